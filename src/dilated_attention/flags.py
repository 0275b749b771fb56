"""The library's process-level switches, in one place.

There are seven.

**cuDNN attention.** Whether the torch path's dense blocks may use cuDNN attention on a GPU of compute
capability >= 9 (see docs/spec.md, "Choices the library makes"). It is read when a block is
dispatched, not at import, so a change takes effect on the next call:

- ``set_cudnn_attention(False)`` turns it off for this process (``True`` turns it back on,
  ``None`` returns to the environment's choice);
- without a call, the environment decides: ``DILATED_ATTENTION_CUDNN=0`` turns it off, any other
  value or no value leaves it on.

cuDNN is used only where a probe on the device reproduces FlashAttention-2's forward, LSE and
backward; the switch exists for comparisons.

**Direct launch of the Triton kernels.** Whether an eager Triton decode call runs through its
per-configuration plan and launches the compiled kernels directly (``kernels/triton_decode.py``,
``kernels/direct_launch.py``), or through the per-call path that builds every argument and
launches through Triton's ``kernel[grid](...)`` (the path before issue 23's plans; both give the
same bits); likewise whether the training kernels' launches (``kernels/triton_launch.py``) skip
Triton's per-launch dispatch once their compiled kernel is known (``DirectKernel``). Read:

- ``set_direct_launch(False)`` turns the plans off for this process (``True`` on, ``None``: the
  environment decides);
- without a call, ``DILATED_ATTENTION_DIRECT_LAUNCH=0`` turns them off; any other value or none
  leaves them **on** (the default since 2026-11-25: the CUDA tests ran bit-identical to
  Triton's own launch on an H100 with torch 2.11 / Triton 3.6, and ``benchmarks/ab_decode.py``
  measured decode 2.3-2.7x and small training calls 1.3-1.6x faster,
  ``benchmarks/results/ab_decode_h100_2026-11-25.md``). Where Triton's launcher is not the
  layout the direct launch knows (another Triton version or backend), ``direct_launch.launcher``
  gives None and Triton's own path runs. This one is on every decode call's path, so the
  environment is read at the first call and again after each ``set_direct_launch(...)``, not at
  every call (reading ``os.environ`` costs about a microsecond).

The switch exists for same-process A/B measurements (``benchmarks/ab_decode.py``).

**The fused rotary kernel of the models.** Whether ``Rotary`` (``models/longnet.py``) rotates q and
k with the Triton kernel of ``kernels/triton_rotary.py`` (one pass, forward and backward; under
``torch.compile`` as the custom op ``dilated_attention::rotary``) or with its torch code (about
six float32 passes each way). Three answers, from :func:`fused_rotary_mode`:

- ``"auto"`` (the default): the kernel on CUDA where it can run (fp16, bf16, fp32; not xPos),
  else the torch code;
- ``"on"``: the kernel wherever it can run, Triton's interpreter on the CPU included
  (``TRITON_INTERPRET=1``; for tests), else the torch code;
- ``"off"``: always the torch code.

The default became ``"auto"`` on 2026-11-27 after its CUDA tests passed on an H100 (the kernel
against the torch code, fwd and bwd; generate with CUDA graphs; the compiled training step) and
``benchmarks/ab_rotary.py`` measured it: 6-7.7x the torch code's speed for the rotation alone,
an eager ``base`` training step 11% faster (``benchmarks/results/rotary_h100_2026-11-27.md``).

``set_fused_rotary(True)`` is ``"on"``, ``False`` is ``"off"``, ``None`` returns to the
environment: ``DILATED_ATTENTION_FUSED_ROTARY=0`` is ``"off"``, ``=1`` is ``"on"``, ``=auto`` is
``"auto"``, anything else or nothing is the default (``ROTARY_DEFAULT``). Read as the
direct-launch switch is (once after each set: it is asked in every layer of every forward,
decode steps included).

**The cross-entropy kernel of the fused LM loss.** Whether ``models/linear_ce.py`` (the loss of
``LongNetConfig(fused_loss=True)``, the default) computes each chunk's loss and gradient with the
Triton kernel of ``kernels/triton_ce.py`` (one launch per chunk, the gradient written over the
chunk's logits in their dtype) or with its torch code (a float32 copy of the chunk's logits and
about six passes over it). Three answers, from :func:`ce_kernel_mode`, as for the rotary kernel:

- ``"auto"`` (the default, ``CE_KERNEL_DEFAULT``): the kernel on CUDA where it can run (fp16,
  bf16, fp32 logits), else the torch code;
- ``"on"``: the kernel wherever it can run, Triton's interpreter on the CPU included
  (``TRITON_INTERPRET=1``; for tests), else the torch code;
- ``"off"``: always the torch code.

Measured on an H100 on 2026-11-27 (``benchmarks/profile_step.py``, LongNet ``base``, 8K x 4):
the eager step's cross-entropy kernels 52.6 -> 8.5 ms, the step 207.6 -> 158.4 ms
(``benchmarks/results/profile_step_h100_2026-11-27_s14.md``). ``set_ce_kernel(True)`` is
``"on"``, ``False`` is ``"off"``, ``None`` returns to the environment:
``DILATED_ATTENTION_CE_KERNEL=0`` is ``"off"``, ``=1`` is ``"on"``, ``=auto`` is ``"auto"``,
anything else or nothing is the default. Read as the rotary switch is (once after each set).

**The Triton LayerNorm of the models** (issue 23 item 5). Whether the LayerNorms of the LongNet
models (``models/longnet.py``: each block's two pre-LNs, the MAGNETO sub-LNs of the attention and
the FFN, the language model's final LN) run, in eager mode under a bf16/fp16 autocast, as the
Triton kernels of ``kernels/triton_layernorm.py``: the input read in its own dtype (the float32
residual stream or a bf16 activation) with float32 gamma/beta, the output written in the autocast
dtype, all math in float32. Autocast instead runs ``layer_norm`` in float32 and every Linear
after it casts the float32 output back (q, k and v each), plus the mirror casts in backward; the
result is the same up to float32 summation order (the kernel's docstring states the contract).
Three answers, from :func:`triton_layernorm_mode`, as for the rotary kernel:

- ``"auto"`` (the default, ``LAYERNORM_DEFAULT``): the kernels on CUDA;
- ``"on"``: wherever they can run, Triton's interpreter on the CPU included (for tests);
- ``"off"``: always ``nn.LayerNorm``.

Without a bf16/fp16 autocast on the input's device, under ``torch.compile`` (Inductor fuses the
LayerNorm and its casts) or where the kernels cannot run, ``nn.LayerNorm`` runs whatever the
mode. Measured on an H100 on 2026-11-27 (same profile, with the fused loss): the eager step
158.4 -> 118.1 ms at 8K x 4 (LayerNorm kernels 28.8 -> 10.2 ms, casts 23.7 -> 2.3 ms).
``set_triton_layernorm(True)`` is ``"on"``, ``False`` is ``"off"``, ``None`` returns to the
environment: ``DILATED_ATTENTION_TRITON_LAYERNORM=0`` is ``"off"``, ``=1`` is ``"on"``,
``=auto`` is ``"auto"``, anything else or nothing is the default. Read as the direct-launch
switch is (once after each set: it is asked by every LayerNorm of every forward, decode steps
included).

**The Gluon forward of the training kernels** (issue 24). Whether ``kernels/triton_launch.forward``
runs the branches of a call through the Gluon kernel of ``kernels/gluon_fwd_kernel.py``
(FlashAttention-3's structure: TMA loads, a producer warp, two consumer warpgroups with async
wgmma) where it applies (``kernels/gluon_fwd.problem``: a Hopper GPU (sm_90) with Triton's Gluon,
batch x seqlen x heads >= ``gluon_fwd.MIN_ROWS``, bf16/fp16, headdim 64 or 128, seqlen_q == seqlen_k, the
branch geometry ``gluon_fwd.shape_problem`` accepts (short last segments and w % r != 0 included,
through ``TAIL_SEGMENTS`` / ``UNEVEN_BLOCKS``), no key padding mask, no block-config override;
packed documents have their own Gluon kernels, ``kernels/gluon_varlen.py``), or through
the Triton kernels always. Both are exact (the CUDA tests compare each to the float64
reference); the switch exists for A/B measurements. ``set_gluon_forward(False)`` turns it off for
this process, ``True`` on, ``None`` returns to the environment: ``DILATED_ATTENTION_GLUON_FWD=0``
turns it off, any other value or none leaves it on. Read as the direct-launch switch is.

**The Gluon backward of the training kernels** (issue 24). Whether the training backward runs
its branches through the Gluon dK/dV and dQ kernels of ``kernels/gluon_bwd_kernel.py`` where
they apply (``kernels/gluon_bwd.problem``: the forward's conditions, every branch over all
heads, float32 accumulators within ``gluon_bwd.MAX_F32_BYTES``), or through the Triton kernels.
On by default since its CUDA tests passed on an H200 (2026-11-28, twenty-third session:
``tests/test_gluon_bwd.py`` against the float64 reference, bitwise repeatable).
``set_gluon_backward(False)`` turns it off for this process, ``True`` on, ``None`` returns to
the environment: ``DILATED_ATTENTION_GLUON_BWD=0`` turns it off, any other value or none leaves
it on. Read as the direct-launch switch is.
"""

