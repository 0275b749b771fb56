"""The Gluon forward over packed documents on Hopper (issue 22 item 2b): when it runs, and its
launch (the kernel: :mod:`.gluon_varlen_kernel`).

``triton_launch.forward`` asks :func:`problem` for every packed (``docs``) call. Where it is None,
:func:`forward` runs the branches, one launch per branch over every (document, segment) entry,
instead of the Triton varlen kernels. The buffers and the FIRST / COMP / STORE_LO choices are
those of the Triton forward, so the (hi, lo) merge is the same arithmetic, and the Triton varlen
backward reads its out and lse as its own.

The entry table comes from the device offsets (:func:`device_entries`: no host read). Its
``total // w + documents`` slots bound the entries from shapes alone, and unused slots have 0
rows. Their programs, and the programs past a short block's rows, return at once. Offsets the
caller did not check on the host are clamped to the stream, so that no descriptor reaches past
q, k, v, out or lse. Rows outside every document then keep the filled values (zeros, lse -inf),
as on the Triton path.

:data:`VARLEN_FORWARD` is on (2026-11-29, twenty-eighth session, on an H200): its CUDA tests
(tests/test_gluon_varlen.py: 44 configurations, forward and backward against the float64 reference
per document) passed, and results/varlen_switch_ab_h200_2026-11-29.md timed the public packed call
with it on and off, interleaved, over six packed batches. Where it won, the forward took
0.87-0.97x the Triton varlen forward's time (fwd+bwd 0.94-1.02x): head dim 128 and documents of
4K tokens or more on average. Where it lost, :func:`problem` keeps the call on the Triton varlen
kernels: :data:`HEADDIMS` (head dim 64: 1.31x / 1.78x, not causal / causal) and
:data:`MIN_MEAN_DOC` (documents of 512 tokens on average: 1.46x / 1.41x).

:data:`VARLEN_BACKWARD` is on (2026-11-29, twenty-ninth session, on an H200): 50 CUDA tests passed
(both switches forced on, and a Triton forward into the Gluon backward), and the public packed
call's fwd+bwd took 0.77x / 0.87x the time with it on the issue's batch (not causal / causal),
0.82x in fp16 (results/varlen_switch_ab_bwd_h200_2026-11-29_s29.md). Its mean-document gate is its
own, :data:`MIN_MEAN_DOC_BACKWARD` = 1024 rows (with the forward on Triton: 0.89x / 0.98x at a mean
of 1024 rows, 0.87x / 0.90x at 2048, 1.00x / 1.05x at 512;
results/varlen_switch_ab_bwd_gate_h200_2026-11-29_s29.md).

Descriptors (2026-11-29, thirtieth session, on an H200). Each program of the first kernels made its
own TMA descriptors on the device (five in the forward, four in each backward kernel, 0.66 us
apiece: results/tma_desc_cost_h200_2026-11-29.md), a fixed cost of ~3 us a program that left the
packed step 1.14x / 1.19x one sequence's time per useful FLOP (profile_varlen_h200_2026-11-29_s29_*.md).
With :data:`HOST_DESCRIPTORS` (on), a branch whose r divides the stream's rows launches the
``*_hd_kernel``s instead, where the offsets were checked on the host (:func:`host_descriptors`): descriptors made once on the host over the whole stream, block ends masked
in the kernels (``gluon_varlen_kernel``). Same bits as the device-descriptor kernels
(results/varlen_switch_ab_hd_h200_2026-11-29_s30.md: max |on - off| 0), fwd+bwd 0.86x / 0.91x their
time on the issue's batch and 0.78x / 0.77x on 512-token documents; bench_varlen 1.09x / 1.06x one
sequence per useful FLOP (results/varlen_h200_2026-11-29_s30.md). The gates were measured again over
host descriptors (the constants below); the calls with a branch on device descriptors keep the
twenty-ninth session's (``DEVICE_DESC_*``). For calls whose offsets were not checked on the host,
:data:`HOST_DESCRIPTORS_UNCHECKED` (on) splits their launches at :func:`limit_row`: host descriptors for
the programs whose reads stay inside the documents, device descriptors for the rest (rows past the last
document may hold anything).
"""

from __future__ import annotations

import functools
import math

import torch

from . import gluon_fwd

