"""When and how the training forward runs the Gluon kernel (``gluon_fwd_kernel.py``, issue 24).

:func:`problem` says why the kernel cannot run a call (None: it can); :func:`launch_branch`
launches it for one branch over a range of segments, merging into the result buffers exactly as
the Triton forward's launches do (FIRST / COMP / STORE_LO: ``triton_launch`` owns the buffers,
the lo ranges and the branch order, ``triton_launch._gluon_forward``). The kernel module is
imported on the first call that passes every other check, so importing the package never
imports Gluon.

The kernel's restrictions, checked by :func:`problem` (anything else runs the Triton kernels,
the same math): a CUDA device of compute capability exactly 9.0 (its wgmma / TMA / setmaxnreg
are Hopper's), Triton's Gluon with its Hopper module, bf16 or fp16, headdim 64 or 128,
seqlen_q == seqlen_k, every branch with ``w // r >= 2``; ``w % r == 0`` or (with
:data:`UNEVEN_BLOCKS`, on) blocks of two lengths launched per length class from a head that is a
multiple of r (:func:`length_classes`); ``N % w == 0`` or (with :data:`TAIL_SEGMENTS`, on,
forward and ``gluon_bwd.TAIL_SEGMENTS`` backward) a short last segment launched on its own (at
batch > 1 each entry apart: :data:`TAIL_BATCHES`); q / k / v with heads dense in
a row (row stride = heads x head stride: the TMA view folds the offset class into the head axis)
and 16-byte aligned, and grids within CUDA's limits. Two speed rules, measured: calls of fewer
than :data:`MIN_ROWS` rows (batch x seqlen x heads), and head dim 64 calls whose every block is
shorter than :data:`D64_MIN_BLOCK`, run the Triton kernels. The switch is
:func:`dilated_attention.flags.set_gluon_forward`.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import NamedTuple

import torch

from .. import flags
from . import direct_launch, triton_import

KV_BN = 128  # key rows per tile
CONSUMER_REGS = 240  # setmaxnreg of each consumer warpgroup (FA3: 240)
LOADER_REGS = 24  # setmaxnreg of the loader's warpgroup (the minimum)
# per-thread register cap of the whole kernel: 12 warps (2 consumer warpgroups + the loader's
# warpgroup) x 32 threads x 168 <= 65536; setmaxnreg moves registers from the loader to the
# consumers (240 * 8 + 24 * 4 warps = 2016 <= 168 * 12)
MAXNREG = 168
GRID_YZ_MAX = 65535  # CUDA's limit on a grid's second and third axes
# batch x seqlen x heads below this: the Triton kernels. The Gluon kernels launch through
# Triton's Python launcher (descriptors built per call), the Triton ones through the direct
# launches of their plans (a few microseconds each): on a small call the launches' host time
# can outweigh the faster kernels. Measured on an H200 (2026-11-28, benchmarks/gluon_floor.py:
# causal, bf16, batch 1, the Gluon forward and backward vs the Triton kernels, back-to-back
# eager calls, after the host cuts of that day: cached shared layouts, one rows kernel per
# branch in the backward): at 262144 rows Gluon wins forward+backward (16384 x 16 x 128: 2831
# vs 3806 us; 32768 x 8 x 64: 1973 vs 2348 us) and the forward at 16 x 128 (681 vs 925 us)
# but not at 8 x 64 (589 vs 557 us); at 131072 rows (16384 x 8 x 64) it loses 4x (558 vs
# 135 us forward: the ~0.4 ms of host time per Gluon call is not hidden). Hence 262144
# (results/gluon_floor_h200_2026-11-28.md). Measured before the Gluon launches went direct with light
# descriptors (DIRECT_LAUNCH, LIGHT_DESCRIPTORS, 2026-11-29): the floor may now be lower; not re-measured.
MIN_ROWS = 1 << 18
# Head dim 64 with small blocks: the Gluon kernels are not taken when every branch's blocks
# (w // r rows) are shorter than this. Measured on an H200 (2026-11-29, benchmarks/gluon_ab.py,
# results/gluon_ab_h200_2026-11-29.md, same process, impl="triton"): on the sweep's
# 8br-paper-d64-fp16-causal row (blocks of 512 to 1365 rows) the Triton kernels were faster in
# both directions (forward 3.86 vs 4.66 ms, backward 11.57 vs 13.48 ms); on every head-dim-64
# row with blocks of 2048 rows or more the Gluon backward was 13-22% faster and the forwards
# within 6% of each other. Set 0 to take the Gluon kernels for every block length.
D64_MIN_BLOCK = 2048
# branches with w % r != 0 (blocks of two lengths, launched per length class:
# :func:`length_classes`), in the forward and the backward (``gluon_bwd``). On since their CUDA
# tests passed on an H200 (2026-11-29: tests/test_gluon_fwd.py and test_gluon_bwd.py, 111
# passed); the sweep's rows with such branches ran 3-40% faster than on the Triton kernels
# (results/gluon_uneven_h200_2026-11-29.md). False: those calls run the Triton kernels.
UNEVEN_BLOCKS = True
# N % w != 0 (a short last segment of N % w rows, as docs/spec.md defines it) in the forward,
# batch 1: the full segments as usual and the short one in a launch of its own
# (:func:`launch_tail`; its blocks are length classes of (N % w, r), so a tail whose length r
# does not divide also needs UNEVEN_BLOCKS). On since its CUDA tests passed (H200,
# 2026-11-29); the backward too since ``gluon_bwd.TAIL_SEGMENTS`` (on). False: the forward
# runs the Triton kernels for these calls.
TAIL_SEGMENTS = True
# batch > 1 with N % w != 0 (under TAIL_SEGMENTS): each batch entry launched on its own, over
# views of one entry (the descriptors' block axis counts N // w segments per entry, which
# skips the short last segment of every entry but the last), forward and, with
# ``gluon_bwd.TAIL_SEGMENTS``, backward: batch x the launches. On since its CUDA tests passed
# on an H200 (2026-11-29, results/gluon_tail_h200_2026-11-29.md); no sweep row has batch > 1
# with N % w != 0, so its speed is unmeasured. Since each entry pays a Gluon call's host time,
# each entry must clear MIN_ROWS alone (seqlen x heads >= MIN_ROWS, :func:`shape_problem`).
# False: those calls run the Triton kernels.
TAIL_BATCHES = True
# later launches of a Gluon kernel with the same specialisation through the compiled kernel's
# launcher (:func:`launch`), skipping Triton's JITFunction.run. Its CUDA test passed (H200,
# 2026-11-29: the same bits as Triton's launcher). It did not make a small call worth the
# Gluon kernels (results/gluon_uneven_h200_2026-11-29.md: 16384 x 8 x 64, still 0.39x / 0.33x
# of the Triton kernels' speed forward / forward+backward; MIN_ROWS stays), but a training step
# is host-bound in its backward, and there it counts: with :data:`LIGHT_DESCRIPTORS`, the
# compiled LongNet-base step at 16K x 2 went 120.9 -> 104.5 ms on an H200, same process
# (results/profile_step_h200_2026-11-29_s33_call2.md). On since 2026-11-29 (thirty-third session).
DIRECT_LAUNCH = True
# the launches' host tensor descriptors as :class:`Desc` tuples (the fields Triton's launcher
# reads), made into Triton's ``TensorDescriptor`` only where Triton's JITFunction.run takes the
# launch (:func:`launch`): its dataclass checks every field per construction, 5 to 6 per launch,
# 720 per LongNet-base training step at 16K x 2 (results/profile_step_h200_2026-11-29_s33_call1.md).
# The checks stay where they matter: :func:`problem` checks the tensors' alignment and strides
# before any launch, and the driver's cuTensorMapEncodeTiled refuses a misaligned address or
# stride with an error.
LIGHT_DESCRIPTORS = True
# direct launches encode their descriptors' CUtensorMaps once per (address, shape, strides)
# (``direct_launch.tma_grid_launcher``) instead of per launch (Triton's ``make_tensordesc_arg``,
# ~5 per launch). Same bits (CUDA test, H200, 2026-11-29); the compiled LongNet-base step at
# 16K x 2: 105.96 ms with it, 106.61 ms without, one run each (results/profile_step_h200_2026-11-29_s33_call5.md):
# within what runs vary, so off until an interleaved A/B settles it. Read per launch (an A/B needs no
# recompile).
TMA_CACHE = False
# programmatic dependent launch between the launches of one call (forward: every branch's after
# the first; backward: every dK/dV launch after a phase's first, and every dQ launch likewise):
# each program lets the next launch start as soon as it runs, and waits for the previous one to
# complete only before its epilogue reads or writes what that one wrote (the kernels'
# ``gdc_launch_dependents`` / ``gdc_wait``; no-ops in a launch without the attribute). The next
# branch's programs then fill the SMs that the previous branch's last wave leaves idle, where a
# call of short blocks (LongNet-base's 2048-row blocks at 16K: launches of 384 to 3,072
# programs) loses about a tenth of its kernel time to those tails (a list-scheduling model of
# 132 SMs). Same bits: each program's arithmetic and each accumulator's order of branches are
# unchanged (CUDA test, H200, 2026-11-29: four cases, causal and not, three calls each). Same
# process, interleaved (benchmarks/split_ab.py --switch gluon_fwd.PDL, 5 rounds, H200,
# results/pdl_ab_h200_2026-11-29.md): fwd+bwd on / off 0.937 (LongNet-base 16K x 2, 12 x 64,
# 4 branches), 0.965 (8K x 4), 0.993 and 0.996 (headline-causal, B 8 x 16K); forward 0.97-1.0.
# Off during CUDA-graph capture; only on the direct launches (:data:`DIRECT_LAUNCH`, on), which
# pass the attribute to the compiled kernel's C launcher (measured above with binaries compiled
# with Triton's ``launch_pdl`` option, the same code: since the same session no second binary).
# Read per call.
PDL = True
DTYPES = (torch.bfloat16, torch.float16)
HEADDIMS = (64, 128)

_module = None  # gluon_fwd_kernel once imported
_import_error: str | None = None
# (dtype, headdim, causal) whose first launch failed (compile error, resources): the reason;
# those calls run the Triton kernels from then on (a warning said so once)
_failed: dict[tuple, str] = {}


def stages(d: int) -> int:
    """K/V ring depth: shared memory holds Q (128 x D) and STAGES x (K + V) tiles (BN x D):
    2 stages at D = 128 (160 KB), 3 at D = 64 (112 KB); a Hopper block has at most 227 KB."""
    return 2 if d == 128 else 3


def import_kernels(name: str):
    """(module, None), or (None, why) when the kernel module ``name`` of this package does not
    import (Gluon or its Hopper module missing): the lazy import of both Gluon modules."""
    try:
        return importlib.import_module(f"{__package__}.{name}"), None
    except Exception as e:  # noqa: BLE001  (any import failure: the Triton kernels run)
        return None, f"{type(e).__name__}: {e}"


def kernel_module():
    """The kernel module, imported once; None when Gluon or its Hopper module is missing
    (:func:`import_error` says why)."""
    global _module, _import_error
    if _module is None and _import_error is None:
        _module, _import_error = import_kernels("gluon_fwd_kernel")
    return _module


def import_error() -> str | None:
    return _import_error


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def view_problem(name: str, x: torch.Tensor) -> str | None:
    b, n, heads, d = x.shape
    sb, sn, sh, sd = x.stride()
    if sd != 1 or sn != heads * sh or (b > 1 and sb != n * sn):
        return (f"{name} needs dense heads in a row and rows in a batch entry (strides "
                f"{tuple(x.stride())} for shape {tuple(x.shape)})")  # fmt: skip
    if x.data_ptr() % 16 or any((s * x.element_size()) % 16 for s in (sb, sn, sh) if s):
        return f"{name} is not 16-byte aligned (pointer or strides {tuple(x.stride())})"
    return None


def problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, branches) -> str | None:
    """Why the Gluon forward cannot run these validated inputs (q (B, N, H, D), k and v (B, N,
    Hkv, D)) and branches ((w, r, head start, head stop), each with heads); None: it can."""
    why = shape_problem(q, k, v, branches)
    if why is not None:
        return why
    key = (q.dtype, q.shape[-1], bool(causal))
    if key in _failed:
        return f"the Gluon forward failed here before: {_failed[key]}"
    if kernel_module() is None:
        return f"Gluon or its Hopper module is missing: {_import_error}"
    return None


def device_problem(q: torch.Tensor) -> str | None:
    """The checks every Gluon kernel (one sequence, packed documents) makes of q: not under the
    interpreter, a CUDA tensor on an sm_90 GPU, bf16 / fp16, headdim 64 / 128; None: they pass."""
    if triton_import.INTERPRET:
        return "Triton's interpreter (TRITON_INTERPRET=1) does not run Gluon kernels"
    if q.device.type != "cuda":
        return f"the Gluon forward needs a CUDA tensor, got {q.device}"
    cap = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
    if cap != (9, 0):
        return f"the Gluon forward is for sm_90 (Hopper) only, this GPU is sm_{cap[0]}{cap[1]}"
    if q.dtype not in DTYPES:
        return f"the Gluon forward takes bf16 or fp16, got {q.dtype}"
    if q.shape[-1] not in HEADDIMS:
        return f"the Gluon forward takes headdim 64 or 128, got {q.shape[-1]}"
    return None


def shape_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, branches) -> str | None:
    """The checks the Gluon kernels (forward and backward) share: device, dtype, headdim
    (:func:`device_problem`), lengths, branch geometry, grid limits and the TMA views of q, k, v;
    None: they pass."""
    why = device_problem(q)
    if why is not None:
        return why
    bsz, n, nh, d = q.shape
    if k.shape[1] != n or n == 0:
        return f"the Gluon forward needs seqlen_q == seqlen_k > 0 (got {n} and {k.shape[1]})"
    if not branches:
        return "no branch has heads"
    if bsz * n * nh < MIN_ROWS:
        return (f"batch x seqlen x heads = {bsz * n * nh} < gluon_fwd.MIN_ROWS = {MIN_ROWS}: "
                f"the Triton kernels' direct launches cost less host time")  # fmt: skip
    if n * nh < MIN_ROWS and batch_entries(bsz, n, branches) is not None:
        return (f"batch {bsz} with a short last segment launches each entry apart "
                f"(gluon_fwd.TAIL_BATCHES), and seqlen x heads = {n * nh} < gluon_fwd.MIN_ROWS = "
                f"{MIN_ROWS}: the Triton kernels' direct launches cost less host time")  # fmt: skip
    if d == 64 and max(w // r for w, r, _, _ in branches) < D64_MIN_BLOCK:
        return (f"headdim 64 and every branch's blocks shorter than gluon_fwd.D64_MIN_BLOCK = "
                f"{D64_MIN_BLOCK} rows (w // r): the Triton kernels are faster there")  # fmt: skip
    for w, r, hs, he in branches:
        if w // r < 2:
            return f"branch (w={w}, r={r}): the Gluon forward needs w // r >= 2"
        for length in (w, n % w):  # the segments, and the short last one (N % w rows)
            if length % r and not (UNEVEN_BLOCKS and hs % r == 0):
                return (f"branch (w={w}, r={r}): segments of {length} rows make blocks of two "
                        f"lengths; they run the Triton kernels (gluon_fwd.UNEVEN_BLOCKS is "
                        f"{UNEVEN_BLOCKS}; heads from {hs})")  # fmt: skip
        if n % w:
            if not TAIL_SEGMENTS or (bsz != 1 and not TAIL_BATCHES):
                return (f"branch (w={w}): N = {n} is no multiple of w; the short last segment runs "
                        f"the Triton kernels (gluon_fwd.TAIL_SEGMENTS is {TAIL_SEGMENTS}, "
                        f"TAIL_BATCHES {TAIL_BATCHES}, batch {bsz})")  # fmt: skip
            if any(0 < big < 2 for big, _, _ in length_classes(n % w, r)):
                return f"branch (w={w}, r={r}): the short last segment ({n % w} rows) has blocks of one row"
        if n // w > GRID_YZ_MAX or bsz * (he - hs) > GRID_YZ_MAX:
            return f"branch (w={w}, r={r}): grid past CUDA's limits"
    for name, x in (("q", q), ("k", k), ("v", v)):
        why = view_problem(name, x)
        if why is not None:
            return why
    return None


def record_failure(failed: dict, what: str, fallback: str, env: str, q: torch.Tensor, causal: bool,
                   err: BaseException) -> None:  # fmt: skip
    """Record in ``failed`` that the Gluon ``what`` failed for q's (dtype, headdim, causal): those
    calls run the ``fallback`` from then on; warn once."""
    why = f"{type(err).__name__}: {str(err)[:400]}"
    failed[(q.dtype, q.shape[-1], bool(causal))] = why
    warnings.warn(
        f"dilated_attention: the Gluon {what} failed ({why}); this configuration runs the "
        f"{fallback} from now on (set {env}=0 to skip it)",
        RuntimeWarning,
        stacklevel=4,
    )


def note_failure(q: torch.Tensor, causal: bool, err: BaseException) -> None:
    """Record a failed launch (the caller then runs the Triton kernels) and warn once."""
    record_failure(_failed, "forward", "Triton kernels", "DILATED_ATTENTION_GLUON_FWD", q, causal, err)


def _gl_dtype(dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


@functools.lru_cache(maxsize=64)
def _block_layout(rows: int, d: int, dtype: torch.dtype):
    """The shared-memory layout of a [1, rows, 1, d] box (one object per box: Gluon's layout
    constructor costs ~20 us of host time, and block_desc runs 5-13 times per branch)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, d], _gl_dtype(dtype))


