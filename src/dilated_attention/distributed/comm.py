"""Process groups, point-to-point ring communication and cross-rank input checks.

- :func:`resolve_group`: ``None`` / a ``ProcessGroup`` / a 1-D ``DeviceMesh`` / ``(mesh, dim)``
  / an N-D mesh with ``dim`` -> a ``ProcessGroup`` (or ``None`` for the default group).
- :class:`RingComm`: batched ``isend``/``irecv`` to the next / from the previous rank of a group,
  so that the next block is in flight while the current one is computed. It counts the bytes it
  sends and the bytes of receive buffers that are alive (through weak references), which is how
  the tests check that ring memory does not grow with the number of ranks.
- :func:`world_and_rank`: (size, rank) of a group, (1, 0) without ``torch.distributed``.
- :func:`validate_across_ranks` / :func:`check_same_across_ranks`: local input checks, then one
  small ``all_gather`` of an int64 descriptor so that mismatched shapes or dtypes raise the same
  clear error on every rank instead of hanging. Every descriptor travels padded to
  :data:`DESCRIPTOR_LEN` ints with its kind (a checksum of its field names, one of the
  descriptors below), so ranks that make different calls (e.g. ``cu_seqlens`` on some ranks
  only) get an error naming the calls, not a gloo size abort.
"""

from __future__ import annotations

import struct
import weakref
import zlib

import torch
import torch.distributed as dist

_DTYPE_CODES = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float64: 4,
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


def resolve_group(group, dim=None):
    """A ``ProcessGroup`` (or ``None``: the default group) from what a user may pass.

    ``group``: ``None``, a ``ProcessGroup``, a 1-D ``DeviceMesh``, a ``(DeviceMesh, dim)`` pair,
    or an N-D ``DeviceMesh`` together with ``dim`` (the mesh dimension, name or index, used for
    the sequence). A multi-dimensional mesh without ``dim`` is ambiguous and raises.
    """
    if group is None:
        return None
    if isinstance(group, tuple) and len(group) == 2 and _is_mesh(group[0]):
        if dim is not None:
            raise ValueError("give the mesh dimension once: (mesh, dim) or mesh with dim=, not both")
        group, dim = group
    if _is_mesh(group):
        if dim is not None:
            return group.get_group(dim)
        if group.ndim != 1:
            raise ValueError(
                f"a DeviceMesh with {group.ndim} dims is ambiguous for sequence parallelism; pass "
                "(mesh, dim) or mesh.get_group(dim) for the sequence-parallel dimension (for "
                "parallelize: parallelize(model, mesh, sp_dim='sp'))"
            )
        return group.get_group()
    if dim is not None:
        raise ValueError(
            f"a mesh dimension ({dim!r}) is only meaningful with a DeviceMesh; a ProcessGroup was given"
        )
    return group


def _is_mesh(obj) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, DeviceMesh)


def world_and_rank(group) -> tuple[int, int]:
    """(size, rank) of ``group``; (1, 0) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def global_rank(group, group_rank: int) -> int:
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _comm_device(group, like: torch.Tensor) -> torch.device:
    """Device for small collectives: the tensor's device for NCCL, CPU otherwise."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and like.is_cuda:
        return like.device
    return torch.device("cpu")


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES.get(dtype, 0)


# every descriptor is sent padded to this many ints: all_gather needs one size on every rank,
# whatever call each rank made (gloo aborts the process on a size mismatch)
DESCRIPTOR_LEN = 16

# The descriptors the cross-rank checks compare (field names), one per kind of call.
# dilated_attention(group=...) (sequence_parallel._validate)
SP_NAMES = ("batch", "shard seqlen (N/P: N % P must be 0)", "nheads", "headdim", "nheads_kv", "dtype",
            "causal", "key_padding_mask given", "head_assignment", "branches (hash)",
            "softmax_scale (float64 bits)")  # fmt: skip
# packed documents over a group (sequence_parallel.dilated_attention_sp_varlen)
SP_VARLEN_NAMES = ("shard tokens (N/P)", "nheads", "headdim", "nheads_kv", "dtype", "causal",
                   "head_assignment", "branches (hash)", "softmax_scale (float64 bits)", "layout",
                   "documents", "cu_seqlens (hash)")  # fmt: skip
# ring_attention without cu_seqlens (ring._validate)
RING_NAMES = ("batch", "seqlen_q (shard)", "nheads", "headdim", "batch (k)", "seqlen_k (shard)",
              "nheads_kv", "headdim (k)", "dtype", "causal", "layout", "softmax_scale (float64 bits)")  # fmt: skip
