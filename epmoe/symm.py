"""Symmetric workspaces: named buffers at the same offsets on every rank, reachable through peer addresses.

The NVLink dispatchers (`ht`, `ll`) store rows straight into peers' buffers from Triton kernels: a
kernel loads a peer's address from an int64 table (`Workspace.peers`) and casts it to a pointer
(epmoe/kernels/sync.py). A dispatcher gets its workspace from a `WorkspaceBackend`, the one interface of
its two implementations:

- `TorchSymmetricMemory`: torch.distributed._symmetric_memory over a real process group (CUDA, one host).
- `EmulatedGroup`: several ranks in ONE process (CPU tensors, TRITON_INTERPRET=1, or one GPU); every
  rank's buffers are ordinary tensors and the tables hold their addresses. Its ranks run in turn, phase
  by phase: every rank's send step, then every rank's receive step, so a device-side wait must never
  wait for a later phase (`runs_in_turn`).

Shape letters: R ranks.
"""
from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .config import repr_hash

_ALIGN = 256


@dataclass(frozen=True)
class BufferSpec:
    """One named region of a workspace."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


def _offsets(specs: list[BufferSpec]) -> tuple[dict[str, int], int]:
    offsets, total = {}, 0
    for spec in specs:
        if spec.name in offsets:
            raise ValueError(f"buffer {spec.name!r} declared twice")
        offsets[spec.name] = total
        total += -(-spec.nbytes // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


class Workspace:
    """This rank's view of a symmetric workspace.

    Attributes:
        rank, world_size: this rank and R.
        base_R: int64 [R] on the device: address of each rank's workspace.
    Methods:
        local(name): this rank's buffer as a tensor (shape and dtype of its spec).
        peers(name): int64 [R] on the device, each rank's address of buffer `name` (cast to a pointer in
            Triton: tl.load(table + r).to(tl.pointer_type(dtype))).
        peer(name, r): rank r's buffer `name` as a tensor on this device (its memory mapped here: copies
            into it move bytes to rank r, by the copy engine on a GPU).
        views(cls, **given) / tables(cls): a dataclass of local buffers / of address tables, by field name.
    """

    def __init__(self, specs: list[BufferSpec], raws: list[torch.Tensor], bases: list[int], rank: int) -> None:
        """raws: every rank's whole workspace as a uint8 tensor addressable here (raws[rank]: this
        rank's allocation); bases: their addresses."""
        self.specs = {s.name: s for s in specs}
        self._offsets, _ = _offsets(specs)
        self._raws = raws  # raws[rank] keeps this rank's allocation alive
        self.rank, self.world_size = rank, len(bases)
        self.base_R = torch.tensor(bases, dtype=torch.int64, device=raws[rank].device)
        self._peers = {name: self.base_R + off for name, off in self._offsets.items()}
        # views made once: a dispatcher looks buffers up several times per call
        self._local = {name: self._view(rank, name) for name in self._offsets}

    def _view(self, r: int, name: str) -> torch.Tensor:
        spec, off = self.specs[name], self._offsets[name]
        return self._raws[r][off:off + spec.nbytes].view(spec.dtype).view(spec.shape)

    def local(self, name: str) -> torch.Tensor:
        return self._local[name]

    def peers(self, name: str) -> torch.Tensor:
        return self._peers[name]

    def peer(self, name: str, r: int) -> torch.Tensor:
        return self._local[name] if r == self.rank else self._view(r, name)

    def views(self, cls: type, **given: Any) -> Any:
        """The dataclass `cls` with each field this rank's buffer of the same name (None where the
        workspace has none), except the fields in `given`."""
        return cls(**{f.name: self._local.get(f.name) for f in fields(cls) if f.name not in given}, **given)

    def tables(self, cls: type) -> Any:
        """The dataclass `cls` with each field the address table (`peers`) of the buffer of the same
        name (None where the workspace has none)."""
        return cls(**{f.name: self._peers.get(f.name) for f in fields(cls)})


