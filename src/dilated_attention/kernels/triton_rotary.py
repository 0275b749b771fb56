"""Rotary position embedding (rotate-half form) as one Triton kernel, forward and backward.

What this module owns: :func:`rotary_fused`, the eager fast path of
:meth:`dilated_attention.models.longnet.Rotary.rotate`. It rotates q (B, Nq, H, D) and
k (B, Nk, Hkv, D) in one launch (grid axis 1 picks the tensor), with precomputed tables
cos, sin (1, N, 1, D) float32 whose two halves are equal (``torch.cat([c, c], -1)``, as
``Rotary.table`` builds them):

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x2, x1)
        = (x1 * c - x2 * s, x2 * c + x1 * s)

computed in float32 and stored in x's dtype, i.e. exactly the math of ``Rotary._rotate_with``
in one pass over x instead of about six float32 passes (cast, chunk, cat, two products, sum,
cast back). The rotation is orthogonal, so its transpose (the backward) is the rotation by the
opposite angle: the same kernel with ``s`` negated (``INVERSE``),

    dx = (dy1 * c + dy2 * s, dy2 * c - dy1 * s).

The backward calls the same autograd Function with ``inverse`` flipped, so a gradient taken
with ``create_graph=True`` is itself differentiable (exactly: the map is linear in x).

Under ``torch.compile`` the same launches run as the custom op ``dilated_attention::rotary``
(:func:`rotary_op`; a fake implementation for tracing, its backward the op with ``inverse``
flipped), which :func:`rotary_fused` calls there instead of the Function: Inductor fused the plain torch code
with the tables' computation into kernels 4-7x slower than this one (2026-11-29, H200, LongNet
``base``: 9.7 ms of rotary per step compiled against 1.4 ms eager, ``results/profile_step_h200_2026-11-29_s32_before.md``;
1.3 ms compiled with the op, ``..._s32_after.md``).
Eager calls keep the Function (a custom op's dispatch costs host time). The module imports without triton;
:func:`unavailable_reason` then says why it cannot run, and ``kernels/select.py`` asks it once per
(device type, dtype, head dim) (``backend_reason("triton_rotary", ...)``). On the CPU the kernel
runs only in Triton's interpreter (``TRITON_INTERPRET=1``, for tests).
"""

from __future__ import annotations

import torch

from . import direct_launch
from .triton_import import device_reason, tl, triton  # triton, tl: None without triton

MAX_HEADDIM = 256  # one program holds every head of BLOCK_T rows at once: keep the tile small
# Elements of one half-tile (BLOCK_T rows x BLOCK_H heads x BLOCK_D): a few KiB of registers per
# program, enough rows per program that the launch is not dominated by tiny programs.
_TILE_ELEMENTS = 4096

