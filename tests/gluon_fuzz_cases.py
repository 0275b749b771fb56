"""Random configurations that take the Gluon kernels (kernels/gluon_fwd.py + gluon_fwd_kernel.py,
gluon_bwd.py + gluon_bwd_kernel.py), their variants within Triton's specialisation classes, and
their check against impl="reference": ``scripts/fuzz.py --gluon``.

The Gluon kernels run a call only when every condition of their gate holds
(``gluon_fwd.shape_problem`` / ``problem``, ``gluon_bwd.problem``), so the dense generator of
tests/property_cases.py (headdim 16, float32, masks, nq < nk) never reaches them. A
:class:`GluonCase` satisfies every condition a case controls (:func:`case_problem` lists them):
bf16 or fp16, headdim 64 or 128, seqlen_q == seqlen_k = N, every branch with w // r >= 2;
w % r != 0 (blocks of two lengths, ``gluon_fwd.UNEVEN_BLOCKS``, on as shipped) for a branch in
:data:`UNEVEN_P` of the draws, its heads starting at a multiple of r; N % w != 0 (a short last
segment, ``gluon_fwd.TAIL_SEGMENTS``, on as shipped: its blocks of >= 2 rows; at batch 2 with
``gluon_fwd.TAIL_BATCHES``, on as shipped since 2026-11-29, read when drawing) in
:data:`TAIL_P` of the cases (their backward is the Gluon one only where
``gluon_bwd.TAIL_SEGMENTS`` is on: :func:`backward_runs_gluon` reads it when asked);
contiguous q / k / v, no key padding mask, no packed documents, batch 1-2, heads 1-8
with kv heads dividing them (MHA, GQA, MQA), causal or not; the backward's extra condition,
every branch over all heads, holds unless the case splits its heads (``split``, one case in
five: the Gluon forward, then the Triton backward). What a case cannot control: the device
(CUDA sm_90 with Triton's Gluon: :func:`gluon_unavailable`) and the speed rules
``gluon_fwd.MIN_ROWS`` (batch x N x heads below it runs the Triton kernels for their host time)
and ``D64_MIN_BLOCK``, set to 0 while a case runs: the kernels' exactness depends on neither. Sizes stay small for the float64 reference,
which is dense (B x H x N x N scores, :data:`MAX_SCORES`): N <= 4096, drawn log-uniformly and
mostly among numbers with many divisors (so that several branches fit); lengths w // r of
every size, mostly not multiples of the kernels' 64 / 128-row tiles (partial tiles), some over
128 (several tiles); the first branch with r = 1 half of the time, else any r.

The check (:func:`check`) is tests/test_gluon_fwd.py's and test_gluon_bwd.py's: out, lse, dq,
dk, dv of impl="triton" with both Gluon switches on must be within 2x the error of the same
call with both switches off (the Triton kernels, same dtype, same inputs) + 1e-3 of the
float64 reference, which sees the very (rounded) inputs the kernels see; both within a gross
bound, :data:`GROSS_ATOL` x (1 + max |ref|) (fp16: varlen_cases.HALF_ATOL, the repository's
float16 tolerance; bf16: 8x that for its 3 fewer mantissa bits), which catches a wrong result
that both paths share; the -inf pattern of lse equal; no NaN. property_cases.TOLERANCE holds
no bf16 / fp16 tolerance, hence the relative rule. And the Gluon kernels must have launched:
:func:`counting_launches` counts the calls of ``gluon_fwd.launch_branch`` and
``gluon_bwd.launch_branch`` that returned, and :func:`launch_problems` wants every branch with
heads launched forward and, unless split heads make the Gluon backward refuse, each branch
once backward; else :class:`GluonNotLaunched` (fuzz.py counts it as an error, with the
reason a failed first launch left in ``gluon_fwd._failed`` / ``gluon_bwd._failed``): a
silent fall back to the Triton kernels is never a pass.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
from dataclasses import dataclass

import torch
from varlen_cases import HALF_ATOL

from dilated_attention import call_cache, dilated_attention, flags
from dilated_attention.branches import branch_head_ranges
from dilated_attention.kernels.direct_launch import int_class as spec_class

MAX_N = 4096  # longest sequence: the float64 reference is dense
MIN_N = 4
MAX_HEADS = 8
# B x H x N x N, the elements of each of the dense reference's (B, H, N, N) float64 tensors:
# 2^26 (512 MiB each, a few GiB per worker at its peak) allows N = 4096 with B x H <= 4 and
# every batch and head count up to N = 2048
MAX_SCORES = 1 << 26
SPLIT_P = 0.2  # head_assignment="split": the Gluon forward, the Triton backward
UNEVEN_P = 0.3  # a branch drawn with w % r != 0 (blocks of two lengths)
TAIL_P = 0.5  # a case whose branches may have N % w != 0 (a short last segment; batch 2 under TAIL_BATCHES)
GRID_MAX = 65535
# gross bound on any result's error, times 1 + max |ref| (fp16: the repository's float16
# tolerance, varlen_cases.HALF_ATOL; bf16: 8x, its 3 fewer mantissa bits)
GROSS_ATOL = {torch.float16: HALF_ATOL, torch.bfloat16: 8 * HALF_ATOL}
NAMES = ("out", "lse", "dq", "dk", "dv")


class HalfPrecision:
    """``dtype`` of a case with a ``bf16`` field: bfloat16, else float16."""

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float16


@dataclass(frozen=True)
class GluonCase(HalfPrecision):
    b: int
    n: int  # seqlen_q == seqlen_k
    h: int
    hkv: int
    d: int  # 64 or 128
    seg: tuple[int, ...]
    dil: tuple[int, ...]
    causal: bool
    split: bool  # head_assignment="split" (the Gluon backward refuses it unless every branch has all heads)
    bf16: bool  # else float16
    seed: int

    @property
    def head_assignment(self) -> str:
        return "split" if self.split else "all"


class GluonNotLaunched(RuntimeError):
    """The Gluon kernels did not run a case that they should have run (a fall back to Triton)."""


# ------------------------------------------------------------------------------ the gate


def branches_with_heads(c: GluonCase) -> list[tuple[int, int, int, int]]:
    """(w, r, head start, head stop) of the branches that have heads (``triton_launch.branch_list``)."""
    ranges = branch_head_ranges(c.h, len(c.seg), c.head_assignment)
    return [(w, r, hs, he) for (w, r), (hs, he) in zip(zip(c.seg, c.dil, strict=True), ranges, strict=True) if he > hs]


def tail_batches() -> bool:
    """``gluon_fwd.TAIL_BATCHES`` (read now): batch > 1 with short last segments, each entry
    launched apart (on as shipped since 2026-11-29)."""
    from dilated_attention.kernels import gluon_fwd

    return gluon_fwd.TAIL_BATCHES


def has_tail(c: GluonCase) -> bool:
    """Whether a branch has a short last segment (N % w != 0)."""
    return any(c.n % w for w in c.seg)


def backward_runs_gluon(c: GluonCase) -> bool:
    """Whether the Gluon backward takes the case: every branch with heads over all of them, and
    no short last segment unless ``gluon_bwd.TAIL_SEGMENTS`` is on (read now)."""
    from dilated_attention.kernels import gluon_bwd

    if has_tail(c) and not gluon_bwd.TAIL_SEGMENTS:
        return False
    return all(hs == 0 and he == c.h for _, _, hs, he in branches_with_heads(c))


def _tail_ok(t: int, r: int) -> bool:
    """A short last segment of ``t`` rows with dilation r: none, or blocks of >= 2 rows."""
    return t == 0 or t // r >= 2


def case_problem(c: GluonCase) -> str | None:
    """Why the Gluon forward would not run case ``c`` on an sm_90 GPU with Gluon and
    ``gluon_fwd.MIN_ROWS`` and ``D64_MIN_BLOCK`` 0 (None: it would): the conditions of
    ``gluon_fwd.shape_problem`` that the case controls, with UNEVEN_BLOCKS and TAIL_SEGMENTS on
    (as shipped), in pure Python; and the
    fuzzer's own bounds (batch, heads, N, :data:`MAX_SCORES`)."""
    if c.dtype not in (torch.bfloat16, torch.float16) or c.d not in (64, 128):
        return f"dtype {c.dtype} / headdim {c.d}"
    if not (1 <= c.b <= 2 and 1 <= c.hkv <= c.h <= MAX_HEADS and c.h % c.hkv == 0):
        return f"batch {c.b}, heads {c.h}, kv heads {c.hkv}"
    if not (MIN_N <= c.n <= MAX_N) or c.b * c.h * c.n * c.n > MAX_SCORES:
        return f"N = {c.n} (batch {c.b}, heads {c.h})"
    if not c.seg or len(c.seg) != len(c.dil) or not branches_with_heads(c):
        return "no branch with heads"
    for w, r in zip(c.seg, c.dil, strict=True):
        if not (1 <= r <= w) or w // r < 2:
            return f"branch (w={w}, r={r}): needs w // r >= 2"
        if c.n % w and c.b != 1 and not tail_batches():
            return (f"branch (w={w}) with N = {c.n}: a short last segment needs batch 1 (batch {c.b}) "
                    "while gluon_fwd.TAIL_BATCHES is off")  # fmt: skip
        if not _tail_ok(c.n % w, r):
            return f"branch (w={w}, r={r}) with N = {c.n}: its short last segment has blocks of one row"
        if c.n // w > GRID_MAX or c.b * c.h > GRID_MAX:
            return f"branch (w={w}, r={r}): grid past CUDA's limits"
    for w, r, hs, _ in branches_with_heads(c):
        if (w % r or (c.n % w) % r) and hs % r:
            return f"branch (w={w}, r={r}): blocks of two lengths need its heads from a multiple of r (from {hs})"
    return None