LOG2E = 1.4426950408889634
# the switch (module attribute, as gluon_fwd's): False runs every packed call on the Triton
# varlen kernels
VARLEN_FORWARD = True
# The speed gates (on an H200, 2026-11-29), for calls whose every branch takes host descriptors
# (:func:`host_descriptors`: offsets checked on the host, r divides the stream's rows), then for the others (DEVICE_DESC_*: some
# branch's programs make their descriptors, ~3 us each, which loses on short documents).
# The forward's head dims (64: the Triton varlen forward faster, 1.02x / 1.13x not causal / causal
# over host descriptors: results/varlen_switch_ab_fwd_d64_h200_2026-11-29_s30.md)
HEADDIMS = (128,)
# the backward's (64 wins over host descriptors: fwd+bwd 0.88x / 0.89x with the forward on
# Triton, results/varlen_switch_ab_both_more_h200_2026-11-29_s30.md; unmeasured with device ones)
HEADDIMS_BACKWARD = (64, 128)
DEVICE_DESC_HEADDIMS_BACKWARD = (128,)
# total rows // documents below this: the Triton varlen forward. Over host descriptors the Gluon
# forward took 0.83x / 0.86x at a mean of 1024 rows and 0.78x / 0.78x at 2048
# (results/varlen_switch_ab_both_h200_2026-11-29_s30.md); at 512 and 256 no difference beyond the
# noise (0.94-1.14x, results/varlen_switch_ab_fwd_gates_h200_2026-11-29_s30.md). With device
# descriptors it lost at 1024 (1.08x / 1.17x, varlen_switch_ab_both_h200_2026-11-29_s29.md).
MIN_MEAN_DOC = 1024
DEVICE_DESC_MIN_MEAN_DOC = 4096
# the backward's: over host descriptors its kernels won down to a mean of 256 rows (fwd+bwd 0.85x
# / 0.88x at 512, 0.89x / 0.89x at 256: results/varlen_switch_ab_bwd_gates_h200_2026-11-29_s30.md);
# with device descriptors down to 1024 (0.89x / 0.98x; 1.00x / 1.05x at 512:
# results/varlen_switch_ab_bwd_gate_h200_2026-11-29_s29.md)
MIN_MEAN_DOC_BACKWARD = 256
DEVICE_DESC_MIN_MEAN_DOC_BACKWARD = 1024
PROGRAM_ROWS = 128  # gluon_varlen_kernel.PROGRAM_ROWS (tests/test_gluon_fwd.py checks they agree)
# descriptors made on the host over the whole stream (the ``*_hd_kernel``s) for every branch whose
# dilation divides the stream's rows (:func:`host_descriptors`), instead of five (forward) or four
# (each backward kernel) made by every program on the device at ~0.66 us apiece
# (results/tma_desc_cost_h200_2026-11-29.md); False: the device-made descriptors everywhere
HOST_DESCRIPTORS = True
# the same for calls whose offsets were not checked on the host (rows past the last document may hold
# anything, NaN included, which the host-descriptor kernels would read past a block's end): each branch
# then launches the host-descriptor kernel for the programs whose reads stay below the stream's first
# row of no document (``PART`` 1, :func:`limit_row`) and the device-descriptor one for the others
# (``PART`` 2). On since 2026-11-29 (thirty-first session, H200): the CUDA tests of
# tests/test_gluon_varlen.py passed with it (results/cuda_tests_h200_2026-11-29_s31_call{1,4}.txt), and over device
# offsets on the batch fwd+bwd took 0.88x / 0.95x the time of device descriptors alone, same bits
# (results/varlen_switch_ab_unchecked_h200_2026-11-29_s31.md). Such calls then take the gates above
# (host descriptors), as host offsets do
HOST_DESCRIPTORS_UNCHECKED = True

# calls whose offsets were not checked on the host and whose first branch stores every row of every
# document (r = 1 over all heads): results allocated empty, the first branch storing as with checked
# offsets, and only the rows no document covers set by :func:`fill_uncovered` (one launch per buffer),
# instead of zero-filling every result and accumulator (out, lo, lse; the backward's three float32
# accumulators: ~4 GiB of writes on the batch). On since 2026-11-29 (thirty-second session, H200):
# its CUDA tests passed (results/cuda_tests_h200_2026-11-29_s32_call1.txt), as did 2,000 fuzz cases
# (fuzz.py --gluon --varlen, about half of the device-offset ones with it on; fuzz_gluon_varlen_h200_2026-11-29_s32.txt);
# fwd+bwd over unchecked device offsets 0.88x / 0.93x (issue batch) and 0.89x / 0.87x (512-token mix)
# of the full fills, same bits (varlen_switch_ab_fill_only_h200_2026-11-29_s32.md). The peak of such a
# call is unchanged by it (the buffers are the same; they are only written less)
FILL_UNCOVERED_ONLY = True
FILL_ROWS_PER = 512  # rows of every slab per program of fill_uncovered_kernel (at least)
FILL_MAX_PROGRAMS = 1024  # and at most this many programs: each reads the offsets once

_module = None
_import_error: str | None = None


def kernel_module():
    """The kernel module, imported once; None when Gluon or its Hopper module is missing."""
    global _module, _import_error
    if _module is None and _import_error is None:
        _module, _import_error = gluon_fwd.import_kernels("gluon_varlen_kernel")
    return _module


def entries(offsets: list[int], w: int) -> tuple[list[int], list[int]]:
    """(first row, rows) of every segment of branch w in every non-empty document, from host
    offsets: document i (rows offsets[i]:offsets[i+1]) has segments of w rows from its first
    row, the last one shorter where its length is no multiple of w."""
    p0, ws = [], []
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        for s in range(a, b, w):
            p0.append(s)
            ws.append(min(w, b - s))
    return p0, ws


