"""What one TMA descriptor made on the device costs a program (issue 22 item 2b), measured apart
from any attention work.

The Gluon varlen kernels make each program's TMA descriptors on the device (five in the forward,
four in the dK/dV and dQ kernels: ``tma.make_tensor_descriptor``, which Triton 3.6 lowers to a
128-byte copy into global scratch with a GPU-scope exchange, a tensormap invalidate and a flush),
where the one-sequence kernels take descriptors made on the host. results/profile_varlen_h200_
2026-11-29_s29_*.md found the packed kernels slower per tile pair than the one-sequence ones by a
fixed cost per program of about 5 us (forward). This kernel does nothing but that part: each
program takes a [128, D] tile through ``NDESC`` descriptors, one TMA load each, made on the device
(``DEVICE``) or the same host descriptor ``NDESC`` times, with 128 KiB of shared memory so that
one program runs per SM as in the attention kernels. (device - host) / (programs per SM) is the
cost a program pays for making its descriptors.

    PYTHONPATH=src python3 benchmarks/tma_desc_cost.py [--programs 16560] [--out f.md]   # Hopper GPU
    /tmp/t36/bin/python benchmarks/tma_desc_cost.py --compile-only                         # CPU, Triton 3.6
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BM, D, SLOTS = 128, 128, 4  # a [128, 128] bf16 tile (32 KiB), four slots: 128 KiB of shared memory


@gluon.jit
def desc_cost_kernel(X, Y, x_desc, ROWS, NDESC: gl.constexpr, DEVICE: gl.constexpr, layout: gl.constexpr,
                     BM: gl.constexpr, D: gl.constexpr, SLOTS: gl.constexpr):  # fmt: skip
    pid = gl.program_id(0)
    row0 = (pid % (ROWS // BM)) * BM
    bufs = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, 1, BM, 1, D], layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    for i in gl.static_range(NDESC):
        mbarrier.expect(bar.index(0), BM * D * 2)
        if DEVICE:
            # a block of BM rows starting at row0 (as the varlen kernels' per-block descriptors)
            d = tma.make_tensor_descriptor(X + row0.to(gl.int64) * D, [1, BM, 1, D], [BM * D, D, D, 1],
                                           [1, BM, 1, D], layout)  # fmt: skip
            tma.async_copy_global_to_shared(d, [0, 0, 0, 0], bar.index(0), bufs.index(i % SLOTS))
        else:
            tma.async_copy_global_to_shared(x_desc, [0, row0, 0, 0], bar.index(0), bufs.index(i % SLOTS))
        mbarrier.wait(bar.index(0), i % 2)
    mbarrier.invalidate(bar.index(0))
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    acc = gl.zeros([BM, D], gl.float32, blk)
    for i in gl.static_range(SLOTS):
        if i < NDESC:
            acc += bufs.index(i).reshape([BM, D]).load(blk).to(gl.float32)
    gl.store(Y + pid, gl.sum(gl.sum(acc, axis=1), axis=0))


def _layout():
    return gl.NVMMASharedLayout.get_default_for([1, BM, 1, D], gl.bfloat16)


def compile_only() -> int:
    """sm_90 compile on the CPU (Triton 3.6): every variant compiles, with its scratch size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    rc = 0
    for device in (True, False):
        for n in (1, 5):
            sig = {"X": "*bf16", "Y": "*fp32", "x_desc": f"tensordesc<bf16[1, {BM}, 1, {D}],{_layout()!r}>",
                   "ROWS": "i32"}  # fmt: skip
            consts = {"NDESC": n, "DEVICE": device, "layout": _layout(), "BM": BM, "D": D, "SLOTS": SLOTS}
            sig.update({k: "constexpr" for k in consts})
            try:
                ck = triton.compile(GluonASTSource(desc_cost_kernel, sig, consts, {(0,): [["tt.divisibility", 16]]}),
                                    target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})  # fmt: skip
                print(f"DEVICE={device} NDESC={n}: shared {ck.metadata.shared} B, "
                      f"global scratch {ck.metadata.global_scratch_size} B / program")
            except Exception as e:  # noqa: BLE001
                print(f"DEVICE={device} NDESC={n}: compile FAILED: {type(e).__name__}: {str(e)[:400]}")
                rc = 1
    return rc


def bench(programs: int, rep: int) -> list[str]:
    """The table's lines; the device descriptors' global scratch from the library's allocator
    (``gluon_varlen._Scratch``, as its varlen launches), set for the whole measurement."""
    from dilated_attention.kernels import gluon_varlen

    with gluon_varlen._Scratch(torch.device("cuda")):
        return _bench(programs, rep)


def _bench(programs: int, rep: int) -> list[str]:
    import triton
    import triton.testing
    from common import results_header
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows = 64 * BM
    x = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(programs, device="cuda", dtype=torch.float32)
    xd = TensorDescriptor(x.view(1, rows, 1, D), [1, rows, 1, D], [rows * D, D, D, 1], [1, BM, 1, D], _layout())
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def launch(n, device):
        desc_cost_kernel[(programs,)](x, y, xd, rows, NDESC=n, DEVICE=device, layout=_layout(), BM=BM, D=D,
                                      SLOTS=SLOTS, num_warps=4)  # fmt: skip

    # exact first: every variant reads the same tiles
    for n in (1, 5):
        launch(n, True)
        a = y.clone()
        launch(n, False)
        torch.cuda.synchronize()
        assert torch.equal(a, y), f"NDESC={n}: device and host descriptors read different tiles"
    lines = [*results_header("TMA descriptors made on the device vs on the host, per program", device="cuda",
                             command=f"python3 benchmarks/tma_desc_cost.py {shlex.join(sys.argv[1:])}"), "",
             f"{programs} programs, one per SM at a time ({sms} SMs: {programs / sms:.0f} programs an SM), "
             f"each loading a [{BM}, {D}] bf16 tile NDESC times. do_bench medians.", "",
             "| NDESC | host descriptor us | device descriptors us | extra us a program | extra us a descriptor |",
             "|---|---|---|---|---|"]  # fmt: skip
    for n in (1, 2, 3, 4, 5):
        t = {dev: 1e3 * triton.testing.do_bench(lambda dev=dev, n=n: launch(n, dev), warmup=20, rep=rep,
                                                  return_mode="median") for dev in (False, True)}  # fmt: skip
        per = (t[True] - t[False]) / (programs / sms)
        lines.append(f"| {n} | {t[False]:.1f} | {t[True]:.1f} | {per:.2f} | {per / n:.2f} |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=16560, help="the packed batch's w = 2048 branch: 16560")
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.compile_only:
        return compile_only()
    lines = bench(a.programs, a.rep)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
