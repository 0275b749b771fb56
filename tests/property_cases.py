"""Random dilated-attention configurations and their check against impl="reference".

Shared by tests/test_properties.py (hypothesis, bounded example count, in CI) and
scripts/fuzz.py (long runs that keep going and count mismatches). A configuration covers
branches (w, r) with lengths that are not multiples of w, GQA/MQA, key padding masks (including
fully padded rows), causal, split heads and queries shorter than keys.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from dilated_attention import dilated_attention
from dilated_attention.kernels.direct_launch import int_class


@dataclass(frozen=True)
class Case:
    b: int
    nq: int
    nk: int
    h: int
    hkv: int
    d: int
    seg: tuple[int, ...]
    dil: tuple[int, ...]
    causal: bool
    split: bool
    pad_frac: float  # 0: no mask
    seed: int


def _branches(draw_int, n_branches: int, nk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    seg, dil = [], []
    for _ in range(n_branches):
        w = draw_int(1, max(1, nk + 3))  # sometimes longer than the sequence
        seg.append(w)
        dil.append(draw_int(1, w))
    return tuple(seg), tuple(dil)


def _build(draw_int, draw_bool, draw_frac, seed: int, d: int) -> Case:
    nk = draw_int(1, 24)
    nq = nk if draw_bool() else draw_int(1, nk)
    hkv = draw_int(1, 2)
    h = hkv * draw_int(1, 3)
    seg, dil = _branches(draw_int, draw_int(1, 3), nk)
    return Case(
        b=draw_int(1, 2), nq=nq, nk=nk, h=h, hkv=hkv, d=d, seg=seg, dil=dil, causal=draw_bool(),
        split=draw_bool(), pad_frac=draw_frac(), seed=seed,
    )


def random_case(rng: random.Random, d: int = 16) -> Case:
    return _build(
        rng.randint, lambda: rng.random() < 0.5, lambda: rng.choice([0.0, 0.0, 0.3, 0.9]),
        rng.randrange(2**31), d,
    )


# The class Triton specialises an integer kernel argument on (the value 1, a multiple of 16, other;
# int32 / int64): values of one class share the compiled binaries. The launcher's own rule.
spec_class = int_class


def draw_like(rng: random.Random, lo: int, hi: int, like: int) -> int | None:
    """A uniform draw from ``[lo, hi]`` of the :func:`spec_class` of ``like`` (None if none)."""
    want = spec_class(like)
    pool = [x for x in range(lo, hi + 1) if spec_class(x) == want]
    return rng.choice(pool) if pool else None


def variant(c: Case, rng: random.Random) -> Case | None:
    """A random case that would, as a rule, run on the Triton binaries ``c`` compiled (fuzz.py's
    compile pool): the structure of ``c`` kept (heads, kv heads, headdim, number of branches,
    causal, split heads, whether there is a padding mask) and every value redrawn as
    :func:`random_case` draws it, but within the :func:`spec_class` of ``c``'s value: lengths,
    queries shorter than keys (and nk - nq), each branch's w and r (and (nk - nq) // w, the first
    segment a launch covers), batch (and batch x nq x heads), the mask's density, the tensors'
    seed. None when no such values exist. Other kernel arguments can still change class:
    fuzz.py's gate checks the launches themselves."""
    nk = draw_like(rng, 1, 24, c.nk)
    if nk is None:
        return None
    if c.nq == c.nk:
        nq = nk
    else:
        opts = [x for x in range(1, nk) if spec_class(x) == spec_class(c.nq)
                and spec_class(nk - x) == spec_class(c.nk - c.nq)]  # fmt: skip
        if not opts:
            return None
        nq = rng.choice(opts)
    seg, dil = [], []
    for w0, r0 in zip(c.seg, c.dil, strict=True):
        # w's class, and that of the launch's first segment with a query, (nk - nq) // w
        ws = [x for x in range(1, max(1, nk + 3) + 1) if spec_class(x) == spec_class(w0)
              and spec_class((nk - nq) // x) == spec_class((c.nk - c.nq) // w0)]  # fmt: skip
        w = rng.choice(ws) if ws else None
        r = None if w is None else draw_like(rng, 1, w, r0)
        if r is None:
            return None
        seg.append(w)
        dil.append(r)
    bs = [x for x in (1, 2) if spec_class(x * nq * c.h) == spec_class(c.b * c.nq * c.h)]  # rows of q
    if not bs:
        return None
    pad = rng.choice([0.3, 0.9]) if c.pad_frac > 0 else 0.0
    return Case(
        b=rng.choice(bs), nq=nq, nk=nk, h=c.h, hkv=c.hkv, d=c.d, seg=tuple(seg), dil=tuple(dil),
        causal=c.causal, split=c.split, pad_frac=pad, seed=rng.randrange(2**31),
    )


def case_strategy(d: int = 16):
    """A hypothesis strategy of :class:`Case` (imported lazily: fuzz.py may run without it)."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw):
        return _build(
            lambda lo, hi: draw(st.integers(lo, hi)), lambda: draw(st.booleans()),
            lambda: draw(st.sampled_from([0.0, 0.3, 0.9])), draw(st.integers(0, 2**31 - 1)), d,
        )

    return cases()


def _inputs(c: Case, dtype, device):
    g = torch.Generator().manual_seed(c.seed)
    q = torch.randn(c.b, c.nq, c.h, c.d, generator=g, dtype=torch.float64)
    k = torch.randn(c.b, c.nk, c.hkv, c.d, generator=g, dtype=torch.float64)
    v = torch.randn(c.b, c.nk, c.hkv, c.d, generator=g, dtype=torch.float64)
    do = torch.randn(c.b, c.nq, c.h, c.d, generator=g, dtype=torch.float64)
    kpm = torch.rand(c.b, c.nk, generator=g) < c.pad_frac if c.pad_frac > 0 else None
    to = dict(dtype=dtype, device=device)
    return q.to(**to), k.to(**to), v.to(**to), do.to(**to), None if kpm is None else kpm.to(device)


def _run(c: Case, impl: str, dtype, device):
    q, k, v, do, kpm = _inputs(c, dtype, device)
    xs = [t.requires_grad_() for t in (q, k, v)]
    out, lse = dilated_attention(
        *xs, list(c.seg), list(c.dil), causal=c.causal, key_padding_mask=kpm,
        head_assignment="split" if c.split else "all", return_lse=True, impl=impl,
    )
    grads = torch.autograd.grad(out, xs, do)
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


# tolerances per impl: float64 torch path is exact to rounding; triton runs in float32
TOLERANCE = {"torch": (torch.float64, 1e-9), "triton": (torch.float32, 2e-4)}


def run_impl(c: Case, impl: str, device: str = "cpu") -> dict:
    """``impl`` alone on case ``c`` (forward and backward, in :data:`TOLERANCE`'s dtype), its
    results unchecked: fuzz.py's compile gate runs it with the kernel launches recorded only."""
    return _run(c, impl, TOLERANCE[impl][0], device)


def check(c: Case, impl: str, device: str = "cpu") -> list[str]:
    """Mismatches of ``impl`` against the float64 reference on case ``c`` (empty: equal)."""
    dtype, atol = TOLERANCE[impl]
    return compare(_run(c, "reference", torch.float64, "cpu"), _run(c, impl, dtype, device), atol)


def compare(ref: dict, got: dict, atol: float) -> list[str]:
    """Mismatches of the results ``got`` against ``ref`` (dicts of tensors by name, ``"lse"``
    compared on its finite entries after its -inf pattern): error at most ``atol`` times
    ``1 + max |ref|``, no NaN, equal shapes."""
    bad = []
    for name, want in ref.items():
        have = got[name].detach().to("cpu", torch.float64)
        want = want.detach()
        if have.shape != want.shape:
            bad.append(f"{name}: shape {tuple(have.shape)} != {tuple(want.shape)}")
            continue
        if name == "lse":  # -inf (no key) must match exactly; finite values within tolerance
            if not torch.equal(torch.isneginf(have), torch.isneginf(want)):
                bad.append(f"{name}: -inf pattern differs")
                continue
            fin = torch.isfinite(want)
            have, want = have[fin], want[fin]
        if torch.isnan(have).any():
            bad.append(f"{name}: NaN")
            continue
        err = (have - want).abs().max().item() if want.numel() else 0.0
        scale = 1.0 + (want.abs().max().item() if want.numel() else 0.0)
        if err > atol * scale:
            bad.append(f"{name}: max abs err {err:.3g} > {atol * scale:.3g}")
    return bad
