"""Launch compiled Triton kernels without Triton's per-call Python dispatch (issue 23).

``kernel[grid](*args)`` runs ``JITFunction.run`` on every call: it binds the arguments,
specialises each one (``native_specialize_impl``), hashes the result into a cache key and then
launches. On the H100 host that is 40-60 us per launch (``benchmarks/profile_host.py``,
results/overhead_h100_2026-11-25.md), several times the decode kernels' own 12 us.

:func:`direct` wraps a ``triton.jit`` kernel. The first call with a given *specialisation key*
goes through Triton's own path (``kernel[grid](...)``, which compiles or fetches the kernel) and
keeps the ``CompiledKernel`` it returns; later calls with the same key launch that compiled
kernel through its launcher (``CompiledKernel[grid](*args)``, Triton's public launcher entry).

The key is a superset of what Triton specialises on, so that two calls with one key can never
need different binaries: per argument in signature order, a ``tl.constexpr`` parameter by its
value; a tensor by dtype and 16-byte alignment of its data pointer; an int by (== 1, divisible by
16, fits in int32); a bool by value; a float by its type; None as None; the launch options
(num_warps, num_stages, ...) by value; and the current device. Anything else (a type Triton may
treat specially) is keyed by type and value.

Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) there is nothing compiled to
keep: the wrapper calls ``kernel[grid](...)`` every time.
"""

from __future__ import annotations

import torch

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _spec(a):
    """What Triton may specialise a runtime argument on (a superset)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    t = type(a)
    if t is bool:
        return (bool, a)
    if t is int:
        return (int, a == 1, a % 16 == 0, _I32_MIN <= a <= _I32_MAX)
    if t is float:
        return float
    if a is None:
        return None
    return (t, a)


class _Direct:
    """``direct(kernel)[grid](*args, **kwargs)``: same call as ``kernel[grid](...)``."""

    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        # interpreted kernels (InterpretedFunction) compile nothing: no fast path
        self.compiled_mode = params is not None and hasattr(kernel, "run") and hasattr(kernel, "arg_names")
        if self.compiled_mode:
            self.names = list(kernel.arg_names)
            self.index = {n: i for i, n in enumerate(self.names)}
            self.constexpr = tuple(bool(p.is_constexpr) for p in params)
        self.cache: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        if not self.compiled_mode:
            return self.kernel[grid](*args, **kwargs)
        full = list(args) + [None] * (len(self.names) - len(args))
        given = len(args)
        options = []
        for name, value in kwargs.items():
            i = self.index.get(name)
            if i is None:
                options.append((name, value))  # num_warps, num_stages, ...
            else:
                full[i] = value
                given += 1
        if given != len(self.names):  # a parameter left to its default: Triton's path decides
            return self.kernel[grid](*args, **kwargs)
        key = (
            torch.cuda.current_device(),
            tuple(options),
            tuple(v if c else _spec(v) for v, c in zip(full, self.constexpr, strict=True)),
        )
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if compiled is not None:
                self.cache[key] = compiled
            return compiled
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*full)
        return compiled


def direct(kernel) -> _Direct:
    """Wrap a ``triton.jit`` kernel for launches without per-call specialisation (see module)."""
    return _Direct(kernel)
