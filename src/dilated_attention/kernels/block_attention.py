"""Dense attention over one block of rows that returns its LSE, and its backward given the final LSE.

This is the one building block every path shares: a dilated branch runs it on the gathered rows
of each (segment, offset) block, a ring step runs it on one K/V block. Both merge partial results
by LSE, and both run the backward of each piece with the *final* merged output and LSE, which
gives exact gradients (the mixing weights are not detached).

Layout here is SDPA's ``(batch, heads, seqlen, headdim)``; ``k``/``v`` may have fewer heads (GQA).
``causal`` is bottom-right aligned: query row t may see key j iff ``j <= Lk - Lq + t``.
LSE is float32 (float64 for float64 inputs), shape ``(batch, heads, Lq)``; a row with no key has
``lse = -inf`` and output 0.

Backends, chosen per call by :func:`pick_backend`:
- ``"cudnn"``: cuDNN attention (Hopper; what SDPA picks there), same private-op route, used only
  when a one-time probe on the device reproduces the FlashAttention-2 results;
- ``"flash"``: PyTorch's FlashAttention-2 kernels (CUDA, fp16/bf16) through the private aten ops
  that ``torch.distributed.tensor.experimental`` context parallelism also uses;
- ``"cpu_flash"``: PyTorch's fused CPU kernel (same contract, any float dtype);
- ``"math"``: a blockwise loop in plain PyTorch (any device and dtype, key masks, dropout),
  never holding more than one block of scores.
"""

from __future__ import annotations

import functools
import math

import torch

from ..flags import cudnn_attention_enabled
from ..merge import acc_dtype

_MATH_BLOCK_BYTES = 64 * 1024 * 1024  # fp32 score bytes per block in the math path
_CUDNN_MIN_ROWS = 128


def _flash_ok(q: torch.Tensor, k: torch.Tensor, key_mask, dropout_p: float, causal: bool) -> bool:
    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and d <= 256
        and d % 8 == 0
        and key_mask is None
        and dropout_p == 0.0
        and (not causal or q.shape[2] == k.shape[2])
    )


def pick_backend(q, k, key_mask=None, dropout_p: float = 0.0, causal: bool = False) -> str:
    if _flash_ok(q, k, key_mask, dropout_p, causal):
        # cuDNN only for MHA blocks of >= 128 rows (the shapes its probe and the GPU runs covered;
        # it rejects s_q = s_kv = 1 outright); small blocks gain nothing from it anyway
        if (
            q.shape[1] == k.shape[1]
            and q.shape[-1] in (64, 128)
            and min(q.shape[2], k.shape[2]) >= _CUDNN_MIN_ROWS
            and cudnn_attention_enabled()  # read now: flags.set_cudnn_attention / the environment
            and _cudnn_usable(q.device.index or 0)
        ):
            return "cudnn"
        return "flash"
    if (
        q.device.type == "cpu"
        and key_mask is None
        and dropout_p == 0.0
        and (not causal or q.shape[2] == k.shape[2])
        and q.shape[1] == k.shape[1]
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    ):
        return "cpu_flash"
    return "math"


def _cudnn_fwd(q, k, v, scale, causal):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    lse = res[1]
    return res[0], (lse.reshape(lse.shape[:3]) if lse.dim() == 4 else lse)


def _cudnn_bwd(do, q, k, v, out, lse, scale, causal):
    """cuDNN's backward with dO and out contiguous. PyTorch (2.11, cuDNN 9.19) caches the
    backward's cuDNN graph under a key of the shapes and the q / k / v strides, but the graph
    reads dO with the strides of the call that built it: a later call of the same shape whose dO
    has other strides got gradients off by ~1-2 with no error (and an out-of-bounds read where
    the strides are larger; `benchmarks/probe_cudnn_bwd_strides.py`, H200, 2026-11-28). With dO
    and out contiguous their strides are a function of the shape, which the key holds."""
    aux, lse_4d = _cudnn_aux(q.device.index or 0)
    lse_in = lse.reshape(*lse.shape, 1) if lse_4d else lse
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do.contiguous(), q, k, v, out.contiguous(), lse_in.contiguous(), *aux, q.shape[2], k.shape[2], 0.0,
        causal, scale=scale,
    )  # fmt: skip


