"""An independent float64 recomputation of docs/spec.md's definition, by loops over every
(batch, head, query, key) (tiny sizes only). It imports nothing from the library: its own head
split (the first H % B groups one head larger), bottom-right query alignment, key padding mask,
softmax scale and multiplicities, so that a bug the reference and the torch path share (both are
built on the library's geometry and branch code) still shows. Written by the 2026-11-30 mutation
audit, which found such a shared bug uncaught (the split head grouping)."""

from __future__ import annotations

import math

import torch


def head_ranges(h: int, nb: int, ha: str) -> list[tuple[int, int]]:
    if ha == "all":
        return [(0, h)] * nb
    base, extra = divmod(h, nb)
    out, s = [], 0
    for b in range(nb):
        n = base + (1 if b < extra else 0)
        out.append((s, s + n))
        s += n
    return out


def spec(q, k, v, seg, dil, causal=False, scale=None, kpm=None, ha="all"):
    """(out (B, Nq, H, D), lse (B, H, Nq)) float64 of q (B, Nq, H, D), k / v (B, Nk, Hkv, D):
    query row t sits at position Nk - Nq + t; key j is attended with multiplicity m (the
    branches whose segment and residue hold both), weight m * exp(score); kpm True = padding."""
    bt, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    rep = h // hkv
    scale = d**-0.5 if scale is None else scale
    qoff = nk - nq
    out = torch.zeros(bt, nq, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((bt, h, nq), -math.inf, dtype=torch.float64)
    rng = head_ranges(h, len(seg), ha)
    for b in range(bt):
        for hh in range(h):
            for t in range(nq):
                i = qoff + t
                ms = []
                for j in range(nk):
                    m = 0
                    for (w, r), (hs, he) in zip(zip(seg, dil, strict=True), rng, strict=True):
                        if hs <= hh < he and i // w == j // w and (i % w) % r == hh % r and (j % w) % r == hh % r:
                            m += 1
                    if (causal and j > i) or (kpm is not None and bool(kpm[b, j])):
                        m = 0
                    ms.append(m)
                js = [j for j in range(nk) if ms[j] > 0]
                if not js:
                    continue
                s = torch.stack([scale * (q[b, t, hh].double() @ k[b, j, hh // rep].double()) for j in js])
                wts = torch.tensor([float(ms[j]) for j in js], dtype=torch.float64)
                lg = torch.logsumexp(s + wts.log(), 0)
                p = wts * torch.exp(s - lg)
                out[b, t, hh] = sum(p[n] * v[b, js[n], hh // rep].double() for n in range(len(js)))
                lse[b, hh, t] = lg
    return out, lse
