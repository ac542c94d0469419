"""World size of the multi-GPU tests (marker `gpu2`), for the EP4/EP8 runs (scripts/gpu_run.sh NPROC)."""
import os


def gpu_test_ranks() -> int:
    """$EPMOE_GPU_RANKS, 2 to 8, default 2."""
    ranks = int(os.environ.get("EPMOE_GPU_RANKS", "2"))
    if not 2 <= ranks <= 8:
        raise ValueError(f"EPMOE_GPU_RANKS must be 2 to 8, got {ranks}")
    return ranks


def multiple_of(n: int, ranks: int) -> int:
    """n rounded up to a multiple of `ranks` (expert counts of test cases that run at any world size)."""
    return -(-n // ranks) * ranks
