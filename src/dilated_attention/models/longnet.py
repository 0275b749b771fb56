"""LongNet models in one file: config, MAGNETO blocks, decoder LM with KV cache, LongViT encoder.

What this file owns (gpt-fast / nanoGPT style: read top to bottom):

- :class:`LongNetConfig`: a dataclass with named presets (``LongNetConfig.preset("tiny")``).
- :class:`Rotary`: rotary position embedding (RoPE) on (B, N, H, D) q/k, optionally xPos; its
  :class:`RotaryTable` (cos/sin of one forward's positions) is built once per forward and shared
  by every layer; in eager mode on CUDA the rotation is one fused Triton kernel
  (``kernels/triton_rotary.py``).
- :class:`AutocastLayerNorm`: ``nn.LayerNorm`` whose output, in eager mode under a bf16/fp16
  autocast on CUDA (``flags.set_triton_layernorm``; on by default from 32768 rows), is written
  in the autocast dtype by one Triton kernel (``kernels/triton_layernorm.py``), not in float32
  for each following Linear to cast; every LayerNorm of the models is one.
- :class:`Attention`: q/k/v/out projections + rotary + :class:`DilatedAttention` + MAGNETO
  sub-LayerNorm before the output projection. The sub-LN and gamma initialisation are the same
  as :class:`dilated_attention.MultiheadDilatedAttention`; this block exists because rotary must
  be applied between the projections and the attention, which that module does internally.
- :class:`FeedForward`: fc1 -> GELU -> sub-LayerNorm -> fc2 (MAGNETO).
- :class:`LongNetLM`: decoder-only causal LM, tied embeddings, activation checkpointing,
  KV-cache ``generate``.
- :class:`LongNetEncoder`: non-causal LongViT-style encoder over image patches.

The models contain no parallelism code. :func:`dilated_attention.models.parallelize.parallelize`
sets each attention module's ``process_group`` and the model's ``sp_group`` from outside; the
model then treats its input as this rank's contiguous shard of the sequence and offsets its
rotary positions by ``rank * N_local`` so that positions are global (docs/spec.md, "Sequence
parallelism").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..autograd_rules import _AUTOCAST_CASTS, autocast_dtype
from ..call_cache import _transforms_active
from ..decode import MAX_DECODE_ROWS
from ..flags import _layernorm as _LAYERNORM_SWITCH
from ..flags import fused_rotary_mode
from ..kernels import direct_launch
from ..kernels.select import backend_reason
from ..modules import DilatedAttention, magneto_init_
from .linear_ce import (
    linear_cross_entropy_sum,  # registers dilated_attention::linear_ce (compiled graphs)
)

# --------------------------------------------------------------------------------------- config


@dataclass
class LongNetConfig:
    """Hyper-parameters of a LongNet model. ``segment_lengths``/``dilation_rates``: one per branch."""

    vocab_size: int = 256
    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None = n_head; fewer gives GQA/MQA
    ffn_dim: int | None = None  # None = 4 * dim
    segment_lengths: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
    dilation_rates: tuple[int, ...] = (1, 2, 4, 6, 12)
    head_assignment: str = "all"
    max_seq_len: int = 32768  # a default for the data/KV cache; the model itself has no limit
    dropout: float = 0.0  # residual and FFN dropout
    attention_dropout: float = 0.0
    bias: bool = True
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    xpos: bool = False  # xPos (Sun et al. 2022) decay on top of rotary
    xpos_scale_base: float = 512.0
    tie_embeddings: bool = True
    gamma_init: float | None = None  # None = MAGNETO's sqrt(log(2 * n_layer))
    checkpoint_activations: bool = False
    # the LM loss with its gradients in one pass over the head (models/linear_ce.py; eager
    # training only; on since 2026-11-27, measured on an H100: benchmarks/profile_step.py).
    # False: the checkpointed chunks (no gradient work in forward; double backward allowed)
    fused_loss: bool = True
    impl: str = "auto"
    # encoder (LongViT) only
    image_size: tuple[int, int] = (224, 224)
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 0  # 0 = no head, forward returns features
    ordering: str | None = None  # "hilbert" reorders the patch grid before attention

    def __post_init__(self):
        # None-valued defaults (n_kv_head, ffn_dim, gamma_init) stay None and are resolved by the
        # properties below, so dataclasses.replace(cfg, n_layer=...) never keeps a stale value.
        self.segment_lengths = tuple(int(w) for w in self.segment_lengths)
        self.dilation_rates = tuple(int(r) for r in self.dilation_rates)
        if self.dim % self.n_head != 0:
            raise ValueError(f"dim ({self.dim}) must be a multiple of n_head ({self.n_head})")
        if (self.dim // self.n_head) % 2 != 0:
            raise ValueError(
                f"head_dim = dim / n_head = {self.dim // self.n_head} must be even for rotary"
            )
        if self.n_head % self.kv_heads != 0:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.kv_heads})"
            )
        # Note: max(dilation_rates) > n_head is allowed (docs/spec.md) but then, with
        # head_assignment "all", query rows whose offset has no head skip that branch; presets keep r <= n_head.

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.dim if self.ffn_dim is None else self.ffn_dim

    @property
    def gamma(self) -> float:
        """MAGNETO's init gain: sqrt(log(2 * n_layer)) for decoder-only/encoder-only models."""
        return math.sqrt(math.log(2 * self.n_layer)) if self.gamma_init is None else self.gamma_init

    @classmethod
    def preset(cls, name: str, **overrides) -> LongNetConfig:
        """A named configuration; keyword arguments override its fields."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(cls(**PRESETS[name]), **overrides)

    def with_attention(
        self, kind: str, seq_len: int, local_window: int | None = None
    ) -> LongNetConfig:
        """Same model size, other attention: ``"dilated"`` (unchanged), ``"dense"`` (one branch
        w >= seq_len, r = 1) or ``"local"`` (one branch of window ``local_window``, r = 1;
        default the smallest segment of this config)."""
        if kind == "dilated":
            return dataclasses.replace(self)
        if kind == "dense":
            return dataclasses.replace(
                self, segment_lengths=(max(seq_len, 1),), dilation_rates=(1,)
            )
        if kind == "local":
            w = local_window or min(self.segment_lengths)
            return dataclasses.replace(self, segment_lengths=(w,), dilation_rates=(1,))
        raise ValueError(f"attention kind must be 'dilated', 'dense' or 'local', got {kind!r}")


PRESETS: dict[str, dict] = {
    # CPU, a fraction of a second per step: 4 heads so that every offset of r <= 4 has a head.
    "tiny": dict(
        vocab_size=128,
        dim=64,
        n_layer=3,
        n_head=4,
        ffn_dim=128,
        segment_lengths=(32, 128, 256),
        dilation_rates=(1, 2, 4),
        max_seq_len=256,
    ),
    # one GPU, quick: 32K tokens.
    "small": dict(
        vocab_size=256,
        dim=384,
        n_layer=6,
        n_head=6,
        ffn_dim=1536,
        segment_lengths=(1024, 4096, 16384, 32768),
        dilation_rates=(1, 2, 4, 6),
        max_seq_len=32768,
    ),
    # the paper's LongNet base: 768 hidden, 12 heads, 12 layers.
    "base": dict(
        vocab_size=50304,
        dim=768,
        n_layer=12,
        n_head=12,
        ffn_dim=3072,
        segment_lengths=(2048, 4096, 8192, 16384, 32768),
        dilation_rates=(1, 2, 4, 6, 12),
        max_seq_len=32768,
    ),
    # LongViT-style encoder on a 1024x1024 image with 16x16 patches (4096 tokens).
    "vit-tiny": dict(
        dim=128,
        n_layer=4,
        n_head=4,
        ffn_dim=256,
        image_size=(128, 128),
        patch_size=8,
        segment_lengths=(64, 256),
        dilation_rates=(1, 2),
        num_classes=10,
    ),
    "vit-base": dict(
        dim=768,
        n_layer=12,
        n_head=12,
        ffn_dim=3072,
        image_size=(1024, 1024),
        patch_size=16,
        segment_lengths=(256, 1024, 4096),
        dilation_rates=(1, 2, 4),
        num_classes=1000,
    ),
}


# --------------------------------------------------------------------------------------- rotary


class RotaryTable(NamedTuple):
    """The rotation of one set of positions: cos, sin (1, N, 1, D) for q and for k, float32
    (float64 for float64 inputs), each the concatenation of two equal halves.

    Built once per forward by :meth:`Rotary.table` and shared by every layer (the positions are
    the same in every layer). Without xPos the k tables are the q tables (the same tensors).
    ``pos`` (N,) int64: the positions it was built for (None when q and k had different ones).
    """

    pos: torch.Tensor | None
    cos_q: torch.Tensor
    sin_q: torch.Tensor
    cos_k: torch.Tensor
    sin_k: torch.Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype rotary computes in for inputs of ``dtype``: float32, or float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_ROTARY_FUSED = []  # kernels.triton_rotary's rotary_fused, rotary_into_cache, once imported (an import per call costs ~1 us)


def _rotary_fused():
    # imported at the first fused call, not with the package (triton.jit picks the interpreter
    # or the compiler when the kernel is defined, and tests set TRITON_INTERPRET late)
    if not _ROTARY_FUSED:
        from ..kernels.triton_rotary import rotary_fused, rotary_into_cache

        _ROTARY_FUSED.extend((rotary_fused, rotary_into_cache))
    return _ROTARY_FUSED[0]


def _rotary_into_cache():
    if not _ROTARY_FUSED:
        _rotary_fused()
    return _ROTARY_FUSED[1]


def _constant_for_dynamo(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing Dynamo with this module (the
    public decorator imports ``torch._dynamo``: over a second of import time, issue 23 item 8): the
    mark that decorator sets, which Dynamo reads when it meets a call of ``fn`` while tracing (it
    then calls ``fn`` and puts the result in the graph as a constant).
    tests/test_compile_kernels.py checks that the public decorator still sets this mark."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_for_dynamo
def _compiled_kernel(kind: str, device_type: str, dtype: torch.dtype, size: int) -> str:
    """The eager rule's answer while ``torch.compile`` traces, for the library's Triton kernel
    ``kind`` ("rotary" or "layernorm") and tensors of ``device_type`` and ``dtype`` (``size``: the
    head dim or the normalized dim): "" where the kernel does not run, else its switch in
    ``flags`` ("on", or "auto" on CUDA: the caller applies the auto rule's size bounds) where the
    backend can run (``select.backend_reason``). Called by Dynamo outside the trace, its answer
    kept by the graph (a switch flipped after a compile applies to graphs compiled after
    ``torch._dynamo.reset()``). It imports the kernel's module (the lazy caches below), which
    registers the custom op that the module's entry point calls under ``torch.compile``."""
    from .. import flags

    mode = {"rotary": fused_rotary_mode, "layernorm": flags.triton_layernorm_mode}[kind]()
    if mode == "off" or (mode == "auto" and device_type != "cuda"):
        return ""
    backend = {"rotary": "triton_rotary", "layernorm": "triton_layernorm"}[kind]
    if backend_reason(backend, device_type, dtype, size) is not None:
        return ""
    (_rotary_fused if kind == "rotary" else _ln_triton)()
    return mode


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half form) on (B, N, H, D), with optional xPos decay.

    Positions are absolute (global) positions, passed by the caller, so a KV cache or a
    sequence-parallel shard gets the same rotation as the full sequence would.
    xPos multiplies q by zeta^(p / scale_base) and k by zeta^(-p / scale_base); the product
    decays with the distance i - j. It is not centred (centring would make a cached key depend
    on the final length), so very long sequences in low precision can under/overflow: keep
    ``xpos=False`` beyond a few thousand tokens or compute in float32.

    Two steps, so that a model computes its tables once per forward: :meth:`table` (positions ->
    :class:`RotaryTable`) and :meth:`rotate` (q, k, table -> rotated q, k). :meth:`forward` does
    both. :meth:`rotate` runs the fused Triton kernel (``kernels/triton_rotary.py``: one pass
    over q and k, forward and backward) on CUDA, in eager mode through its autograd Function and
    under ``torch.compile`` as the custom op ``dilated_attention::rotary``; the torch code
    (:meth:`_rotate_with`) with xPos, for float64 and where the kernel cannot run;
    ``flags.set_fused_rotary`` switches the kernel off (or on in Triton's interpreter, for tests).
    """

    def __init__(
        self, head_dim: int, base: float = 10000.0, xpos: bool = False, scale_base: float = 512.0
    ):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (D/2,)
        self.xpos = xpos
        self.scale_base = scale_base
        zeta = (torch.arange(0, head_dim, 2, dtype=torch.float64) + 0.4 * head_dim) / (
            1.4 * head_dim
        )
        self.register_buffer("zeta", zeta, persistent=False)  # (D/2,)

    def forward(self, q: torch.Tensor, k: torch.Tensor, pos_q: torch.Tensor, pos_k: torch.Tensor):
        """q (B, Nq, H, D), k (B, Nk, Hkv, D), pos_* (N,) int64 -> rotated q, k (same dtypes)."""
        if pos_k is pos_q:
            return self.rotate(q, k, self.table(pos_q, q.dtype))
        tq, tk = self.table(pos_q, q.dtype), self.table(pos_k, k.dtype)
        return self.rotate(q, k, RotaryTable(None, tq.cos_q, tq.sin_q, tk.cos_k, tk.sin_k))

    def table(self, pos: torch.Tensor, dtype: torch.dtype) -> RotaryTable:
        """The :class:`RotaryTable` of positions pos (N,) for q/k of ``dtype``."""
        cos, sin = self._table(pos, +1, dtype)
        if not self.xpos:  # one table serves both
            return RotaryTable(pos, cos, sin, cos, sin)
        return RotaryTable(pos, cos, sin, *self._table(pos, -1, dtype))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, table: RotaryTable):
        """q (B, N, H, D), k (B, N, Hkv, D) rotated by ``table`` -> q, k (same dtypes)."""
        if self._fused_applies(q, k, table):
            return _rotary_fused()(q, k, table.cos_q, table.sin_q, table.cos_k, table.sin_k)
        return (self._rotate_with(q, table.cos_q, table.sin_q),
                self._rotate_with(k, table.cos_k, table.sin_k))  # fmt: skip

    def rotate_into_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: RotaryTable,
        cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """A decode step's :meth:`rotate` and KV-cache write: q rotated (returned); k rotated and
        v written to ``cache_k`` / ``cache_v`` (B, capacity, Hkv, D) at the rows ``slots`` (T,).
        Where the fused kernel applies and nothing needs a gradient, one launch
        (``triton_rotary.rotary_into_cache``: the same bits as rotating and then copying; eager
        only, it has no custom op); else :meth:`rotate` then two ``index_copy_``."""
        if (
            not torch.compiler.is_compiling()
            and v.dtype == k.dtype and cache_k.dtype == k.dtype and cache_v.dtype == k.dtype
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and self._fused_applies(q, k, table)
        ):  # fmt: skip
            return _rotary_into_cache()(
                q, k, v, table.cos_q, table.sin_q, table.cos_k, table.sin_k, cache_k, cache_v, slots
            )
        q, k = self.rotate(q, k, table)
        cache_k.index_copy_(1, slots, k)
        cache_v.index_copy_(1, slots, v)
        return q

    def _fused_applies(self, q: torch.Tensor, k: torch.Tensor, table: RotaryTable) -> bool:
        """Whether the fused kernel rotates q and k (eager: its Function; under ``torch.compile``:
        its custom op, the switch and backend asked outside the trace by ``_compiled_kernel``)."""
        if self.xpos or k.dtype != q.dtype or table.cos_q.dtype != torch.float32:
            return False  # xPos, mixed dtypes, or float64 (float64 tables): the torch code
        if torch.compiler.is_compiling():
            return bool(_compiled_kernel("rotary", q.device.type, q.dtype, q.shape[-1]))
        mode = fused_rotary_mode()
        if mode == "off" or (mode == "auto" and not q.is_cuda):
            return False
        return backend_reason("triton_rotary", q.device.type, q.dtype, q.shape[-1]) is None

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor, sign: int) -> torch.Tensor:
        return self._rotate_with(x, *self._table(pos, sign, x.dtype))

    def _table(self, pos: torch.Tensor, sign: int, dtype: torch.dtype):
        """cos, sin (1, N, 1, D) for positions pos (N,) in the compute dtype of ``dtype``."""
        # Angles in float64 then cast: positions up to millions keep full precision.
        ang = pos.to(self.inv_freq.dtype)[:, None] * self.inv_freq  # (N, D/2)
        cos, sin = ang.cos(), ang.sin()
        if self.xpos:
            scale = self.zeta ** (
                sign * pos.to(self.zeta.dtype)[:, None] / self.scale_base
            )  # (N, D/2)
            cos, sin = cos * scale, sin * scale
        dt = _compute_dtype(dtype)
        cos = torch.cat([cos, cos], -1).to(dt)[None, :, None, :]  # (1, N, 1, D)
        sin = torch.cat([sin, sin], -1).to(dt)[None, :, None, :]
        return cos, sin

    @staticmethod
    def _rotate_with(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.to(cos.dtype)
        x1, x2 = xf.chunk(2, dim=-1)
        rot = torch.cat([-x2, x1], dim=-1)
        return (xf * cos + rot * sin).to(x.dtype)


# ------------------------------------------------------------------------------------ layernorm

_LN_TRITON = []  # kernels.triton_layernorm.layer_norm, once imported (as _ROTARY_FUSED)
_PRO_LN = []  # the kernels.triton_layernorm module, once imported (decode steps' fused norms)
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# "auto" runs the kernel from this many rows (tokens x batch) up: below it (decode steps, short
# calls) its launches cost more host time than the casts save. H100, a block's pre-LN and its
# q/k/v Linears, back-to-back eager calls (benchmarks/results/layernorm_rows_h100_2026-11-27_s15.md):
# forward + backward 1.23-1.51x slower than nn.LayerNorm at every size from 1 to 8192 rows,
# even (1.01x) at 32768; the LongNet base step at 32768 rows (8K x 4, 16K x 2) 118 / 130 ms with
# it against 158 / 163 without (profile_step_h100_2026-11-27_s14.md). 8193-32767 rows: not
# measured. "on" runs it at any size
LAYERNORM_AUTO_MIN_ROWS = 32768
# The decode step's one q/k/v GEMM (Attention._decode_qkv) for layers whose three weights take at
# most this many bytes: there the GEMMs are launch-bound (the ``small`` preset's 0.9 MiB, ``base``'s
# 3.4 MiB); above it they are bandwidth-bound, one GEMM saves little, and the concatenated copy
# (kept while the KV cache lives) would cost as much memory again as the weights
FUSED_QKV_MAX_BYTES = 8 * 2**20


def _plain(module: nn.Module, cls: type) -> bool:
    """``module`` is exactly ``cls`` (not a subclass or a wrapper) with no forward hooks: a decode
    fusion that computes its forward from its parameters computes what calling it would."""
    return type(module) is cls and not (module._forward_hooks or module._forward_pre_hooks)


def _ln_args(norm: nn.Module) -> tuple | None:
    """(weight, bias, eps) of a plain ``AutocastLayerNorm`` with a weight and one normalized
    dim and no hooks (what a decode step's fused LayerNorm computes from), else None."""
    if not _plain(norm, AutocastLayerNorm) or len(norm.normalized_shape) != 1:
        return None
    p = norm._parameters
    w = p["weight"]
    return None if w is None else (w, p["bias"], norm.eps)


def _global_hooks() -> bool:
    """Whether module forward hooks are registered for every module
    (``nn.modules.module.register_module_forward_hook`` and its pre-hook)."""
    from torch.nn.modules import module as _m

    return bool(_m._global_forward_hooks or _m._global_forward_pre_hooks)


def _ln_triton():
    if not _LN_TRITON:
        from ..kernels.triton_layernorm import layer_norm

        _LN_TRITON.append(layer_norm)
    return _LN_TRITON[0]


class AutocastLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, same state_dict) whose output, under a bf16/fp16
    autocast on CUDA (``flags.triton_layernorm_mode()`` ``"auto"``, the default, for inputs of
    at least ``LAYERNORM_AUTO_MIN_ROWS`` rows; ``"on"``: any size, Triton's interpreter on the
    CPU included), is written in the autocast dtype by the Triton kernels of
    ``kernels/triton_layernorm.py`` (the input read in its own dtype, float32 math; the same
    values as autocast's float32 ``layer_norm`` rounded by the Linear after it, up to summation
    order), instead of a float32 output that each following Linear casts.

    Under ``torch.compile`` the same rule picks the same kernels, called as the custom ops
    ``dilated_attention::layer_norm`` / ``::layer_norm_backward``. Everywhere else (the switch
    ``"off"``; no such autocast on the input's device; where the kernel cannot run) it is
    ``nn.LayerNorm`` itself. ``autocast_output = False`` keeps it so always (the
    encoder's final LayerNorm, whose output is the model's output: its dtype stays autocast's).
    """

    autocast_output = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the switch's slot read here, not through flags.triton_layernorm_mode(): no extra call
        # per LayerNorm (decode steps call four per layer)
        if torch.compiler.is_compiling():  # the switch and the backend, asked outside the trace
            mode = _compiled_kernel("layernorm", x.device.type, x.dtype, x.shape[-1])
        else:
            mode = _LAYERNORM_SWITCH.value or _LAYERNORM_SWITCH.load()
        if mode == "on" or (mode == "auto" and x.is_cuda and x.numel() >= LAYERNORM_AUTO_MIN_ROWS * x.shape[-1]):
            dtype = self._kernel_dtype(x)
            if dtype is not None:
                return _ln_triton()(x, self.weight, self.bias, self.eps, dtype)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def _kernel_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The autocast dtype the kernel writes for ``x``, or None (nn.LayerNorm runs)."""
        if not self.autocast_output or self.weight is None:
            return None
        dev = x.device.type
        if not torch.is_autocast_enabled(dev):
            return None
        dtype = torch.get_autocast_dtype(dev)
        if dtype not in _LOW_PRECISION or len(self.normalized_shape) != 1:
            return None
        if not torch.compiler.is_compiling() and backend_reason("triton_layernorm", dev, x.dtype, x.shape[-1]) is not None:
            return None  # float64 (autocast leaves it alone), no triton, not CUDA, N too large
        return dtype  # (under torch.compile, forward's _compiled_kernel asked the backend)


# --------------------------------------------------------------------------------------- blocks


class KVCache(nn.Module):
    """Preallocated keys/values of one layer: (B, capacity, Hkv, D) each (gpt-fast style).

    Position p lives in slot ``p % capacity``: a capacity at least the sequence length is the
    plain cache; a smaller one is a rolling cache (see :meth:`LongNetLM.generate`). Writes take
    device positions, so a decode step writes without host synchronisation (CUDA-graph safe).
    """

    def __init__(self, batch: int, capacity: int, n_kv_head: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, capacity, n_kv_head, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # the layer's q/k/v weights concatenated for the decode step's one GEMM
        # (Attention._decode_qkv): (key, weight, bias), made at the first decode step, dropped
        # with the cache
        self.qkv: tuple | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def write(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v (B, T, Hkv, D) of positions ``pos`` (T,) int64 into their slots."""
        self.write_slots(pos % self.capacity, k, v)

    def write_slots(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """:meth:`write` with the slots ``pos % capacity`` (T,) int64 already computed. (A decode
        step does not come here: its slots come from ``DecodeIndex``, once for every layer of
        one capacity, and ``Rotary.rotate_into_cache`` writes the rows.)"""
        self.k.index_copy_(1, slots, k)
        self.v.index_copy_(1, slots, v)

    def window(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions [start, end) in position order: (B, end - start, Hkv, D).

        A view when the positions are contiguous in the buffer, else one gathered copy.
        """
        cap = self.capacity
        if end - start > cap:
            raise ValueError(
                f"KV cache of capacity {cap} cannot hold positions [{start}, {end}); "
                "setup_cache with a larger capacity"
            )
        s0 = start % cap
        if s0 + (end - start) <= cap:
            return self.k[:, s0 : s0 + end - start], self.v[:, s0 : s0 + end - start]
        slots = torch.arange(start, end, device=self.k.device) % cap
        return self.k.index_select(1, slots), self.v.index_select(1, slots)


class Attention(nn.Module):
    """Pre-projected multi-head dilated attention with rotary and MAGNETO sub-LN.

    Same parameterisation as :class:`MultiheadDilatedAttention` (q/k gain 1, v/out gain gamma,
    xavier_normal_, zero biases, LayerNorm before ``out_proj``), plus rotary on q/k.
    """

    def __init__(self, cfg: LongNetConfig, causal: bool, grid: tuple[int, int] | None = None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.causal = causal
        self.gamma_init = cfg.gamma
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.dim, kv_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.dim, kv_dim, bias=cfg.bias)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_base, cfg.xpos, cfg.xpos_scale_base)
        self.attention = DilatedAttention(
            cfg.segment_lengths, cfg.dilation_rates, attention_dropout=cfg.attention_dropout,
            head_assignment=cfg.head_assignment, impl=cfg.impl,
            ordering=cfg.ordering if grid is not None else None, grid=grid,
        )  # fmt: skip
        self.norm = AutocastLayerNorm(cfg.dim, eps=cfg.norm_eps)  # MAGNETO sub-LN
        self.out_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.kv_cache: KVCache | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        magneto_init_(self.q_proj, self.k_proj, self.v_proj, self.out_proj, self.gamma_init)
        self.norm.reset_parameters()

    def forward(
        self, x: torch.Tensor, start_pos: int | torch.Tensor, packed=None, rope: RotaryTable | None = None,
        step: DecodeIndex | None = None,
    ) -> torch.Tensor:
        """x (B, T, E) holding positions [start_pos, start_pos + T) -> (B, T, E).

        ``step``: the :class:`DecodeIndex` of a decode step (the cache slots and lengths of
        ``rope.pos``, which the model computes once per step for all its layers); None: computed
        here.

        ``rope``: the :class:`RotaryTable` of these positions (:func:`rotary_positions`), which
        the model computes once per forward for all its layers; None: computed here.

        ``packed``: ``(pos (T,), cu_seqlens, max_seqlen)`` for one packed row (B = 1) of
        documents: rotary takes the per-document positions ``pos`` and each document attends
        only to itself (``start_pos`` unused; no KV cache).

        Without a KV cache ``start_pos`` (an int) is only the rotary offset (nonzero for a
        sequence-parallel shard). With one, the new keys/values are written to the cache and
        the queries attend the cached positions (bottom-right alignment):
        - ``start_pos`` an int (prefill): through :func:`dilated_attention` over the cache window
          that starts at :meth:`align_start` (a multiple of every segment length, so segments
          keep their absolute alignment);
        - ``start_pos`` a 0-dim int64 device tensor (decode, T <= 64): through
          :func:`dilated_attention_with_kvcache` on the whole cache buffer, with no host
          synchronisation (the step can be captured in a CUDA graph).
        """
        b, t, e = x.shape
        cache = self.kv_cache
        decode = cache is not None and packed is None and isinstance(start_pos, torch.Tensor)
        qkv = self._decode_qkv(x, cache) if decode else None
        if qkv is not None:
            q, k, v = qkv
        else:
            q = self.q_proj(x)
            k = self.k_proj(x)
            v = self.v_proj(x)
        q = q.view(b, t, self.n_head, self.head_dim)  # (B, T, H, D)
        k = k.view(b, t, self.n_kv_head, self.head_dim)  # (B, T, Hkv, D)
        v = v.view(b, t, self.n_kv_head, self.head_dim)  # (B, T, Hkv, D)
        if rope is None or rope.cos_q.dtype != _compute_dtype(q.dtype):
            rope = self.rotary.table(rotary_positions(start_pos, t, x.device, packed), q.dtype)
        if decode:
            # decode: the rotation writes k and v into their cache slots itself
            if step is None or step.pos is not rope.pos:
                step = DecodeIndex(rope.pos)
            q = self.rotary.rotate_into_cache(q, k, v, rope, cache.k, cache.v, step.slots(cache.capacity))
            y = self.attention.decode(q, cache.k, cache.v, step.seqlens(b), is_causal=self.causal)
            return self.out_proj(self.norm(y.reshape(b, t, e)))
        q, k = self.rotary.rotate(q, k, rope)
        if packed is not None:
            if self.kv_cache is not None:
                raise ValueError("packed documents (cu_seqlens) cannot be written to a KV cache")
            _, cu, mx = packed
            y = self.attention(q, k, v, is_causal=self.causal, cu_seqlens=cu, max_seqlen=mx)
            return self.out_proj(self.norm(y.reshape(b, t, e)))
        if cache is None:
            y = self.attention(q, k, v, is_causal=self.causal)  # (B, T, H, D)
        else:
            cache.write(rope.pos, k, v)
            kw, vw = cache.window(self.align_start(start_pos), start_pos + t)
            y = self.attention(q, kw, vw, is_causal=self.causal)  # (B, T, H, D)
        y = self.norm(y.reshape(b, t, e))
        return self.out_proj(y)

    def _decode_qkv(self, x: torch.Tensor, cache: KVCache):
        """q (B, T, E), k and v (B, T, Hkv * D) of a decode step from one GEMM over the three
        projections' weights concatenated (views of its output), or None where that does not
        apply: a gradient recorded, ``torch.compile`` (Inductor fuses on its own), a projection
        that is not a plain ``nn.Linear`` without hooks (an adapter that wraps one, or a hook,
        keeps its own forward), biases on some projections only, or weights of more than
        ``FUSED_QKV_MAX_BYTES`` (there the GEMMs are bandwidth-bound; in the ``small`` preset's
        decode step 18 of 112 kernels were these launch-bound GEMMs).

        The concatenation is kept on the layer's KV cache and made again when a weight or bias
        changes (another tensor, storage or in-place version: an optimiser step,
        ``load_state_dict``, ``.to()``, ``copy_`` under ``no_grad``). An in-place edit through
        ``.data`` bumps no version and cannot be seen without reading the weights: a decode loop
        that edits weights that way between steps of one cache calls ``setup_cache`` again
        (``generate`` makes its cache per call). Weights that are inference tensors (made under
        ``torch.inference_mode``) have no version to key on and keep the three GEMMs. The values
        equal the three GEMMs' up to the GEMM's summation order (cuBLAS may pick another kernel
        for the wider output); every decode step (eager, CUDA graph) takes this path, so they
        agree with each other bit for bit."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        m = self._modules  # dict lookups: nn.Module.__getattr__ costs ~20 calls a layer here
        lq, lk, lv = m["q_proj"], m["k_proj"], m["v_proj"]
        if not (_plain(lq, nn.Linear) and _plain(lk, nn.Linear) and _plain(lv, nn.Linear)):
            return None
        pq, pk, pv = lq._parameters, lk._parameters, lv._parameters
        wq, wk, wv, bq, bk, bv = pq["weight"], pk["weight"], pv["weight"], pq["bias"], pk["bias"], pv["bias"]
        try:
            key = (wq._version, wk._version, wv._version, wq.data_ptr(), wk.data_ptr(), wv.data_ptr())
            if bq is not None and bk is not None and bv is not None:
                key += (bq._version, bk._version, bv._version, bq.data_ptr(), bk.data_ptr(), bv.data_ptr())
        except RuntimeError:  # inference tensors (a model made under torch.inference_mode) have no
            return None  # version counter: an in-place edit could not be seen, so no cached copy
        got = cache.qkv  # (key, weight or None (not fused), bias, the six tensors, sizes)
        if got is not None:
            t = got[3]
            if not (t[0] is wq and t[1] is wk and t[2] is wv and t[3] is bq and t[4] is bk and t[5] is bv
                    and got[0] == key):  # fmt: skip
                got = None
        if got is None:
            nq, nk = wq.shape[0], wk.shape[0]
            nbytes = (nq + nk + wv.shape[0]) * wq.shape[1] * wq.element_size()
            mixed = (bq is None) != (bk is None) or (bq is None) != (bv is None)
            if mixed or nbytes > FUSED_QKV_MAX_BYTES:
                w = bias = None
            else:
                w = torch.cat((wq, wk, wv))
                bias = None if bq is None else torch.cat((bq, bk, bv))
            got = cache.qkv = (key, w, bias, (wq, wk, wv, bq, bk, bv), (nq, nk))
        if got[1] is None:
            return None
        y = F.linear(x, got[1], got[2])  # (B, T, E + 2 Hkv D)
        e, kvd = got[4]
        return y[..., :e], y[..., e : e + kvd], y[..., e + kvd :]

    def align_start(self, start_pos: int) -> int:
        """First key position a chunk starting at ``start_pos`` needs, rounded down to a multiple
        of every segment length: a branch never reads a key before its own segment start."""
        period = self.attention.period
        return start_pos // period * period


class DecodeIndex:
    """What every layer of one decode step derives from the step's positions ``pos`` (T,) int64,
    computed once per step (:meth:`_Trunk.run_layers`) instead of once per layer: the cache slots
    ``pos % capacity`` (per capacity) and the cache lengths ``pos[-1] + 1`` as the int32 (B,)
    tensor that :func:`dilated_attention_with_kvcache` takes. The same ops as the per-layer code,
    so the same values, with no host synchronisation."""

    __slots__ = ("pos", "_slots", "_seqlens")

    def __init__(self, pos: torch.Tensor):
        self.pos = pos
        self._slots: dict[int, torch.Tensor] = {}
        self._seqlens: dict[int, torch.Tensor] = {}

    def slots(self, capacity: int) -> torch.Tensor:
        s = self._slots.get(capacity)
        if s is None:
            s = self._slots[capacity] = self.pos % capacity  # (T,)
        return s

    def seqlens(self, batch: int) -> torch.Tensor:
        s = self._seqlens.get(batch)
        if s is None:
            s = self._seqlens[batch] = (self.pos[-1:] + 1).to(torch.int32).expand(batch).contiguous()  # (B,)
        return s


def rotary_positions(start_pos: int | torch.Tensor, t: int, device, packed=None) -> torch.Tensor:
    """The rotary positions (T,) int64 of T tokens starting at ``start_pos``: an int (prefill,
    training; ``arange``), a 0-dim device tensor (decode: no host synchronisation), or, with
    ``packed = (pos, cu_seqlens, max_seqlen)``, the per-document positions ``pos``."""
    if packed is not None:
        return packed[0]
    if isinstance(start_pos, torch.Tensor):
        if t == 1 and start_pos.dim() == 0 and not start_pos.dtype.is_floating_point:
            # one decode token: start_pos + arange(1) is start_pos itself (no arange, no add)
            return start_pos.reshape(1).to(torch.int64)
        return start_pos + torch.arange(t, device=device)
    return torch.arange(start_pos, start_pos + t, device=device)


class FeedForward(nn.Module):
    """MAGNETO FFN: fc1 -> GELU -> sub-LayerNorm -> fc2, fc1/fc2 xavier_normal_ with gain gamma."""

    def __init__(self, cfg: LongNetConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=cfg.bias)
        self.norm = AutocastLayerNorm(cfg.ffn_hidden, eps=cfg.norm_eps)
        self.fc2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        for lin in (self.fc1, self.fc2):
            nn.init.xavier_normal_(lin.weight, gain=cfg.gamma)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if self.training:  # eval: dropout is the identity (the same tensor back)
            h = self.dropout(h)
        return self.fc2(self.norm(h))


class Block(nn.Module):
    """Pre-LN residual block: x + attn(LN(x)), then x + ffn(LN(x))."""

    def __init__(self, cfg: LongNetConfig, causal: bool, grid: tuple[int, int] | None = None):
        super().__init__()
        self.attn_norm = AutocastLayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg, causal, grid)
        self.ffn_norm = AutocastLayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, start_pos: int | torch.Tensor, packed=None, rope: RotaryTable | None = None,
        step: DecodeIndex | None = None,
    ) -> torch.Tensor:
        if self.training:
            x = x + self.dropout(self.attn(self.attn_norm(x), start_pos, packed, rope, step))
            return x + self.dropout(self.ffn(self.ffn_norm(x)))
        # eval: dropout is the identity (the same tensor back); no module call for it
        x = x + self.attn(self.attn_norm(x), start_pos, packed, rope, step)
        return x + self.ffn(self.ffn_norm(x))


class _Trunk(nn.Module):
    """Blocks + final LayerNorm + the sequence-parallel position offset, shared by both models."""

    def __init__(self, cfg: LongNetConfig, causal: bool, grid: tuple[int, int] | None = None):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg, causal, grid) for _ in range(cfg.n_layer))
        self.norm = AutocastLayerNorm(cfg.dim, eps=cfg.norm_eps)
        # Set by parallelize(): the sequence-parallel group; the input is then this rank's shard.
        self.sp_group = None

    def position_offset(self, local_len: int) -> int:
        """Global position of this rank's first token: rank * N_local (contiguous layout)."""
        if self.sp_group is None:
            return 0
        import torch.distributed as dist

        return dist.get_rank(self.sp_group) * local_len

    def run_layers(self, x: torch.Tensor, start_pos: int | torch.Tensor, packed=None) -> torch.Tensor:
        """``packed``: see :meth:`Attention.forward` (one packed row of documents)."""
        rope = step = None
        if len(self.layers):
            # one rotary table for every layer: the positions are the same in each (the layers'
            # Rotary modules are equal: same head dim, base and xPos); x's dtype decides the
            # compute dtype as q's does (autocast leaves float64 alone)
            pos = rotary_positions(start_pos, x.shape[1], x.device, packed)  # (T,)
            rope = self.layers[0].attn.rotary.table(pos, x.dtype)
            if packed is None and isinstance(start_pos, torch.Tensor):
                step = DecodeIndex(pos)  # a decode step: cache slots and lengths once for all layers
        plan = self._decode_norms_plan(x) if step is not None and not self.training else None
        if plan is not None:
            return self._decode_layers(x, start_pos, rope, step, plan)
        if self.cfg.checkpoint_activations and self.training and torch.is_grad_enabled():
            for layer in self.layers:
                x = checkpoint(layer, x, start_pos, packed, rope, step, use_reentrant=False)
        else:
            for layer in self.layers:
                x = layer(x, start_pos, packed, rope, step)
        return self.norm(x)

    def _decode_norms_plan(self, x: torch.Tensor) -> list | None:
        """What :meth:`_decode_layers` runs (per layer: the attention module, the LayerNorm
        arguments after it, fc1, the FFN's sub-LayerNorm, fc2, the next LayerNorm; first the
        first pre-LN's), or None where it does not apply: a gradient recorded, autocast,
        ``torch.compile``, the LayerNorm switch ``"off"`` (or ``"auto"`` off CUDA; ``"on"`` takes
        Triton's interpreter on the CPU), the kernel unable to run at either width, or a block,
        FFN or LayerNorm that is not the model's own class or has forward hooks (on it, or
        global), or a block or FFN in training mode (its dropout): a subclass, a wrapper, a hook
        or a module left training keeps the blocks' forward. Built from the modules' dicts each
        step (no ``nn.Module.__getattr__``)."""
        mode = _LAYERNORM_SWITCH.value or _LAYERNORM_SWITCH.load()
        if mode == "off" or (mode == "auto" and not x.is_cuda):
            return None
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
            return None
        if _global_hooks():
            return None
        dev = x.device.type
        if (
            backend_reason("triton_layernorm", dev, x.dtype, x.shape[-1]) is not None
            or backend_reason("triton_layernorm", dev, x.dtype, self.cfg.ffn_hidden) is not None
        ):
            return None
        final = _ln_args(self._modules["norm"])
        if final is None:
            return None
        plan, prev = [], None
        for layer in self.layers:  # _decode_layers bypasses these modules' forward
            if not _plain(layer, Block) or layer.training:  # a block or FFN left in training
                return None  # mode (model.eval(), then layers[i].train()) applies its dropout
            m = layer._modules
            f = m["ffn"]
            if not _plain(f, FeedForward) or f.training:
                return None
            fm = f._modules
            pre, mid, sub = _ln_args(m["attn_norm"]), _ln_args(m["ffn_norm"]), _ln_args(fm["norm"])
            if pre is None or mid is None or sub is None:
                return None
            if prev is None:
                plan.append(pre)  # the first pre-LN, then each layer's entry
            else:
                prev.append(pre)  # the previous layer's last LayerNorm is this one's pre-LN
            prev = [m["attn"], mid, fm["fc1"], sub, fm["fc2"]]
            plan.append(prev)
        prev.append(final)
        return plan

    def _decode_layers(self, x: torch.Tensor, start_pos: torch.Tensor, rope, step, plan: list) -> torch.Tensor:
        """The layers of a decode step (eval, no gradients; ``plan`` from
        :meth:`_decode_norms_plan`) with each residual add fused into the LayerNorm after it and
        the FFN's GELU into its sub-LayerNorm (``triton_layernorm`` ``_prologue_ln_kernel``): 3
        launches fewer per layer (18 of the ``small`` preset's 100 per step). The same
        computation as the blocks' forward (the adds' bits; each LayerNorm to the order of its
        float32 sums, the GELU to an ulp of float32's erf before its rounding). The attention
        modules and the FFNs' Linears are called as modules; the blocks', FFNs' and norms'
        ``forward`` are not, which the plan allows only where they are the model's own classes
        without hooks."""
        if not _PRO_LN:
            from ..kernels import triton_layernorm

            _PRO_LN.append(triton_layernorm)
        pro = _PRO_LN[0]._prologue_ln  # the unchecked entry: the tensors here are the model's own
        w, b, eps = plan[0]
        h = F.layer_norm(x, w.shape, w, b, eps)
        for attn, (w1, b1, e1), fc1, (w2, b2, e2), fc2, (w3, b3, e3) in plan[1:]:
            x, h = pro(x, attn(h, start_pos, None, rope, step), w1, b1, e1, False)
            g = pro(fc1(h), None, w2, b2, e2, True)[1]
            x, h = pro(x, fc2(g), w3, b3, e3, False)
        return h


# ---------------------------------------------------------------------------------- LM loss

# Elements of one chunk of logits (2**26 float32 = 256 MiB): the rows per chunk are this divided
# by the vocabulary size, so a 256-byte vocabulary takes 262144 rows at once and a 50304-word one
# 1334 rows.
CE_CHUNK_ELEMENTS = 2**26


def _ce_sum(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy of logits h @ weight.T (softmax in float32, or float64) against t."""
    logits = F.linear(h, weight)  # (rows, V)
    if logits.dtype != torch.float64:
        logits = logits.float()
    return F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``logits = hidden @ weight.T`` without materialising all the logits.

    hidden (..., E), weight (V, E), targets (...) int64; rows whose target is ``ignore_index``
    are dropped first (a retrieval batch scores a handful of rows of 32K). The remaining rows go
    through the head in chunks of ``chunk_rows`` (default ``CE_CHUNK_ELEMENTS // V``). With more
    than one chunk each one runs under ``torch.utils.checkpoint``, so only its inputs are kept
    and its logits are recomputed in backward: the extra memory is one chunk of logits (and its
    gradient) at any time, at the price of recomputing the head's matmul. Values and gradients
    equal ``F.cross_entropy(F.linear(hidden, weight).float(), targets)`` (tested in float64).
    Autocast applies to the matmul as it would in ``lm_head``; the softmax is in float32
    (float64 for float64 inputs).
    ``reduction``: "mean" over the scored rows (NaN when there are none, as torch's) or "sum".
    ``fused=True`` (when a gradient is needed): the chunks' gradients are computed in the
    forward pass instead of recomputing each chunk in backward (``models/linear_ce.py``: one
    head matmul fewer per chunk, the weight cast once); same values and gradients to rounding;
    no double backward. Under ``torch.compile`` the same pass runs as the custom op
    ``dilated_attention::linear_ce``, over every row (ignored rows are not dropped there).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    h = hidden.reshape(-1, hidden.shape[-1])  # (M, E)
    t = targets.reshape(-1)  # (M,)
    if t.shape[0] != h.shape[0]:
        raise ValueError(
            f"targets {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)}[:-1]"
        )
    if torch.compiler.is_compiling():
        # inside torch.compile: no data-dependent row count (that would be a host sync and a
        # graph break); ignored rows stay in and F.cross_entropy skips them (ignore_index)
        count = (t != ignore_index).sum()
    else:
        # eager: drop the ignored rows first (a retrieval batch scores a handful of rows of 32K);
        # nonzero() needs their number on the host, one synchronisation per call
        rows = (t != ignore_index).nonzero().squeeze(1)
        if rows.shape[0] != t.shape[0]:
            h, t = h.index_select(0, rows), t.index_select(0, rows)  # (M', E), (M',)
        count = h.shape[0]
    m = h.shape[0]
    step = chunk_rows or max(1, CE_CHUNK_ELEMENTS // weight.shape[0])
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if fused and grad and not _transforms_active():
        # under torch.compile: its custom op, with the ignored rows in (kept above); not under
        # functorch transforms (torch.func.grad, vmap): its autograd.Function has no
        # setup_context for them, the checkpointed chunks below take the same values
        total = linear_cross_entropy_sum(h, weight, t, ignore_index=ignore_index, chunk_rows=step)
    elif m <= step:
        total = _ce_sum(h, weight, t, ignore_index)  # one chunk: nothing to gain from recomputation
    else:
        parts = []
        for c in range(0, m, step):
            hc, tc = h[c : c + step], t[c : c + step]
            if grad:
                parts.append(checkpoint(_ce_sum, hc, weight, tc, ignore_index, use_reentrant=False))
            else:
                parts.append(_ce_sum(hc, weight, tc, ignore_index))
        total = torch.stack(parts).sum()
    return total if reduction == "sum" else total / count


class LongNetLM(_Trunk):
    """Decoder-only causal LongNet language model with tied embeddings.

    ``forward(idx (B, T) int64, targets (B, T) | None)`` -> ``(logits (B, T, V), loss | None)``;
    targets equal to -100 are ignored. The loss is the mean over this rank's valid targets.
    """

    def __init__(self, cfg: LongNetConfig):
        super().__init__(cfg, causal=True)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        nn.init.normal_(self.tok_emb.weight, std=cfg.dim**-0.5)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=cfg.dim**-0.5)
        self.emb_dropout = nn.Dropout(cfg.dropout)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        start_pos: int | None = None,
        return_logits: bool = True,
        loss_reduction: str = "mean",
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ):
        """idx (B, T) -> (logits (B, T, V) or None, loss or None).

        The loss (over targets != -100; ``loss_reduction`` "mean" or "sum") is computed by
        :func:`chunked_cross_entropy` from the hidden states, never from a full (B, T, V) logits
        tensor: with ``return_logits=False`` no (B, T, V) tensor exists at all, so the model's
        memory is set by its trunk, not by its vocabulary (logits is then None). Training
        loops should pass ``return_logits=False``.

        ``start_pos``: global position of ``idx[:, 0]``. Default: 0, or ``rank * T`` when
        sequence-parallel. With a KV cache (:meth:`setup_cache`) it is where the tokens are
        written and must be given.

        ``cu_seqlens``: packed documents (``dilated_attention.data.pack_documents`` makes them):
        int32 (docs + 1,) offsets into the flattened ``B * T`` tokens of ``idx``. Each document
        is its own sequence: its rotary positions and its segments restart at 0 and it attends
        only to itself, so its logits equal the document run alone. ``max_seqlen``: the longest
        document (computed from ``cu_seqlens`` when None: one host sync). Not with a KV cache
        or ``start_pos``. Sequence-parallel (:func:`parallelize`): ``idx`` (1, N/P) is this
        rank's contiguous shard of ONE packed stream of N tokens and ``cu_seqlens`` the global
        offsets (the same on every rank; documents may cross rank boundaries), as
        ``dilated_attention_varlen(..., group=)`` takes them.
        """
        x = self.hidden_states(idx, start_pos=start_pos, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        logits = self.lm_head(x) if return_logits or targets is None else None  # (B, T, V)
        loss = None
        if targets is not None:
            loss = chunked_cross_entropy(x, self.lm_head.weight, targets, reduction=loss_reduction,
                                         fused=self.cfg.fused_loss)  # fmt: skip
        return logits, loss

    def hidden_states(
        self,
        idx: torch.Tensor,
        *,
        start_pos: int | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """idx (B, T) -> final-LayerNorm hidden states (B, T, E), the input of ``lm_head``
        (``cu_seqlens``, ``max_seqlen``: packed documents, see :meth:`forward`). Under a
        bf16/fp16 autocast they are float32 where the final LayerNorm is ``nn.LayerNorm`` and
        in the autocast dtype (the dtype ``lm_head`` reads them in) where it runs as the Triton
        kernel: on CUDA from ``LAYERNORM_AUTO_MIN_ROWS`` rows by default, at any size with
        ``flags.set_triton_layernorm(True)`` (see :class:`AutocastLayerNorm`)."""
        if cu_seqlens is not None:
            return self._hidden_packed(idx, start_pos, cu_seqlens, max_seqlen)
        b, t = idx.shape
        if start_pos is None:
            if self.has_cache:
                raise ValueError(
                    "with a KV cache, pass start_pos (the cache length before these tokens)"
                )
            start_pos = self.position_offset(t)
        x = self.tok_emb(idx)  # (B, T, E)
        if self.training:  # eval: dropout is the identity
            x = self.emb_dropout(x)
        return self.run_layers(x, start_pos)  # (B, T, E)

    def _hidden_packed(self, idx, start_pos, cu_seqlens, max_seqlen) -> torch.Tensor:
        try:
            self._check_packed(idx, start_pos, cu_seqlens)
        except (TypeError, ValueError) as e:
            if self.sp_group is None:
                raise
            # sequence-parallel: raise on every rank (the others would wait in the first
            # attention layer's cross-rank check until the collective timeout)
            from ..distributed.sequence_parallel import sp_varlen_arg_error

            sp_varlen_arg_error(self.sp_group, e, (idx, cu_seqlens), "LongNetLM")
        b, t = idx.shape
        dev = idx.device
        if cu_seqlens.device != dev:
            # host offsets (as data.pack_documents makes them): the longest document read on the
            # host, and one fresh host copy uploaded without waiting (a blocking .to(cuda) is a
            # host synchronisation per step)
            host = cu_seqlens.to(torch.long, copy=True)
            if max_seqlen is None:
                max_seqlen = int((host[1:] - host[:-1]).max())
            cu = host.to(dev, non_blocking=True)
        else:
            cu = cu_seqlens.to(torch.long)
            if max_seqlen is None:  # device offsets: one read of the device (pass max_seqlen)
                max_seqlen = int((cu[1:] - cu[:-1]).max())
        # global stream positions of these tokens (this rank's contiguous shard under parallelize)
        flat = self.position_offset(t) + torch.arange(b * t, device=dev)
        doc = torch.searchsorted(cu, flat, right=True) - 1  # document of each token
        pos = flat - cu[doc.clamp(0, cu.numel() - 1)]  # (B*T,) position inside its document
        x = self.emb_dropout(self.tok_emb(idx)).reshape(1, b * t, -1)  # (1, B*T, E)
        x = self.run_layers(x, 0, (pos, cu_seqlens, max_seqlen))
        return x.reshape(b, t, -1)  # (B, T, E)

    def _check_packed(self, idx, start_pos, cu_seqlens) -> None:
        if start_pos is not None or self.has_cache:
            raise ValueError(
                "cu_seqlens (packed documents) runs without a KV cache or start_pos; call "
                "forward(idx, cu_seqlens=...) on a model without them"
            )
        if (
            not isinstance(cu_seqlens, torch.Tensor)
            or cu_seqlens.dim() != 1
            or cu_seqlens.numel() < 2
            or cu_seqlens.dtype.is_floating_point
        ):
            raise TypeError(
                "cu_seqlens must be a 1-D integer tensor (docs + 1,) of document offsets into the "
                f"flattened B * T tokens, got {cu_seqlens!r:.80}"
            )
        if self.sp_group is not None and idx.shape[0] != 1:
            raise ValueError(
                "with sequence parallelism and cu_seqlens, idx must be this rank's shard of ONE "
                f"packed stream, shape (1, N/P), got {tuple(idx.shape)}; pack the batch into one "
                "row (pack_documents(docs, seq_len=N) and concatenate its rows)"
            )

    # ---------------------------------------------------------------- KV cache and generation

    @property
    def has_cache(self) -> bool:
        return self.layers[0].attn.kv_cache is not None

    def setup_cache(self, batch: int, capacity: int) -> None:
        """Allocate a KV cache of ``capacity`` positions per layer for ``batch`` sequences.

        Position p is stored in slot ``p % capacity``: a capacity at least the sequence length
        keeps every position (segments are aligned to absolute positions, so a key far back can
        still share a segment with a new query); see :meth:`rolling_capacity` for a bounded one.
        The cache holds the parameters' dtype, or under autocast (for the parameters' device,
        float32 parameters) the autocast dtype, which the projections then produce: call it in
        the autocast context of the steps (``generate`` does).
        """
        p = self.tok_emb.weight
        dtype = p.dtype
        if dtype in _AUTOCAST_CASTS:
            dtype = autocast_dtype(p.device.type) or dtype
        for layer in self.layers:
            a = layer.attn
            a.kv_cache = KVCache(batch, capacity, a.n_kv_head, a.head_dim, dtype, p.device)

    def clear_cache(self) -> None:
        for layer in self.layers:
            layer.attn.kv_cache = None

    def rolling_capacity(self, prefill_chunk: int) -> int:
        """Cache capacity that keeps every key a query can still read, for prefill chunks of at
        most ``prefill_chunk`` tokens and decode steps of one token.

        A query reads, per branch, only keys of its own segment, so nothing older than
        ``max(w)`` positions is ever read again. A prefill chunk starting at c reads from
        :meth:`Attention.align_start` (c rounded down to a multiple of ``lcm(w)``, at most
        ``lcm(w) - 1`` earlier) up to its last token, and writing it must not overwrite any of
        those: ``lcm(w) - 1 + chunk`` slots. With nested segment lengths (LongNet's powers of
        two) ``lcm(w) = max(w)``. Exact for any context length.
        """
        period = math.lcm(*self.cfg.segment_lengths)
        return period - 1 + max(prefill_chunk, MAX_DECODE_ROWS)

    def _hidden_last(self, idx: torch.Tensor, start_pos: int | torch.Tensor) -> torch.Tensor:
        """Cached forward of idx (B, T) at ``start_pos`` -> logits of the last position (B, V)."""
        x = self.tok_emb(idx)  # (B, T, E)
        x = self.run_layers(x, start_pos)  # (B, T, E)
        return self.lm_head(x[:, -1])  # (B, V)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        *,
        return_logits: bool = False,
        generator: torch.Generator | None = None,
        rolling: bool = False,
        prefill_chunk: int | None = None,
        decode: str = "auto",
    ):
        """Sample ``max_new_tokens`` after ``idx`` (B, T) with a static, preallocated KV cache.

        The prompt is prefilled in chunks of ``prefill_chunk`` tokens (default: all of it, or
        ``max(w)`` when rolling) through :func:`dilated_attention`; then one token per step
        through the decode path (:func:`dilated_attention_with_kvcache`: per branch only the
        keys of the query's segment and residue, whatever the context length).

        Args:
            max_new_tokens: an int >= 1 (``TypeError`` / ``ValueError`` otherwise).
            temperature: 0 means greedy (argmax); else sampling, optionally from the ``top_k``
                most likely tokens, with ``generator`` as the random source. A finite number
                >= 0; ``top_k`` None or an int >= 1; ``prefill_chunk`` None (the default) or an
                int >= 1 (anything else raises ``ValueError`` / ``TypeError`` naming it).
            rolling: keep only :meth:`rolling_capacity` positions per layer (about ``max(w)``
                plus a prefill chunk) instead of the whole sequence: exact, and the cache does not
                grow with the number of generated tokens.
            decode: ``"eager"``; ``"graph"`` (one CUDA graph of the decode step, replayed per
                token; CUDA only); ``"compile"`` (``torch.compile(mode="reduce-overhead")``);
                ``"auto"``: ``"graph"`` on CUDA, else ``"eager"``.

        Returns (B, T + max_new_tokens); with ``return_logits`` also the list of last-position
        logits (B, V) used at each step.
        """
        if self.sp_group is not None:
            raise ValueError(
                "generate() runs on one device; call it on a model without sequence parallelism"
            )
        if decode not in ("auto", "eager", "graph", "compile"):
            raise ValueError(f"decode must be 'auto', 'eager', 'graph' or 'compile', got {decode!r}")
        dev = self.tok_emb.weight.device
        if decode == "auto":
            decode = "graph" if dev.type == "cuda" else "eager"
        if decode == "graph" and dev.type != "cuda":
            raise ValueError(f"decode='graph' needs a CUDA model, this one is on {dev}")
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                "generate: idx must be a (B, T) int64 or int32 tensor of token ids, got "
                + (f"shape {tuple(idx.shape)} {idx.dtype}" if isinstance(idx, torch.Tensor) else type(idx).__name__)
                + " (one prompt: idx[None])"
            )
        b, t = idx.shape
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise TypeError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r} ({type(max_new_tokens).__name__})")
        if t < 1 or max_new_tokens < 1:
            raise ValueError(f"need a prompt and max_new_tokens >= 1, got T={t}, {max_new_tokens}")
        max_new_tokens = int(max_new_tokens)
        temperature, top_k, prefill_chunk = _check_generate_args(temperature, top_k, prefill_chunk)
        chunk = prefill_chunk if prefill_chunk is not None else (max(self.cfg.segment_lengths) if rolling else t)
        capacity = self.rolling_capacity(chunk) if rolling else t + max_new_tokens
        # the model's device, whatever the current one (a model on cuda:1 while cuda:0 is current):
        # the decode graph, its capture stream and memory pool, the compiled step's graphs and
        # every launch of the call are that device's; one check per call, the current device
        # restored on return (the kernels' own device guard, kernels/direct_launch.py)
        i = direct_launch.tensor_device(self.tok_emb.weight)  # -1 on the CPU
        switch = i >= 0 and direct_launch.current_device() != i
        on_device = torch.cuda.device(i) if switch else contextlib.nullcontext()
        was_training = self.training
        self.eval()
        steps = []
        with on_device:
            self.setup_cache(b, capacity)
            try:
                for c0 in range(0, t, chunk):  # prefill
                    last = self._hidden_last(idx[:, c0 : c0 + chunk], c0)  # (B, V)
                step = self._decode_step(b, t, decode)
                out = [idx]
                for s in range(max_new_tokens):
                    if return_logits:  # a graph step returns its static output buffer: copy
                        steps.append(last.clone() if decode != "eager" else last)
                    nxt = _sample(last, temperature, top_k, generator)  # (B, 1)
                    out.append(nxt)
                    if s + 1 < max_new_tokens:
                        last = step(nxt, t + s)  # (B, V)
            finally:
                self.clear_cache()
                self.train(was_training)
        idx = torch.cat(out, dim=1)
        return (idx, steps) if return_logits else idx

    def _decode_step(self, batch: int, first_pos: int, mode: str):
        """A callable (tokens (B, 1), position int) -> logits (B, V) of one decode step."""
        dev = self.tok_emb.weight.device
        if mode == "eager":
            # torch.full: a fill with the value as a launch argument; torch.tensor(pos, device=)
            # copies a host tensor to the device and, on CUDA, waits for it (a sync per token)
            return lambda tok, pos: self._hidden_last(tok, torch.full((), pos, dtype=torch.long, device=dev))
        tok_buf = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        pos_buf = torch.full((), first_pos, dtype=torch.long, device=dev)
        if mode == "compile":
            fn = torch.compile(self._hidden_last, mode="reduce-overhead", fullgraph=True)

            def compiled(tok, pos):
                tok_buf.copy_(tok)
                pos_buf.fill_(pos)
                return fn(tok_buf, pos_buf)

            return compiled
        # CUDA graph: warm up on a side stream at the first decode position (the warm-up writes
        # cache slots of that position, which the first real step overwrites), then capture.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._hidden_last(tok_buf, pos_buf)
        torch.cuda.current_stream(dev).wait_stream(side)
        # captured on `side` (this device's), not on torch.cuda.graph's default capture stream:
        # that one is made once per process, on whichever device was current at the first capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            logits = self._hidden_last(tok_buf, pos_buf)

        def replay(tok, pos):
            tok_buf.copy_(tok)
            pos_buf.fill_(pos)
            graph.replay()
            return logits

        return replay


def _check_generate_args(temperature, top_k, prefill_chunk):
    """``generate``'s sampling and prefill arguments, one rule each (``ValueError`` / ``TypeError``
    naming the value): ``temperature`` a finite number >= 0 (0 = greedy); ``top_k`` None or an
    int >= 1; ``prefill_chunk`` None (the default chunk) or an int >= 1."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a number >= 0, got {temperature!r}")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 = greedy, 1 = the model's distribution), "
            f"got {temperature!r}"
        )
    for name, val in (("top_k", top_k), ("prefill_chunk", prefill_chunk)):
        if val is None:
            continue
        if isinstance(val, bool) or not isinstance(val, numbers.Integral):
            raise TypeError(f"{name} must be None or an int >= 1, got {val!r} ({type(val).__name__})")
        if val < 1:
            what = "keep the top_k most likely tokens" if name == "top_k" else "tokens per prefill call"
            raise ValueError(f"{name} must be None or an int >= 1 ({what}), got {val!r}")
    return temperature, (None if top_k is None else int(top_k)), (None if prefill_chunk is None else int(prefill_chunk))


def _sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next token (B, 1)."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    # shifted by the row's largest logit first (that token's logit is then 0 whatever the
    # temperature) and divided in float64 (1e-300 is 0 in float32): a tiny temperature cannot
    # overflow the logits to inf or divide 0 by 0 (NaN weights)
    logits = logits.double()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


# --------------------------------------------------------------------------------------- encoder


class LongNetEncoder(_Trunk):
    """Non-causal LongViT-style encoder: image -> patch tokens -> MAGNETO blocks.

    ``forward(images (B, C, H, W))`` -> features (B, N, E), N = (H/p)(W/p) patches in row-major
    order, or class logits (B, num_classes) from mean-pooled features when ``num_classes > 0``.
    ``forward_tokens(x (B, N, E))`` skips the patch embedding (pre-embedded or 1-D inputs).
    With ``ordering="hilbert"`` the attention reorders the patch grid along a Hilbert curve
    (needs :mod:`dilated_attention.ordering`).
    """

    def __init__(self, cfg: LongNetConfig):
        ih, iw = cfg.image_size
        if ih % cfg.patch_size or iw % cfg.patch_size:
            raise ValueError(
                f"image_size {cfg.image_size} must be a multiple of patch_size {cfg.patch_size}"
            )
        grid = (ih // cfg.patch_size, iw // cfg.patch_size)
        if cfg.ordering not in (None, "none", "hilbert"):
            raise ValueError(f"ordering must be None or 'hilbert', got {cfg.ordering!r}")
        super().__init__(cfg, causal=False, grid=grid if cfg.ordering == "hilbert" else None)
        # the final LayerNorm's output is the features this model returns (or mean-pools): its
        # dtype stays what autocast gives (float32), whatever flags.set_triton_layernorm says
        self.norm.autocast_output = False
        self.grid = grid
        self.patch_embed = nn.Conv2d(
            cfg.in_chans, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.head = nn.Linear(cfg.dim, cfg.num_classes) if cfg.num_classes > 0 else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)  # (B, E, H/p, W/p)
        if self.cfg.ordering == "hilbert" and tuple(x.shape[-2:]) != self.grid:
            # the Hilbert permutation is the one of the configured grid: another grid with as
            # many patches (48 x 32 for 32 x 48) would run, reordered along the wrong curve
            raise ValueError(
                f"LongNetEncoder: images of {tuple(images.shape[-2:])} make a "
                f"{tuple(x.shape[-2:])} patch grid, but ordering='hilbert' was built for "
                f"image_size {tuple(self.cfg.image_size)} ({self.grid[0]} x {self.grid[1]} patches); "
                "pass images of that size or build the encoder for this one"
            )
        x = x.flatten(2).transpose(1, 2)  # (B, N, E), row-major patches
        return self.forward_tokens(x)

    def forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        x = self.run_layers(x, self.position_offset(x.shape[1]))  # (B, N, E)
        if self.head is None:
            return x
        return self.head(x.mean(dim=1))  # (B, num_classes)
