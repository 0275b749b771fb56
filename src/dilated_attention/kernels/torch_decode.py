"""Decode path in plain PyTorch: a few query rows against a KV cache, reading only selected keys.

For branch (w, r) a query at position i reads the keys of its own segment that share its
residue: ``j = seg0 + c + r*u`` with ``seg0 = (i // w) * w``, ``c = (i % w) % r`` and
``u = 0 .. ceil(w / r) - 1``, limited to ``j < min(seg0 + w, n)`` (``j <= i`` when causal), where
``n = cache_seqlens[b] - cache_leftpad[b]`` is the length of row b's sequence. Query heads take
part when they belong to the branch and their offset ``h % r`` equals ``c``. The key lists of all
branches are concatenated and normalised by one log-sum-exp, which is exactly the multiplicity
softmax of ``docs/spec.md`` (a key two branches select appears twice).

Everything is computed with static shapes from device tensors (no ``.item()``, no host
planning that depends on tensor values): the same code runs on the CPU, inside a CUDA graph or
under ``torch.compile``. It is the decode path where the Triton kernel cannot run (CPU, float64)
and the readable statement of what ``kernels/triton_decode.py`` computes.

Cache slots: position ``p`` of row b is slot index ``a = cache_leftpad[b] + p`` and lives in slot
``a % cache_len`` (a ring buffer; a cache at least as long as the sequence is the plain cache).
Keys that a row does not select are never mixed into its result: their gathered K and V are
replaced by zeros before any arithmetic, so garbage (NaN, Inf) in unwritten slots cannot leak.
"""

from __future__ import annotations

import torch


def decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cache_leftpad: torch.Tensor | None,
    branches: list[tuple[int, int, int, int]],
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, T, H, D); k_cache, v_cache (B, C, Hkv, D); cache_seqlens, cache_leftpad (B,) int.

    ``branches``: (w, r, head start, head stop) of the branches with at least one head.
    Row b's sequence is slots ``[L_b, cache_seqlens[b])`` with ``L_b = max(cache_leftpad[b], 0)``
    (0 without leftpad); query row t is position ``cache_seqlens[b] - L_b - T + t``; a row at a
    negative position reads nothing. Returns out (B, T, H, D) in q's dtype and lse (B, H, T)
    float32; a row no branch selects gets out = 0, lse = -inf.
    """
    bsz, nq, nh, d = q.shape
    cap, hkv = k_cache.shape[1], k_cache.shape[2]
    rep = nh // hkv
    dev = q.device
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if cache_leftpad is None:
        lpad = torch.zeros(bsz, 1, dtype=torch.int64, device=dev)
    else:
        lpad = cache_leftpad.to(torch.int64).clamp_min(0)[:, None]  # (B, 1)
    seqlens = cache_seqlens.to(torch.int64)[:, None] - lpad  # (B, 1) sequence lengths
    pos = seqlens - nq + torch.arange(nq, device=dev)  # (B, T) query positions
    heads = torch.arange(nh, device=dev).view(1, 1, hkv, rep)  # query head h = g * rep + i
    bidx = torch.arange(bsz, device=dev).view(bsz, 1, 1)
    qf = q.to(cdt).view(bsz, nq, hkv, rep, d)
    scores, values = [], []
    for w, r, hs, he in branches:
        seg0 = torch.div(pos, w, rounding_mode="floor") * w  # (B, T)
        c = (pos - seg0) % r  # (B, T) residue of the query in its segment
        u = torch.arange(-(-w // r), device=dev)  # (U,)
        j = seg0[..., None] + c[..., None] + r * u  # (B, T, U) key positions
        end = torch.minimum(seg0 + w, pos + 1 if causal else seqlens)  # (B, T)
        valid = (j < end[..., None]) & (pos >= 0)[..., None]  # (B, T, U)
        slot = (j.clamp_min(0) + lpad[..., None]) % cap
        zero = torch.zeros((), dtype=cdt, device=dev)
        vmask = valid[..., None, None]  # (B, T, U, 1, 1)
        # select by index before any arithmetic: 0 * NaN would be NaN
        kk = torch.where(vmask, k_cache[bidx, slot].to(cdt), zero)  # (B, T, U, Hkv, D)
        vv = torch.where(vmask, v_cache[bidx, slot].to(cdt), zero)
        s = torch.einsum("btgid,btugd->btgiu", qf, kk) * scale  # (B, T, Hkv, rep, U)
        takes = (heads >= hs) & (heads < he) & (heads % r == c[..., None, None])  # (B, T, Hkv, rep)
        keep = takes[..., None] & valid[:, :, None, None, :]  # (B, T, Hkv, rep, U)
        scores.append(s.masked_fill(~keep, float("-inf")))
        values.append(vv)
    s_all = torch.cat(scores, dim=-1)  # (B, T, Hkv, rep, sum U)
    lse = torch.logsumexp(s_all, dim=-1)  # (B, T, Hkv, rep); -inf for a row with no key
    shift = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = torch.zeros(bsz, nq, hkv, rep, d, dtype=cdt, device=dev)
    for s, vv in zip(scores, values, strict=True):
        p = torch.exp(s - shift[..., None])  # masked keys: exp(-inf) = 0
        out += torch.einsum("btgiu,btugd->btgid", p, vv)
    out = out.view(bsz, nq, nh, d).to(q.dtype)
    lse = lse.view(bsz, nq, nh).transpose(1, 2).to(torch.float32)  # (B, H, T)
    return out, lse