@functools.cache
def _cudnn_aux(device_index: int) -> tuple[tuple, bool]:
    """What the backward op wants back from the dropout-free cuDNN forward on this device:
    ((philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k), whether its LSE is 4-D)."""
    q = torch.randn(1, 1, 16, 64, device=torch.device("cuda", device_index), dtype=torch.float16)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, False, False)
    return (res[6], res[7], None, res[2], res[3]), res[1].dim() == 4


@functools.cache
def _cudnn_usable(device_index: int) -> bool:
    """Use cuDNN attention (what SDPA itself picks on Hopper, where it is faster than PyTorch's
    FlashAttention-2: benchmarks/results/ring_cudnn_* and bench_cli_torch_cudnn_*) through its
    private ops?

    Only on compute capability >= 9 and only if a probe on this device reproduces the
    FlashAttention-2 forward, LSE and backward on strided (B, L, H, D)-transposed inputs like ours.
    Cached per device: the caller checks the switch (flags.cudnn_attention_enabled) first.
    """
    dev = torch.device("cuda", device_index)
    if torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    try:
        _cudnn_aux(device_index)
        g = torch.Generator(device=dev).manual_seed(0)
        for causal in (False, True):
            q, k, v, do = (
                torch.randn(2, 300, 4, 128, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2)
                for _ in range(4)
            )
            o1, l1 = _cudnn_fwd(q, k, v, 0.1, causal)
            o2, l2 = attn_fwd(q, k, v, 0.1, causal, backend="flash")
            if (o1.float() - o2.float()).abs().max() > 2e-2 or (l1 - l2).abs().max() > 1e-3:
                return False
            out = o2.transpose(1, 2).contiguous().transpose(1, 2)  # layout of our saved outputs
            g1 = _cudnn_bwd(do, q, k, v, out, l2, 0.1, causal)
            g2 = attn_bwd(do, q, k, v, out, l2, 0.1, causal, backend="flash")
            for a, b in zip(g1, g2, strict=True):
                if (a.float() - b.float()).norm() > 2e-2 * b.float().norm():
                    return False
        return True
    except RuntimeError:
        return False


@functools.cache
def _cuda_flash_native_gqa(device_index: int) -> bool:
    """Does this torch's flash op take fewer K/V heads than Q heads? Probed once per device."""
    dev = torch.device("cuda", device_index)
    q = torch.randn(1, 4, 16, 64, device=dev, dtype=torch.float16)
    k = torch.randn(1, 2, 16, 64, device=dev, dtype=torch.float16)
    try:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, k, 0.0, False, False)
        ref = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k.repeat_interleave(2, 1), k.repeat_interleave(2, 1), 0.0, False, False
        )
        return bool(torch.allclose(out[0], ref[0]))
    except RuntimeError:
        return False


@functools.cache
def _cuda_flash_aux(device_index: int):
    """(cum_seq_q, cum_seq_k, philox_seed, philox_offset) exactly as this torch's flash forward
    returns them for dense, dropout-free inputs; the backward op wants these objects back."""
    q = torch.randn(1, 1, 16, 64, device=torch.device("cuda", device_index), dtype=torch.float16)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False, False)
    return res[2], res[3], res[6], res[7]


