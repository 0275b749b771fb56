"""Where the time of one dilated-attention call goes: a torch.profiler table of GPU kernels.

    PYTHONPATH=src python3 benchmarks/profile_impl.py --impl torch --n 131072 [--causal] [--out f.md]

Runs one warm-up and one profiled forward+backward of ``dilated_attention`` (bf16, batch 1,
16 heads x 128, LongNet branches w=2048..32768, r=1..16) and prints the GPU kernels sorted by
total time, grouped into attention kernels (flash / cudnn / triton dilated) and the rest (copies,
casts, merges), with the share of each group. The point is to measure what limits a path,
rather than guess.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from dilated_attention import dilated_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import results_header  # noqa: E402

_ATTN = re.compile(r"flash|fmha|cudnn|sm90|_attn_|_fwd_kernel|_bwd_|dilated", re.I)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", default="torch")
    p.add_argument("--n", type=int, default=131072)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    seg, dil = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
    q, k, v = (torch.randn(1, a.n, a.heads, a.headdim, device=dev, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def step():
        out = dilated_attention(q, k, v, seg, dil, causal=a.causal, impl=a.impl)
        out.backward(do)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.key and not e.key.startswith("ProfilerStep"):
            rows.append((e.key, t / 1e3, e.count))
    # keep kernels only (names of aten ops also carry device time in some versions)
    kernels = [r for r in rows if not r[0].startswith("aten::") and not r[0].startswith("cuda")]
    kernels.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in kernels)
    attn = sum(r[1] for r in kernels if _ATTN.search(r[0]))
    lines = results_header(f"profile: impl={a.impl}, N={a.n}, causal={a.causal}, fwd+bwd", dev) + [
        "",
        f"GPU kernel time {total:.2f} ms: attention kernels {attn:.2f} ms ({100 * attn / total:.0f}%), "
        f"other {total - attn:.2f} ms ({100 * (total - attn) / total:.0f}%)",
        "",
        "| kernel | ms | calls | attention? |",
        "|---|---:|---:|---|",
    ]
    for name, ms, cnt in kernels[: a.top]:
        short = name if len(name) < 90 else name[:87] + "..."
        lines.append(f"| `{short}` | {ms:.2f} | {cnt} | {'yes' if _ATTN.search(name) else ''} |")
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