# (kernel, argument specialisations, options, device) -> the compiled kernel's grid launcher
# (direct_launch.grid_launcher), or False where it has none (Triton's path for good)
_direct: dict = {}


def _spec(a):
    """What Triton specialises a Gluon kernel argument on (Triton 3.6, checked on its
    ``native_specialize_impl``): an int's class (1 / multiple of 16 / other, int32 / int64), a
    float's type, a tensor's dtype and 16-byte alignment, a host tensor descriptor's dtype, block
    shape and layout (not its shape or strides: those are runtime arguments). Plain ints first,
    by exact type: most of a launch's ~20 arguments."""
    if type(a) is int:
        return direct_launch.int_class(a)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return direct_launch.int_class(a)
    if isinstance(a, float):
        return "f"
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    return (a.base.dtype, tuple(a.block_shape), id(a.layout))  # a TensorDescriptor


class Desc(NamedTuple):
    """A host TMA descriptor's fields, as Triton's ``TensorDescriptor`` (Gluon's Hopper module)
    holds them, without its construction-time checks: what the compiled kernel's launcher reads
    (base, shape, strides, padding) and what :func:`_spec` keys on (the base's dtype, the block
    shape, the layout). :meth:`real` makes the checked ``TensorDescriptor`` for Triton's own
    path."""

    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list
    layout: object
    padding: str = "zero"

    def real(self):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        return TensorDescriptor(*self)


