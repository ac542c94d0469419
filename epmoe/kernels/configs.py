"""Launch configurations of the grouped expert GEMMs: a pure function of shapes over a tuned table.

Shape letters: R rows per expert (the host's estimate, see `rows_hint`), N output columns, K reduction size.

The table is data (`configs.json` beside this file), written by `python -m epmoe.bench.experts --tune`
on the GPU and committed; nothing is tuned at call time. Each table entry lists buckets
`[max_rows_per_expert, config]` in increasing order; the first bucket whose bound holds wins.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("configs.json")
OPS = ("gate_up", "down")


@dataclass(frozen=True, kw_only=True)
class GemmConfig:
    """Tile sizes and launch settings of one grouped GEMM launch.

    block_m >= 16 (tl.dot's minimum); block_k divides 128 when fp8 (one K block within one scale group);
    group_m is the number of row tiles that share a pass over the column tiles (L2 reuse); tma: load
    tiles through TMA descriptors (Hopper and later; rows read through a batch's row index still use
    pointer loads).
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "group_m"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two, got {value}")
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 16:
            raise ValueError(f"GemmConfig blocks must be >= 16 (tl.dot), got {self}")

    def to_dict(self) -> dict:
        return asdict(self)


# The interpreter (CPU) runs every program in numpy: small tiles keep the tests fast.
INTERPRETER_CONFIG = GemmConfig(block_m=16, block_n=32, block_k=32, group_m=4, num_warps=1, num_stages=1)


def table_key(op: str, fp8: bool) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return f"{op}_{'fp8' if fp8 else 'bf16'}"


@functools.cache
def _table(path: Path = TABLE_PATH) -> dict[str, list[tuple[int, GemmConfig]]]:
    raw = json.loads(path.read_text())
    return {key: [(bound, GemmConfig(**cfg)) for bound, cfg in buckets] for key, buckets in raw["tables"].items()}


def gemm_config(op: str, *, fp8: bool, rows_hint: int, on_gpu: bool, element_size: int = 2) -> GemmConfig:
    """The launch configuration for one grouped GEMM.

    Args:
        op: "gate_up" (fused SiLU-and-mul epilogue) or "down".
        fp8: fp8 block-quantized operands (block_k must divide 128; block_n 128 lets gate_up emit fp8 h).
        rows_hint: estimated rows per expert (the mean N / L for the contiguous layout).
        on_gpu: False under the Triton interpreter (CPU tensors), which gets INTERPRETER_CONFIG.
        element_size: bytes per unquantized operand element; the 16-bit tables are halved along K for
            float32 so that the pipeline stages still fit in shared memory.
    """
    key = table_key(op, fp8)
    if not on_gpu:
        return INTERPRETER_CONFIG
    buckets = _table()[key]
    cfg = next((cfg for bound, cfg in buckets if rows_hint <= bound), buckets[-1][1])
    if not fp8 and element_size > 2:
        cfg = dataclasses.replace(cfg, block_k=max(16, cfg.block_k * 2 // element_size))
    return cfg
