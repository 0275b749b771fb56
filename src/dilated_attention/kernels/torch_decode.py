"""Decode path in plain PyTorch: a few query rows against a KV cache, reading only selected keys.

For branch (w, r) a query at position i reads the keys of its own segment that share its
residue: ``j = seg0 + c + r*u`` with ``seg0 = (i // w) * w``, ``c = (i % w) % r`` and
``u = 0 .. ceil(w / r) - 1``, limited to ``j < min(seg0 + w, S)`` (``j <= i`` when causal), where
``S = cache_seqlens[b]`` is the number of valid cache positions. Query heads take part when
they belong to the branch and their offset ``h % r`` equals ``c``. The key lists of all branches
are concatenated and normalised by one log-sum-exp, which is exactly the multiplicity softmax of
``docs/spec.md`` (a key two branches select appears twice).

Everything is computed with static shapes from device tensors (no ``.item()``, no host
planning that depends on tensor values): the same code runs on the CPU, inside a CUDA graph or
under ``torch.compile``. It is the decode path where the Triton kernel cannot run (CPU, float64)
and the readable statement of what ``kernels/triton_decode.py`` computes.

Cache slots: position ``p`` lives in slot ``p % cache_len`` (a ring buffer); a cache at least as
long as the sequence is the plain cache.
"""

from __future__ import annotations

import torch


def decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    branches: list[tuple[int, int, int, int]],
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, T, H, D); k_cache, v_cache (B, C, Hkv, D); cache_seqlens (B,) int.

    ``branches``: (w, r, head start, head stop) of the branches with at least one head.
    Query row t is position ``cache_seqlens[b] - T + t``. Returns out (B, T, H, D) in q's dtype
    and lse (B, H, T) float32; a row no branch selects gets out = 0, lse = -inf.
    """
    bsz, nq, nh, d = q.shape
    cap, hkv = k_cache.shape[1], k_cache.shape[2]
    rep = nh // hkv
    dev = q.device
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    seqlens = cache_seqlens.to(torch.int64)  # (B,)
    pos = seqlens[:, None] - nq + torch.arange(nq, device=dev)  # (B, T) query positions
    heads = torch.arange(nh, device=dev).view(1, 1, hkv, rep)  # query head h = g * rep + i
    bidx = torch.arange(bsz, device=dev).view(bsz, 1, 1)
    qf = q.to(cdt).view(bsz, nq, hkv, rep, d)
    scores, values = [], []
    for w, r, hs, he in branches:
        seg0 = torch.div(pos, w, rounding_mode="floor") * w  # (B, T)
        c = (pos - seg0) % r  # (B, T) residue of the query in its segment
        u = torch.arange(-(-w // r), device=dev)  # (U,)
        j = seg0[..., None] + c[..., None] + r * u  # (B, T, U) key positions
        end = torch.minimum(seg0 + w, pos + 1 if causal else seqlens[:, None])  # (B, T)
        valid = (j < end[..., None]) & (pos >= 0)[..., None]  # (B, T, U)
        slot = j.clamp_min(0) % cap
        kk = k_cache[bidx, slot].to(cdt)  # (B, T, U, Hkv, D)
        vv = v_cache[bidx, slot].to(cdt)
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
