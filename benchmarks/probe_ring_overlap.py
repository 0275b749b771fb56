"""Where does a ring step's time go? Compute alone, exchange alone, and both overlapped.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 benchmarks/probe_ring_overlap.py --n-local 32768

One ring step of ring_attention at N_local rows per rank: flash attention of the local queries
against one K/V block, and the exchange of one K/V block (2 x B x Hkv x N_local x D) with the
neighbours by batched isend/irecv. Prints per-rank medians and the achieved exchange bandwidth.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch
import torch.distributed as dist

from dilated_attention.kernels.block_attention import attn_fwd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-local", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local)
    q = torch.randn(1, a.heads, a.n_local, a.headdim, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(2, 1, a.heads, a.n_local, a.headdim, device=dev, dtype=torch.bfloat16)
    buf = torch.empty_like(kv)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def exchange():
        ops = [dist.P2POp(dist.irecv, buf, prv), dist.P2POp(dist.isend, kv, nxt)]
        return dist.batch_isend_irecv(ops)

    def compute():
        attn_fwd(q, kv[0], kv[1], a.headdim**-0.5, False)

    def overlapped():
        reqs = exchange()
        compute()
        for r in reqs:
            r.wait()

    def comm_only():
        for r in exchange():
            r.wait()

    res = {}
    for name, fn in (("compute", compute), ("exchange", comm_only), ("overlapped", overlapped)):
        # the shared timer, the ranks starting each call together (a barrier before each)
        res[name] = median_ms(fn, dev, 1, a.iters, before=dist.barrier)
    gbps = kv.numel() * kv.element_size() / (res["exchange"] / 1e3) / 1e9
    peer = torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else None
    line = (f"rank {rank}: N_local={a.n_local} block={kv.numel() * kv.element_size() / 2**20:.0f} MiB | "
            f"compute {res['compute']:.2f} ms | exchange {res['exchange']:.2f} ms ({gbps:.1f} GB/s per direction) | "
            f"overlapped {res['overlapped']:.2f} ms | peer access {peer}")
    out = [None] * world
    dist.all_gather_object(out, line)
    if rank == 0:
        print("\n".join(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