# gather_sequence (layout.py): ndim, dtype, dim, layout and the first 12 sizes
GATHER_DIMS = 12
GATHER_NAMES = ("ndim", "dtype (checksum)", "dim", "layout", *(f"size {i}" for i in range(GATHER_DIMS)))


def _kind(names) -> int:
    return zlib.crc32("\x1f".join(names).encode())


# descriptor kind -> the call that sends it, for the error when ranks made different calls
_KINDS = {
    _kind(SP_NAMES): "dilated_attention(group=...) on (B, N/P, H, D) shards",
    _kind(SP_VARLEN_NAMES): "packed documents (dilated_attention_varlen(group=...) or ring_attention with cu_seqlens)",
    _kind(RING_NAMES): "ring_attention without cu_seqlens",
    _kind(GATHER_NAMES): "gather_sequence",
}


def float_bits(x: float) -> int:
    """The float64 bit pattern of ``x`` as an int64 (descriptors compare floats exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def validate_across_ranks(group, what: str, local_checks, describe, names: list[str],
                          like: torch.Tensor, enabled: bool = True) -> None:
    """Run this rank's ``local_checks()``, then compare input descriptors across ranks.

    With one rank (or ``enabled=False``) a local ``TypeError``/``ValueError`` is raised as it is
    and nothing is exchanged. Otherwise a local error is not raised at once: every rank takes
    part in one :func:`check_same_across_ranks` (``describe()`` gives this rank's descriptor, a
    list of ints named by ``names``), which raises the same error on every rank, so that no rank
    is left waiting in a later collective.
    """
    world, _ = world_and_rank(group)
    local_error = None
    try:
        local_checks()
    except (TypeError, ValueError) as e:
        if world == 1 or not enabled:
            raise
        local_error = str(e)
    if world == 1 or not enabled:
        return
    desc = [0] * len(names) if local_error else describe()
    check_same_across_ranks(group, desc, names, like, what, local_error)


def check_same_across_ranks(group, desc: list[int], names: list[str], like: torch.Tensor, what: str,
                            local_error: str | None = None) -> None:
    """All-gather ``desc`` (a few ints) and raise the same error on every rank if they differ.

    Cost: one all_gather of ``DESCRIPTOR_LEN + 2`` int64 per rank and one host synchronisation per
    call (tens of microseconds on NVLink; it also stalls the CPU until the GPU stream reaches it).
    ``local_error``: a validation error found on this rank only; it is raised on every rank
    (with the rank named) so that no rank is left waiting in a later collective.
    """
    world, rank = world_and_rank(group)
    if world == 1:
        if local_error:
            raise ValueError(local_error)
        return
    n = len(desc)
    if n != len(names) or n > DESCRIPTOR_LEN:
        raise ValueError(f"{what}: internal: a descriptor of {n} ints for {len(names)} names")
    dev = _comm_device(group, like)
    kind = _kind(names)
    t = torch.tensor([1 if local_error else 0, kind, *desc, *[0] * (DESCRIPTOR_LEN - n)],
                     dtype=torch.int64, device=dev)  # fmt: skip
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    rows = [p.tolist() for p in parts]
    bad = [r for r, row in enumerate(rows) if row[0]]
    if local_error:
        raise ValueError(f"{what}: on rank {rank}: {local_error}")
    kinds = [row[1] for row in rows]
    if any(kd != kind for kd in kinds):
        calls = {}
        for r, kd in enumerate(kinds):
            calls.setdefault(kd, []).append(r)
        said = "; ".join(f"rank(s) {rs}: {_KINDS.get(kd, 'another call')}" for kd, rs in calls.items())
        raise ValueError(
            f"{what}: the ranks made different calls ({said}); every rank must make the same call "
            "with shards of the same shape and options"
        )
    if bad:
        raise ValueError(f"{what}: invalid inputs on rank(s) {bad} (see the error raised there)")
    rows = [row[2 : 2 + n] for row in rows]
    first = rows[0]
    for r, row in enumerate(rows):
        if row != first:
            diffs = []
            for name, a, b in zip(names, first, row, strict=True):
                if a != b:
                    if name == "dtype":
                        a, b = _CODE_DTYPES.get(a, a), _CODE_DTYPES.get(b, b)
                    diffs.append(f"{name}: rank 0 has {a}, rank {r} has {b}")
            raise ValueError(
                f"{what}: inputs differ across ranks ({'; '.join(diffs)}); every rank must pass "
                "shards of the same shape, dtype and options"
            )


class BufferTracker:
    """Bytes of tracked tensors that are still alive (weak references), and their peak."""

    def __init__(self):
        self.live_bytes = 0
        self.peak_live_bytes = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.live_bytes += n
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        weakref.finalize(t, self._release, n)
        return t

    def _release(self, n: int) -> None:
        self.live_bytes -= n


class RingComm:
    """Send a tensor to the next rank and receive one from the previous rank, asynchronously.

    Usage::

        comm = RingComm(group)
        nxt = comm.send_recv(cur)   # queue isend(cur -> rank+1), irecv(nxt <- rank-1)
        comm.commit()               # launch the batch
        ...compute on cur...
        comm.wait()                 # nxt is now valid

    ``bytes_sent`` counts payload bytes; ``tracker`` (a :class:`BufferTracker`, shareable between
    two rings) counts the receive buffers allocated here that are still referenced anywhere.
    """

    def __init__(self, group, tracker: BufferTracker | None = None, tag: int = 0):
        self.group = group
        self.world, self.rank = world_and_rank(group)
        self.send_to = global_rank(group, (self.rank + 1) % self.world)
        self.recv_from = global_rank(group, (self.rank - 1) % self.world)
        self.tag = tag  # gloo matches messages by tag; NCCL ignores it (order is what matters)
        self.tracker = tracker if tracker is not None else BufferTracker()
        self._ops: list = []
        self._reqs: list | None = None
        self.bytes_sent = 0

    def send_recv(self, to_send: torch.Tensor, recv_buf: torch.Tensor | None = None) -> torch.Tensor:
        if not to_send.is_contiguous():
            raise ValueError("RingComm.send_recv needs a contiguous tensor")
        if recv_buf is None:
            recv_buf = self.tracker.track(torch.empty_like(to_send))
        # irecv before isend in the batch: the order NCCL batches are documented with
        self._ops.append(dist.P2POp(dist.irecv, recv_buf, self.recv_from, self.group, self.tag))
        self._ops.append(dist.P2POp(dist.isend, to_send, self.send_to, self.group, self.tag))
        self.bytes_sent += to_send.numel() * to_send.element_size()
        return recv_buf

    def exchange(self, to_send: torch.Tensor | None, dst: int | None,
                 recv_buf: torch.Tensor | None, src: int | None) -> None:
        """Queue a send of ``to_send`` to group rank ``dst`` and a receive into ``recv_buf`` from
        group rank ``src`` (either may be None), for any peers, in the next :meth:`commit` batch.

        The caller sizes ``recv_buf`` (the two sides of one transfer agree on its shape), and it
        is counted by the tracker like the buffers :meth:`send_recv` allocates.
        """
        if recv_buf is not None:
            self.tracker.track(recv_buf)
            peer = global_rank(self.group, src)
            self._ops.append(dist.P2POp(dist.irecv, recv_buf, peer, self.group, self.tag))
        if to_send is not None:
            if not to_send.is_contiguous():
                raise ValueError("RingComm.exchange needs a contiguous tensor")
            peer = global_rank(self.group, dst)
            self._ops.append(dist.P2POp(dist.isend, to_send, peer, self.group, self.tag))
            self.bytes_sent += to_send.numel() * to_send.element_size()

    def commit(self) -> None:
        if self._reqs is not None:
            raise RuntimeError("RingComm.commit called twice without wait")
        self._reqs = dist.batch_isend_irecv(self._ops) if self._ops else []

    def wait(self) -> None:
        if self._reqs is None:
            return
        for req in self._reqs:
            req.wait()
        # drop references to the sent / received tensors so that they can be freed
        self._reqs = None
        self._ops = []


class PeerExchange:
    """One round of batched point-to-point sends/receives of packed flat buffers, to and from any
    peers of a group (the sequence-parallel exchange; :class:`RingComm` is its ring-neighbour
    sibling). ``bytes_sent`` counts what :meth:`add` posted; the caller adds it to its own
    statistics."""

    def __init__(self, group, tag):
        self.group, self.tag = group, tag
        self.ops, self.reqs, self.bytes_sent = [], None, 0

    def add(self, send: dict, recv: dict):
        # one message per peer and direction; receives first (order kept the same on all ranks)
        for peer in sorted(recv):
            self.ops.append(dist.P2POp(dist.irecv, recv[peer], global_rank(self.group, peer),
                                       self.group, self.tag))
        for peer in sorted(send):
            buf = send[peer]
            self.ops.append(dist.P2POp(dist.isend, buf, global_rank(self.group, peer),
                                       self.group, self.tag))
            self.bytes_sent += buf.numel() * buf.element_size()
        if self.ops:
            self.reqs = dist.batch_isend_irecv(self.ops)

    def wait(self):
        for req in self.reqs or []:
            req.wait()
        self.ops, self.reqs = [], None
