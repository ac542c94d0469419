"""Randomized load through every path the library lists, each output against the float64 oracle.

A path is a dispatcher x experts x precision that `testing.plan` allows (the library's own
`list_dispatchers`, `list_experts` and pairing checks), run where it runs:
- single rank: `local`, in this process;
- ranks of a process group (gloo on CPU, NCCL on GPUs): the whole FusedMoE (a shared expert, routed
  scaling, chunking where the dispatcher can agree on a chunk count), in ranks started by the caller;
- emulated ranks (`ht`, `ht(sync_free)`, `ll` over an EmulatedGroup): every rank in this process, phase by
  phase (every rank's send, then every rank's receive), on the CPU under the Triton interpreter or on one GPU.

Every call draws, per rank and from (seed, path, call, rank) alone, a token count (0 and 1 often, up to
2.5 chunks where the path chunks), a routing (uniform, skewed to one hot expert, -1 holes, all to one expert,
all -1), weights and tokens; the output is compared with the oracle (relative L2 error within
`testing.TOLERANCES`) and hashed. The first `reruns` calls then run again on a freshly built layer: equal
hashes mean the path is deterministic. Device memory (allocated, and reserved with the allocator's free
blocks let go first) and host RSS are sampled every `sample_every` calls; growth is counted from the end of
the warm-up (on a GPU, first one call per power-of-two token count, which captures every CUDA graph bucket
of `local` and compiles each kernel specialization, made on first use; then the first tenth of the calls).

Shape letters: T tokens of one rank, D hidden size, K top-k, E experts, R ranks.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..dispatch.ht import HtDispatcher
from ..oracle import MoERef
from ..registry import dispatcher_class, make_dispatcher, make_experts
from ..symm import EmulatedGroup
from ..testing import build_layer, layer_oracle, make_weights, plan, rel_error, tolerance

PRECISIONS = {"fp32": {"dtype": torch.float32}, "bf16": {"dtype": torch.bfloat16},
              "fp8_block": {"dtype": torch.bfloat16, "quant": "fp8_block"}}
ROUTINGS = ("uniform", "skewed", "holes", "one_expert", "none")
# (measured: 3-6% rel err on random bf16 rows; ties are rounded away from even too)
INTERPRETED_HT_FP8 = "under the Triton interpreter the ht send kernel's fp8 cast rounds about 2% of values wrong " \
                     "(a carry into the next binade dropped); runs on a GPU"
WAIT_TIMEOUT_S = 10.0  # device-side waits of emulated ranks: every peer has sent before a rank waits

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x_TD, ids_TK, weights_TK
Step = Callable[[list[Inputs]], list[torch.Tensor]]  # one call: the inputs of the ranks here -> their outputs


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """Shapes and volume of a load run (the same on every rank)."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    max_tokens_per_rank: int  # Tmax: the chunk size, and the buffers of ht / ll
    calls: int  # layer calls per path
    interpreted_calls: int  # per path that runs Triton kernels under the interpreter (CPU; about 1 s a call)
    reruns: int  # calls run again on a fresh layer to compare hashes
    emulated_ranks: int
    seed: int = 0
    sample_every: int = 10

    def config(self, precision: str) -> MoEConfig:
        return MoEConfig(num_experts=self.num_experts, top_k=self.top_k, hidden_size=self.hidden_size,
                         intermediate_size=self.intermediate_size, max_tokens_per_rank=self.max_tokens_per_rank,
                         routed_scaling_factor=2.0, **PRECISIONS[precision])


CPU_LOAD = LoadSpec(num_experts=12, top_k=3, hidden_size=64, intermediate_size=32, max_tokens_per_rank=8,
                    calls=1000, interpreted_calls=20, reruns=20, emulated_ranks=3)
GPU_LOAD = LoadSpec(num_experts=32, top_k=4, hidden_size=512, intermediate_size=256, max_tokens_per_rank=64,
                    calls=200, interpreted_calls=200, reruns=20, emulated_ranks=4)