def device_entries(cu: torch.Tensor, w: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`entries` from device offsets ``cu`` (documents + 1) without reading them on the
    host: int32 (first rows, rows) of ``total // w + documents`` slots (a bound on the entries
    known from shapes alone; ``total`` is the stream's row count), slots past the last entry with
    0 rows. The offsets are clamped to [0, total] and each document's length to >= 0, so every
    entry lies inside the stream whatever the values (checked offsets are unchanged by it)."""
    return device_entries_all(cu, [w], total)[0]


@functools.lru_cache(maxsize=64)
def _widths(widths: tuple, device: torch.device) -> torch.Tensor:
    """The segment lengths as an int32 device tensor, built once per (widths, device) outside any
    CUDA-graph pool (``constants.int32_table``): no host-to-device copy on later calls, which a
    graph capture would refuse."""
    from .constants import int32_table

    return int32_table([list(widths)], device)


def device_entries_all(cu: torch.Tensor, widths, total: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`device_entries` of every segment length in ``widths`` at once (one set of ~30
    small device ops per call, not one per branch: host time, issue 23): each branch's (first
    rows, rows) a contiguous 16-byte aligned row of one [branches, slots] table, cut to its own
    ``total // w + documents`` slots."""
    cu = cu.to(torch.int64).clamp(0, total)
    ndocs = int(cu.numel() - 1)
    lens = (cu[1:] - cu[:-1]).clamp(min=0)  # (docs,)
    slots = [ndocs + total // w for w in widths]
    width = max(-(-max(slots) // 4) * 4, 4)  # rows 16-byte aligned (int32): the kernels' pointer specialisation
    w = _widths(tuple(widths), cu.device).view(-1, 1).to(torch.int64)
    nseg = torch.div(lens.view(1, -1) + w - 1, w, rounding_mode="floor")  # (branches, docs)
    ends = nseg.cumsum(1)
    e = torch.arange(width, device=cu.device).view(1, -1).expand(len(slots), width).contiguous()
    doc = torch.searchsorted(ends, e, right=True).clamp(max=max(ndocs - 1, 0))
    if ndocs == 0:  # no document: every slot unused
        zero = torch.zeros(len(slots), width, dtype=torch.int32, device=cu.device)
        return [(zero[i, :n], zero[i, :n]) for i, n in enumerate(slots)]
    s = e - (ends.gather(1, doc) - nseg.gather(1, doc))
    p0 = cu[doc] + s * w
    ws = torch.clamp(torch.minimum(w.expand_as(s), lens[doc] - s * w), min=0)
    ws = torch.minimum(ws, total - p0).clamp(min=0)  # clamped offsets: never past the stream
    ws = torch.where(e < ends[:, -1:], ws, 0)
    p0, ws = p0.to(torch.int32), ws.to(torch.int32)
    return [(p0[i, :n], ws[i, :n]) for i, n in enumerate(slots)]


def host_descriptors(total: int, r: int, covered: bool) -> bool:
    """Whether branch r's launches take host descriptors (:data:`HOST_DESCRIPTORS`): they view
    the stream as [1, total / r, r * heads, D] (``gluon_fwd.block_desc(x, total, r, ...)``),
    which reaches every row only when r divides ``total``; and ``covered``, every row of the
    stream lies in a document (offsets checked on the host). The kernels read rows past a block's
    end and mask them, which holds for finite values only: rows past the last document, which
    unchecked offsets may leave, may hold anything (the Triton path never reads them), so those
    calls keep the device-made descriptors, which end at each block, or with
    :data:`HOST_DESCRIPTORS_UNCHECKED` split each launch at :func:`limit_row`."""
    return HOST_DESCRIPTORS and total % r == 0 and (covered or HOST_DESCRIPTORS_UNCHECKED)


def limit_row(cu: torch.Tensor, total: int) -> torch.Tensor:
    """int32 (1,) on ``cu``'s device, no host read: the stream's first row past the last document
    (the last offset, clamped to [0, total] as :func:`device_entries` clamps), or 2^31 - 1 where
    that is the stream's end (rows past it are TMA zeros). Every row from a block's first row up
    to it lies in some document whatever the offsets (consecutive entries chain from cu[i] to
    cu[-1]), so a program whose reads stay below it reads documents' rows only (the kernels'
    ``PART`` 1; ``PART`` 2: the others)."""
    end = cu[-1:].to(torch.int64).clamp(0, total)
    return torch.where(end < total, end, 2**31 - 1).to(torch.int32)


def fill_uncovered(x: torch.Tensor, cu: torch.Tensor, max_len: int, value: float, rows_dim: int) -> None:
    """Set the rows of ``x`` that no document of ``cu`` covers to ``value``, in one launch and no
    host read of ``cu``: ``x`` contiguous, its dimension ``rows_dim`` the stream's rows (out, lo
    and the accumulators: (1, total, H, D) or (total, H, D) with ``rows_dim`` 1 or 0; lse (H,
    total): 1). Where the offsets tile [0, cu[-1]) inside the stream with documents of at most
    ``max_len`` rows, those are the rows at or past cu[-1]; otherwise (offsets nobody checked may
    be anything) every row, as the zero-fill this replaces. Between that and the branches'
    launches every element is written: the first branch stores each document's rows."""
    from . import triton_kernels

    assert x.is_contiguous()
    if x.numel() == 0:
        return
    total = x.shape[rows_dim]
    inner = math.prod(x.shape[rows_dim + 1 :])  # contiguous elements of a row
    outer = math.prod(x.shape[:rows_dim])  # slabs of `total` rows, total * inner elements apart
    progs = min(-(-total // FILL_ROWS_PER), FILL_MAX_PROGRAMS)
    rows_per = -(-total // progs)
    triton_kernels.fill_uncovered_kernel[(progs,)](
        x, cu, cu.shape[0] - 1, total, max_len, inner, outer, total * inner, rows_per, value,
        BLOCK=1024, BLOCK_D=128)  # fmt: skip


def grid(max_len: int, ndocs: int, total: int, w: int, r: int, nh: int) -> tuple[int, int, int]:
    """(query tiles of the longest possible block, entry slots, heads), from shapes and the
    caller's bound ``max_len`` on a document's length: a block has at most ceil(min(w, max_len,
    total) / r) rows."""
    longest = -(-min(w, max_len, total) // r)
    return (-(-longest // PROGRAM_ROWS), ndocs + total // w, nh)


class _Scratch:
    """Triton's allocator for the descriptors' global scratch, set for one launch: the previous
    allocator (the user's, or Triton's default) comes back after it."""

    def __init__(self, device):
        self.device = device

    def __call__(self, size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=self.device)

    def __enter__(self):
        from triton.runtime import _allocation

        self._token = _allocation._allocator.set(self)
        return self

    def __exit__(self, *exc):
        from triton.runtime import _allocation

        _allocation._allocator.reset(self._token)
        return False


def problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, branches, same_offsets: bool,
            max_len: int, ndocs: int, *, covered: bool = False) -> str | None:  # fmt: skip
    """Why the Gluon varlen forward cannot run these validated packed inputs (q (1, total, H, D),
    k, v (1, total, Hkv, D)) and branches ((w, r, head start, head stop), each with heads); None:
    it can. ``same_offsets``: queries and keys share the offsets (``Docs.same_offsets``);
    ``max_len``: the caller's bound on a document's length; ``ndocs``: the documents; ``covered``:
    every row in a document (:func:`host_descriptors`)."""
    if not VARLEN_FORWARD:
        return "gluon_varlen.VARLEN_FORWARD is off"
    if _all_host(q, branches, covered):
        gates = (MIN_MEAN_DOC, "MIN_MEAN_DOC", HEADDIMS, "HEADDIMS")
    else:
        gates = (DEVICE_DESC_MIN_MEAN_DOC, "DEVICE_DESC_MIN_MEAN_DOC", HEADDIMS, "HEADDIMS")
    why = _inputs_problem(q, k, v, branches, same_offsets, max_len, ndocs, *gates)
    if why is not None:
        return why
    key = (q.dtype, q.shape[3], bool(causal))
    if key in _failed:
        return f"the Gluon varlen forward failed here before: {_failed[key]}"
    if kernel_module() is None:
        return f"Gluon or its Hopper module is missing: {_import_error}"
    return None


def _all_host(q, branches, covered: bool) -> bool:
    """Whether every branch's launches take host descriptors (q (1, total, H, D))."""
    return all(host_descriptors(q.shape[1], r, covered) for _, r, _, _ in branches)


def _inputs_problem(q, k, v, branches, same_offsets: bool, max_len: int, ndocs: int, min_mean: int,
                    gate: str, headdims: tuple, hd_gate: str) -> str | None:
    """The conditions the Gluon varlen forward and backward share (:func:`problem`): inputs,
    branches, device and the speed gates (``min_mean`` and ``headdims``: this direction's
    mean-document and head-dim gates, whose names ``gate`` and ``hd_gate`` the messages give)."""
    if not same_offsets:
        return "the Gluon varlen kernels need the same offsets for queries and keys"
    nh = q.shape[2]
    if any(hs != 0 or he != nh for _, _, hs, he in branches):
        return "the Gluon varlen kernels need every branch over all heads (head_assignment='all')"
    if not branches:
        return "no branch has heads"
    why = gluon_fwd.device_problem(q)
    if why is not None:
        return why
    _, total, _, d = q.shape
    if k.shape[1] != total or total == 0:
        return f"the Gluon varlen kernels need as many key rows as query rows > 0 ({total}, {k.shape[1]})"
    if total * nh < gluon_fwd.MIN_ROWS:
        return (f"total x heads = {total * nh} < gluon_fwd.MIN_ROWS = {gluon_fwd.MIN_ROWS}: the Triton "
                f"kernels' direct launches cost less host time")  # fmt: skip
    if d not in headdims:
        return (f"head dim {d} not in gluon_varlen.{hd_gate} = {headdims}: the Triton varlen kernels are "
                f"faster there")  # fmt: skip
    if total < min_mean * ndocs:
        return (f"{ndocs} documents in {total} rows: a mean under gluon_varlen.{gate} = {min_mean} "
                f"rows, where the Triton varlen kernels are faster")  # fmt: skip
    if d == 64 and max(min(w, max_len) // r for w, r, _, _ in branches) < gluon_fwd.D64_MIN_BLOCK:
        return (f"headdim 64 and every branch's blocks shorter than gluon_fwd.D64_MIN_BLOCK = "
                f"{gluon_fwd.D64_MIN_BLOCK} rows: the Triton kernels are faster there")  # fmt: skip
    for w, r, _, _ in branches:
        if w // r < 2:
            return f"branch (w={w}, r={r}): the Gluon varlen kernels need w // r >= 2"
        if max(grid(max_len, ndocs, total, w, r, nh)[1:]) > gluon_fwd.GRID_YZ_MAX:
            return f"branch (w={w}, r={r}): {ndocs} documents + {total} // {w} entry slots: grid past CUDA's limits"
    for name, x in (
        ("q", q),
        ("k", k),
        ("v", v),
    ):  # the descriptors: rows of heads x D, 16-byte aligned
        if not x.is_contiguous() or x.data_ptr() % 16:
            return f"the Gluon varlen kernels need {name} contiguous and 16-byte aligned"
    return None


# (dtype, headdim, causal) whose first launch failed: the reason (those calls run the Triton
# varlen kernels from then on; a warning said so once)
_failed: dict[tuple, str] = {}


def note_failure(q: torch.Tensor, causal: bool, err: BaseException) -> None:
    """Record a failed launch (the caller then runs the Triton kernels) and warn once."""
    gluon_fwd.record_failure(_failed, "varlen forward", "Triton varlen kernels", "gluon_varlen.VARLEN_FORWARD",
                             q, causal, err)  # fmt: skip


def forward(
    q, k, v, cu: torch.Tensor, max_len: int, branches, causal: bool, scale: float, fill: bool, *,
    covered: bool = False, fill_uncovered_rows: bool = False,
):
    """out (1, total, H, D) in q's dtype and lse (1, H, total) float32 of the branches ((w, r,
    0, H) each) over the packed documents ``cu`` (int32 device offsets, queries and keys alike),
    inputs as :func:`problem` accepts. ``fill``: the buffers start as zeros (lse -inf), False
    where the first branch stores every row (``triton_launch._first_branch_writes_all``: r = 1
    first over offsets checked on the host). ``covered``: every row in a document
    (:func:`host_descriptors`). ``fill_uncovered_rows`` (with ``fill`` False: unchecked offsets,
    :data:`FILL_UNCOVERED_ONLY`): the buffers start empty but for the rows no document covers
    (:func:`fill_uncovered`). Launches only (no host read of ``cu``)."""
    mod = kernel_module()
    kern = mod.gluon_fwd_varlen_kernel
    _, total, nh, d = q.shape
    nkv = k.shape[2]
    q3, k3, v3 = q[0], k[0], v[0]
    several = len(branches) > 1
    out = torch.zeros_like(q3) if fill else torch.empty_like(q3)
    lo = (torch.zeros_like(q3) if fill else torch.empty_like(q3)) if several else out
    if fill:
        lse = torch.full((nh, total), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty((nh, total), dtype=torch.float32, device=q.device)
    if fill_uncovered_rows and not fill:
        fill_uncovered(out, cu, max_len, 0.0, 0)
        if several:
            fill_uncovered(lo, cu, max_len, 0.0, 0)
        fill_uncovered(lse, cu, max_len, float("-inf"), 1)
    q_layout = gluon_fwd._block_layout(mod.F.WG_M, d, q.dtype)
    kv_layout = gluon_fwd._block_layout(gluon_fwd.KV_BN, d, q.dtype)
    ndocs = cu.shape[0] - 1
    last = len(branches) - 1
    tables = device_entries_all(cu, [w for w, _, _, _ in branches], total)
    bd = gluon_fwd.block_view  # for gluon_fwd.launch (LIGHT_DESCRIPTORS)
    split = not covered and any(host_descriptors(total, r, covered) for _, r, _, _ in branches)
    lim = limit_row(cu, total) if split else None
    with _Scratch(q.device):
        for bi, (w, r, _, _) in enumerate(branches):
            g = grid(max_len, ndocs, total, w, r, nh)
            if 0 in g:  # max_len 0 (no document has a row): nothing to launch, the fills stand
                continue
            p0, ws = tables[bi]
            hd = host_descriptors(total, r, covered)
            # PART: 0 every program; unchecked offsets over host descriptors: 1 (the host-descriptor
            # kernel) the programs that read below limit_row, 2 (the device-descriptor one) the others
            if hd:
                wgm = mod.F.WG_M
                od = bd(out[None], total, r, wgm)
                gluon_fwd.launch(mod.gluon_fwd_varlen_hd_kernel, g, (
                    bd(q, total, r, wgm), bd(k, total, r, gluon_fwd.KV_BN), bd(v, total, r, gluon_fwd.KV_BN), od,
                    bd(lo[None], total, r, wgm) if several else od, out, lo, lse, p0, ws, p0 if lim is None else lim,
                    scale * LOG2E, total, q3.stride(0), r, nh, nkv), dict(BN=gluon_fwd.KV_BN, D=d,
                    STAGES=gluon_fwd.stages(d), CAUSAL=bool(causal), FIRST=bi == 0, COMP=several, STORE_LO=bi < last,
                    PART=0 if covered else 1, CONSUMER_REGS=gluon_fwd.CONSUMER_REGS,
                    LOADER_REGS=gluon_fwd.LOADER_REGS, num_warps=4, maxnreg=gluon_fwd.MAXNREG),
                )  # fmt: skip
                if covered:
                    continue
            kern[g](
                q3, k3, v3, out, lo, lse, p0, ws, p0 if lim is None else lim, scale * LOG2E, total, q3.stride(0),
                k3.stride(0), r, nh, nkv, q_layout=q_layout, kv_layout=kv_layout, BN=gluon_fwd.KV_BN, D=d,
                STAGES=gluon_fwd.stages(d), CAUSAL=bool(causal), FIRST=bi == 0, COMP=several, STORE_LO=bi < last,
                PART=2 if hd else 0, CONSUMER_REGS=gluon_fwd.CONSUMER_REGS, LOADER_REGS=gluon_fwd.LOADER_REGS,
                num_warps=4, maxnreg=gluon_fwd.MAXNREG,
            )  # fmt: skip
    return out[None], lse[None]


# ---------------------------------------------------------------------------------- backward
# the switch of the Gluon varlen backward (module attribute): False runs every packed backward
# on the Triton varlen kernels. On since 2026-11-29 (twenty-ninth session, an H200): its 46 CUDA
# tests (tests/test_gluon_varlen.py, both switches forced on) passed, and the public packed call's
# fwd+bwd took 0.77x / 0.87x the time with it on the batch (not causal / causal), 0.82x in
# fp16 (results/varlen_switch_ab_bwd_h200_2026-11-29_s29.md). The forward's gates but for the mean
# document: MIN_MEAN_DOC_BACKWARD.
VARLEN_BACKWARD = True
_bwd_failed: dict[tuple, str] = {}  # (dtype, headdim, causal) -> why its first launch failed


def backward_problem(q, k, v, causal: bool, branches, same_offsets: bool, max_len: int, ndocs: int, *,
                     covered: bool = False) -> str | None:  # fmt: skip
    """Why the Gluon varlen backward cannot run these packed inputs (as :func:`problem`); None:
    it can. Beyond the forward's conditions: its float32 accumulators (dq, dk, dv) and the
    largest branch's block-major lse / delta rows within ``gluon_bwd.MAX_F32_BYTES``."""
    from . import gluon_bwd

    if not VARLEN_BACKWARD:
        return "gluon_varlen.VARLEN_BACKWARD is off"
    if _all_host(q, branches, covered):
        gates = (MIN_MEAN_DOC_BACKWARD, "MIN_MEAN_DOC_BACKWARD", HEADDIMS_BACKWARD, "HEADDIMS_BACKWARD")
    else:
        gates = (DEVICE_DESC_MIN_MEAN_DOC_BACKWARD, "DEVICE_DESC_MIN_MEAN_DOC_BACKWARD",
                 DEVICE_DESC_HEADDIMS_BACKWARD, "DEVICE_DESC_HEADDIMS_BACKWARD")  # fmt: skip
    why = _inputs_problem(q, k, v, branches, same_offsets, max_len, ndocs, *gates)
    if why is not None:
        return why
    _, total, nh, d = q.shape
    f32 = 4 * total * d * (nh + 2 * k.shape[2]) + max(rows_bytes(max_len, ndocs, total, w, r, nh)
                                                     for w, r, _, _ in branches)  # fmt: skip
    if f32 > gluon_bwd.MAX_F32_BYTES:
        return f"the Gluon varlen backward's float32 buffers ({f32 / 2**30:.1f} GiB) pass gluon_bwd.MAX_F32_BYTES"
    key = (q.dtype, d, bool(causal))
    if key in _bwd_failed:
        return f"the Gluon varlen backward failed here before: {_bwd_failed[key]}"
    if kernel_module() is None:
        return f"Gluon or its Hopper module is missing: {_import_error}"
    return None


def note_backward_failure(q: torch.Tensor, causal: bool, err: BaseException) -> None:
    """Record a failed backward launch (the caller then runs the Triton kernels) and warn once."""
    gluon_fwd.record_failure(_bwd_failed, "varlen backward", "Triton varlen kernels",
                             "gluon_varlen.VARLEN_BACKWARD", q, causal, err)  # fmt: skip


def rows_pad(max_len: int, total: int, w: int, r: int) -> int:
    """LP: the longest possible block of branch (w, r), ceil(min(w, max_len, total) / r) rows,
    rounded up to ``gluon_bwd.LPAD`` (at least one tile)."""
    from . import gluon_bwd

    longest = -(-min(w, max_len, total) // r)
    return max(-(-longest // gluon_bwd.LPAD), 1) * gluon_bwd.LPAD


def rows_bytes(max_len: int, ndocs: int, total: int, w: int, r: int, nh: int) -> int:
    """Bytes of branch (w, r)'s block-major lse and delta rows (:func:`block_rows`)."""
    return 2 * 4 * nh * (ndocs + total // w) * rows_pad(max_len, total, w, r)


def prep_rows(x: torch.Tensor, p0: torch.Tensor, ws: torch.Tensor, r: int, lp: int, pad_value: float,
              mult: float = 1.0) -> torch.Tensor:  # fmt: skip
    """(H, total) float -> block-major float32 [H, NE, LP] over the entry slots (p0, ws) of a
    branch with dilation r: ``y[h, e, t] = mult * x[h, p0[e] + c + r t]`` for t < L = ceil((ws[e]
    - c) / r), c = h % r; -inf -> +inf; other rows ``pad_value``. The torch form (the CPU tests;
    :func:`block_rows` launches ``triton_kernels.gluon_varlen_rows_kernel``, the same values)."""
    nh = x.shape[0]
    ne = p0.numel()
    c = (torch.arange(nh, device=x.device) % r).view(nh, 1, 1)
    t = torch.arange(lp, device=x.device).view(1, 1, lp)
    n_rows = torch.clamp(torch.div(ws.long().view(1, ne, 1) - c + r - 1, r, rounding_mode="floor"), min=0)
    valid = t < n_rows
    idx = torch.where(valid, p0.long().view(1, ne, 1) + c + r * t, 0).view(nh, ne * lp)
    y = x.float().gather(-1, idx).view(nh, ne, lp) * mult
    y = torch.where(y == float("-inf"), torch.full_like(y, float("inf")), y)
    return torch.where(valid, y, torch.full_like(y, pad_value))


def block_rows(lse: torch.Tensor, delta: torch.Tensor, p0: torch.Tensor, ws: torch.Tensor, r: int, lp: int):
    """(lse2, delta2): :func:`prep_rows` of ``lse`` (mult LOG2E, pad +inf) and ``delta`` (pad 0),
    (H, total) float32 contiguous, in one launch of ``triton_kernels.gluon_varlen_rows_kernel``."""
    from . import gluon_bwd, triton_kernels

    nh, total = lse.shape
    ne = p0.numel()
    lse2 = torch.empty((nh, ne, lp), dtype=torch.float32, device=lse.device)
    delta2 = torch.empty_like(lse2)
    if lse2.numel():
        triton_kernels.gluon_varlen_rows_kernel[(lp // gluon_bwd.LPAD, ne, nh)](
            lse, delta, lse2, delta2, p0, ws, total, r, ne, lp, LOG2E, BLOCK=gluon_bwd.LPAD)
    return lse2, delta2


def backward(dout, q, k, v, delta, lse, cu: torch.Tensor, max_len: int, branches, causal: bool, scale: float,
             store_first: bool, *, covered: bool = False, fill_uncovered_rows: bool = False):  # fmt: skip
    """dq, dk, dv (the inputs' dtypes) of the branches ((w, r, 0, H) each) over the packed
    documents ``cu`` (int32 device offsets), given the FINAL lse (1, H, total) float32 and
    delta = rowsum(dO * out) (1, H, total) float32; inputs as :func:`backward_problem`
    accepts. ``store_first``: the first branch stores every row of the three results
    (``triton_launch._bwd_writes_all``): they are allocated empty and it stores, not adds.
    The float32 accumulators and their phases are ``gluon_bwd.accumulate``'s. ``covered``: every
    row in a document (:func:`host_descriptors`). ``fill_uncovered_rows`` (with ``store_first``:
    unchecked offsets, :data:`FILL_UNCOVERED_ONLY`): the accumulators' rows no document covers are
    zeroed before the launches (:func:`fill_uncovered`). Launches only (no host read of ``cu``)."""
    from . import gluon_bwd

    mod = kernel_module()
    bk = mod.BK
    if not dout.is_contiguous() or dout.data_ptr() % 16:  # the kernels read dO with q's row stride, by TMA
        dout = dout.clone(memory_format=torch.contiguous_format)
    _, total, nh, d = q.shape
    nkv = k.shape[2]
    rep = nh // nkv
    ndocs = cu.shape[0] - 1
    q3, k3, v3, do3 = q[0], k[0], v[0], dout[0]
    lse_h, delta_h = lse[0].contiguous(), delta[0].contiguous()
    bn = gluon_bwd.dq_bn(d)
    lay = lambda rows: gluon_fwd._block_layout(rows, d, q.dtype)  # noqa: E731
    common = dict(D=d, CAUSAL=bool(causal), CONSUMER_REGS=gluon_bwd.CONSUMER_REGS,
                  LOADER_REGS=gluon_bwd.LOADER_REGS, num_warps=4, maxnreg=gluon_bwd.MAXNREG)  # fmt: skip
    # each branch's entry table once, for both phases (int32 pairs: small)
    tables = [None if 0 in grid(max_len, ndocs, total, w, r, nh) else tab for (w, r, _, _), tab in
              zip(branches, device_entries_all(cu, [w for w, _, _, _ in branches], total), strict=True)]  # fmt: skip
    split = not covered and any(host_descriptors(total, r, covered) for _, r, _, _ in branches)
    lim = limit_row(cu, total) if split else None

    def run(dq, dk, dv, kernels):
        if fill_uncovered_rows and store_first:
            for acc in (dq, dk, dv):
                if acc is not None:
                    fill_uncovered(acc, cu, max_len, 0.0, 1)
        with _Scratch(q.device):
            for bi, ((w, r, _, _), tab) in enumerate(zip(branches, tables, strict=True)):
                if tab is None:  # no row in any document
                    continue
                p0, ws = tab
                add = bi > 0 or not store_first
                nb, ne, _ = grid(max_len, ndocs, total, w, r, nh)
                lp = rows_pad(max_len, total, w, r)
                if q.is_cuda:
                    lse2, delta2 = block_rows(lse_h, delta_h, p0, ws, r, lp)
                else:  # the CPU tests' emulated kernels
                    lse2 = prep_rows(lse_h, p0, ws, r, lp, float("inf"), LOG2E)
                    delta2 = prep_rows(delta_h, p0, ws, r, lp, 0.0)
                ni = min(rep, r)
                hd = host_descriptors(total, r, covered)
                limit = p0 if lim is None else lim
                if hd:  # PART as in forward()
                    _launch_hd(mod, kernels, q, k, v, dout, dq, dk, dv, lse2, delta2, p0, ws, limit, total, r, ne,
                               nb, ni, lp, scale, add, bool(causal), 0 if covered else 1)  # fmt: skip
                    if covered:
                        del lse2, delta2
                        continue
                part = 2 if hd else 0
                if "dkdv" in kernels:
                    mod.dkdv_varlen_kernel[(nb * ne, nkv * ni)](
                        q3, do3, k3, v3, gluon_bwd._row_desc(lse2, bk.BMQ), gluon_bwd._row_desc(delta2, bk.BMQ),
                        dk[0], dv[0], p0, ws, limit, scale * LOG2E, scale, ne, nb, r, nh, nkv, rep, ni, lp,
                        q3.stride(0), k3.stride(0), q_layout=lay(bk.BMQ), kv_layout=lay(bk.WG_M), BMQ=bk.BMQ,
                        STAGES=gluon_bwd.kv_stages(d), ADD=add, PART=part, **common)  # fmt: skip
                if "dq" in kernels:
                    mod.dq_varlen_kernel[(nb * ne, nh)](
                        q3, do3, k3, v3, dq[0], lse2, delta2, p0, ws, limit, scale * LOG2E, scale, ne, nb, r, nh, nkv,
                        lp, q3.stride(0), k3.stride(0), q_layout=lay(bk.WG_M), kv_layout=lay(bn), BN=bn,
                        STAGES=gluon_bwd.DQ_STAGES, ADD=add, PART=part, **common)  # fmt: skip
                del lse2, delta2  # one branch's rows alive at a time (the gate's budget counts one)

    return gluon_bwd.accumulate(q, k, v, store_first, run)



def _launch_hd(mod, kernels, q, k, v, dout, dq, dk, dv, lse2, delta2, p0, ws, limit, total: int, r: int, ne: int,
               nb: int, ni: int, lp: int, scale: float, add: bool, causal: bool, part: int) -> None:  # fmt: skip
    """The backward's launches of one branch over host descriptors (:func:`host_descriptors`):
    ``dkdv_varlen_hd_kernel`` and / or ``dq_varlen_hd_kernel`` (``kernels``), inputs (1, total,
    heads, D), accumulators float32 of the same shapes; ``part`` / ``limit``: the kernels' PART
    and LIMIT (:func:`limit_row`)."""
    from . import gluon_bwd

    bk = mod.BK
    bd = gluon_fwd.block_view  # for gluon_fwd.launch (LIGHT_DESCRIPTORS)
    d, nh, nkv = q.shape[3], q.shape[2], k.shape[2]
    common = dict(D=d, CAUSAL=causal, ADD=add, PART=part, CONSUMER_REGS=gluon_bwd.CONSUMER_REGS,
                  LOADER_REGS=gluon_bwd.LOADER_REGS, num_warps=4, maxnreg=gluon_bwd.MAXNREG)  # fmt: skip
    if "dkdv" in kernels:
        gluon_fwd.launch(mod.dkdv_varlen_hd_kernel, (nb * ne, nkv * ni), (
            bd(q, total, r, bk.BMQ), bd(dout, total, r, bk.BMQ), bd(k, total, r, bk.WG_M), bd(v, total, r, bk.WG_M),
            gluon_bwd._row_view(lse2, bk.BMQ), gluon_bwd._row_view(delta2, bk.BMQ), dk[0], dv[0], p0, ws, limit,
            scale * LOG2E, scale, ne, nb, r, nh, nkv, nh // nkv, ni, lp),
            dict(BMQ=bk.BMQ, STAGES=gluon_bwd.kv_stages(d), **common))  # fmt: skip
    if "dq" in kernels:
        bn = gluon_bwd.dq_bn(d)
        gluon_fwd.launch(mod.dq_varlen_hd_kernel, (nb * ne, nh), (
            bd(q, total, r, bk.WG_M), bd(dout, total, r, bk.WG_M), bd(k, total, r, bn), bd(v, total, r, bn), dq[0],
            lse2, delta2, p0, ws, limit, scale * LOG2E, scale, ne, nb, r, nh, nkv, lp),
            dict(BN=bn, STAGES=gluon_bwd.DQ_STAGES, **common))  # fmt: skip