def torch_workspace(specs: list[BufferSpec], group: dist.ProcessGroup, device: torch.device) -> Workspace:
    """Allocate `specs` in CUDA symmetric memory on every rank of `group` (collective). Zero-filled."""
    from torch.distributed import _symmetric_memory as symm_mem

    _, total = _offsets(specs)
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():  # required before rendezvous on older torch; a deprecated no-op on 2.11+
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
    raw = symm_mem.empty(total, dtype=torch.uint8, device=device)
    raw.zero_()
    handle = symm_mem.rendezvous(raw, group=group.group_name)
    dist.barrier(group=group)
    rank = dist.get_rank(group)
    raws = [raw if r == rank else handle.get_buffer(r, (total,), torch.uint8) for r in range(handle.world_size)]
    ws = Workspace(specs, raws, list(handle.buffer_ptrs), rank)
    ws.handle = handle
    return ws


def all_gather_ints(group: dist.ProcessGroup, values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's int64 `values` (the same count on every rank), by rank: one all_gather over `group` of
    a tensor on `device` (a CUDA device for NCCL, the CPU for gloo) and a host read."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every).tolist()


class WorkspaceBackend(ABC):
    """Where a symmetric-memory dispatcher's workspace comes from, and how its ranks run.

    rank, world_size: this rank and R. runs_in_turn: the ranks share one process and run phase by phase
    (the dispatchers then launch every device-side wait only where the awaited signals were sent in an
    earlier phase). default_device: where buffers live unless the dispatcher is told otherwise."""

    rank: int
    world_size: int
    runs_in_turn: ClassVar[bool]
    default_device: ClassVar[str]

    @abstractmethod
    def workspace(self, key: Any, specs: list[BufferSpec], device: torch.device) -> Workspace:
        """This rank's workspace of `specs` on `device`, zero-filled; collective over the ranks. Dispatchers
        of equal `key` may share one (emulated ranks do: they then act as one dispatcher)."""


class TorchSymmetricMemory(WorkspaceBackend):
    """The ranks of a NCCL process group, one GPU each, with torch's symmetric memory."""

    runs_in_turn = False
    default_device = "cuda"

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def workspace(self, key: Any, specs: list[BufferSpec], device: torch.device) -> Workspace:
        return torch_workspace(specs, self.group, device)


@dataclass
class _EmulatedWorld:
    world_size: int
    workspaces: dict[Any, list[Workspace]] = field(default_factory=dict)


@dataclass(frozen=True)
class EmulatedGroup(WorkspaceBackend):
    """A stand-in process group for rank `rank` of `world_size` ranks emulated in one process.

    Make all ranks' groups with `EmulatedGroup.world(R)`. Dispatchers built on these share workspaces
    through the group; only the symmetric-memory dispatchers accept them.
    """

    rank: int
    world_size: int
    _world: _EmulatedWorld
    runs_in_turn: ClassVar[bool] = True
    default_device: ClassVar[str] = "cpu"

    @staticmethod
    def world(world_size: int) -> list["EmulatedGroup"]:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        shared = _EmulatedWorld(world_size)
        return [EmulatedGroup(r, world_size, shared) for r in range(world_size)]

    def workspace(self, key: Any, specs: list[BufferSpec], device: torch.device) -> Workspace:
        """This rank's workspace `key`; the first rank to ask allocates every rank's (zero-filled)."""
        table = self._world.workspaces
        if key not in table:
            _, total = _offsets(specs)
            raws = [torch.zeros(total, dtype=torch.uint8, device=device) for _ in range(self.world_size)]
            bases = [r.data_ptr() for r in raws]
            table[key] = [Workspace(specs, raws, bases, r) for r in range(self.world_size)]
        return table[key][self.rank]


def workspace_backend(group: dist.ProcessGroup | WorkspaceBackend) -> WorkspaceBackend:
    """The backend of a group that `symmetric_world` accepted: itself (EmulatedGroup), or torch's
    symmetric memory over a process group."""
    return group if isinstance(group, WorkspaceBackend) else TorchSymmetricMemory(group)


MAX_NVLINK_WORLD = 8


def indexed_device(device: torch.device | str) -> torch.device:
    """`device` with the current CUDA device's index when it is "cuda" without one (tensors made there
    report cuda:N, and buffers are compared with them)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def symmetric_world(cfg, group) -> tuple[int, str]:
    """(R, "ok") when the symmetric-memory dispatchers can run `cfg` over `group`, else (0, reason).

    `group` must be a WorkspaceBackend (an EmulatedGroup), or a NCCL group of at most 8 ranks, all GPUs
    of this host, with torch symmetric memory; E must be divisible by R.
    """
    world, reason = symmetric_group_world(group)
    if not world:
        return 0, reason
    if world > MAX_NVLINK_WORLD:
        return 0, f"world size {world} > {MAX_NVLINK_WORLD} (one NVLink domain)"
    if cfg.num_experts % world:
        return 0, f"num_experts={cfg.num_experts} not divisible by world size {world}"
    return world, "ok"


def symmetric_group_world(group) -> tuple[int, str]:
    """`symmetric_world`'s checks of the group alone, the same answer on every rank of it: (R, "ok") or
    (0, reason)."""
    if isinstance(group, WorkspaceBackend):
        world = group.world_size
    elif isinstance(group, dist.ProcessGroup):
        if not torch.cuda.is_available():
            return 0, "needs CUDA"
        try:
            from torch.distributed import _symmetric_memory  # noqa: F401
        except ImportError:
            return 0, "torch.distributed._symmetric_memory is not available"
        if "nccl" not in str(dist.get_backend(group)):
            return 0, f"needs a NCCL group of one host's GPUs, got backend {dist.get_backend(group)!r}"
        world = dist.get_world_size(group)
        if world > torch.cuda.device_count():
            return 0, f"needs all {world} ranks on one host ({torch.cuda.device_count()} GPUs here)"
    else:
        return 0, "needs a NCCL process group or an EmulatedGroup"
    return world, "ok"


def agree_construction(name: str, cfg, group, options: tuple) -> None:
    """Before a symmetric-memory dispatcher checks or allocates anything (each rank's checks depend on
    its own config and options, and a rank that raised alone would leave the others waiting in the
    allocation's collective): over a process group that symmetric memory can use, all-gather every rank's
    config fingerprint and a hash of its options, and raise ValueError on every rank alike where they
    differ. Nothing for emulated ranks (built one after another in one process, they exchange nothing)
    nor for groups symmetric memory cannot use (their checks then fail alike on every rank)."""
    if not isinstance(group, dist.ProcessGroup) or not symmetric_group_world(group)[0]:
        return
    device = torch.device("cuda", torch.cuda.current_device())
    every = all_gather_ints(group, [cfg.fingerprint(), repr_hash(options)], device)
    refuse_other_builds(name, dist.get_rank(group), every)


def refuse_other_builds(name: str, rank: int, every_R2: list[list[int]]) -> None:
    """ValueError unless every rank's (config fingerprint, options hash) equals rank `rank`'s, naming the
    ranks that differ and in what (the same message on every rank but the rank named)."""
    mine = every_R2[rank]
    configs = [r for r, (fingerprint, _) in enumerate(every_R2) if fingerprint != mine[0]]
    if configs:
        raise ValueError(f"dispatcher {name!r}: rank(s) {configs} were built from another MoEConfig than rank "
                         f"{rank}'s; every rank must build the layer from the same config")
    options = [r for r, (_, opts) in enumerate(every_R2) if opts != mine[1]]
    if options:
        raise ValueError(f"dispatcher {name!r}: rank(s) {options} were built with other options than rank "
                         f"{rank}'s; every rank must build it with the same options")


def group_rank_world(group: dist.ProcessGroup | WorkspaceBackend | None) -> tuple[int, int]:
    """(rank, world size) of a process group, a WorkspaceBackend (an EmulatedGroup), or None (a single rank).
    Raises ValueError on a process outside `group` (torch gives it rank and world size -1)."""
    if group is None:
        return 0, 1
    if isinstance(group, WorkspaceBackend):
        return group.rank, group.world_size
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process group; "
                         "build the layer only on the group's ranks")
    return rank, dist.get_world_size(group)
