"""Random packed-document configurations that take the Gluon varlen kernels
(kernels/gluon_varlen.py + gluon_varlen_kernel.py), their variants, and their check against the
float64 reference run on each document alone: ``scripts/fuzz.py --gluon --varlen``.

The Gluon varlen forward and backward run a packed call (``dilated_attention_varlen(impl="triton")``
on an sm_90 GPU) when ``gluon_varlen.problem`` / ``backward_problem`` say None. A
:class:`GluonVarlenCase` satisfies every condition a case controls (:func:`case_problem`): bf16 or
fp16, head dim 64 or 128, the same offsets for queries and keys, every branch over all heads with
w // r >= 2, contiguous inputs. The speed gates (``gluon_varlen.MIN_MEAN_DOC*``, ``HEADDIMS*``,
``gluon_fwd.MIN_ROWS``, ``D64_MIN_BLOCK``) are lifted while a case runs
(:func:`varlen_gates_open`): the kernels' exactness depends on none of them.

What a case draws: 1-12 documents of lognormal lengths with empty and one-row documents among
them (stream of at most :data:`MAX_TOTAL` rows); heads 1-8 with kv heads dividing them; 1-3
branches (the first with r = 1 half of the time: the first branch then stores every row; else
the buffers are filled), w up to 1024, any r with w // r >= 2 (r not dividing w in some);
causal or not; the offsets on the host (checked: host descriptors where r divides the stream's
rows) or on the device (unchecked: the split launches of ``HOST_DESCRIPTORS_UNCHECKED``), and
then, in half the cases, rows past the last document holding NaN / inf, which no document may
see, and in half of them (odd seeds) the Gluon run with ``FILL_UNCOVERED_ONLY`` on (only the rows no
document covers filled); the caller's ``max_seqlen`` equal to the longest document or larger.

The check (:func:`check`) is gluon_fuzz_cases.judge's: out, lse, dq, dk, dv with the Gluon
kernels within 2x the error of the same call on the Triton varlen kernels (both Gluon switches
off) + 1e-3 of the float64 reference, both within a gross bound, lse's -inf pattern equal, no
NaN; rows past the last document out 0, lse -inf and zero gradients (the reference says so).
And the Gluon varlen kernels must have run: :func:`counting_calls` counts the returns of
``gluon_varlen.forward`` and ``backward``, one each per case, else :class:`GluonNotLaunched`.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass

import torch
from gluon_fuzz_cases import GluonNotLaunched, HalfPrecision, draw_kv_heads, gluon_switches, judge
from helpers import varlen_reference

from dilated_attention import dilated_attention_varlen
from dilated_attention.kernels.direct_launch import int_class as spec_class

MAX_TOTAL = 3000  # stream rows (documents and rows past them): the reference is dense per document
MAX_HEADS = 8
MAX_DOCS = 12
W_CHOICES = (8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 256, 384, 512, 1024)
PAST_P = 0.5  # of the cases with device offsets: rows past the last document (holding NaN / inf)


@dataclass(frozen=True)
class GluonVarlenCase(HalfPrecision):
    lens: tuple[int, ...]  # document lengths (queries = keys)
    past: int  # rows past the last document (device offsets only: host offsets must end at the stream's end)
    max_extra: int  # the caller's max_seqlen = the longest document + max_extra
    h: int
    hkv: int
    d: int  # 64 or 128
    seg: tuple[int, ...]
    dil: tuple[int, ...]
    causal: bool
    bf16: bool  # else float16
    device_offsets: bool  # cu_seqlens on the device (unchecked), else on the host (checked)
    seed: int

    @property
    def total(self) -> int:
        return sum(self.lens) + self.past

    @property
    def max_len(self) -> int:
        return max(self.lens) + self.max_extra

    @property
    def fill_uncovered_only(self) -> bool:
        """``gluon_varlen.FILL_UNCOVERED_ONLY`` for the Gluon run: on for half of the cases with
        device offsets (odd seeds; from the seed so that older draws are unchanged)."""
        return self.device_offsets and bool(self.seed & 1)


def case_problem(c: GluonVarlenCase) -> str | None:
    """Why the Gluon varlen kernels would not run case ``c`` with the speed gates lifted (None:
    they would), as far as the case controls it; and the fuzzer's own bounds."""
    if c.d not in (64, 128):
        return f"headdim {c.d}"
    if not (1 <= c.hkv <= c.h <= MAX_HEADS and c.h % c.hkv == 0):
        return f"heads {c.h}, kv heads {c.hkv}"
    if not (1 <= len(c.lens) <= MAX_DOCS) or min(c.lens) < 0 or max(c.lens) < 1:
        return f"documents {c.lens}: at least one with a row"
    if c.past and not c.device_offsets:
        return "rows past the last document need offsets on the device (host offsets are checked)"
    if not (1 <= c.total <= MAX_TOTAL):
        return f"{c.total} rows"
    if not c.seg or len(c.seg) != len(c.dil):
        return "no branch"
    for w, r in zip(c.seg, c.dil, strict=True):
        if not (1 <= r <= w) or w // r < 2:
            return f"branch (w={w}, r={r}): needs w // r >= 2"
    return None


