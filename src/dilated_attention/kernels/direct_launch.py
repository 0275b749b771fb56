"""Launch an already compiled Triton kernel through its launcher, with no per-argument work (issue 23).

``kernel[grid](*args)`` runs Triton's ``JITFunction.run`` on every call: it binds ~45 arguments,
specialises each one (integers on == 1 / divisible by 16 / int32, pointers on 16-byte alignment),
hashes the result into a cache key, builds launch metadata and then calls the compiled kernel's
C launcher. On the H100 host that is half of the ~200 us host time of an eager decode call
(``benchmarks/results/profile_host_h100_2026-11-25.md``). A Python-side copy of the specialiser
saves nothing (``results/overhead_direct_launch_h100_2026-11-25.md``): the per-argument work is
the cost, whoever does it.

So the work moves to *plans* (``triton_decode.DecodePlan``): a plan is built once per
configuration (shapes, strides, dtype, device, options: everything an integer argument or a
constexpr is derived from), holds the constant arguments, and runs its first call through
``kernel[grid](...)`` (which compiles or fetches the binary and returns the ``CompiledKernel``).
:func:`launcher` then turns that ``CompiledKernel`` into ``go(stream, args)``: a call of the
kernel's C launcher with the grid, function handle and metadata bound once (or
:func:`launch_form`: the same call for a caller that makes it inline, with no Python frame of
its own: the decode plans, whose eager call is host-bound on the H100). The caller passes
the same argument list Triton would (every parameter in signature order, constexpr values
included; data pointers as ints) and guarantees the binary's specialisation holds: the integer
arguments are the plan's (they are in its key) or, for those a plan takes per call (a decode
cache's length and strides), of the classes in its key (:func:`int_class`), and every pointer
is 16-byte aligned (checked per call with one ``|`` of the pointers; a misaligned view takes
Triton's own path).

Only one launcher layout is supported: Triton 3.6's NVIDIA launcher (``CudaLauncher``, whose C
``launch`` parses ``_BASE_ARGS_FORMAT == "iiiKKppOOOOOO"``: grid x/y/z, stream, function,
cooperative, PDL, global scratch, profile scratch, packed metadata, launch metadata, enter hook,
exit hook, then the kernel arguments). Anything else (another Triton version, another backend,
the interpreter, a kernel that needs global or profile scratch memory, an active launch hook such
as Proton's) gives ``None`` or ``hooks_idle() is False``, and the caller keeps Triton's path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .. import flags

# Triton 3.6's nvidia driver: the fixed leading arguments of the generated C ``launch``
_LAYOUT_36 = "iiiKKppOOOOOO"


@functools.cache
def unavailable_reason() -> str | None:
    """Why compiled kernels cannot be launched directly in this process (None if they can).
    Decided once per process: the Triton version and backend do not change."""
    from .triton_import import INTERPRET  # here, not at import: it imports triton

    if INTERPRET:
        return "TRITON_INTERPRET is set: kernels are interpreted, nothing is compiled"
    try:
        from triton import knobs  # noqa: F401
        from triton.backends.nvidia import driver as nv
    except Exception as e:  # noqa: BLE001 - any import problem means: use Triton's path
        return f"Triton's nvidia driver module is not importable ({e})"
    layout = getattr(nv, "_BASE_ARGS_FORMAT", None)
    if layout != _LAYOUT_36:
        return f"unknown Triton launcher layout {layout!r} (supported: Triton 3.6's {_LAYOUT_36!r})"
    if getattr(nv, "CudaLauncher", None) is None:
        return "Triton's nvidia driver has no CudaLauncher"
    return None


@functools.cache
def _runtime_knobs():
    """Triton's ``knobs.runtime`` (None where it does not exist), looked up once."""
    try:
        from triton import knobs

        return knobs.runtime
    except Exception:  # noqa: BLE001 - no knobs module: hooks cannot be checked
        return None


def runtime_knobs():
    """Triton's ``knobs.runtime`` (None where it does not exist): where its launch hooks live."""
    return _runtime_knobs()


