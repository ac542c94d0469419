"""The grouped GEMMs' tile map: which expert, rows and column tile one tile index stands for.

Shape letters: L local experts (one lane each, L_POW2 lanes in all), M rows of a tile, N columns.

Each expert l owns the rows [base_l, base_l + count_l) and the row tiles [tiles_end_l - tiles_l,
tiles_end_l), tiles_l = ceil(count_l / BLOCK_M) (tiles_end: the inclusive cumulative sum), all built on
device from the L counts by the kernels. Tiles are numbered so that GROUP_M row tiles sweep the column
tiles together (a weight tile is read from HBM about once per group, an activation tile once per sweep).
Written in Triton; the Gluon kernel (grouped_gemm_ws.py) calls the same function.
"""
import triton
import triton.language as tl


@triton.jit
def tile_coords(tile, e, base, count, tiles, tiles_end, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """(expert, first row, end row of the expert, column tile) of tile number `tile`.

    e, base, count, tiles, tiles_end: int32 [L_POW2] per expert lane (lanes past L: count 0);
    num_tiles_m = sum(tiles), num_tiles_n = ceil(N / BLOCK_N). Rows from the first row up to BLOCK_M may
    pass the expert's end row: they belong to the next expert (or past R) and must not be stored.
    """
    in_group = GROUP_M * num_tiles_n
    first_m = (tile // in_group) * GROUP_M
    group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % group_size
    pid_n = (tile % in_group) // group_size
    expert = tl.sum((tiles_end <= pid_m).to(tl.int32), 0)
    mine = e == expert
    tile0 = tl.sum(tl.where(mine, tiles_end - tiles, 0), 0)
    row0 = tl.sum(tl.where(mine, base, 0), 0) + (pid_m - tile0) * BLOCK_M
    row_end = tl.sum(tl.where(mine, base + count, 0), 0)
    return expert, row0, row_end, pid_n
