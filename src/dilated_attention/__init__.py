"""dilated_attention: exact LongNet dilated attention and ring attention for PyTorch.

Layout (batch, seqlen, nheads, headdim) everywhere; LSE float32 (batch, nheads, seqlen).
See README.md and docs/spec.md for the exact definition.
"""

from .api import available_impls, dilated_attention
from .decode import dilated_attention_with_kvcache
from .distributed import gather_sequence, ring_attention, shard_sequence
from .modules import DilatedAttention, MultiheadDilatedAttention
from .ordering import hilbert_permutation
from .varlen import dilated_attention_varlen

__version__ = "0.1.0"

__all__ = [
    "DilatedAttention",
    "MultiheadDilatedAttention",
    "available_impls",
    "dilated_attention",
    "dilated_attention_varlen",
    "dilated_attention_with_kvcache",
    "hilbert_permutation",
    "gather_sequence",
    "ring_attention",
    "shard_sequence",
    "__version__",
]
