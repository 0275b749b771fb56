"""Sequence sharding layouts: which global positions each rank holds.

Pure tensor code (no ``torch.distributed`` needed) plus the two thin collectives
:func:`shard_sequence` / :func:`gather_sequence` built on it.

Layouts of a global sequence of length N over P ranks (docs/spec.md, "Sequence parallelism"):

- ``"contiguous"``: rank r holds positions ``[r*N/P, (r+1)*N/P)``; needs ``N % P == 0``.
- ``"zigzag"``: the sequence is cut into 2P equal chunks; rank r holds chunk r followed by chunk
  ``2P-1-r`` (so every rank has one early and one late chunk, which balances causal attention);
  needs ``N % (2P) == 0``.

Within a rank the positions are increasing in both layouts, so causal masking of a rank's own
block is plain causal masking.
"""

from __future__ import annotations

import zlib

import torch

from .comm import GATHER_DIMS as _GATHER_DIMS
from .comm import GATHER_NAMES, resolve_group, validate_across_ranks, world_and_rank

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_divisible(n: int, world: int, layout: str, what: str = "sequence length") -> None:
    """Raise a clear error when a global length ``n`` cannot be split over ``world`` ranks."""
    check_layout(layout)
    parts = world if layout == "contiguous" else 2 * world
    if n % parts != 0:
        hint = "P" if layout == "contiguous" else "2P (zigzag cuts 2P chunks)"
        raise ValueError(
            f"{what} {n} is not divisible by {hint} = {parts} for layout={layout!r} with "
            f"P = {world} ranks; pad the sequence to a multiple of {parts} (and mask the padding)"
        )


def chunk_ids(world: int, rank: int, layout: str) -> list[int]:
    """The chunk indices rank ``rank`` holds, in local order (chunk size N/P or N/2P)."""
    check_layout(layout)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world size {world}")
    if layout == "contiguous":
        return [rank]
    return [rank, 2 * world - 1 - rank]


def rank_chunks(n: int, world: int, rank: int, layout: str = "contiguous") -> list[tuple[int, int, int]]:
    """``(global start, global end, local start)`` of each chunk rank ``rank`` holds, in local
    order (which is also increasing global order, in both layouts)."""
    check_divisible(n, world, layout)
    ids = chunk_ids(world, rank, layout)
    c = n // world // len(ids)
    return [(i * c, (i + 1) * c, j * c) for j, i in enumerate(ids)]


def chunk_owner(chunk: int, world: int, layout: str) -> int:
    """The rank that holds global chunk ``chunk`` (chunks of N/P for "contiguous", N/2P for
    "zigzag")."""
    check_layout(layout)
    if layout == "contiguous":
        return chunk
    return chunk if chunk < world else 2 * world - 1 - chunk


def shard_positions(n: int, world: int, rank: int, layout: str = "contiguous", device=None) -> torch.Tensor:
    """Global positions (int64, shape (n // world,)) that rank ``rank`` holds, in local order."""
    check_divisible(n, world, layout)
    ids = chunk_ids(world, rank, layout)
    c = n // world // len(ids)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])


def shard_local(x: torch.Tensor, world: int, rank: int, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The shard of a global tensor ``x`` that rank ``rank`` holds (a view for "contiguous")."""
    n = x.shape[dim]
    check_divisible(n, world, layout)
    ids = chunk_ids(world, rank, layout)
    c = n // world // len(ids)
    parts = [x.narrow(dim, i * c, c) for i in ids]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard(shards: list[torch.Tensor], layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_local`: the global tensor from all ranks' shards (rank order)."""
    check_layout(layout)
    world = len(shards)
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    n_local = shards[0].shape[dim]
    if n_local % 2:
        raise ValueError(f"zigzag shards must have an even length, got {n_local}")
    c = n_local // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * world)
    for r, s in enumerate(shards):
        chunks[r] = s.narrow(dim, 0, c)
        chunks[2 * world - 1 - r] = s.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)


def shard_sequence(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """Global tensor (identical on every rank) -> this rank's shard along ``dim``.

    No communication. ``group=None``: the default group when ``torch.distributed`` is initialised,
    otherwise a single rank (returns ``x``). Not differentiable through other ranks' shards.
    """
    world, rank = world_and_rank(resolve_group(group))
    return shard_local(x, world, rank, layout, dim)


class _GatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, layout, dim, world, rank):
        import torch.distributed as dist

        ctx.group, ctx.layout, ctx.dim, ctx.world, ctx.rank = group, layout, dim, world, rank
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        return unshard(parts, layout, dim)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        # every rank may use the gathered tensor: the gradient of a shard is the sum over ranks
        grad = grad.contiguous()  # gloo all_reduce needs a dense tensor
        dist.all_reduce(grad, group=ctx.group)
        return shard_local(grad, ctx.world, ctx.rank, ctx.layout, ctx.dim).contiguous(), None, None, None, None, None


def gather_sequence(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1,
                    validate: bool = True) -> torch.Tensor:  # fmt: skip
    """Shards (one per rank, same shape) -> the global tensor on every rank. For tests and tools.

    Uses one ``all_gather`` (O(N) memory per rank). Differentiable: the gradient of each shard is
    the sum over ranks of the gradient of the gathered tensor (one ``all_reduce``).
    ``validate`` (default): first compare the shards' shapes, dtypes, ``dim`` and ``layout``
    across ranks (one small all_gather) and raise the same ``ValueError`` on every rank where
    they differ; without it, shards of other shapes abort a gloo rank or gather garbage.
    """
    group = resolve_group(group)
    world, rank = world_and_rank(group)

    def local_checks():
        check_layout(layout)
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"gather_sequence: dim {dim} is out of range for a tensor of {x.dim()} dims")

    if world == 1:
        local_checks()
        return x

    def describe():
        sizes = [*x.shape[:_GATHER_DIMS], *[-1] * (_GATHER_DIMS - min(x.dim(), _GATHER_DIMS))]
        return [x.dim(), zlib.crc32(str(x.dtype).encode()), dim % x.dim(), int(layout == "zigzag"), *sizes]

    # a bad argument on one rank raises on every rank (no rank left waiting in the all-gather)
    validate_across_ranks(group, "gather_sequence", local_checks, describe, GATHER_NAMES, x, validate)
    return _GatherFunction.apply(x, group, layout, dim % x.dim(), world, rank)
