"""Names -> implementations, and the one place that decides what is available.

Every dispatcher and experts implementation is listed here by name; `list_dispatchers` and
`list_experts` report each with (available, reason) without constructing anything.
"""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from .config import MoEConfig
from .interfaces import Dispatcher, Experts, Layout

_DISPATCHERS = {
    "local": "epmoe.dispatch.local:LocalDispatcher",
    "allgather": "epmoe.dispatch.allgather:AllGatherDispatcher",
    "alltoall": "epmoe.dispatch.alltoall:AllToAllDispatcher",
    "ht": "epmoe.dispatch.ht:HtDispatcher",
    "ll": "epmoe.dispatch.ll:LLDispatcher",
}
_EXPERTS = {
    "reference": "epmoe.experts.reference:ReferenceExperts",
    "triton": "epmoe.experts.triton:TritonExperts",
    "grouped_mm": "epmoe.experts.grouped_mm:GroupedMMExperts",
}
DISPATCHER_NAMES = tuple(_DISPATCHERS)
EXPERTS_NAMES = tuple(_EXPERTS)
# "auto" prefers the first available name in this order.
_AUTO_DISPATCH_ORDER = ("local", "ht", "alltoall", "allgather")


def auto_experts_order(device: torch.device) -> tuple[str, ...]:
    """The experts names "auto" tries, best first (a pure function of the device).

    CPU: the reference (the Triton interpreter is for tests, not speed). CUDA: the Triton kernels (both
    layouts, fp8, rows read through a batch's row index, the top-k weights in the down projection),
    which every dispatcher's batch suits: torch._grouped_mm needs the rows copied out of the index and
    the weights applied apart, and measured slower in the whole block at every size of `epmoe bench moe`
    (BENCHMARKS.md, MoE block on one GPU). Candidates that do not take `layout` are dropped by the caller.
    """
    if device.type != "cuda":
        return ("reference",)
    return ("triton", "grouped_mm", "reference")


def _load(path: str):
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def dispatcher_class(name: str) -> type[Dispatcher]:
    if name not in _DISPATCHERS:
        raise ValueError(f"unknown dispatcher {name!r}; known: {sorted(_DISPATCHERS)} or 'auto'")
    return _load(_DISPATCHERS[name])


def experts_class(name: str) -> type[Experts]:
    if name not in _EXPERTS:
        raise ValueError(f"unknown experts {name!r}; known: {sorted(_EXPERTS)} or 'auto'")
    return _load(_EXPERTS[name])


def list_dispatchers(cfg: MoEConfig, group: dist.ProcessGroup | None = None) -> dict[str, tuple[bool, str]]:
    """Every dispatcher name with (available, reason) for this config and process group."""
    return {name: dispatcher_class(name).availability(cfg, group) for name in _DISPATCHERS}


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def list_experts(cfg: MoEConfig, device: torch.device | str | None = None) -> dict[str, tuple[bool, str]]:
    """Every experts name with (available, reason) for this config on `device` (default: the current
    CUDA device if there is one, else the CPU)."""
    device = default_device() if device is None else torch.device(device)
    return {name: experts_class(name).availability(cfg, device) for name in _EXPERTS}


def _resolve(kind: str, name: str, table: dict[str, tuple[bool, str]], auto_order: tuple[str, ...]) -> str:
    """Map "auto" to the first available name of `auto_order`; refuse an unknown or unavailable name."""
    if name == "auto":
        for candidate in auto_order:
            if table[candidate][0]:
                return candidate
        raise ValueError(f"no {kind} is available: {table}")
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(table)} or 'auto'")
    if not table[name][0]:
        raise ValueError(f"{kind} {name!r} is not available: {table[name][1]}")
    return name


def resolve_dispatcher(name: str, cfg: MoEConfig, group: dist.ProcessGroup | None) -> str:
    """Map "auto" to a concrete available name; refuse an unavailable explicit name."""
    return _resolve("dispatcher", name, list_dispatchers(cfg, group), _AUTO_DISPATCH_ORDER)


def resolve_experts(name: str, cfg: MoEConfig, device: torch.device | str | None = None,
                    layout: Layout | None = None) -> str:
    """Map "auto" to the best available name that takes `layout` (any if None); refuse an unavailable name."""
    device = default_device() if device is None else torch.device(device)
    order = tuple(c for c in auto_experts_order(device)
                  if layout is None or layout in experts_class(c).layouts)
    return _resolve("experts", name, list_experts(cfg, device), order)


def make_dispatcher(name: str, cfg: MoEConfig, group: dist.ProcessGroup | None = None, **options) -> Dispatcher:
    """Build dispatcher `name` ("auto" picks one) for `cfg` over `group` (None = single rank).

    Collective for multi-rank dispatchers that set up shared buffers: call it on every rank.
    """
    return dispatcher_class(resolve_dispatcher(name, cfg, group))(cfg, group, **options)


def make_experts(name: str, cfg: MoEConfig, num_local_experts: int, device, layout: Layout | None = None) -> Experts:
    """Build experts implementation `name` ("auto" picks one for `layout`) holding `num_local_experts` experts."""
    return experts_class(resolve_experts(name, cfg, device, layout))(cfg, num_local_experts, device)
