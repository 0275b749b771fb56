"""Shared by tests/test_gluon_fwd.py and tests/test_gluon_bwd.py: when the Gluon kernels can
run, inputs, the public call with gradients, and the CUDA cases."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import dilated_attention
from dilated_attention.kernels import gluon_fwd


def gluon_ready() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return "the Gluon forward is for sm_90 only"
    if gluon_fwd.kernel_module() is None:
        return f"Gluon is missing: {gluon_fwd.import_error()}"
    return None


needs_gluon = pytest.mark.skipif(gluon_ready() is not None, reason=str(gluon_ready()))


class OnCuda:
    """What the Gluon gate reads of a contiguous CUDA tensor of ``shape`` (no memory): the
    library's own ``shape_problem`` / ``problem`` judge the cases on the CPU."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device("cuda", 0)
        self._size = torch.empty((), dtype=dtype).element_size()

    def stride(self):
        out, acc = [], 1
        for s in reversed(self.shape):
            out.append(acc)
            acc *= s
        return tuple(reversed(out))

    def data_ptr(self):
        return 1 << 20

    def is_contiguous(self):
        return True

    def element_size(self):
        return self._size


def qkv(b=1, n=256, h=4, hkv=2, d=64, dtype=torch.bfloat16, device="cpu"):
    q = torch.randn(b, n, h, d, dtype=dtype, device=device)
    k = torch.randn(b, n, hkv, d, dtype=dtype, device=device)
    return q, k, torch.randn_like(k)


def run(q, k, v, do, seg, dil, dtype, **kw):
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = dilated_attention(*xs, seg, dil, return_lse=True, **kw)
    grads = torch.autograd.grad(out, xs, do.to(dtype))
    return out, lse, grads


def err(a, r):
    return (a.double() - r.double()).abs().max().item()


CASES = [
    # (B, N, H, Hkv, D, seg, dil, head_assignment)
    (1, 4096, 4, 4, 128, [1024, 2048, 4096], [1, 2, 4], "all"),  # LongNet-like, r = 1 first
    (1, 4096, 8, 2, 64, [512, 2048], [1, 4], "all"),  # GQA
    (1, 8192, 4, 1, 128, [2048, 8192], [2, 8], "all"),  # MQA, first branch r = 2 (filled buffers)
    (2, 2048, 4, 2, 64, [256, 1024, 2048], [1, 2, 4], "all"),  # batch 2
    (1, 3840, 4, 4, 128, [960, 3840], [5, 5], "all"),  # L = 192 and 768: partial tiles
    (1, 2048, 4, 4, 64, [64, 2048], [16, 1], "all"),  # L = 4: a tile mostly past the block
    (1, 4096, 8, 8, 128, [1024, 2048, 4096], [1, 2, 4], "split"),  # heads split: one branch a row
]

UNEVEN_CASES = [
    # (B, N, H, Hkv, D, seg, dil, head_assignment): branches with w % r != 0 (blocks of two
    # lengths: gluon_fwd.UNEVEN_BLOCKS)
    (1, 4096, 8, 4, 128, [1024, 2048, 4096], [1, 3, 6], "all"),  # L 683/682, 683/682
    (1, 3072, 4, 2, 64, [768, 3072], [5, 7], "all"),  # H < r: the short class has no head
    (1, 3072, 4, 4, 128, [3072], [5], "all"),  # one branch, r > 1 first (filled buffers)
    (1, 4096, 8, 1, 64, [1024, 4096], [1, 6], "all"),  # MQA: rep 8 >= r
    (2, 4096, 6, 6, 64, [1024, 4096], [2, 3], "split"),  # heads [3, 6) of r = 3: hs % r == 0
]

TAIL_CASES = [
    # (B, N, H, Hkv, D, seg, dil, head_assignment): N % w != 0, a short last segment
    # (gluon_fwd.TAIL_SEGMENTS, batch 1)
    (1, 5000, 8, 4, 128, [1024, 2048, 4096], [1, 2, 4], "all"),  # tails of 904 rows
    (1, 3000, 4, 2, 64, [1024, 4096], [1, 3], "all"),  # N < 4096: one short segment of 3000
    (1, 4500, 6, 6, 64, [2048, 4096], [2, 6], "all"),  # a tail of 404 rows with r = 6: two lengths
]


