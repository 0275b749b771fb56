"""The Gluon kernels over packed documents (kernels/gluon_varlen.py, gluon_varlen_kernel.py):
the forward and the backward (``gluon_varlen.VARLEN_FORWARD`` / ``VARLEN_BACKWARD``, both on by
default: the backward since these CUDA tests passed on an H200, 2026-11-29).

CPU:
- the gates (:func:`gluon_varlen.problem`, :func:`gluon_varlen.backward_problem`) and the switches;
- the backward's kernels emulated in float64 (:class:`_EmulatedVarlenBwd`) under the public
  packed call, gradients against the float64 reference per document; its block-major rows
  kernel (interpreted) against the torch form; a failed launch falls back with a warning;
- the entry table from device offsets (clamped into the stream whatever the offsets) and the grid;
- the library's packed call with the kernel emulated in float64 (:class:`_EmulatedVarlenKernel`):
  ``dilated_attention_varlen(impl="triton")`` forward and backward against the float64 reference
  run on each document alone (the backward: the Triton varlen kernels on the emulated out and lse).

CUDA (sm_90 with Triton's Gluon), both switches on (forward and backward):
- the same calls against the reference, judged as tests/test_gluon_fwd.py judges the Gluon
  forward: error <= 2x the Triton varlen path's + 1e-3;
- the Gluon launches counted (a fall back to Triton is a failure);
- forward bits repeatable.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch

pytest.importorskip("triton")

from gluon_cases import lse_merge, needs_gluon
from helpers import interpreted, varlen_reference

from dilated_attention import dilated_attention_varlen, flags
from dilated_attention.kernels import gluon_fwd, gluon_varlen

LOG2E = 1.4426950408889634


@pytest.fixture
def switch_on(monkeypatch):
    monkeypatch.setattr(gluon_varlen, "VARLEN_FORWARD", True)
    monkeypatch.setattr(gluon_varlen, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(gluon_varlen, "_failed", {})
    monkeypatch.setattr(gluon_varlen, "_bwd_failed", {})
    # small cases: below gluon_fwd.MIN_ROWS and D64_MIN_BLOCK, which keep small calls on the
    # Triton kernels for speed; the kernel's exactness depends on neither
    monkeypatch.setattr(gluon_fwd, "MIN_ROWS", 0)
    monkeypatch.setattr(gluon_fwd, "D64_MIN_BLOCK", 0)
    # and the speed gates of the packed call (head dim 64, short documents: the Triton varlen
    # forward is faster there)
    for name in ("HEADDIMS", "HEADDIMS_BACKWARD", "DEVICE_DESC_HEADDIMS_BACKWARD"):
        monkeypatch.setattr(gluon_varlen, name, (64, 128))
    for name in ("MIN_MEAN_DOC", "MIN_MEAN_DOC_BACKWARD", "DEVICE_DESC_MIN_MEAN_DOC", "DEVICE_DESC_MIN_MEAN_DOC_BACKWARD"):
        monkeypatch.setattr(gluon_varlen, name, 0)
    flags.set_gluon_forward(True)
    flags.set_gluon_backward(True)
    yield
    flags.set_gluon_forward(None)
    flags.set_gluon_backward(None)


def _offsets(lens):
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    return offs


# --------------------------------------------------------------------------------- CPU


def test_switch_off_and_what_the_gate_refuses(monkeypatch):
    q = torch.zeros(1, 64, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    br = [(16, 1, 0, 4), (32, 2, 0, 4)]
    assert gluon_varlen.VARLEN_FORWARD  # on by default since 2026-11-29
    monkeypatch.setattr(gluon_varlen, "VARLEN_FORWARD", False)
    assert "VARLEN_FORWARD is off" in gluon_varlen.problem(q, k, k, True, br, True, 64, 3)
    monkeypatch.setattr(gluon_varlen, "VARLEN_FORWARD", True)
    assert "same offsets" in gluon_varlen.problem(q, k, k, True, br, False, 64, 3)
    assert "all heads" in gluon_varlen.problem(q, k, k, True, [(16, 1, 0, 2), (32, 2, 2, 4)], True, 64, 3)
    why = gluon_varlen.problem(q, k, k, True, br, True, 64, 3)
    assert "interpreter" in why or "CUDA tensor" in why


@pytest.mark.parametrize("host", [True, False], ids=["host-desc", "device-desc"])
def test_the_speed_gates_keep_head_dim_64_and_short_documents_on_triton(monkeypatch, host):
    # past the device checks (here on the CPU: as if on a Hopper GPU), the forward's gates: head
    # dim 64 and a mean document under MIN_MEAN_DOC rows (every branch over host descriptors: r
    # divides the stream's rows) or DEVICE_DESC_MIN_MEAN_DOC (some branch's descriptors made per
    # program: r = 2 and an odd stream) run the Triton varlen forward; head dim 128 with long
    # documents the Gluon one
    monkeypatch.setattr(gluon_fwd, "device_problem", lambda q: None)
    monkeypatch.setattr(gluon_fwd, "MIN_ROWS", 0)
    monkeypatch.setattr(gluon_varlen, "kernel_module", lambda: object())
    br = [(2048, 1, 0, 4), (4096, 2, 0, 4)]
    gate = "MIN_MEAN_DOC" if host else "DEVICE_DESC_MIN_MEAN_DOC"
    assert gluon_varlen.MIN_MEAN_DOC < gluon_varlen.DEVICE_DESC_MIN_MEAN_DOC
    mean = getattr(gluon_varlen, gate)
    n = 4 * mean + (0 if host else 1)

    def why(d, ndocs, covered=True):
        q = torch.zeros(1, n, 4, d, dtype=torch.bfloat16)
        return gluon_varlen.problem(q, q, q, False, br, True, n, ndocs, covered=covered)

    # offsets not checked on the host (rows past the last document may hold anything): with the split
    # (HOST_DESCRIPTORS_UNCHECKED, on) the host-descriptor gate, as host offsets; without it the device
    # descriptors, and so their gate, whatever the rows
    assert gluon_varlen.HOST_DESCRIPTORS_UNCHECKED
    assert why(128, 5, covered=False) == why(128, 5)
    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS_UNCHECKED", False)
    assert "DEVICE_DESC_MIN_MEAN_DOC" in why(128, 5, covered=False)
    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS_UNCHECKED", True)
    assert "HEADDIMS" in why(64, 1)
    assert why(128, 4) is None  # a mean of MIN_MEAN_DOC rows (and one row more without host descriptors)
    assert f"gluon_varlen.{gate} = {mean}" in why(128, 5) and "5 documents" in why(128, 5)
    monkeypatch.setattr(gluon_varlen, gate, 0)
    monkeypatch.setattr(gluon_varlen, "HEADDIMS", (64, 128))
    assert why(128, 5) is None and why(64, 1) is None


def test_device_entries_equal_the_host_table_and_stay_in_the_stream():
    for offs, w in (([0, 5, 5, 17, 18], 8), ([0, 0], 4), ([0, 300], 256), ([0, 7, 7, 8, 48, 61], 4), ([0], 4)):
        p0, ws = gluon_varlen.entries(offs, w)
        dp0, dws = gluon_varlen.device_entries(torch.tensor(offs, dtype=torch.int32), w, offs[-1])
        assert dp0.dtype == dws.dtype == torch.int32 and dp0.numel() == len(offs) - 1 + offs[-1] // w
        assert dp0[: len(p0)].tolist() == p0 and dws[: len(ws)].tolist() == ws and not dws[len(ws) :].any()
    # offsets nobody checked (decreasing, past the stream, negative): every entry inside [0, total)
    total = 40
    for bad in ([0, 30, 10, 90], [-5, 20, 60], [0, 41], [3, 2, 1, 0], [7], [50]):  # [7]: no document
        p0, ws = gluon_varlen.device_entries(torch.tensor(bad, dtype=torch.int32), 16, total)
        assert (ws >= 0).all() and (p0 >= 0).all() and ((p0 + ws <= total) | (ws == 0)).all(), bad


def test_device_entries_of_all_branches_at_once_equal_each_branch_alone():
    # one table for every branch of a call (gluon_varlen.device_entries_all): the values of
    # device_entries per branch, rows 16-byte aligned, checked and unchecked offsets alike
    for offs in ([0, 5, 5, 17, 18], [0, 300], [0, 7, 7, 8, 48, 61], [0], [0, 30, 10, 90], [-5, 20, 60], [3, 2, 1, 0]):
        total = max(offs[-1], 40) if offs[-1] < 0 or offs != sorted(offs) else offs[-1]
        cu = torch.tensor(offs, dtype=torch.int32)
        widths = [4, 8, 256, 3]
        for w, (p0, ws) in zip(widths, gluon_varlen.device_entries_all(cu, widths, total), strict=True):
            want_p0, want_ws = gluon_varlen.device_entries(cu, w, total)
            assert p0.dtype == ws.dtype == torch.int32 and p0.is_contiguous() and p0.data_ptr() % 16 == 0
            assert torch.equal(ws, want_ws), (offs, w)
            assert torch.equal(p0, want_p0), (offs, w)


def test_grid_covers_every_block():
    # a block has at most ceil(min(w, max_len) / r) rows; the grid's first axis covers them in
    # tiles of PROGRAM_ROWS, the second has a slot per entry
    for max_len, w, r in ((300, 256, 1), (300, 1024, 3), (5, 8, 2), (1000, 64, 7)):
        offs = _offsets([max_len, max_len // 2, 1])
        g = gluon_varlen.grid(max_len, 3, offs[-1], w, r, 4)
        p0, ws = gluon_varlen.entries(offs, w)
        assert g[1] >= len(p0) and g[2] == 4
        assert g[0] * gluon_varlen.PROGRAM_ROWS >= max(-(-n // r) for n in ws)
    assert gluon_varlen.grid(0, 2, 5, 8, 1, 4)[0] == 0  # no row in any document: forward() launches nothing
    if gluon_fwd.kernel_module() is not None and gluon_varlen.kernel_module() is not None:
        assert gluon_varlen.kernel_module().PROGRAM_ROWS == gluon_varlen.PROGRAM_ROWS


class _EmulatedVarlenKernel:
    """``gluon_fwd_varlen_kernel`` in float64 on the CPU: per entry slot e and head h, the block
    of rows ``p0[e] + c + r t`` (t < L = ceil((ws[e] - c) / r), c = h % r), dense attention in
    it, merged into out / lo / lse as the kernel's epilogue does (FIRST stores, COMP reads and
    STORE_LO writes the lo buffer: the (hi, lo) pair). Checks the host's tables and grid (every
    block covered by the first axis, a slot per entry, rows inside the stream)."""

    BM = 128

    def __init__(self):
        self.launches = []
        self.ran = collections.Counter()  # programs that did work, by (host descriptors?, PART)
        self.hd = _Launcher(self.run_hd)  # gluon_fwd_varlen_hd_kernel

    def __getitem__(self, grid):
        return lambda *a, **kw: self.run(grid, *a, **kw)

    def module(self, **more):
        """A stand-in for the kernel module with this forward (both kernels)."""
        return types.SimpleNamespace(gluon_fwd_varlen_kernel=self, gluon_fwd_varlen_hd_kernel=self.hd,
                                     F=types.SimpleNamespace(WG_M=64), PROGRAM_ROWS=128, **more)  # fmt: skip

    def run_hd(self, grid, q_desc, k_desc, v_desc, o_desc, lo_desc, out, lo, lse, p0, ws, limit, qk_scale, total, snq,
               r, nh, hkv, *, BN, CAUSAL, FIRST, COMP, STORE_LO, PART, **_):  # fmt: skip
        """``gluon_fwd_varlen_hd_kernel`` program by program over its host descriptors, read as TMA
        reads them (:func:`_view_rows`: rows past the block are the stream's, zeros past the view):
        query tile rows q_row0 + [0, 128) and key tiles up to the kernel's n_tiles, keys t >= L
        (and above the diagonal) masked, rows t >= L not stored."""
        self.launches.append((r, tuple(grid), FIRST, COMP, STORE_LO, "hd"))
        d = q_desc.shape[3]
        assert total % r == 0 and snq == out.stride(0) and grid[1] == p0.numel() == ws.numel() and grid[2] == nh
        for desc, x, heads, rows in ((q_desc, None, nh, 64), (k_desc, None, hkv, BN), (v_desc, None, hkv, BN),
                                     (o_desc, out, nh, 64), (lo_desc, lo if COMP else out, nh, 64)):  # fmt: skip
            assert list(desc.shape) == [1, total // r, r * heads, d] and list(desc.block_shape) == [1, rows, 1, d]
            assert x is None or desc.base.data_ptr() == x.data_ptr()
        scale = qk_scale / LOG2E
        for e in range(grid[1]):
            a, n = int(p0[e]), int(ws[e])
            for h in range(nh):
                c, hk = h % r, h // (nh // hkv)
                big_l = max(-(-(n - c) // r), 0)
                assert big_l <= grid[0] * self.BM, "the grid's first axis does not cover the block"
                pos0 = a + c
                b, a0 = pos0 % r, pos0 // r
                for pid_m in range(grid[0]):
                    q_row0 = pid_m * self.BM
                    if q_row0 >= big_l or not _part_runs(PART, limit, pos0, r, _fwd_reach(q_row0, big_l, BN, CAUSAL)):
                        continue
                    self.ran[(True, PART)] += 1
                    n_kv = -(-big_l // BN)
                    n_tiles = min(n_kv, -(-(q_row0 + self.BM) // BN)) if CAUSAL else n_kv
                    tq = torch.arange(q_row0, q_row0 + self.BM)
                    tk = torch.arange(n_tiles * BN)
                    qb = _view_rows(q_desc, a0 + tq, b * nh + h)
                    kb, vb = (_view_rows(x, a0 + tk, b * hkv + hk) for x in (k_desc, v_desc))
                    sc = (qb @ kb.T * scale).masked_fill(tk[None, :] >= big_l, float("-inf"))
                    if CAUSAL:
                        sc = sc.masked_fill(tk[None, :] > tq[:, None], float("-inf"))
                    valid = tq < big_l
                    sc = sc[valid]
                    self._merge(out, lo, lse, pos0 + r * tq[valid], h, torch.logsumexp(sc, -1),
                                torch.softmax(sc, -1) @ vb, FIRST, COMP, STORE_LO)  # fmt: skip

    def run(self, grid, q, k, v, out, lo, lse, p0, ws, limit, qk_scale, total, snq, snk, r, nh, hkv, *, BN, CAUSAL,
            FIRST, COMP, STORE_LO, PART, **_):  # fmt: skip
        self.launches.append((r, tuple(grid), FIRST, COMP, STORE_LO) + (("part2",) if PART == 2 else ()))
        assert grid[1] == p0.numel() == ws.numel() and grid[2] == nh and (snq, snk) == (q.stride(0), k.stride(0))
        scale = qk_scale / LOG2E
        for e in range(grid[1]):
            a, n = int(p0[e]), int(ws[e])
            for h in range(nh):
                c = h % r
                big_l = max(-(-(n - c) // r), 0)
                if big_l == 0:
                    continue
                assert big_l <= grid[0] * self.BM, "the grid's first axis does not cover the block"
                rows = a + c + r * torch.arange(big_l)
                assert int(rows[-1]) < total
                hk = h // (nh // hkv)
                qb, kb, vb = q[rows, h].double(), k[rows, hk].double(), v[rows, hk].double()
                sc = qb @ kb.T * scale
                if CAUSAL:
                    t = torch.arange(big_l)
                    sc = sc.masked_fill(t[None, :] > t[:, None], float("-inf"))
                # the query tiles whose programs run (PART 2: those reading at or past the limit row)
                runs = torch.tensor([_part_runs(PART, limit, a + c, r, _fwd_reach(t0 // self.BM * self.BM, big_l, BN,
                                                                                 CAUSAL))
                                     for t0 in range(big_l)], dtype=torch.bool)  # fmt: skip
                self.ran[(False, PART)] += len({t0 // self.BM for t0 in range(big_l) if runs[t0]})
                if runs.any():
                    self._merge(out, lo, lse, rows[runs], h, torch.logsumexp(sc[runs], -1),
                                torch.softmax(sc[runs], -1) @ vb, FIRST, COMP, STORE_LO)  # fmt: skip

    @staticmethod
    def _merge(out, lo, lse, rows, h, lse_b, out_b, FIRST, COMP, STORE_LO):
        # the kernel's epilogue: the branch's (out, lse) of rows ``rows``, head h, into the result
        if FIRST:
            new_out, new_lse = out_b, lse_b
        else:
            lse_a, out_a = lse[h, rows].double(), out[rows, h].double()
            if COMP:
                out_a = out_a + lo[rows, h].double()
            new_out, new_lse = lse_merge(out_a, lse_a, out_b, lse_b)
        hi = new_out.to(out.dtype)
        out[rows, h] = hi
        if COMP and STORE_LO:
            lo[rows, h] = (new_out - hi.double()).to(lo.dtype)
        lse[h, rows] = new_lse.float()


def _fwd_reach(q_row0: int, big_l: int, bn: int, causal: bool) -> int:
    """The last block row a forward or dQ program from query row q_row0 reads (its query tile of
    128 rows, its key tiles of bn rows: the kernels' ``reach``)."""
    n_tiles = -(-big_l // bn)
    if causal:
        n_tiles = min(n_tiles, -(-(q_row0 + 128) // bn))
    return max(q_row0 + 128, n_tiles * bn) - 1


def _part_runs(part: int, limit, pos0: int, r: int, reach: int) -> bool:
    """The kernels' ``_runs`` past the rows check: PART 0 every program, 1 those whose last read
    row pos0 + r reach lies below *limit, 2 the others."""
    if part == 0:
        return True
    past = pos0 + r * reach >= int(limit[0])
    return past if part == 2 else not past


def _view_rows(desc, t: torch.Tensor, col: int) -> torch.Tensor:
    """Rows ``t`` of column ``col`` of a host descriptor's 4-D view [1, T, C, D] in float64, as TMA
    reads them: the base tensor through the descriptor's shape and strides, zeros at t >= T."""
    view = torch.as_strided(desc.base, list(desc.shape), list(desc.strides), desc.base.storage_offset())
    got = torch.zeros(t.numel(), desc.shape[3], dtype=torch.float64)
    inside = (t >= 0) & (t < desc.shape[1])
    got[inside] = view[0, t[inside], col].double()
    return got


CASES = [  # lengths (empty and one-token documents, no multiple of any w), branches, heads
    ([7, 0, 1, 40, 13], [4, 8, 16], [1, 2, 4], 4, 2),  # LongNet-like, r = 1 first: no fill
    ([30, 0, 45, 2], [6, 10], [2, 3], 6, 3),  # r > 1 first (filled buffers), 10 % 3 != 0
    ([3, 50, 9], [4, 64], [1, 5], 4, 4),  # w > every document, 64 % 5 != 0
    ([33, 1, 17], [16], [1], 2, 1),  # one branch: no lo buffer; MQA
    ([30, 0, 45, 3], [6, 10], [2, 3], 6, 3),  # 78 rows: r = 2 and 3 both over host descriptors
]


@interpreted
@pytest.mark.parametrize("lens,seg,dil,h,hkv", CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("host", [True, False], ids=["host-desc", "device-desc"])
def test_packed_call_with_emulated_kernel(monkeypatch, switch_on, lens, seg, dil, h, hkv, causal, checked, host):
    """``dilated_attention_varlen(impl="triton")`` with the Gluon varlen forward taken (its gate
    opened, its kernel emulated) against the float64 reference per document, forward and
    backward (the Triton varlen backward on the emulated out and lse); host-checked offsets
    (``check_offsets``) make the buffers unfilled where a first r = 1 branch stores every row.
    ``host``: the branches whose r divides the stream's rows launch the host-descriptor kernel
    (emulated through its descriptors' views), the others the device-descriptor one."""
    from dilated_attention.kernels import direct_launch

    emu = _EmulatedVarlenKernel()
    mod = emu.module()
    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS", host)
    # as on a Hopper GPU, but the offsets must reach it as one tensor (int64 offsets passed
    # for both: converted once, Docs.same_offsets)
    monkeypatch.setattr(gluon_varlen, "problem", lambda q, k, v, c, br, same, *a, **kw: None if same else "not same")
    monkeypatch.setattr(gluon_varlen, "kernel_module", lambda: mod)
    monkeypatch.setattr(direct_launch, "current_device", lambda: direct_launch.tensor_device(torch.zeros(1)))
    offs = _offsets(lens)
    g = torch.Generator().manual_seed(sum(lens) + h)
    q = torch.randn(offs[-1], h, 16, generator=g).to(torch.float16)
    k = torch.randn(offs[-1], hkv, 16, generator=g).to(torch.float16)
    v = torch.randn(offs[-1], hkv, 16, generator=g).to(torch.float16)
    do = torch.randn(offs[-1], h, 16, generator=g).to(torch.float16)
    cu = torch.tensor(offs, dtype=torch.int64 if checked else torch.int32)
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = dilated_attention_varlen(*xs, cu, cu, max(lens), max(lens), seg, dil, causal=causal, impl="triton",
                                        return_lse=True, check_offsets=checked)  # fmt: skip
    assert [x[0] for x in emu.launches] == dil, "the Gluon varlen forward did not run every branch"
    assert [x[-1] == "hd" for x in emu.launches] == [host and offs[-1] % r == 0 for r in dil]
    first_fills = not (dil[0] == 1 and checked)
    assert emu.launches[0][2] and all(not x[2] for x in emu.launches[1:])  # FIRST on branch 0 only
    grads = torch.autograd.grad(out, xs, do)
    r64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want_out, want_lse, want_g = varlen_reference(*r64, offs, offs, seg, dil, do.double(), causal=causal)
    assert (out.double() - want_out).abs().max().item() < 2e-2
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse.double()[fin] - want_lse[fin]).abs().max().item() < 1e-4
    for a, b in zip(grads, want_g, strict=True):
        assert (a.double() - b).abs().max().item() < 5e-2 * (1 + b.abs().max().item())
    assert first_fills or lse.isfinite().all()  # every row a document's: the first branch stored it


class _Launcher:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *a, **kw: self.fn(grid, *a, **kw)


class _EmulatedVarlenBwd:
    """``dkdv_varlen_kernel`` and ``dq_varlen_kernel`` in float64 on the CPU at the granularity
    of a program: the grid decode of the kernels (entry, key / query tile of 128 rows, kv head
    and residue slot / query head), the block of rows ``p0 + c + R t`` from the entry table, the
    block-major lse / delta rows [H, NE, LP], the stores (ADD False) or adds into the float32
    accumulators. Checks the grids against the tables."""

    BLK = 128

    def __init__(self):
        self.launches = []
        self.hd_launches = []  # those of the launches over host descriptors
        self.parts = []  # (kernel, r, PART) of every launch
        self.ran = collections.Counter()  # programs that did work, by (kernel, host descriptors?, PART)
        self.dkdv_varlen_kernel = _Launcher(self._dkdv)
        self.dq_varlen_kernel = _Launcher(self._dq)
        self.dkdv_varlen_hd_kernel = _Launcher(self._dkdv_hd)
        self.dq_varlen_hd_kernel = _Launcher(self._dq_hd)
        self.BK = types.SimpleNamespace(BMQ=64, WG_M=64)

    @staticmethod
    def _grads(qb, dob, kb, vb, l2, dl2, qk_scale, causal, q_rows, k_rows):
        p = torch.exp2(qb @ kb.T * qk_scale - l2[:, None])
        if causal:
            p = p.masked_fill(k_rows[None, :] > q_rows[:, None], 0.0)
        return p, p * (dob @ vb.T - dl2[:, None])

    @staticmethod
    def _kv_slot(pid_x, ni, rep, r):
        # gluon_varlen_kernel._kv_slot: kv head g, first query head, its residue, its heads of g
        g = pid_x // ni
        h_start = g * rep + pid_x % ni
        return g, h_start, h_start % r, ((g + 1) * rep - h_start + r - 1) // r

    def _block(self, p0, ws, e, c, r):
        n = max(-(-(int(ws[e]) - c) // r), 0)
        return int(p0[e]) + c + r * torch.arange(n), n

    def _dkdv(self, grid, q, do, k, v, l_desc, dl_desc, dk, dv, p0, ws, limit, qk_scale, sm_scale, ne, nnb, r, nh,
              hkv, rep, ni, lp, snq, snk, *, BMQ, CAUSAL, ADD, PART, **_):  # fmt: skip
        self.launches.append(("dkdv", r, ADD))
        self.parts.append(("dkdv", r, PART))
        assert grid == (nnb * ne, hkv * ni) and ne == p0.numel() == ws.numel() and (snq, snk) == (q.stride(0), k.stride(0))
        assert lp % self.BLK == 0 and lp >= nnb * self.BLK  # the kernels load whole 128-row tiles of rows
        lf, df = l_desc.base.reshape(-1).double(), dl_desc.base.reshape(-1).double()
        assert l_desc.base.shape == (nh, ne, lp)
        for pid0 in range(grid[0]):
            pid_n, e = pid0 % nnb, pid0 // nnb
            for pid_x in range(grid[1]):
                g, h_start, c, nhl = self._kv_slot(pid_x, ni, rep, r)
                rows, n = self._block(p0, ws, e, c, r)
                assert n <= nnb * self.BLK and n <= lp, "the grid or the rows do not cover the block"
                kr = torch.arange(pid_n * self.BLK, max(pid_n * self.BLK, min((pid_n + 1) * self.BLK, n)))  # empty past the block
                reach = max(pid_n * self.BLK + self.BLK, -(-n // BMQ) * BMQ) - 1
                if kr.numel() == 0 or not _part_runs(PART, limit, int(p0[e]) + c, r, reach):
                    continue
                self.ran[("dkdv", False, PART)] += 1
                kb, vb = k[rows[kr], g].double(), v[rows[kr], g].double()
                gk, gv = torch.zeros_like(kb), torch.zeros_like(vb)
                for j in range(max(nhl, 0)):
                    h = h_start + j * r
                    qb, dob = q[rows, h].double(), do[rows, h].double()
                    lrow = (h * ne + e) * lp
                    pr, ds = self._grads(qb, dob, kb, vb, lf[lrow : lrow + n], df[lrow : lrow + n], qk_scale, CAUSAL,
                                         torch.arange(n), kr)  # fmt: skip
                    gv += pr.T @ dob
                    gk += ds.T @ qb
                for acc, gr in ((dk, gk * sm_scale), (dv, gv)):
                    if ADD:
                        acc[rows[kr], g] += gr.float()
                    else:
                        acc[rows[kr], g] = gr.float()

    def _dkdv_hd(self, grid, q_desc, do_desc, k_desc, v_desc, l_desc, dl_desc, dk, dv, p0, ws, limit, qk_scale,
                 sm_scale, ne, nnb, r, nh, hkv, rep, ni, lp, *, BMQ, CAUSAL, ADD, PART, **_):  # fmt: skip
        """``dkdv_varlen_hd_kernel`` program by program through its descriptors' views
        (:func:`_view_rows`): the key tile n_lo + [0, 128), the query tiles of 64 rows the kernel
        streams (from n_lo on when causal), their lse / delta rows block-major (+inf / 0 past
        the block: those queries add nothing), dK / dV rows t < L stored."""
        self.launches.append(("dkdv", r, ADD))
        self.hd_launches.append(("dkdv", r))
        self.parts.append(("dkdv", r, PART))
        d = q_desc.shape[3]
        assert grid == (nnb * ne, hkv * ni) and ne == p0.numel() == ws.numel() and lp % self.BLK == 0
        for desc, heads, rows in ((q_desc, nh, BMQ), (do_desc, nh, BMQ), (k_desc, hkv, 64), (v_desc, hkv, 64)):
            assert list(desc.shape)[1:] == [q_desc.shape[1], r * heads, d] and list(desc.block_shape) == [1, rows, 1, d]
        lf, df = l_desc.base.reshape(-1).double(), dl_desc.base.reshape(-1).double()
        for pid0 in range(grid[0]):
            pid_n, e = pid0 % nnb, pid0 // nnb
            for pid_x in range(grid[1]):
                g, h_start, c, nhl = self._kv_slot(pid_x, ni, rep, r)
                big_l = max(-(-(int(ws[e]) - c) // r), 0)
                n_lo = pid_n * self.BLK
                pos0 = int(p0[e]) + c
                reach = max(n_lo + self.BLK, -(-big_l // BMQ) * BMQ) - 1
                if n_lo >= big_l or not _part_runs(PART, limit, pos0, r, reach):
                    continue
                self.ran[("dkdv", True, PART)] += 1
                b, a0 = pos0 % r, pos0 // r
                tk = torch.arange(n_lo, n_lo + self.BLK)
                kb, vb = (_view_rows(x, a0 + tk, b * hkv + g) for x in (k_desc, v_desc))
                tq = torch.arange(n_lo if CAUSAL else 0, -(-big_l // BMQ) * BMQ)
                gk, gv = torch.zeros_like(kb), torch.zeros_like(vb)
                for j in range(max(nhl, 0)):
                    h = h_start + j * r
                    qb, dob = (_view_rows(x, a0 + tq, b * nh + h) for x in (q_desc, do_desc))
                    lrow = (h * ne + e) * lp
                    pr, ds = self._grads(qb, dob, kb, vb, lf[lrow + tq], df[lrow + tq], qk_scale, CAUSAL, tq, tk)
                    gv += pr.T @ dob
                    gk += ds.T @ qb
                keep = tk < big_l
                rows = pos0 + r * tk[keep]
                for acc, gr in ((dk, gk[keep] * sm_scale), (dv, gv[keep])):
                    if ADD:
                        acc[rows, g] += gr.float()
                    else:
                        acc[rows, g] = gr.float()

    def _dq_hd(self, grid, q_desc, do_desc, k_desc, v_desc, dq, lse2, delta2, p0, ws, limit, qk_scale, sm_scale, ne,
               nmb, r, nh, hkv, lp, *, BN, CAUSAL, ADD, PART, **_):  # fmt: skip
        """``dq_varlen_hd_kernel`` program by program through its descriptors' views: the query
        tile q_row0 + [0, 128), the key tiles of BN rows up to the kernel's n_tiles, keys t >= L
        (and above the diagonal) masked, dQ rows t < L stored."""
        self.launches.append(("dq", r, ADD))
        self.hd_launches.append(("dq", r))
        self.parts.append(("dq", r, PART))
        assert grid == (nmb * ne, nh) and lse2.shape == delta2.shape == (nh, ne, lp)
        lf, df = lse2.reshape(-1).double(), delta2.reshape(-1).double()
        for pid0 in range(grid[0]):
            pid_m, e = pid0 % nmb, pid0 // nmb
            for h in range(nh):
                c, hk = h % r, h // (nh // hkv)
                big_l = max(-(-(int(ws[e]) - c) // r), 0)
                q_row0 = pid_m * self.BLK
                pos0 = int(p0[e]) + c
                if q_row0 >= big_l or not _part_runs(PART, limit, pos0, r, _fwd_reach(q_row0, big_l, BN, CAUSAL)):
                    continue
                self.ran[("dq", True, PART)] += 1
                b, a0 = pos0 % r, pos0 // r
                n_kv = -(-big_l // BN)
                n_tiles = min(n_kv, -(-(q_row0 + self.BLK) // BN)) if CAUSAL else n_kv
                tq = torch.arange(q_row0, q_row0 + self.BLK)
                tk = torch.arange(n_tiles * BN)
                qb, dob = (_view_rows(x, a0 + tq, b * nh + h) for x in (q_desc, do_desc))
                kb, vb = (_view_rows(x, a0 + tk, b * hkv + hk) for x in (k_desc, v_desc))
                lrow = (h * ne + e) * lp
                p = torch.exp2(qb @ kb.T * qk_scale - lf[lrow + tq][:, None]).masked_fill(tk[None, :] >= big_l, 0.0)
                if CAUSAL:
                    p = p.masked_fill(tk[None, :] > tq[:, None], 0.0)
                ds = p * (dob @ vb.T - df[lrow + tq][:, None])
                keep = tq < big_l
                gq = (ds[keep] @ kb * sm_scale).float()
                rows = pos0 + r * tq[keep]
                if ADD:
                    dq[rows, h] += gq
                else:
                    dq[rows, h] = gq

    def _dq(self, grid, q, do, k, v, dq, lse2, delta2, p0, ws, limit, qk_scale, sm_scale, ne, nmb, r, nh, hkv, lp,
            snq, snk, *, BN, CAUSAL, ADD, PART, **_):  # fmt: skip
        self.launches.append(("dq", r, ADD))
        self.parts.append(("dq", r, PART))
        assert grid == (nmb * ne, nh) and lse2.shape == delta2.shape == (nh, ne, lp)
        assert lp % self.BLK == 0 and lp >= nmb * self.BLK
        lf, df = lse2.reshape(-1).double(), delta2.reshape(-1).double()
        for pid0 in range(grid[0]):
            pid_m, e = pid0 % nmb, pid0 // nmb
            for h in range(nh):
                c, hk = h % r, h // (nh // hkv)
                rows, n = self._block(p0, ws, e, c, r)
                assert n <= nmb * self.BLK and n <= lp
                qr = torch.arange(pid_m * self.BLK, max(pid_m * self.BLK, min((pid_m + 1) * self.BLK, n)))  # empty past the block
                reach = _fwd_reach(pid_m * self.BLK, n, BN, CAUSAL)
                if qr.numel() == 0 or not _part_runs(PART, limit, int(p0[e]) + c, r, reach):
                    continue
                self.ran[("dq", False, PART)] += 1
                kb, vb = k[rows, hk].double(), v[rows, hk].double()
                lrow = (h * ne + e) * lp
                _, ds = self._grads(q[rows[qr], h].double(), do[rows[qr], h].double(), kb, vb, lf[lrow + qr],
                                    df[lrow + qr], qk_scale, CAUSAL, qr, torch.arange(n))  # fmt: skip
                gq = (ds @ kb * sm_scale).float()
                if ADD:
                    dq[rows[qr], h] += gq
                else:
                    dq[rows[qr], h] = gq


def _emulate_backward(monkeypatch):
    """The Gluon varlen backward taken on the CPU: its gate opened where the switch is on (same
    offsets only), its kernels emulated (:class:`_EmulatedVarlenBwd`); the forward stays on the
    Triton varlen kernels (interpreted)."""
    from dilated_attention.kernels import direct_launch

    emu = _EmulatedVarlenBwd()
    monkeypatch.setattr(gluon_varlen, "VARLEN_FORWARD", False)
    monkeypatch.setattr(gluon_varlen, "backward_problem",
                        lambda q, k, v, c, br, same, *a, **kw: None if same and gluon_varlen.VARLEN_BACKWARD else "off")
    monkeypatch.setattr(gluon_varlen, "kernel_module", lambda: emu)
    monkeypatch.setattr(direct_launch, "current_device", lambda: direct_launch.tensor_device(torch.zeros(1)))
    return emu


BWD_CASES = CASES + [
    ([20, 0, 37, 5], [8, 16], [2, 4], 8, 2),  # 4 query heads per kv head, r = 2 and 4: several heads a residue
    ([26, 31], [6, 12], [2, 3], 6, 2),  # 3 query heads per kv head: r = 2 does not divide the group
    ([20, 0, 37, 7], [8, 16], [2, 4], 8, 2),  # 64 rows: r = 2 and 4 over host descriptors
]


@interpreted
@pytest.mark.parametrize("lens,seg,dil,h,hkv", BWD_CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("split", [False, True], ids=["one-phase", "split-phases"])
@pytest.mark.parametrize("host", [True, False], ids=["host-desc", "device-desc"])
def test_packed_backward_with_emulated_kernels(monkeypatch, switch_on, lens, seg, dil, h, hkv, causal, checked, split,
                                               host):  # fmt: skip
    """``dilated_attention_varlen(impl="triton")`` with the Gluon varlen backward taken (its
    kernels emulated in float64, the block-major rows by ``gluon_varlen.prep_rows``): gradients
    against the float64 reference per document. A first r = 1 branch over host-checked offsets
    (CPU offsets always are) stores (ADD False) into unfilled accumulators; every other launch
    adds (r > 1 first: zeroed accumulators). ``host``: the branches whose r divides the stream's
    rows launch the host-descriptor kernels (emulated through their descriptors' views)."""
    from dilated_attention.kernels import gluon_bwd

    emu = _emulate_backward(monkeypatch)
    monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", split)
    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS", host)
    offs = _offsets(lens)
    g = torch.Generator().manual_seed(sum(lens) + 3 * h)
    q = torch.randn(offs[-1], h, 16, generator=g).to(torch.float16)
    k = torch.randn(offs[-1], hkv, 16, generator=g).to(torch.float16)
    v = torch.randn(offs[-1], hkv, 16, generator=g).to(torch.float16)
    do = torch.randn(offs[-1], h, 16, generator=g).to(torch.float16)
    cu = torch.tensor(offs, dtype=torch.int64 if checked else torch.int32)
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    out = dilated_attention_varlen(*xs, cu, cu, max(lens), max(lens), seg, dil, causal=causal, impl="triton",
                                   check_offsets=checked)  # fmt: skip
    grads = torch.autograd.grad(out, xs, do)
    stores = dil[0] == 1  # offsets on the CPU are always checked (varlen.py), ``check_offsets`` or not
    assert sorted({x[:2] for x in emu.launches}) == sorted({(kn, r) for kn in ("dkdv", "dq") for r in dil})
    # the first branch's two launches store (r = 1 over offsets checked on the host), all others add
    stored = [x for x in emu.launches if not x[2]]
    assert sorted(stored) == ([("dkdv", 1, False), ("dq", 1, False)] if stores else [])
    assert len(emu.launches) == 2 * len(dil)
    assert sorted(emu.hd_launches) == sorted((kn, r) for kn in ("dkdv", "dq") for r in dil if host and offs[-1] % r == 0)
    r64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    _, _, want_g = varlen_reference(*r64, offs, offs, seg, dil, do.double(), causal=causal)
    for name, a, b in zip("qkv", grads, want_g, strict=True):
        assert a.dtype == torch.float16
        assert (a.double() - b).abs().max().item() < 2e-2 * (1 + b.abs().max().item()), f"d{name}"


@interpreted
@pytest.mark.parametrize("causal", [False, True])
def test_unchecked_offsets_add_into_zeros_and_leave_rows_past_the_documents_zero(monkeypatch, switch_on, causal):
    """Offsets nobody checked (``offsets_checked=False``, the route of device offsets) that stop
    short of the stream: the first r = 1 branch adds into zeroed accumulators (no launch
    stores), and the rows past the last document get zero gradients. Those rows hold NaN and
    -inf here, which no document may see: such calls never take the host-descriptor kernels
    (which read past a block's end; emulated so, they would spread the NaN) unless
    ``HOST_DESCRIPTORS_UNCHECKED`` splits them (its own test below), switched off here, as is
    ``FILL_UNCOVERED_ONLY`` (on by default since 2026-11-29: the first branch then stores; its
    own tests below)."""
    from dilated_attention.kernels.triton_ops import dilated_attention_triton_varlen

    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS_UNCHECKED", False)
    monkeypatch.setattr(gluon_varlen, "FILL_UNCOVERED_ONLY", False)
    emu = _emulate_backward(monkeypatch)
    lens, seg, dil, h, hkv = [7, 0, 1, 40, 13], [4, 8, 16], [1, 2, 4], 4, 2
    offs = _offsets(lens)
    total = offs[-1] + 9  # 9 rows of no document
    g = torch.Generator().manual_seed(11)
    q = torch.randn(total, h, 16, generator=g).to(torch.float16)
    k, v = (torch.randn(total, hkv, 16, generator=g).to(torch.float16) for _ in range(2))
    do = torch.randn(total, h, 16, generator=g).to(torch.float16)
    for x, bad in ((q, float("nan")), (k, float("-inf")), (v, float("nan")), (do, float("inf"))):
        x[offs[-1] :] = bad
    cu = torch.tensor(offs, dtype=torch.int32)
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    out = dilated_attention_triton_varlen(*xs, cu, cu, max(lens), max(lens), seg, dil, causal=causal, scale=0.25,
                                          head_assignment="all", offsets_checked=False)[0]  # fmt: skip
    grads = torch.autograd.grad(out, xs, do)
    assert len(emu.launches) == 2 * len(dil) and all(x[2] for x in emu.launches), "a launch stored"
    assert not emu.hd_launches
    n = offs[-1]
    for a in grads:
        assert (a[n:] == 0).all(), "rows past the last document have gradients"
    r64 = [x[:n].detach().double().requires_grad_() for x in (q, k, v)]
    _, _, want = varlen_reference(*r64, offs, offs, seg, dil, do[:n].double(), causal=causal, softmax_scale=0.25)
    for a, b in zip(grads, want, strict=True):
        assert (a[:n].double() - b).abs().max().item() < 2e-2 * (1 + b.abs().max().item())


class _NaNEmpty:
    """``torch`` for a module under test, but ``empty`` / ``empty_like`` give floating tensors full
    of NaN: a buffer allocated empty whose element no launch or fill writes shows up as NaN (on
    the CPU, fresh memory is often zeros, which would hide it)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def _nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty(self, *a, **kw):
        return self._nan(self._real.empty(*a, **kw))

    def empty_like(self, *a, **kw):
        return self._nan(self._real.empty_like(*a, **kw))


def _emulate_gluon_varlen(monkeypatch):
    """The Gluon varlen forward and backward taken on the CPU (same offsets only), their kernels
    emulated, host- and device-descriptor alike; the modules' empty buffers start as NaN."""
    from dilated_attention.kernels import direct_launch, gluon_bwd

    fwd, bwd = _EmulatedVarlenKernel(), _EmulatedVarlenBwd()
    mod = fwd.module(dkdv_varlen_kernel=bwd.dkdv_varlen_kernel, dq_varlen_kernel=bwd.dq_varlen_kernel,
                     dkdv_varlen_hd_kernel=bwd.dkdv_varlen_hd_kernel, dq_varlen_hd_kernel=bwd.dq_varlen_hd_kernel,
                     BK=bwd.BK)  # fmt: skip
    monkeypatch.setattr(gluon_varlen, "kernel_module", lambda: mod)
    monkeypatch.setattr(gluon_varlen, "problem", lambda q, k, v, c, br, same, *a, **kw: None if same else "not same")
    monkeypatch.setattr(gluon_varlen, "backward_problem", lambda q, k, v, c, br, same, *a, **kw: None if same else "x")
    monkeypatch.setattr(direct_launch, "current_device", lambda: direct_launch.tensor_device(torch.zeros(1)))
    monkeypatch.setattr(gluon_varlen, "torch", _NaNEmpty(torch))
    monkeypatch.setattr(gluon_bwd, "torch", _NaNEmpty(torch))
    return fwd, bwd


def _fill_uncovered_cases(cu_ok: bool, rows: int, device: str) -> None:
    """:func:`test_fill_uncovered_sets_exactly_the_rows_no_document_covers` on ``device``."""
    g = torch.Generator().manual_seed(rows)
    lens = _lognormal(rows - 40, 120.0, seed=rows)
    good = _offsets(lens)
    bad_sets = [[3] + good[1:], good[:2] + [good[1] - 1] + good[3:], [0, rows + 5], good[:-1] + [rows - 20]]
    for cuv in [good] if cu_ok else bad_sets:
        max_len = max(max(b - a for a, b in zip(cuv[:-1], cuv[1:], strict=True)), 1)
        if not cu_ok and cuv is bad_sets[-1]:
            max_len = max(lens) - 1  # a document longer than the caller's bound
        valid = cuv[0] == 0 and cuv[-1] <= rows and all(0 <= b - a <= max_len for a, b in zip(cuv[:-1], cuv[1:], strict=True))
        assert valid == cu_ok, cuv
        start = min(max(cuv[-1], 0), rows) if valid else 0
        cu = torch.tensor(cuv, dtype=torch.int32, device=device)
        half = torch.bfloat16 if device == "cuda" else torch.float16  # bf16: the GPU's (the interpreter refuses it)
        for shape, rows_dim, value, dt in [((rows, 3, 8), 0, 0.0, half), ((1, rows, 2, 8), 1, 0.0, torch.float32),
                                           ((5, rows), 1, float("-inf"), torch.float32)]:  # fmt: skip
            for per, most in ((64, 1024), (4096, 1024), (64, 7)):  # many programs, one, rows spread over 7
                x = torch.randn(shape, generator=g).to(dt).to(device)
                want = x.clone()
                want.narrow(rows_dim, start, rows - start).fill_(value)
                old = gluon_varlen.FILL_ROWS_PER, gluon_varlen.FILL_MAX_PROGRAMS
                gluon_varlen.FILL_ROWS_PER, gluon_varlen.FILL_MAX_PROGRAMS = per, most
                try:
                    gluon_varlen.fill_uncovered(x, cu, max_len, value, rows_dim)
                finally:
                    gluon_varlen.FILL_ROWS_PER, gluon_varlen.FILL_MAX_PROGRAMS = old
                assert torch.equal(x, want), (cuv, shape, per, most)


@interpreted
@pytest.mark.parametrize("cu_ok", [True, False], ids=["valid", "invalid"])
@pytest.mark.parametrize("rows", [1500, 1480])
def test_fill_uncovered_sets_exactly_the_rows_no_document_covers(cu_ok, rows):
    """``triton_kernels.fill_uncovered_kernel`` (interpreted): valid offsets (0 first, documents
    of 0..max_len rows, the last offset inside the stream) set the rows at or past the last
    offset, any other offsets every row; the rest stay as they were, for every buffer layout the
    Gluon varlen path fills (rows first, rows second, one program or many)."""
    _fill_uncovered_cases(cu_ok, rows, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cu_ok", [True, False], ids=["valid", "invalid"])
def test_fill_uncovered_kernel_compiled(cu_ok):
    """The same, compiled on a GPU (bf16 among the buffers)."""
    _fill_uncovered_cases(cu_ok, 1480, "cuda")


OFFSET_CASES = {
    "stops-short": lambda offs, n: (offs, n + 29),
    "covers-all": lambda offs, n: (offs, n),
    "first-not-0": lambda offs, n: ([5] + offs[1:], n + 29),
    "overlapping": lambda offs, n: (offs[:2] + [offs[1] - 20] + offs[3:], n + 29),
}


@interpreted
@pytest.mark.parametrize("case", list(OFFSET_CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("phases", [True, False], ids=["split-phases", "one-phase"])
def test_unchecked_offsets_fill_only_the_uncovered_rows(monkeypatch, switch_on, case, causal, phases):
    """``FILL_UNCOVERED_ONLY``: offsets nobody checked, through the Gluon varlen forward and
    backward (emulated, host and device descriptors, buffers allocated empty start as NaN): the
    results and gradients are those of the zero-filled buffers bit for bit where the offsets tile
    the stream's start (documents stopping short of it or covering it, or starting past row 0);
    overlapping documents (no valid packing) still leave no element unwritten."""
    from dilated_attention.kernels import gluon_bwd
    from dilated_attention.kernels.triton_ops import dilated_attention_triton_varlen

    _emulate_gluon_varlen(monkeypatch)
    monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", phases)  # the accumulators in one run, or dK/dV's then dQ's
    lens, seg, dil, h, hkv = [60, 0, 90, 1, 120], [16, 32], [1, 2], 4, 2
    offs, total = OFFSET_CASES[case](_offsets(lens), sum(lens))
    g = torch.Generator().manual_seed(23)
    q, do = (torch.randn(total, h, 16, generator=g).to(torch.float16) for _ in range(2))
    k, v = (torch.randn(total, hkv, 16, generator=g).to(torch.float16) for _ in range(2))
    cu = torch.tensor(offs, dtype=torch.int32)
    fills, real_fill = [], gluon_varlen.fill_uncovered
    monkeypatch.setattr(gluon_varlen, "fill_uncovered", lambda x, *a: fills.append(x.shape) or real_fill(x, *a))
    results = {}
    for only in (False, True):
        fills.clear()
        monkeypatch.setattr(gluon_varlen, "FILL_UNCOVERED_ONLY", only)
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = dilated_attention_triton_varlen(*xs, cu, cu, max(lens), max(lens), seg, dil, causal=causal, scale=0.25,
                                              head_assignment="all", offsets_checked=False)[0]  # fmt: skip
        results[only] = [out, *torch.autograd.grad(out, xs, do)]
        assert all(torch.isfinite(t).all() for t in results[only]), (case, only)
        # out, lo, lse; then the float32 accumulators dq, dk, dv (one or two phases)
        assert len(fills) == (6 if only else 0), fills
    if case != "overlapping":  # overlapping documents: the first branch stores where the fills added
        for a, b in zip(results[True], results[False], strict=True):
            assert torch.equal(a, b), case


# seeds whose draws cover host and unchecked offsets, rows past the documents, r = 1 first or not,
# MHA / GQA / MQA, head dims 64 and 128
@interpreted
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 6, 7, 20, 21])
def test_random_packed_batches_through_the_emulated_kernels(monkeypatch, seed):
    """Random cases of ``scripts/fuzz.py --gluon --varlen`` (tests/gluon_varlen_fuzz_cases.py,
    float16 and at most 700 rows here) through the emulated Gluon varlen kernels: offsets
    checked on the host, or unchecked (rows past the documents NaN / inf), with the fills of
    every buffer or of the uncovered rows only (``FILL_UNCOVERED_ONLY``): judged as the fuzz
    judges them, against the float64 reference per document and the interpreted Triton varlen
    kernels. (440 such cases passed on the CPU, each with both fills, 2026-11-29; 64 of them on the
    uncovered-rows fill with rows past the documents.)"""
    import dataclasses
    import random

    import gluon_varlen_fuzz_cases as V
    from gluon_fuzz_cases import gluon_switches, judge

    from dilated_attention.kernels.triton_ops import dilated_attention_triton_varlen

    _emulate_gluon_varlen(monkeypatch)
    monkeypatch.setattr(gluon_varlen, "_failed", {})  # a failed first launch would route the call to Triton
    monkeypatch.setattr(gluon_varlen, "_bwd_failed", {})
    monkeypatch.setattr(V, "MAX_TOTAL", 700)
    c = dataclasses.replace(V.gluon_varlen_case(random.Random(seed)), bf16=False)  # the interpreter refuses bf16

    def run(gluon: bool, only: bool):
        q, k, v, do = V._inputs(c, "cpu")
        cu = torch.tensor(V._offsets(c), dtype=torch.int32)
        xs = [t.detach().requires_grad_() for t in (q, k, v)]
        monkeypatch.setattr(gluon_varlen, "FILL_UNCOVERED_ONLY", only)
        with gluon_switches(gluon), V.varlen_gates_open(), V.counting_calls() as seen:
            out, lse = dilated_attention_triton_varlen(
                *xs, cu, cu, c.max_len, c.max_len, list(c.seg), list(c.dil), causal=c.causal, scale=c.d**-0.5,
                head_assignment="all", offsets_checked=not c.device_offsets)[:2]  # fmt: skip
            grads = torch.autograd.grad(out, xs, do)
        assert seen == ({"forward": 1, "backward": 1} if gluon else {"forward": 0, "backward": 0}), (seen, c)
        return {"out": out, "lse": lse.reshape(c.h, -1), "dq": grads[0], "dk": grads[1], "dv": grads[2]}

    ref = V.run(c, "reference", "cpu", None)
    base = run(False, False)
    for only in (False, True):
        assert judge(ref, base, run(True, only), c.dtype) == [], (only, c)


@interpreted
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fill_only", [False, True], ids=["zero-filled", "fill-uncovered"])
def test_unchecked_offsets_split_between_host_and_device_descriptors(monkeypatch, switch_on, causal, fill_only):
    """``HOST_DESCRIPTORS_UNCHECKED``: offsets not checked that stop short of the stream (NaN and inf
    in the rows past them). Each branch whose r divides the rows launches the host-descriptor
    kernels for the programs whose reads stay below ``limit_row`` (PART 1) and the
    device-descriptor ones for the others (PART 2), forward and backward; here both parts have
    programs. The documents match the float64 reference and see no NaN (the emulated
    host-descriptor kernels read past a block's end as TMA does, so a program on the wrong side
    would spread it); the rows past them read 0, zero-filled or (``fill_only``,
    ``FILL_UNCOVERED_ONLY``) set by the fill of the rows no document covers."""
    from dilated_attention.kernels.triton_ops import dilated_attention_triton_varlen

    fwd, bwd = _emulate_gluon_varlen(monkeypatch)
    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS_UNCHECKED", True)
    monkeypatch.setattr(gluon_varlen, "FILL_UNCOVERED_ONLY", fill_only)
    lens, seg, dil, h, hkv = [60, 0, 90, 1, 120], [16, 32], [1, 2], 4, 2
    offs = _offsets(lens)
    n, total = offs[-1], offs[-1] + 29  # 300 rows: r = 1 and 2 divide them
    g = torch.Generator().manual_seed(17)
    q, do = (torch.randn(total, h, 16, generator=g).to(torch.float16) for _ in range(2))
    k, v = (torch.randn(total, hkv, 16, generator=g).to(torch.float16) for _ in range(2))
    for x, bad in ((q, float("nan")), (k, float("-inf")), (v, float("nan")), (do, float("inf"))):
        x[n:] = bad
    cu = torch.tensor(offs, dtype=torch.int32)
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    out = dilated_attention_triton_varlen(*xs, cu, cu, max(lens), max(lens), seg, dil, causal=causal, scale=0.25,
                                          head_assignment="all", offsets_checked=False)[0]  # fmt: skip
    grads = torch.autograd.grad(out, xs, do)
    assert fwd.ran[(True, 1)] and fwd.ran[(False, 2)] and not fwd.ran[(True, 0)] and not fwd.ran[(False, 0)]
    for kn in ("dkdv", "dq"):
        assert bwd.ran[(kn, True, 1)] and bwd.ran[(kn, False, 2)], (kn, bwd.ran)
    assert sorted(bwd.parts) == sorted((kn, r, p) for kn in ("dkdv", "dq") for r in dil for p in (1, 2))
    assert (out[n:] == 0).all() and all((a[n:] == 0).all() for a in grads)
    r64 = [x[:n].detach().double().requires_grad_() for x in (q, k, v)]
    want_out, _, want = varlen_reference(*r64, offs, offs, seg, dil, do[:n].double(), causal=causal,
                                         softmax_scale=0.25)  # fmt: skip
    assert (out[:n].double() - want_out).abs().max().item() < 2e-2
    for a, b in zip(grads, want, strict=True):
        assert (a[:n].double() - b).abs().max().item() < 2e-2 * (1 + b.abs().max().item())


@interpreted
@pytest.mark.parametrize("r,lens,w", [(1, [7, 0, 1, 40, 13], 16), (3, [30, 0, 45, 2], 10), (5, [3, 50, 9], 64)])
def test_block_rows_kernel_equals_prep_rows(r, lens, w):
    """``triton_kernels.gluon_varlen_rows_kernel`` (interpreted here) gives
    :func:`gluon_varlen.prep_rows`'s values bit for bit, over the device entry table (unused
    slots all padding), with -inf lse rows (no key) sent to +inf."""
    offs = _offsets(lens)
    total, nh = offs[-1], 4
    g = torch.Generator().manual_seed(r)
    lse = torch.randn(nh, total, generator=g)
    lse[1, 3] = float("-inf")
    delta = torch.randn(nh, total, generator=g)
    p0, ws = gluon_varlen.device_entries(torch.tensor(offs, dtype=torch.int32), w, total)
    lp = gluon_varlen.rows_pad(max(lens), total, w, r)
    lse2, delta2 = gluon_varlen.block_rows(lse, delta, p0, ws, r, lp)
    assert torch.equal(lse2, gluon_varlen.prep_rows(lse, p0, ws, r, lp, float("inf"), LOG2E))
    assert torch.equal(delta2, gluon_varlen.prep_rows(delta, p0, ws, r, lp, 0.0))
    hp0, hws = gluon_varlen.entries(offs, w)
    for h in range(nh):
        c = h % r
        for e, (a, n) in enumerate(zip(hp0, hws, strict=True)):
            rows = [a + c + r * t for t in range(max(-(-(n - c) // r), 0))]
            want = lse[h, rows] * LOG2E
            want[want == float("-inf")] = float("inf")
            assert torch.equal(lse2[h, e, : len(rows)], want) and (lse2[h, e, len(rows) :] == float("inf")).all()
    assert (lse2[:, len(hp0) :] == float("inf")).all() and (delta2[:, len(hp0) :] == 0).all()


def test_backward_gate(monkeypatch):
    """The backward's own switch, its float32 budget (accumulators + the largest branch's rows)
    and its failures recorded apart from the forward's; a failed launch warns and the Triton
    varlen backward runs the call."""
    import functools

    from dilated_attention.kernels import gluon_bwd

    q = torch.zeros(1, 8192, 4, 128, dtype=torch.bfloat16)
    br = [(2048, 1, 0, 4), (4096, 2, 0, 4)]
    # every row in a document (offsets checked on the host): the host-descriptor gates where r divides the rows
    monkeypatch.setattr(gluon_varlen, "backward_problem", functools.partial(gluon_varlen.backward_problem, covered=True))
    monkeypatch.setattr(gluon_varlen, "problem", functools.partial(gluon_varlen.problem, covered=True))
    monkeypatch.setattr(gluon_varlen, "VARLEN_BACKWARD", False)
    assert "VARLEN_BACKWARD is off" in gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 2)
    monkeypatch.setattr(gluon_varlen, "VARLEN_BACKWARD", True)
    monkeypatch.setattr(gluon_fwd, "device_problem", lambda q: None)
    monkeypatch.setattr(gluon_fwd, "MIN_ROWS", 0)
    monkeypatch.setattr(gluon_varlen, "kernel_module", lambda: object())
    monkeypatch.setattr(gluon_varlen, "_bwd_failed", {})
    assert gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 2) is None
    # dq + dk + dv in float32, and the larger branch's rows: (2048, 1), 2 documents + 4 slots of 2048 rows
    need = 4 * 8192 * 128 * 12 + gluon_varlen.rows_bytes(8192, 2, 8192, 2048, 1, 4)
    assert need == 4 * 8192 * 128 * 12 + 2 * 4 * 4 * (2 + 4) * 2048
    assert gluon_varlen.rows_bytes(8192, 2, 8192, 4096, 2, 4) < gluon_varlen.rows_bytes(8192, 2, 8192, 2048, 1, 4)
    monkeypatch.setattr(gluon_bwd, "MAX_F32_BYTES", need - 1)
    assert "MAX_F32_BYTES" in gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 2)
    monkeypatch.setattr(gluon_bwd, "MAX_F32_BYTES", need)
    assert gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 2) is None
    # the backward's gates are its own: head dim 64 runs it over host descriptors (HEADDIMS_BACKWARD),
    # not over device ones (DEVICE_DESC_HEADDIMS_BACKWARD), nor the forward (HEADDIMS); its
    # mean-document gate is lower (9 documents in 8192 rows keep the forward on Triton, not the backward)
    monkeypatch.setattr(gluon_bwd, "MAX_F32_BYTES", 2**40)  # more documents, more rows
    q64 = torch.zeros(1, 8192, 4, 64, dtype=torch.bfloat16)
    assert gluon_varlen.backward_problem(q64, q64, q64, False, br, True, 8192, 2) is None
    assert "HEADDIMS " in gluon_varlen.problem(q64, q64, q64, False, br, True, 8192, 2)
    q64_odd = torch.zeros(1, 8191, 4, 64, dtype=torch.bfloat16)  # r = 2 does not divide 8191 rows
    why = gluon_varlen.backward_problem(q64_odd, q64_odd, q64_odd, False, br, True, 8191, 2)
    assert "DEVICE_DESC_HEADDIMS_BACKWARD" in why
    assert "MIN_MEAN_DOC " in gluon_varlen.problem(q, q, q, False, br, True, 8192, 9)
    assert gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 9) is None
    assert gluon_varlen.MIN_MEAN_DOC_BACKWARD < gluon_varlen.DEVICE_DESC_MIN_MEAN_DOC_BACKWARD
    monkeypatch.setattr(gluon_varlen, "MIN_MEAN_DOC_BACKWARD", 1024)
    assert gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 8) is None  # a mean of exactly 1024
    why = gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 9)
    assert "MIN_MEAN_DOC_BACKWARD = 1024" in why and "9 documents" in why
    q_odd = torch.zeros(1, 8191, 4, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(gluon_varlen, "DEVICE_DESC_MIN_MEAN_DOC_BACKWARD", 2048)
    why = gluon_varlen.backward_problem(q_odd, q_odd, q_odd, False, br, True, 8191, 4)
    assert "DEVICE_DESC_MIN_MEAN_DOC_BACKWARD = 2048" in why and "4 documents" in why
    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS", False)  # the switch off: the device gates everywhere
    assert "DEVICE_DESC_MIN_MEAN_DOC_BACKWARD" in gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 5)
    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS", True)
    # unchecked offsets: the host gate under the split (HOST_DESCRIPTORS_UNCHECKED, on), else the device one
    assert gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 5, covered=False) is None
    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS_UNCHECKED", False)
    why = gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 5, covered=False)
    assert "DEVICE_DESC_MIN_MEAN_DOC_BACKWARD" in why
    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS_UNCHECKED", True)
    gluon_varlen._bwd_failed[(torch.bfloat16, 128, True)] = "boom"
    assert "failed here before" in gluon_varlen.backward_problem(q, q, q, True, br, True, 8192, 2)
    assert gluon_varlen.backward_problem(q, q, q, False, br, True, 8192, 2) is None


@interpreted
def test_failed_backward_launch_falls_back_with_a_warning(monkeypatch, switch_on):
    def boom(*a, **kw):
        raise RuntimeError("out of resources (test)")

    _emulate_backward(monkeypatch)
    monkeypatch.setattr(gluon_varlen, "backward", boom)
    offs = _offsets([9, 20])
    q = torch.randn(offs[-1], 2, 16).to(torch.float16)
    cu = torch.tensor(offs, dtype=torch.int32)
    xs = [q.clone().requires_grad_() for _ in range(3)]
    out = dilated_attention_varlen(*xs, cu, cu, 20, 20, [8, 16], [1, 2], impl="triton")
    with pytest.warns(RuntimeWarning, match="Gluon varlen backward failed"):
        got = torch.autograd.grad(out, xs, torch.ones_like(out))
    r64 = [q.detach().double().requires_grad_() for _ in range(3)]
    _, _, want = varlen_reference(*r64, offs, offs, [8, 16], [1, 2], torch.ones_like(out).double())
    for a, b in zip(got, want, strict=True):
        assert (a.double() - b).abs().max().item() < 2e-2 * (1 + b.abs().max().item())
    assert list(gluon_varlen._bwd_failed) == [(torch.float16, 16, False)] and not gluon_varlen._failed


@interpreted
def test_switch_ab_benchmark_runs_both_arms_and_counts_the_on_arm(monkeypatch, switch_on, tmp_path):
    """benchmarks/varlen_switch_ab.py on a tiny case on the CPU (the backward's kernels emulated,
    timing replaced by one call): both arms run, the Gluon calls counted are the on arm's, the
    switches come back as they were."""
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import varlen_switch_ab as ab

    _emulate_backward(monkeypatch)
    monkeypatch.setattr(ab, "DEVICE", "cpu")
    monkeypatch.setattr(ab, "_bench", lambda fn, rep: (fn(), 1.0)[1])
    monkeypatch.setitem(ab.CASES, "tiny", (96, 30, 0.5, 2, 1, 16, torch.float16, [16, 32], [1, 2]))
    before = (gluon_varlen.VARLEN_FORWARD, gluon_varlen.VARLEN_BACKWARD)
    r = ab.run_case("tiny", True, 1, 1, "backward")
    assert r["gluon"] == "0 / 1" and r["diff"] < 2e-2 and r["on_fb"] == r["off_fb"] == 1.0
    assert (gluon_varlen.VARLEN_FORWARD, gluon_varlen.VARLEN_BACKWARD) == before
    assert gluon_varlen.forward.__module__ == gluon_varlen.__name__  # the spies removed
    # the whole script: its table, one row per (case, causal), the per-round range, gates restored
    monkeypatch.setattr(ab, "results_header", lambda *a, **kw: ["# header"])
    monkeypatch.setattr(sys, "argv", ["varlen_switch_ab.py", "--cases", "tiny", "--rounds", "2", "--switch", "both",
                                      "--min-mean-doc", "0", "--out", str(tmp_path / "ab.md")])  # fmt: skip
    monkeypatch.setattr(gluon_varlen, "MIN_MEAN_DOC", gluon_varlen.MIN_MEAN_DOC)  # main sets it: restored after
    ab.main()
    rows = [x for x in (tmp_path / "ab.md").read_text().splitlines() if x.startswith("| tiny |")]
    assert len(rows) == 2 and all(x.count("|") == 14 and "| 1.000-1.000 |" in x for x in rows), rows


@interpreted
def test_switch_off_runs_the_triton_varlen_kernels(monkeypatch):
    monkeypatch.setattr(gluon_varlen, "VARLEN_FORWARD", False)
    called = []
    monkeypatch.setattr(gluon_varlen, "forward", lambda *a, **kw: called.append(1))
    lens = [9, 20]
    offs = _offsets(lens)
    q = torch.randn(offs[-1], 2, 16).to(torch.float16)
    cu = torch.tensor(offs, dtype=torch.int32)
    out = dilated_attention_varlen(q, q, q, cu, cu, 20, 20, [8, 16], [1, 2], impl="triton")
    assert out.shape == q.shape and not called and not gluon_varlen.VARLEN_FORWARD


@interpreted
def test_failed_launch_falls_back_with_a_warning(monkeypatch, switch_on):
    from dilated_attention.kernels import direct_launch

    def boom(*a, **kw):
        raise RuntimeError("out of resources (test)")

    monkeypatch.setattr(gluon_varlen, "problem", lambda *a, **kw: None)
    monkeypatch.setattr(gluon_varlen, "forward", boom)
    monkeypatch.setattr(direct_launch, "current_device", lambda: direct_launch.tensor_device(torch.zeros(1)))
    offs = _offsets([9, 20])
    q = torch.randn(offs[-1], 2, 16).to(torch.float16)
    cu = torch.tensor(offs, dtype=torch.int32)
    with pytest.warns(RuntimeWarning, match="Gluon varlen forward failed"):
        out = dilated_attention_varlen(q, q, q, cu, cu, 20, 20, [8, 16], [1, 2], impl="triton")
    want = dilated_attention_varlen(q, q, q, cu, cu, 20, 20, [8, 16], [1, 2], impl="reference")
    assert (out.float() - want.float()).abs().max().item() < 2e-2
    assert list(gluon_varlen._failed) == [(torch.float16, 16, False)]


@interpreted
def test_out_of_memory_in_the_forward_propagates_and_records_no_failure(monkeypatch, switch_on):
    """Out of memory in the Gluon varlen forward is the caller's, as on the Triton path (which
    needs as much): it propagates, and the configuration is not marked as failed."""
    from dilated_attention.kernels import direct_launch

    def oom(*a, **kw):
        raise torch.cuda.OutOfMemoryError("out of memory (test)")

    monkeypatch.setattr(gluon_varlen, "problem", lambda *a, **kw: None)
    monkeypatch.setattr(gluon_varlen, "forward", oom)
    monkeypatch.setattr(direct_launch, "current_device", lambda: direct_launch.tensor_device(torch.zeros(1)))
    offs = _offsets([9, 20])
    q = torch.randn(offs[-1], 2, 16).to(torch.float16)
    cu = torch.tensor(offs, dtype=torch.int32)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        dilated_attention_varlen(q, q, q, cu, cu, 20, 20, [8, 16], [1, 2], impl="triton")
    assert not gluon_varlen._failed


@interpreted
def test_gpu_check_helper_runs_on_the_cpu_with_the_emulated_kernel(monkeypatch, switch_on):
    """The CUDA tests' helper end to end on the CPU (the kernel emulated, its gate following the
    switch), so that a mistake in it does not first show on a GPU; and it fails when the Gluon
    path does not run."""
    from dilated_attention.kernels import direct_launch

    emu = _EmulatedVarlenKernel()
    bwd = _EmulatedVarlenBwd()
    mod = emu.module(dkdv_varlen_kernel=bwd.dkdv_varlen_kernel, dq_varlen_kernel=bwd.dq_varlen_kernel,
                     dkdv_varlen_hd_kernel=bwd.dkdv_varlen_hd_kernel, dq_varlen_hd_kernel=bwd.dq_varlen_hd_kernel,
                     BK=bwd.BK)  # fmt: skip
    monkeypatch.setattr(gluon_varlen, "problem", lambda *a, **kw: None if gluon_varlen.VARLEN_FORWARD else "off")
    monkeypatch.setattr(gluon_varlen, "backward_problem", lambda *a, **kw: None if gluon_varlen.VARLEN_BACKWARD else "off")
    monkeypatch.setattr(gluon_varlen, "kernel_module", lambda: mod)
    monkeypatch.setattr(direct_launch, "current_device", lambda: direct_launch.tensor_device(torch.zeros(1)))
    _check_on_gpu(monkeypatch, torch.float16, 16, 4, 2, [8, 20], [1, 3], True, [9, 0, 1, 30], device="cpu")
    assert emu.launches and bwd.launches
    # the Triton forward's lse into the Gluon backward (their gates differ: MIN_MEAN_DOC_BACKWARD)
    n, nb = len(emu.launches), len(bwd.launches)
    monkeypatch.setattr(gluon_varlen, "VARLEN_FORWARD", False)
    _check_on_gpu(monkeypatch, torch.float16, 16, 4, 2, [8, 20], [1, 3], False, [9, 0, 1, 30], device="cpu")
    assert len(emu.launches) == n and len(bwd.launches) > nb
    monkeypatch.setattr(gluon_varlen, "VARLEN_FORWARD", True)
    monkeypatch.setattr(gluon_varlen, "backward_problem", lambda *a, **kw: "refused")
    with pytest.raises(AssertionError, match="backward did not run"):
        _check_on_gpu(monkeypatch, torch.float16, 16, 4, 2, [8], [1], False, [9, 5], device="cpu")
    monkeypatch.setattr(gluon_varlen, "problem", lambda *a, **kw: "refused")
    with pytest.raises(AssertionError, match="did not run"):
        _check_on_gpu(monkeypatch, torch.float16, 16, 4, 2, [8], [1], False, [9, 5], device="cpu")


# --------------------------------------------------------------------------------- CUDA


def _lognormal(total: int, mean: float, seed: int) -> list[int]:
    """Document lengths, ``total`` tokens in all: lognormal around ``mean``, with an empty and
    a one-token document in the middle."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total - 1:
        lens.append(max(1, int(torch.empty(1).log_normal_(0.0, 1.0, generator=g).item() * mean)))
    lens[-1] -= sum(lens) - (total - 1)
    lens[len(lens) // 2 : len(lens) // 2] = [0, 1]
    return lens


def _check_on_gpu(monkeypatch, dtype, d, h, hkv, seg, dil, causal, lens, device: str = "cuda",
                  host_offsets: bool = True) -> None:
    """The library's packed call with the Gluon varlen forward and backward where their switches
    (``gluon_varlen.VARLEN_FORWARD``, ``VARLEN_BACKWARD``) are on, against the float64 reference per
    document, forward and backward, each error <= 2x the Triton varlen path's (both switches
    off) + 1e-3; the Gluon paths ran; their bits repeatable. (``device`` "cpu": the CPU
    smoke test of this helper, with the kernel emulated.) ``host_offsets``: the offsets as a CPU
    tensor (checked on the host: the host-descriptor kernels where r divides the rows), else on
    ``device`` (not checked: the device-descriptor kernels, or the split of
    ``HOST_DESCRIPTORS_UNCHECKED``)."""
    offs = _offsets(lens)
    cu = torch.tensor(offs, dtype=torch.int32, device="cpu" if host_offsets else device)
    g = torch.Generator(device=device).manual_seed(sum(lens) + d)
    q = torch.randn(offs[-1], h, d, device=device, generator=g).to(dtype)
    k = torch.randn(offs[-1], hkv, d, device=device, generator=g).to(dtype)
    v = torch.randn(offs[-1], hkv, d, device=device, generator=g).to(dtype)
    do = torch.randn(offs[-1], h, d, device=device, generator=g).to(dtype)
    launches, bwd_launches = [], []
    real, real_bwd = gluon_varlen.forward, gluon_varlen.backward
    monkeypatch.setattr(gluon_varlen, "forward", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    monkeypatch.setattr(gluon_varlen, "backward", lambda *a, **kw: bwd_launches.append(1) or real_bwd(*a, **kw))
    fwd_on, bwd_on = gluon_varlen.VARLEN_FORWARD, gluon_varlen.VARLEN_BACKWARD

    def call():
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        out, lse = dilated_attention_varlen(*xs, cu, cu, max(lens), max(lens), list(seg), list(dil), causal=causal,
                                            impl="triton", return_lse=True)  # fmt: skip
        return out, lse, torch.autograd.grad(out, xs, do)

    case = f"{dtype} D {d} heads {h}/{hkv} w {seg} r {dil} causal {causal} lengths {lens}"
    got = call()
    assert bool(launches) == fwd_on, f"the Gluon varlen forward did not run ({case}): {gluon_varlen._failed}"
    assert bool(bwd_launches) == bwd_on, f"the Gluon varlen backward did not run ({case}): {gluon_varlen._bwd_failed}"
    again = call()
    monkeypatch.setattr(gluon_varlen, "VARLEN_FORWARD", False)
    monkeypatch.setattr(gluon_varlen, "VARLEN_BACKWARD", False)
    base = call()
    monkeypatch.setattr(gluon_varlen, "VARLEN_FORWARD", fwd_on)
    monkeypatch.setattr(gluon_varlen, "VARLEN_BACKWARD", bwd_on)
    r64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want_out, want_lse, want_g = varlen_reference(*r64, offs, offs, list(seg), list(dil), do.double(), causal=causal)
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(got[1])), case
    pairs = [("out", got[0], base[0], want_out), ("lse", got[1][fin], base[1][fin], want_lse[fin])]
    pairs += [(f"d{n}", a, b, w) for n, a, b, w in zip("qkv", got[2], base[2], want_g, strict=True)]
    for name, a, b, w in pairs:
        ea, eb = (a.double() - w).abs().max().item(), (b.double() - w).abs().max().item()
        assert ea <= 2 * eb + 1e-3, f"{name}: Gluon varlen err {ea:.3g} > 2 x Triton err {eb:.3g} + 1e-3 ({case})"
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1]), f"forward not bitwise repeatable ({case})"
    for a, b in zip(got[2], again[2], strict=True):  # no atomics in either backward
        assert torch.equal(a, b), f"backward not bitwise repeatable ({case})"


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,h,hkv", [(128, 4, 2), (64, 6, 6)])
@pytest.mark.parametrize("seg,dil", [([64, 128, 256], [1, 2, 4]), ([96, 160], [2, 3]), ([64, 1024], [1, 5]),
                                     ([128], [1])])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_varlen_forward_vs_reference(monkeypatch, switch_on, dtype, d, h, hkv, seg, dil, causal):
    lens = _lognormal(1500, 300.0, seed=len(seg) * 7 + d + int(causal))
    _check_on_gpu(monkeypatch, dtype, d, h, hkv, seg, dil, causal, lens)


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("seg,dil", [([64, 128, 256], [1, 2, 4]), ([96, 160], [2, 3])])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_varlen_backward_after_the_triton_forward(monkeypatch, switch_on, seg, dil, causal):
    """The backward's gate is its own (MIN_MEAN_DOC_BACKWARD < MIN_MEAN_DOC): a call whose forward
    ran the Triton varlen kernels (its lse) and whose backward runs the Gluon ones."""
    monkeypatch.setattr(gluon_varlen, "VARLEN_FORWARD", False)
    lens = _lognormal(1500, 300.0, seed=len(seg) + int(causal))
    _check_on_gpu(monkeypatch, torch.bfloat16, 128, 4, 2, seg, dil, causal, lens)


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(12))
def test_gluon_varlen_forward_random_cases(monkeypatch, switch_on, seed):
    """Random packed configurations (seeded): dtype, headdim, heads (MQA, GQA, MHA, r > heads),
    1-4 branches with w from 2 to 2048 (w % r != 0 often, w past every document sometimes), r
    from 1 to 9 (r = 1 first or not), lengths lognormal around 50-800 tokens with empty and
    one-token documents, 300-4000 tokens in all; offsets on the host (checked) for even seeds, on the
    device (not checked) for odd ones."""
    import random

    rng = random.Random(1000 + seed)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    d = rng.choice([64, 128])
    hkv = rng.choice([1, 2, 4])
    h = hkv * rng.choice([1, 2, 3])
    seg, dil = [], []
    for _ in range(rng.randint(1, 4)):
        w = rng.choice([2, 3, 16, 64, 96, 100, 128, 257, 512, 1000, 2048])
        r = rng.randint(1, min(9, w // 2))
        seg.append(w)
        dil.append(r)
    if rng.random() < 0.5:
        dil[0] = 1
    lens = _lognormal(rng.randint(300, 4000), rng.choice([50.0, 200.0, 800.0]), seed=seed)
    _check_on_gpu(monkeypatch, dtype, d, h, hkv, seg, dil, rng.random() < 0.5, lens, host_offsets=seed % 2 == 0)


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("host_offsets", [False, True])
def test_gluon_varlen_training_call_does_not_synchronise(monkeypatch, switch_on, host_offsets):
    """A packed training call through the Gluon varlen forward and backward (entry tables,
    rows kernel, device-made descriptors, accumulators and casts) makes no host
    synchronisation, with the offsets on the device (never read) or on the host (checked there,
    copied without a sync); both Gluon paths ran."""
    lens = _lognormal(3000, 400.0, seed=5)
    offs = _offsets(lens)
    cu = torch.tensor(offs, dtype=torch.int32, device="cpu" if host_offsets else "cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    xs = [torch.randn(offs[-1], h, 128, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
          for h in (4, 2, 2)]  # fmt: skip
    calls = []
    for name in ("forward", "backward"):
        real = getattr(gluon_varlen, name)
        monkeypatch.setattr(gluon_varlen, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))

    def step():
        out = dilated_attention_varlen(*xs, cu, cu, max(lens), max(lens), [256, 512, 1024], [1, 2, 4],
                                       causal=True, impl="triton")  # fmt: skip
        torch.autograd.grad(out, xs, torch.ones_like(out))

    step()  # first call: compilation and one-time probes may synchronise
    torch.cuda.synchronize()
    calls.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert calls == ["forward", "backward"], f"the Gluon varlen paths did not both run: {calls}"


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["stops-short", "covers-all", "first-not-0"])
def test_gluon_varlen_fill_uncovered_only_same_bits(monkeypatch, switch_on, causal, case):
    """``FILL_UNCOVERED_ONLY`` on the GPU: device offsets (not checked), the Gluon varlen forward
    and backward with empty buffers (NaN-filled here, so that a missed element shows) and only
    the rows no document covers filled, against the zero-filled buffers: the same bits (out and
    the three gradients), and both the documents' float64 reference."""
    from dilated_attention.kernels import gluon_bwd

    lens = _lognormal(1500, 300.0, seed=5)
    offs, total = OFFSET_CASES[case](_offsets(lens), sum(lens))
    n = offs[-1]
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (torch.randn(total, h, 128, device="cuda", generator=g).to(torch.bfloat16) for h in (4, 2, 2, 4))
    cu = torch.tensor(offs, dtype=torch.int32, device="cuda")
    seg, dil = [64, 128, 256], [1, 2, 4]
    monkeypatch.setattr(gluon_varlen, "torch", _NaNEmpty(torch))
    monkeypatch.setattr(gluon_bwd, "torch", _NaNEmpty(torch))
    fills, real_fill = [], gluon_varlen.fill_uncovered
    monkeypatch.setattr(gluon_varlen, "fill_uncovered", lambda x, *a: fills.append(x.shape) or real_fill(x, *a))
    res = {}
    for only in (False, True):
        monkeypatch.setattr(gluon_varlen, "FILL_UNCOVERED_ONLY", only)
        ins = [x.detach().requires_grad_() for x in (q, k, v)]
        out = dilated_attention_varlen(*ins, cu, cu, max(lens), max(lens), seg, dil, causal=causal, impl="triton")
        res[only] = [out, *torch.autograd.grad(out, ins, do)]
    assert len(fills) == 6, fills  # out, lo, lse, dq, dk, dv: the Gluon varlen forward and backward ran
    for a, b in zip(res[True], res[False], strict=True):
        assert torch.equal(a, b)
    lo = offs[0]
    r64 = [x[lo:n].detach().double().requires_grad_() for x in (q, k, v)]
    doc_offs = [o - lo for o in offs]
    want_out, _, want_g = varlen_reference(*r64, doc_offs, doc_offs, seg, dil, do[lo:n].double(), causal=causal)
    out, *grads = res[True]
    assert (out[:lo] == 0).all() and (out[n:] == 0).all()
    assert (out[lo:n].double() - want_out).abs().max().item() < 2e-2
    for name, a, b in zip("qkv", grads, want_g, strict=True):
        assert (a[:lo] == 0).all() and (a[n:] == 0).all(), f"d{name} outside the documents"
        assert (a[lo:n].double() - b).abs().max().item() < 2e-2 * (1 + b.abs().max().item()), f"d{name}"


@needs_gluon
@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("split", [False, True], ids=["device-desc", "split"])
def test_gluon_varlen_rows_past_the_documents_stay_out(monkeypatch, switch_on, causal, split):
    """Device offsets (not checked) that stop short of the stream, whose rows past the last document
    hold NaN and inf: the Gluon varlen kernels run (on device-made descriptors, which end at each
    block: ``gluon_varlen.host_descriptors``; ``split``: with ``HOST_DESCRIPTORS_UNCHECKED``, the
    host-descriptor kernels for the programs that read below ``limit_row``, 1800 rows divided by
    every r), the documents' results and gradients match the float64 reference, and the rows past
    them read as out 0 and zero gradients."""
    monkeypatch.setattr(gluon_varlen, "HOST_DESCRIPTORS_UNCHECKED", split)
    lens = _lognormal(1500, 300.0, seed=3)
    offs = _offsets(lens)
    n, total = offs[-1], offs[-1] + 300
    g = torch.Generator(device="cuda").manual_seed(3)
    xs = [torch.randn(total, h, 128, device="cuda", generator=g).to(torch.bfloat16) for h in (4, 2, 2, 4)]
    for x, bad in zip(xs, (float("nan"), float("-inf"), float("nan"), float("inf")), strict=True):
        x[n:] = bad
    q, k, v, do = xs
    cu = torch.tensor(offs, dtype=torch.int32, device="cuda")
    seg, dil = [64, 128, 256], [1, 2, 4]
    calls = []
    for name in ("forward", "backward"):
        real = getattr(gluon_varlen, name)
        monkeypatch.setattr(gluon_varlen, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    ins = [x.detach().requires_grad_() for x in (q, k, v)]
    out = dilated_attention_varlen(*ins, cu, cu, max(lens), max(lens), seg, dil, causal=causal, impl="triton")
    grads = torch.autograd.grad(out, ins, do)
    assert calls == ["forward", "backward"], calls
    assert (out[n:] == 0).all() and all((gr[n:] == 0).all() for gr in grads)
    r64 = [x[:n].detach().double().requires_grad_() for x in (q, k, v)]
    want_out, _, want_g = varlen_reference(*r64, offs, offs, seg, dil, do[:n].double(), causal=causal)
    assert (out[:n].double() - want_out).abs().max().item() < 2e-2
    for name, a, b in zip("qkv", grads, want_g, strict=True):
        assert (a[:n].double() - b).abs().max().item() < 2e-2 * (1 + b.abs().max().item()), f"d{name}"