def hooks_idle() -> bool:
    """True when no Triton launch hook is installed (Proton and friends install one): the direct
    launch passes no hooks, so with a hook installed the caller must use Triton's path. Read at
    each call (a hook may be added at any time). ``DecodePlan.launch`` inlines the common case
    (both hooks Triton 3.6's ``HookChain``s: idle when their ``calls`` lists are empty) and asks
    this function only for anything else."""
    rt = _runtime_knobs()
    if rt is None:
        return False
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is None:
            continue
        try:
            if h.calls:  # Triton 3.6: a HookChain, idle when its list of calls is empty
                return False
        except AttributeError:  # a hook of another kind (e.g. a plain function): it would run
            return False
    return True


def compiled_of(ret):
    """The ``CompiledKernel`` that ``kernel[grid](...)`` returned (None under the interpreter or
    for anything else); resolves Triton's async-compile futures."""
    if ret is None:
        return None
    if hasattr(ret, "result") and not hasattr(ret, "function"):
        ret = ret.result()
    if not hasattr(ret, "packed_metadata") or not hasattr(ret, "run"):
        return None
    return ret


def _launch_parts(compiled):
    """(C launch, function, cooperative, PDL, packed metadata) of ``compiled`` (a
    ``CompiledKernel``), or None where this process cannot launch it directly (see
    :func:`launcher`)."""
    if unavailable_reason() is not None:
        return None
    compiled = compiled_of(compiled)
    if compiled is None:
        return None
    run = compiled.run  # loads the binary (CompiledKernel._init_handles) if not done yet
    if type(run).__name__ != "CudaLauncher":
        return None
    launch = getattr(run, "launch", None)
    if launch is None:
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None  # the kernel needs scratch memory per launch: Triton's path allocates it
    if not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl"):
        return None
    coop, pdl = bool(run.launch_cooperative_grid), bool(run.launch_pdl)
    return launch, compiled.function, coop, pdl, compiled.packed_metadata


def launch_form(compiled, grid: tuple[int, ...]) -> tuple | None:
    """``(launch, pre, post)`` such that ``launch(*pre, stream, *post, *args)`` launches
    ``compiled`` (a ``CompiledKernel``) on ``grid``: Triton 3.6's C ``launch`` with its leading
    arguments bound (``pre`` the grid, ``post`` the function handle, cooperative and PDL flags, no
    scratch memory, the packed metadata, no launch metadata or hooks). None where
    :func:`launcher` gives None. For a caller that inlines the launch in its own per-call code
    (``triton_decode.DecodePlan.run``: no Python frame per launch); ``args`` as for
    :func:`launcher`."""
    parts = _launch_parts(compiled)
    if parts is None:
        return None
    launch, function, coop, pdl, meta = parts
    g = tuple(int(x) for x in grid) + (1, 1)
    return launch, (g[0], g[1], g[2]), (function, coop, pdl, None, None, meta, None, None, None)


def launcher(compiled, grid: tuple[int, ...]) -> Callable[[int, tuple], None] | None:
    """``go(stream, args)`` launching ``compiled`` (a ``CompiledKernel``) on ``grid``, or None if
    this process cannot launch it directly (see :func:`unavailable_reason`; also a kernel that needs
    scratch memory). ``args``: every kernel parameter in signature order, as ``JITFunction.run``
    passes them (``bound_args.values()``), data pointers as ints; ``stream``: a raw CUDA stream
    handle (:func:`current_stream`)."""
    form = launch_form(compiled, grid)
    if form is None:
        return None
    launch, (gx, gy, gz), (function, coop, pdl, _, _, meta, _, _, _) = form

    def go(stream: int, args: tuple) -> None:
        launch(gx, gy, gz, stream, function, coop, pdl, None, None, meta, None, None, None, *args)

    return go


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2(n)`` for an int n >= 1 (1 for n <= 1), without a Python call of
    Triton's: on Triton 3.6 it (and ``triton.cdiv``) is a ``ConstexprFunction`` whose ``__call__``
    costs microseconds of host time, paid per launch by the kernels' host code."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def int_class(x: int) -> int:
    """The class of an integer kernel argument under Triton's specialisation (``JITFunction``'s
    ``specialize_impl`` for a plain int without ``do_not_specialize``): 4 for the value 1
    (compiled as a constant), else 0 (int32), 1 (int32, divisible by 16), 2 (int64) or 3 (int64,
    divisible by 16). Values of one class get one binary; a binary must never run values of
    another class. For tensor sizes and strides, which lie in [0, 2^63): the int32 / int64 split
    is at 2^31 (Triton's uint64 class, from 2^63, cannot occur)."""
    return 4 if x == 1 else (x & 15 == 0) + 2 * (x > 0x7FFFFFFF)


