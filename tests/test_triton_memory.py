"""Memory of impl="triton" forward+backward (issue 24): the live bytes at the peak stay within
the bound written in benchmarks/NOTES_triton.md ("Memory at 2M tokens"), and the ranges that
keep the lo buffers small change no bit of any result.

The peak is counted on the CPU (Triton's interpreter) by ``benchmarks/mem_account.py``'s
:class:`LiveBytes`: every storage torch allocates inside it, user tensors included, alive or
freed. ``LO_MIN_BYTES = 0`` cuts the lo buffers into their long-N ranges at this tiny N, so the
ratio to q is the one of N = 2M (it does not depend on N once N >= LO_CHUNKS x lcm(w)).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

pytest.importorskip("triton")

from dilated_attention.kernels import select  # noqa: E402

if not select.interpreting():
    pytest.skip("CPU interpreter tests (TRITON_INTERPRET=1)", allow_module_level=True)

from dilated_attention.kernels import triton_launch as L  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import mem_account  # noqa: E402


def _bound(loss: str, d: int) -> float:
    """Peak / q bytes that NOTES_triton.md claims (fp16/bf16, H == Hkv): the user's q, k, v,
    out (+ the held dout for out.backward(dout)), dq, dk, dv, one dQ-phase lo range
    (1/LO_CHUNKS), and two float32 (B, H, N) tensors (lse, delta) of 4 / (2 D) each."""
    held = 5 if loss == "backward" else 4
    return held + 3 + 1 / L.LO_CHUNKS + 2 * 4 / (2 * d)


@pytest.mark.parametrize("loss", ["backward", "sum"])
@pytest.mark.parametrize("causal", [False, True])
def test_peak_live_bytes_within_bound_interpreter(causal, loss):
    n, h, d = 256, 2, 16
    peak, log = mem_account.cpu_ledger(1, n, h, h, d, (8, 16), (1, 2), causal, loss)
    unit = n * h * d * 2
    slack = 256 / unit  # the branch table of the folded forward (a few int32, cached)
    bound = _bound(loss, d)
    msg = "\n".join(f"{e:5} {u:7.4f} -> {c:7.4f} {w}" for e, w, u, c in log)
    assert peak <= bound + slack, f"peak {peak:.4f} x q > bound {bound:.4f}:\n{msg}"
    # the counter saw the tensors (q, k, v, out, grads: at least 7 units)
    assert peak >= bound - 1 / L.LO_CHUNKS - 2 * 4 / (2 * d) - 1e-9, msg


def _run(b, nq, nk, h, hkv, d, seg, dil, causal, lo_rows, dtype=torch.float16):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, nq, h, d, generator=g).to(dtype)
    k, v = (torch.randn(b, nk, hkv, d, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(b, nq, h, d, generator=g).to(dtype)
    hr = [(0, h)] * len(seg)
    out, lse = L.forward(q, k, v, None, seg, dil, causal, d**-0.5, hr, fold=False, lo_rows=lo_rows)
    grads = L.backward(do, q, k, v, None, out, lse, seg, dil, causal, d**-0.5, hr, lo_rows=lo_rows)
    return (out, lse, *grads)


@pytest.mark.parametrize(
    "b,nq,nk,h,hkv,seg,dil,causal",
    [
        (2, 256, 256, 2, 2, (16, 32), (1, 2), True),  # batch 2
        (1, 200, 256, 4, 2, (16, 32, 64), (1, 2, 4), False),  # GQA, seqlen_q < seqlen_k
        (1, 250, 250, 2, 1, (16, 32), (1, 2), True),  # MQA, short last range
        (1, 90, 264, 3, 3, (8, 24), (1, 3), True),  # lcm 24, queries start in a late range
    ],
)
def test_lo_ranges_change_no_bit_interpreter(b, nq, nk, h, hkv, seg, dil, causal):
    whole = _run(b, nq, nk, h, hkv, 16, seg, dil, causal, lo_rows=10**9)
    cut = _run(b, nq, nk, h, hkv, 16, seg, dil, causal, lo_rows=1)  # one lcm(w) per range
    lay = L._layout(torch.empty(b, nq, 1, 1), torch.empty(b, nk, 1, 1), None)
    assert len(L.lo_chunks(lay, [(w, r, 0, h) for w, r in zip(seg, dil, strict=True)], 1, 1)) > 2
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), whole, cut, strict=True):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("causal", [False, True])
def test_broadcast_dout_read_in_place_interpreter(causal):
    # out.sum().backward(): the incoming gradient is a broadcast scalar; the launcher reads it
    # in place (no (B, N, H, D) copy) and gets the same bits as a materialised ones tensor
    from dilated_attention import dilated_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 96, 2, 16, generator=g).half().requires_grad_() for _ in range(3))
    out = dilated_attention(q, k, v, (16, 32), (1, 2), causal=causal, impl="triton")
    ga = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    gb = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for name, x, y in zip("qkv", ga, gb, strict=True):
        assert torch.equal(x, y), name