def calls_of(spec: LoadSpec, device: torch.device, interpreted: bool) -> int:
    """Calls per path: fewer where Triton kernels run under the interpreter (on the CPU)."""
    return spec.interpreted_calls if interpreted and device.type == "cpu" else spec.calls


def call_inputs(cfg: MoEConfig, seed: int, path: str, call: int, rank: int, max_tokens: int,
                device: torch.device, tokens: int | None = None) -> Inputs:
    """One rank's inputs of one call, drawn from (seed, path, call, rank) alone (`tokens`: T, else drawn)."""
    key = hashlib.sha256(f"{seed}/{path}/{call}/{rank}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    E, K, D = cfg.num_experts, cfg.top_k, cfg.hidden_size
    u = float(torch.rand((), generator=g))
    T = 0 if u < 0.15 else 1 if u < 0.25 else int(torch.randint(2, max_tokens + 1, (), generator=g))
    T = T if tokens is None else tokens
    routing = ROUTINGS[int(torch.randint(len(ROUTINGS), (), generator=g))]
    scores_TE = torch.rand(T, E, generator=g)
    if routing == "skewed":  # most tokens' first choice is one hot expert
        scores_TE[torch.rand(T, generator=g) < 0.8, call % E] += 2.0
    ids_TK = scores_TE.argsort(dim=1, descending=True)[:, :K].to(torch.int32)
    if routing == "holes":
        ids_TK = ids_TK.masked_fill(torch.rand(T, K, generator=g) < 0.3, -1)
    elif routing == "one_expert":
        ids_TK = torch.full_like(ids_TK, -1)
        ids_TK[:, 0] = E - 1
    elif routing == "none":
        ids_TK = torch.full_like(ids_TK, -1)
    weights_TK = torch.rand(T, K, generator=g) * 2 + 0.05
    x_TD = torch.randn(T, D, generator=g).to(cfg.dtype)
    return x_TD.to(device), ids_TK.to(device), weights_TK.to(device)


def digest(outs: Sequence[torch.Tensor]) -> str:
    """sha256 of the outputs' bytes, in order."""
    h = hashlib.sha256()
    for out in outs:
        t = out.detach().cpu().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes) if t.nbytes else b"")
    return h.hexdigest()[:16]


