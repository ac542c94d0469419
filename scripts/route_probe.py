"""Routing on one GPU: the Triton kernel (`epmoe.kernels.routing.route_topk`, what `epmoe.route` runs on
a GPU) against route's torch version, per call: host time (calls queued behind a GPU spin) and GPU time
(back-to-back calls behind a spin), for DeepSeek-V3's grouped sigmoid choice, Qwen3-MoE's softmax
top-8 of 128 and Mixtral's top-2 of 8, at several token counts (bf16 logits). The floor: the logits
read once (T * E * 2 bytes at the 4.16 TB/s device copy rate: 0.5 µs for [4096, 256]).

    python3 scripts/route_probe.py [--calls 40]
"""
from __future__ import annotations

import argparse

import torch

import epmoe
import epmoe.routing
from epmoe.timing import gpu_us, host_us

CASES = {
    "deepseek_v3": dict(E=256, K=8, scoring="sigmoid", num_groups=8, topk_groups=4, bias=True),
    "qwen3_moe": dict(E=128, K=8, scoring="softmax", bias=False),
    "mixtral": dict(E=8, K=2, scoring="softmax", bias=False),
}


def _time(fn, calls: int) -> tuple[float, float]:
    """(host µs, GPU µs) per call of fn over `calls` calls queued behind a spin (`epmoe.timing.host_us`,
    `gpu_us`: the host's queueing, and the work's own time, not the host's pace)."""
    return host_us(fn, calls), gpu_us(fn, calls)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}; µs per call; host: queueing; gpu: the calls' own time")
    print(f"{'case':12} {'T':>6}  {'kernel host':>11} {'gpu':>7}  {'torch host':>10} {'gpu':>7}  "
          f"{'host ratio':>10} {'gpu ratio':>9}")
    for name, c in CASES.items():
        cfg = epmoe.MoEConfig(num_experts=c["E"], top_k=c["K"], hidden_size=128, intermediate_size=128,
                              scoring=c["scoring"], num_groups=c.get("num_groups"),
                              topk_groups=c.get("topk_groups"))
        bias = torch.randn(c["E"], device=dev) * 0.1 if c["bias"] else None
        for T in (1, 128, 4096, 16384):
            logits = torch.randn(T, c["E"], device=dev, dtype=torch.bfloat16)
            times = {}
            for version in ("kernel", "torch"):
                epmoe.routing._use_kernel = lambda logits_TE, E, v=version: v == "kernel"
                times[version] = _time(lambda: epmoe.route(logits, cfg, correction_bias_E=bias), args.calls)
            (kh, kg), (th, tg) = times["kernel"], times["torch"]
            print(f"{name:12} {T:6d}  {kh:11.1f} {kg:7.1f}  {th:10.1f} {tg:7.1f}  {th / kh:9.1f}x {tg / kg:8.1f}x",
                  flush=True)


if __name__ == "__main__":
    main()