# ------------------------------------------------------------------------------ generator


@functools.cache
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(x for x in range(1, n + 1) if n % x == 0)


@functools.cache
def _smooth() -> tuple[int, ...]:
    """2^a 3^b 5^c 7^d in [MIN_N, MAX_N]: lengths with many divisors (several branches fit)."""
    out = {1}
    for p in (2, 3, 5, 7):
        out |= {x * p**e for x in out for e in range(13) if x * p**e <= MAX_N}
    return tuple(sorted(x for x in out if x >= MIN_N))


def _draw_n(rng: random.Random) -> int:
    t = math.exp(rng.uniform(math.log(MIN_N), math.log(MAX_N)))  # log-uniform: mostly small and cheap
    if rng.random() < 0.7:
        near = [x for x in _smooth() if t / 1.3 <= x <= t * 1.3]
        return rng.choice(near) if near else min(_smooth(), key=lambda x: abs(x - t))
    return max(MIN_N, min(MAX_N, round(t)))


def _draw_branch(rng: random.Random, n: int, first: bool, tail: bool = False) -> tuple[int, int]:
    """A branch (w, r) of length N = ``n``: r = 1 for half the first branches (LongNet's),
    else mostly r > 1 where w has such a divisor, and in :data:`UNEVEN_P` of the draws an r
    that does not divide w. ``tail``: w need not divide N (half the draws: any w in [2, 2N])."""
    if tail and rng.random() < 0.5:
        w = rng.randint(2, 2 * n)
    else:
        w = rng.choice([x for x in _divisors(n) if x >= 2])
    if first and rng.random() < 0.5:
        return w, 1
    uneven = [r for r in range(2, w // 2 + 1) if w % r] if rng.random() < UNEVEN_P else []
    if uneven:
        return w, rng.choice(uneven)
    rs = [r for r in _divisors(w) if w // r >= 2]
    dilated = [r for r in rs if r > 1]
    return w, rng.choice(dilated if dilated and rng.random() < 0.8 else rs)


def draw_kv_heads(rng: random.Random, h: int) -> int:
    """kv heads for ``h`` query heads: MHA, MQA or GQA a third of the time each (kv heads a proper
    divisor of the heads; MHA where none)."""
    kind = rng.random()
    gqa = [x for x in _divisors(h) if 1 < x < h]
    return 1 if 1 / 3 <= kind < 2 / 3 else rng.choice(gqa) if kind >= 2 / 3 and gqa else h


def gluon_case(rng: random.Random, d: int | None = None) -> GluonCase:
    """A random case that the Gluon kernels take (:func:`case_problem` None); ``d`` None draws
    64 or 128 (fuzz.py's draw signature)."""
    while True:
        n = _draw_n(rng)
        h = rng.randint(1, MAX_HEADS)
        b = rng.randint(1, 2)
        if b * h * n * n <= MAX_SCORES:
            break
    hkv = draw_kv_heads(rng, h)
    d = d if d is not None else rng.choice([64, 128])
    tail = (b == 1 or tail_batches()) and rng.random() < TAIL_P
    split, causal, bf16 = rng.random() < SPLIT_P, rng.random() < 0.5, rng.random() < 0.5
    while True:  # redraw the branches until the gate takes them (two-length blocks' heads, tails)
        nb = rng.randint(1, 3)
        br = [_draw_branch(rng, n, i == 0, tail) for i in range(nb)]
        if rng.random() < 0.6:  # LongNet's order; else any order (FIRST / COMP / STORE_LO differ)
            br.sort()
        c = GluonCase(
            b=b, n=n, h=h, hkv=hkv, d=d, seg=tuple(w for w, _ in br), dil=tuple(r for _, r in br), causal=causal,
            split=split, bf16=bf16, seed=rng.randrange(2**31),
        )  # fmt: skip
        if case_problem(c) is None:
            return c


# ------------------------------------------------------------------------------ variants


@functools.cache
def tiles(d: int) -> tuple[int, ...]:
    """The tile rows whose counts over a block, ceil(L / rows), are kernel arguments at headdim
    ``d``: the Gluon backward's 128 (gluon_bwd_kernel.BLK), the Triton kernels' BM / BN
    (``triton_launch.default_configs``, compiled and interpreted: NM, NNB)."""
    rows = {128}
    try:
        from dilated_attention.kernels.triton_launch import default_configs
    except Exception:  # noqa: BLE001 - no Triton: its blocks do not matter
        return tuple(sorted(rows))
    for interpret in (False, True):
        for bm, bn, _, _ in default_configs(d, interpret).values():
            rows |= {bm, bn}
    return tuple(sorted(rows))


def _length_key(w: int, r: int, d: int) -> tuple[int, ...]:
    """The :func:`spec_class` of w, of both block lengths (floor and ceil of w / r) and of the
    tile counts over each (:func:`tiles`)."""
    lo, hi = w // r, -(-w // r)
    return (spec_class(w), spec_class(lo), spec_class(hi),
            *(spec_class(-(-x // t)) for x in (lo, hi) for t in tiles(d)))  # fmt: skip


def branch_key(n: int, w: int, r: int, d: int) -> tuple[int, ...]:
    """What a variant keeps of a branch: whether its blocks have two lengths (w % r != 0: the
    kernels' CLASSES) and whether it has a short last segment (N % w rows), the
    :func:`spec_class` of r and of the segments N // w, and :func:`_length_key` of its segments
    and of its short last segment: kernel arguments of the Gluon and Triton launches."""
    t = n % w
    return (int(w % r > 0), int(t > 0), int(t % r > 0), spec_class(r), spec_class(n // w),
            *_length_key(w, r, d), *(_length_key(t, r, d) if t else ()))  # fmt: skip


def _int_in_class(rng: random.Random, cls: int, lo: int, hi: int) -> int | None:
    """A random integer in [lo, hi] of :func:`spec_class` ``cls`` (None: none drawn)."""
    if cls == 4:
        return 1 if lo <= 1 <= hi else None
    if cls == 1:
        a, b = -(-lo // 16), hi // 16
        return 16 * rng.randint(a, b) if a <= b else None
    x = rng.randint(lo, hi) if lo <= hi else None
    return x if x is not None and spec_class(x) == cls else None


def _pair_like(n: int, d: int, key: tuple, rng: random.Random, tries: int = 400) -> tuple[int, int] | None:
    """A branch (w, r) of length N = ``n`` with :func:`branch_key` ``key``: from :func:`_pairs`
    where the key has blocks of one length and no short last segment, else by random draws of
    w and r in their classes (key[3] for r, key[5] for w)."""
    uneven, tail = key[0], key[1]
    if not uneven and not tail:
        got = _pairs(n, d).get(key)
        return rng.choice(got) if got else None
    divs = [x for x in _divisors(n) if spec_class(x) == key[5]]
    for _ in range(tries):
        w = _int_in_class(rng, key[5], 2, 2 * n) if tail else (rng.choice(divs) if divs else None)
        if w is None or bool(n % w) != bool(tail):
            continue
        r = _int_in_class(rng, key[3], 1, w // 2)
        if r is not None and branch_key(n, w, r, d) == key:
            return w, r
    return None


@functools.lru_cache(maxsize=2 * MAX_N)
def _pairs(n: int, d: int) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """The Gluon branches (w, r) of length N = ``n``, by :func:`branch_key`."""
    out: dict = {}
    for w in _divisors(n):
        for r in _divisors(w):
            if w // r >= 2:
                out.setdefault(branch_key(n, w, r, d), []).append((w, r))
    return out


def case_key(c: GluonCase) -> tuple:
    """What :func:`variant` keeps: the structure (heads, kv heads, headdim, dtype, number and
    order of branches, causal, split) and the :func:`spec_class` of N, heads x N (the lse rows'
    stride), batch x N x heads (rows of q) and each :func:`branch_key`. (Whether the switches-off
    run folds its branches, ``triton_launch.fold_geometry``, may still change: the gate sees it.)"""
    branches = tuple(branch_key(c.n, w, r, c.d) for w, r in zip(c.seg, c.dil, strict=True))
    return (c.h, c.hkv, c.d, c.bf16, c.causal, c.split, spec_class(c.n), spec_class(c.h * c.n),
            spec_class(c.b * c.n * c.h), branches)  # fmt: skip


def variant(c: GluonCase, rng: random.Random, tries: int = 40) -> GluonCase | None:
    """A random case that would, as a rule, run on the binaries ``c`` compiled (fuzz.py's compile
    pool): :func:`case_key` kept, every value redrawn (N, log-uniformly as :func:`gluon_case`
    draws it; each branch's w and r among those of the new N with the template branch's key;
    batch; the tensors' seed). None when ``tries`` lengths in class gave no branch in class.
    Other kernel arguments can still change class: fuzz.py's gate checks the launches."""
    want = case_key(c)
    ns = [x for x in range(MIN_N, MAX_N + 1) if spec_class(x) == want[6] and spec_class(c.h * x) == want[7]
          and c.h * x * x <= MAX_SCORES]  # fmt: skip
    if not ns:
        return None
    tail = any(key[1] for key in want[9])
    for n in rng.choices(ns, weights=[1.0 / x for x in ns], k=tries):
        bs = [b for b in ((1,) if tail and not tail_batches() else (1, 2))
              if spec_class(b * n * c.h) == want[8] and b * c.h * n * n <= MAX_SCORES]  # fmt: skip
        if not bs:
            continue
        br = [_pair_like(n, c.d, key, rng) for key in want[9]]
        if not all(br):
            continue
        out = GluonCase(
            b=rng.choice(bs), n=n, h=c.h, hkv=c.hkv, d=c.d, seg=tuple(w for w, _ in br), dil=tuple(r for _, r in br),
            causal=c.causal, split=c.split, bf16=c.bf16, seed=rng.randrange(2**31),
        )  # fmt: skip
        if case_problem(out) is not None:  # two-length blocks whose split heads start off a multiple of r
            continue
        assert case_key(out) == want, (out, c)
        return out
    return None


# ------------------------------------------------------------------------------ runs


def gluon_unavailable(device: str) -> str | None:
    """Why the Gluon kernels cannot run on ``device`` in this process (None: they can): Triton's
    interpreter, no CUDA device, another compute capability than 9.0, Gluon or its Hopper module
    missing."""
    try:
        from dilated_attention.kernels import gluon_bwd, gluon_fwd, triton_import
    except Exception as e:  # noqa: BLE001 - triton missing: say so
        return f"the Triton kernels do not import ({type(e).__name__}: {e})"
    if triton_import.INTERPRET:
        return "TRITON_INTERPRET is set: Triton's interpreter does not run Gluon kernels"
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"--device {device}: the Gluon kernels run on a CUDA device only (--device cuda)"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__})"
    cap = torch.cuda.get_device_capability(dev)
    if cap != (9, 0):
        name = torch.cuda.get_device_name(dev)
        return f"the Gluon kernels are for sm_90 (Hopper) only, {name} is sm_{cap[0]}{cap[1]}"
    for mod in (gluon_fwd, gluon_bwd):
        if mod.kernel_module() is None:
            return f"Gluon or its Hopper module is missing: {mod._import_error}"
    return None


@contextlib.contextmanager
def gluon_switches(on: bool):
    """Both Gluon switches ``on`` (``flags.set_gluon_forward`` / ``set_gluon_backward``) and
    ``gluon_fwd.MIN_ROWS`` and ``D64_MIN_BLOCK`` 0 meanwhile; afterwards the switches follow the environment again."""
    from dilated_attention.kernels import gluon_fwd

    rows, block = gluon_fwd.MIN_ROWS, gluon_fwd.D64_MIN_BLOCK
    gluon_fwd.MIN_ROWS = gluon_fwd.D64_MIN_BLOCK = 0
    flags.set_gluon_forward(on)
    flags.set_gluon_backward(on)
    call_cache.clear()
    try:
        yield
    finally:
        flags.set_gluon_forward(None)
        flags.set_gluon_backward(None)
        gluon_fwd.MIN_ROWS, gluon_fwd.D64_MIN_BLOCK = rows, block


@contextlib.contextmanager
def counting_launches():
    """``{"fwd": [(w, r, hs, he), ...], "bwd": [(w, r, kernel), ...]}``: the calls of
    ``gluon_fwd.launch_branch`` and ``gluon_bwd.launch_branch`` (one entry per kernel it launched:
    "dkdv", "dq") that returned meanwhile (a launch
    that raised makes the caller fall back to the Triton kernels: not counted)."""
    from dilated_attention.kernels import gluon_bwd, gluon_fwd

    seen: dict[str, list] = {"fwd": [], "bwd": []}
    real_fwd, real_bwd = gluon_fwd.launch_branch, gluon_bwd.launch_branch

    def fwd(*a, **kw):
        res = real_fwd(*a, **kw)
        seen["fwd"].append(tuple(a[6:10]))
        return res

    def bwd(*a, **kw):
        res = real_bwd(*a, **kw)
        kernels = kw.get("kernels", a[14] if len(a) > 14 else gluon_bwd.KERNELS)
        seen["bwd"] += [(*a[9:11], kern) for kern in kernels]  # SPLIT_PHASES: one call per kernel
        return res

    gluon_fwd.launch_branch, gluon_bwd.launch_branch = fwd, bwd
    try:
        yield seen
    finally:
        gluon_fwd.launch_branch, gluon_bwd.launch_branch = real_fwd, real_bwd


def launch_problems(c: GluonCase, seen: dict) -> list[str]:
    """What :func:`counting_launches` saw wrong for case ``c``: the Gluon forward must launch
    every branch with heads (once per lo range), the Gluon backward each branch once where it
    takes the case (:func:`backward_runs_gluon`) and never where it does not."""
    from dilated_attention.kernels import gluon_bwd

    bad = []
    want = branches_with_heads(c)
    if set(seen["fwd"]) != set(want):
        bad.append(f"the Gluon forward launched branches (w, r, hs, he) {sorted(set(seen['fwd']))}, expected {want}")
    # the backward launches each branch's full segments, then its short last one as (N % w, r)
    want_bwd = sorted([(w, r) for w, r, _, _ in want] + [(c.n % w, r) for w, r, _, _ in want if c.n % w])
    if has_tail(c):  # batch > 1: each entry launched apart (gluon_fwd.TAIL_BATCHES)
        want_bwd = sorted(want_bwd * c.b)
    want_bwd = sorted((w, r, kern) for w, r in want_bwd for kern in gluon_bwd.KERNELS) if backward_runs_gluon(c) else []
    if sorted(seen["bwd"]) != want_bwd:
        bad.append(f"the Gluon backward launched (w, r, kernel) {sorted(seen['bwd'])}, expected {want_bwd}")
    return bad


def _failures() -> list[str]:
    """The first-launch failures the Gluon modules recorded (which route those configurations to
    the Triton kernels for good), cleared: the next case tries again."""
    from dilated_attention.kernels import gluon_bwd, gluon_fwd

    out = []
    for what, mod in (("forward", gluon_fwd), ("backward", gluon_bwd)):
        out += [f"the Gluon {what} failed for {key}: {why}" for key, why in mod._failed.items()]
        mod._failed.clear()
    return out


def _inputs(c: GluonCase, device: str):
    """q, k, v, dO in the case's dtype, from its seed (a generator on ``device``)."""
    g = torch.Generator(device=device).manual_seed(c.seed)
    shapes = [(c.b, c.n, c.h, c.d), (c.b, c.n, c.hkv, c.d), (c.b, c.n, c.hkv, c.d), (c.b, c.n, c.h, c.d)]
    return [torch.randn(s, generator=g, device=device).to(c.dtype) for s in shapes]


def run(c: GluonCase, impl: str, device: str, gluon: bool | None) -> dict:
    """``impl`` on case ``c``, forward (out, lse) and backward (dq, dk, dv): the reference
    (``gluon`` None) in float64 on the case's rounded inputs, else in the case's dtype with both
    Gluon switches ``gluon`` (:func:`gluon_switches`)."""
    q, k, v, do = _inputs(c, device)
    dtype = torch.float64 if gluon is None else c.dtype
    xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    with gluon_switches(bool(gluon)) if gluon is not None else contextlib.nullcontext():
        out, lse = dilated_attention(
            *xs, list(c.seg), list(c.dil), causal=c.causal, head_assignment=c.head_assignment, return_lse=True,
            impl=impl,
        )  # fmt: skip
        grads = torch.autograd.grad(out, xs, do.to(dtype))
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def run_impl(c: GluonCase, impl: str, device: str = "cuda"):
    """The runs of ``impl`` that :func:`check` makes (both Gluon switches off, then on), results
    unchecked: fuzz.py's compile gate runs them with the kernel launches recorded only."""
    return run(c, impl, device, False), run(c, impl, device, True)


def _max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.detach().double() - ref).abs().max().item() if ref.numel() else 0.0


def judge(ref: dict, base: dict, got: dict, dtype: torch.dtype) -> list[str]:
    """Mismatches of ``got`` (both Gluon switches on) against the float64 ``ref``, given ``base``
    (both off; dicts of tensors by :data:`NAMES`): shapes equal, no NaN, lse's -inf pattern
    equal (then its finite entries), error <= 2x base's + 1e-3 (tests/test_gluon_fwd.py's rule)
    and, for both, <= :data:`GROSS_ATOL` x (1 + max |ref|)."""
    bad = []
    for name in NAMES:
        want = ref[name].detach().to(torch.float64)
        a, b = got[name].detach(), base[name].detach()
        if a.shape != want.shape or b.shape != want.shape:
            bad.append(f"{name}: shapes {tuple(a.shape)} / {tuple(b.shape)} != {tuple(want.shape)}")
            continue
        if name == "lse":  # -inf (no key) must match exactly; finite values within tolerance
            if not torch.equal(torch.isneginf(a), torch.isneginf(want)):
                bad.append(f"{name}: -inf pattern differs")
                continue
            fin = torch.isfinite(want)
            a, b, want = a[fin], b[fin], want[fin]
        if torch.isnan(a).any():
            bad.append(f"{name}: NaN")
            continue
        ea, eb = _max_err(a, want), _max_err(b, want)
        if not ea <= 2 * eb + 1e-3:  # NaN in base: the gross bound below says so
            bad.append(f"{name}: Gluon err {ea:.3g} > 2 x Triton err {eb:.3g} + 1e-3")
        gross = GROSS_ATOL[dtype] * (1.0 + (want.abs().max().item() if want.numel() else 0.0))
        if not ea <= gross:
            bad.append(f"{name}: Gluon err {ea:.3g} > {gross:.3g}")
        if not eb <= gross:
            bad.append(f"{name}: Triton err (Gluon off) {eb:.3g} > {gross:.3g}")
    return bad


def check(c: GluonCase, impl: str = "triton", device: str = "cuda") -> list[str]:
    """Mismatches of ``impl`` with the Gluon kernels on case ``c`` (empty: equal), :func:`judge`;
    raises :class:`GluonNotLaunched` when they did not run it (:func:`launch_problems`)."""
    ref = run(c, "reference", device, None)
    base = run(c, impl, device, False)
    with counting_launches() as seen:
        got = run(c, impl, device, True)
    why = launch_problems(c, seen)
    if why:
        raise GluonNotLaunched("; ".join(why + _failures()))
    return judge(ref, base, got, c.dtype)