def cache_classes(c: int, k_stride: tuple, v_stride: tuple):
    """:func:`int_class` of a 4-D KV cache's length ``c`` (``k.shape[1]``) and of every stride
    of both caches (``k.stride()``, ``v.stride()``): what a decode plan and the decode fast path
    key on instead of the values, which the plan passes per call. A cache that grows by one
    token per step (a view ``k[:, :filled]`` of one buffer, or a fresh ``torch.cat``, whose batch
    stride grows too; a transposed ``(batch, heads, seq, dim)`` buffer, whose head stride does)
    so keeps its plan and its binaries within a class; a length that becomes a multiple of 16
    gets another plan.

    Two forms, a function of the classes (so equal classes give equal results): where every
    stride but the last is an int32 multiple of 16 and both last strides are 1 (the usual
    layouts, headdim a multiple of 16), the length's class alone (an int); otherwise the tuple
    of the nine classes. The first is cheaper per call (a few integer operations)."""
    k0, k1, k2, k3 = k_stride
    v0, v1, v2, v3 = v_stride
    s = k0 | k1 | k2 | v0 | v1 | v2  # strides are >= 0: s < 2^31 iff each one is
    if k3 == 1 and v3 == 1 and not s & 15 and s <= 0x7FFFFFFF:
        return 4 if c == 1 else (c & 15 == 0) + 2 * (c > 0x7FFFFFFF)
    return tuple(map(int_class, (c, k0, k1, k2, k3, v0, v1, v2, v3)))


def grid_launcher(compiled) -> Callable[[int, int, int, int, tuple], None] | None:
    """:func:`launcher` with the grid given per call: ``go(gx, gy, gz, stream, args)`` (a grid is
    no part of a binary's specialisation; packed documents launch the same binary over as many
    documents as each call has). ``go(..., args, True)`` launches it as a programmatic dependent
    of the previous launch on the stream: the attribute is an argument of Triton's C launcher,
    not part of the binary (Triton's ``launch_pdl`` compile option only sets its default). None
    where :func:`launcher` gives None."""
    parts = _launch_parts(compiled)
    if parts is None:
        return None
    launch, function, coop, pdl, meta = parts

    def go(gx: int, gy: int, gz: int, stream: int, args: tuple, dependent: bool = pdl) -> None:
        launch(gx, gy, gz, stream, function, coop, dependent, None, None, meta, None, None, None, *args)

    return go


# The CUtensorMaps of host tensor descriptors (Gluon kernels' TMA arguments), encoded once per
# (address, shape, strides, padding, argument's encoding) by :func:`tma_grid_launcher`'s launchers;
# cleared when full. An entry is the encoding of those values alone (the map holds the address,
# dims, strides, element type, swizzle and box), so a later tensor at the same address with the
# same shape and strides gets the same, correct, map.
_TMA_MAPS: dict = {}
TMA_MAPS_MAX = 4096


