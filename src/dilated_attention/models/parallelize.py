"""Sequence parallelism applied to a LongNet model from outside (torchtitan style).

The model files contain no parallelism code. :func:`parallelize` sets, on a built model,

- every :class:`~dilated_attention.DilatedAttention`'s ``process_group`` (its forward then calls
  ``dilated_attention(..., group=pg)``, whose backward is exact across ranks), and
- the model's ``sp_group``, from which the model computes its global position offset
  ``rank * N_local``: each rank passes its contiguous shard ``[r*N/P, (r+1)*N/P)`` of the sequence
  (``shard_sequence(x, group)``) and rotary positions stay global.

Composition with data parallelism (2-D mesh ``("dp", "sp")``)::

    mesh = init_device_mesh("cuda", (dp, sp), mesh_dim_names=("dp", "sp"))
    parallelize(model, mesh, sp_dim="sp")
    model = DDP(model, process_group=None)  # or fully_shard(model, mesh=mesh["dp"]) ...

Gradients: each rank's loss is the mean over its own tokens, and the attention backward already
sends the K/V gradients of other ranks' queries to the rank that owns them. With equal token
counts per rank the gradient of the global mean loss is therefore the *average over all ranks*
(dp and sp) of the local gradients, which is what DDP over the whole world does; with FSDP2,
shard over ``dp`` and all-reduce (average) gradients over ``sp`` as well (or ``fully_shard`` over
the flattened ``(dp, sp)`` mesh). With ignored targets (-100) the counts differ: weight each rank's
loss by its token count over the global count instead.
"""

from __future__ import annotations

from torch import nn

from ..distributed.comm import resolve_group
from ..modules import DilatedAttention


def parallelize(model: nn.Module, mesh_or_group, *, sp_dim: int | str | None = None) -> nn.Module:
    """Make ``model`` sequence-parallel over a group (in place; returns the model).

    Args:
        model: a :class:`LongNetLM` / :class:`LongNetEncoder` (any module whose attention is
            :class:`DilatedAttention` and which has an ``sp_group`` attribute for positions).
        mesh_or_group: a ``ProcessGroup``, a 1-D ``DeviceMesh``, or an N-D mesh with ``sp_dim``.
            ``None`` undoes sequence parallelism.
        sp_dim: the mesh dimension (name or index) used for the sequence.

    After this, ``model(idx_local)`` takes this rank's contiguous shard (B, N/P) of the sequence.
    """
    group = resolve_group(mesh_or_group, sp_dim)
    n = 0
    for m in model.modules():
        if isinstance(m, DilatedAttention):
            m.process_group = group
            n += 1
        if hasattr(m, "sp_group"):
            m.sp_group = group
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no DilatedAttention module to parallelize")
    return model