from __future__ import annotations

import os

ENV_CUDNN = "DILATED_ATTENTION_CUDNN"
ENV_DIRECT_LAUNCH = "DILATED_ATTENTION_DIRECT_LAUNCH"
ENV_FUSED_ROTARY = "DILATED_ATTENTION_FUSED_ROTARY"
ENV_CE_KERNEL = "DILATED_ATTENTION_CE_KERNEL"
CE_KERNEL_DEFAULT = "auto"  # since 2026-11-27 (measured on an H100: profile_step.py)
ENV_TRITON_LAYERNORM = "DILATED_ATTENTION_TRITON_LAYERNORM"
ENV_GLUON_FWD = "DILATED_ATTENTION_GLUON_FWD"
ENV_GLUON_BWD = "DILATED_ATTENTION_GLUON_BWD"
ROTARY_DEFAULT = "auto"  # since 2026-11-27 (verified and measured on an H100)
LAYERNORM_DEFAULT = "auto"  # since 2026-11-27 (measured on an H100: profile_step.py --triton-layernorm)

# the value set by set_cudnn_attention; None: the environment decides (the xformers-style setter)
_cudnn_override: bool | None = None


class _Switch:
    """A process-wide switch asked on hot paths: ``value`` is what its setter set, or, after
    ``set(None)``, its environment variable parsed by ``parse`` at the next ask (:meth:`load`),
    then kept. A getter reads ``value`` and calls :meth:`load` only while it is None (no call on
    the common path: the decode fast path counts its calls)."""

    __slots__ = ("env", "parse", "value")

    def __init__(self, env: str, parse):
        self.env, self.parse = env, parse
        self.value = None

    def set(self, value) -> None:
        self.value = value  # None: the environment decides, read at the next ask

    def load(self):
        self.value = self.parse(os.environ.get(self.env, "").strip())
        return self.value


