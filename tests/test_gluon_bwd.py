"""The Gluon backward (kernels/gluon_bwd.py, gluon_bwd_kernel.py): when it runs, and that it is exact.

CPU: the switch (``flags.set_gluon_backward``, on by default) and the gate. CUDA (sm_90 with
Triton's Gluon): impl="triton" with the Gluon backward on (and the Gluon forward, the default)
against the float64 reference, judged as tests/test_gluon_fwd.py judges the forward: error <=
2x the error of the Triton path (both Gluon switches off) + 1e-3; bitwise repeatable; a broadcast
dO; what it refuses (split heads, a mask, the float32-accumulator budget) runs the Triton
backward; a failing launch falls back with a warning.
"""

from __future__ import annotations

import os
import sys
import weakref

import pytest
import torch

pytest.importorskip("triton")

from gluon_cases import (
    OnCuda,
    err,
    geometry_cases,
    needs_gluon,
    qkv,
    run,
    switch_on,
    tma_box,
)
from helpers import interpreted

from dilated_attention import call_cache, dilated_attention, flags
from dilated_attention.kernels import gluon_bwd, gluon_fwd
from dilated_attention.kernels import triton_launch as L


@pytest.fixture
def switches_reset():
    yield
    flags.set_gluon_forward(None)
    flags.set_gluon_backward(None)


@pytest.fixture(autouse=True)
def small_calls_too(monkeypatch):
    # the cases are small (N <= 8192, <= 8 heads): below gluon_fwd.MIN_ROWS, which keeps small
    # calls on the Triton kernels for their host time, and their head-dim-64 blocks are below
    # D64_MIN_BLOCK; the kernels' exactness depends on neither
    monkeypatch.setattr(gluon_fwd, "MIN_ROWS", 0)
    monkeypatch.setattr(gluon_fwd, "D64_MIN_BLOCK", 0)

def test_switch_on_by_default_and_environment(monkeypatch, switches_reset):
    monkeypatch.delenv(flags.ENV_GLUON_BWD, raising=False)
    flags.set_gluon_backward(None)
    assert flags.gluon_backward_enabled() is True  # on since its CUDA tests passed (H200)
    monkeypatch.setenv(flags.ENV_GLUON_BWD, "0")
    flags.set_gluon_backward(None)
    assert flags.gluon_backward_enabled() is False
    monkeypatch.setenv(flags.ENV_GLUON_BWD, "1")
    flags.set_gluon_backward(None)
    assert flags.gluon_backward_enabled() is True
    flags.set_gluon_backward(False)
    assert flags.gluon_backward_enabled() is False
    with pytest.raises(TypeError, match="set_gluon_backward"):
        flags.set_gluon_backward(1)


def test_problem_on_the_cpu_and_for_split_heads():
    q, k, v = qkv()
    why = gluon_bwd.problem(q, k, v, False, [(64, 1, 0, 4)], 4)
    assert why is not None and ("interpreter" in why or "CUDA" in why), why


@interpreted
def test_cpu_backward_never_launches_gluon(seed, monkeypatch, switches_reset):
    called = []
    monkeypatch.setattr(gluon_bwd, "launch_branch", lambda *a, **kw: called.append(1))
    flags.set_gluon_backward(True)
    q, k, v = (t.float().requires_grad_() for t in qkv())
    out = dilated_attention(q, k, v, [64, 128], [1, 2], impl="triton")
    out.sum().backward()
    assert q.grad is not None and not called


def test_lpad_is_the_kernels_tile():
    mod = gluon_bwd.kernel_module()
    if mod is None:
        pytest.skip(f"Gluon does not import here: {gluon_bwd._import_error}")
    assert gluon_bwd.LPAD == mod.LPAD == mod.BLK


def test_stages_fit_shared_memory():
    # dK/dV: K + V halves (2 x 2 x 64 x D) + STAGES x (q + dO 64 x D, lse + delta 64 floats);
    # dQ: Q + dO halves (4 x 64 x D) + STAGES x (K + V of BN x D); 2-byte elements, <= 227 KB
    for d in (64, 128):
        kv = 2 * (4 * 64 * d + gluon_bwd.kv_stages(d) * 2 * 64 * d) + gluon_bwd.kv_stages(d) * 512
        dq = 2 * (4 * 64 * d + gluon_bwd.DQ_STAGES * 2 * gluon_bwd.dq_bn(d) * d)
        assert max(kv, dq) <= 227 * 1024, (d, kv, dq)


