"""Sequence-parallel execution over ``torch.distributed`` (docs/spec.md, "Sequence parallelism").

- :mod:`.layout`: which positions each rank holds ("contiguous", "zigzag"), pure tensor code;
- :mod:`.comm`: the ring of batched isend/irecv and cross-rank input checks;
- :mod:`.ring`: ring attention (dense attention, sequence-sharded);
- :mod:`.sequence_parallel`: dilated attention with ``group=`` (imported lazily by the API).
"""

from .layout import gather_sequence, shard_sequence
from .ring import ring_attention

__all__ = ["gather_sequence", "ring_attention", "shard_sequence"]
