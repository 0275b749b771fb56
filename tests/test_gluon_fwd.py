"""The Gluon forward (kernels/gluon_fwd.py, gluon_fwd_kernel.py): when it runs, and that it is exact.

CPU: the gate (:func:`gluon_fwd.problem`) and the switch (``flags.set_gluon_forward``). CUDA
(sm_90 with Triton's Gluon): impl="triton" with the Gluon forward against the float64 reference,
forward and backward (the backward runs the Triton kernels on the Gluon forward's out and lse),
judged as tests/test_triton.py judges the Triton path: error <= 2x the error of the Triton path
with the Gluon forward off (same dtype, same inputs) + 1e-3; the lo ranges must not change a
bit; a failing first launch falls back to the Triton kernels with a warning.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from gluon_cases import (
    OnCuda,
    err,
    geometry_cases,
    gluon_ready,
    lse_merge,
    needs_gluon,
    qkv,
    run,
    switch_on,
    tma_box,
)
from helpers import interpreted

from dilated_attention import call_cache, dilated_attention, flags
from dilated_attention.kernels import gluon_fwd
from dilated_attention.kernels import triton_launch as L


@pytest.fixture
def switch_reset():
    yield
    flags.set_gluon_forward(None)


@pytest.fixture(autouse=True)
def small_calls_too(monkeypatch):
    # the cases are small (N <= 8192, <= 8 heads): below gluon_fwd.MIN_ROWS, which keeps small
    # calls on the Triton kernels for their host time, and their head-dim-64 blocks are below
    # D64_MIN_BLOCK; the kernels' exactness depends on neither
    monkeypatch.setattr(gluon_fwd, "MIN_ROWS", 0)
    monkeypatch.setattr(gluon_fwd, "D64_MIN_BLOCK", 0)

# --------------------------------------------------------------------------------- CPU


def test_switch_setter_getter_and_environment(monkeypatch, switch_reset):
    flags.set_gluon_forward(False)
    assert flags.gluon_forward_enabled() is False
    flags.set_gluon_forward(True)
    assert flags.gluon_forward_enabled() is True
    monkeypatch.setenv(flags.ENV_GLUON_FWD, "0")
    flags.set_gluon_forward(None)
    assert flags.gluon_forward_enabled() is False
    monkeypatch.setenv(flags.ENV_GLUON_FWD, "1")
    flags.set_gluon_forward(None)
    assert flags.gluon_forward_enabled() is True
    monkeypatch.delenv(flags.ENV_GLUON_FWD)
    flags.set_gluon_forward(None)
    assert flags.gluon_forward_enabled() is True  # on by default
    with pytest.raises(TypeError, match="set_gluon_forward"):
        flags.set_gluon_forward("yes")


@pytest.mark.parametrize("w,r", [(64, 1), (64, 4), (2048, 3), (4096, 6), (768, 5), (3072, 7), (100, 9)])
@pytest.mark.parametrize("hs,he", [(0, 4), (0, 13), (6, 11), (14, 15)])
def test_length_classes_cover_each_block_once(w, r, hs, he):
    """The launches of a branch (length classes x the heads the kernel enumerates in each)
    read and write exactly the rows of the branch's geometry: head h, offset c = h % r, rows
    s*w + c + r*t inside segment s, each (row, head) once, and no row of another segment (the
    TMA box stops at L)."""
    if w % r and hs % r:
        pytest.skip("uneven blocks need the branch's first head at a multiple of r (the gate)")
    nseg = 3
    want = {(s * w + h % r + r * t, h) for h in range(hs, he) for s in range(nseg)
            for t in range(-(-(w - h % r) // r)) if h % r < w}  # fmt: skip
    got = []
    classes = gluon_fwd.length_classes(w, r)
    assert sum(c1 - c0 for _, c0, c1 in classes) == r and classes[0][1] == 0
    assert (len(classes) == 1) == (w % r == 0)
    for big_l, c0, c1 in classes:
        n = gluon_fwd.class_heads(hs, he, r, c0, c1) if (c0, c1) != (0, r) else he - hs
        for i in range(n):
            h = gluon_fwd.class_head(i, hs, r, c0, c1 - c0)
            c = h % r
            assert hs <= h < he and c0 <= c < c1
            for s in range(nseg):
                rows = [s * w + c + r * t for t in range(big_l)]
                assert rows[-1] < (s + 1) * w, "a block reads into the next segment"
                got += [(row, h) for row in rows]
    assert len(got) == len(set(got)) and set(got) == want


class _EmulatedKernel:
    """``gluon_fwd_kernel`` in float64 on the CPU, through the descriptors it is given: each
    access is the box TMA would move, rows [0, L) of one (block, column) of the descriptor's
    view (``as_strided`` of its base with its strides: a block axis longer than the block's
    rows reads the next segment's rows, as TMA would, and past the tensor raises; L past the
    descriptor's own block axis is an error here), the program's head, columns, lse index and merge
    (FIRST / COMP / STORE_LO, the (hi, lo) pair) as the kernel computes them. What it checks:
    the host's launches (length classes, descriptors, grids, lo ranges, heads) and the kernel's
    index formulas; not the kernel's pipelining."""

    BM, WG_M = 128, 64

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.run(grid, *a, **kw)

    def run(self, grid, q_desc, k_desc, v_desc, o_desc, lo_desc, lse, qk_scale, n, big_l, w, nseg, s0,
            lo_nseg, lo_s0, r, nh, hkv, hs, nhb, c0, cw, *, CAUSAL, FIRST, COMP, STORE_LO, CLASSES, **_):
        self.launches.append((w, r, big_l, c0, cw if CLASSES else None))
        def box(d, blk, col):  # rows [0, big_l) of one (block, column)
            return tma_box(d, blk, col, big_l)

        qv, kv, vv, ov, lov = q_desc, k_desc, v_desc, o_desc, lo_desc
        assert grid[0] == -(-big_l // self.BM)
        scale = qk_scale / 1.4426950408889634
        t = torch.arange(big_l)
        for pid1 in range(grid[1]):
            seg = s0 + pid1
            for bh in range(grid[2]):
                b, i = divmod(bh, nhb)
                h = hs + (i // cw) * r + c0 + i % cw if CLASSES else hs + i
                c = h % r
                blk, col, kcol = b * nseg + seg, c * nh + h, c * hkv + h // (nh // hkv)
                lo_blk = b * lo_nseg + seg - lo_s0
                qb, kb, vb = (box(x, blk, cc).double() for x, cc in ((qv, col), (kv, kcol), (vv, kcol)))
                sc = qb @ kb.T * scale
                if CAUSAL:
                    sc = sc.masked_fill(t[None, :] > t[:, None], float("-inf"))
                lse_b = torch.logsumexp(sc, -1)
                out_b = torch.softmax(sc, -1) @ vb
                idx = (b * nh + h) * n + seg * w + c + r * t
                # the kernel's LSE pointer: the view's first element, then raw offsets
                flat = torch.as_strided(lse, (lse.untyped_storage().nbytes() // 4 - lse.storage_offset(),), (1,))
                if FIRST:
                    new_out, new_lse = out_b, lse_b
                else:
                    lse_a = flat[idx].double()
                    out_a = box(ov, blk, col).double()
                    if COMP:
                        out_a = out_a + box(lov, lo_blk, col).double()
                    new_out, new_lse = lse_merge(out_a, lse_a, out_b, lse_b)
                hi = new_out.to(ov.base.dtype)
                box(ov, blk, col).copy_(hi)
                if COMP and STORE_LO:
                    box(lov, lo_blk, col).copy_((new_out - hi.double()).to(lov.base.dtype))
                flat[idx] = new_lse.float()


@pytest.mark.parametrize("b,n,seg,dil,h,hkv,ha", [
    (2, 384, [64, 192], [1, 5], 4, 2, "all"),  # 192 % 5: blocks of 39 and 38 rows
    (2, 384, [96, 192], [5, 7], 8, 8, "all"),  # both uneven, r = 7 with 8 heads: the last group partial
    (2, 384, [192], [5], 3, 1, "all"),  # one branch, r > 1 first (filled buffers), H < r
    (2, 384, [64, 128], [2, 3], 6, 6, "split"),  # heads [3, 6) of r = 3, 128 % 3 != 0
    (2, 384, [64, 96, 192], [1, 2, 4], 4, 2, "all"),  # even: one class per branch
    (1, 400, [64, 192], [1, 5], 4, 2, "all"),  # short last segments of 16 rows (TAIL_SEGMENTS)
    (1, 400, [96, 160], [2, 3], 6, 3, "all"),  # tails of 16 and 80 rows, 160 % 3 and 80 % 3 != 0
    (1, 400, [64, 512], [1, 4], 4, 4, "all"),  # N < w: the whole sequence is one short segment
    (2, 400, [64, 192], [1, 5], 4, 2, "all"),  # batch 2 with tails: each entry apart (TAIL_BATCHES)
    (3, 400, [96, 512], [2, 4], 4, 4, "all"),  # batch 3, r > 1 first (filled buffers), N < w
])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lo_rows", [None, 192])
def test_gluon_forward_host_path_with_emulated_kernel(seed, monkeypatch, switch_reset, b, n, seg, dil, h, hkv,
                                                     ha, causal, lo_rows):  # fmt: skip
    """triton_launch._gluon_forward (buffers, lo ranges, branch order, length classes, short
    last segments, TMA descriptors, grids) with the kernel emulated in float64
    (:class:`_EmulatedKernel`): the float64 reference's out and lse to bf16 precision; uneven
    branches with UNEVEN_BLOCKS, N % w != 0 with TAIL_SEGMENTS."""
    from dilated_attention import reference
    from dilated_attention.branches import branch_head_ranges as ranges_of
    from dilated_attention.kernels import direct_launch

    emu = _EmulatedKernel()
    monkeypatch.setattr(gluon_fwd, "UNEVEN_BLOCKS", True)
    monkeypatch.setattr(gluon_fwd, "TAIL_SEGMENTS", True)
    monkeypatch.setattr(gluon_fwd, "TAIL_BATCHES", True)
    monkeypatch.setattr(gluon_fwd, "problem", lambda *a: None)  # as on a Hopper GPU
    mod = types.SimpleNamespace(BM=emu.BM, WG_M=emu.WG_M, gluon_fwd_kernel=emu)
    monkeypatch.setattr(gluon_fwd, "kernel_module", lambda: mod)
    monkeypatch.setattr(gluon_fwd, "_failed", {})
    monkeypatch.setattr(direct_launch, "current_device", lambda: -1)
    flags.set_gluon_forward(True)
    q, k, v = qkv(b, n, h, hkv, 16, torch.bfloat16)
    hr = ranges_of(h, len(seg), ha)
    got = L._gluon_forward(q, k, v, seg, dil, causal, 0.25, hr, lo_rows)
    assert got is not None and emu.launches
    uneven = [(w, r) for w, r, _, _ in L.branch_list(seg, dil, hr) if w % r]
    assert all(any(x[:2] == u and x[4] is not None for x in emu.launches) for u in uneven)
    want_out, want_lse = reference.dilated_attention_reference(
        q.double(), k.double(), v.double(), seg, dil, causal=causal, softmax_scale=0.25, head_assignment=ha)
    assert (got[0].double() - want_out).abs().max().item() < 2e-2
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(got[1]))
    assert (got[1].double()[fin] - want_lse[fin]).abs().max().item() < 1e-4


@pytest.mark.parametrize("b,n,seg,dil,h,hkv,lo_rows", [
    (2, 384, [64, 192], [1, 5], 4, 2, None),  # length classes: two launches of one branch
    (1, 400, [64, 192], [1, 5], 4, 2, 192),  # short last segments, lo ranges (a zeroing between)
    (3, 400, [96, 512], [2, 4], 4, 4, None),  # batch 3 with tails: each entry apart, filled buffers
])  # fmt: skip
@pytest.mark.parametrize("pdl", [False, True], ids=["pdl-off", "pdl-on"])
def test_gluon_forward_dependent_launches(seed, monkeypatch, switch_reset, b, n, seg, dil, h, hkv, lo_rows, pdl):
    """gluon_fwd.PDL: every launch of a call after its first is a programmatic dependent one
    (``gluon_fwd.launch(..., pdl=True)``), the first never (its predecessor is not the call's);
    off (or on the CPU, where gluon_fwd.chain never allows them): none. The emulated kernel's
    results are the reference's either way (the kernels' order does not change what they
    compute)."""
    from dilated_attention import reference
    from dilated_attention.branches import branch_head_ranges as ranges_of
    from dilated_attention.kernels import direct_launch

    emu = _EmulatedKernel()
    monkeypatch.setattr(gluon_fwd, "problem", lambda *a: None)  # as on a Hopper GPU
    mod = types.SimpleNamespace(BM=emu.BM, WG_M=emu.WG_M, gluon_fwd_kernel=emu)
    monkeypatch.setattr(gluon_fwd, "kernel_module", lambda: mod)
    monkeypatch.setattr(gluon_fwd, "_failed", {})
    monkeypatch.setattr(direct_launch, "current_device", lambda: -1)
    monkeypatch.setattr(gluon_fwd, "PDL", pdl)
    assert not gluon_fwd.chain(torch.zeros(1)).allowed  # a CPU tensor: never
    monkeypatch.setattr(gluon_fwd, "chain", lambda x: gluon_fwd.Chain(gluon_fwd.PDL))  # as on a GPU
    seen = []
    real_launch = gluon_fwd.launch
    monkeypatch.setattr(gluon_fwd, "launch", lambda *a: seen.append(a[4]) or real_launch(*a))
    flags.set_gluon_forward(True)
    q, k, v = qkv(b, n, h, hkv, 16, torch.bfloat16)
    hr = ranges_of(h, len(seg), "all")
    got = L._gluon_forward(q, k, v, seg, dil, False, 0.25, hr, lo_rows)
    assert got is not None and len(seen) == len(emu.launches) > 2
    assert seen == [False] + [pdl] * (len(seen) - 1)
    want_out, _ = reference.dilated_attention_reference(q.double(), k.double(), v.double(), seg, dil,
                                                        softmax_scale=0.25)  # fmt: skip
    assert (got[0].double() - want_out).abs().max().item() < 2e-2


def test_direct_launch_of_gluon_kernels(monkeypatch):
    """gluon_fwd.launch: the first launch of a specialisation through ``kernel[grid]``, later
    ones through the compiled kernel's grid launcher with every parameter in signature order;
    an int of another class, a misaligned tensor, other constexprs: another key; with
    DIRECT_LAUNCH off, a kernel without a launcher, or a launch hook installed: ``kernel[grid]``."""
    from dilated_attention.kernels import direct_launch

    jit_calls, direct_calls = [], []

    class FakeKernel:
        arg_names = ("desc", "x", "n", "scale", "BN", "CAUSAL")

        def __getitem__(self, grid):
            def run(*args, **options):
                jit_calls.append((grid, args, options))
                return "compiled"

            return run

    kern = FakeKernel()
    launchers = {"compiled": lambda gx, gy, gz, stream, args, *dep: direct_calls.append(((gx, gy, gz), stream, args,
                                                                                          *dep))}  # fmt: skip
    monkeypatch.setattr(direct_launch, "compiled_of", lambda ret: ret)
    monkeypatch.setattr(direct_launch, "grid_launcher", lambda c: launchers.get(c))
    monkeypatch.setattr(direct_launch, "current_stream", lambda dev: 99)
    monkeypatch.setattr(direct_launch, "hooks_idle", lambda: True)
    monkeypatch.setattr(gluon_fwd, "_direct", {})
    monkeypatch.setattr(gluon_fwd, "DIRECT_LAUNCH", True)
    x = torch.zeros(64, 4, 64, dtype=torch.bfloat16)
    buf = torch.zeros(64)
    desc = gluon_fwd.block_desc(x.view(1, 64, 4, 64), 64, 2, 16)
    opts = dict(BN=128, CAUSAL=True, num_warps=4, maxnreg=168)

    gluon_fwd.launch(kern, (3, 2), (desc, buf, 32, 0.5), opts)
    assert len(jit_calls) == 1 and not direct_calls
    gluon_fwd.launch(kern, (5, 1), (desc, buf, 48, 0.25), opts)  # same classes: direct
    assert len(jit_calls) == 1 and direct_calls[-1] == ((5, 1, 1), 99, (desc, buf, 48, 0.25, 128, True))
    # a dependent launch (gluon_fwd.PDL): the same binary, the attribute passed to its launcher
    gluon_fwd.launch(kern, (5, 1), (desc, buf, 48, 0.25), opts, True)
    assert len(jit_calls) == 1 and direct_calls[-1] == ((5, 1, 1), 99, (desc, buf, 48, 0.25, 128, True), True)
    for args, o in (((desc, buf, 33, 0.5), opts),  # 33: not a multiple of 16
                    ((desc, buf[1:], 32, 0.5), opts),  # 4-byte aligned
                    ((desc, buf, 32, 0.5), {**opts, "CAUSAL": False})):  # fmt: skip
        n = len(jit_calls)
        gluon_fwd.launch(kern, (1, 1), args, o)
        assert len(jit_calls) == n + 1, args[2:]
    other = gluon_fwd.block_desc(x.view(1, 64, 4, 64), 64, 2, 32)  # another box
    n = len(jit_calls)
    gluon_fwd.launch(kern, (1, 1), (other, buf, 32, 0.5), opts)
    assert len(jit_calls) == n + 1
    monkeypatch.setattr(direct_launch, "hooks_idle", lambda: False)
    gluon_fwd.launch(kern, (1, 1), (desc, buf, 32, 0.5), opts)
    assert len(jit_calls) == n + 2
    monkeypatch.setattr(gluon_fwd, "DIRECT_LAUNCH", False)
    gluon_fwd.launch(kern, (1, 1), (desc, buf, 32, 0.5), opts, True)  # Triton's path: an ordinary launch
    assert len(jit_calls) == n + 3 and jit_calls[-1][2] == opts
    monkeypatch.setattr(gluon_fwd, "DIRECT_LAUNCH", True)
    launchers.clear()  # a kernel the direct launch cannot take: Triton's path, also later
    monkeypatch.setattr(gluon_fwd, "_direct", {})
    for _ in range(2):
        gluon_fwd.launch(kern, (1, 1), (desc, buf, 32, 0.5), opts)
    assert len(jit_calls) == n + 5


def test_light_descriptors(monkeypatch):
    """gluon_fwd.LIGHT_DESCRIPTORS: block_view gives a Desc with the fields of block_desc's
    TensorDescriptor (the same key in the direct-launch table), Triton's path receives the
    TensorDescriptor made from it, the direct path the Desc itself; off, block_view gives the
    TensorDescriptor."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dilated_attention.kernels import direct_launch

    x = torch.zeros(1, 128, 4, 64, dtype=torch.bfloat16)
    real = gluon_fwd.block_desc(x, 64, 2, 16, 32)
    view = gluon_fwd.block_view(x, 64, 2, 16, 32)
    assert type(view) is gluon_fwd.Desc and type(real) is TensorDescriptor
    for f in ("shape", "strides", "block_shape", "layout", "padding"):
        assert getattr(view, f) == getattr(real, f), f
    assert view.base is real.base is x and gluon_fwd._spec(view) == gluon_fwd._spec(real)
    assert view.real() == real
    seen = []

    class FakeKernel:
        arg_names = ("desc", "buf", "n", "BN")

        def __getitem__(self, grid):
            return lambda *args, **options: seen.append(("jit", args)) or "compiled"

    monkeypatch.setattr(direct_launch, "compiled_of", lambda ret: ret)
    monkeypatch.setattr(direct_launch, "grid_launcher",
                        lambda c: lambda gx, gy, gz, stream, args: seen.append(("direct", args)))  # fmt: skip
    monkeypatch.setattr(direct_launch, "current_stream", lambda dev: 0)
    monkeypatch.setattr(direct_launch, "hooks_idle", lambda: True)
    monkeypatch.setattr(gluon_fwd, "_direct", {})
    monkeypatch.setattr(gluon_fwd, "DIRECT_LAUNCH", True)
    kern, buf = FakeKernel(), torch.zeros(8)
    for _ in range(2):
        gluon_fwd.launch(kern, (1,), (view, buf, 32), dict(BN=64))
    (how0, args0), (how1, args1) = seen
    assert how0 == "jit" and type(args0[0]) is TensorDescriptor and args0[0] == real
    assert how1 == "direct" and args1[0] is view
    monkeypatch.setattr(gluon_fwd, "LIGHT_DESCRIPTORS", False)
    assert type(gluon_fwd.block_view(x, 64, 2, 16, 32)) is TensorDescriptor


def test_grid_launcher_takes_the_dependent_attribute_per_call(monkeypatch):
    """direct_launch.grid_launcher's ``go``: the compiled kernel's own launch_pdl by default, the
    ``dependent`` argument where given (gluon_fwd.PDL's launches: the same binary)."""
    from dilated_attention.kernels import direct_launch

    calls = []
    monkeypatch.setattr(direct_launch, "_launch_parts", lambda c: (lambda *a: calls.append(a), "fn", False, False, "m"))
    go = direct_launch.grid_launcher("compiled")
    go(2, 1, 1, 5, (1, 2))
    go(2, 1, 1, 5, (1, 2), True)
    assert calls == [(2, 1, 1, 5, "fn", False, False, None, None, "m", None, None, None, 1, 2),
                     (2, 1, 1, 5, "fn", False, True, None, None, "m", None, None, None, 1, 2)]  # fmt: skip


def test_tma_grid_launcher_caches_the_maps(monkeypatch):
    """direct_launch.tma_grid_launcher: takes the C launch out of Triton 3.6's descriptor wrapper
    (a closure over launcher / tensordesc_indices / tensordesc_meta), encodes each descriptor
    once per (address, shape, strides, padding, encoding) and passes the rest through in order;
    None without encoding metadata or without that wrapper."""
    import triton.backends.nvidia.driver as nv

    from dilated_attention.kernels import direct_launch

    raw_calls, encodes = [], []

    def wrap(launcher, tensordesc_indices, tensordesc_meta):
        def inner(*args):  # Triton's inner reads these three
            return launcher, tensordesc_indices, tensordesc_meta

        return inner

    meta = {"swizzle": 128, "elem_size": 2, "elem_type": 10, "block_size": [1, 64, 1, 64], "fp4_padded": False}
    meta2 = dict(meta, block_size=[1, 128, 1, 64])
    inner = wrap(lambda *a: raw_calls.append(a), {0, 2}, [meta, meta2])
    monkeypatch.setattr(direct_launch, "_launch_parts", lambda c: (inner, "fn", False, True, "packed"))
    monkeypatch.setattr(nv, "make_tensordesc_arg",
                        lambda a, m: encodes.append(m) or [("map", a.base.data_ptr(), m["block_size"][1]),
                                                           *a.shape, *a.strides])  # fmt: skip
    monkeypatch.setattr(direct_launch, "_TMA_MAPS", {})
    go = direct_launch.tma_grid_launcher("compiled")
    x = torch.zeros(1, 256, 4, 64, dtype=torch.bfloat16)
    d0, d2 = gluon_fwd.Desc(x, [4, 64, 8, 64], [1, 2, 3, 1], [1, 64, 1, 64], None), gluon_fwd.Desc(
        x, [4, 64, 8, 64], [1, 2, 3, 1], [1, 128, 1, 64], None)  # fmt: skip
    for _ in range(2):
        go(3, 2, 1, 7, (d0, 5, d2, 0.5, True))
    assert len(encodes) == 2 and encodes == [meta, meta2]  # the second launch: from the cache
    want = (3, 2, 1, 7, "fn", False, True, None, None, "packed", None, None, None,
            ("map", x.data_ptr(), 64), 4, 64, 8, 64, 1, 2, 3, 1, 5,
            ("map", x.data_ptr(), 128), 4, 64, 8, 64, 1, 2, 3, 1, 0.5, True)  # fmt: skip
    assert raw_calls == [want, want]
    go(3, 2, 1, 7, (d0, 5, d2, 0.5, True), False)  # the launch attribute per call (gluon_fwd.PDL)
    assert raw_calls[-1][6] is False and raw_calls[-1][:6] == want[:6] and raw_calls[-1][7:] == want[7:]
    y = torch.zeros_like(x)  # another address: encoded afresh
    go(3, 2, 1, 7, (d0._replace(base=y), 5, d2, 0.5, True))
    assert len(encodes) == 3 and raw_calls[-1][13] == ("map", y.data_ptr(), 64)
    monkeypatch.setattr(direct_launch, "TMA_MAPS_MAX", 3)
    go(3, 2, 1, 7, (d0._replace(shape=[2, 64, 8, 64]), 5, d2, 0.5, True))  # full: cleared, then refilled
    assert len(direct_launch._TMA_MAPS) == 2 and len(encodes) == 5
    assert direct_launch.tma_grid_launcher("compiled") is not None
    no_meta = wrap(lambda *a: None, {0}, [None])
    monkeypatch.setattr(direct_launch, "_launch_parts", lambda c: (no_meta, "fn", False, False, "packed"))
    assert direct_launch.tma_grid_launcher("compiled") is None
    monkeypatch.setattr(direct_launch, "_launch_parts", lambda c: (print, "fn", False, False, "packed"))
    assert direct_launch.tma_grid_launcher("compiled") is None


def test_problem_names_the_interpreter_or_the_device():
    q, k, v = qkv()
    why = gluon_fwd.problem(q, k, v, False, [(64, 1, 0, 4)])
    assert why is not None and ("interpreter" in why or "CUDA" in why), why


def test_view_problem_refuses_layouts_tma_cannot_view():
    q, _, _ = qkv(b=2)
    assert gluon_fwd.view_problem("q", q) is None
    packed = torch.randn(2, 256, 3, 4, 64)[:, :, 0]  # a slice of packed qkv: row stride 3 x H x D
    assert "strides" in gluon_fwd.view_problem("q", packed)
    heads_first = torch.randn(2, 4, 256, 64).transpose(1, 2)  # (B, H, N, D) transposed
    assert "strides" in gluon_fwd.view_problem("q", heads_first)
    odd = torch.randn(1, 256, 4, 66)[..., :64]  # rows of 66 elements: not 16-byte strided
    why = gluon_fwd.view_problem("q", odd)
    assert why is not None


def test_speed_rules_and_shipped_switches(monkeypatch):
    """shape_problem as on an sm_90 GPU (the device checks stood in for): the measured speed
    rules refuse what they name and nothing else, and blocks of two lengths and short last
    segments are taken as shipped (on since their CUDA tests passed, 2026-11-29)."""
    from dilated_attention.kernels import triton_import

    monkeypatch.undo()  # the autouse zeros of MIN_ROWS / D64_MIN_BLOCK: the shipped values
    monkeypatch.setattr(triton_import, "INTERPRET", False)
    monkeypatch.setattr(gluon_fwd, "_capability", lambda index: (9, 0))
    assert gluon_fwd.UNEVEN_BLOCKS and gluon_fwd.TAIL_SEGMENTS and gluon_fwd.TAIL_BATCHES
    assert gluon_fwd.DIRECT_LAUNCH and gluon_fwd.LIGHT_DESCRIPTORS
    assert (gluon_fwd.MIN_ROWS, gluon_fwd.D64_MIN_BLOCK) == (1 << 18, 2048)

    def why(b, n, h, d, seg, dil):
        q = OnCuda((b, n, h, d), torch.bfloat16)
        return gluon_fwd.shape_problem(q, q, q, [(w, r, 0, h) for w, r in zip(seg, dil, strict=True)])

    assert "MIN_ROWS" in why(1, 16384, 8, 128, [2048, 4096], [1, 2])  # 131072 rows
    assert why(1, 32768, 8, 128, [2048, 4096], [1, 2]) is None  # 262144
    # head dim 64: every block shorter than D64_MIN_BLOCK (the sweep's 8br-paper row's blocks)
    small = ([512, 1024, 2048, 8192], [1, 1, 2, 6])
    assert "D64_MIN_BLOCK" in why(2, 65536, 16, 64, *small)
    assert why(2, 65536, 16, 128, *small) is None  # head dim 128: not this rule's
    assert why(2, 65536, 16, 64, [512, 4096], [1, 2]) is None  # one branch's blocks of 2048
    monkeypatch.setattr(gluon_fwd, "D64_MIN_BLOCK", 0)
    assert why(2, 65536, 16, 64, *small) is None
    # w % r != 0 and a short last segment are taken, at batch 2 only under TAIL_BATCHES
    assert why(1, 100000, 16, 128, [2048, 32768], [1, 6]) is None
    assert why(2, 100000, 16, 128, [2048, 32768], [1, 6]) is None
    # each entry launched apart must clear MIN_ROWS alone: 10000 x 16 = 160000 rows (x 4 = 640000)
    assert "launches each entry apart" in why(4, 10000, 16, 128, [2048, 32768], [1, 6])
    assert why(4, 10240, 16, 128, [2048, 5120], [1, 5]) is None  # no short last segment
    assert why(4, 20000, 16, 128, [2048, 32768], [1, 6]) is None  # 320000 rows an entry
    monkeypatch.setattr(gluon_fwd, "TAIL_BATCHES", False)
    assert "TAIL_BATCHES" in why(2, 100000, 16, 128, [2048, 32768], [1, 6])
    assert why(1, 100000, 16, 128, [2048, 32768], [1, 6]) is None
    assert gluon_fwd.batch_entries(2, 100000, [(2048, 1, 0, 16)]) == [slice(0, 1), slice(1, 2)]
    assert gluon_fwd.batch_entries(2, 131072, [(2048, 1, 0, 16)]) is None
    assert gluon_fwd.batch_entries(1, 100000, [(2048, 1, 0, 16)]) is None
    monkeypatch.setattr(gluon_fwd, "UNEVEN_BLOCKS", False)
    assert "UNEVEN_BLOCKS" in why(1, 131072, 16, 128, [2048, 32768], [1, 6])


@interpreted
def test_cpu_forward_never_launches_gluon(seed, monkeypatch):
    called = []
    monkeypatch.setattr(gluon_fwd, "launch_branch", lambda *a, **kw: called.append(1))
    q, k, v = qkv(dtype=torch.float32)
    out = dilated_attention(q, k, v, [64, 128], [1, 2], impl="triton")
    assert out.shape == q.shape and not called


def test_stages_fit_shared_memory():
    # Q (128 x D) + STAGES x (K + V) (128 x D each), 2-byte elements, under Hopper's 227 KB
    for d in gluon_fwd.HEADDIMS:
        assert 2 * (128 * d + gluon_fwd.stages(d) * 2 * 128 * d) <= 227 * 1024


# --------------------------------------------------------------------------------- CUDA


def _spy(monkeypatch):
    calls = []
    real = gluon_fwd.launch_branch

    def spy(*a, **kw):
        calls.append(a[6:10])  # (w, r, hs, he)
        return real(*a, **kw)

    monkeypatch.setattr(gluon_fwd, "launch_branch", spy)
    return calls


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("kind,case", geometry_cases())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_forward_vs_reference(seed, monkeypatch, switch_reset, kind, case, causal, dtype):
    """Every geometry (gluon_cases.GEOMETRIES): even blocks, blocks of two lengths (w % r != 0),
    short last segments (N % w != 0), at batch 2 each entry launched apart; split heads too."""
    switch_on(monkeypatch, kind)
    _vs_reference(monkeypatch, case, causal, dtype)


def _vs_reference(monkeypatch, case, causal, dtype):
    b, n, h, hkv, d, seg, dil, ha = case
    q, k, v = qkv(b, n, h, hkv, d, torch.float64, "cuda")
    do = torch.randn_like(q)
    kw = dict(causal=causal, head_assignment=ha)
    ref = run(q, k, v, do, seg, dil, torch.float64, impl="reference", **kw)
    flags.set_gluon_forward(False)
    call_cache.clear()
    base = run(q, k, v, do, seg, dil, dtype, impl="triton", **kw)
    flags.set_gluon_forward(True)
    calls = _spy(monkeypatch)
    got = run(q, k, v, do, seg, dil, dtype, impl="triton", **kw)
    assert calls, "the Gluon forward did not run"
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    pairs = [("out", got[0], base[0], ref[0])]
    pairs += [(f"d{c}", a, bb, r) for c, a, bb, r in zip("qkv", got[2], base[2], ref[2], strict=True)]
    for name, a, bb, r in pairs:
        ea, eb = err(a, r), err(bb, r)
        assert ea <= 2 * eb + 1e-3, f"{name}: Gluon err {ea:.3g} > 2 x Triton err {eb:.3g} + 1e-3"
    fin = torch.isfinite(ref[1])
    assert torch.equal(fin, torch.isfinite(got[1])), "lse: rows without keys differ"
    assert err(got[1][fin], ref[1][fin]) <= 2 * err(base[1][fin], ref[1][fin]) + 1e-3, "lse"


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_lo_ranges_change_no_bit(seed, monkeypatch, causal):
    """The lo buffer in ranges (lo_rows) gives bitwise the one-range result, and runs Gluon."""
    q, k, v = qkv(1, 8192, 8, 4, 128, torch.bfloat16, "cuda")
    seg, dil, hr = [1024, 2048, 4096], [1, 2, 4], [(0, 8)] * 3
    calls = _spy(monkeypatch)
    one = L.forward(q, k, v, None, seg, dil, causal, 0.125, hr)
    n_one = len(calls)
    ranged = L.forward(q, k, v, None, seg, dil, causal, 0.125, hr, lo_rows=4096)
    assert n_one == 3 and len(calls) == 3 + 2 * 3  # two ranges of 4096 rows
    assert torch.equal(one[0], ranged[0]) and torch.equal(one[1], ranged[1])


@needs_gluon
@pytest.mark.cuda
def test_gluon_switch_off_and_overrides_run_triton(seed, monkeypatch, switch_reset):
    q, k, v = qkv(1, 4096, 4, 4, 128, torch.bfloat16, "cuda")
    seg, dil, hr = [1024, 4096], [1, 4], [(0, 4)] * 2
    calls = _spy(monkeypatch)
    flags.set_gluon_forward(False)
    off = L.forward(q, k, v, None, seg, dil, False, 0.125, hr)
    assert not calls
    flags.set_gluon_forward(True)
    L.forward(q, k, v, None, seg, dil, False, 0.125, hr, fold=True)  # fold asked: Triton's
    kpm = torch.zeros(1, 4096, dtype=torch.bool, device="cuda")
    L.forward(q, k, v, kpm, seg, dil, False, 0.125, hr)  # a key padding mask: Triton's
    assert not calls
    on = L.forward(q, k, v, None, seg, dil, False, 0.125, hr)
    assert len(calls) == 2
    assert (on[0].float() - off[0].float()).abs().max().item() < 2e-2
    assert (on[1] - off[1]).abs().max().item() < 1e-3


@needs_gluon
@pytest.mark.cuda
def test_gluon_refuses_strided_views_and_runs_triton(seed, monkeypatch):
    qkv = torch.randn(1, 4096, 3, 4, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(2)
    calls = _spy(monkeypatch)
    out = L.forward(q, k, v, None, [1024], [1], False, 0.125, [(0, 4)])
    assert not calls
    want = L.forward(q.contiguous(), k.contiguous(), v.contiguous(), None, [1024], [1], False,
                     0.125, [(0, 4)])  # fmt: skip
    assert len(calls) == 1
    assert (out[0].float() - want[0].float()).abs().max().item() < 2e-2


@needs_gluon
@pytest.mark.cuda
def test_gluon_failure_falls_back_to_triton_with_a_warning(seed, monkeypatch, switch_reset):
    q, k, v = qkv(1, 4096, 4, 4, 64, torch.float16, "cuda")
    seg, dil, hr = [1024, 4096], [1, 4], [(0, 4)] * 2
    flags.set_gluon_forward(False)
    want = L.forward(q, k, v, None, seg, dil, True, 0.125, hr)
    flags.set_gluon_forward(True)
    monkeypatch.setattr(gluon_fwd, "_failed", {})

    def boom(*a, **kw):
        raise RuntimeError("out of resources (test)")

    monkeypatch.setattr(gluon_fwd, "launch_branch", boom)
    with pytest.warns(RuntimeWarning, match="Gluon forward failed"):
        got = L.forward(q, k, v, None, seg, dil, True, 0.125, hr)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert "failed here before" in gluon_fwd.problem(q, k, v, True, L.branch_list(seg, dil, hr))


@needs_gluon
@pytest.mark.cuda
def test_small_calls_stay_on_triton(seed, monkeypatch):
    monkeypatch.setattr(gluon_fwd, "MIN_ROWS", 1 << 17)
    calls = _spy(monkeypatch)
    small = qkv(1, 4096, 8, 8, 64, torch.bfloat16, "cuda")  # 32768 rows x heads
    L.forward(*small, None, [1024, 4096], [1, 4], False, 0.125, [(0, 8)] * 2)
    assert not calls
    big = qkv(1, 32768, 4, 4, 64, torch.bfloat16, "cuda")  # 131072
    L.forward(*big, None, [1024, 4096], [1, 4], False, 0.125, [(0, 4)] * 2)
    assert len(calls) == 2


def test_floor_benchmark_refuses_without_a_hopper_gpu():
    if gluon_ready() is None:
        pytest.skip("a Hopper GPU with Gluon is here: the script would measure")
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import gluon_floor

    assert gluon_floor.main([]) == 2
    assert all(n * h >= 1 for n, h, *_ in gluon_floor.SIZES)


def test_ab_benchmark_checks_rows_and_refuses_without_a_hopper_gpu():
    if gluon_ready() is None:
        pytest.skip("a Hopper GPU with Gluon is here: the script would measure")
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import gluon_ab

    assert gluon_ab.main(["--rows", "8br-paper-d64-fp16-causal,headline"]) == 2
    with pytest.raises(SystemExit):  # a row sweep.py does not have: argparse's error, exit 2
        gluon_ab.main(["--rows", "no-such-row"])
    res = {"row": "r", "fb_flops": 3.5e12, "G/G": {"fwd_ms": 1.0, "fb_ms": 3.0, "bwd_ms": 2.0},
           "T/T": {"fwd_ms": 1.5, "fb_ms": 4.0, "bwd_ms": 2.5}, "T/G": {"error": "OOM"},
           "G/T": {"fwd_ms": 1.0, "fb_ms": 3.5, "bwd_ms": 2.5}}  # fmt: skip
    info = {"command": "c", "device": "d", "versions": {"torch": "x"}, "date": "t"}
    table = gluon_ab.markdown([res, {"row": "s", "skipped": "budget 1 s"}], info, False)
    assert "| r | 1.00 | 1.50 | 2.00 | 2.50 | 3.00 (1167) | 4.00 (875) | OOM | 3.50 (1000) | G/G |" in table
    assert "| s | skipped: budget 1 s |" in table


def test_varlen_prototype_host_math_against_the_reference():
    """benchmarks/gluon_varlen.py (the Gluon kernels over packed documents, a prototype; exact on
    an H200 2026-11-29): its (document, segment) entries, grid and the kernel's per-program index
    arithmetic (emulated in float64) give each document's reference out and lse, with empty,
    one-token and long documents, w % r != 0, r > 1 first, causal and not, GQA; the scratch
    allocator is set for the launch only; the dense ceiling's block groups count the useful work;
    without an sm_90 GPU --check exits 2."""
    import os
    import sys

    from dilated_attention.reference import dilated_attention_reference

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import gluon_varlen as G

    assert G.entries([0, 5, 5, 17, 18], 8) == ([0, 5, 13, 17], [5, 8, 4, 1])
    assert G.grid_for([0, 5, 5, 17, 18], 8, 3, 4) == (1, 4, 4)
    assert G.grid_for([0, 300], 256, 1, 2) == (2, 2, 2)  # blocks of 256 and 44 rows
    assert G.grid_for([0, 0], 8, 1, 2) == (0, 0, 0)
    # (the entries from device offsets, the library's: tests/test_gluon_varlen.py)
    g = torch.Generator().manual_seed(0)
    lens = [7, 0, 1, 40, 13]
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    for seg, dil in (([4, 8, 16], [1, 2, 4]), ([6, 10], [2, 3]), ([4, 64], [1, 5])):
        for causal in (False, True):
            q = torch.randn(offs[-1], 4, 8, generator=g)
            k, v = torch.randn(offs[-1], 2, 8, generator=g), torch.randn(offs[-1], 2, 8, generator=g)
            out, lse = G.emulate_forward(q, k, v, offs, seg, dil, causal)
            for a, b in zip(offs[:-1], offs[1:], strict=True):
                if a == b:
                    continue
                ro, rl = dilated_attention_reference(q[a:b][None].double(), k[a:b][None].double(),
                                                     v[a:b][None].double(), seg, dil, causal=causal)
                torch.testing.assert_close(out[a:b], ro[0], atol=1e-10, rtol=0)
                torch.testing.assert_close(lse[:, a:b], rl[0], atol=1e-10, rtol=0)
    # the backward's block-major lse / delta rows: one document whose length w divides equal the
    # library's per-segment rows (gluon_bwd.prep_rows) entry for segment; a short last segment
    # and a second document get their own entries
    from dilated_attention.kernels import gluon_bwd

    for w, r in ((8, 2), (12, 5), (16, 1)):
        x = torch.randn(3, 48, generator=g)
        x[1, 5] = float("-inf")
        want = gluon_bwd.prep_rows(x[None], w, r, float("inf"), 2.0)[0]
        torch.testing.assert_close(G.varlen_rows(x, [0, 48], w, r, float("inf"), 2.0), want, atol=0, rtol=0)
        got = G.varlen_rows(x, [0, 20, 48], w, r, 0.0)
        p0, ws = G.entries([0, 20, 48], w)
        for h in range(3):
            c = h % r
            for e, (a, n) in enumerate(zip(p0, ws, strict=True)):
                rows = [a + c + r * t for t in range(max(-(-(n - c) // r), 0))]
                want_e = x[h, rows].clone()
                want_e[want_e == float("-inf")] = float("inf")
                torch.testing.assert_close(got[h, e, : len(rows)], want_e, atol=0, rtol=0)
                assert (got[h, e, len(rows):] == 0).all()
    if G._IMPORT_ERROR is None:
        from triton.runtime import _allocation

        before = _allocation._allocator.get()
        from dilated_attention.kernels.gluon_varlen import _Scratch

        with _Scratch(torch.device("cpu")) as sc:
            assert _allocation._allocator.get() is sc and sc(640, 128, None).numel() == 640
        assert _allocation._allocator.get() is before
    # the packed batch's dense ceiling (--bench --ceiling): its blocks, merged by length, are the
    # library's useful work (4 D FLOPs a pair), documents apart; one document is one sequence
    from dilated_attention.flops import dilated_flops, dilated_flops_varlen

    for seg, dil in (([4, 8, 16], [1, 2, 4]), ([6, 10], [2, 3])):
        groups = G.length_groups(lens, 4, seg, dil)
        assert all(n > 0 and c > 0 for n, c in groups) and groups == sorted(groups, reverse=True)
        for causal in (False, True):
            pairs = sum(c * (n * n if not causal else n * (n + 1) // 2) for n, c in groups)
            assert 4 * 8 * pairs == dilated_flops_varlen(lens, lens, 4, 8, seg, dil, causal)
            one = sum(c * (n * n if not causal else n * (n + 1) // 2) for n, c in G.length_groups([61], 4, seg, dil))
            assert 4 * 8 * one == dilated_flops(1, 61, 61, 4, 8, seg, dil, causal)
    if gluon_ready() is not None:
        assert G.main(["--check"]) == 2
        assert G.main(["--bench", "--ceiling"]) == 2 and G.main(["--profile"]) == 2
