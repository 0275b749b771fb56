"""Random packed-documents (varlen) configurations and their check against the reference run on
each document alone in float64 (docs/spec.md, "Packed documents (varlen)").

Shared by tests/test_varlen_properties.py (fixed seeds, in CI) and ``scripts/fuzz.py --varlen``
(long runs that count mismatches). A configuration covers 0-6 documents of 0..40 keys (empty
and one-token documents, lengths no multiple of any w), as many queries as keys or fewer (none
too), GQA/MQA, 1-3 branches (w sometimes longer than every document, sometimes a multiple of
the Triton interpreter's 32-row blocks), causal, split heads, ``softmax_scale``,
``return_lse``, and what a caller may pass beside the math: int64 offsets, one offsets tensor
for queries and keys, offsets on the device, ``max_seqlen`` larger than the longest document,
non-contiguous q/k/v (slices of one packed qkv tensor, token-major transposes, a strided
headdim), ``check_offsets``; for the fused path also the folded forward forced at these tiny
sizes and the per-call path instead of cached plans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from dataclasses import dataclass
from unittest import mock

import torch
from helpers import varlen_reference
from property_cases import TOLERANCE, _branches, compare, draw_like, spec_class

from dilated_attention import dilated_attention_varlen

HALF_ATOL = 1e-2  # float16 results (rounded outputs, fp32 accumulation), times 1 + max |ref|
SCALES = (None, None, 0.05, 0.5, 1.3, 0.0, -0.5)
# how q, k, v are laid out in memory (the values are the same)
LAYOUTS = ("contiguous", "qkv", "transposed", "strided_d")


@dataclass(frozen=True)
class VarlenCase:
    qlens: tuple[int, ...]
    klens: tuple[int, ...]
    h: int
    hkv: int
    d: int
    seg: tuple[int, ...]
    dil: tuple[int, ...]
    causal: bool
    split: bool
    return_lse: bool
    scale: float | None
    extra_max: int  # max_seqlen_q/_k passed this much above the longest document
    int64: bool  # offsets as int64 (else int32, as flash-attn)
    shared: bool  # one offsets tensor for queries and keys (where their lengths are equal)
    offsets_on_device: bool  # else on the CPU (the same thing on a CPU run)
    layout: str  # LAYOUTS
    check_offsets: bool
    fold: bool  # triton: the folded forward forced (fold_fills_tile -> True), as the tests do
    per_call: bool  # triton: the per-call path (USE_PLANS = False) instead of cached plans
    grad: bool  # else under torch.no_grad() (the torch path sends short queries to decoding)
    half: bool  # triton: float16 (inputs rounded to it for the reference too), else float32
    seed: int


def _length(draw_int) -> int:
    kind = draw_int(0, 9)
    return 0 if kind == 0 else 1 if kind == 1 else draw_int(2, 40)


def _build(draw_int, draw_bool, seed: int, d: int) -> VarlenCase:
    klens = [_length(draw_int) for _ in range(draw_int(0, 6))]
    if draw_bool():  # self-attention packing: the offsets may be shared, the forward folded
        qlens = list(klens)
    else:
        qlens = [nk if draw_int(0, 2) == 0 else draw_int(0, nk) for nk in klens]
    hkv = draw_int(1, 2)
    seg, dil = _branches(draw_int, draw_int(1, 3), max([1, *klens]))
    if draw_int(0, 3) == 0:  # a branch of whole 32-row blocks (the kernels' block slots)
        i = draw_int(0, len(seg) - 1)
        seg = seg[:i] + (32 * draw_int(1, 2),) + seg[i + 1 :]
        dil = dil[:i] + (draw_int(1, 2),) + dil[i + 1 :]
    return VarlenCase(
        qlens=tuple(qlens), klens=tuple(klens), h=hkv * draw_int(1, 3), hkv=hkv, d=d, seg=seg,
        dil=dil, causal=draw_bool(), split=draw_bool(), return_lse=draw_bool(),
        scale=SCALES[draw_int(0, len(SCALES) - 1)], extra_max=(0, 0, 1, 17)[draw_int(0, 3)],
        int64=draw_bool(), shared=draw_bool(), offsets_on_device=draw_bool(),
        layout=LAYOUTS[draw_int(0, len(LAYOUTS) - 1)], check_offsets=draw_bool(),
        fold=draw_bool(), per_call=draw_int(0, 3) == 0, grad=draw_int(0, 3) != 0,
        half=draw_int(0, 3) == 0, seed=seed,
    )  # fmt: skip


def random_varlen_case(rng: random.Random, d: int = 16) -> VarlenCase:
    return _build(rng.randint, lambda: rng.random() < 0.5, rng.randrange(2**31), d)


def _totals(qlens, klens, h: int, extra: int) -> tuple[int, ...]:
    """The specialisation classes of the row counts the kernels take as integers: total query
    rows (the LSE stride), total key rows, query rows x heads (the delta kernel's rows), the
    longest documents as passed (``max_seqlen``)."""
    tq, tk = sum(qlens), sum(klens)
    vals = (tq, tk, tq * h, max([0, *qlens]) + extra, max([0, *klens]) + extra)
    return tuple(spec_class(x) for x in vals)


def variant(c: VarlenCase, rng: random.Random) -> VarlenCase | None:
    """A random case that would, as a rule, run on the Triton binaries ``c`` compiled (fuzz.py's
    compile pool): heads, kv heads, headdim, number of branches and every switch of ``c`` kept
    (causal, split, return_lse, offsets' dtype / sharing / device, layout, check_offsets, fold,
    per_call, grad, float16, self-attention packing, whether there is any document); the
    documents (count and lengths), the queries per document, ``softmax_scale``,
    ``max_seqlen``'s excess and the seed redrawn as :func:`random_varlen_case` draws them, but
    with the row totals of :func:`_totals` in the Triton specialisation classes of ``c``'s
    (``property_cases.spec_class``), and each branch's w and r in the classes of ``c``'s. None
    when no such values turn up. fuzz.py's gate checks the launches themselves."""
    for _ in range(100):  # documents whose row totals keep their classes (the LSE strides, ...)
        n = 0 if not c.klens else rng.randint(1, 6)
        klens = [_length(rng.randint) for _ in range(n)]
        if c.qlens == c.klens:
            qlens = list(klens)
        else:
            qlens = [nk if rng.randint(0, 2) == 0 else rng.randint(0, nk) for nk in klens]
        extra = (0, 0, 1, 17)[rng.randint(0, 3)]
        if _totals(qlens, klens, c.h, extra) == _totals(c.qlens, c.klens, c.h, c.extra_max):
            break
    else:
        return None
    top = max([1, *klens])
    seg, dil = [], []
    for w0, r0 in zip(c.seg, c.dil, strict=True):
        w = draw_like(rng, 1, max(top + 3, w0), w0)
        r = None if w is None else draw_like(rng, 1, w, r0)
        if r is None:
            return None
        seg.append(w)
        dil.append(r)
    return dataclasses.replace(
        c, qlens=tuple(qlens), klens=tuple(klens), seg=tuple(seg), dil=tuple(dil),
        scale=SCALES[rng.randint(0, len(SCALES) - 1)], extra_max=extra, seed=rng.randrange(2**31),
    )  # fmt: skip


def varlen_case_strategy(d: int = 16):
    """A hypothesis strategy of :class:`VarlenCase` (imported lazily: fuzz.py may run without it)."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        return _build(
            lambda lo, hi: draw(st.integers(lo, hi)), lambda: draw(st.booleans()),
            draw(st.integers(0, 2**31 - 1)), d,
        )

    return cases()


def _offsets(lengths, dtype) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(dtype)


def _inputs(c: VarlenCase):
    """q (total_q, H, D), k, v (total_k, Hkv, D), do like q: float64 on the CPU, from the seed."""
    g = torch.Generator().manual_seed(c.seed)
    tq, tk = sum(c.qlens), sum(c.klens)
    q = torch.randn(tq, c.h, c.d, generator=g, dtype=torch.float64)
    k = torch.randn(tk, c.hkv, c.d, generator=g, dtype=torch.float64)
    v = torch.randn(tk, c.hkv, c.d, generator=g, dtype=torch.float64)
    do = torch.randn(tq, c.h, c.d, generator=g, dtype=torch.float64)
    if c.half:  # the reference sees the inputs the float16 run sees
        q, k, v, do = (t.half().double() for t in (q, k, v, do))
    return q, k, v, do


def _laid_out(c: VarlenCase, q, k, v, dtype, device):
    """q, k, v with the same values in ``c.layout`` (views of leaves that require grad)."""
    to = dict(dtype=dtype, device=device)
    if c.layout == "qkv" and q.shape[0] == k.shape[0]:  # slices of one packed (total, H+2Hkv, D)
        packed = torch.cat([q, k, v], 1).to(**to).requires_grad_()
        return packed[:, : c.h], packed[:, c.h : c.h + c.hkv], packed[:, c.h + c.hkv :]
    if c.layout in ("qkv", "transposed"):  # (H, total, D) storage seen as (total, H, D)
        bases = [x.transpose(0, 1).to(**to).contiguous().requires_grad_() for x in (q, k, v)]
        return tuple(b.transpose(0, 1) for b in bases)
    if c.layout == "strided_d":  # every other feature of a (total, H, 2D) buffer
        bases = [torch.stack([x, torch.full_like(x, float("nan"))], -1).flatten(-2) for x in (q, k, v)]
        bases = [b.to(**to).requires_grad_() for b in bases]
        return tuple(b[..., ::2] for b in bases)
    return tuple(x.to(**to).requires_grad_() for x in (q, k, v))


@contextlib.contextmanager
def _kernel_route(c: VarlenCase, impl: str):
    """The fused path's internal routes a tiny case would not take by itself (fresh plans)."""
    if impl != "triton" or not (c.fold or c.per_call):
        yield
        return
    from dilated_attention.kernels import triton_launch as L

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(L, "_PLANS", type(L._PLANS)()))
        if c.fold:
            stack.enter_context(mock.patch.object(L, "fold_fills_tile", lambda geo, bm: True))
        if c.per_call:
            stack.enter_context(mock.patch.object(L, "USE_PLANS", False))
        yield