# ------------------------------------------------------------------------------ generator


def _draw_lens(rng: random.Random, total: int, ndocs: int) -> tuple[int, ...]:
    """``ndocs`` lengths summing to ``total`` (lognormal shares; an empty and a one-row document
    among them in some draws), at least one of them > 0."""
    shares = [math.exp(rng.gauss(0.0, 1.0)) for _ in range(ndocs)]
    lens = [int(total * s / sum(shares)) for s in shares]
    lens[rng.randrange(ndocs)] += total - sum(lens)
    if ndocs >= 3 and rng.random() < 0.3:  # an empty and a one-row document (moved from another)
        i, j = rng.sample(range(ndocs), 2)
        big = max(range(ndocs), key=lambda x: lens[x])
        moved = lens[i] + lens[j] - 1
        lens[i], lens[j] = 0, 1
        lens[big if big not in (i, j) else next(x for x in range(ndocs) if x not in (i, j))] += (
            moved
        )
    return tuple(lens)


def _draw_branch(rng: random.Random, first: bool) -> tuple[int, int]:
    w = rng.choice(W_CHOICES)
    if first and rng.random() < 0.5:
        return w, 1
    rs = [r for r in range(1, w // 2 + 1) if r <= 16]
    uneven = [r for r in rs if w % r]
    return w, rng.choice(uneven if uneven and rng.random() < 0.3 else [r for r in rs if w % r == 0])


def gluon_varlen_case(rng: random.Random, d: int | None = None) -> GluonVarlenCase:
    """A random case that the Gluon varlen kernels take (:func:`case_problem` None); ``d`` None
    draws 64 or 128 (fuzz.py's draw signature)."""
    h = rng.randint(1, MAX_HEADS)
    hkv = draw_kv_heads(rng, h)
    d = d if d is not None else rng.choice([64, 128])
    device_offsets = rng.random() < 0.5
    while True:
        docs_total = int(math.exp(rng.uniform(math.log(8), math.log(MAX_TOTAL - 200))))
        ndocs = rng.randint(1, min(MAX_DOCS, max(1, docs_total // 2)))
        past = rng.choice([1, 7, 64, 129, 200]) if device_offsets and rng.random() < PAST_P else 0
        nb = rng.randint(1, 3)
        br = [_draw_branch(rng, i == 0) for i in range(nb)]
        if rng.random() < 0.6:
            br.sort()
        c = GluonVarlenCase(
            lens=_draw_lens(rng, docs_total, ndocs), past=past, max_extra=rng.choice([0, 0, 0, 5, 64]),
            h=h, hkv=hkv, d=d, seg=tuple(w for w, _ in br), dil=tuple(r for _, r in br),
            causal=rng.random() < 0.5, bf16=rng.random() < 0.5, device_offsets=device_offsets,
            seed=rng.randrange(2**31),
        )  # fmt: skip
        if case_problem(c) is None:
            return c


def case_key(c: GluonVarlenCase) -> tuple:
    """What :func:`variant` keeps: everything but the document lengths, the caller's bound over
    them and the seed; the stream's row count is kept too (host descriptors and the split depend
    on it and on r), and the :func:`spec_class` of the document count."""
    return (c.total, c.past, c.h, c.hkv, c.d, c.seg, c.dil, c.causal, c.bf16, c.device_offsets,
            spec_class(len(c.lens)))  # fmt: skip


def variant(c: GluonVarlenCase, rng: random.Random, tries: int = 40) -> GluonVarlenCase | None:
    """Another packing of the same stream (fuzz.py's compile pool): :func:`case_key` kept, the
    documents' count (same class) and lengths, the caller's bound and the seed redrawn. Kernel
    arguments that still change class (the entry slots, the rows' padding) are the gate's to see."""
    want = case_key(c)
    for _ in range(tries):
        ndocs = rng.randint(1, MAX_DOCS)
        if spec_class(ndocs) != want[-1] or ndocs > sum(c.lens):
            continue
        out = GluonVarlenCase(
            lens=_draw_lens(rng, sum(c.lens), ndocs), past=c.past, max_extra=rng.choice([0, 0, 0, 5, 64]),
            h=c.h, hkv=c.hkv, d=c.d, seg=c.seg, dil=c.dil, causal=c.causal, bf16=c.bf16,
            device_offsets=c.device_offsets, seed=rng.randrange(2**31),
        )  # fmt: skip
        if case_problem(out) is None and case_key(out) == want:
            return out
    return None


# ------------------------------------------------------------------------------ runs


@contextlib.contextmanager
def varlen_gates_open(fill_uncovered_only: bool | None = None):
    """Both Gluon varlen switches on and their speed gates lifted meanwhile (the mean-document
    gates 0, head dims 64 and 128 everywhere), and ``FILL_UNCOVERED_ONLY`` set where given;
    restored afterwards."""
    from dilated_attention.kernels import gluon_varlen as gv

    names = ("VARLEN_FORWARD", "VARLEN_BACKWARD", "MIN_MEAN_DOC", "MIN_MEAN_DOC_BACKWARD", "DEVICE_DESC_MIN_MEAN_DOC",
             "DEVICE_DESC_MIN_MEAN_DOC_BACKWARD", "HEADDIMS", "HEADDIMS_BACKWARD", "DEVICE_DESC_HEADDIMS_BACKWARD")  # fmt: skip
    kept = {n: getattr(gv, n) for n in (*names, "FILL_UNCOVERED_ONLY")}
    for n in names:
        setattr(gv, n, True if n.startswith("VARLEN") else 0 if "MEAN_DOC" in n else (64, 128))
    if fill_uncovered_only is not None:
        gv.FILL_UNCOVERED_ONLY = fill_uncovered_only
    try:
        yield
    finally:
        for n, val in kept.items():
            setattr(gv, n, val)


@contextlib.contextmanager
def counting_calls():
    """``{"forward": n, "backward": n}``: the returns of ``gluon_varlen.forward`` / ``backward``
    meanwhile (a launch that raised makes the caller fall back to the Triton kernels: not counted)."""
    from dilated_attention.kernels import gluon_varlen as gv

    seen = {"forward": 0, "backward": 0}
    real = {n: getattr(gv, n) for n in seen}

    def wrap(name):
        def call(*a, **kw):
            res = real[name](*a, **kw)
            seen[name] += 1
            return res

        return call

    for n in seen:
        setattr(gv, n, wrap(n))
    try:
        yield seen
    finally:
        for n, fn in real.items():
            setattr(gv, n, fn)


def _failures() -> list[str]:
    """The first-launch failures gluon_varlen recorded (which route those configurations to the
    Triton varlen kernels for good), cleared: the next case tries again."""
    from dilated_attention.kernels import gluon_varlen as gv

    out = [f"the Gluon varlen forward failed for {k}: {why}" for k, why in gv._failed.items()]
    out += [f"the Gluon varlen backward failed for {k}: {why}" for k, why in gv._bwd_failed.items()]
    gv._failed.clear()
    gv._bwd_failed.clear()
    return out


def _offsets(c: GluonVarlenCase) -> list[int]:
    out = [0]
    for n in c.lens:
        out.append(out[-1] + n)
    return out


def _inputs(c: GluonVarlenCase, device: str):
    """q, do (total, H, D) and k, v (total, Hkv, D) in the case's dtype from its seed; the rows
    past the last document NaN (q, v), -inf (k) and inf (dO)."""
    g = torch.Generator(device=device).manual_seed(c.seed)
    xs = [
        torch.randn(c.total, hh, c.d, generator=g, device=device).to(c.dtype)
        for hh in (c.h, c.hkv, c.hkv, c.h)
    ]
    n = sum(c.lens)
    for x, bad in zip(xs, (float("nan"), float("-inf"), float("nan"), float("inf")), strict=True):
        x[n:] = bad
    return xs


def run(c: GluonVarlenCase, impl: str, device: str, gluon: bool | None) -> dict:
    """Case ``c`` forward (out, lse) and backward (dq, dk, dv): the float64 reference on each
    document alone (``gluon`` None; rows past the documents out 0, lse -inf, zero gradients),
    else ``dilated_attention_varlen(impl=impl)`` in the case's dtype with both Gluon switches
    ``gluon`` and the varlen gates lifted."""
    q, k, v, do = _inputs(c, device)
    offs = _offsets(c)
    n = offs[-1]
    if gluon is None:
        xs = [t[:n].double().requires_grad_() for t in (q, k, v)]
        out, lse, grads = varlen_reference(*xs, offs, offs, list(c.seg), list(c.dil), do[:n].double(),
                                           causal=c.causal)  # fmt: skip
        pad = c.past
        return {"out": torch.cat([out, out.new_zeros(pad, *out.shape[1:])]),
                "lse": torch.cat([lse, lse.new_full((lse.shape[0], pad), float("-inf"))], -1),
                **{name: torch.cat([gr, gr.new_zeros(pad, *gr.shape[1:])]) for name, gr in zip(("dq", "dk", "dv"), grads,
                                                                                             strict=True)}}  # fmt: skip
    cu = torch.tensor(offs, dtype=torch.int32, device=device if c.device_offsets else "cpu")
    xs = [t.detach().requires_grad_() for t in (q, k, v)]
    with gluon_switches(bool(gluon)), varlen_gates_open(c.fill_uncovered_only if gluon else None):
        out, lse = dilated_attention_varlen(*xs, cu, cu, c.max_len, c.max_len, list(c.seg), list(c.dil),
                                            causal=c.causal, return_lse=True, impl=impl)  # fmt: skip
        grads = torch.autograd.grad(out, xs, do)
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def run_impl(c: GluonVarlenCase, impl: str, device: str = "cuda"):
    """The runs of ``impl`` that :func:`check` makes (Gluon off, then on), results unchecked:
    fuzz.py's compile gate runs them with the kernel launches recorded only."""
    return run(c, impl, device, False), run(c, impl, device, True)


def check(c: GluonVarlenCase, impl: str = "triton", device: str = "cuda") -> list[str]:
    """Mismatches of ``impl`` with the Gluon varlen kernels on case ``c`` (empty: equal):
    gluon_fuzz_cases.judge against the float64 reference per document, given the same call on
    the Triton varlen kernels; raises :class:`GluonNotLaunched` when the Gluon varlen forward or
    backward did not run it."""
    ref = run(c, "reference", device, None)
    base = run(c, impl, device, False)
    with counting_calls() as seen:
        got = run(c, impl, device, True)
    if seen != {"forward": 1, "backward": 1}:
        raise GluonNotLaunched("; ".join([f"gluon_varlen calls {seen}, expected one forward and one backward",
                                          *_failures()]))  # fmt: skip
    return judge(ref, base, got, c.dtype)
