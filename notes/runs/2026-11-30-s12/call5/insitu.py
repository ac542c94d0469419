"""In-situ: the gate-up of the layer's own batches (ht through its row index, ht materialized, ll batched,
alltoall contiguous), timed alone after the layer ran; plus per-expert count stats."""
import os, statistics, torch, torch.distributed as dist
from epmoe.bench.dispatch import NVLINK_ENV
from epmoe.launch import spawn
from epmoe.testing import GPU_SPEC, build_layer, rank_inputs
from epmoe.kernels.grouped_gemm import ExpertRows, gate_up
from epmoe.interfaces import Layout

def t_us(fn, n=10):
    for _ in range(3): fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)

def rank(ctx):
    inp = rank_inputs(GPU_SPEC, ctx.rank, ctx.world_size, ctx.device)
    out = []
    for name in ("ht", "ll", "alltoall"):
        moe = build_layer(inp.cfg, inp.weights, ctx.group, name, "triton", ctx.device)
        got = {}
        inner = moe.experts._forward
        def fwd(batch, inner=inner, got=got):
            got["b"] = batch
            return inner(batch)
        moe.experts._forward = fwd
        for _ in range(2):
            moe(inp.x_TD, inp.logits_TE, correction_bias_E=inp.weights.correction_bias_E)
        torch.cuda.synchronize(); dist.barrier()
        b, w13 = got["b"], moe.experts.w13
        counts = b.counts_L.long()
        tiles = int(((counts + 127) // 128).sum())
        if b.layout is Layout.CONTIGUOUS:
            rows = ExpertRows.contiguous(b.offsets_L1)
            x = b.x.reshape(-1, b.x.shape[-1])
            us = t_us(lambda: gate_up(x, w13, rows, x_rows_R=b.row_index_N))
            line = f"{name}: gate_up {'idx' if b.row_index_N is not None else 'contig'} {us:.0f}"
            if b.row_index_N is not None:
                m = b.materialize()
                us2 = t_us(lambda: gate_up(m.x, w13, rows))
                line += f", materialized {us2:.0f}"
        else:
            M = b.x.shape[1]
            rows = ExpertRows.batched_slots(b.counts_L, M)
            hint = moe.experts._batched_rows_hint(M)
            x = b.x.reshape(-1, b.x.shape[-1])
            us = t_us(lambda: gate_up(x, w13, rows, rows_hint=hint))
            line = f"{name}: gate_up batched {us:.0f}"
        line += (f"; rows {int(counts.sum())}, tiles {tiles}, count min/max {int(counts.min())}/{int(counts.max())}"
                 f" std {counts.float().std():.1f}")
        out.append(f"rank {ctx.rank} {line}")
        moe.experts._forward = inner
    return out

if __name__ == "__main__":
    for k, v in NVLINK_ENV.items(): os.environ.setdefault(k, v)
    res = spawn(rank, 2, "cuda", (), timeout_s=300)
    for r in res:
        for l in r: print(l)
