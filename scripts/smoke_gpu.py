"""First-contact checks on the GPU machine: symmetric memory, Triton peer stores and signals, peer-store
bandwidth, torch._grouped_mm's signature. Run: python3 scripts/smoke_gpu.py (needs 2 GPUs)."""
import json
import sys
import time

import torch
import triton
import triton.language as tl

from epmoe.launch import spawn
from epmoe.symm import BufferSpec, torch_workspace


@triton.jit
def _peer_copy(src, peers_R, peer, sig_R, n_rows, D: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    npid = tl.num_programs(0)
    dst = tl.load(peers_R + peer).to(tl.pointer_type(tl.bfloat16))
    cols = tl.arange(0, D)
    for r in range(pid * ROWS, n_rows, npid * ROWS):
        rows = r + tl.arange(0, ROWS)
        m = rows[:, None] < n_rows
        v = tl.load(src + rows[:, None] * D + cols[None, :], mask=m)
        tl.store(dst + rows[:, None] * D + cols[None, :], v, mask=m)
    tl.debug_barrier()
    sig = tl.load(sig_R + peer).to(tl.pointer_type(tl.int32))
    tl.atomic_add(sig, 1, sem="release", scope="sys")


@triton.jit
def _wait(sig, target):
    while tl.atomic_add(sig, 0, sem="acquire", scope="sys") < target:
        pass


def worker(ctx):
    out = {}
    D, N = 4096, 8192  # 64 MiB of bf16
    specs = [BufferSpec("x", (N, D), torch.bfloat16), BufferSpec("sig", (1,), torch.int32)]
    ws = torch_workspace(specs, ctx.group, ctx.device)
    src = torch.randn(N, D, dtype=torch.bfloat16, device=ctx.device) + ctx.rank
    peer = 1 - ctx.rank
    sig_local = ws.local("sig")
    results = {}
    for progs in (16, 32, 66, 132):
        for rows in (1, 2, 4):
            _peer_copy[(progs,)](src, ws.peers("x"), peer, ws.peers("sig"), N, D=D, ROWS=rows)
            torch.distributed.barrier(ctx.group)
            torch.cuda.synchronize()
            t0 = torch.cuda.Event(enable_timing=True); t1 = torch.cuda.Event(enable_timing=True)
            reps = 10
            t0.record()
            for _ in range(reps):
                _peer_copy[(progs,)](src, ws.peers("x"), peer, ws.peers("sig"), N, D=D, ROWS=rows)
            t1.record(); torch.cuda.synchronize()
            ms = t0.elapsed_time(t1) / reps
            results[f"{progs}x{rows}"] = round(N * D * 2 / ms / 1e6, 1)
            torch.distributed.barrier(ctx.group)
    count = int(sig_local.item())
    _wait[(1,)](sig_local, count)
    torch.cuda.synchronize()
    ok = torch.equal(ws.local("x"), src - ctx.rank + peer)
    out["peer_store_GBps"] = results
    out["data_ok"] = bool(ok)
    out["signals"] = count
    # copy_ into the peer view for comparison
    peer_view = ws.handle.get_buffer(peer, (N * D * 2,), torch.uint8) if hasattr(ws.handle, "get_buffer") else None
    if peer_view is not None:
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(10):
            peer_view.copy_(src.view(torch.uint8).reshape(-1))
        torch.cuda.synchronize()
        out["copy_GBps"] = round(N * D * 2 * 10 / (time.perf_counter() - t0) / 1e9, 1)
    torch.distributed.barrier(ctx.group)
    return out


def main():
    print(torch.__version__, triton.__version__, torch.cuda.device_count(), flush=True)
    info = {"grouped_mm": hasattr(torch, "_grouped_mm")}
    if info["grouped_mm"]:
        a = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(4, 256, 128, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([16, 32, 48, 64], device="cuda", dtype=torch.int32)
        try:
            y = torch._grouped_mm(a, b, offs=offs)
            ref = torch.cat([a[i * 16:(i + 1) * 16] @ b[i] for i in range(4)])
            info["grouped_mm_err"] = float((y.float() - ref.float()).abs().max())
            bt = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
            torch._grouped_mm(a, bt.transpose(1, 2), offs=offs)  # a transposed view of b is accepted
            info["grouped_mm_transposed_ok"] = True
            offs2 = torch.tensor([5, 21, 40, 64], device="cuda", dtype=torch.int32)
            y3 = torch._grouped_mm(a, b, offs=offs2)
            ref3 = torch.cat([a[lo:hi] @ b[i] for i, (lo, hi) in enumerate(zip([0, 5, 21, 40], [5, 21, 40, 64]))])
            info["grouped_mm_unaligned_err"] = float((y3.float() - ref3.float()).abs().max())
        except Exception as e:  # noqa: BLE001 - report anything
            info["grouped_mm_error"] = repr(e)[:300]
    print(json.dumps(info), flush=True)
    res = spawn(worker, 2, device="cuda")
    print(json.dumps(res, indent=1), flush=True)


if __name__ == "__main__":
    sys.exit(main())
