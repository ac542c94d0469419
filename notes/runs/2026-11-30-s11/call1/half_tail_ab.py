"""A/B of HALF_TAIL in the grouped GEMMs (run in a tree with notes/half_tail.patch applied), 1 GPU.
Random per-expert counts (t on average, L=32, D 7168, F 2048), table configs, contiguous and gather."""
import sys
import torch
import triton.testing
sys.path.insert(0, ".")
import epmoe.kernels.grouped_gemm as gg
from epmoe.kernels.grouped_gemm import ExpertRows, down, down_ref, gate_up, gate_up_ref
from epmoe.kernels.quant import quantize_act
from epmoe.quant import dequantize_act_ref, quantize_weight_ref

D, F, L = 7168, 2048, 32
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
w13 = torch.randn(L, 2 * F, D, dtype=torch.bfloat16, device=dev, generator=g).mul_(D ** -0.5)
w2 = torch.randn(L, D, F, dtype=torch.bfloat16, device=dev, generator=g).mul_(F ** -0.5)
p13 = [quantize_weight_ref(w) for w in w13]; p2 = [quantize_weight_ref(w) for w in w2]
q13, s13 = torch.stack([q for q, _ in p13]), torch.stack([s for _, s in p13])
q2, s2 = torch.stack([q for q, _ in p2]), torch.stack([s for _, s in p2])
ON = gg.HALF_TAIL_MIN_BLOCK_M


def rows_for(t):
    counts = torch.bincount(torch.randint(0, L, (L * t,), device=dev, generator=g), minlength=L)
    return ExpertRows.contiguous(torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32))


def case(name, fn, check):
    res = {}
    for rep in range(2):
        for tag, thr in (("off", 1 << 30), ("on", ON)):
            gg.HALF_TAIL_MIN_BLOCK_M = thr
            if rep == 0:
                err = check(fn())
                print(f"# {name} {tag}: rel err {err:.2e}", flush=True)
                assert err < 3e-2, (name, tag, err)
            res.setdefault(tag, []).append(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    off, on = min(res["off"]), min(res["on"])
    print(f"{name}: off {off*1e3:.0f} us  on {on*1e3:.0f} us  on/off {on/off:.3f}", flush=True)


def rel(got, ref):
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


for t in (256, 512):
    rows = rows_for(t)
    R = int(rows.index_L[-1])
    x = torch.randn(R, D, dtype=torch.bfloat16, device=dev, generator=g)
    h = torch.randn(R, F, dtype=torch.bfloat16, device=dev, generator=g)
    perm = torch.randperm(R, device=dev, generator=g).to(torch.int32)
    xq, xs = quantize_act(x)
    hq, hs = quantize_act(h)
    case(f"t={t} gate_up bf16", lambda: gate_up(x, w13, rows)[0],
         lambda o: rel(o.float(), gate_up_ref(x, w13, rows)))
    case(f"t={t} gate_up bf16 gather", lambda: gate_up(x, w13, rows, x_rows_R=perm)[0],
         lambda o: rel(o.float(), gate_up_ref(x, w13, rows, x_rows_R=perm)))
    case(f"t={t} gate_up fp8", lambda: gate_up(xq, q13, rows, x_scale_RG=xs, w13_scale=s13),
         lambda o: rel(dequantize_act_ref(*o), gate_up_ref(xq, q13, rows, x_scale_RG=xs, w13_scale=s13)))
    case(f"t={t} gate_up fp8 gather", lambda: gate_up(xq, q13, rows, x_scale_RG=xs, w13_scale=s13, x_rows_R=perm),
         lambda o: rel(dequantize_act_ref(*o), gate_up_ref(xq, q13, rows, x_scale_RG=xs, w13_scale=s13, x_rows_R=perm)))
    case(f"t={t} down bf16", lambda: down(h, w2, rows), lambda o: rel(o.float(), down_ref(h, w2, rows)))
    case(f"t={t} down fp8", lambda: down(hq, q2, rows, h_scale_RG=hs, w2_scale=s2, out_dtype=torch.bfloat16),
         lambda o: rel(o.float(), down_ref(hq, q2, rows, h_scale_RG=hs, w2_scale=s2)))