TAIL_BATCH_CASES = [
    # (B, N, H, Hkv, D, seg, dil, head_assignment): N % w != 0 at batch 2, each entry launched
    # apart (gluon_fwd.TAIL_BATCHES)
    (2, 5000, 8, 4, 128, [1024, 2048, 4096], [1, 2, 4], "all"),
    (2, 4500, 6, 6, 64, [2048, 4096], [2, 6], "all"),
]


def case_id(c) -> str:
    """A CUDA case's test id: B x N x H / Hkv x D-seg-dil-head_assignment."""
    return f"{c[0]}x{c[1]}x{c[2]}/{c[3]}x{c[4]}-{c[5]}-{c[6]}-{c[7]}"


# each geometry's cases and the switches that let the Gluon kernels take them ((module, name):
# gluon_fwd / gluon_bwd). All on as shipped since 2026-11-29; the tests set them, so that a
# default turned off does not turn its test into a test of the Triton kernels.
_TAIL = (("fwd", "UNEVEN_BLOCKS"), ("fwd", "TAIL_SEGMENTS"), ("bwd", "TAIL_SEGMENTS"))
GEOMETRIES = {
    "even": (CASES, ()),
    "uneven": (UNEVEN_CASES, (("fwd", "UNEVEN_BLOCKS"),)),
    "tail": (TAIL_CASES, _TAIL),
    "tail-batched": (TAIL_BATCH_CASES, (*_TAIL, ("fwd", "TAIL_BATCHES"))),
}


def geometry_cases(all_heads: bool = False) -> list:
    """pytest params (kind, case) of every :data:`GEOMETRIES` case, id "kind-case"; ``all_heads``:
    only those with every branch over all heads (what the Gluon backward takes)."""
    return [pytest.param(kind, c, id=f"{kind}-{case_id(c)}") for kind, (cases, _) in GEOMETRIES.items()
            for c in cases if not all_heads or c[7] == "all"]  # fmt: skip


def switch_on(monkeypatch, kind: str) -> None:
    """Turn on the switches geometry ``kind`` needs (:data:`GEOMETRIES`)."""
    from dilated_attention.kernels import gluon_bwd

    for mod, name in GEOMETRIES[kind][1]:
        monkeypatch.setattr(gluon_fwd if mod == "fwd" else gluon_bwd, name, True)


def lse_merge(out_a, lse_a, out_b, lse_b):
    """The kernels' epilogue merge of two (out, lse) pairs by LSE, float64 (rows, D) / (rows,):
    a pair with lse -inf weighs nothing; rows with no key in either stay lse -inf, out 0."""
    mx = torch.maximum(lse_a, lse_b)
    mx = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)
    wa, wb = torch.exp(lse_a - mx), torch.exp(lse_b - mx)
    tot = wa + wb
    new_lse = torch.where(tot > 0, mx + torch.log(torch.where(tot > 0, tot, 1.0)), float("-inf"))
    return (out_a * wa[:, None] + out_b * wb[:, None]) / torch.where(tot > 0, tot, 1.0)[:, None], new_lse


def tma_box(d, blk: int, col: int, big_l: int) -> torch.Tensor:
    """Rows [0, big_l) of (block, column) of a TMA descriptor's 4-D view, as a strided view of
    its base: what the kernels' boxes cover (the emulated kernels of the CPU tests). Past the
    tensor raises; past the descriptor's block axis is an error here."""
    assert big_l <= d.shape[1] and blk < d.shape[0] and col < d.shape[2]
    st = d.strides
    return torch.as_strided(d.base, (big_l, d.shape[3]), (st[1], st[3]),
                            d.base.storage_offset() + blk * st[0] + col * st[2])  # fmt: skip