def tma_grid_launcher(compiled) -> Callable[[int, int, int, int, tuple], None] | None:
    """:func:`grid_launcher` for a kernel with host tensor-descriptor arguments, whose
    CUtensorMaps are cached (:data:`_TMA_MAPS`) instead of encoded on every launch: Triton 3.6's
    launcher wraps the C ``launch`` in ``wrap_handle_tensordesc``'s ``inner``, which calls
    ``make_tensordesc_arg`` (a ``cuTensorMapEncodeTiled``) for each descriptor of each launch; the
    training step of a model launches the same descriptors step after step (the caching
    allocator hands the same addresses back). Here the C ``launch`` is taken from that closure
    and ``make_tensordesc_arg`` runs on a cache miss only. None where the launcher is not that
    layout (then :func:`grid_launcher`), or where a descriptor has no encoding metadata."""
    parts = _launch_parts(compiled)
    if parts is None:
        return None
    launch, function, coop, pdl, meta = parts
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if code is None or not closure:
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure), strict=False))
    raw, indices, metas = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
    if not callable(raw) or not indices or metas is None or len(metas) != len(indices):
        return None
    if any(not isinstance(m, dict) for m in metas):
        return None  # no encoding metadata: Triton passes the base tensor itself, nothing to cache
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except Exception:  # noqa: BLE001 - no such helper: the plain launcher
        return None
    try:
        where = {i: (m, (m["swizzle"], m["elem_size"], m["elem_type"], tuple(m["block_size"]), m["fp4_padded"]))
                 for i, m in zip(sorted(indices), metas, strict=True)}  # fmt: skip
    except (KeyError, TypeError):
        return None
    maps = _TMA_MAPS

    def go(gx: int, gy: int, gz: int, stream: int, args: tuple, dependent: bool = pdl) -> None:
        final = []
        for i, a in enumerate(args):
            m = where.get(i)
            if m is None:
                final.append(a)
                continue
            key = (a.base.data_ptr(), tuple(a.shape), tuple(a.strides), a.padding, m[1])
            enc = maps.get(key)
            if enc is None:
                enc = make_tensordesc_arg(a, m[0])
                if len(maps) >= TMA_MAPS_MAX:
                    maps.clear()
                maps[key] = enc
            final.extend(enc)
        raw(gx, gy, gz, stream, function, coop, dependent, None, None, meta, None, None, None, *final)

    return go


# The CUDA state a direct launch reads per call, each one C call of torch (no Python frame: on
# the H100 host a frame costs ~0.3 us and a decode call is host-bound, issue 23):
#   current_stream(device_index) -> int: the raw handle of that device's current stream (what
#       Triton launches on);
#   current_device() -> int: the current CUDA device index (Triton launches on it, whatever the
#       tensors' device);
#   capturing() -> bool: whether the current CUDA stream is capturing a graph;
#   tensor_device(t) -> int: the CUDA device index of tensor t, -1 on the CPU.
# Module attributes, so that a test can stand them in. A torch built without CUDA lacks some of
# them: then they raise (no plan on a CPU tensor launches directly, nothing calls them there).
#
# The device guard. Triton launches on the current device, whatever the tensors' (their pointers
# then belong to another device: an illegal address, or with peer access a launch on the wrong
# device's stream, unordered with the tensors' own: a race), and so does a direct launch. So
# every entry point that launches (TrainPlan.forward / backward and the per-call paths of
# triton_launch.py, DecodePlan.launch and decode_triton_jit of triton_decode.py, the rotary,
# cross-entropy and LayerNorm launches) starts with
#     dev = tensor_device(x)          # or the plan's device index, read once when it was built
#     if dev >= 0 and current_device() != dev:
#         with torch.cuda.device(dev):
#             return <the same call>
# one C call on the usual path (a plan already read the current device per call for its direct
# launch), the context manager only for a call whose current device is another: under it the
# call's buffers, stream lookups and launches (the direct ones included) are the tensors'
# device's, and the current device is restored on exit.


def _no_cuda(*_args):
    raise RuntimeError("this torch build has no CUDA support: there is no CUDA stream or device to query")


current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _no_cuda)
current_device = getattr(torch._C, "_cuda_getDevice", _no_cuda)
capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", _no_cuda)


tensor_device = torch.Tensor.get_device  # a C method: no Python frame per call