if triton is not None:

    @triton.jit
    def _rotate_tile(
        X, Y, COS, SIN, rows, N, H,
        sxb, sxn, sxh, syb, syn, syh, sc, ss, row0, SLOTS,
        HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        INVERSE: tl.constexpr, SLOTTED: tl.constexpr, COPY: tl.constexpr,
    ):  # fmt: skip
        """Rotate rows [row0, row0 + BLOCK_T) of the flattened (B * N) rows of X, every head.
        SLOTTED: row n of batch b goes to row SLOTS[n] of Y (a KV cache's slots); COPY: X is
        copied, not rotated (the cache's values)."""
        r = row0 + tl.arange(0, BLOCK_T)  # flattened (b, n) row
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        # int64: B * N * H * D passes 2^31 at a few million tokens
        b = (r // N).to(tl.int64)
        n = (r % N).to(tl.int64)
        rmask = r < rows
        mask = rmask[:, None, None] & (h < H)[None, :, None] & (d < HALF)[None, None, :]
        if SLOTTED:
            yn = tl.load(SLOTS + n, mask=rmask, other=0).to(tl.int64)
        else:
            yn = n
        x_off = (b * sxb + n * sxn)[:, None, None] + (h * sxh)[None, :, None] + d[None, None, :]
        y_off = (b * syb + yn * syn)[:, None, None] + (h * syh)[None, :, None] + d[None, None, :]
        if COPY:
            tl.store(Y + y_off, tl.load(X + x_off, mask=mask, other=0.0).to(Y.dtype.element_ty), mask=mask)
            tl.store(Y + y_off + HALF, tl.load(X + x_off + HALF, mask=mask, other=0.0).to(Y.dtype.element_ty),
                     mask=mask)  # fmt: skip
        else:
            cmask = rmask[:, None] & (d < HALF)[None, :]
            # the table's two halves are equal: the first half serves both
            c = tl.load(COS + (n * sc)[:, None] + d[None, :], mask=cmask, other=0.0)[:, None, :]
            s = tl.load(SIN + (n * ss)[:, None] + d[None, :], mask=cmask, other=0.0)[:, None, :]
            if INVERSE:
                s = -s
            x1 = tl.load(X + x_off, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(X + x_off + HALF, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + y_off, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
            tl.store(Y + y_off + HALF, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        XA, YA, CA, SA, XB, YB, CB, SB,
        rows_a, NA, HA, sab, san, sah, tab, tan, tah, sca, ssa,
        rows_b, NB, HB, sbb, sbn, sbh, tbb, tbn, tbh, scb, ssb,
        HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HA: tl.constexpr,
        BLOCK_HB: tl.constexpr, BLOCK_D: tl.constexpr, INVERSE: tl.constexpr,
    ):  # fmt: skip
        """Grid (cdiv(max(rows_a, rows_b), BLOCK_T), 1 or 2): axis 1 is tensor A (q) or B (k).
        The tensors first: launched through ``direct_launch.DirectKernel``."""
        row0 = tl.program_id(0) * BLOCK_T
        if tl.program_id(1) == 0:
            _rotate_tile(XA, YA, CA, SA, rows_a, NA, HA, sab, san, sah, tab, tan, tah, sca, ssa,
                         row0, CA, HALF, BLOCK_T, BLOCK_HA, BLOCK_D, INVERSE, False, False)  # fmt: skip
        else:
            _rotate_tile(XB, YB, CB, SB, rows_b, NB, HB, sbb, sbn, sbh, tbb, tbn, tbh, scb, ssb,
                         row0, CA, HALF, BLOCK_T, BLOCK_HB, BLOCK_D, INVERSE, False, False)  # fmt: skip

    @triton.jit
    def _rotary_cache_kernel(
        XA, YA, CA, SA, XB, YB, CB, SB, XC, YC, SLOTS,
        rows, T, HA, HB, sab, san, sah, tab, tan, tah, sca, ssa, sbb, sbn, sbh, tbb, tbn, tbh,
        scb, ssb, svb, svn, svh, tvb, tvn, tvh,
        HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HA: tl.constexpr,
        BLOCK_HB: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """A decode step's rotation and cache write (the tensors first: launched through
        ``direct_launch.DirectKernel``). Grid (cdiv(rows, BLOCK_T), 3): axis 1 is q (A, rotated
        into YA), k (B, rotated into the cache YB at rows SLOTS[n]) or v (C, copied into the
        cache YC at rows SLOTS[n]); A, B and C have the same rows (B * T), C has B's heads."""
        row0 = tl.program_id(0) * BLOCK_T
        which = tl.program_id(1)
        if which == 0:
            _rotate_tile(XA, YA, CA, SA, rows, T, HA, sab, san, sah, tab, tan, tah, sca, ssa,
                         row0, SLOTS, HALF, BLOCK_T, BLOCK_HA, BLOCK_D, False, False, False)  # fmt: skip
        elif which == 1:
            _rotate_tile(XB, YB, CB, SB, rows, T, HB, sbb, sbn, sbh, tbb, tbn, tbh, scb, ssb,
                         row0, SLOTS, HALF, BLOCK_T, BLOCK_HB, BLOCK_D, False, True, False)  # fmt: skip
        else:
            _rotate_tile(XC, YC, CB, SB, rows, T, HB, svb, svn, svh, tvb, tvn, tvh, scb, ssb,
                         row0, SLOTS, HALF, BLOCK_T, BLOCK_HB, BLOCK_D, False, True, True)  # fmt: skip

    # a decode step launches it once per layer with the same arguments: after the first call of
    # a shape, the compiled kernel's launcher directly (no JITFunction.run per call); so does a
    # training step the rotation (twice per layer: forward and backward)
    _ROTARY_CACHE = direct_launch.DirectKernel(_rotary_cache_kernel, 11)
    _ROTARY = direct_launch.DirectKernel(_rotary_kernel, 8)


def unavailable_reason(q: torch.Tensor, interpret: bool) -> str | None:
    """Why the rotary kernel cannot run on inputs like ``q`` (None if it can)."""
    reason = device_reason(q, interpret)
    if reason is not None:
        return reason
    d = q.shape[-1]
    if d % 2 or not 2 <= d <= MAX_HEADDIM:
        return f"headdim {d} is not supported by the rotary kernel (even, 2 to {MAX_HEADDIM}); the torch path runs"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} is not supported by the rotary kernel (fp16, bf16, fp32); the torch path runs"
    return None


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, name: str) -> None:
    b, n, h, d = x.shape
    for tname, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != n or t.shape[2] != 1 or t.shape[3] != d:
            raise ValueError(
                f"rotary_fused: {tname} for {name} must be (1, {n}, 1, {d}) for {name} of shape "
                f"{tuple(x.shape)}, got {tuple(t.shape)}; build the tables with Rotary.table"
            )
        if t.dtype != torch.float32 or t.stride(-1) != 1 or t.device != x.device:
            raise ValueError(
                f"rotary_fused: {tname} for {name} must be float32 on {x.device} with unit stride in "
                f"its last dim, got {t.dtype} on {t.device} with strides {t.stride()}"
            )


_SIZES: dict[tuple, tuple] = {}


def _sizes(d: int, ha: int, hb: int | None, rows_a: int, rows_b: int) -> tuple:
    """(HALF, BLOCK_D, BLOCK_HA, BLOCK_HB, BLOCK_T, grid) of a launch, once per shape (a decode
    step repeats one shape in every layer; ~1-2 us of Python per call saved)."""
    key = (d, ha, hb, rows_a, rows_b)
    got = _SIZES.get(key)
    if got is None:
        half = d // 2
        block_d = direct_launch.next_power_of_2(half)
        block_ha = direct_launch.next_power_of_2(ha)
        block_hb = block_ha if hb is None else direct_launch.next_power_of_2(hb)
        block_t = max(1, min(64, _TILE_ELEMENTS // (max(block_ha, block_hb) * block_d)))
        grid = (triton.cdiv(max(rows_a, rows_b), block_t), 1 if hb is None else 2)
        got = (half, block_d, block_ha, block_hb, block_t, grid)
        if len(_SIZES) >= 1024:  # a bound for processes that sweep shapes (training: one per N)
            _SIZES.clear()
        _SIZES[key] = got
    return got


def _launch(xa, ca, sa, xb, cb, sb, inverse: bool, dtype_a=None, dtype_b=None):
    """Rotate xa (and xb, when not None) in one launch: new tensors in ``dtype_*`` (default the
    input's dtype), contiguous (B, N, H, D). Either input may be None (then its output is None)."""
    # the kernel addresses batch, row and head by stride but assumes unit stride along headdim
    # (the model's q/k are views of a Linear output, already so; an incoming gradient may not be)
    xa = None if xa is None else (xa if xa.stride(-1) == 1 else xa.contiguous())
    xb = None if xb is None else (xb if xb.stride(-1) == 1 else xb.contiguous())
    if xa is None:  # the kernel's slot A is always present: move B there
        if xb is None:
            return None, None
        yb, _ = _launch(xb, cb, sb, None, None, None, inverse, dtype_b)
        return None, yb
    dev = direct_launch.tensor_device(xa)
    if dev >= 0 and direct_launch.current_device() != dev:  # the device guard (direct_launch.py)
        with torch.cuda.device(dev):
            return _launch(xa, ca, sa, xb, cb, sb, inverse, dtype_a, dtype_b)
    ya = torch.empty(xa.shape, dtype=dtype_a or xa.dtype, device=xa.device)
    yb = None if xb is None else torch.empty(xb.shape, dtype=dtype_b or xb.dtype, device=xb.device)
    rows_a = xa.shape[0] * xa.shape[1]
    if xb is None:  # slot B unused: pass A's arguments again (never read: grid axis 1 is 1)
        xb_, yb_, cb_, sb_, rows_b = xa, ya, ca, sa, 0
    else:
        xb_, yb_, cb_, sb_, rows_b = xb, yb, cb, sb, xb.shape[0] * xb.shape[1]
    if rows_a == 0 and rows_b == 0:
        return ya, yb
    half, block_d, block_ha, block_hb, block_t, grid = _sizes(
        xa.shape[-1], xa.shape[2], None if xb is None else xb.shape[2], rows_a, rows_b
    )
    _ROTARY[grid](
        xa, ya, ca, sa, xb_, yb_, cb_, sb_,
        rows_a, max(xa.shape[1], 1), xa.shape[2], *xa.stride()[:3], *ya.stride()[:3], ca.stride(1), sa.stride(1),
        rows_b, max(xb_.shape[1], 1), xb_.shape[2], *xb_.stride()[:3], *yb_.stride()[:3], cb_.stride(1),
        sb_.stride(1),
        HALF=half, BLOCK_T=block_t, BLOCK_HA=block_ha, BLOCK_HB=block_hb, BLOCK_D=block_d,
        INVERSE=inverse,
    )  # fmt: skip
    return ya, yb


class _RotaryFunction(torch.autograd.Function):
    """q, k rotated by their tables (``inverse``: by the opposite angles); the backward is the
    same Function with ``inverse`` flipped (the transpose of a rotation is its inverse)."""

    @staticmethod
    def forward(ctx, q, k, cos_q, sin_q, cos_k, sin_k, inverse):
        qo, ko = _launch(q, cos_q, sin_q, k, cos_k, sin_k, inverse)
        ctx.save_for_backward(cos_q, sin_q, cos_k, sin_k)
        ctx.inverse = inverse
        ctx.shapes = (q.shape, q.dtype, k.shape, k.dtype)
        # a gradient may reach only q or only k (the other output unused): no zeros for it
        ctx.set_materialize_grads(False)
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        cos_q, sin_q, cos_k, sin_k = ctx.saved_tensors
        qshape, qdtype, kshape, kdtype = ctx.shapes
        if not torch.is_grad_enabled():  # a plain backward: launch, nothing to record
            gq, gk = _launch(dq, cos_q, sin_q, dk, cos_k, sin_k, not ctx.inverse, qdtype, kdtype)
            return gq, gk, None, None, None, None, None
        # create_graph=True: through apply, so that the gradient is itself differentiable
        if dq is None:
            dq = torch.zeros(qshape, dtype=qdtype, device=cos_q.device)
        if dk is None:
            dk = torch.zeros(kshape, dtype=kdtype, device=cos_k.device)
        gq, gk = _RotaryFunction.apply(dq.to(qdtype), dk.to(kdtype), cos_q, sin_q, cos_k, sin_k,
                                       not ctx.inverse)  # fmt: skip
        return gq, gk, None, None, None, None, None


@torch.library.custom_op("dilated_attention::rotary", mutates_args=())
def rotary_op(
    q: torch.Tensor, k: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor, cos_k: torch.Tensor,
    sin_k: torch.Tensor, inverse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The compiled graphs' rotary (module docstring): q, k rotated (``inverse``: by the opposite
    angles) into new contiguous tensors of their shapes and dtypes. Unchecked: :func:`rotary_fused`
    calls it after its checks."""
    return _launch(q, cos_q, sin_q, k, cos_k, sin_k, inverse)


@rotary_op.register_fake
def _(q, k, cos_q, sin_q, cos_k, sin_k, inverse):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _rotary_op_setup(ctx, inputs, output):
    _, _, cos_q, sin_q, cos_k, sin_k, inverse = inputs
    ctx.save_for_backward(cos_q, sin_q, cos_k, sin_k)
    ctx.inverse = inverse


def _rotary_op_backward(ctx, dq, dk):
    # the transpose of a rotation is its inverse: the op again, so the gradient is differentiable
    cos_q, sin_q, cos_k, sin_k = ctx.saved_tensors
    gq, gk = rotary_op(dq, dk, cos_q, sin_q, cos_k, sin_k, not ctx.inverse)
    return gq, gk, None, None, None, None, None


rotary_op.register_autograd(_rotary_op_backward, setup_context=_rotary_op_setup)


def rotary_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_q: torch.Tensor,
    sin_q: torch.Tensor,
    cos_k: torch.Tensor,
    sin_k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Nq, H, D), k (B, Nk, Hkv, D) rotated by cos_*/sin_* (1, N*, 1, D) float32 -> rotated
    q, k (same shapes and dtypes, contiguous), with autograd; one kernel launch for both.

    The tables' two halves must be equal (``Rotary.table`` builds them so). q and k need unit
    stride in their last dim to be read in place (else they are copied once); fp16, bf16 and
    fp32 (see :func:`unavailable_reason`; callers ask ``select.backend_reason("triton_rotary",
    ...)`` first).
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape[-1] != q.shape[-1] or k.shape[0] != q.shape[0]:
        raise ValueError(
            f"rotary_fused: q (B, Nq, H, D) and k (B, Nk, Hkv, D) with the same B and D, got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if q.shape[-1] % 2:
        raise ValueError(f"rotary_fused: the head dim must be even, got {q.shape[-1]}")
    if k.device != q.device:
        raise ValueError(f"rotary_fused: q and k must be on one device, got {q.device} and {k.device}")
    _check(q, cos_q, sin_q, "q")
    _check(k, cos_k, sin_k, "k")
    if torch.compiler.is_compiling():  # opaque to the tracer, its autograd registered
        return torch.ops.dilated_attention.rotary(q, k, cos_q, sin_q, cos_k, sin_k, False)
    if not torch.is_grad_enabled() or not (
        q.requires_grad or k.requires_grad or cos_q.requires_grad or sin_q.requires_grad
        or cos_k.requires_grad or sin_k.requires_grad
    ):  # fmt: skip
        # nothing to record (a decode step, no_grad): the Function's forward without the
        # autograd.Function machinery (its apply costs more host time than the launch's Python)
        return _launch(q, cos_q, sin_q, k, cos_k, sin_k, False)
    return _RotaryFunction.apply(q, k, cos_q, sin_q, cos_k, sin_k, False)


def rotary_into_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_q: torch.Tensor,
    sin_q: torch.Tensor,
    cos_k: torch.Tensor,
    sin_k: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """A decode step's rotation and KV-cache write in one launch, without autograd: q (B, T, H, D)
    rotated -> a new contiguous tensor (returned); k (B, T, Hkv, D) rotated and v copied into
    ``cache_k`` / ``cache_v`` (B, capacity, Hkv, D) at the rows ``slots`` (T,) int64.

    The same bits as ``qo, ko = rotary_fused(q, k, ...)`` followed by ``cache_k.index_copy_(1,
    slots, ko)`` and ``cache_v.index_copy_(1, slots, v)``: the rotation is the same code, and the
    cache rows receive what the copies would have written. Saves those two launches per layer of
    a decode step. ``slots`` must hold distinct values in [0, capacity) (``pos % capacity`` of
    distinct positions, as ``DecodeIndex.slots`` makes them): they are not checked (that would
    read device values), and a duplicate leaves either row's values, as ``index_copy_`` does.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[-1] != q.shape[-1] or k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"rotary_into_cache: q (B, T, H, D), k and v (B, T, Hkv, D) with the same B, T and D, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, t, hkv, d = k.shape
    for name, c in (("cache_k", cache_k), ("cache_v", cache_v)):
        if c.dim() != 4 or c.shape[0] != b or c.shape[2:] != (hkv, d) or c.stride(-1) != 1:
            raise ValueError(
                f"rotary_into_cache: {name} must be (B={b}, capacity, Hkv={hkv}, D={d}) with unit stride in "
                f"its last dim, got {tuple(c.shape)} with strides {c.stride()}"
            )
        if c.dtype != k.dtype or c.device != q.device:
            raise ValueError(
                f"rotary_into_cache: {name} must be {k.dtype} on {q.device} like k and v, got {c.dtype} on {c.device}"
            )
    if v.dtype != k.dtype or k.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError(
            f"rotary_into_cache: q, k and v of one dtype on one device, got {q.dtype}/{k.dtype}/{v.dtype} "
            f"on {q.device}/{k.device}/{v.device}"
        )
    if slots.dim() != 1 or slots.shape[0] != t or slots.dtype != torch.int64 or slots.device != q.device:
        raise ValueError(
            f"rotary_into_cache: slots must be ({t},) int64 on {q.device}, got {tuple(slots.shape)} "
            f"{slots.dtype} on {slots.device}"
        )
    if d % 2:
        raise ValueError(f"rotary_into_cache: the head dim must be even, got {d}")
    _check(q, cos_q, sin_q, "q")
    _check(k, cos_k, sin_k, "k")
    dev = direct_launch.tensor_device(q)
    if dev >= 0 and direct_launch.current_device() != dev:  # the device guard (direct_launch.py)
        with torch.cuda.device(dev):
            return rotary_into_cache(q, k, v, cos_q, sin_q, cos_k, sin_k, cache_k, cache_v, slots)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rows = b * t
    if rows == 0:
        return qo
    half, block_d, block_ha, block_hb, block_t, grid = _sizes(d, q.shape[2], hkv, rows, rows)
    _ROTARY_CACHE[(grid[0], 3)](
        q, qo, cos_q, sin_q, k, cache_k, cos_k, sin_k, v, cache_v, slots,
        rows, t, q.shape[2], hkv, *q.stride()[:3], *qo.stride()[:3], cos_q.stride(1), sin_q.stride(1),
        *k.stride()[:3], *cache_k.stride()[:3], cos_k.stride(1), sin_k.stride(1),
        *v.stride()[:3], *cache_v.stride()[:3],
        HALF=half, BLOCK_T=block_t, BLOCK_HA=block_ha, BLOCK_HB=block_hb, BLOCK_D=block_d,
    )  # fmt: skip
    return qo
