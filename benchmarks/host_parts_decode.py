"""Where the host time of a repeated eager decode call goes, part by part (issue 23 item 2).

Times, per call, the whole repeated call through both front doors and each part of its fast
path on its own: the key (``decode.fast_key``), the lookup and per-call checks
(``decode.fast_lookup``), the plan's call (``DecodePlan.launch``: state queries, workspace,
``out``, data pointers, both launches), and inside it ``torch.empty_like(q)``, the CUDA state
queries, the data pointers and each kernel's launch alone. Issue 23's shapes (1 new token, 32 q /
8 kv heads x 128, bf16, LongNet branches (2048..32768)/(1..16), causal, batch 1); median over
``--rounds`` rounds of the per-call median of ``--calls`` calls::

    python benchmarks/host_parts_decode.py [--calls 2000] [--rounds 5] [--cache 32768]

On a GPU the parts are the real ones (the GPU is synchronised between rounds; a part that
launches a kernel is timed per call, so that a full launch queue shows as outliers, not in the
median). On a CPU (``TRITON_INTERPRET=1``) the plans get the stand-in launches and device queries
of ``host_cost_decode_cpu.py`` (no kernel runs), for a dry run of the script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dilated_attention as da  # noqa: E402
from dilated_attention import decode  # noqa: E402
from dilated_attention.kernels import direct_launch  # noqa: E402
from dilated_attention.kernels import triton_decode as td  # noqa: E402


def _median_per_call(fn, calls: int, rounds: int, sync) -> float:
    """Median over rounds of the median per-call time of ``fn()`` in microseconds."""
    clock = time.perf_counter_ns
    meds = []
    for _ in range(rounds):
        ts = []
        for _ in range(calls):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        sync()
        meds.append(statistics.median(ts) / 1e3)
    return statistics.median(meds)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cache", type=int, default=32768)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.float16  # (bf16 is refused under the interpreter; the host path is the same)
    seg, dil = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]  # lists, as ab_decode.py passes them
    q = torch.randn(1, 1, 32, 128, dtype=dt, device=dev)
    k, v = (torch.randn(1, args.cache, 8, 128, dtype=dt, device=dev) for _ in range(2))
    lens = torch.full((1,), args.cache, dtype=torch.int32, device=dev)
    kv_call = lambda: da.dilated_attention_with_kvcache(q, k, v, lens, seg, dil, causal=True, impl="triton")  # noqa: E731
    da_call = lambda: da.dilated_attention(q, k, v, seg, dil, causal=True, impl="triton")  # noqa: E731
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if not cuda:  # the stand-ins of host_cost_decode_cpu.py
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import host_cost_decode_cpu as cpu

        cpu._stand_ins()
    with torch.no_grad():
        for _ in range(3):
            kv_call(), da_call()
        if not cuda:
            cpu._arm_plans()
        for _ in range(3):
            kv_call(), da_call()
        sync()
        extra = ((lens.shape, lens.dtype, lens.device), None)
        key = decode.fast_key("kv", q, k, v, seg, dil, True, None, "all", "triton", extra)
        hit = decode.fast_lookup(key, q, k, v, seg, dil)
        if hit is None:
            raise SystemExit(f"no fast-path entry for the kv call (direct launch: {direct_launch.unavailable_reason()})")
        plan = hit.plan
        if plan.split_go is None:
            raise SystemExit(f"the plan has no launch forms (direct launch: {direct_launch.unavailable_reason()})")
        kst, vst, c = k.stride(), v.stride(), k.shape[1]
        stream = direct_launch.current_stream(plan.dev_index)
        wp, lpw, lsw = plan.ws_state[3:]
        qp, kp, vp, sp = q.data_ptr(), k.data_ptr(), v.data_ptr(), lens.data_ptr()
        out = torch.empty_like(q)
        split_args = (*plan.split_pre, stream, *plan.split_post, qp, kp, vp, sp, sp, plan.table_ptr, wp, lpw,
                      *plan.split_q, *kst[:3], *vst[:3], *plan.split_mid, c, *plan.split_rest)  # fmt: skip
        reduce_args = (*plan.reduce_pre, stream, *plan.reduce_post, wp, lpw, out.data_ptr(), lsw, *plan.reduce_tail)
        parts = {
            "dilated_attention_with_kvcache (whole call)": kv_call,
            "dilated_attention(q_one_row) (whole call)": da_call,
            "decode.fast_call (kv)": lambda: decode.fast_call(
                "kv", q, k, v, lens, None, seg, dil, True, None, "all", "triton", False),
            "in fast_call: decode.fast_key": lambda: decode.fast_key("kv", q, k, v, seg, dil, True, None, "all", "triton", extra),
            "in fast_call: decode.fast_lookup": lambda: decode.fast_lookup(key, q, k, v, seg, dil),
            "in fast_call: DecodePlan.launch": lambda: plan.launch(q, k, v, lens, None, False, c, kst, vst),
            "in launch: torch.empty_like(q)": lambda: torch.empty_like(q),
            "in launch: state queries (stream, capturing, device)": lambda: (
                direct_launch.current_stream(plan.dev_index), direct_launch.capturing(), direct_launch.current_device()),
            "in launch: 5 data_ptr()": lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), lens.data_ptr(), out.data_ptr()),
            "in launch: split kernel launch (args prebuilt)": lambda: plan.split_go(*split_args),
            "in launch: reduce kernel launch (args prebuilt)": lambda: plan.reduce_go(*reduce_args),
        }  # fmt: skip
        res = {name: _median_per_call(fn, args.calls, args.rounds, sync) for name, fn in parts.items()}
    where = torch.cuda.get_device_name() if cuda else "CPU, stand-in launches and device queries"
    print(f"| part ({where}; cache {args.cache}) | median us/call |")
    print("|---|---|")
    for name, us in res.items():
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