def _descriptor(base, shape, strides, block_shape, layout):
    """A :class:`Desc`, or with :data:`LIGHT_DESCRIPTORS` off Triton's ``TensorDescriptor``."""
    if LIGHT_DESCRIPTORS:
        return Desc(base, shape, strides, block_shape, layout)
    return Desc(base, shape, strides, block_shape, layout).real()


def _run(kernel, grid, args: tuple, options: dict):
    """Triton's own path: ``kernel[grid](...)``, each :class:`Desc` made a ``TensorDescriptor``."""
    return kernel[grid](*[a.real() if type(a) is Desc else a for a in args], **options)


class Chain:
    """The launches of one call, back to back on one stream: with ``allowed`` (:func:`chain`)
    each after the first is a programmatic dependent of the one before (:data:`PDL`)."""

    __slots__ = ("allowed", "started")

    def __init__(self, allowed: bool):
        self.allowed = allowed
        self.started = False

    def next(self) -> bool:
        """Whether the launch about to be made is a dependent one; counts it."""
        pdl = self.allowed and self.started
        self.started = True
        return pdl


def chain(x: torch.Tensor) -> Chain:
    """A :class:`Chain` for a call on x: dependent launches where :data:`PDL` is on, x is on a
    GPU and no CUDA graph is being captured on the current stream."""
    return Chain(PDL and x.is_cuda and not torch.cuda.is_current_stream_capturing())