def reference(c: VarlenCase) -> dict:
    q, k, v, do = _inputs(c)
    xs = [t.requires_grad_() for t in (q, k, v)]
    out, lse, grads = varlen_reference(
        *xs, _offsets(c.qlens, torch.int64), _offsets(c.klens, torch.int64), list(c.seg),
        list(c.dil), do, causal=c.causal, softmax_scale=c.scale,
        head_assignment="split" if c.split else "all",
    )  # fmt: skip
    res = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if not c.return_lse:
        del res["lse"]
    if not c.grad:
        del res["dq"], res["dk"], res["dv"]
    return res


def run(c: VarlenCase, impl: str, dtype, device) -> tuple[dict, list[str]]:
    """``dilated_attention_varlen`` on case ``c``: its results by name, and what is wrong with
    their types and shapes."""
    q, k, v, do = _inputs(c)
    qx, kx, vx = _laid_out(c, q, k, v, dtype, device)
    odt = torch.int64 if c.int64 else torch.int32
    odev = device if c.offsets_on_device else "cpu"
    cu_q = _offsets(c.qlens, odt).to(odev)
    cu_k = cu_q if c.shared and c.qlens == c.klens else _offsets(c.klens, odt).to(odev)
    mq, mk = max([0, *c.qlens]) + c.extra_max, max([0, *c.klens]) + c.extra_max
    with _kernel_route(c, impl), torch.set_grad_enabled(c.grad):
        res = dilated_attention_varlen(
            qx, kx, vx, cu_q, cu_k, mq, mk, list(c.seg), list(c.dil), causal=c.causal,
            softmax_scale=c.scale, head_assignment="split" if c.split else "all",
            return_lse=c.return_lse, impl=impl, check_offsets=c.check_offsets,
        )  # fmt: skip
        bad = []
        if c.return_lse != isinstance(res, tuple):
            bad.append(f"return_lse={c.return_lse} but the result is a {type(res).__name__}")
            res = res if isinstance(res, tuple) else (res, None)
        out, lse = res if c.return_lse else (res, None)
        if out.shape != q.shape or out.dtype != dtype:
            bad.append(f"out: {tuple(out.shape)} {out.dtype}, q is {tuple(q.shape)} {dtype}")
        if lse is not None and (lse.shape != (c.h, q.shape[0]) or lse.dtype != torch.float32):
            bad.append(f"lse: {tuple(lse.shape)} {lse.dtype}, want {(c.h, q.shape[0])} float32")
        got = {"out": out} if lse is None else {"out": out, "lse": lse}
        if not c.grad:
            return got, bad
        if not out.requires_grad:
            bad.append("out is not connected to q, k, v (no grad_fn)")
            grads = (None, None, None)
        else:
            grads = torch.autograd.grad(out, (qx, kx, vx), do.to(dtype=dtype, device=device), allow_unused=True)
    zeros = [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, (qx, kx, vx), strict=True)]
    got.update(dq=zeros[0], dk=zeros[1], dv=zeros[2])
    return got, bad


def _dtype_atol(c: VarlenCase, impl: str):
    if c.half and impl == "triton":
        return torch.float16, HALF_ATOL
    return TOLERANCE[impl]


def run_impl(c: VarlenCase, impl: str, device: str = "cpu") -> dict:
    """``impl`` alone on case ``c`` (in :func:`check_varlen`'s dtype), its results unchecked:
    fuzz.py's compile gate runs it with the kernel launches recorded only."""
    return run(c, impl, _dtype_atol(c, impl)[0], device)[0]


def check_varlen(c: VarlenCase, impl: str, device: str = "cpu") -> list[str]:
    """Mismatches of ``dilated_attention_varlen(impl=impl)`` against the float64 reference run
    on each document alone (empty: equal), forward, LSE and dq/dk/dv."""
    dtype, atol = _dtype_atol(c, impl)
    got, bad = run(c, impl, dtype, device)
    return bad + compare(reference(c), got, atol)
