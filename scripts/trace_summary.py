"""Timeline of GPU work around each launch of one kernel, from a torch.profiler chrome trace: every
kernel and copy on the same device that overlaps [start - BEFORE, end + AFTER] of the kernel, with
start and end relative to the kernel's start (µs), stream, and for copies bytes and GB/s.

    python3 scripts/trace_summary.py TRACE.json [--kernel _combine_kernel] [--max 3]
"""
from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--kernel", default="_combine_kernel")
    p.add_argument("--max", type=int, default=3, help="launches to show (the last ones)")
    p.add_argument("--before", type=float, default=30.0)
    p.add_argument("--after", type=float, default=30.0)
    args = p.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    anchors = [e for e in gpu if args.kernel in e["name"]][-args.max:]
    for a in anchors:
        t0, t1 = a["ts"] - args.before, a["ts"] + a["dur"] + args.after
        print(f"--- {a['name'][:40]} at {a['ts']:.1f} us, {a['dur']:.1f} us long")
        for e in sorted(gpu, key=lambda e: e["ts"]):
            if e["pid"] != a["pid"] or e["ts"] + e["dur"] < t0 or e["ts"] > t1:
                continue
            extra = ""
            nbytes = e.get("args", {}).get("bytes")
            if nbytes:
                extra = f" {nbytes / 1e6:8.2f} MB {nbytes / max(e['dur'], 1e-3) / 1e3:6.0f} GB/s"
            print(f"  {e['ts'] - a['ts']:8.1f} .. {e['ts'] + e['dur'] - a['ts']:8.1f}  stream {e['tid']!s:>4}  "
                  f"{e['name'][:48]:<48}{extra}")


if __name__ == "__main__":
    main()
