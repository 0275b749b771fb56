"""The region Nsight Compute profiles: one fused dilated fwd+bwd and one dense flash fwd+bwd.

    ncu --profile-from-start off --clock-control none --kernel-name regex:'dilated_|flash' \
        --section SpeedOfLight --section Occupancy ... python3 benchmarks/ncu_kernels.py
    (scripts/gpu_check.sh ncu runs exactly that and writes the report to $OUT)

Issue 24: the dK/dV kernel runs at ~339 TF/s (H100) and is half of fwd+bwd; splitting it in two
launches to remove its register spills made it slower (``dkdv_split_h200_2026-11-28.md``), so
the spills are not what limits it. Before the next change, read its hardware counters beside
the dQ kernel's, the forward's and dense flash attention's backward: achieved occupancy, warp
stall reasons, tensor-pipe and memory throughput, local (spill) traffic.

Outside the profiled range: warm-up calls (Triton compiles there). Inside it
(``torch.cuda.profiler.start`` / ``stop``): ``triton_launch.forward`` + ``backward`` of the
headline shape (batch 1, 16 x 128 bf16, branches 2048..32768 / 1..16, N = ``--n``), then dense
SDPA (``--backend``: flash, or cudnn as the sweep's dense column) fwd+bwd at ``--dense-n`` (smaller: ncu replays every kernel tens of times,
and a 131072-token dense backward takes ~0.7 s per replay; its per-tile behaviour does not
depend on N).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dilated_attention.branches import branch_head_ranges
from dilated_attention.kernels import triton_launch as L


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=131072)
    p.add_argument("--dense-n", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument(
        "--backend",
        choices=["flash", "cudnn"],
        default="flash",
        help="dense SDPA backend (the sweep's dense column prefers cudnn where it runs)",
    )
    p.add_argument("--dense-only", action="store_true", help="profile the dense call alone")
    a = p.parse_args()
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[a.backend]
    dev = torch.device("cuda")
    seg, dil = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
    hr = branch_head_ranges(a.heads, len(seg), "all")
    scale = a.headdim**-0.5
    q, k, v, do = (torch.randn(1, a.n, a.heads, a.headdim, device=dev, dtype=torch.bfloat16)
                   for _ in range(4))  # fmt: skip

    def dilated():
        out, lse = L.forward(q, k, v, None, seg, dil, a.causal, scale, hr)
        return L.backward(do, q, k, v, None, out, lse, seg, dil, a.causal, scale, hr)

    qd, kd, vd = (torch.randn(1, a.heads, a.dense_n, a.headdim, device=dev, dtype=torch.bfloat16,
                              requires_grad=True) for _ in range(3))  # fmt: skip
    dod = torch.randn_like(qd)

    def dense():
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=a.causal)
        return torch.autograd.grad(o, (qd, kd, vd), dod)

    for _ in range(2):
        if not a.dense_only:
            dilated()
        dense()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    if not a.dense_only:
        dilated()
    dense()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(
        f"profiled: dilated N={a.n} (skipped: {a.dense_only}) causal={a.causal}, dense {a.backend} "
        f"N={a.dense_n}",
        flush=True,
    )


if __name__ == "__main__":
    main()