def rss_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@dataclass
class MemoryTrace:
    """Samples of (call, device allocated, device reserved, host RSS) bytes; device 0 on the CPU."""

    device: torch.device
    samples: list[tuple[int, int, int, int]] = field(default_factory=list)

    def sample(self, call: int) -> None:
        """One sample after `call`. On a GPU the allocator's cache of free blocks is emptied first, so that
        reserved counts the segments something holds (live tensors, CUDA graph pools), not the free ones
        a call of a new size left cached."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            allocated, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        else:
            allocated = reserved = 0
        self.samples.append((call, allocated, reserved, rss_bytes()))

    def growth(self, warmup_calls: int) -> dict[str, int]:
        """Per quantity, the largest sample after the warm-up less the first sample at or after its end."""
        after = [s for s in self.samples if s[0] >= warmup_calls]
        if len(after) < 2:
            return {"allocated": 0, "reserved": 0, "rss": 0}
        return {name: max(s[i] for s in after) - after[0][i] for i, name in
                enumerate(("allocated", "reserved", "rss"), start=1)}


@dataclass
class Tally:
    """What one path did: calls made, outputs compared (one per rank and call with T > 0), mismatches
    (an output off the oracle by more than the tolerance, not finite, of the wrong shape or dtype, or a
    call that raised or whose device-side wait gave up), the largest error, the hashes of every call and
    how many of the reruns hashed equal."""

    path: str
    tolerance: float
    calls: int = 0
    outputs: int = 0
    mismatches: int = 0
    max_error: float = 0.0
    first_mismatch: str = ""
    hashes: list[str] = field(default_factory=list)
    rerun_equal: int = 0
    reruns: int = 0
    memory_growth: dict[str, int] = field(default_factory=dict)

    def fail(self, call: int, why: str) -> None:
        self.mismatches += 1
        self.first_mismatch = self.first_mismatch or f"call {call}: {why}"

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "hashes"} | {"digest": digest_of(self.hashes)}


def digest_of(hashes: Sequence[str]) -> str:
    return hashlib.sha256("".join(hashes).encode()).hexdigest()[:16]


def check_outputs(tally: Tally, call: int, inputs: list[Inputs], outs: list[torch.Tensor], oracle: MoERef,
                  dtype: torch.dtype) -> None:
    """Each rank's output against the oracle (one oracle call for all the ranks' tokens)."""
    want = oracle(torch.cat([x for x, _, _ in inputs]), torch.cat([ids for _, ids, _ in inputs]),
                  torch.cat([w for _, _, w in inputs])).split([x.shape[0] for x, _, _ in inputs])
    for (x, _, _), out, ref in zip(inputs, outs, want):
        if out.shape != x.shape or out.dtype != dtype:
            tally.fail(call, f"output {tuple(out.shape)} {out.dtype}, want {tuple(x.shape)} {dtype}")
            continue
        if x.shape[0] == 0:
            continue
        err = rel_error(out, ref)
        tally.outputs += 1
        tally.max_error = max(tally.max_error, err)
        if not err <= tally.tolerance:  # also NaN
            tally.fail(call, f"rel err {err:.3g} > {tally.tolerance:g} (T {x.shape[0]})")


def warmup_tokens(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to max_tokens, and max_tokens."""
    counts = [1 << i for i in range(max(1, max_tokens).bit_length()) if 1 << i < max_tokens]
    return counts + [max_tokens]


