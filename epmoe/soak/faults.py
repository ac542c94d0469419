"""Faults: each one injected into a two-rank layer call; every rank must end with a clear error inside the
configured time-out (no hang, no illegal memory access, no output returned as if nothing happened), and
where the process lives on, a layer built on a fresh group must then give the oracle's result.

Faults (rank 1 is the faulty one): a peer that never arrives (rank 1 skips the call), a peer that dies
mid-call (rank 1 exits between its dispatch and its combine), a rank with another config (rank 1's hidden
size differs), ids out of range on one rank only, a wrong dtype on one rank only.

Where:
- process groups (gloo ranks on the CPU, `allgather` and `alltoall`; NCCL groups are not faulted here):
  every fault runs on a group of its own whose collectives time out after `timeout_s`; the fresh group is a
  new one (of the survivor alone after a death). The ranks are processes of their own (`run_ranks`), so that
  a rank that dies or hangs leaves the others' reports: a rank that has not reported by the deadline is
  killed and counted as hung.
- emulated ranks (`ht`, `ht(sync_free)`, `ll`; the CPU under the Triton interpreter, or one GPU): the
  device-side waits give up after `timeout_s` (`wait_timeout_s`); ht raises on the host at its next
  batch-size read, and every dispatcher's `timed_out()` says so (ll and ht(sync_free) have no host sync
  to raise at: the flag is the error). The fresh group is a new EmulatedGroup world.

Shape letters: T tokens, D hidden size, K top-k, E experts.
"""
from __future__ import annotations

import datetime
import os
import pickle
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import MoEConfig
from ..launch import _die_with_parent, close_rank, free_port, init_rank
from ..oracle import MoERef
from ..testing import build_layer, layer_oracle, make_weights, rel_error, tolerance
from .load import emulated_available, emulated_step, emulated_world

FAULTS = ("never_arrives", "dies_mid_call", "other_config", "ids_out_of_range", "wrong_dtype")
FAULT_CFG = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, max_tokens_per_rank=8)
OTHER_CFG = replace(FAULT_CFG, hidden_size=48)  # the faulty rank's config in other_config


@dataclass(frozen=True)
class Outcome:
    """How one rank's call ended under one fault."""

    fault: str
    path: str
    rank: int
    ended: str  # "error", "output" (returned one), "skipped the call" (the fault itself), "died (the fault)"
    error: str  # type and first line of the message, "" if none
    seconds: float
    fresh_group_ok: bool | None  # the next layer, on a fresh group (None: not tried, the rank is gone)
    fresh_error: str = ""

    @property
    def clear(self) -> bool:
        """Ended by the fault itself, or with a clear error (a message) on a rank that called."""
        return self.ended in ("skipped the call", "died (the fault)") or (self.ended == "error" and bool(self.error))


def describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]


