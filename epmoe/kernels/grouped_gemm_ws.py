"""Warp-specialized grouped expert GEMMs for Hopper, in Gluon: gate-up (SiLU-and-mul fused) and down.

Shape letters: L local experts, R rows of the batch, N output columns of one GEMM, K its reduction size,
G = ceil(K / 128) activation scale groups, M rows per expert slot (batched layout).

The GEMMs of `grouped_gemm._grouped_gemm_kernel` (the same tile map, built on device from the L counts
by `tile_map.tile_coords`; the same epilogues; no host sync), with the warps' roles explicit:
- a loader partition walks the program's tiles and streams A [BLOCK_M, BLOCK_K] and B [BLOCK_N, BLOCK_K]
  tiles (gate-up: the gate tile and the up tile) through TMA into a ring of `stages` shared-memory
  stages, each guarded by a `ready` and an `empty` mbarrier;
- consumers issue the wgmma and run the epilogue, on one of two schedules (`SCHEDULES`):
  "cooperative": one consumer of 8 warps (two warp groups, 64 or more rows each) takes every tile;
  "interleaved": two consumers of 4 warps, the ring filled a K block of one's tile then of the other's,
  so that both multiply at once and each one's CUDA-core work (the fp8 promotion) runs beside the
  other's MMAs;
  "split": two consumers of 4 warps sharing every tile, each the wgmma of its half of the rows (a stage
  goes back to the loader when both have arrived on its `empty` mbarrier). The cooperative consumer's
  two warp groups meet at a 256-thread barrier after every wgmma wait (the compiler's), so that they
  promote fp8 block results at the same time and leave the tensor cores idle meanwhile; split
  consumers synchronize only through the ring, so one's promotion may run beside the other's MMAs.
- fp8 block-128: each 128-deep K block is multiplied into a separate fp32 tile and promoted on the CUDA
  cores, acc += tile * a_scale[row] * b_scale. With pipe_mma each K block's successor is issued before
  the block is promoted, so that its promotion overlaps the successor's MMAs; an iteration takes 2-4
  blocks (`pipe_blocks`) and retires them all (ptxas serializes every wgmma when one stays in flight
  across iterations while other instructions read accumulators), so all of its promotions but the
  last overlap MMAs. Without pipe_mma each block is waited for and promoted before the next is issued
  (gate-up: the gate's MMA, then the up's, into one register tile).
With `Meta.swap` (decode sizes; the cooperative and interleaved schedules) each wgmma takes the weights as its
M side and the expert's rows as its N side (B_tile A_tile^T, [block_n, block_m]), so that a tile of 16 rows
fills the 64-row wgmma with weights rather than padding rows; the sums are transposed into the epilogue's
layout after the SiLU-and-mul, and the epilogue is the same.
Tiles go to the programs statically (program p takes tiles p, p + programs, ...) or, with `Meta.claim`
(cooperative schedule), from an atomic counter of the launch: the loader claims a tile when it has queued the
last one's loads and hands its number to the consumer in a slot beside the ring stage of the tile's first K
block, so that the SMs that get more of the memory bandwidth take more tiles; the last program to claim past
the end sets the counter back to zero for the next launch on its stream (`tile_counter`).
A gate-up lets a programmatic dependent launch (a down that follows it: `Meta.gdc_wait`) start as soon as
all of its programs have begun; the down's programs then take idle SMs and those the gate-up's leave, build
their tile map, prefetch their first tiles' weights into L2 (static tiles, not the split schedule; the leading
K columns, `PREFETCH_L2_BYTES` in all), and wait
for the gate-up to end (griddepcontrol.wait) before they claim a tile, load or store.
The epilogue of a tile whose rows all belong to its expert goes through shared memory and one TMA store
(`Meta.tma_store`: 16-bit outputs of the cooperative and split schedules where the buffer fits beside the ring;
the consumer goes on to the next tile's MMAs while the copy engine writes, and waits for it only before
the next such epilogue); the other tiles store from registers with masks: rows past the expert's end
(the next expert's rows, or TMA's zero fill past R) and columns past N are computed but never stored.
Without a TMA store (the fp8 h, the interleaved schedule) a tile goes first through shared memory into a
layout of 16 contiguous bytes of a row a thread (`Meta.store_rows`, where the consumers' tiles fit beside
the ring: `uses_row_stores`), so that a store instruction writes 16 bytes and not the wgmma layout's 2
columns: the fp8 MLP 1.00-1.12x on an H100 (BENCHMARKS.md, experts).

A gate-up may read its rows through a row index (`Meta.gather`: row i of the batch is A[a_rows[i]], the
contiguous layout): TMA cannot gather rows, so there the loader's threads copy A's tiles with cp.async,
one 16-byte piece each at a time, rows past the expert's end zero-filled, and arrive on the stage's
`ready` mbarrier once their copies land (it counts the TMA expect and every loader thread); B still
comes by TMA. The consumers fence the generic-proxy writes before their wgmma read them.
Runs only on a Hopper GPU (Gluon has no interpreter); `grouped_gemm` launches it (`launch`) for launch
configs with `warp_specialize` set where `supported` says it can.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..config import FP8_BLOCK
from ..quant import FP8_DTYPE, num_groups
from .configs import CLAIM_MAX_STAGES, SHARED_BYTES, swap_scratch_bytes
from .quant import FP8_MAX_C, MIN_AMAX_C
from .tile_map import tile_coords

SCHEDULES = {"cooperative": 0, "interleaved": 1, "split": 2}
# Warps of the loader (one thread issues its TMA copies; four warps share out the tile map's lanes),
# registers per thread of the loader and of the second consumer; the first consumer (the default
# partition) gets what is left of the block's budget, 65536 registers over the three warp groups.
LOADER_WARPS = gl.constexpr(4)
LOADER_REGS = gl.constexpr(56)
CONSUMER_REGS = gl.constexpr(224)
# A loader that gathers 16-bit rows (cp.async) holds each tile's source rows and the pieces' addresses: 56
# registers spill there (ptxas of triton 3.6), so it takes 80 and the second consumer 216; the fp8 gathers
# keep 56 (their consumers spill with fewer than 224).
GATHER_LOADER_REGS = gl.constexpr(80)
GATHER_CONSUMER_REGS = gl.constexpr(216)
# A split consumer holds the fp8 gate-up's three 64x128 fp32 tiles: with 224 registers it spills (ptxas of
# triton 3.6 and 3.9), with 232 not; a loader that does not gather needs 48 (one that gathers fp8 rows
# spills with 48: split fp8 gate-ups through a row index are not offered).
SPLIT_LOADER_REGS = gl.constexpr(48)
SPLIT_CONSUMER_REGS = gl.constexpr(232)
# Registers per thread the kernel is compiled for: the 65536 over its 12 warps (8 consumer warps and the
# loader's 4); setmaxnreg then moves them from the loader to the consumers.
_MAX_REGISTERS = (65536 // (12 * 32)) // 8 * 8
# The tile map holds one lane per local expert in every partition.
MAX_EXPERTS = 256
_MIN_EXPERT_LANES = 128
_SCALE_GROUP = gl.constexpr(FP8_BLOCK)
# A dependent down's L2 prefetch, all of its programs together, reads at most this many bytes of weights
# (the leading K columns of each program's first tiles): about a quarter of the H200's 60 MB L2. Uncapped,
# Mixtral-8x7B's fp8 decode down (K 14336, 256 tiles at up to 64 rows per expert) prefetched all 470 MB of
# its weights while the gate-up streamed its own; that down ran 8-10% slower as a dependent launch than
# after a plain one (one H200, 2026-12-05).
PREFETCH_L2_BYTES = gl.constexpr(16 << 20)
MAX_CLAIM_STAGES = gl.constexpr(CLAIM_MAX_STAGES)  # a launch with claimed tiles: its tile-number slots
PIPE_BLOCKS = (4, 3, 2)  # K blocks per iteration the pipelined fp8 down loop may take (`pipe_blocks`)

# TMA tile load into shared memory, signalling an mbarrier: `async_load` in newer Tritons, which removed
# triton 3.6's `async_copy_global_to_shared`.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# A barrier of the partition's warps: `barrier` in newer Tritons, `thread_barrier` in triton 3.6.
_partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# cp.async of a pointer tile into shared memory: `async_load` in newer Tritons (which keep the old name only
# to raise), `async_copy_global_to_shared` in triton 3.6.
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# Threads that arrive on a gathering stage's `ready` mbarrier besides the TMA expect: every loader thread.
_GATHER_ARRIVALS = LOADER_WARPS * 32
_COPY_BYTES = 16  # one cp.async piece
_tile_coords = gluon.jit(tile_coords.fn)

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, FP8_DTYPE: gl.float8e4nv}


@dataclass(frozen=True)
class Meta:
    """What one launch compiles for (a constexpr of the kernel and of every partition)."""

    schedule: int  # SCHEDULES
    batched: bool
    gather: bool  # A's rows through a row index (cp.async loads; contiguous layout, gate-up)
    gate_up: bool
    fp8: bool
    pipe_blocks: int  # fp8 with pipe_mma: K blocks per main-loop iteration (`pipe_blocks`); else 0
    quant_out: bool  # gate-up fp8: h quantized in the epilogue (block_n == 128)
    tma_store: bool  # full tiles' outputs through shared memory and a TMA store (`uses_tma_store`)
    store_rows: bool  # tiles stored from registers go through rows of 16 bytes a thread (`uses_row_stores`)
    has_row_scale: bool
    lanes: int  # expert lanes of the tile map: a power of two >= L
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    stages: int
    claim: bool = False  # tiles from the launch's counter (cooperative schedule; `tile_counter`)
    gdc_wait: bool = False  # launched as a programmatic dependent: every partition waits after its tile map
    swap: bool = False  # the weights on the wgmma's M side (`GemmConfig.swap_ab`; not the split schedule)
    row_off: int = 0  # split: the first row of a tile this consumer multiplies (`for_consumer`)

    def for_consumer(self, consumer: int) -> "Meta":
        """The Meta of one of two consumers: split, the second takes a tile's rows from block_m / 2 on;
        interleaved, both take whole tiles."""
        return dataclasses.replace(self, row_off=consumer * self.block_m // 2 if self.schedule == 2 else 0)


@gluon.constexpr_function
def _consumer_meta(meta, consumer):
    # (a method call: the jit rejects a constexpr function whose body names dataclasses.replace)
    return meta.for_consumer(consumer)


@gluon.constexpr_function
def _mma_layout(block_m, block_n, num_warps, bitwidth):
    """The wgmma accumulator layout: warps along M while each gets 16 rows, then along N."""
    warps = [num_warps, 1] if block_m >= 16 * num_warps else [4, num_warps // 4]
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps,
                                     instr_shape=[16, min(block_n // warps[1], 256), 256 // bitwidth])


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _pinned(x):
    """x through an empty asm statement with side effects, so that LLVM computes x before the next wgmma
    is issued (sunk below it, the promotion would keep registers that wgmma overwrites alive past its
    issue, and ptxas would serialize every wgmma)."""
    return gl.inline_asm_elementwise("", "=f,0", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _tile_map(index_ptr, L, SLOT_ROWS, META: gl.constexpr):
    """Per expert lane, in this partition's warps: (lane, first row, rows, row tiles, cumulative row tiles)."""
    W: gl.constexpr = gl.num_warps()
    LANES: gl.constexpr = META.lanes  # (shapes take constexprs: triton 3.6 does not make a field one)
    layout: gl.constexpr = gl.BlockedLayout([max(LANES // (32 * W), 1)], [32], [W], [0])
    e = gl.arange(0, LANES, layout=layout)
    e_mask = e < L
    if META.batched:
        count = gl.load(index_ptr + e, mask=e_mask, other=0)
        base = e * SLOT_ROWS
    else:
        base = gl.load(index_ptr + e, mask=e_mask, other=0)
        count = gl.load(index_ptr + e + 1, mask=e_mask, other=0) - base
    tiles = (count + META.block_m - 1) // META.block_m
    return e, base, count, tiles, gl.associative_scan(tiles, 0, _add)


@gluon.jit
def _gdc_wait(META: gl.constexpr):
    """A programmatic dependent launch (`Meta.gdc_wait`): wait until the grid before it has ended and its
    writes are visible (griddepcontrol.wait); before it a partition reads only the tile map's counts (and the
    loader prefetches weights)."""
    if META.gdc_wait:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_weights(tile, total, tile_map, args, META: gl.constexpr, TILES: gl.constexpr):
    """Prefetch the weight rows a down's tile multiplies into L2, their leading K columns up to this program's
    share of `PREFETCH_L2_BYTES` (TILES: the tiles each program prefetches), a 128-byte line a thread at a
    time (a dependent launch's loader, before its wait: the weights are not the kernel before's output)."""
    L, N, K, b_ptr = args[6], args[9], args[10], args[18]
    ELEMENT_BYTES: gl.constexpr = b_ptr.dtype.element_ty.primitive_bitwidth // 8
    share = PREFETCH_L2_BYTES // (gl.num_programs(0) * TILES * META.block_n * ELEMENT_BYTES)  # K columns
    # No branch on tile < total (a branch here led the compiler to copy the wait after it into both paths):
    # past the last tile, no lines.
    _, b_row, _ = _tile_source(gl.minimum(tile, total - 1), tile_map, args, META)
    LINE: gl.constexpr = 128 * 8 // b_ptr.dtype.element_ty.primitive_bitwidth  # elements a line
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    rows = b_row + gl.arange(0, META.block_n, layout=layout)
    # (a last column tile past N: rows of the next expert, or none past B)
    starts = b_ptr + gl.maximum(gl.minimum(rows, L * N - 1), 0).to(gl.int64) * K
    for k0 in range(0, gl.minimum(K, share) * (tile < total).to(gl.int32), LINE):
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [starts + k0], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _k_steps(K, META: gl.constexpr):
    """Ring steps per tile: the K blocks, rounded up to a multiple of `Meta.pipe_blocks` for the pipelined
    fp8 loop (its padding steps reload the last block and weigh it zero)."""
    k_tiles = gl.cdiv(K, META.block_k)
    if META.pipe_blocks:
        k_tiles = gl.cdiv(k_tiles, META.pipe_blocks) * META.pipe_blocks
    return k_tiles


@gluon.jit
def _ring_slot(j, steps, META: gl.constexpr):
    """(first ring position, stride) of the K blocks of this program's j-th tile: tile after tile
    (cooperative), or (interleaved) the two tiles of a pair alternating block by block, consumer c on the
    positions c mod 2, and so a pair's lone tile (the program's last) too, the odd positions beside it
    left empty. With an even count of stages (the kernel asserts it) each consumer so keeps its own
    stages, and its wait on a stage follows its own wait on the stage's fill before: an mbarrier tells only
    its phase's parity, and a lone tile on consecutive positions waited on stages whose fill for the other
    consumer could still be landing; such a wait passed at once (DeepSeek-V3's fp8 down on H100s: "Warp
    Illegal Instruction" at the loader's arrive on the stage after the early release, or a wrong result)."""
    pos0 = j * steps
    stride = pos0 * 0 + 1
    if META.schedule == 1:
        pos0 = (j // 2) * 2 * steps + j % 2
        stride = stride * 2
    return pos0, stride


@gluon.jit
def _post_tile(ring, pos, tile, META: gl.constexpr):
    """Loader: wait until ring position pos's stage is free, then write tile (-1: no more) into its slot; the
    stage's `ready` arrival publishes it. The loader's warps meet first, so that none writes a slot late."""
    s = pos % META.stages
    mbarrier.wait(ring[4].index(s), ((pos // META.stages) & 1) ^ 1)
    _partition_barrier()
    ring[5].index(s).store(gl.full([1], tile, gl.int32, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0])))


@gluon.jit
def _read_tile(ring, pos, META: gl.constexpr):
    """Consumer: the tile number the loader wrote for ring position pos, once its stage is ready."""
    s = pos % META.stages
    mbarrier.wait(ring[3].index(s), (pos // META.stages) & 1)
    return gl.max(ring[5].index(s).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), 0)


@gluon.constexpr_function
def _copy_layout(block_k, element_bits, num_warps):
    """The loader's layout of a gathered A tile [block_m, block_k]: 16-byte pieces along K, a row's pieces
    on neighbouring lanes, warps along M."""
    vec = _COPY_BYTES * 8 // element_bits
    lanes_k = min(max(block_k // vec, 1), 32)
    return gl.BlockedLayout([1, vec], [32 // lanes_k, lanes_k], [num_warps, 1], [1, 0])


@gluon.jit
def _gather_rows(a_ptr, a_rows_ptr, row0, row_end, META: gl.constexpr):
    """(source row, live) of a gathered tile's rows, in the copy layout's row slice: a_rows[row] for the
    expert's rows, live False past its end (those pieces are zero-filled)."""
    layout: gl.constexpr = _copy_layout(META.block_k, a_ptr.dtype.element_ty.primitive_bitwidth, gl.num_warps())
    offs_m = row0 + gl.arange(0, META.block_m, layout=gl.SliceLayout(1, layout))
    live = offs_m < row_end
    return gl.load(a_rows_ptr + offs_m, mask=live, other=0).to(gl.int64), live


@gluon.jit
def _load_block(a_desc, b_desc, ring, pos, row0, b_row, k0, N, gathered, META: gl.constexpr):
    """Ring position pos <- A[row0:, k0:] (gather: A[src, k0:] of gathered = (a_ptr, K, src rows, live),
    by cp.async) and B[b_row:, k0:] (gate-up: and B[b_row + N:, k0:])."""
    a_bufs, b_bufs, bu_bufs, ready, empty = ring[0], ring[1], ring[2], ring[3], ring[4]
    s = pos % META.stages
    # A fresh mbarrier counts as having completed the phase before phase 0: the first pass over the ring
    # does not wait.
    mbarrier.wait(empty.index(s), ((pos // META.stages) & 1) ^ 1)
    bar = ready.index(s)
    b_bytes: gl.constexpr = b_desc.block_type.nbytes * (2 if META.gate_up else 1)
    if META.gather:
        mbarrier.expect(bar, b_bytes)
    else:
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_bytes)
        _tma_load(a_desc, [row0, k0], bar, a_bufs.index(s))
    _tma_load(b_desc, [b_row, k0], bar, b_bufs.index(s))
    if META.gate_up:
        _tma_load(b_desc, [b_row + N, k0], bar, bu_bufs.index(s))
    if META.gather:
        a_ptr, K, src, live = gathered
        layout: gl.constexpr = _copy_layout(META.block_k, a_ptr.dtype.element_ty.primitive_bitwidth,
                                            gl.num_warps())
        offs_k = k0 + gl.arange(0, META.block_k, layout=gl.SliceLayout(0, layout))
        ptrs = a_ptr + src[:, None] * K + offs_k[None, :]
        _cp_async(a_bufs.index(s), ptrs, mask=live[:, None])  # (K a multiple of block_k: `supported`)
        async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _gathered(a_ptr, a_rows_ptr, K, row0, row_end, META: gl.constexpr):
    """What `_load_block` reads A's rows of a tile by: (a_ptr, K, source rows, live) with `Meta.gather`,
    else placeholders it ignores (TMA reads rows row0..)."""
    if META.gather:
        src, live = _gather_rows(a_ptr, a_rows_ptr, row0, row_end, META)
    else:
        src, live = row0, row0 < row_end
    return a_ptr, K, src, live


@gluon.jit
def _tile_source(tile, tile_map, args, META: gl.constexpr):
    """Where the loader reads a tile's blocks from: (A's first row, B's first row, `_gathered`'s rows)."""
    N, K, a_ptr, a_rows_ptr = args[9], args[10], args[15], args[16]
    e, base, count, tiles, tiles_end, num_tiles_m, num_tiles_n = tile_map
    expert, row0, row_end, pid_n = _tile_coords(tile, e, base, count, tiles, tiles_end, num_tiles_m, num_tiles_n,
                                                META.group_m, META.block_m)
    b_row = expert * (2 if META.gate_up else 1) * N + pid_n * META.block_n
    return row0, b_row, _gathered(a_ptr, a_rows_ptr, K, row0, row_end, META)


@gluon.jit
def _load_tile(a_desc, b_desc, ring, pos, tile, tile_map, args, META: gl.constexpr):
    """The loader: the K blocks of one tile into the ring from position pos on (claimed tiles: its number
    into the slot of pos first); returns the position after them."""
    N, K = args[9], args[10]
    row0, b_row, gathered = _tile_source(tile, tile_map, args, META)
    if META.claim:
        _post_tile(ring, pos, tile, META)
    k_tiles = gl.cdiv(K, META.block_k)
    for kk in range(_k_steps(K, META)):
        _load_block(a_desc, b_desc, ring, pos, row0, b_row, gl.minimum(kk, k_tiles - 1) * META.block_k, N, gathered,
                    META)
        pos += 1
    return pos


@gluon.jit
def _ws_load(a_desc, b_desc, ring, args, META: gl.constexpr):
    """The loader: the K blocks of this program's tiles into the ring, in ring order."""
    index_ptr, L, SLOT_ROWS, N, K, counter_ptr = args[5], args[6], args[7], args[9], args[10], args[17]
    e, base, count, tiles, tiles_end = _tile_map(index_ptr, L, SLOT_ROWS, META)
    num_tiles_m = gl.sum(tiles, 0)
    num_tiles_n = gl.cdiv(N, META.block_n)
    total = num_tiles_m * num_tiles_n
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    k_tiles = gl.cdiv(K, META.block_k)
    steps = _k_steps(K, META)
    tile_map = (e, base, count, tiles, tiles_end, num_tiles_m, num_tiles_n)
    if META.gdc_wait:
        # this program's first tiles' weights into L2 while the kernel before ends (not the claimed tiles,
        # unknown until after the wait; not the split schedule's, whose 48-register loader then spills 8 B
        # under triton 3.6 with the fp8 down's 4 K blocks an iteration)
        if not META.claim and META.schedule != 2:
            if META.schedule == 1:
                _prefetch_weights(pid, total, tile_map, args, META, 2)
                _prefetch_weights(pid + nprog, total, tile_map, args, META, 2)
            else:
                _prefetch_weights(pid, total, tile_map, args, META, 1)
        _gdc_wait(META)
    if META.schedule == 1:
        n_mine = gl.cdiv(gl.maximum(total - pid, 0), nprog)
        for p in range(gl.cdiv(n_mine, 2)):
            tile = pid + 2 * p * nprog
            full = 2 * p + 1 < n_mine
            row0, b_row, gathered = _tile_source(tile, tile_map, args, META)
            row2, b_row2, gathered2 = _tile_source(tile + nprog * full.to(gl.int32), tile_map, args, META)
            pos = 2 * p * steps
            for kk in range(steps):  # (`_ring_slot`: a lone tile's odd positions stay empty)
                k0 = gl.minimum(kk, k_tiles - 1) * META.block_k  # a padding step reloads the last block
                _load_block(a_desc, b_desc, ring, pos, row0, b_row, k0, N, gathered, META)
                if full:
                    _load_block(a_desc, b_desc, ring, pos + 1, row2, b_row2, k0, N, gathered2, META)
                pos += 2
    elif META.claim:
        pos = 0
        tile = gl.atomic_add(counter_ptr, 1)
        while tile < total:
            pos = _load_tile(a_desc, b_desc, ring, pos, tile, tile_map, args, META)
            tile = gl.atomic_add(counter_ptr, 1)
        _post_tile(ring, pos, -1, META)
        bar = ring[3].index(pos % META.stages)
        mbarrier.arrive(bar)
        if META.gather:  # a gathering stage's `ready` counts every loader thread too (none has a copy pending)
            async_copy.mbarrier_arrive(bar, increment_count=False)
        # Every program claims past the end once, then counts itself done: the last one resets the counter
        # (before the grid ends: a next launch that programmatic dependent launch let start early could claim
        # before this store).
        if gl.atomic_add(counter_ptr + 1, 1) == nprog - 1:
            gl.store(counter_ptr, 0)
            gl.store(counter_ptr + 1, 0)
    else:
        pos = 0
        for tile in range(pid, total, nprog):
            pos = _load_tile(a_desc, b_desc, ring, pos, tile, tile_map, args, META)


@gluon.jit
def _issue(ring, pos, t, UP: gl.constexpr, USE_ACC: gl.constexpr, META: gl.constexpr):
    """Wait for ring position pos, then issue t (+)= A B^T (UP: B's up tile; swap: t (+)= B A^T) of its
    stage, not waiting for the wgmma (split: the consumer's rows of A, from `Meta.row_off`)."""
    a_bufs, b_bufs, bu_bufs, ready = ring[0], ring[1], ring[2], ring[3]
    s = pos % META.stages
    mbarrier.wait(ready.index(s), (pos // META.stages) & 1)
    if META.gather:
        fence_async_shared()  # the loader's cp.async wrote A through the generic proxy; wgmma reads by the async one
    b = bu_bufs.index(s) if UP else b_bufs.index(s)
    a = a_bufs.index(s)
    if META.schedule == 2:
        a = a.slice(META.row_off, META.block_m // 2)
    if META.swap:
        t = warpgroup_mma(b, a.permute((1, 0)), t, use_acc=USE_ACC, is_async=True)
    else:
        t = warpgroup_mma(a, b.permute((1, 0)), t, use_acc=USE_ACC, is_async=True)
    return t


@gluon.jit
def _release(ring, pos, pred, META: gl.constexpr):
    """Hand ring position pos's stage back to the loader (its wgmma are done)."""
    mbarrier.arrive(ring[4].index(pos % META.stages), pred=pred)


@gluon.jit
def _mainloop_16bit(ring, pos0, stride, k_tiles, zero, META: gl.constexpr):
    """acc (and acc_up) over all K blocks; each block's wgmma stays in flight while the next is issued,
    and its stage is released once it is done."""
    acc = zero
    acc_up = zero
    for kk in range(k_tiles):
        pos = pos0 + kk * stride
        acc = _issue(ring, pos, acc, False, True, META)
        if META.gate_up:
            acc_up = _issue(ring, pos, acc_up, True, True, META)
            acc, acc_up = warpgroup_mma_wait(2, deps=(acc, acc_up))
        else:
            acc = warpgroup_mma_wait(1, deps=(acc, ))
        _release(ring, pos + META.stages - stride, kk > 0, META)
    if META.gate_up:
        acc, acc_up = warpgroup_mma_wait(0, deps=(acc, acc_up))
    else:
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    _release(ring, pos0 + (k_tiles - 1) * stride, True, META)
    return acc, acc_up


@gluon.jit
def _block_scale(a_scale_ptrs, b_scale_at, kk, k_tiles):
    """a_scale * b_scale of K block kk per row; zero for a padding step past the last block."""
    g = gl.minimum(kk, k_tiles - 1)
    return gl.load(a_scale_ptrs + g) * (gl.load(b_scale_at + g) * (kk < k_tiles).to(gl.float32))


@gluon.jit
def _scaled(t, s, META: gl.constexpr):
    """A block result t times its rows' scales s (t's rows, or with `Meta.swap` its columns)."""
    if META.swap:
        out = t * s[None, :]
    else:
        out = t * s[:, None]
    return out


@gluon.jit
def _mainloop_fp8_serial(ring, pos0, stride, k_tiles, zero, a_scale_ptrs, b_scale_at, up_scale_at,
                         META: gl.constexpr):
    """fp8 acc over all K blocks, each block's wgmma (gate-up: the gate's, then the up's, into the same
    registers) waited for and promoted before the next is issued."""
    acc = zero
    acc_up = zero
    t = zero
    for kk in range(k_tiles):
        pos = pos0 + kk * stride
        s = _block_scale(a_scale_ptrs, b_scale_at, kk, k_tiles)
        if META.gate_up:
            s_up = _block_scale(a_scale_ptrs, up_scale_at, kk, k_tiles)
        t = warpgroup_mma_wait(0, deps=(_issue(ring, pos, t, False, False, META), ))
        acc = _pinned(acc + _scaled(t, s, META))
        if META.gate_up:
            t = warpgroup_mma_wait(0, deps=(_issue(ring, pos, t, True, False, META), ))
            acc_up = _pinned(acc_up + _scaled(t, s_up, META))
        _release(ring, pos, True, META)
    return acc, acc_up


@gluon.jit
def _issue_block(ring, pos, t, u, META: gl.constexpr):
    """Issue ring position pos's block products t = A B^T (gate-up: and u = A B_up^T), not waiting."""
    t = _issue(ring, pos, t, False, False, META)
    if META.gate_up:
        u = _issue(ring, pos, u, True, False, META)
    return t, u


@gluon.jit
def _mainloop_fp8_pipelined(ring, pos0, stride, k_tiles, steps, zero, a_scale_ptrs, b_scale_at, up_scale_at,
                            META: gl.constexpr):
    """fp8 acc over all K blocks, `Meta.pipe_blocks` per iteration with two blocks' wgmma in flight: each
    block's successor is issued before it is waited for and promoted (its promotion overlaps the
    successor's MMAs), the two block results taking turns in two register tiles; an iteration's last
    block is promoted with nothing in flight, so that no wgmma crosses iterations."""
    U: gl.constexpr = META.pipe_blocks
    acc = zero
    acc_up = zero
    t_a = zero
    u_a = zero
    t_b = zero
    u_b = zero
    for kk in range(0, steps, U):
        pos = pos0 + kk * stride
        t_a, u_a = _issue_block(ring, pos, t_a, u_a, META)
        for i in gl.static_range(U):
            s = _block_scale(a_scale_ptrs, b_scale_at, kk + i, k_tiles)
            if META.gate_up:
                s_up = _block_scale(a_scale_ptrs, up_scale_at, kk + i, k_tiles)
            if i + 1 < U:
                t_b, u_b = _issue_block(ring, pos + (i + 1) * stride, t_b, u_b, META)
                if META.gate_up:  # this block's two wgmma done, the successor's two in flight
                    t_a, u_a, t_b, u_b = warpgroup_mma_wait(2, deps=(t_a, u_a, t_b, u_b))
                else:
                    t_a, t_b = warpgroup_mma_wait(1, deps=(t_a, t_b))
            elif META.gate_up:
                t_a, u_a = warpgroup_mma_wait(0, deps=(t_a, u_a))
            else:
                t_a = warpgroup_mma_wait(0, deps=(t_a, ))
            _release(ring, pos + i * stride, True, META)
            acc = _pinned(acc + _scaled(t_a, s, META))
            if META.gate_up:
                acc_up = _pinned(acc_up + _scaled(u_a, s_up, META))
            t_a, t_b = t_b, t_a
            u_a, u_b = u_b, u_a
    return acc, acc_up


@gluon.jit
def _store_masked(c_ptr, acc, offs_m, offs_n, m_mask, N):
    """acc's rows below the expert's end and columns below N into C [R, N] from registers."""
    c_ptrs = c_ptr + offs_m.to(gl.int64)[:, None] * N + offs_n[None, :]
    gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n < N)[None, :])


@gluon.jit
def _store_tile(c_ptr, acc, row0, row_end, col0, N, META: gl.constexpr):
    """acc [rows, columns] from registers into C [R, N] at (row0, col0), its rows below row_end and columns
    below N; with `Meta.store_rows` from a layout whose threads hold 16 contiguous bytes of a row each (acc
    moved there through shared memory): one store instruction writes them, where the wgmma layout holds 2
    contiguous columns a thread."""
    if META.store_rows:
        W: gl.constexpr = gl.num_warps()
        VEC: gl.constexpr = 128 // c_ptr.dtype.element_ty.primitive_bitwidth
        COLS: gl.constexpr = META.block_n // VEC  # threads along a row
        rows: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // COLS, COLS], [W, 1], [1, 0])
        acc = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), rows)
    layout: gl.constexpr = acc.type.layout
    offs_m = row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    offs_n = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    _store_masked(c_ptr, acc, offs_m, offs_n, offs_m < row_end, N)


@gluon.jit
def _ws_consume(ring, args, out, CONSUMER: gl.constexpr, META: gl.constexpr):
    """A consumer: the MMAs and the epilogue of this program's tiles CONSUMER, CONSUMER + CONSUMERS, ...
    (out: C's TMA descriptor and the shared buffer of its tiles, with `Meta.tma_store`)."""
    (a_scale_ptr, b_scale_ptr, c_ptr, c_scale_ptr, row_scale_ptr, index_ptr, L, SLOT_ROWS, R, N, K, stride_bsl,
     stride_bsn, G_A, G_C, a_ptr, a_rows_ptr, counter_ptr, b_ptr) = args
    W: gl.constexpr = gl.num_warps()
    BITS: gl.constexpr = ring[0].dtype.primitive_bitwidth
    BLOCK_M: gl.constexpr = META.block_m
    BLOCK_N: gl.constexpr = META.block_n
    SPLIT: gl.constexpr = META.schedule == 2
    TILE_M: gl.constexpr = BLOCK_M // 2 if SPLIT else BLOCK_M  # the rows this consumer multiplies
    ROW_OFF: gl.constexpr = META.row_off  # their first, within a tile
    # The sums' layout (swap: [BLOCK_N, TILE_M]) and the epilogue's ([TILE_M, BLOCK_N]; swap: rows of 8
    # contiguous columns a thread, the sums transposed into it).
    if META.swap:
        mma: gl.constexpr = _mma_layout(BLOCK_N, TILE_M, W, BITS)
        epi: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])
    else:
        mma: gl.constexpr = _mma_layout(TILE_M, BLOCK_N, W, BITS)
        epi: gl.constexpr = mma
    rows_l: gl.constexpr = gl.SliceLayout(1, epi)
    # the tile's rows along the sums (their fp8 scales)
    sum_rows_l: gl.constexpr = gl.SliceLayout(0, mma) if META.swap else rows_l
    CONSUMERS: gl.constexpr = 2 if META.schedule == 1 else 1  # tiles a consumer steps by
    FIRST: gl.constexpr = CONSUMER if META.schedule == 1 else 0

    e, base, count, tiles, tiles_end = _tile_map(index_ptr, L, SLOT_ROWS, META)
    _gdc_wait(META)
    num_tiles_m = gl.sum(tiles, 0)
    num_tiles_n = gl.cdiv(N, META.block_n)
    total = num_tiles_m * num_tiles_n
    k_tiles = gl.cdiv(K, META.block_k)
    steps = _k_steps(K, META)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_mine = gl.cdiv(gl.maximum(total - pid, 0), nprog)
    if META.swap:
        zero = gl.zeros((BLOCK_N, TILE_M), gl.float32, layout=mma)
    else:
        zero = gl.zeros((TILE_M, BLOCK_N), gl.float32, layout=mma)
    j = FIRST
    if META.claim:  # n_mine: the tiles known so far (one more while the loader hands out tiles)
        tile = _read_tile(ring, 0, META)
        n_mine = (tile >= 0).to(gl.int32)
    else:
        tile = pid + FIRST * nprog
    while j < n_mine:
        expert, row0, row_end, pid_n = _tile_coords(tile, e, base, count, tiles, tiles_end,
                                                    num_tiles_m, num_tiles_n, META.group_m, META.block_m)
        pos0, stride = _ring_slot(j, steps, META)
        offs_m = row0 + ROW_OFF + gl.arange(0, TILE_M, layout=rows_l)
        m_mask = offs_m < row_end
        if META.fp8:
            sum_rows = row0 + ROW_OFF + gl.arange(0, TILE_M, layout=sum_rows_l)
            rows_a = gl.minimum(sum_rows, R - 1).to(gl.int64)  # rows past the expert's end: read, never stored
            if META.gather:
                rows_a = gl.load(a_rows_ptr + rows_a, mask=sum_rows < row_end, other=0).to(gl.int64)
            a_scale_ptrs = a_scale_ptr + rows_a * G_A
            b_scale_at = (b_scale_ptr + expert.to(gl.int64) * stride_bsl
                          + (pid_n * META.block_n // _SCALE_GROUP) * stride_bsn)
            up_scale_at = b_scale_at + (N // _SCALE_GROUP) * stride_bsn
            if META.pipe_blocks:
                acc, acc_up = _mainloop_fp8_pipelined(ring, pos0, stride, k_tiles, steps, zero, a_scale_ptrs,
                                                      b_scale_at, up_scale_at, META)
            else:
                acc, acc_up = _mainloop_fp8_serial(ring, pos0, stride, k_tiles, zero, a_scale_ptrs, b_scale_at,
                                                   up_scale_at, META)
        else:
            acc, acc_up = _mainloop_16bit(ring, pos0, stride, k_tiles, zero, META)

        if META.gate_up:
            acc = acc / (1.0 + gl.exp(-acc)) * acc_up
        if META.swap:
            acc = gl.convert_layout(gl.permute(acc, (1, 0)), epi)
        if META.has_row_scale:
            acc = acc * gl.load(row_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
        if META.quant_out:
            # One scale group per column tile (block_n == 128, N a multiple of it), as `quantize_act`.
            scale = gl.div_rn(gl.maximum(gl.max(gl.abs(acc), axis=1), MIN_AMAX_C), FP8_MAX_C)
            q = gl.minimum(gl.maximum(gl.div_rn(acc, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
            gl.store(c_scale_ptr + offs_m.to(gl.int64) * G_C + pid_n, scale, mask=m_mask)
            _store_tile(c_ptr, q, row0 + ROW_OFF, row_end, pid_n * BLOCK_N, N, META)
        elif META.tma_store:
            c_desc, c_smem = out
            if SPLIT:
                c_smem = c_smem.index(CONSUMER)
            if row0 + ROW_OFF + TILE_M <= row_end:
                tma.store_wait(0)  # the last tile's store has read the buffer (its issuing thread waits) ...
                _partition_barrier()  # ... before any warp writes it again
                c_smem.store(acc.to(c_desc.dtype))
                fence_async_shared()
                _tma_store(c_desc, [row0 + ROW_OFF, pid_n * BLOCK_N], c_smem)  # columns past N: clipped by TMA
            else:
                _store_tile(c_ptr, acc, row0 + ROW_OFF, row_end, pid_n * BLOCK_N, N, META)
        else:
            _store_tile(c_ptr, acc, row0 + ROW_OFF, row_end, pid_n * BLOCK_N, N, META)
        j += CONSUMERS
        if META.claim:
            tile = _read_tile(ring, j * steps, META)
            n_mine = j + (tile >= 0).to(gl.int32)
        else:
            tile = pid + j * nprog
    if META.tma_store:
        tma.store_wait(0)


# Sizes that do not shape the code are not specialized on (one binary serves every expert count).
@gluon.jit(do_not_specialize=["L", "SLOT_ROWS", "R", "stride_bsl", "stride_bsn", "G_A", "G_C"])
def _ws_gemm_kernel(a_desc, b_desc, c_desc, a_ptr, a_rows_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
                    c_scale_ptr, row_scale_ptr, index_ptr, counter_ptr, L, SLOT_ROWS, R, N, K, stride_bsl,
                    stride_bsn, G_A, G_C, META: gl.constexpr):
    """C[rows of l] = A[rows of l] @ B[l]^T (gate-up: silu(A B_gate^T) * (A B_up^T), B_up = rows N.. of
    B[l]), as `grouped_gemm._grouped_gemm_kernel`: A through a_desc ([R, K], block [block_m, block_k]),
    or with `Meta.gather` A [S, K] at a_ptr, row i of the batch A[a_rows[i]] (a_desc then only gives the
    tiles' shape and shared layout); B through b_desc (B as [L * N (x2), K], block [block_n, block_k]),
    C [R, N] by pointers, and with `Meta.tma_store` full tiles through c_desc (block [block_m, block_n],
    split: [block_m / 2, block_n]; else any descriptor, unread); counter_ptr: int32 [2], the launch's tile
    counter and its programs done, zero at the start (`Meta.claim`; else unread)."""
    gl.static_assert(not META.gather or (META.gate_up and not META.batched), "a row index is for the gate-up, "
                     "contiguous layout")
    gl.static_assert(not META.fp8 or META.block_k == _SCALE_GROUP, "fp8 needs block_k == 128 (one scale group)")
    gl.static_assert(not META.fp8 or _SCALE_GROUP % META.block_n == 0, "fp8 needs block_n to divide 128")
    gl.static_assert(not META.quant_out or (META.gate_up and META.fp8 and META.block_n == _SCALE_GROUP),
                     "fp8 h output needs the gate-up fp8 kernel with block_n == 128")
    gl.static_assert(META.schedule == 0 or gl.num_warps() == 4, "two consumers have 4 warps each")
    gl.static_assert(META.schedule != 1 or META.stages % 2 == 0, "interleaved consumers: an even count of stages")
    gl.static_assert(not META.tma_store or (META.schedule != 1 and not META.quant_out),
                     "TMA stores: the cooperative and split schedules' 16-bit outputs")
    gl.static_assert(META.schedule != 2 or META.block_m >= 128, "split consumers take 64 rows or more each")
    gl.static_assert(not META.claim or (META.schedule == 0 and META.stages <= MAX_CLAIM_STAGES),
                     "claimed tiles: the cooperative schedule, at most MAX_CLAIM_STAGES stages")
    gl.static_assert(not (META.gdc_wait and META.gate_up), "a programmatic dependent launch is a down")
    gl.static_assert(not META.swap or (META.schedule != 2 and META.block_n >= 16 * gl.num_warps()),
                     "swapped products: not split, block_n rows of weights for every warp's 16")
    if META.gate_up:  # a programmatic dependent launch (the down) may start once every program has begun
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    STAGES: gl.constexpr = META.stages  # (shapes take constexprs: triton 3.6 does not make a field one)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    if META.gate_up:
        bu_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    else:
        bu_bufs = b_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1 + (_GATHER_ARRIVALS if META.gather else 0))
        mbarrier.init(empty.index(i), count=2 if META.schedule == 2 else 1)  # split: both consumers
    # The inits made visible to the async proxy, whose TMA copies complete their bytes on them, as the CUDA
    # programming guide's TMA example does (fence.proxy.async after mbarrier.init).
    fence_async_shared()
    if META.claim:  # a tile-number slot per stage
        ids = gl.allocate_shared_memory(gl.int32, [MAX_CLAIM_STAGES, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    else:
        ids = ready  # (unread)
    ring = (a_bufs, b_bufs, bu_bufs, ready, empty, ids)
    if META.tma_store:  # split: a buffer per consumer
        shape: gl.constexpr = ([2] if META.schedule == 2 else []) + c_desc.block_type.shape
        out = (c_desc, gl.allocate_shared_memory(c_desc.dtype, shape, c_desc.layout))
    else:
        out = (c_desc, a_bufs)  # (unread)
    args = (a_scale_ptr, b_scale_ptr, c_ptr, c_scale_ptr, row_scale_ptr, index_ptr, L, SLOT_ROWS, R, N, K,
            stride_bsl, stride_bsn, G_A, G_C, a_ptr, a_rows_ptr, counter_ptr, b_ptr)
    loader_regs: gl.constexpr = (GATHER_LOADER_REGS if META.gather and not META.fp8 else
                                 SPLIT_LOADER_REGS if META.schedule == 2 and not META.gather else LOADER_REGS)
    if META.schedule == 0:
        gl.warp_specialize([(_ws_consume, (ring, args, out, 0, META)),
                            (_ws_load, (a_desc, b_desc, ring, args, META))],
                           [LOADER_WARPS], [loader_regs])
    else:
        consumer_regs: gl.constexpr = (GATHER_CONSUMER_REGS if META.gather and not META.fp8 else
                                       SPLIT_CONSUMER_REGS if META.schedule == 2 and not META.gather else
                                       CONSUMER_REGS)
        gl.warp_specialize([(_ws_consume, (ring, args, out, 0, _consumer_meta(META, 0))),
                            (_ws_consume, (ring, args, out, 1, _consumer_meta(META, 1))),
                            (_ws_load, (a_desc, b_desc, ring, args, META))],
                           [4, LOADER_WARPS], [consumer_regs, loader_regs])


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _tma_ready(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def supported(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, num_experts: int, *, gate_up: bool,
              block_n: int, block_k: int, gathered: bool) -> bool:
    """Whether this kernel can run a launch (else the pointer kernel does): a Hopper GPU; A read in order,
    or through a row index (gathered) for a gate-up whose K is a multiple of block_k; 16-bit or fp8 A and
    B of one dtype (fp8 x quantized before); TMA-aligned rows; K > 0; at most MAX_EXPERTS local experts;
    fp8: 128-deep K blocks, one weight scale per column tile (gate-up: F a multiple of 128, so that the up
    half's scale blocks line up too)."""
    if (gathered and not gate_up) or not a.is_cuda or not _is_hopper(a.device.index):
        return False
    if a.dtype not in _GL_DTYPES or w.dtype != a.dtype or not (_tma_ready(a) and _tma_ready(w)):
        return False
    K, N = a.shape[1], out.shape[1]
    if K == 0 or num_experts > MAX_EXPERTS or (gathered and K % block_k):
        return False
    if w.dtype == FP8_DTYPE:
        return block_k == FP8_BLOCK and FP8_BLOCK % block_n == 0 and (not gate_up or N % FP8_BLOCK == 0)
    return True


def uses_tma_store(cfg, a_dtype: torch.dtype, out: torch.Tensor, gate_up: bool, quant_out: bool) -> bool:
    """Whether a launch stores its full tiles by TMA: the cooperative or split schedule, a 16-bit TMA-ready
    output (not the fp8 h), and the ring's stages with the [block_m, block_n] output buffer (split: two
    halves) and the swapped sums' transposition (`swap_scratch_bytes`) within the block's shared memory."""
    if (cfg.warp_specialize not in ("cooperative", "split") or quant_out or out.element_size() != 2
            or not _tma_ready(out)):
        return False
    return _ring_bytes(cfg, a_dtype, gate_up) + cfg.block_m * cfg.block_n * 2 <= SHARED_BYTES


def uses_row_stores(cfg, a_dtype: torch.dtype, out: torch.Tensor, gate_up: bool, tma_store: bool) -> bool:
    """Whether a launch stores its tiles from registers through shared memory, in rows of 16 contiguous bytes
    a thread (`_store_tile`): where no TMA store serves its tiles, a tile's row is at most 32 such pieces and
    the consumers' tiles in C's dtype (interleaved: two whole tiles; split: two halves of one) fit beside the
    ring and the swapped sums' transposition."""
    if tma_store or cfg.block_n * out.element_size() > 32 * 16:
        return False
    tiles = 2 if cfg.warp_specialize == "interleaved" else 1
    return (_ring_bytes(cfg, a_dtype, gate_up) + tiles * cfg.block_m * cfg.block_n * out.element_size()
            <= SHARED_BYTES)


def _ring_bytes(cfg, a_dtype: torch.dtype, gate_up: bool) -> int:
    """Shared memory of the ring's stages, the swapped sums' transposition and the barriers (1 KB)."""
    stage = (cfg.block_m + cfg.block_n * (2 if gate_up else 1)) * cfg.block_k * a_dtype.itemsize
    return cfg.num_stages * stage + swap_scratch_bytes(cfg) + 1024


def tma_store_block(cfg) -> list[int]:
    """The [rows, columns] one TMA store of the output writes: a tile, a split consumer's half of one."""
    return [cfg.block_m // (2 if cfg.warp_specialize == "split" else 1), cfg.block_n]


def pipe_blocks(k_tiles: int, gate_up: bool) -> int:
    """K blocks per iteration of the pipelined fp8 loop for k_tiles blocks of 128: the down GEMM's of 4, 3
    and 2 the one that pads the fewest steps, the larger on a tie (the more of an iteration's promotions
    overlap MMAs: all but its last); the gate-up's 2 (its four block results in flight leave no registers
    for more: 3 or 4 spill, ptxas of triton 3.9)."""
    if gate_up:
        return 2
    return min(PIPE_BLOCKS, key=lambda u: (-(-k_tiles // u) * u, -u))


# (device, stream handle) -> its launches' tile counter
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def tile_counter(device: torch.device) -> torch.Tensor:
    """The tile counter of a claiming launch on the current stream of `device`: int32 [2] (the next tile,
    the programs done), zero at the start of the launch. Eager: the stream's own, zero between launches
    (each launch's last program resets it), so that launches on concurrent streams never share one and
    none pays for zeroing it. While the stream is being captured into a CUDA graph: a counter of the
    launch's own from the graph's memory pool, zeroed by a node of the graph before the kernel's (a
    replay can run beside eager launches on any stream; the same kernel as eager, so that a capture
    compiles nothing)."""
    stream = 0
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(2, dtype=torch.int32, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (device, stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def launch(a, a_scale, w, w_scale, index_L, batched: bool, slot_rows: int, out, out_scale, row_scale, *,
           gate_up: bool, cfg, programs: int, a_rows: torch.Tensor | None = None, dependent: bool = False) -> None:
    """Launch the kernel for one grouped GEMM (operands checked by the caller, `supported` true).

    a [R, K] and w [L, N (x2 for gate-up), K] in one dtype (fp8: a_scale [R, G], w_scale [L, ., G]);
    or a [S, K] (and a_scale [S, G]) read through a_rows, int32 [R] in [0, S) (gate-up, contiguous);
    out [R, N] (fp8 h with out_scale [R, N / 128] when given); row_scale [R] or None; index_L: int32
    offsets [L+1] or counts [L] (batched, slot_rows rows per slot); programs: the grid (one per SM). A config
    with claim_tiles takes its tiles from a `tile_counter`. A gate-up lets a programmatic dependent launch
    start once its programs have begun; dependent: launch as one (a down that follows its gate-up).
    """
    R, N = out.shape
    K = a.shape[1]
    L = w.shape[0]
    fp8 = w.dtype == FP8_DTYPE
    dt = _GL_DTYPES[a.dtype]
    a_block, b_block = [cfg.block_m, cfg.block_k], [cfg.block_n, cfg.block_k]
    a_desc = TensorDescriptor.from_tensor(a, a_block, gl.NVMMASharedLayout.get_default_for(a_block, dt))
    b_desc = TensorDescriptor.from_tensor(w.view(-1, K), b_block, gl.NVMMASharedLayout.get_default_for(b_block, dt))
    quant_out = out_scale is not None
    tma_store = uses_tma_store(cfg, a.dtype, out, gate_up, quant_out)
    store_rows = uses_row_stores(cfg, a.dtype, out, gate_up, tma_store)
    c_desc = b_desc
    if tma_store:
        c_block = tma_store_block(cfg)
        c_desc = TensorDescriptor.from_tensor(out, c_block,
                                              gl.NVMMASharedLayout.get_default_for(c_block, _GL_DTYPES[out.dtype]))
    counter = tile_counter(a.device) if cfg.claim_tiles else None
    meta = Meta(schedule=SCHEDULES[cfg.warp_specialize], batched=batched, gather=a_rows is not None,
                gate_up=gate_up, fp8=fp8, pipe_blocks=pipe_blocks(triton.cdiv(K, cfg.block_k), gate_up)
                if fp8 and cfg.pipe_mma else 0, quant_out=quant_out, tma_store=tma_store,
                store_rows=store_rows, has_row_scale=row_scale is not None,
                lanes=max(triton.next_power_of_2(L), _MIN_EXPERT_LANES), block_m=cfg.block_m, block_n=cfg.block_n,
                block_k=cfg.block_k, group_m=cfg.group_m, stages=cfg.num_stages, claim=cfg.claim_tiles,
                gdc_wait=dependent, swap=cfg.swap_ab)
    dummy = out  # placeholder pointer for arguments a variant does not read
    _ws_gemm_kernel[(programs, )](
        a_desc, b_desc, c_desc, a, a_rows if a_rows is not None else index_L, a_scale if fp8 else dummy, w,
        w_scale if fp8 else dummy, out,
        out_scale if out_scale is not None else dummy, row_scale if row_scale is not None else dummy, index_L,
        counter if cfg.claim_tiles else index_L, L, slot_rows, R, N, K, w_scale.stride(0) if fp8 else 0,
        w_scale.stride(1) if fp8 else 0,
        num_groups(K), num_groups(N), META=meta, num_warps=cfg.num_warps, maxnreg=_MAX_REGISTERS,
        launch_pdl=dependent)