def drive(tally: Tally, build: Callable[[], Step], cfg: MoEConfig, oracle: MoERef, spec: LoadSpec, calls: int,
          ranks: list[int], max_tokens: int, device: torch.device, healthy: Callable[[], bool] = lambda: True,
          any_rank: Callable[[bool], bool] = lambda failed: failed) -> None:
    """`calls` calls through a layer from build(), then spec.reruns of them through a fresh one; fills
    `tally`. `ranks`: the ranks whose inputs this process feeds; `healthy()` is False once a device-side
    wait of the layer gave up; any_rank(failed) tells whether a call failed on any rank of a process group
    (then every rank stops the path, so that none goes on into collectives the others have left)."""
    step, trace = build(), MemoryTrace(device)
    inputs_of = lambda call: [call_inputs(cfg, spec.seed, tally.path, call, r, max_tokens, device)  # noqa: E731
                              for r in ranks]
    every = max(1, min(spec.sample_every, calls // 10))

    def attempt(call: int, inputs: list[Inputs], what: str = "call", label: str = "") -> list | None:
        """step(inputs), or None once its failure is tallied (here or on another rank: every rank stops)."""
        try:
            outs = step(inputs)
        except Exception as e:  # a failing call is a mismatch of the path, not the end of the soak
            tally.fail(call, f"{label}{type(e).__name__}: {e}")
            any_rank(True)
            return None
        if any_rank(False):
            tally.fail(call, f"the {what} failed on another rank")
            return None
        return outs

    if device.type == "cuda":  # one call per power-of-two token count: the layer's CUDA graph buckets
        for i, T in enumerate(warmup_tokens(max_tokens)):  # and kernel specializations, made on first use
            inputs = [call_inputs(cfg, spec.seed, f"{tally.path}/warm-up", i, r, max_tokens, device, tokens=T)
                      for r in ranks]
            if attempt(-1, inputs, "warm-up", f"warm-up, T {T}: ") is None:
                return
    for call in range(calls):
        inputs = inputs_of(call)
        tally.calls += 1
        outs = attempt(call, inputs)
        if outs is None:
            break
        tally.hashes.append(digest(outs))
        check_outputs(tally, call, inputs, outs, oracle, cfg.dtype)
        if not healthy():
            tally.fail(call, "a device-side wait gave up")
            break
        del outs, inputs  # (device memory is sampled with nothing of the call left)
        if call % every == 0 or call == calls - 1:
            trace.sample(call)
    tally.memory_growth = trace.growth(max(2, calls // 10))
    del step
    if any_rank(bool(tally.mismatches)) or not spec.reruns:  # (every rank reruns, or none)
        return
    step = build()
    tally.reruns = min(spec.reruns, calls)
    tally.rerun_equal = sum(digest(step(inputs_of(call))) == tally.hashes[call] for call in range(tally.reruns))


def group_paths(cfg: MoEConfig, group, device: torch.device,
                experts: Sequence[str] | None = None) -> tuple[list[tuple[str, str, str]], list]:
    """(path label, dispatcher key, experts name) of every run `plan` allows over `group` (a process group,
    None, or an EmulatedGroup) with `experts` (None: every available one), `ht` also as ht(sync_free)
    (key "ht_sync_free"); and plan's skipped list."""
    todo = plan(cfg, group, device, experts)
    runs = []
    for d_name, e_name in todo.runs:
        runs.append((d_name, d_name, e_name))
        if d_name == "ht":
            runs.append(("ht(sync_free)", "ht_sync_free", e_name))
    return runs, todo.skipped


def make_dispatcher_for(d_key: str, cfg: MoEConfig, group):
    """The dispatcher of a group_paths key (a name, or "ht_sync_free") over a process group or None."""
    if d_key == "ht_sync_free":
        return HtDispatcher(cfg, group, sync_free=True)
    return make_dispatcher(d_key, cfg, group)


def _any_rank(failed: bool, group, device: torch.device) -> bool:
    """Whether `failed` on any rank of `group` (None: this one)."""
    if group is None:
        return failed
    flag = torch.tensor([int(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def chunk_tokens(cfg: MoEConfig, d_key: str) -> int:
    """The most tokens a call may give a layer with the dispatcher of a group_paths key: 2.5 chunks where it
    syncs the host (FusedMoE agrees a chunk count), else one chunk."""
    syncs = d_key != "ht_sync_free" and dispatcher_class(d_key).needs_host_sync
    return cfg.max_tokens_per_rank * 5 // 2 if syncs else cfg.max_tokens_per_rank


def soak_layers(spec: LoadSpec, precisions: Sequence[str], group, rank: int, world_size: int, device: torch.device,
                experts: Sequence[str] | None = None) -> tuple[list[Tally], list[tuple[str, str, str]]]:
    """Every FusedMoE path over `group` (None: one rank) with `experts` (None: all); this rank's tallies and the
    skipped runs."""
    tallies, skipped = [], []
    for prec in precisions:
        cfg = spec.config(prec)
        weights = make_weights(cfg, spec.seed, device)
        oracle = layer_oracle(cfg, weights, shared=True, device=device)
        runs, skips = group_paths(cfg, group, device, experts)
        skipped += [(d, e, f"{prec}: {why}") for d, e, why in skips]
        for label, d_key, e_name in runs:
            where = "1 rank" if group is None else f"{world_size} {'gloo' if device.type == 'cpu' else 'nccl'} ranks"
            tally = Tally(f"{label}/{e_name}/{prec} ({where})", tolerance(cfg))
            max_tokens = chunk_tokens(cfg, d_key)

            def build(d_key=d_key, e_name=e_name, cfg=cfg, weights=weights) -> Step:
                moe = build_layer(cfg, weights, group, make_dispatcher_for(d_key, cfg, group), e_name, device)
                return lambda inputs: [moe(x, weights_TK=w, ids_TK=ids) for x, ids, w in inputs]
            drive(tally, build, cfg, oracle, spec, calls_of(spec, device, e_name == "triton"), [rank], max_tokens,
                  device, any_rank=lambda failed: _any_rank(failed, group, device))
            tallies.append(tally)
    return tallies, skipped


def emulated_step(dispatchers: list, experts: list) -> Step:
    """One call of every emulated rank, phase by phase."""
    def step(inputs: list[Inputs]) -> list[torch.Tensor]:
        pending = [d.dispatch_send(*inp) for d, inp in zip(dispatchers, inputs)]
        batches = [d.dispatch_recv(p) for d, p in zip(dispatchers, pending)]
        ys = [e(b) for e, b in zip(experts, batches)]
        pending = [d.combine_send(y, b) for d, y, b in zip(dispatchers, ys, batches)]
        return [d.combine_recv(p) for d, p in zip(dispatchers, pending)]
    return step


def emulated_world(cfg: MoEConfig, R: int, d_key: str, e_name: str, w13_END: torch.Tensor, w2_EDF: torch.Tensor,
                   device: torch.device, **options) -> tuple[list, list]:
    """R emulated ranks' dispatchers (d_key as in group_paths, with `options`) and loaded experts."""
    groups = EmulatedGroup.world(R)
    if d_key == "ht_sync_free":
        dispatchers = [HtDispatcher(cfg, g, sync_free=True, device=device, **options) for g in groups]
    else:
        dispatchers = [make_dispatcher(d_key, cfg, g, device=device, **options) for g in groups]
    L = cfg.num_experts // R
    experts = []
    for r, d in enumerate(dispatchers):
        e = make_experts(e_name, cfg, L, device, d.layout)
        e.load(w13_END[r * L:(r + 1) * L], w2_EDF[r * L:(r + 1) * L])
        experts.append(e)
    return dispatchers, experts


def emulated_available(device: torch.device) -> tuple[bool, str]:
    """Emulated ranks run Triton kernels: on a GPU, or on the CPU under the interpreter (TRITON_INTERPRET=1 in
    the environment before Python starts; read here only to report it)."""
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return True, "ok"
    return False, "emulated ranks run Triton kernels: on the CPU they need TRITON_INTERPRET=1"


def soak_emulated(spec: LoadSpec, precisions: Sequence[str], device: torch.device,
                  experts: Sequence[str] | None = None) -> tuple[list[Tally], list[tuple[str, str, str]]]:
    """Every path over spec.emulated_ranks emulated ranks with `experts` (None: all); tallies and the skipped
    runs."""
    ok, why = emulated_available(device)
    if not ok:
        return [], [("ht, ll", "*", why)]
    R = spec.emulated_ranks
    tallies, skipped = [], []
    for prec in precisions:
        cfg = spec.config(prec)
        weights = make_weights(cfg, spec.seed, device)
        oracle = MoERef.build(weights.w13_END, weights.w2_EDF, fp8=cfg.quant == "fp8_block", device=device)
        runs, skips = group_paths(cfg, EmulatedGroup.world(R)[0], device, experts)
        skipped += [(d, e, f"{prec}: {why}") for d, e, why in skips if d not in ("local", "allgather", "alltoall")]
        for label, d_key, e_name in runs:
            if d_key.startswith("ht") and cfg.quant == "fp8_block" and device.type == "cpu":
                skipped.append((label, e_name, f"{prec}: {INTERPRETED_HT_FP8}"))
                continue
            tally = Tally(f"{label}/{e_name}/{prec} ({R} emulated ranks)", tolerance(cfg))
            holder: list = []

            def build(d_key=d_key, e_name=e_name, cfg=cfg, weights=weights) -> Step:
                dispatchers, experts = emulated_world(cfg, R, d_key, e_name, weights.w13_END, weights.w2_EDF, device,
                                                      wait_timeout_s=WAIT_TIMEOUT_S)
                holder[:] = dispatchers
                return emulated_step(dispatchers, experts)
            drive(tally, build, cfg, oracle, spec, calls_of(spec, device, True), list(range(R)),
                  cfg.max_tokens_per_rank, device,
                  healthy=lambda: not any(d.timed_out() for d in holder))
            tallies.append(tally)
    return tallies, skipped
