"""Launch configurations of the grouped expert GEMMs: a pure function of shapes and GPU over tuned tables.

Shape letters: R rows per expert (the host's estimate, see `rows_hint`), N output columns, K reduction size.

The table is data, written by `python -m epmoe.bench.experts --tune` on the GPU and committed beside this
file; nothing is tuned at call time. A launch on a GPU takes the committed table whose `devices` list that
GPU's name (`torch.cuda.get_device_name`: `configs_h100.json` for "NVIDIA H100 80GB HBM3"), else the
default `configs.json` (tuned on an H200); the environment variable `EPMOE_GEMM_TABLE` names a file that
serves every launch of the process in their place. Each table entry lists buckets
`[max_rows_per_expert, config]` in increasing order; the first bucket whose bound holds wins. Entries
`<op>_<precision>_indexed` (optional) serve gate-ups that read their rows through a row index (tuned
for it: the warp-specialized kernel's loader gathers the rows by cp.async; its buckets up to
HAND_SET_ROWS, if any, hand-set for decode sizes); without one such a launch takes the plain entry's
`pointer_variant`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("configs.json")  # the default table: GPUs that no committed table lists
TABLE_GLOB = "configs*.json"  # the committed tables, beside TABLE_PATH
TABLE_ENV = "EPMOE_GEMM_TABLE"  # names a configs.json to launch with in place of the committed ones (read once a GPU)
OPS = ("gate_up", "down")
# The launch table's buckets up to this many rows per expert are hand-set (decode sizes, weight-bound), the
# tuner's above; an `_indexed` table's buckets up to it (if it has any) are hand-set too, and serve gathered
# rows at decode sizes in place of the plain ones.
HAND_SET_ROWS = 64
# Schedules of the warp-specialized kernel (epmoe/kernels/grouped_gemm_ws.py): one consumer of 8 warps,
# two of 4 warps taking K blocks of two tiles at once (interleaved), or two of 4 warps sharing each tile,
# half its rows each (split).
WS_SCHEDULES = ("cooperative", "interleaved", "split")
SHARED_BYTES = 232448  # shared memory one H100/H200 block may use
# Shared memory the pointer kernel's pipeline stages may take (of SHARED_BYTES).
POINTER_STAGE_BYTES = 200 * 1024
CLAIM_MAX_STAGES = 8  # ring stages of a launch with claim_tiles (a tile-number slot each)


@dataclass(frozen=True, kw_only=True)
class GemmConfig:
    """Tile sizes and launch settings of one grouped GEMM launch.

    block_m >= 16 (tl.dot's minimum); block_k divides 128 when fp8 (one K block within one scale group);
    group_m is the number of row tiles that share a pass over the column tiles (L2 reuse); tma: load
    tiles through TMA descriptors (Hopper and later; rows read through a batch's row index still use
    pointer loads).
    warp_specialize: one of WS_SCHEDULES to run the warp-specialized Gluon kernel on Hopper (TMA
    loader warps, wgmma consumers; num_warps is per consumer: 8 cooperative, else 4; num_stages is its
    ring of shared-memory stages, >= 3, even for interleaved); launches it cannot serve (rows through an
    index with K not a multiple of block_k, fp32, other GPUs, the interpreter) run `pointer_variant()`.
    None: the pointer kernel. pipe_mma (fp8, warp specialized): two K blocks' wgmma in flight, the first
    promoted while the second runs. claim_tiles (cooperative schedule, at most CLAIM_MAX_STAGES stages):
    the programs take their tiles from an atomic counter, so that SMs with a larger share of the memory
    bandwidth take more of them (under CUDA graph capture too: `grouped_gemm_ws.tile_counter`).
    pdl (down GEMMs, on Hopper): where the caller says that the gate-up which wrote h is the last work
    queued before it (`grouped_gemm.down`'s follows_gate_up), the down launches as that gate-up's
    programmatic dependent: its programs start on idle SMs and those the gate-up's programs leave, build
    their tile map (and prefetch their first tiles' weights into L2) meanwhile, and wait for the gate-up to
    end (griddepcontrol.wait) before they read h or write.
    swap_ab (the pointer kernel, and the cooperative and interleaved schedules): each tile's product is
    taken transposed, the weights' block_n rows on the MMA's M side and the expert's block_m rows (16 or
    more) on its N side, so that a decode tile of 16 rows fills a 64-row wgmma with weights rather than with
    padding rows (the same result).
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False
    warp_specialize: str | None = None
    pipe_mma: bool = False
    claim_tiles: bool = False
    pdl: bool = False
    swap_ab: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "group_m"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two, got {value}")
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 16:
            raise ValueError(f"GemmConfig blocks must be >= 16 (tl.dot), got {self}")
        if self.warp_specialize is not None:
            if self.warp_specialize not in WS_SCHEDULES:
                raise ValueError(f"GemmConfig.warp_specialize must be None or one of {WS_SCHEDULES}, "
                                 f"got {self.warp_specialize!r}")
            warps = 8 if self.warp_specialize == "cooperative" else 4
            rows = 128 if self.warp_specialize == "split" else 64  # wgmma: 64 rows a consumer
            if self.num_warps != warps or (self.block_m < rows and not self.swap_ab) or self.num_stages < 3:
                raise ValueError(f"GemmConfig: warp_specialize={self.warp_specialize!r} needs num_warps={warps}, "
                                 f"block_m >= {rows} (wgmma) and num_stages >= 3, got {self}")
            # each interleaved consumer keeps its own stages (grouped_gemm_ws._ring_slot)
            if self.warp_specialize == "interleaved" and self.num_stages % 2:
                raise ValueError(f"GemmConfig: warp_specialize='interleaved' needs an even num_stages, got {self}")
            # swapped, the weights' block_n rows are the wgmma's M side: the schedules take 128 (compiled and
            # tested so), not split (whose consumers split a tile's rows)
            if self.swap_ab and (self.warp_specialize == "split" or self.block_n != 128):
                raise ValueError(f"GemmConfig.swap_ab with warp_specialize needs the cooperative or interleaved "
                                 f"schedule and block_n 128, got {self}")
        elif self.pipe_mma:
            raise ValueError(f"GemmConfig.pipe_mma needs warp_specialize, got {self}")
        if self.claim_tiles and (self.warp_specialize != "cooperative" or self.num_stages > CLAIM_MAX_STAGES):
            raise ValueError(f"GemmConfig.claim_tiles needs warp_specialize='cooperative' and at most "
                             f"{CLAIM_MAX_STAGES} stages, got {self}")

    def to_dict(self) -> dict:
        """The table's form: the fields that differ from their defaults, and the tile sizes."""
        out = asdict(self)
        for f in dataclasses.fields(self):
            if f.default is not dataclasses.MISSING and out[f.name] == f.default and f.name not in ("group_m",
                                                                                                    "num_warps",
                                                                                                    "num_stages"):
                del out[f.name]
        return out

    def pointer_variant(self, element_size: int = 2) -> "GemmConfig":
        """This config for the pointer kernel (for launches the warp-specialized kernel cannot serve): the
        same tiles and warps in all, TMA for the weights, as many of its stages as fit beside a gate-up's
        two weight tiles (at most 4)."""
        if self.warp_specialize is None:
            return self
        stage = (self.block_m + 2 * self.block_n) * self.block_k * element_size
        return dataclasses.replace(self, warp_specialize=None, pipe_mma=False, claim_tiles=False, num_warps=8,
                                   tma=True, num_stages=max(2, min(self.num_stages, 4, POINTER_STAGE_BYTES // stage)))


def swap_scratch_bytes(cfg: GemmConfig) -> int:
    """Shared memory a warp-specialized consumer of `cfg` takes to transpose its float32 sums into the epilogue's
    layout (swap_ab; none otherwise), beside the ring."""
    return cfg.block_m * cfg.block_n * 4 if cfg.swap_ab and cfg.warp_specialize else 0


# The interpreter (CPU) runs every program in numpy: small tiles keep the tests fast.
INTERPRETER_CONFIG = GemmConfig(block_m=16, block_n=32, block_k=32, group_m=4, num_warps=1, num_stages=1)


def table_key(op: str, fp8: bool, indexed: bool = False) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return f"{op}_{'fp8' if fp8 else 'bf16'}" + ("_indexed" if indexed else "")


def gpu_name(device: torch.device) -> str | None:
    """The name of the CUDA GPU `device` is (its index, else the current one), which picks its launch table;
    None for other devices."""
    if device.type != "cuda":
        return None
    return _gpu_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _current_gpu() -> str | None:
    return _gpu_name(torch.cuda.current_device()) if torch.cuda.is_available() else None


def table_path(gpu: str | None = None) -> Path:
    """The launch table in use on the GPU named `gpu` (default: the current CUDA device, if any): the file
    `EPMOE_GEMM_TABLE` names (a tuner's configs.json, say), else the committed table that lists the GPU
    (`device_tables`), else TABLE_PATH; read once per GPU name, at the first launch (`_in_use`)."""
    return _in_use(gpu or _current_gpu())[0]


def _table(path: Path | None = None, gpu: str | None = None) -> dict[str, list[tuple[int, GemmConfig]]]:
    """The table at `path`, or the one in use on the GPU named `gpu` (default: the current CUDA device)."""
    return _load_table(path) if path is not None else _in_use(gpu or _current_gpu())[1]


@functools.cache
def device_tables() -> dict[str, Path]:
    """{GPU name: committed table file tuned for it}: the `devices` the committed tables list (TABLE_GLOB
    beside TABLE_PATH); ValueError if two tables list one GPU."""
    out: dict[str, Path] = {}
    for path in sorted(TABLE_PATH.parent.glob(TABLE_GLOB)):
        for name in _load_devices(path):
            if name in out:
                raise ValueError(f"launch tables {out[name]} and {path} both list the GPU {name!r}")
            out[name] = path
    return out


@functools.cache
def _in_use(gpu: str | None) -> tuple[Path, dict[str, list[tuple[int, GemmConfig]]]]:
    named = os.environ.get(TABLE_ENV)
    path = Path(named) if named else device_tables().get(gpu, TABLE_PATH)
    return path, _load_table(path, f" (from {TABLE_ENV})" if named else "")


def _read(path: Path, where: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{where}: not a JSON object")
    return data


def _load_devices(path: Path) -> list[str]:
    """The GPU names a table file lists (`"devices"`, optional); ValueError, naming the file, unless a list
    of strings."""
    devices = _read(path, f"launch table {path}").get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(name, str) for name in devices):
        raise ValueError(f"launch table {path}: \"devices\" must be a list of GPU names, got {devices!r}")
    return devices


@functools.cache
def _load_table(path: Path, source: str = "") -> dict[str, list[tuple[int, GemmConfig]]]:
    """{table key: [(max rows per expert, config), ...]} of a configs.json; ValueError, naming the file (and
    `source`, where it was named), if it cannot serve every launch (a plain entry per op and precision,
    buckets in increasing order, valid configs, pdl on down entries only)."""
    where = f"launch table {path}{source}"
    data = _read(path, where)
    try:
        table = {key: [(int(bound), GemmConfig(**cfg)) for bound, cfg in buckets]
                 for key, buckets in data["tables"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{where}: {type(exc).__name__}: {exc}") from exc
    for key in (table_key(op, fp8) for op in OPS for fp8 in (False, True)):
        if not table.get(key):
            raise ValueError(f"{where}: no buckets for {key!r}")
    for key, buckets in table.items():
        bounds = [bound for bound, _ in buckets]
        if bounds != sorted(set(bounds)) or not bounds or bounds[0] < 1:
            raise ValueError(f"{where}: {key!r} needs buckets of increasing max rows >= 1, got {bounds}")
        if key.startswith("gate_up") and any(cfg.pdl for _, cfg in buckets):
            raise ValueError(f"{where}: {key!r} sets pdl, which only down GEMMs take")
    return table


def routed_rows(mean: int) -> int:
    """Rows per expert a launch config is chosen for where routed counts scatter around `mean` (the
    contiguous layout): one standard deviation of a Poisson count above it, mean + ceil(sqrt(mean)).
    One H200, `epmoe bench moe` against the bucket for the mean (down) and for twice the mean (gate-up
    through a row index): 1.02-1.18x at 9 of 11 decode-sized points of Qwen3-30B-A3B, DeepSeek-V2-Lite
    and Mixtral-8x7B, 0.95x at V2-Lite fp8 256 tokens (BENCHMARKS.md, "What we tried: the one-GPU block")."""
    return mean + math.isqrt(max(mean - 1, 0)) + 1


def gemm_config(op: str, *, fp8: bool, rows_hint: int, on_gpu: bool, gpu: str | None = None,
                element_size: int = 2, indexed: bool = False, scattered: bool = False) -> GemmConfig:
    """The launch configuration for one grouped GEMM.

    Args:
        op: "gate_up" (fused SiLU-and-mul epilogue) or "down".
        fp8: fp8 block-quantized operands (block_k must divide 128; block_n 128 lets gate_up emit fp8 h).
        rows_hint: estimated rows per expert (the mean N / L for the contiguous layout).
        on_gpu: False under the Triton interpreter (CPU tensors), which gets INTERPRETER_CONFIG.
        gpu: the name of the GPU the launch runs on (`gpu_name`), whose table serves it (`table_path`);
            default: the current CUDA device.
        element_size: bytes per unquantized operand element; float32 runs the pointer kernel with the
            16-bit tables halved along K, so that the pipeline stages still fit in shared memory.
        indexed: the activations are read through a row index (routed rows, scattered too): the table's
            `_indexed` entry as it is (the warp-specialized kernel gathers a gate-up's rows itself); where
            the hand-set buckets are taken (scattered), the `_indexed` table's own hand-set bucket (bound
            up to HAND_SET_ROWS) where one holds the rows, else the plain entry's `pointer_variant`, as
            where there is no `_indexed` entry (or none above its hand-set buckets).
        scattered: the experts' row counts scatter around rows_hint (routed rows, contiguous layout):
            where `routed_rows(rows_hint)` fits the table's hand-set buckets (those up to HAND_SET_ROWS), its
            bucket.
    """
    key = table_key(op, fp8)
    if not on_gpu:
        return INTERPRETER_CONFIG
    table = _table(gpu=gpu)
    buckets = table[key]
    tuned = table.get(table_key(op, fp8, indexed=True)) if indexed else None
    if indexed or scattered:
        # Routed rows at decode sizes: the hand-set bucket for `routed_rows` (an expert with more rows than
        # its tile has is a second pass over its weights); above, the table's entry for the mean
        wide = routed_rows(rows_hint)
        own = [(bound, cfg) for bound, cfg in tuned or () if bound <= HAND_SET_ROWS]  # hand-set, gathered rows
        if wide <= max((bound for bound, _ in buckets if bound <= HAND_SET_ROWS), default=0):
            rows_hint = wide
            if own and wide <= own[-1][0]:
                buckets = own
        elif tuned is not None:
            buckets = tuned[len(own):] or buckets
    cfg = next((cfg for bound, cfg in buckets if rows_hint <= bound), buckets[-1][1])
    if indexed and buckets is table[key]:
        cfg = cfg.pointer_variant(1 if fp8 else element_size)  # a plain entry, not tuned for gathered rows
    if not fp8 and element_size > 2:
        cfg = dataclasses.replace(cfg.pointer_variant(element_size), block_k=max(16, cfg.block_k * 2 // element_size))
    return cfg
