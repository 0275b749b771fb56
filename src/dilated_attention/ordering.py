"""Token orderings for flattened 2-D grids: the Hilbert curve (docs/spec.md, "Token ordering").

- :func:`hilbert_permutation`: ``(perm, inv)`` for a ``height x width`` grid of any size, built
  with the generalized Hilbert ("gilbert") curve of J. Cerveny, which covers any rectangle and
  keeps consecutive cells 4-neighbours (exactly for power-of-two squares, and for all but at most
  one diagonal step on other rectangles). Computed level by level on int64 tensors (no Python loop
  per cell) and cached on the CPU; copies are moved to the device on demand.
- :func:`hilbert_attention`: what ``DilatedAttention(ordering="hilbert", grid=(h, w))`` runs:
  reorder q, k, v (and the key padding mask) along the curve, attend, restore row-major order.
  One gather per tensor in the forward and one in the backward (the gradient of a permutation is
  the inverse permutation, so no scatter-add is needed). With a process group the reordering is a
  global permutation done by one ``all_to_all_single`` before attention and one after.

Why gilbert and not a power-of-two curve on the enclosing square filtered to the grid: filtering
cuts the curve wherever it leaves the grid, so on e.g. 37x53 many consecutive tokens are far apart
(the curve jumps back in somewhere else); gilbert never leaves the rectangle.
"""

from __future__ import annotations

import torch

from .plan_cache import cached_plan

__all__ = ["hilbert_permutation", "hilbert_attention", "permute_sequence"]


# --------------------------------------------------------------------------------------------
# The curve
# --------------------------------------------------------------------------------------------


