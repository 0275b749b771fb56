"""Triton, imported if it can be (an optional dependency: the modules that define kernels must
import without it), and the reasons a Triton kernel cannot run that do not depend on the kernel.

``triton`` and ``tl`` are None when the import failed; ``TRITON_IMPORT_ERROR`` says why.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = str(e)


def _jit_interprets() -> bool:
    # what ``triton.jit`` makes while this module is imported: an interpreted function when
    # Triton reads TRITON_INTERPRET as on (its own rule: 1, true, yes, on, y in any case), else
    # a compiled one. Asked of Triton itself, not of the environment variable, so that every
    # module agrees with the kernels that are actually defined.
    if triton is None:
        return False

    @triton.jit
    def _probe():
        pass

    return not isinstance(_probe, triton.runtime.JITFunction)


# Whether Triton kernels run in Triton's interpreter in this process (the CPU, for tests) or
# compiled (CUDA): the package's one interpreter check. Fixed when the first kernel module is
# imported (this module is imported with it); ``kernels.select.interpreting`` returns it to the
# layers above the kernels, the kernel modules read it here.
INTERPRET: bool = _jit_interprets()


def interpreter_bf16_reason(q: torch.Tensor, interpret: bool, what: str) -> str | None:
    """Why the attention kernels (``what``) cannot run bfloat16 ``q`` here: Triton's interpreter
    computes their bf16 products wrongly (values ~1e8 from inputs ~1, no error; triton 3.9,
    2026-11-28: its bf16 ``tl.dot``). The LayerNorm, rotary and cross-entropy kernels are
    exact there and do not ask."""
    if interpret and q.device.type == "cpu" and q.dtype == torch.bfloat16:
        return (f"bfloat16 in Triton's interpreter (TRITON_INTERPRET=1): it computes the {what}'s "
                "bf16 products wrongly; use float32 or float16 under the interpreter, impl='torch', "
                "or a CUDA device")
    return None


def device_reason(q: torch.Tensor, interpret: bool) -> str | None:
    """Why no Triton kernel can run on inputs like ``q`` here (None if one can): triton missing,
    CUDA inputs under the interpreter, or inputs on a device that is neither CUDA nor (with the
    interpreter) the CPU."""
    if TRITON_IMPORT_ERROR is not None:
        return f"the triton package is not importable ({TRITON_IMPORT_ERROR}); pip install 'dilated-attention[triton]'"
    if q.device.type == "cuda" and interpret:
        return "TRITON_INTERPRET=1 is set but the inputs are on CUDA; unset it to run the compiled kernel"
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpret):
        return f"the triton kernel needs a CUDA tensor, got device {q.device} (TRITON_INTERPRET=1 allows the CPU for tests)"
    return None