def _expand_kv(q, k, v):
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit-stride last dim: PyTorch's fused CPU kernel reads the head dim as if it
    had one, so a strided view (a permuted buffer) would give wrong results silently."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _cpu_flash_guard(backend: str, causal: bool, scale: float) -> str:
    """PyTorch's fused CPU kernel scales the causally masked scores after masking them, so a
    causal call with ``scale <= 0`` gets NaN rows (-inf * 0, or +inf from -inf * -x):
    such calls (legal: any finite scale) run the math backend instead."""
    if backend == "cpu_flash" and causal and not scale > 0:
        return "math"
    return backend


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    key_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (B, H, Lq, D); k, v: (B, Hkv, Lk, D); key_mask: (B, Lk) bool, True = masked.

    Returns out (B, H, Lq, D) in q's dtype and lse (B, H, Lq) float32 (float64 for float64).
    """
    backend = backend or _cpu_flash_guard(pick_backend(q, k, key_mask, dropout_p, causal), causal, scale)
    if q.shape[2] == 0 or k.shape[2] == 0:
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=acc_dtype(q.dtype))
        return out, lse
    if backend == "flash":
        if k.shape[1] != q.shape[1] and not _cuda_flash_native_gqa(q.device.index or 0):
            k, v = _expand_kv(q, k, v)
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return res[0], res[1]
    if backend == "cudnn":
        return _cudnn_fwd(q, k, v, scale, causal)
    if backend == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _unit_last(q), _unit_last(k), _unit_last(v), 0.0, causal, scale=scale
        )
        return out, lse.to(acc_dtype(q.dtype))
    return _math_fwd(q, k, v, scale, causal, key_mask, dropout_p, dropout_seed)


def attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    causal: bool = False,
    key_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the FINAL out and lse of the rows (see module docstring).

    Returns dq (like q), dk, dv (like k, v: GQA heads already summed), in the inputs' dtypes.
    """
    backend = backend or _cpu_flash_guard(pick_backend(q, k, key_mask, dropout_p, causal), causal, scale)
    if q.shape[2] == 0 or k.shape[2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if backend == "cudnn":
        return _cudnn_bwd(do, q, k, v, out, lse, scale, causal)  # (dO, out made contiguous there)
    if backend == "flash":
        hkv = k.shape[1]
        native = hkv == q.shape[1] or _cuda_flash_native_gqa(q.device.index or 0)
        ke, ve = (k, v) if native else _expand_kv(q, k, v)
        lq, lk = q.shape[2], k.shape[2]
        cum_q, cum_k, seed, offset = _cuda_flash_aux(q.device.index or 0)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do.contiguous() if do.stride(-1) != 1 else do,
            q,
            ke,
            ve,
            out,
            lse.contiguous(),
            cum_q,
            cum_k,
            lq,
            lk,
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
        if not native and hkv != q.shape[1]:
            b, h, l, d = dk.shape
            dk = dk.view(b, hkv, h // hkv, l, d).sum(2)
            dv = dv.view(b, hkv, h // hkv, l, d).sum(2)
        return dq, dk, dv
    if backend == "cpu_flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _unit_last(do), _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(out),
            lse.to(torch.float32) if q.dtype != torch.float64 else lse, 0.0, causal, scale=scale,
        )
        return dq, dk, dv
    return _math_bwd(do, q, k, v, out, lse, scale, causal, key_mask, dropout_p, dropout_seed)


def _block_rows(b: int, h: int, lk: int) -> int:
    per_row = max(1, b * h * lk * 4)
    return max(16, _MATH_BLOCK_BYTES // per_row)


def _mask_block(t0, t1, lq, lk, causal, key_mask, device):
    """Boolean 'allowed' mask for query rows [t0, t1): shape broadcastable to (B, 1, 1, rows, Lk)."""
    allowed = None
    if causal:
        rows = torch.arange(t0, t1, device=device)[:, None] + (lk - lq)
        cols = torch.arange(lk, device=device)[None, :]
        allowed = (cols <= rows)[None, None, None]  # (1, 1, 1, rows, Lk)
    if key_mask is not None:
        km = (~key_mask)[:, None, None, None, :]  # (B, 1, 1, 1, Lk)
        allowed = km if allowed is None else (allowed & km)
    return allowed


def _dropout_keep(seed: int, block: int, shape, device, p: float) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + block) % (2**63 - 1))
    return torch.rand(shape, generator=g, device=device) >= p


def _math_fwd(q, k, v, scale, causal, key_mask, dropout_p, dropout_seed):
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    rep = h // hkv
    cdt = acc_dtype(q.dtype)
    qg = q.view(b, hkv, rep, lq, d)
    kc = k.to(cdt)[:, :, None]  # (B, Hkv, 1, Lk, D)
    vc = v.to(cdt)[:, :, None]
    out = torch.empty(b, hkv, rep, lq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hkv, rep, lq, dtype=cdt, device=q.device)
    step = _block_rows(b, h, lk)
    for blk, t0 in enumerate(range(0, lq, step)):
        t1 = min(lq, t0 + step)
        s = torch.matmul(qg[:, :, :, t0:t1].to(cdt), kc.transpose(-1, -2)) * scale  # (B,Hkv,rep,rows,Lk)
        allowed = _mask_block(t0, t1, lq, lk, causal, key_mask, q.device)
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        m = torch.logsumexp(s, dim=-1)  # (B,Hkv,rep,rows)
        safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - safe[..., None])
        if dropout_p > 0.0:
            keep = _dropout_keep(dropout_seed, blk, p.shape, q.device, dropout_p)
            p = p * keep / (1.0 - dropout_p)
        out[:, :, :, t0:t1] = torch.matmul(p, vc).to(q.dtype)
        lse[:, :, :, t0:t1] = m
    return out.view(b, h, lq, -1), lse.view(b, h, lq).to(acc_dtype(q.dtype))


