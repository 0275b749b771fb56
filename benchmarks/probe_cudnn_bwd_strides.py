"""Does cuDNN attention's backward give wrong gradients when dO's strides change between calls
of one shape? (GPU probe, 2026-11-28.)

While checking the Gluon backward prototype, its comparator (SDPA's backward on per-head tensors
with a strided dO) showed errors of 0.4-0.8 and then an illegal memory access. The suspected cause is
PyTorch's cuDNN SDPA backward caching its graph under a key that does not hold dO's strides.
This probe asks whether the library's torch path (``kernels/block_attention.attn_bwd`` with backend
"cudnn") is exposed:

1. raw: ``attn_bwd(..., backend="cudnn")`` on one shape, first with a contiguous dO, then with the
   same values in another layout (and the reverse order on a second shape), against the flash
   backend's gradients for the same inputs;
2. end to end: ``dilated_attention(..., impl="torch")`` on CUDA, backward with an upstream gradient
   in two layouts (contiguous, then a transposed view with the same values), against each other.

Prints one line per check and exits 1 if any gradient differs beyond bf16 rounding.
Run: ``PYTHONPATH=src python3 benchmarks/probe_cudnn_bwd_strides.py``.
"""

from __future__ import annotations

import sys

import torch


def _max_err(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def raw(l_rows: int, dout_first: str) -> tuple[bool, str]:
    from dilated_attention.kernels import block_attention as ba

    torch.manual_seed(l_rows)
    b, h, d = 1, 4, 64
    q, k, v = (torch.randn(b, h, l_rows, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = d**-0.5
    out, lse = ba.attn_fwd(q, k, v, scale, False, backend="cudnn")
    g = torch.randn(b, h, l_rows, d, device="cuda", dtype=torch.bfloat16)
    g_other = g.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, L, H, D) memory
    assert torch.equal(g, g_other) and g.stride() != g_other.stride()
    out_f, lse_f = ba.attn_fwd(q, k, v, scale, False, backend="flash")
    want = ba.attn_bwd(g, q, k, v, out_f, lse_f, scale, False, backend="flash")
    order = [("contiguous", g), ("other", g_other)]
    if dout_first == "other":
        order.reverse()
    lines, ok = [], True
    for name, gg in order:
        got = ba.attn_bwd(gg, q, k, v, out, lse, scale, False, backend="cudnn")
        torch.cuda.synchronize()
        e = _max_err(got, want)
        good = e < 0.05
        ok &= good
        lines.append(f"{name} dO {tuple(gg.stride())}: max |cudnn - flash| {e:.3e} {'ok' if good else 'WRONG'}")
    return ok, f"raw L={l_rows} (dO {dout_first} first): " + "; ".join(lines)


def end_to_end() -> tuple[bool, str]:
    from dilated_attention import dilated_attention

    torch.manual_seed(0)
    n, h, d = 4096, 8, 64
    seg, dil = [1024, 2048, 4096], [1, 2, 4]
    x = [torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    g = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16)
    g_other = g.transpose(1, 2).contiguous().transpose(1, 2)
    res = []
    for gg in (g, g_other, g):
        out = dilated_attention(*x, seg, dil, impl="torch")
        res.append(torch.autograd.grad(out, x, gg))
    torch.cuda.synchronize()
    e1, e2 = _max_err(res[0], res[1]), _max_err(res[0], res[2])
    ok = e1 < 0.05 and e2 < 0.05
    return ok, (f"end to end impl='torch' N={n}: grads with dO contiguous vs a transposed layout differ by "
                f"{e1:.3e}, contiguous twice by {e2:.3e} {'ok' if ok else 'WRONG'}")


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_cudnn_bwd_strides: needs a CUDA GPU")
        return 2
    from dilated_attention import timing
    from dilated_attention.kernels import block_attention as ba

    print("\n".join(timing.results_header("probe_cudnn_bwd_strides", device="cuda")[2:]))
    print(f"cudnn {torch.backends.cudnn.version()}")
    print(f"cudnn usable for the torch path: {ba._cudnn_usable(torch.cuda.current_device())}")
    all_ok = True
    for fn, args in ((raw, (256, "contiguous")), (raw, (384, "other")), (end_to_end, ())):
        try:
            ok, line = fn(*args)
        except Exception as e:  # noqa: BLE001  (report and go on; a CUDA error ends the probe)
            ok, line = False, f"{fn.__name__}{args}: {type(e).__name__}: {str(e)[:300]}"
        all_ok &= ok
        print(line, flush=True)
    print("probe: all ok" if all_ok else "probe: WRONG gradients found")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