class DirectKernel:
    """``kernel[grid](*args, **options)`` for a call site that passes its ``n_ptr`` tensors first
    and only non-tensor values after them (sizes, strides, scales, constexprs, in signature
    order): after the first call with a given key, the compiled kernel is launched directly.

    The key is a superset of what Triton specialises on, built without per-argument Python:
    the grid, the argument tail itself (every integer by value, every constexpr by value), the
    options, the tensors' dtypes and the device. The tensors' 16-byte alignment is checked per
    call (all aligned, or Triton's path). Triton's path also runs under the interpreter, with the
    A/B switch off (``flags.set_direct_launch(False)``), with a launch hook installed, when the
    current device is not the tensors', and wherever :func:`launcher` gives None. At most
    ``max_plans`` keys are kept per kernel (the oldest dropped first).

    Used for the training kernels (``triton_launch.py``): their call sites already build the
    argument lists, so the saving is Triton's ``JITFunction.run`` (binding, specialising and
    hashing ~40 arguments, launch metadata): tens of microseconds per launch on the H100 host.
    """

    def __init__(self, kernel, n_ptr: int, max_plans: int = 64):
        self.kernel = kernel
        self.n_ptr = n_ptr
        self.max_plans = max_plans
        self.names = tuple(getattr(kernel, "arg_names", ()))  # the parameters, in signature order
        self.plans: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **options: self.launch(grid, args, options)

    def _full_tail(self, args: tuple, options: dict) -> tuple | None:
        """Every parameter after the tensors, in signature order (keyword constexprs put in
        their places), or None when that cannot be built (a parameter left to its default, a
        tensor after the first ``n_ptr`` arguments)."""
        if not self.names or len(args) > len(self.names):
            return None
        rest = self.names[len(args) :]
        if any(name not in options for name in rest):
            return None
        tail = args[self.n_ptr :] + tuple(options[name] for name in rest)
        if any(isinstance(a, torch.Tensor) for a in tail):
            return None
        return tail

    @staticmethod
    def key(grid, ptrs, tail: tuple, options: dict, dev: int) -> tuple:
        """The key of a launch: grid, the tensors' dtypes, every non-tensor argument (``tail``:
        the positional ones after the tensors), the keyword options in call order, the device."""
        return (tuple(grid), tail, tuple(options.items()), tuple([t.dtype for t in ptrs]), dev)

    def entry(self, grid, ptrs, tail: tuple, options: dict):
        """What :meth:`launch` keeps for this launch: ``(go, full tail, compiled kernel)``
        (launched directly; the compiled kernel for :func:`grid_launcher`),
        False (Triton's path for good) or None (no aligned call with this key on the tensors'
        device yet, or the direct launch is off). For callers that hold launches of their own
        (``triton_launch.TrainPlan``): they launch ``go(stream, (*pointers, *full tail))``."""
        dev = tensor_device(ptrs[0])
        if dev < 0:
            return None
        return self.plans.get(self.key(grid, ptrs, tail, options, dev))

    def launch(self, grid, args: tuple, options: dict):
        n = self.n_ptr
        ptrs = args[:n]
        dev = tensor_device(ptrs[0])
        if dev < 0 or not flags.direct_launch_enabled():
            return self.kernel[grid](*args, **options)
        key = self.key(grid, ptrs, args[n:], options, dev)
        addr = [t.data_ptr() for t in ptrs]
        misaligned = 0
        for a in addr:
            misaligned |= a
        ok = not misaligned & 15 and current_device() == dev and hooks_idle()
        plan = self.plans.get(key) if ok else None
        if plan:
            go, tail, _ = plan
            go(current_stream(dev), (*addr, *tail))
            return None
        ret = self.kernel[grid](*args, **options)
        if ok and plan is None:  # the first aligned call with this key: keep its compiled kernel
            plan = False  # False: Triton's path for this key from now on
            tail = self._full_tail(args, options)
            if tail is not None and unavailable_reason() is None:
                go = launcher(ret, grid)
                if go is not None:
                    plan = (go, tail, ret)
            if len(self.plans) >= self.max_plans:
                self.plans.pop(next(iter(self.plans)), None)
            self.plans[key] = plan
        return ret