_direct = _Switch(ENV_DIRECT_LAUNCH, lambda v: v != "0")  # on unless "0"
_gluon = _Switch(ENV_GLUON_FWD, lambda v: v != "0")  # on unless "0"
_gluon_bwd = _Switch(ENV_GLUON_BWD, lambda v: v != "0")  # on unless "0"
_MODES = {"0": "off", "1": "on", "auto": "auto"}  # the rotary, cross-entropy and LayerNorm switches
_rotary = _Switch(ENV_FUSED_ROTARY, lambda v: _MODES.get(v.lower(), ROTARY_DEFAULT))
_ce = _Switch(ENV_CE_KERNEL, lambda v: _MODES.get(v.lower(), CE_KERNEL_DEFAULT))
_layernorm = _Switch(ENV_TRITON_LAYERNORM, lambda v: _MODES.get(v.lower(), LAYERNORM_DEFAULT))


def _check_bool(setter: str, enabled, env: str) -> None:
    """The setters' argument check: True, False or None, else a TypeError naming the setter."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(
            f"{setter}(enabled={enabled!r}): pass True, False or None (None: the {env} "
            f"environment variable decides)"
        )


def set_cudnn_attention(enabled: bool | None) -> None:
    """Allow (True) or forbid (False) cuDNN attention for the torch path's dense blocks in this
    process; None returns to the environment's choice (``DILATED_ATTENTION_CUDNN``)."""
    global _cudnn_override
    _check_bool("set_cudnn_attention", enabled, ENV_CUDNN)
    _cudnn_override = enabled


def cudnn_attention_enabled() -> bool:
    """Whether cuDNN attention may be used now: the value set by :func:`set_cudnn_attention`, else
    the environment read at this call (``DILATED_ATTENTION_CUDNN=0`` turns it off)."""
    if _cudnn_override is not None:
        return _cudnn_override
    return os.environ.get(ENV_CUDNN, "1").strip() != "0"


def set_direct_launch(enabled: bool | None) -> None:
    """Use (True) or bypass (False) the decode plans and their direct kernel launch in this
    process; None returns to the environment's choice (``DILATED_ATTENTION_DIRECT_LAUNCH``)."""
    _check_bool("set_direct_launch", enabled, ENV_DIRECT_LAUNCH)
    _direct.set(enabled)


def direct_launch_enabled() -> bool:
    """Whether Triton kernels are launched directly (decode plans, training launches) now: the value set by
    :func:`set_direct_launch`, else the environment (``DILATED_ATTENTION_DIRECT_LAUNCH=0`` turns
    it off; on by default) as read at the first call since the last :func:`set_direct_launch`."""
    v = _direct.value
    return _direct.load() if v is None else v


def set_fused_rotary(enabled: bool | None) -> None:
    """Use the fused rotary kernel wherever it can run (True: the interpreter on the CPU
    included) or never (False) in this process; None returns to the environment's choice
    (``DILATED_ATTENTION_FUSED_ROTARY``: ``0``, ``1`` or ``auto``, CUDA only; unset:
    ``ROTARY_DEFAULT``)."""
    _check_bool("set_fused_rotary", enabled, ENV_FUSED_ROTARY)
    _rotary.set(None if enabled is None else "on" if enabled else "off")