def _emulated_launch(q, k, v, dout, lse2, delta2, dq, dk, dv, w, r, causal, scale, add=True,
                     kernels=("dkdv", "dq"), chains=None):  # fmt: skip
    """gluon_bwd.launch_branch with the kernels replaced by the float64 emulation of their index
    math and schedule (benchmarks/gluon_dilated_bwd.py --emulate)."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import gluon_dilated_bwd as emu

    args = [t.double() for t in (q, k, v, dout, lse2, delta2)]
    ek, ev = emu.emulate_dkdv(*args, w, r, causal, scale)
    eq = emu.emulate_dq(*args, w, r, causal, scale)
    for acc, e in ((dq, eq), (dk, ek), (dv, ev)):
        if acc is None:  # a phase without this result (gluon_bwd.SPLIT_PHASES)
            assert (e is eq) != ("dq" in kernels)
            continue
        if add:
            acc += e.float()
        else:
            acc.copy_(e.float())


@interpreted
@pytest.mark.parametrize("split", [False, True], ids=["one-phase", "split-phases"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seg,dil", [([32, 64], [1, 2]), ([64, 128], [2, 4])], ids=["r1-first", "r2-first"])
def test_host_path_with_emulated_kernels(seed, monkeypatch, causal, seg, dil, split):
    """gluon_bwd.backward on the CPU (delta from the library's delta kernel in the interpreter,
    the block-major prep, store-or-add per branch, the final cast) with the kernels emulated:
    the gradients of the float64 reference."""
    from dilated_attention import reference

    monkeypatch.setattr(gluon_bwd, "launch_branch", _emulated_launch)
    monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", split)
    q, k, v = (t.double() for t in qkv(1, 256, 4, 2, 16, torch.float32))
    do = torch.randn_like(q)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    hr = [(0, 4)] * len(seg)
    out, lse = reference.dilated_attention_reference(*xs, seg, dil, causal=causal)
    want = torch.autograd.grad(out, xs, do)
    xs32 = [t.float() for t in (q, k, v)]
    delta = L._delta(out.detach().float(), do.float())
    got = gluon_bwd.backward(do.float(), *xs32, delta, lse.detach().float(), L.branch_list(seg, dil, hr),
                             causal, 16**-0.5)  # fmt: skip
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.dtype == torch.float32
        assert (a.double() - b).abs().max().item() < 1e-4, f"d{name}"


@interpreted
def test_out_of_memory_runs_the_triton_backward(seed, monkeypatch, switches_reset):
    """An out-of-memory error in the Gluon backward (its float32 accumulators) gives None for
    that call (the Triton backward runs it), records no failure (a later, smaller call may fit)
    and warns once."""
    q, k, v = qkv(1, 256, 4, 2, 16, torch.float32)
    out, lse = L.forward(q, k, v, None, [64, 128], [1, 2], False, 0.25, [(0, 4)] * 2)
    do = torch.randn_like(q)
    flags.set_gluon_backward(True)
    monkeypatch.setattr(gluon_bwd, "problem", lambda *a: None)  # as if on a Hopper GPU
    monkeypatch.setattr(L.direct_launch, "current_device", lambda: L.direct_launch.tensor_device(q))
    monkeypatch.setattr(gluon_bwd, "_failed", {})
    monkeypatch.setattr(gluon_bwd, "_oom_warned", False)

    def oom(*a, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(gluon_bwd, "backward", oom)
    args = (None, out, lse, [64, 128], [1, 2], False, 0.25, [(0, 4)] * 2)
    with pytest.warns(RuntimeWarning, match="did not fit"):
        assert L.gluon_backward(do, q, k, v, *args) is None
    assert gluon_bwd._failed == {}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert L.gluon_backward(do, q, k, v, *args) is None  # no second warning
    got = L.backward(do, q, k, v, *args)  # the Triton backward
    flags.set_gluon_backward(False)
    want = L.backward(do, q, k, v, *args)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bsz,nh,n,w,r", [(1, 4, 256, 64, 1), (2, 3, 384, 128, 4), (1, 5, 600, 300, 3),
                                          (1, 2, 1024, 1024, 2), (1, 9, 600, 300, 7), (2, 3, 384, 128, 5)])  # fmt: skip
def test_block_rows_kernel_equals_prep_rows(seed, bsz, nh, n, w, r):
    """The one-launch block-major rows (Triton kernel; the interpreter on the CPU) equal the
    torch prep_rows bit for bit: the gather per head residue, x LOG2E, -inf -> +inf (rows no
    query of a causal block reached), padding to LPAD (L = 300 // 3 = 100 and 512: not
    multiples of 128), strided lse / delta views."""
    from helpers import DEV, HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("no Triton to run the kernel")
    lse = torch.randn(bsz, nh, 2 * n, device=DEV)[..., ::2] * 3  # a strided view
    lse[..., ::7] = float("-inf")
    delta = torch.randn(bsz, n, nh, device=DEV).transpose(1, 2)
    delta[..., ::5] = float("-inf")  # prep_rows maps it as it maps lse
    got = gluon_bwd.block_rows(lse, delta, w, r)
    want = (gluon_bwd.prep_rows(lse, w, r, float("inf"), gluon_bwd.LOG2E),
            gluon_bwd.prep_rows(delta, w, r, 0.0))  # fmt: skip
    for g, e in zip(got, want, strict=True):
        assert g.shape == e.shape and g.dtype == torch.float32
        assert torch.equal(g, e)
    # prep_rows itself, element by element (blocks of two lengths when w % r != 0)
    big = -(-w // r)
    for name, x, e, mult, pad in (("lse", lse, want[0], gluon_bwd.LOG2E, float("inf")), ("delta", delta, want[1], 1.0, 0.0)):
        for h in range(nh):
            c = h % r
            for s in range(n // w):
                for t in range(e.shape[-1]):
                    row = s * w + c + r * t
                    if t < big and row < (s + 1) * w:
                        v = x[0, h, row].float() * mult
                        v = torch.tensor(float("inf")) if v == float("-inf") else v
                    else:
                        v = torch.tensor(pad)
                    assert e[0, h, s, t] == v, (name, h, s, t)


class _EmulatedBwdKernels:
    """``dkdv_kernel`` and ``dq_kernel`` in float64 on the CPU at the granularity of a program
    (its rows of keys or queries, all its heads), through the descriptors and arguments the
    host passes: the grids, the programs' decode (the kernels' formulas, CLASSES included), the
    descriptors' block axes, the block-major lse / delta rows, the masked stores or adds."""

    BLK, BMQ, WG_M = 128, 64, 64

    def __init__(self):
        self.launches = []
        self.dkdv_kernel = _Launcher(self._dkdv)
        self.dq_kernel = _Launcher(self._dq)

    def _grads(self, qb, dob, kb, vb, l2, dl2, qk_scale, causal, q_rows, k_rows):
        sc = qb @ kb.T
        p = torch.exp2(sc * qk_scale - l2[:, None])
        if causal:
            p = p.masked_fill(k_rows[None, :] > q_rows[:, None], 0.0)
        ds = p * (dob @ vb.T - dl2[:, None])
        return p, ds

    def _dkdv(self, grid, q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, dk, dv, qk_scale, sm_scale,
              big_l, w, nseg, nnb, r, nh, hkv, rep, ni, lp, c0, cw, *, CAUSAL, ADD, CLASSES, **_):
        self.launches.append(("dkdv", w, r, big_l, CLASSES))
        assert grid[0] == nnb * nseg and nnb == -(-big_l // self.BLK)
        assert grid[1] % (hkv * (cw if CLASSES else ni)) == 0
        lf, df = l_desc.base.reshape(-1).double(), dl_desc.base.reshape(-1).double()
        t_all = torch.arange(big_l)
        for pid0 in range(grid[0]):
            pid_n, s = pid0 % nnb, pid0 // nnb
            for pid_x in range(grid[1]):
                if CLASSES:
                    b, g = pid_x // (hkv * cw), (pid_x // cw) % hkv
                    i0 = ((c0 + pid_x % cw - g * rep) % r + r) % r
                else:
                    b, g, i0 = pid_x // (hkv * ni), (pid_x // ni) % hkv, pid_x % ni
                h_start = g * rep + i0
                c = h_start % r
                nhl = ((g + 1) * rep - h_start + r - 1) // r
                blk = b * nseg + s
                kr = t_all[pid_n * self.BLK : (pid_n + 1) * self.BLK]
                kb = tma_box(k_desc, blk, c * hkv + g, big_l)[kr].double()
                vb = tma_box(v_desc, blk, c * hkv + g, big_l)[kr].double()
                gk = torch.zeros_like(kb)
                gv = torch.zeros_like(vb)
                for j in range(max(nhl, 0)):
                    h = h_start + j * r
                    qb = tma_box(q_desc, blk, c * nh + h, big_l).double()
                    dob = tma_box(do_desc, blk, c * nh + h, big_l).double()
                    lrow = ((b * nh + h) * nseg + s) * lp
                    p, ds = self._grads(qb, dob, kb, vb, lf[lrow : lrow + big_l], df[lrow : lrow + big_l], qk_scale,
                                        CAUSAL, t_all, kr)  # fmt: skip
                    gv += p.T @ dob
                    gk += ds.T @ qb
                rows = s * w + c + r * kr
                for out, gr in ((dk, gk * sm_scale), (dv, gv)):
                    if ADD:
                        out[b, rows, g] += gr.float()
                    else:
                        out[b, rows, g] = gr.float()

    def _dq(self, grid, q_desc, do_desc, k_desc, v_desc, dq, lse2, delta2, qk_scale, sm_scale, big_l, w,
            nseg, nmb, r, nh, hkv, lp, nhb, c0, cw, *, CAUSAL, ADD, CLASSES, **_):
        self.launches.append(("dq", w, r, big_l, CLASSES))
        assert grid[0] == nmb * nseg and grid[1] % (nhb if CLASSES else nh) == 0
        lf, df = lse2.reshape(-1).double(), delta2.reshape(-1).double()
        t_all = torch.arange(big_l)
        for pid0 in range(grid[0]):
            pid_m, s = pid0 % nmb, pid0 // nmb
            for bh in range(grid[1]):
                if CLASSES:
                    b, i = bh // nhb, bh % nhb
                    h = (i // cw) * r + c0 + i % cw
                else:
                    b, h = bh // nh, bh % nh
                c, hk = h % r, h // (nh // hkv)
                blk = b * nseg + s
                qr = t_all[pid_m * self.BLK : (pid_m + 1) * self.BLK]
                qb = tma_box(q_desc, blk, c * nh + h, big_l)[qr].double()
                dob = tma_box(do_desc, blk, c * nh + h, big_l)[qr].double()
                kb = tma_box(k_desc, blk, c * hkv + hk, big_l).double()
                vb = tma_box(v_desc, blk, c * hkv + hk, big_l).double()
                lrow = ((b * nh + h) * nseg + s) * lp
                _, ds = self._grads(qb, dob, kb, vb, lf[lrow + qr], df[lrow + qr], qk_scale, CAUSAL, qr, t_all)
                gq = (ds @ kb * sm_scale).float()
                rows = s * w + c + r * qr
                if ADD:
                    dq[b, rows, h] += gq
                else:
                    dq[b, rows, h] = gq


class _Launcher:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *a, **kw: self.fn(grid, *a, **kw)


@pytest.mark.parametrize("seg,dil,h,hkv", [
    ([64, 192], [1, 5], 4, 2, ),  # 192 % 5: blocks of 39 / 38 rows; rep 2 < r: programs without heads
    ([64, 192], [1, 5], 8, 1),  # MQA, rep 8 >= r
    ([96, 192], [5, 7], 8, 8),  # both uneven, r > 1 first: accumulators zeroed, every branch adds
    ([192], [5], 3, 1),  # H < r
    ([64, 128], [1, 2], 4, 2),  # even: one class per branch
])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("split", [False, True], ids=["one-phase", "split-phases"])
def test_backward_launches_with_emulated_kernels(seed, monkeypatch, seg, dil, h, hkv, causal, split):
    """gluon_bwd.backward's launches (length classes, descriptors, grids, CLASSES, the block-major
    rows of two lengths) with both kernels emulated in float64 (:class:`_EmulatedBwdKernels`):
    the float64 reference's gradients."""
    emu = _EmulatedBwdKernels()
    monkeypatch.setattr(gluon_bwd, "kernel_module", lambda: emu)
    monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", split)
    got, want = _backward_and_reference(2, 384, seg, dil, h, hkv, causal)
    assert {x[1:3] for x in emu.launches} == set(zip(seg, dil, strict=True))
    assert any(x[4] for x in emu.launches) == any(w % r for w, r in zip(seg, dil, strict=True))
    for name, a, b in zip("qkv", got, want, strict=True):
        assert a.dtype == torch.float16
        assert (a.double() - b).abs().max().item() < 2e-3 * (1 + b.abs().max().item()), f"d{name}"


def _backward_and_reference(b, n, seg, dil, h, hkv, causal):
    """gluon_bwd.backward on float16 inputs (the descriptors' dtypes; whatever kernel module is
    patched in) and the float64 reference's gradients of the same values: (got, want)."""
    from dilated_attention import reference

    q, k, v = (t.double() for t in qkv(b, n, h, hkv, 16, torch.float16))
    do = torch.randn_like(q).half().double()
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference.dilated_attention_reference(*xs, seg, dil, causal=causal, softmax_scale=0.25)
    want = torch.autograd.grad(out, xs, do)
    delta = (do * out.detach()).sum(-1).transpose(1, 2).float()
    got = gluon_bwd.backward(do.half(), *(t.half() for t in (q, k, v)), delta, lse.detach().float(),
                             L.branch_list(seg, dil, [(0, h)] * len(seg)), causal, 0.25)  # fmt: skip
    return got, want


@pytest.mark.parametrize("b,n,seg,dil,h,hkv", [
    (1, 400, [64, 192], [1, 5], 4, 2),  # tails; 192 % 5: two length classes
    (2, 400, [96, 192], [5, 7], 8, 1),  # batch 2 with tails (each entry apart), r > 1 first (zeroed)
])  # fmt: skip
@pytest.mark.parametrize("split", [False, True], ids=["one-phase", "split-phases"])
def test_backward_dependent_launches(seed, monkeypatch, b, n, seg, dil, h, hkv, split):
    """gluon_fwd.PDL in the backward: with split phases, every dK/dV launch after the phase's
    first depends on the one before, and every dQ launch likewise; in one phase (the kernels
    alternate) none does. The block-major rows are built once for both phases. Gradients: the
    float64 reference's (emulated kernels)."""
    emu = _EmulatedBwdKernels()
    monkeypatch.setattr(gluon_bwd, "kernel_module", lambda: emu)
    monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", split)
    monkeypatch.setattr(gluon_fwd, "PDL", True)
    monkeypatch.setattr(gluon_fwd, "chain", lambda x: gluon_fwd.Chain(gluon_fwd.PDL))  # as on a GPU
    seen = []  # (kernel, pdl) per launch
    real_launch = gluon_fwd.launch
    monkeypatch.setattr(gluon_fwd, "launch",
                        lambda *a: seen.append(("dkdv" if a[0] is emu.dkdv_kernel else "dq", a[4]))
                        or real_launch(*a))  # fmt: skip
    rows = []
    real_rows = gluon_bwd._rows
    monkeypatch.setattr(gluon_bwd, "_rows", lambda *a: rows.append(a[3:]) or real_rows(*a))
    got, want = _backward_and_reference(b, n, seg, dil, h, hkv, True)
    for name, a, bb in zip("qkv", got, want, strict=True):
        assert (a.double() - bb).abs().max().item() < 2e-3 * (1 + bb.abs().max().item()), f"d{name}"
    # one build per (branch, entry, part): b entries x (full segments + tail) x branches
    assert len(rows) == b * 2 * len(seg), rows
    for kern in ("dkdv", "dq"):
        flags_of = [p for kn, p in seen if kn == kern]
        assert len(flags_of) > 2
        assert flags_of == ([False] + [True] * (len(flags_of) - 1) if split else [False] * len(flags_of))


@pytest.mark.parametrize("b,n,seg,dil,h,hkv", [
    (1, 400, [64, 192], [1, 5], 4, 2),  # tails of 16 rows: r = 1 (stores) and r = 5 (blocks of 4 / 3)
    (1, 150, [64, 192], [1, 5], 4, 4),  # N < 192: that branch is all short last segment
    (1, 300, [96, 192], [5, 7], 8, 1),  # r > 1 first (zeroed, every launch adds); tails 12 and 108
    (2, 400, [64, 192], [1, 5], 4, 2),  # batch 2: each entry apart (gluon_fwd.TAIL_BATCHES)
    (3, 300, [96, 192], [5, 7], 8, 1),
])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("split", [False, True], ids=["one-phase", "split-phases"])
def test_backward_tail_segments_with_emulated_kernels(seed, monkeypatch, b, n, seg, dil, h, hkv, causal, split):
    """gluon_bwd.backward with N % w != 0 (gluon_bwd.TAIL_SEGMENTS; batch > 1: each entry
    apart): each branch's full segments, then its short last segment over views from its first
    row, with both kernels emulated in float64: the float64 reference's gradients (the
    reference defines the short segment)."""
    emu = _EmulatedBwdKernels()
    monkeypatch.setattr(gluon_bwd, "kernel_module", lambda: emu)
    monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", split)
    got, want = _backward_and_reference(b, n, seg, dil, h, hkv, causal)
    tails = {(n % w, r) for w, r in zip(seg, dil, strict=True)}
    launches = sum(x[0] == "dq" for x in emu.launches)
    assert launches >= b * len(seg), "each batch entry launched apart"
    assert tails <= {x[1:3] for x in emu.launches}, "a short last segment was not launched"
    for name, a, b in zip("qkv", got, want, strict=True):
        assert (a.double() - b).abs().max().item() < 2e-3 * (1 + b.abs().max().item()), f"d{name}"


def test_backward_takes_short_segments_only_when_switched_on(monkeypatch):
    """gluon_bwd.problem as on an sm_90 GPU: N % w != 0 runs the Gluon backward while
    gluon_bwd.TAIL_SEGMENTS is on (as shipped since 2026-11-29), the Triton one when it is off;
    batch > 1 also needs gluon_fwd.TAIL_BATCHES (on as shipped)."""
    from dilated_attention.kernels import triton_import

    monkeypatch.setattr(triton_import, "INTERPRET", False)
    monkeypatch.setattr(gluon_fwd, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(gluon_bwd, "kernel_module", lambda: object())
    monkeypatch.setattr(gluon_bwd, "_failed", {})
    assert gluon_bwd.TAIL_SEGMENTS is True and gluon_fwd.TAIL_BATCHES is True
    q = OnCuda((1, 100000, 16, 128), torch.bfloat16)
    q2 = OnCuda((2, 100000, 16, 128), torch.bfloat16)
    br = [(2048, 1, 0, 16), (32768, 8, 0, 16)]
    assert gluon_bwd.problem(q, q, q, True, br, 16) is None
    assert gluon_bwd.problem(q2, q2, q2, True, br, 16) is None
    monkeypatch.setattr(gluon_fwd, "TAIL_BATCHES", False)  # batch 2 needs it, batch 1 does not
    assert "TAIL_BATCHES" in gluon_bwd.problem(q2, q2, q2, True, br, 16)
    assert gluon_bwd.problem(q, q, q, True, br, 16) is None
    monkeypatch.setattr(gluon_bwd, "TAIL_SEGMENTS", False)
    assert "TAIL_SEGMENTS" in gluon_bwd.problem(q, q, q, True, br, 16)


# --------------------------------------------------------------------------------- CUDA


def _spy(monkeypatch):
    calls = []
    real = gluon_bwd.launch_branch

    def spy(*a, **kw):
        # (w, r, kernel): one entry per kernel launched, so one call with both kernels (one
        # phase) and a call per kernel (gluon_bwd.SPLIT_PHASES) count alike
        calls.extend((*a[9:11], kern) for kern in kw.get("kernels", a[14] if len(a) > 14 else gluon_bwd.KERNELS))
        return real(*a, **kw)

    monkeypatch.setattr(gluon_bwd, "launch_branch", spy)
    return calls


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("kind,case", geometry_cases(all_heads=True))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gluon_backward_vs_reference(seed, monkeypatch, switches_reset, kind, case, causal, dtype):
    """Every geometry the backward takes (gluon_cases.GEOMETRIES, every branch over all heads):
    even blocks, blocks of two lengths, short last segments, at batch 2 each entry apart."""
    switch_on(monkeypatch, kind)
    _backward_vs_reference(monkeypatch, case, causal, dtype)


def _backward_vs_reference(monkeypatch, case, causal, dtype):
    b, n, h, hkv, d, seg, dil, _ = case
    q, k, v = qkv(b, n, h, hkv, d, torch.float64, "cuda")
    do = torch.randn_like(q)
    ref = run(q, k, v, do, seg, dil, torch.float64, impl="reference", causal=causal)
    flags.set_gluon_forward(False)
    flags.set_gluon_backward(False)
    call_cache.clear()
    base = run(q, k, v, do, seg, dil, dtype, impl="triton", causal=causal)
    flags.set_gluon_forward(None)
    flags.set_gluon_backward(True)
    calls = _spy(monkeypatch)
    got = run(q, k, v, do, seg, dil, dtype, impl="triton", causal=causal)
    # one launch per branch, one more per short last segment (N % w != 0); batch > 1 with such
    # segments: per batch entry
    per = b if any(n % w for w in seg) else 1
    want = len(gluon_bwd.KERNELS) * per * (len(seg) + sum(n % w > 0 for w in seg))
    assert len(calls) == want, "the Gluon backward did not run every branch"
    again = run(q, k, v, do, seg, dil, dtype, impl="triton", causal=causal)
    for name, a, bb, r, a2 in zip("qkv", got[2], base[2], ref[2], again[2], strict=True):
        assert a.dtype == dtype
        ea, eb = err(a, r), err(bb, r)
        assert ea <= 2 * eb + 1e-3, f"d{name}: Gluon err {ea:.3g} > 2 x Triton err {eb:.3g} + 1e-3"
        assert torch.equal(a, a2), f"d{name}: not bitwise repeatable"


@needs_gluon
@pytest.mark.cuda
def test_gluon_backward_broadcast_dout_and_refusals(seed, monkeypatch, switches_reset):
    flags.set_gluon_backward(True)
    seg, dil = [1024, 4096], [1, 4]
    q, k, v = (t.requires_grad_() for t in qkv(1, 4096, 4, 2, 128, torch.bfloat16, "cuda"))
    calls = _spy(monkeypatch)
    out = dilated_attention(q, k, v, seg, dil, impl="triton")
    g_gluon = torch.autograd.grad(out.sum(), (q, k, v))  # a broadcast (stride 0) dO
    assert sorted(calls) == sorted((w, r, kern) for w, r in zip(seg, dil, strict=True) for kern in gluon_bwd.KERNELS)
    flags.set_gluon_backward(False)
    out = dilated_attention(q, k, v, seg, dil, impl="triton")
    g_triton = torch.autograd.grad(out.sum(), (q, k, v))
    for a, bb in zip(g_gluon, g_triton, strict=True):
        assert (a.float() - bb.float()).abs().max().item() < 3e-2
    flags.set_gluon_backward(True)
    calls.clear()
    out = dilated_attention(q, k, v, seg, dil, impl="triton", head_assignment="split")
    torch.autograd.grad(out.sum(), (q, k, v))
    kpm = torch.zeros(1, 4096, dtype=torch.bool, device="cuda")
    out = dilated_attention(q, k, v, seg, dil, impl="triton", key_padding_mask=kpm)
    torch.autograd.grad(out.sum(), (q, k, v))
    monkeypatch.setattr(gluon_bwd, "MAX_F32_BYTES", 0)
    out = dilated_attention(q, k, v, seg, dil, impl="triton")
    torch.autograd.grad(out.sum(), (q, k, v))
    assert not calls  # split heads, a mask, the float32 budget: the Triton backward


@needs_gluon
@pytest.mark.cuda
def test_gluon_backward_failure_falls_back_with_a_warning(seed, monkeypatch, switches_reset):
    q, k, v = qkv(1, 4096, 4, 4, 64, torch.float16, "cuda")
    do = torch.randn_like(q)
    out, lse = L.forward(q, k, v, None, [1024, 4096], [1, 4], True, 0.125, [(0, 4)] * 2)
    args = (None, out, lse, [1024, 4096], [1, 4], True, 0.125, [(0, 4)] * 2)
    flags.set_gluon_backward(False)
    want = L.backward(do, q, k, v, *args)
    flags.set_gluon_backward(True)
    monkeypatch.setattr(gluon_bwd, "_failed", {})

    def boom(*a, **kw):
        raise RuntimeError("out of resources (test)")

    monkeypatch.setattr(gluon_bwd, "launch_branch", boom)
    with pytest.warns(RuntimeWarning, match="Gluon backward failed"):
        got = L.backward(do, q, k, v, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@needs_gluon
@pytest.mark.cuda
def test_gluon_training_call_does_not_synchronise(seed, monkeypatch, switches_reset):
    """A training call through the Gluon forward and backward (descriptors, the rows kernel,
    the accumulators and their casts) makes no host synchronisation (issue 23 item 3), and both
    Gluon paths ran."""
    calls = _spy(monkeypatch)
    fwd_calls = []
    real_fwd = gluon_fwd.launch_branch
    monkeypatch.setattr(gluon_fwd, "launch_branch", lambda *a, **kw: fwd_calls.append(1) or real_fwd(*a, **kw))
    q, k, v = (t.requires_grad_() for t in qkv(1, 4096, 4, 2, 128, torch.bfloat16, "cuda"))
    seg, dil = [1024, 2048, 4096], [1, 2, 4]

    def step():
        out = dilated_attention(q, k, v, seg, dil, causal=True, impl="triton")
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    step()  # first call: compilation and one-time probes may synchronise
    torch.cuda.synchronize()
    calls.clear()
    fwd_calls.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert fwd_calls and calls, "the Gluon forward / backward did not run"


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tma_cache", [False, True], ids=["encode", "tma_cache"])
def test_direct_launches_change_no_bit(seed, monkeypatch, switches_reset, causal, tma_cache):
    """gluon_fwd.DIRECT_LAUNCH (the Gluon kernels' later launches through their compiled
    launchers; with TMA_CACHE, their CUtensorMaps from the cache): the same bits as Triton's
    launches, forward and backward, and it launched directly (every key has a launcher; with
    TMA_CACHE every key has one with the cache, and the maps were reused)."""
    from dilated_attention.kernels import direct_launch

    q, k, v = qkv(1, 4096, 8, 2, 128, torch.bfloat16, "cuda")
    do = torch.randn_like(q)
    seg, dil = [1024, 2048, 4096], [1, 2, 4]
    monkeypatch.setattr(gluon_fwd, "DIRECT_LAUNCH", False)
    base = run(q, k, v, do, seg, dil, torch.bfloat16, impl="triton", causal=causal)
    monkeypatch.setattr(gluon_fwd, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(gluon_fwd, "TMA_CACHE", tma_cache)
    monkeypatch.setattr(gluon_fwd, "_direct", {})
    run(q, k, v, do, seg, dil, torch.bfloat16, impl="triton", causal=causal)  # fills the launchers
    assert gluon_fwd._direct and all(gluon_fwd._direct.values()), "no direct launcher"
    if tma_cache:
        assert all(v[1] is not None for v in gluon_fwd._direct.values()), "no launcher with cached maps"
        direct_launch._TMA_MAPS.clear()
    for _ in range(2):  # with the cache: the first fills it, the second reads it
        got = run(q, k, v, do, seg, dil, torch.bfloat16, impl="triton", causal=causal)
        for a, b in zip((got[0], got[1], *got[2]), (base[0], base[1], *base[2]), strict=True):
            assert torch.equal(a, b)
    if tma_cache:
        assert direct_launch._TMA_MAPS, "no map was cached"


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (2, 16384, 12, 12, 64, [2048, 4096, 8192, 16384], [1, 2, 4, 8]),  # LongNet-base at 16K x 2
    (1, 8192, 8, 2, 128, [1024, 2048, 4096], [1, 2, 4]),  # GQA, r = 1 first (stores)
    (2, 6000, 8, 2, 64, [2048, 4096], [2, 6]),  # r > 1 first (zeroed), tails, w % r (classes), batch apart
    (1, 16384, 8, 8, 128, [1024, 2048], [1, 3]),  # four lo ranges (a zeroing between), w % r
])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
def test_dependent_launches_change_no_bit(seed, monkeypatch, switches_reset, case, causal):
    """gluon_fwd.PDL (each launch of a call after its first starts while the one before
    finishes, and waits for it before its epilogue): the same bits as without, forward and
    backward, three times over (a missing wait would race: the bits would move), and the
    dependent launches did happen (each kernel's direct launcher was given the attribute)."""
    from dilated_attention.kernels import direct_launch

    b, n, h, hkv, d, seg, dil = case
    q, k, v = qkv(b, n, h, hkv, d, torch.bfloat16, "cuda")
    do = torch.randn_like(q)
    real_chunks = L.lo_chunks
    monkeypatch.setattr(L, "lo_chunks", lambda lay, br, rb, lo_rows=None: real_chunks(lay, br, rb, 4096))
    monkeypatch.setattr(gluon_fwd, "PDL", False)
    base = run(q, k, v, do, seg, dil, torch.bfloat16, impl="triton", causal=causal)
    monkeypatch.setattr(gluon_fwd, "PDL", True)
    monkeypatch.setattr(gluon_fwd, "_direct", {})
    kinds = set()  # (kernel, dependent) of the direct launches
    real_grid = direct_launch.grid_launcher

    def spy_grid(compiled):
        go = real_grid(compiled)
        if not go:
            return go
        name = getattr(compiled, "name", "?")

        def wrapped(gx, gy, gz, stream, args, *dep):
            kinds.add((name, bool(dep and dep[0])))
            return go(gx, gy, gz, stream, args, *dep)

        return wrapped

    monkeypatch.setattr(direct_launch, "grid_launcher", spy_grid)
    for _ in range(3):
        got = run(q, k, v, do, seg, dil, torch.bfloat16, impl="triton", causal=causal)
        for name, a, bb in zip(("out", "lse", "dq", "dk", "dv"), (got[0], got[1], *got[2]),
                               (base[0], base[1], *base[2]), strict=True):  # fmt: skip
            assert torch.equal(a, bb), name
    for kern in ("gluon_fwd_kernel", "dkdv_kernel", "dq_kernel"):
        assert (kern, True) in kinds, (kern, sorted(kinds))


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("case", [
    (1, 16384, 16, 16, 128, [2048, 4096, 8192], [1, 2, 4], "all"),  # r = 1 first (stores)
    (2, 6000, 8, 2, 64, [2048, 4096], [2, 6], "all"),  # GQA, r > 1 first (zeroed), tails, w % r
])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
def test_split_phases_same_bits_and_lower_peak(seed, monkeypatch, switches_reset, case, causal):
    """gluon_bwd.SPLIT_PHASES (every branch's dK/dV first, its accumulators cast and freed
    before dQ's is allocated): the same bits as one phase (each accumulator still adds its
    branches in order), and a lower peak, by what the accumulators alive at once say (MHA: 7 ->
    5 result sizes above the inputs; GQA 8:2 (K = Q / 4): 16K -> 14K), less 10% slack."""
    b, n, h, hkv, d, seg, dil, _ = case
    q, k, v = qkv(b, n, h, hkv, d, torch.bfloat16, "cuda")
    do = torch.randn_like(q)
    flags.set_gluon_backward(True)
    peaks, grads = {}, {}
    calls = _spy(monkeypatch)
    for split in (False, True, False):
        monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", split)
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = dilated_attention(*xs, seg, dil, causal=causal, impl="triton")
        calls.clear()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        g = torch.autograd.grad(out, xs, do)
        torch.cuda.synchronize()
        assert calls, "the Gluon backward did not run"
        peaks[split] = torch.cuda.max_memory_allocated() - base
        grads.setdefault(split, g)
        for a, a0 in zip(g, grads[split], strict=True):
            assert torch.equal(a, a0)
        del out, xs, g
    for a, a0 in zip(grads[True], grads[False], strict=True):
        assert torch.equal(a, a0), "split phases changed bits"
    # in bytes of a bf16 q (Q) and k (K): one phase peaks at its first cast, 2Q + 4K of float32
    # + Q; split phases at max(4K + K, 2K + 2Q + Q)
    qb, kb = 2 * q.numel(), 2 * k.numel()
    saved = 3 * qb + 4 * kb - max(5 * kb, 2 * kb + 3 * qb)
    assert saved > 0 and peaks[True] <= peaks[False] - 0.9 * saved, (peaks, saved)


class _CountingTorch:
    """gluon_bwd's ``torch`` with ``empty`` / ``zeros`` of float32 recorded (weak references):
    how many float32 accumulators are alive at each emulated launch."""

    def __init__(self):
        self.refs = []

    def __getattr__(self, name):
        fn = getattr(torch, name)
        if name not in ("empty", "zeros"):
            return fn

        def alloc(*a, **kw):
            t = fn(*a, **kw)
            if kw.get("dtype") is torch.float32:
                self.refs.append(weakref.ref(t))
            return t

        return alloc

    def live(self) -> int:
        return sum(ref() is not None for ref in self.refs)


@pytest.mark.parametrize("split", [False, True], ids=["one-phase", "split-phases"])
def test_split_phases_free_the_dkdv_accumulators_before_dq(seed, monkeypatch, split):
    """gluon_bwd.SPLIT_PHASES: every dK/dV launch sees two float32 accumulators alive and every
    dQ launch one (dk's and dv's cast and freed first); without it, three throughout. The
    results are the same bits either way (the kernels add in the same branch order)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dilated_attention import reference

    emu = _EmulatedBwdKernels()
    counting = _CountingTorch()
    live = []
    for name in ("dkdv_kernel", "dq_kernel"):
        fn = getattr(emu, name).fn
        setattr(
            emu,
            name,
            _Launcher(
                lambda *a, fn=fn, name=name, **kw: (
                    live.append((name, counting.live())),
                    fn(*a, **kw),
                )
            ),
        )
    monkeypatch.setattr(gluon_bwd, "kernel_module", lambda: emu)
    q, k, v = qkv(1, 256, 4, 2, 16, torch.float16)
    do = torch.randn_like(q)
    seg, dil = [64, 128], [1, 2]
    out, lse = reference.dilated_attention_reference(
        *(t.double() for t in (q, k, v)), seg, dil, softmax_scale=0.25
    )
    delta = (do.double() * out).sum(-1).transpose(1, 2).float()
    args = (do, q, k, v, delta, lse.float(), L.branch_list(seg, dil, [(0, 4)] * 2), True, 0.25)
    monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", False)
    want = gluon_bwd.backward(*args)
    monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", split)
    monkeypatch.setattr(gluon_bwd, "torch", counting)
    live.clear()

    class Casts(TorchDispatchMode):  # the float32 accumulators alive at each cast to the result dtype
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            to16 = (kwargs or {}).get("dtype") == torch.float16
            if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32 and to16:
                live.append(("cast", counting.live()))
            return func(*args, **(kwargs or {}))

    with Casts():
        got = gluon_bwd.backward(*args)
    casts = [c for n, c in live if n == "cast"]
    assert casts == ([2, 1, 1] if split else [3, 2, 1]), "each accumulator freed once cast"
    assert {n for n, _ in live} == {"dkdv_kernel", "dq_kernel", "cast"}
    if split:
        assert {c for n, c in live if n == "dkdv_kernel"} == {2}
        assert {c for n, c in live if n == "dq_kernel"} == {1}
        assert live.index(("dq_kernel", 1)) > max(
            i for i, (n, _) in enumerate(live) if n == "dkdv_kernel"
        )
    else:
        assert {c for n, c in live if n != "cast"} == {3}
    assert counting.live() == 0, "an accumulator outlived the call"
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_float32_budget_counts_all_three_accumulators(monkeypatch):
    """gluon_bwd.MAX_F32_BYTES against dq + dk + dv in float32, with SPLIT_PHASES or without:
    the split lowers the peak of the calls the budget admits, it admits no more of them."""
    from dilated_attention.kernels import triton_import

    monkeypatch.setattr(triton_import, "INTERPRET", False)
    monkeypatch.setattr(gluon_fwd, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(gluon_bwd, "kernel_module", lambda: object())
    monkeypatch.setattr(gluon_bwd, "_failed", {})
    q, k = OnCuda((1, 131072, 16, 128), torch.bfloat16), OnCuda((1, 131072, 4, 128), torch.bfloat16)
    br = [(2048, 1, 0, 16), (8192, 4, 0, 16)]
    f32_q = 4 * 131072 * 128 * 16  # 1 GiB; dk + dv: 0.5 GiB
    monkeypatch.setattr(gluon_bwd, "MAX_F32_BYTES", f32_q)
    assert "MAX_F32_BYTES" in gluon_bwd.problem(q, k, k, True, br, 16)
    for split in (True, False):
        monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", split)
        monkeypatch.setattr(gluon_bwd, "MAX_F32_BYTES", f32_q + f32_q // 2 - 1)
        assert "MAX_F32_BYTES" in gluon_bwd.problem(q, k, k, True, br, 16)
        monkeypatch.setattr(gluon_bwd, "MAX_F32_BYTES", f32_q + f32_q // 2)
        assert gluon_bwd.problem(q, k, k, True, br, 16) is None


def test_split_ab_benchmark_checks_rows_and_refuses_without_a_hopper_gpu():
    """benchmarks/split_ab.py (SPLIT_PHASES off / on, interleaved): exit 2 without sm_90, argparse's
    error on an unknown row, and its table from given rounds (medians, per-round ratios, peaks)."""
    from gluon_cases import gluon_ready

    if gluon_ready() is None:
        pytest.skip("a Hopper GPU with Gluon is here: the script would measure")
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import split_ab

    assert split_ab.main(["--rows", "headline"]) == 2
    with pytest.raises(SystemExit):
        split_ab.main(["--rows", "no-such-row"])
    with pytest.raises(SystemExit):
        split_ab.main(["--rows", "headline", "--rounds", "0"])
    # another switch: MOD.NAME of a boolean in dilated_attention.kernels, checked before any GPU
    assert split_ab.main(["--rows", "headline", "--switch", "gluon_fwd.PDL", "--direction", "both"]) == 2
    for bad in ("PDL", "gluon_fwd.NO_SUCH", "no_module.PDL", "gluon_fwd.MIN_ROWS"):
        with pytest.raises(SystemExit):
            split_ab.main(["--rows", "headline", "--switch", bad])
    res = {"row": "r", "ms": {"off": [10.0, 12.0, 11.0], "on": [10.5, 11.0, 11.0]},
           "fwd_ms": {"off": [4.0, 4.0, 4.0], "on": [3.0, 3.0, 3.6]},
           "peak_ratio": {"off": 1.5, "on": 1.25}}  # fmt: skip
    info = {"command": "c", "device": "d", "versions": {"torch": "x"}, "date": "t"}
    table = split_ab.markdown([res, {"row": "s", "skipped": "skipped: budget 1 s"},
                               {"row": "e", "error": "the Gluon backward does not take this row: x"}], info, 3, 5,
                              "gluon_fwd.PDL")  # fmt: skip
    assert "gluon_fwd.PDL off / on" in table
    # medians 11.00 / 11.00; pairs 1.05, 0.917, 1.0; forward 4.00 / 3.00, pairs 0.75, 0.75, 0.9
    assert "| r | fwd+bwd | 11.00 (10.00-12.00) | 11.00 (10.50-11.00) | 1.000 | 0.917-1.050 | 1.50x | 1.25x |" in table
    assert "| r | fwd | 4.00 (4.00-4.00) | 3.00 (3.00-3.60) | 0.750 | 0.750-0.900 | 1.50x | 1.25x |" in table
    assert "| s | | skipped: budget 1 s |" in table
    assert "| e | | the Gluon backward does not take this row: x |" in table