def launch(kernel, grid, args: tuple, options: dict, pdl: bool = False) -> None:
    """``kernel[grid](*args, **options)``: with :data:`DIRECT_LAUNCH` (and the direct-launch
    switch, ``flags.set_direct_launch``), launches after the first of a specialisation go
    straight to the compiled kernel's C launcher (``direct_launch.grid_launcher``), which fills
    the descriptors' CUtensorMaps itself. ``args``: the kernel's positional parameters (tensors,
    descriptors, numbers); ``options``: every later parameter by name (constexprs) and the
    compile options (num_warps, maxnreg). ``pdl``: launched as a programmatic dependent of the
    previous launch on the stream (:data:`PDL`), which the caller allows only where that launch
    is one of the same call's. Only the direct launches take it (the attribute is their C
    launcher's argument, the binary the same); a launch through Triton's ``kernel[grid]`` (a
    specialisation's first, or with the direct launch off) is an ordinary one, as correct, and
    no second binary is compiled with Triton's ``launch_pdl`` option."""
    if not DIRECT_LAUNCH or not flags.direct_launch_enabled():
        _run(kernel, grid, args, options)
        return
    dev = next(a for a in args if isinstance(a, torch.Tensor)).get_device()
    key = (kernel, tuple(map(_spec, args)), tuple(options.items()), dev)
    got = _direct.get(key)
    if got is None:
        compiled = direct_launch.compiled_of(_run(kernel, grid, args, options))
        go = compiled is not None and direct_launch.grid_launcher(compiled)
        # (the launcher, the one with cached CUtensorMaps or None, the parameters after args)
        _direct[key] = (go, direct_launch.tma_grid_launcher(compiled), kernel.arg_names[len(args):]) if go else False
        return
    if got is False or not direct_launch.hooks_idle():
        _run(kernel, grid, args, options)
        return
    go, go_tma, names = got
    if TMA_CACHE and go_tma is not None:
        go = go_tma
    g = (*grid, 1, 1)
    full = (*args, *(options[n] for n in names))
    stream = direct_launch.current_stream(dev)
    if pdl:  # (the launch attribute only where set: go's default is the binary's own)
        go(g[0], g[1], g[2], stream, full, True)
    else:
        go(g[0], g[1], g[2], stream, full)