def fused_rotary_mode() -> str:
    """``"on"``, ``"off"`` or ``"auto"`` for the models' fused rotary kernel: the value set by
    :func:`set_fused_rotary`, else the environment (``DILATED_ATTENTION_FUSED_ROTARY=0`` off,
    ``=1`` on, ``=auto`` auto, else ``ROTARY_DEFAULT``) as read at the first call since the last
    :func:`set_fused_rotary`."""
    v = _rotary.value
    return _rotary.load() if v is None else v


def set_ce_kernel(enabled: bool | None) -> None:
    """Use the cross-entropy kernel of the fused LM loss wherever it can run (True: the
    interpreter on the CPU included) or never (False) in this process; None returns to the
    environment's choice (``DILATED_ATTENTION_CE_KERNEL``: ``0``, ``1`` or ``auto``, CUDA only;
    unset: ``CE_KERNEL_DEFAULT``)."""
    _check_bool("set_ce_kernel", enabled, ENV_CE_KERNEL)
    _ce.set(None if enabled is None else "on" if enabled else "off")


def ce_kernel_mode() -> str:
    """``"on"``, ``"off"`` or ``"auto"`` for the fused loss's cross-entropy kernel: the value set
    by :func:`set_ce_kernel`, else the environment (``DILATED_ATTENTION_CE_KERNEL=0`` off, ``=1``
    on, ``=auto`` auto, else ``CE_KERNEL_DEFAULT``) as read at the first call since the last
    :func:`set_ce_kernel`."""
    v = _ce.value
    return _ce.load() if v is None else v


def set_triton_layernorm(enabled: bool | None) -> None:
    """Run the models' LayerNorms under a bf16/fp16 autocast as the Triton kernels of
    ``kernels/triton_layernorm.py`` wherever they can run (True: Triton's interpreter on the CPU
    included) or as ``nn.LayerNorm`` (False) in this process; None returns to the environment's
    choice (``DILATED_ATTENTION_TRITON_LAYERNORM``: ``0``, ``1`` or ``auto``, CUDA only; unset:
    ``LAYERNORM_DEFAULT``). The same switch lets a model's decode step (no autocast, no
    gradient) fuse each residual add and the FFN's GELU into the LayerNorm after it
    (``auto``: on CUDA; ``True``: also in the interpreter; ``False``: never)."""
    _check_bool("set_triton_layernorm", enabled, ENV_TRITON_LAYERNORM)
    _layernorm.set(None if enabled is None else "on" if enabled else "off")


def triton_layernorm_mode() -> str:
    """``"on"``, ``"off"`` or ``"auto"`` for the models' Triton LayerNorm: the value set by
    :func:`set_triton_layernorm`, else the environment (``DILATED_ATTENTION_TRITON_LAYERNORM=0``
    off, ``=1`` on, ``=auto`` auto, else ``LAYERNORM_DEFAULT``) as read at the first call since
    the last :func:`set_triton_layernorm`."""
    v = _layernorm.value
    return _layernorm.load() if v is None else v


def set_gluon_forward(enabled: bool | None) -> None:
    """Run the training forward's branches through the Gluon kernel where it applies (True) or
    through the Triton kernels always (False) in this process; None returns to the environment's
    choice (``DILATED_ATTENTION_GLUON_FWD``; on unless ``0``)."""
    _check_bool("set_gluon_forward", enabled, ENV_GLUON_FWD)
    _gluon.set(enabled)


def gluon_forward_enabled() -> bool:
    """Whether the training forward may use the Gluon kernel now: the value set by
    :func:`set_gluon_forward`, else the environment (``DILATED_ATTENTION_GLUON_FWD=0`` turns it
    off; on by default) as read at the first call since the last :func:`set_gluon_forward`."""
    v = _gluon.value
    return _gluon.load() if v is None else v


def set_gluon_backward(enabled: bool | None) -> None:
    """Run the training backward's branches through the Gluon kernels where they apply (True) or
    through the Triton kernels always (False) in this process; None returns to the environment's
    choice (``DILATED_ATTENTION_GLUON_BWD``; on unless ``0``)."""
    _check_bool("set_gluon_backward", enabled, ENV_GLUON_BWD)
    _gluon_bwd.set(enabled)


def gluon_backward_enabled() -> bool:
    """Whether the training backward may use the Gluon kernels now: the value set by
    :func:`set_gluon_backward`, else the environment (``DILATED_ATTENTION_GLUON_BWD=0`` turns it
    off; on by default) as read at the first call since the last :func:`set_gluon_backward`."""
    v = _gluon_bwd.value
    return _gluon_bwd.load() if v is None else v