def _math_bwd(do, q, k, v, out, lse, scale, causal, key_mask, dropout_p, dropout_seed):
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    rep = h // hkv
    cdt = acc_dtype(q.dtype)
    qg = q.view(b, hkv, rep, lq, d)
    dog = do.reshape(b, hkv, rep, lq, -1)
    og = out.reshape(b, hkv, rep, lq, -1)
    lseg = lse.reshape(b, hkv, rep, lq).to(cdt)
    kc = k.to(cdt)[:, :, None]
    vc = v.to(cdt)[:, :, None]
    dq = torch.empty(b, hkv, rep, lq, d, dtype=q.dtype, device=q.device)
    dk = torch.zeros(b, hkv, lk, d, dtype=cdt, device=q.device)
    dv = torch.zeros(b, hkv, lk, v.shape[-1], dtype=cdt, device=q.device)
    step = _block_rows(b, h, lk)
    for blk, t0 in enumerate(range(0, lq, step)):
        t1 = min(lq, t0 + step)
        qb = qg[:, :, :, t0:t1].to(cdt)
        dob = dog[:, :, :, t0:t1].to(cdt)
        s = torch.matmul(qb, kc.transpose(-1, -2)) * scale
        allowed = _mask_block(t0, t1, lq, lk, causal, key_mask, q.device)
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        l_b = lseg[:, :, :, t0:t1]
        safe = torch.where(torch.isfinite(l_b), l_b, torch.full_like(l_b, math.inf))
        p = torch.exp(s - safe[..., None])  # rows with lse=-inf get exp(-inf) = 0
        dp = torch.matmul(dob, vc.transpose(-1, -2))  # (B,Hkv,rep,rows,Lk)
        if dropout_p > 0.0:
            keep = _dropout_keep(dropout_seed, blk, p.shape, q.device, dropout_p)
            pd = p * keep / (1.0 - dropout_p)
            dp = dp * keep / (1.0 - dropout_p)
        else:
            pd = p
        dv += torch.matmul(pd.transpose(-1, -2), dob).sum(2)
        delta = (dob * og[:, :, :, t0:t1].to(cdt)).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq[:, :, :, t0:t1] = torch.matmul(ds, kc).to(q.dtype)
        dk += torch.matmul(ds.transpose(-1, -2), qb).sum(2)
    return dq.view(b, h, lq, d), dk.to(k.dtype), dv.to(v.dtype)