def faulty_inputs(fault: str, cfg: MoEConfig, rank: int, device: torch.device):
    """Rank `rank`'s x_TD, ids_TK, weights_TK (6 tokens) under `fault`: rank 1 gets the bad ones."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, cfg.hidden_size, generator=g).to(cfg.dtype)
    ids = torch.rand(6, cfg.num_experts, generator=g).argsort(dim=1)[:, :cfg.top_k].to(torch.int32)
    w = torch.rand(6, cfg.top_k, generator=g)
    if rank == 1 and fault == "ids_out_of_range":
        ids[0, 0] = cfg.num_experts
    if rank == 1 and fault == "wrong_dtype":
        x = x.float() if cfg.dtype != torch.float32 else x.double()
    return x.to(device), ids.to(device), w.to(device)


# -- process groups --------------------------------------------------------------------------------------


def _worker(rank: int, world: int, init_method: str, fn, args: tuple, queue, launcher_pid: int) -> None:
    _die_with_parent(launcher_pid)
    ctx = init_rank(rank, world, "cpu", init_method)
    try:
        fn(ctx, lambda outcome: queue.put(pickle.dumps(outcome)), *args)
    finally:
        close_rank()


def run_ranks(fn, world: int, args: tuple, deadline_s: float) -> tuple[list[Outcome], list[int | None]]:
    """fn(ctx, report, *args) on `world` gloo ranks, each a process; report(outcome) sends one back at once.
    Returns the outcomes, and each rank's exit code (None: still running at the deadline, killed: hung)."""
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [context.Process(target=_worker, args=(r, world, init_method, fn, args, queue, os.getpid()), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    outcomes, end = [], time.monotonic() + deadline_s
    while any(p.is_alive() for p in procs) and time.monotonic() < end:
        while not queue.empty():
            outcomes.append(pickle.loads(queue.get()))
        time.sleep(0.05)
    codes = [None if p.is_alive() else p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    while not queue.empty():
        outcomes.append(pickle.loads(queue.get()))
    return outcomes, codes


def _fresh_layer_ok(cfg: MoEConfig, group, d_name: str, rank: int, device: torch.device) -> tuple[bool, str]:
    """A new layer over `group` gives the oracle's result for one call."""
    try:
        weights = make_weights(cfg, 1, device)
        moe = build_layer(cfg, weights, group, d_name, "reference", device)
        x, ids, w = faulty_inputs("none", cfg, rank, device)
        err = rel_error(moe(x, weights_TK=w, ids_TK=ids), layer_oracle(cfg, weights, device=device)(x, ids, w))
        return err <= tolerance(cfg), "" if err <= tolerance(cfg) else f"rel err {err:.3g}"
    except Exception as e:  # the report says how the fresh layer failed
        return False, describe(e)


def _attempt(fault: str, d_name: str, ctx, group, report, timeout_s: float) -> None:
    """One fault through dispatcher d_name on `group`; reports this rank's outcome."""
    rank, dev, t0 = ctx.rank, ctx.device, time.monotonic()
    cfg = OTHER_CFG if fault == "other_config" and rank == 1 else FAULT_CFG
    ended, error = "output", ""
    if fault == "never_arrives" and rank == 1:
        ended = "skipped the call"
        time.sleep(timeout_s)  # then join the fresh group
    else:
        moe = build_layer(cfg, make_weights(cfg, 2, dev), group, d_name, "reference", dev)
        if fault == "dies_mid_call" and rank == 1:
            def die(*args, **kwargs):
                report(Outcome(fault, f"{d_name} (gloo)", rank, "died (the fault)", "", time.monotonic() - t0, None))
                time.sleep(0.5)  # the report is on its way
                os._exit(0)
            moe.dispatcher.combine = die
        x, ids, w = faulty_inputs(fault, cfg, rank, dev)
        try:
            moe(x, weights_TK=w, ids_TK=ids)
        except Exception as e:  # the fault's error: what the report is about
            ended, error = "error", describe(e)
    seconds = time.monotonic() - t0
    if fault == "dies_mid_call":  # the survivor's fresh group: itself alone
        fresh = dist.new_group([rank], timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=True)
    else:
        fresh = _aligned_group(timeout_s)
    ok, why = _fresh_layer_ok(FAULT_CFG, fresh, d_name, rank, dev)
    report(Outcome(fault, f"{d_name} (gloo)", rank, ended, error, seconds, ok, why))


def fault_rank(ctx, report, faults: tuple[str, ...], d_names: tuple[str, ...], timeout_s: float, threads: int) -> None:
    """Every fault in `faults` with every dispatcher, each on a new group whose collectives time out after
    timeout_s (a death ends this rank's list: give it a launch of its own); `threads` torch CPU threads."""
    torch.set_num_threads(threads)
    for fault in faults:
        for d_name in d_names:
            _attempt(fault, d_name, ctx, _aligned_group(timeout_s), report, timeout_s)


def _aligned_group(timeout_s: float):
    """A new group of both ranks whose collectives time out after timeout_s, made once both have got here (a
    barrier of the default group, whose time-out is long): a rank that ended its call early does not give up
    connecting while the other still waits out its time-out."""
    dist.barrier()
    return dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s))


def group_faults(timeout_s: float, faults=FAULTS, d_names=("allgather", "alltoall"), threads: int = 1) -> list[Outcome]:
    """Every fault over 2 gloo ranks: the faults that leave both ranks alive in one launch, a death in a
    launch of its own per dispatcher. A rank that never reported is an Outcome "hung"."""
    launches = [(tuple(f for f in faults if f != "dies_mid_call"), d_names)]
    if "dies_mid_call" in faults:
        launches += [(("dies_mid_call",), (d,)) for d in d_names]
    outcomes = []
    for these, ds in launches:
        if not these:
            continue
        deadline = 60 + len(these) * len(ds) * 4 * timeout_s
        got, codes = run_ranks(fault_rank, 2, (these, ds, timeout_s, threads), deadline)
        outcomes += got
        reported = {(o.fault, o.path, o.rank) for o in got}
        for f in these:
            for d in ds:
                for r, code in enumerate(codes):
                    if (f, f"{d} (gloo)", r) not in reported:
                        ended = "hung (killed at the deadline)" if code is None else \
                            f"process ended (exit code {code}) before its report"
                        outcomes.append(Outcome(f, f"{d} (gloo)", r, ended, "", deadline, None))
    return outcomes


# -- emulated ranks --------------------------------------------------------------------------------------


def _emulated_call(fault: str, cfg: MoEConfig, d_key: str, device: torch.device, timeout_s: float) -> list[Outcome]:
    """One two-rank emulated call under `fault`, then a fresh world's call; both ranks' outcomes."""
    label = d_key.replace("_sync_free", "(sync_free)")
    weights = make_weights(cfg, 2, device)
    ds, ex = emulated_world(cfg, 2, d_key, "reference", weights.w13_END, weights.w2_EDF, device,
                            wait_timeout_s=timeout_s)
    other_ds = other_ex = None
    if fault == "other_config":
        w_other = make_weights(OTHER_CFG, 2, device)
        other_ds, other_ex = emulated_world(OTHER_CFG, 2, d_key, "reference", w_other.w13_END, w_other.w2_EDF, device,
                                            wait_timeout_s=timeout_s)
    inputs = [faulty_inputs(fault, OTHER_CFG if fault == "other_config" and r == 1 else cfg, r, device)
              for r in range(2)]
    errors, t0 = ["", ""], time.monotonic()
    ranks = [ds[0], (other_ds or ds)[1]]
    experts = [ex[0], (other_ex or ex)[1]]
    skip = {1} if fault == "never_arrives" else set()
    pending, batches = {}, {}
    for phase in ("dispatch_send", "dispatch_recv", "experts", "combine_send", "combine_recv"):
        for r in range(2):
            if r in skip or errors[r]:
                continue
            try:
                if phase == "dispatch_send":
                    pending[r] = ranks[r].dispatch_send(*inputs[r])
                elif phase == "dispatch_recv":
                    batches[r] = ranks[r].dispatch_recv(pending[r])
                elif phase == "experts":
                    pending[r] = experts[r](batches[r])
                elif phase == "combine_send":
                    pending[r] = ranks[r].combine_send(pending[r], batches[r])
                else:
                    pending[r] = ranks[r].combine_recv(pending[r])
            except Exception as e:  # the fault's error, what the report is about
                errors[r] = describe(e)
        if fault == "dies_mid_call" and phase == "dispatch_recv":
            skip.add(1)  # rank 1 is gone before its combine
    seconds = time.monotonic() - t0
    fresh_ok, fresh_why = _emulated_fresh_ok(cfg, d_key, device, timeout_s)
    out = []
    for r in range(2):
        if r in skip:
            ended = "skipped the call" if fault == "never_arrives" else "died (the fault)"
            out.append(Outcome(fault, f"{label} (emulated)", r, ended, "", seconds, fresh_ok, fresh_why))
            continue
        flag = ranks[r].timed_out()
        if errors[r]:
            ended, error = "error", errors[r]
        elif flag:
            ended, error = "error", "timed_out() is True: a device-side wait gave up (no host sync to raise at)"
        else:
            ended, error = "output", ""
        out.append(Outcome(fault, f"{label} (emulated)", r, ended, error, seconds, fresh_ok, fresh_why))
    return out


def _emulated_fresh_ok(cfg: MoEConfig, d_key: str, device: torch.device, timeout_s: float) -> tuple[bool, str]:
    try:
        weights = make_weights(cfg, 1, device)
        ds, ex = emulated_world(cfg, 2, d_key, "reference", weights.w13_END, weights.w2_EDF, device,
                                wait_timeout_s=timeout_s)
        inputs = [faulty_inputs("none", cfg, r, device) for r in range(2)]
        outs = emulated_step(ds, ex)(inputs)
        oracle = MoERef.build(weights.w13_END, weights.w2_EDF, device=device)
        errs = [rel_error(out, oracle(*inp)) for out, inp in zip(outs, inputs)]
        ok = max(errs) <= tolerance(cfg) and not any(d.timed_out() for d in ds)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an illegal memory access earlier would surface here
        return ok, "" if ok else f"rel err {max(errs):.3g}"
    except Exception as e:  # the report says how the fresh world failed
        return False, describe(e)


def emulated_faults(device: torch.device, timeout_s: float, faults=FAULTS,
                    d_keys=("ht", "ht_sync_free", "ll")) -> tuple[list[Outcome], str]:
    """Every fault on two emulated ranks of each dispatcher; (outcomes, why skipped or "")."""
    ok, why = emulated_available(device)
    if not ok:
        return [], why
    return [o for fault in faults for d_key in d_keys
            for o in _emulated_call(fault, FAULT_CFG, d_key, device, timeout_s)], ""