def _hilbert_cpu(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_hilbert_build`, kept in :mod:`.plan_cache` (which keeps no tensor made under a fake
    or tracing mode: a ``torch.export`` of an encoder must not leave fake permutations behind)."""
    return cached_plan((__name__, "hilbert", height, width), lambda: _hilbert_build(height, width))


def _hilbert_build(height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, inv) on the CPU; perm[t] = row-major index (y * width + x) of the t-th curve cell.

    The gilbert recursion, run breadth first: every live rectangle is one row of the int64 state
    ``(x, y, ax, ay, bx, by, start)`` (origin, major axis vector a, minor axis vector b, index on
    the curve of its first cell). A level splits every rectangle into its 2 or 3 children at once;
    rectangles one cell thick are leaves and emit their cells with ``repeat_interleave``. The
    recursion depth is about 2 * log2(max(height, width)), so a 1024x1024 grid takes tens of ms.
    """
    n = height * width
    if width >= height:
        st = torch.tensor([[0, 0, width, 0, 0, height, 0]], dtype=torch.int64)
    else:
        st = torch.tensor([[0, 0, 0, height, width, 0, 0]], dtype=torch.int64)
    perm = torch.empty(n, dtype=torch.int64)
    while st.shape[0]:
        x, y, ax, ay, bx, by, s = st.unbind(1)
        w = (ax + ay).abs()
        h = (bx + by).abs()
        dax, day, dbx, dby = ax.sign(), ay.sign(), bx.sign(), by.sign()

        # Leaves: one cell thick. Walk along a if h == 1, else along b (w == 1).
        leaf = (h == 1) | (w == 1)
        if bool(leaf.any()):
            row = h[leaf] == 1
            length = torch.where(row, w[leaf], h[leaf])  # (L,)
            sx = torch.where(row, dax[leaf], dbx[leaf])
            sy = torch.where(row, day[leaf], dby[leaf])
            cum = torch.cumsum(length, 0)
            total = int(cum[-1])
            owner = torch.repeat_interleave(torch.arange(length.numel()), length, output_size=total)
            i = torch.arange(total) - (cum - length)[owner]  # step along the leaf
            cx = x[leaf][owner] + i * sx[owner]
            cy = y[leaf][owner] + i * sy[owner]
            perm[s[leaf][owner] + i] = cy * width + cx

        keep = ~leaf
        x, y, ax, ay, bx, by, s = (t[keep] for t in (x, y, ax, ay, bx, by, s))
        w, h, dax, day, dbx, dby = (t[keep] for t in (w, h, dax, day, dbx, dby))
        if x.numel() == 0:
            break
        # Python floor division, as the reference implementation (matters for negative vectors).
        ax2, ay2 = torch.div(ax, 2, rounding_mode="floor"), torch.div(ay, 2, rounding_mode="floor")
        bx2, by2 = torch.div(bx, 2, rounding_mode="floor"), torch.div(by, 2, rounding_mode="floor")
        w2 = (ax2 + ay2).abs()
        h2 = (bx2 + by2).abs()

        long = 2 * w > 3 * h
        # Long case: split along a into two parts (prefer an even first half).
        fix_a = long & (w2 % 2 == 1) & (w > 2)
        lax2 = ax2 + torch.where(fix_a, dax, 0)
        lay2 = ay2 + torch.where(fix_a, day, 0)
        # Standard case: up along b, across along a, down (prefer an even first step).
        fix_b = ~long & (h2 % 2 == 1) & (h > 2)
        sbx2 = bx2 + torch.where(fix_b, dbx, 0)
        sby2 = by2 + torch.where(fix_b, dby, 0)

        lg, sd = long, ~long
        # Long children.
        l1 = torch.stack([x, y, lax2, lay2, bx, by, s], 1)[lg]
        a1 = ((lax2 + lay2).abs() * h)[lg]
        l2 = torch.stack([x + lax2, y + lay2, ax - lax2, ay - lay2, bx, by, s], 1)[lg]
        l2[:, 6] += a1
        # Standard children.
        c1 = torch.stack([x, y, sbx2, sby2, ax2, ay2, s], 1)[sd]
        area1 = ((sbx2 + sby2).abs() * (ax2 + ay2).abs())[sd]
        c2 = torch.stack([x + sbx2, y + sby2, ax, ay, bx - sbx2, by - sby2, s], 1)[sd]
        c2[:, 6] += area1
        area2 = (w * (bx - sbx2 + by - sby2).abs())[sd]
        c3 = torch.stack(
            [
                x + (ax - dax) + (sbx2 - dbx),
                y + (ay - day) + (sby2 - dby),
                -sbx2,
                -sby2,
                -(ax - ax2),
                -(ay - ay2),
                s,
            ],
            1,
        )[sd]
        c3[:, 6] += area1 + area2
        st = torch.cat([l1, l2, c1, c2, c3], 0)
        # Empty children (a zero-length axis) can appear for 2-wide strips; they own no cells.
        cw = (st[:, 2] + st[:, 3]).abs()
        ch = (st[:, 4] + st[:, 5]).abs()
        st = st[(cw > 0) & (ch > 0)]

    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)
    return perm, inv


def _hilbert_on(height: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    def build():
        perm, inv = _hilbert_cpu(height, width)
        return perm.to(device), inv.to(device)

    return cached_plan((__name__, "hilbert", height, width, str(device)), build)


def hilbert_permutation(height: int, width: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Hilbert ordering of a ``height x width`` grid flattened row-major.

    Args:
        height, width: grid size, any positive integers (not only powers of two).
        device: where the returned tensors live (default CPU).

    Returns:
        ``(perm, inv)``, int64 tensors of shape ``(height * width,)``: ``perm[t]`` is the
        row-major index ``row * width + col`` of the t-th cell along the curve, so
        ``x[:, perm]`` is ``x`` in curve order; ``inv`` is the inverse (``inv[perm] == arange``),
        so ``y[:, inv]`` restores row-major order. Fresh tensors on every call (copies of a
        per-(height, width, device) cache), so the caller may modify them.
    """
    perm, inv = _hilbert_cached(height, width, device)
    return perm.clone(), inv.clone()


def _hilbert_cached(height: int, width: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached ``(perm, inv)`` themselves: library-internal, never modified, never returned."""
    height, width = _check_grid(height, width)
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cpu":
        return _hilbert_cpu(height, width)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _hilbert_on(height, width, dev)


def _check_grid(height, width) -> tuple[int, int]:
    try:
        h, w = int(height), int(width)
    except (TypeError, ValueError):
        raise ValueError(
            f"grid sizes must be integers, got height={height!r}, width={width!r}"
        ) from None
    if h != height or w != width or h < 1 or w < 1:
        raise ValueError(
            f"grid sizes must be positive integers, got height={height!r}, width={width!r}"
        )
    return h, w


# --------------------------------------------------------------------------------------------
# Permuting sequences (single device and sequence-parallel)
# --------------------------------------------------------------------------------------------


class _PermuteFunction(torch.autograd.Function):
    """y = x.index_select(dim, perm); the backward is a gather with ``inv`` (no index_add)."""

    @staticmethod
    def forward(ctx, x, perm, inv, dim):
        ctx.save_for_backward(perm, inv)
        ctx.dim = dim
        return x.index_select(dim, perm)

    @staticmethod
    def backward(ctx, g):
        perm, inv = ctx.saved_tensors
        return _PermuteFunction.apply(g, inv, perm, ctx.dim), None, None, None


def _exchange_plan(height: int, width: int, world: int, rank: int, forward: bool):
    """:func:`_exchange_plan_build`, kept in :mod:`.plan_cache`."""
    return cached_plan((__name__, "exchange", height, width, world, rank, forward),
                       lambda: _exchange_plan_build(height, width, world, rank, forward))  # fmt: skip


def _exchange_plan_build(height: int, width: int, world: int, rank: int, forward: bool):
    """Index plan for the all-to-all that turns contiguous shards of x into shards of x[perm].

    Globally ``y[t] = x[src[t]]`` with ``src = perm`` (forward) or ``inv`` (restore); ``dst`` is
    the inverse of ``src``. Rank r holds x[r*n:(r+1)*n] and must end with y[r*n:(r+1)*n].
    - Send: local row g goes to global slot dst[r*n + g], i.e. to rank dst // n. Rows are sent
      sorted by destination slot, so per destination they arrive in increasing slot order.
    - Receive: slot t needs x[src[t]] from rank src[t] // n; received rows are grouped by source
      rank (all_to_all order) and within a source in increasing t, which is a stable sort of the
      slots by source rank; ``unsort`` puts them back in slot order.
    Returns CPU int64 (send_idx, unsort) and the split size lists.
    """
    perm, inv = _hilbert_cpu(height, width)
    src, dst = (perm, inv) if forward else (inv, perm)
    n = height * width // world
    lo, hi = rank * n, (rank + 1) * n
    my_dst = dst[lo:hi]
    send_idx = torch.argsort(my_dst)
    send_splits = torch.bincount(my_dst // n, minlength=world).tolist()
    my_src_rank = src[lo:hi] // n
    order = torch.sort(my_src_rank, stable=True).indices
    unsort = torch.argsort(order)
    recv_splits = torch.bincount(my_src_rank, minlength=world).tolist()
    return send_idx, unsort, send_splits, recv_splits


def _exchange_plan_on(height, width, world, rank, forward, device):
    """:func:`_exchange_plan` with the index tensors on ``device`` (no copy per call)."""

    def build():
        send_idx, unsort, send_splits, recv_splits = _exchange_plan(height, width, world, rank, forward)
        return send_idx.to(device), unsort.to(device), send_splits, recv_splits

    return cached_plan((__name__, "exchange", height, width, world, rank, forward, str(device)), build)


def _exchange(x: torch.Tensor, grid, group, forward: bool) -> torch.Tensor:
    """Shard (B, n, ...) of a contiguous-layout sequence -> shard of the (un)permuted sequence."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_idx, unsort, send_splits, recv_splits = _exchange_plan_on(
        grid[0], grid[1], world, rank, forward, x.device
    )
    # One gather that also moves the sequence dim first, because all_to_all_single splits dim 0.
    send = x.transpose(0, 1).index_select(0, send_idx)  # (n, B, ...) contiguous
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    return recv.index_select(0, unsort).transpose(0, 1).contiguous()  # (B, n, ...)


class _ExchangeFunction(torch.autograd.Function):
    """Distributed permutation; its backward is the inverse permutation (the same exchange)."""

    @staticmethod
    def forward(ctx, x, grid, group, forward):
        ctx.grid, ctx.group, ctx.forward_dir = grid, group, forward
        return _exchange(x, grid, group, forward)

    @staticmethod
    def backward(ctx, g):
        return (
            _ExchangeFunction.apply(g.contiguous(), ctx.grid, ctx.group, not ctx.forward_dir),
            None,
            None,
            None,
        )


def permute_sequence(
    x: torch.Tensor, grid: tuple[int, int], *, inverse: bool = False, group=None
) -> torch.Tensor:
    """Reorder dim 1 of ``x`` (batch, seqlen, ...) from row-major to Hilbert order (or back).

    Args:
        x: (batch, seqlen, ...); with ``group`` this rank's contiguous shard, seqlen = H*W / P.
        grid: (height, width), ``height * width`` = the global sequence length.
        inverse: False: row-major -> curve order (``x[:, perm]``); True: curve -> row-major.
        group: process group for sequence-parallel shards (None: x is the whole sequence).

    Returns:
        a tensor like ``x``, differentiable; one gather (plus one all_to_all with a group).
        Boolean tensors (masks) are supported and carry no gradient.
    """
    h, w = _check_grid(*grid)
    if group is None:
        perm, inv = _hilbert_cached(h, w, device=x.device)
        if inverse:
            perm, inv = inv, perm
        if not x.requires_grad:
            return x.index_select(1, perm)
        return _PermuteFunction.apply(x, perm, inv, 1)
    if x.dtype == torch.bool:  # collectives on bool are not supported by every backend
        return _exchange(x.to(torch.uint8), (h, w), group, not inverse).bool()
    if not x.requires_grad:
        return _exchange(x, (h, w), group, not inverse)
    return _ExchangeFunction.apply(x, (h, w), group, not inverse)


def hilbert_attention(
    attend, grid, query, key, value, is_causal=False, key_padding_mask=None, process_group=None
):
    """``attend`` on q, k, v reordered along the Hilbert curve of ``grid``, the output put back in
    row-major order.

    Args:
        attend: ``attend(q, k, v, is_causal, key_padding_mask) -> out``, the attention to run on the
            reordered tensors (e.g. a ``DilatedAttention``'s forward without an ordering).
        grid: (height, width) of the image the sequence was flattened from (row-major).
        process_group: the sequence-parallel group the shards belong to, or None.
        query: (batch, seqlen, nheads, headdim); key, value: (batch, seqlen, nheads_kv, headdim).
            seqlen = height * width (or height * width / P per rank with a process group of P
            ranks, contiguous layout: rank r holds row-major positions [r*N/P, (r+1)*N/P)).
        is_causal: causal *along the curve*: token t attends to tokens at or before it in Hilbert
            order, not in row-major order.
        key_padding_mask: (batch, seqlen) bool, True = padding, in row-major order like the keys.

    Returns:
        (batch, seqlen, nheads, headdim) in row-major order (this rank's shard with a group).
    """
    h, w = grid
    n = h * w
    group = process_group
    world = 1
    if group is not None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "ordering='hilbert' with a process_group needs torch.distributed initialised"
            )
        world = dist.get_world_size(group)
    nq, nk, nv = query.shape[1], key.shape[1], value.shape[1]
    if not nq == nk == nv or nq * world != n:
        per = f" per rank ({world} ranks, contiguous shards of {n} // {world})" if world > 1 else ""
        raise ValueError(
            f"ordering='hilbert' with grid=({h}, {w}) needs query, key and value of sequence length "
            f"{n // world if n % world == 0 else f'{n}/{world}'}{per}; got seqlen_q={nq}, seqlen_k={nk}, "
            f"seqlen_v={nv} (decoding with seqlen_q < seqlen_k is not supported with an ordering)"
        )
    if n % world != 0:
        raise ValueError(f"grid ({h}, {w}) has {n} tokens, not divisible by {world} ranks")
    q = permute_sequence(query, (h, w), group=group)
    k = permute_sequence(key, (h, w), group=group)
    v = permute_sequence(value, (h, w), group=group)
    mask = (
        None
        if key_padding_mask is None
        else permute_sequence(key_padding_mask, (h, w), group=group)
    )
    out = attend(q, k, v, is_causal, mask)
    return permute_sequence(out, (h, w), inverse=True, group=group)