def length_classes(w: int, r: int) -> list[tuple[int, int, int]]:
    """(L, c0, c1): the block length L of the offsets c in [c0, c1) of branch (w, r): one class
    (w // r, 0, r) when r divides w, else (ceil(w / r), 0, c*) and (w // r, c*, r) with
    c* = w - r * (ceil(w / r) - 1) (row s*w + c + r*t lies in segment s for t < L)."""
    big = -(-w // r)
    cstar = w - r * (big - 1)
    return [(big, 0, r)] if cstar == r else [(big, 0, cstar), (big - 1, cstar, r)]


def class_heads(hs: int, he: int, r: int, c0: int, c1: int) -> int:
    """How many heads h in [hs, he) have h % r in [c0, c1), for hs % r == 0 (or the whole
    range, c0 = 0 and c1 = r): the kernel enumerates them as hs + (i // cw) * r + c0 + i % cw,
    cw = c1 - c0 (:func:`class_head`)."""
    full, rem = divmod(he - hs, r)
    return full * (c1 - c0) + max(0, min(rem, c1) - c0)


def class_head(i: int, hs: int, r: int, c0: int, cw: int) -> int:
    """The kernel's i-th head of a launch (``gluon_fwd_kernel``: the same formula)."""
    return hs + (i // cw) * r + c0 + i % cw


def block_desc(x: torch.Tensor, w: int, r: int, rows: int, big_l: int | None = None):
    """TMA descriptor of the dilated blocks of x (B, N, heads, D) (heads dense in a row): the
    4-D view [B*N/w, L, r*heads, D], strides [w*sn, r*sn, sh, 1], box [1, rows, 1, D]: index
    (b*nseg + s, t, c*heads + h, d) is row s*w + c + r*t, head h. L = ``big_l`` (default
    w // r): TMA reads zeros and writes nothing at t >= L, so a block of offset c must have
    exactly L rows in its segment (:func:`length_classes`). Triton's ``TensorDescriptor``, for
    callers that launch with ``kernel[grid](...)``; :func:`block_view` for :func:`launch`."""
    return Desc(*_block_fields(x, w, r, rows, big_l)).real()


def block_view(x: torch.Tensor, w: int, r: int, rows: int, big_l: int | None = None):
    """:func:`block_desc` as a :class:`Desc` (a ``TensorDescriptor`` with
    :data:`LIGHT_DESCRIPTORS` off), for :func:`launch`."""
    return _descriptor(*_block_fields(x, w, r, rows, big_l))


def _block_fields(x: torch.Tensor, w: int, r: int, rows: int, big_l: int | None):
    b, n, heads, d = x.shape
    _, sn, sh, _ = x.stride()
    shape = [b * (n // w), w // r if big_l is None else big_l, r * heads, d]
    strides = [w * sn, r * sn, sh, 1]
    return x, shape, strides, [1, rows, 1, d], _block_layout(rows, d, x.dtype)


def batch_entries(bsz: int, n: int, branches) -> list[slice] | None:
    """The batch slices to launch apart: one per entry where batch > 1 and a branch has a short
    last segment (:data:`TAIL_BATCHES`: a 4-D view of several entries assumes N = segments x
    w); None: the whole batch at once."""
    if bsz > 1 and any(n % w for w, _, _, _ in branches):
        return [slice(b, b + 1) for b in range(bsz)]
    return None


def entry_views(entries: list[slice] | None, *xs: torch.Tensor):
    """Per :func:`batch_entries` slice, the views ``x[slice]`` of ``xs`` (None stays None);
    ``entries`` None: ``xs`` once."""
    if entries is None:
        return [xs]
    return [tuple(None if x is None else x[e] for x in xs) for e in entries]


def launch_tail(q, k, v, out, lo, lse, w: int, r: int, hs: int, he: int, causal: bool,
                scale: float, lo_row0: int, first: bool, comp: bool, store_lo: bool,
                chain: Chain | None = None) -> None:  # fmt: skip
    """Launch branch (w, r)'s short last segment (rows t0 = N - N % w to N; batch 1) as a
    segment of its own: descriptors, result, lo and lse views that start at row t0, one segment
    (NSEG 1, S0 0), segment length N % w (its length classes). ``lo`` holds the rows from
    ``lo_row0`` on. Otherwise as :func:`launch_branch`."""
    n = q.shape[1]
    wt = n % w
    t0 = n - wt
    qt, kt, vt, ot = (x[:, t0:] for x in (q, k, v, out))
    lot = lo[:, t0 - lo_row0 :] if comp else ot
    _launch_segments(qt, kt, vt, ot, lot, lse[..., t0:], n, wt, r, hs, he, causal, scale, 0, 1, 1, 1, 0,
                     first, comp, store_lo, chain)  # fmt: skip


def launch_branch(q, k, v, out, lo, lse, w: int, r: int, hs: int, he: int, causal: bool,
                  scale: float, s0: int, nseg: int, lo_s0: int, first: bool, comp: bool,
                  store_lo: bool, chain: Chain | None = None) -> None:  # fmt: skip
    """Launch branch (w, r) over heads [hs, he) and segments [s0, s0 + nseg): its (out, lse)
    merged into ``out`` (B, N, H, D) contiguous, ``lse`` (B, H, N) float32 and, with ``comp``,
    the lo buffer ``lo`` (B, rows, H, D) contiguous, which holds the rows from segment ``lo_s0``
    of branch w on (rows a multiple of w; ``out`` itself as a dummy without one). Inputs as
    :func:`problem` accepts. ``chain``: the call's :class:`Chain` (None: no dependent launches)."""
    n = q.shape[1]
    _launch_segments(q, k, v, out, lo, lse, n, w, r, hs, he, causal, scale, s0, nseg, n // w,
                     lo.shape[1] // w, lo_s0, first, comp, store_lo, chain)  # fmt: skip


def _launch_segments(q, k, v, out, lo, lse, n: int, w: int, r: int, hs: int, he: int, causal: bool,
                     scale: float, s0: int, nseg: int, nseg_all: int, lo_nseg: int, lo_s0: int,
                     first: bool, comp: bool, store_lo: bool, chain: Chain | None = None) -> None:  # fmt: skip
    """The kernel over segments [s0, s0 + nseg) of length w of the views q, k, v, out, lo and
    the lse pointer (``nseg_all`` segments per batch entry in the views, ``lo_nseg`` in lo, from
    segment ``lo_s0`` on); ``n``: the row stride of lse per (batch, head). One launch per length
    class of (w, r), each counted in ``chain``."""
    mod = kernel_module()
    bsz, _, nh, d = q.shape
    for big_l, c0, c1 in length_classes(w, r):
        classes = (c0, c1) != (0, r)
        nhb = class_heads(hs, he, r, c0, c1) if classes else he - hs
        grid = (-(-big_l // mod.BM), nseg, bsz * nhb)
        if big_l == 0 or grid[1] * grid[2] == 0:
            continue
        o_desc = block_view(out, w, r, mod.WG_M, big_l)
        lo_desc = block_view(lo, w, r, mod.WG_M, big_l) if comp else o_desc
        launch(mod.gluon_fwd_kernel, grid, (
            block_view(q, w, r, mod.WG_M, big_l), block_view(k, w, r, KV_BN, big_l),
            block_view(v, w, r, KV_BN, big_l), o_desc, lo_desc, lse, scale * 1.4426950408889634,
            n, big_l, w, nseg_all, s0, lo_nseg, lo_s0, r, nh, k.shape[2], hs, nhb,
            c0, c1 - c0), dict(BN=KV_BN, D=d, STAGES=stages(d), CAUSAL=bool(causal),
            FIRST=bool(first), COMP=bool(comp), STORE_LO=bool(store_lo), CLASSES=classes,
            CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS, num_warps=4, maxnreg=MAXNREG),
            chain is not None and chain.next(),
        )  # fmt: skip
