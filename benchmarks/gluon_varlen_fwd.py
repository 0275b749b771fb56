"""Prototype: the Gluon forward over packed documents in ONE launch per branch (issue 22 item 2b).

Why: on Hopper one sequence runs the Gluon kernels and packed documents the Triton varlen ones,
so the packed stream's rate per useful FLOP lags one sequence's by the two families' gap
(benchmarks/NOTES_triton.md, "Packed documents in the Gluon kernels"). This prototype is NOTES'
option A: the library's Gluon forward partitions (``kernels/gluon_fwd_kernel``: loader,
two consumer warpgroups, the (hi, lo) merge epilogue) unchanged, under a new top-level kernel
whose program builds its block's TMA descriptors on the device
(``tma.make_tensor_descriptor``): base at the block's first row ``p0 + c`` (``p0`` the
segment's first row in the packed stream, ``c = h % r``), shape ``[1, L, 1, D]`` with ``L =
ceil((w_s - c) / r)`` rows for a segment of ``w_s`` rows, row stride ``r x`` the stream's. TMA
then zero-fills past the block and drops stores past it, exactly as the host descriptors do at
a launch's L: no masking changes, no length classes (each program has its own L), short last
segments and documents shorter than w included.

One program per (query tile of 128 rows, entry, head); an entry is one (document, segment)
of the branch, listed on the host here (``entries``: the prototype reads the offsets on the
host; the library would build the table on the device, as its Triton varlen grid does).
Programs past their block's rows do nothing. The descriptors need a global scratch of 640 bytes
a program, which Triton asks of the allocator in ``triton.runtime._allocation._allocator`` (a
ContextVar): set around each launch and reset after, so the process-wide default (set by the
user or not) is left as found.

    /tmp/t36/bin/python benchmarks/gluon_varlen_fwd.py --compile-only    # CPU: sm_90 compile (Triton 3.6)
    PYTHONPATH=src python3 benchmarks/gluon_varlen_fwd.py --check --bench --out $OUT/gluon_varlen_fwd.md

``--check``: random packed batches (lognormal lengths with empty, one-token and long
documents; branches with w % r != 0, w > a document, r > 1 first; causal and not; GQA; bf16 and
fp16; D 64 and 128) against the float64 reference on each document alone (out and lse).
``--bench``: the issue's packed batch (128K tokens, lognormal mean 8K, 16 x 128, bf16, LongNet
branches) forward: this prototype, the library's varlen forward (Triton kernels), and one
sequence of 128K tokens (Gluon, and Triton) per useful FLOP. Exit 2 without an sm_90 GPU (the
compile mode needs only Triton 3.6). Not in src/: nothing here is wired into the library.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from dilated_attention.kernels import gluon_fwd_kernel as F

    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001  (no Gluon / no Hopper module in this Triton)
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

from dilated_attention.kernels import gluon_fwd  # noqa: E402

SCRATCH_PER_PROGRAM = 640  # five 128-byte descriptors (checked against the compiled kernel)
PROGRAM_ROWS = 128  # query rows a program covers: gluon_fwd_kernel.BM (two 64-row consumers)

if _IMPORT_ERROR is None:
    _WGM = gl.constexpr(F.WG_M)

    @gluon.jit
    def gluon_fwd_varlen_kernel(Q, K, V, O, LO, LSE, ENT_P0, ENT_W, qk_scale, TOTAL, SNQ, SNK, R, H, HKV,
                                q_layout: gl.constexpr, kv_layout: gl.constexpr, BN: gl.constexpr,
                                D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                FIRST: gl.constexpr, COMP: gl.constexpr, STORE_LO: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):  # fmt: skip
        """One program per (query tile of 128 rows, entry e, head h): the block of head h in
        entry e's segment (rows ENT_P0[e] + c + R t, c = h % R, t < L, the segment ENT_W[e]
        rows long) through the library's partitions with descriptors made here (coordinates 0
        but the row). q, out, lo: (TOTAL, H, D) rows of SNQ elements; k, v: (TOTAL, HKV, D) rows of
        SNK; lse (H, TOTAL) float32."""
        pid_m = gl.program_id(0)
        e = gl.program_id(1)
        h = gl.program_id(2)
        c = h % R
        hk = h // (H // HKV)
        p0 = gl.load(ENT_P0 + e)
        ws = gl.load(ENT_W + e)
        L = gl.maximum((ws - c + R - 1) // R, 0)
        q_row0 = pid_m * (2 * _WGM)
        if q_row0 < L:
            row = (p0 + c).to(gl.int64)
            rq = R.to(gl.int64) * SNQ
            rk = R.to(gl.int64) * SNK
            q_desc = tma.make_tensor_descriptor(Q + row * SNQ + h * D, [1, L, 1, D], [rq * L, rq, D, 1],
                                                [1, _WGM, 1, D], q_layout)  # fmt: skip
            k_desc = tma.make_tensor_descriptor(K + row * SNK + hk * D, [1, L, 1, D], [rk * L, rk, D, 1],
                                                [1, BN, 1, D], kv_layout)  # fmt: skip
            v_desc = tma.make_tensor_descriptor(V + row * SNK + hk * D, [1, L, 1, D], [rk * L, rk, D, 1],
                                                [1, BN, 1, D], kv_layout)  # fmt: skip
            o_desc = tma.make_tensor_descriptor(O + row * SNQ + h * D, [1, L, 1, D], [rq * L, rq, D, 1],
                                                [1, _WGM, 1, D], q_layout)  # fmt: skip
            lo_desc = tma.make_tensor_descriptor(LO + row * SNQ + h * D, [1, L, 1, D], [rq * L, rq, D, 1],
                                                 [1, _WGM, 1, D], q_layout)  # fmt: skip
            n_kv = gl.cdiv(L, BN)
            if CAUSAL:
                n_tiles = gl.minimum(n_kv, gl.cdiv(q_row0 + 2 * _WGM, BN))
                n_full = gl.minimum(q_row0 // BN, L // BN)
            else:
                n_tiles = n_kv
                n_full = L // BN
            lse_base = h.to(gl.int64) * TOTAL
            pos0 = p0 + c
            dtype: gl.constexpr = Q.dtype.element_ty
            q_bufs = gl.allocate_shared_memory(dtype, [2, 1, _WGM, 1, D], q_layout)
            k_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BN, 1, D], kv_layout)
            v_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BN, 1, D], kv_layout)
            e_bufs = gl.allocate_shared_memory(dtype, [2, 1, _WGM, 1, D], q_layout)
            q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            e_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(q_bars.index(i), count=1)
                mbarrier.init(e_bars.index(i), count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(k_ready.index(i), count=1)
                mbarrier.init(v_ready.index(i), count=1)
                mbarrier.init(k_empty.index(i), count=2)
                mbarrier.init(v_empty.index(i), count=2)
            # as gluon_fwd_kernel, with the block, column and lo coordinates 0 (the descriptors
            # start at the block) and lse at pos0 + R t of row h
            gl.warp_specialize(
                [
                    (F._consumer_wg0, (q_bufs, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_empty, v_empty,
                                       o_desc, lo_desc, e_bufs, e_bars, LSE, lse_base, pos0, 0, 0, 0,
                                       q_row0, n_tiles, n_full, L, R, qk_scale, BN, D, STAGES, CAUSAL,
                                       FIRST, COMP, STORE_LO)),
                    (F._consumer_wg1, (q_bufs, k_bufs, v_bufs, q_bars, k_ready, v_ready, k_empty, v_empty,
                                       o_desc, lo_desc, e_bufs, e_bars, LSE, lse_base, pos0, 0, 0, 0,
                                       q_row0, n_tiles, n_full, L, R, qk_scale, BN, D, STAGES, CAUSAL,
                                       FIRST, COMP, STORE_LO)),
                    (F._loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bars, k_ready,
                                 v_ready, k_empty, v_empty, q_row0, 0, 0, 0, n_tiles, BN, STAGES)),
                ],
                [4, 1],
                [CONSUMER_REGS, LOADER_REGS],
            )  # fmt: skip


# ------------------------------------------------------------------------------ host


def entries(offsets: list[int], w: int) -> tuple[list[int], list[int]]:
    """(first row, rows) of every segment of branch w in every non-empty document: document i
    (rows offsets[i]:offsets[i+1]) has segments of w rows from its first row, the last one
    shorter where its length is no multiple of w."""
    p0, ws = [], []
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        for s in range(a, b, w):
            p0.append(s)
            ws.append(min(w, b - s))
    return p0, ws


def grid_for(offsets: list[int], w: int, r: int, nh: int) -> tuple[int, int, int]:
    """(query tiles of the longest block, entries, heads); (0, 0, 0) without an entry. The
    longest block is the first offset's (c = 0) of the longest segment: ceil(min(w, n) / r)."""
    lens = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    n_ent = sum(-(-n // w) for n in lens)
    if not n_ent:
        return (0, 0, 0)
    longest = -(-max(min(w, n) for n in lens) // r)
    return (-(-longest // PROGRAM_ROWS), n_ent, nh)


class _Scratch:
    """Triton's allocator for the descriptors' global scratch, set for one launch: the previous
    allocator (the user's, or Triton's default) comes back after it."""

    def __init__(self, device):
        self.device = device

    def __call__(self, size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=self.device)

    def __enter__(self):
        from triton.runtime import _allocation

        self._token = _allocation._allocator.set(self)
        return self

    def __exit__(self, *exc):
        from triton.runtime import _allocation

        _allocation._allocator.reset(self._token)
        return False


def varlen_forward(q, k, v, offsets: list[int], seg, dil, causal: bool, scale: float | None = None):
    """out (total, H, D) and lse (H, total) float32 of dilated attention over the packed
    documents ``offsets`` (host ints, queries and keys alike), every head in every branch.
    Buffers and the FIRST / COMP / STORE_LO choices as the library's Gluon forward."""
    total, nh, d = q.shape
    nkv = k.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v)):  # the descriptors' strides: rows of heads x D
        if not x.is_contiguous():
            raise ValueError(f"gluon_varlen_fwd: {name} must be contiguous (total, heads, D), got strides {x.stride()}")
    if k.shape != v.shape or nh % nkv or offsets[-1] > total:
        raise ValueError(f"gluon_varlen_fwd: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"last offset {offsets[-1]}")
    scale = d**-0.5 if scale is None else scale
    branches = list(zip(seg, dil, strict=True))
    # branch 0 with r = 1 stores every row of every document; else the buffers start filled
    covered = offsets[0] == 0 and offsets[-1] == total
    fill = not (branches[0][1] == 1 and covered)
    several = len(branches) > 1
    out = torch.zeros_like(q) if fill else torch.empty_like(q)
    lo = (torch.zeros_like(q) if fill else torch.empty_like(q)) if several else out
    lse = torch.full((nh, total), float("-inf"), dtype=torch.float32, device=q.device) if fill else \
        torch.empty((nh, total), dtype=torch.float32, device=q.device)
    kern = gluon_fwd_varlen_kernel
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([1, F.WG_M, 1, d], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([1, gluon_fwd.KV_BN, 1, d], gdt)
    last = len(branches) - 1
    with _Scratch(q.device):
        for bi, (w, r) in enumerate(branches):
            p0, ws = entries(offsets, w)
            if not p0:
                continue
            ent = torch.tensor([p0, ws], dtype=torch.int32).to(q.device, non_blocking=True)
            grid = grid_for(offsets, w, r, nh)
            kern[grid](q, k, v, out, lo, lse, ent[0], ent[1], scale * 1.4426950408889634, total,
                       q.stride(0), k.stride(0), r, nh, nkv, q_layout=q_layout, kv_layout=kv_layout,
                       BN=gluon_fwd.KV_BN, D=d, STAGES=gluon_fwd.stages(d), CAUSAL=bool(causal),
                       FIRST=bi == 0, COMP=several, STORE_LO=bi < last,
                       CONSUMER_REGS=gluon_fwd.CONSUMER_REGS, LOADER_REGS=gluon_fwd.LOADER_REGS,
                       num_warps=4, maxnreg=gluon_fwd.MAXNREG)  # fmt: skip
    return out, lse


def emulate_forward(q, k, v, offsets: list[int], seg, dil, causal: bool, scale: float | None = None):
    """The kernel's index arithmetic in float64 on any device (a CPU check of the design, no
    Gluon): per branch, entry (p0, w_s) and head h, the block rows p0 + c + r t (t < L, L =
    ceil((w_s - c) / r), c = h % r), dense attention inside it (causal inside the block), its
    (out, lse) merged into the result by LSE weights at rows pos0 + r t of lse's row h."""
    total, nh, d = q.shape
    grp = nh // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros(total, nh, d, dtype=torch.float64, device=q.device)
    lse = torch.full((nh, total), float("-inf"), dtype=torch.float64, device=q.device)
    for w, r in zip(seg, dil, strict=True):
        for p0, ws in zip(*entries(offsets, w), strict=True):
            for h in range(nh):
                c = h % r
                n_rows = max(-(-(ws - c) // r), 0)
                if n_rows == 0:
                    continue
                rows = p0 + c + r * torch.arange(n_rows, device=q.device)
                qb = q[rows, h].double()
                kb, vb = k[rows, h // grp].double(), v[rows, h // grp].double()
                s_ = qb @ kb.T * scale
                if causal:
                    s_ = s_.masked_fill(torch.ones_like(s_, dtype=torch.bool).triu(1), float("-inf"))
                lb = torch.logsumexp(s_, dim=1)
                ob = torch.softmax(s_, dim=1) @ vb
                la = lse[h, rows]
                mx = torch.maximum(la, lb)
                wa, wb = torch.exp(la - mx), torch.exp(lb - mx)
                out[rows, h] = (out[rows, h] * wa[:, None] + ob * wb[:, None]) / (wa + wb)[:, None]
                lse[h, rows] = mx + torch.log(wa + wb)
    return out, lse


# ------------------------------------------------------------------------------ check / bench


def _lengths(rng: torch.Generator, total: int, mean: float) -> list[int]:
    from bench_varlen import document_lengths

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    lens = document_lengths(total, mean, 1.0, seed)
    # empty and one-token documents inside the stream
    lens[len(lens) // 2 : len(lens) // 2] = [0, 1]
    return lens


CHECK_BRANCHES = (
    ([64, 128, 256], [1, 2, 4]),  # LongNet-like, r = 1 first (no fill)
    ([96, 160], [2, 3]),  # r > 1 first (filled buffers), 160 % 3 != 0
    ([64, 1024], [1, 5]),  # w > most documents, 1024 % 5 != 0
    ([128], [1]),  # one branch: no lo buffer
)


def check(device, lines: list[str]) -> bool:
    from dilated_attention.reference import dilated_attention_reference

    ok = True
    rng = torch.Generator().manual_seed(0)
    lines += ["## check against the float64 reference on each document alone", "",
              "| dtype | D | heads | branches | causal | docs | out max err | lse max err | ok |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for dtype in (torch.bfloat16, torch.float16):
        for d, nh, nkv in ((128, 4, 2), (64, 6, 6)):
            for seg, dil in CHECK_BRANCHES:
                for causal in (False, True):
                    lens = _lengths(rng, 1500, 300.0)
                    offs = [0]
                    for n in lens:
                        offs.append(offs[-1] + n)
                    total = offs[-1]
                    q = torch.randn(total, nh, d, device=device, dtype=dtype)
                    k = torch.randn(total, nkv, d, device=device, dtype=dtype)
                    v = torch.randn_like(k)
                    out, lse = varlen_forward(q, k, v, offs, seg, dil, causal)
                    torch.cuda.synchronize()
                    e_out = e_lse = 0.0
                    for a, b in zip(offs[:-1], offs[1:], strict=True):
                        if a == b:
                            continue
                        ro, rl = dilated_attention_reference(q[a:b][None].double(), k[a:b][None].double(),
                                                             v[a:b][None].double(), seg, dil, causal=causal)
                        e_out = max(e_out, (out[a:b].double() - ro[0]).abs().max().item())
                        fin = torch.isfinite(rl[0])
                        if not torch.equal(fin, torch.isfinite(lse[:, a:b])):
                            e_lse = float("inf")
                        else:
                            e_lse = max(e_lse, (lse[:, a:b].double()[fin] - rl[0][fin]).abs().max().item())
                    good = e_out < 2e-2 and e_lse < 1e-3
                    ok &= good
                    row = (f"| {str(dtype)[6:]} | {d} | {nh}/{nkv} | {seg} / {dil} | {causal} | {len(lens)} | "
                           f"{e_out:.2e} | {e_lse:.2e} | {'yes' if good else '**NO**'} |")
                    print(row, flush=True)
                    lines.append(row)
    lines.append("")
    return ok


def _bench_rows(device, causal, offs, lens, seg, dil, total, nh, d) -> list[str]:
    import triton.testing

    from dilated_attention import dilated_attention, dilated_attention_varlen, flags
    from dilated_attention.flops import dilated_flops, dilated_flops_varlen

    q = torch.randn(total, nh, d, device=device, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu = torch.tensor(offs, dtype=torch.int32)
    fl_v = dilated_flops_varlen(lens, lens, nh, d, seg, dil, causal)
    fl_1 = dilated_flops(1, total, total, nh, d, seg, dil, causal)

    def t(fn):
        fn()
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    def one():
        return dilated_attention(q[None], k[None], v[None], seg, dil, causal=causal, impl="triton")

    def one_triton():
        flags.set_gluon_forward(False)
        try:
            return one()
        finally:
            flags.set_gluon_forward(None)

    with torch.no_grad():
        ms = {
            "prototype (Gluon, packed)": (t(lambda: varlen_forward(q, k, v, offs, seg, dil, causal)), fl_v),
            "library varlen (Triton)": (t(lambda: dilated_attention_varlen(
                q, k, v, cu, cu, max(lens), max(lens), seg, dil, causal=causal, impl="triton")), fl_v),
            "one sequence, Gluon": (t(one), fl_1),
            "one sequence, Triton": (t(one_triton), fl_1),
        }  # fmt: skip
    rate_one = fl_1 / ms["one sequence, Gluon"][0] / 1e9
    rows = []
    for name, (m, fl) in ms.items():
        rate = fl / m / 1e9
        rows.append(f"| {causal} | {name} | {m:.3f} | {rate:.0f} | {rate_one / rate:.3f}x |")
        print(rows[-1], flush=True)
    return rows


def bench(device, lines: list[str]) -> None:
    from bench_varlen import document_lengths

    seg, dil = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
    total, nh, d = 131072, 16, 128
    lens = document_lengths(total, 8192.0, 1.0, 0)
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    lines += [f"## forward: {total} tokens in {len(lens)} documents (lognormal mean 8192, sigma 1, seed 0; "
              f"longest {max(lens)}), {nh} x {d}, bf16, w {seg}, r {dil}", "",
              "| causal | call | ms | useful TF/s | vs one sequence (Gluon) per FLOP |", "|---|---|---|---|---|"]  # fmt: skip
    for causal in (False, True):
        lines += _bench_rows(device, causal, offs, lens, seg, dil, total, nh, d)
    lines.append("")


def _resources(cubin: bytes) -> str:
    """'REG / STACK / LOCAL' of a cubin (cuobjdump bundled with Triton)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    got = [re.search(rf"{key}:(\d+)", res) for key in ("REG", "STACK", "LOCAL")]
    return " / ".join(m.group(1) if m else "?" for m in got)


def compile_only(lines: list[str]) -> bool:
    """Compile the variants for sm_90 without a GPU (Triton 3.6): shared memory and scratch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    lines += [f"## sm_90 compile (CPU, triton {triton.__version__})", "",
              "| variant | shared bytes | global scratch bytes / program | regs / stack / local |", "|---|---|---|---|"]  # fmt: skip
    ok = F.BM == PROGRAM_ROWS
    if not ok:
        lines.append(f"PROGRAM_ROWS {PROGRAM_ROWS} != gluon_fwd_kernel.BM {F.BM}")
    for dt, gdt in (("bf16", gl.bfloat16), ("fp16", gl.float16)):
        for d in (128, 64):
            for causal, first, comp in ((False, True, False), (False, False, True), (True, True, True),
                                        (True, False, True)):  # fmt: skip
                name = f"{dt} D={d} causal={causal} first={first} comp={comp}"
                sig = {n: f"*{dt}" for n in ("Q", "K", "V", "O", "LO")}
                sig.update({"LSE": "*fp32", "ENT_P0": "*i32", "ENT_W": "*i32", "qk_scale": "fp32"})
                sig.update({n: "i32" for n in ("TOTAL", "SNQ", "SNK", "R", "H", "HKV")})
                consts = {"q_layout": gl.NVMMASharedLayout.get_default_for([1, F.WG_M, 1, d], gdt),
                          "kv_layout": gl.NVMMASharedLayout.get_default_for([1, gluon_fwd.KV_BN, 1, d], gdt),
                          "BN": gluon_fwd.KV_BN, "D": d, "STAGES": gluon_fwd.stages(d), "CAUSAL": causal,
                          "FIRST": first, "COMP": comp, "STORE_LO": comp,
                          "CONSUMER_REGS": gluon_fwd.CONSUMER_REGS, "LOADER_REGS": gluon_fwd.LOADER_REGS}  # fmt: skip
                sig.update({n: "constexpr" for n in consts})
                attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}
                try:
                    ck = triton.compile(GluonASTSource(gluon_fwd_varlen_kernel, sig, consts, attrs),
                                        target=GPUTarget("cuda", 90, 32),
                                        options={"num_warps": 4, "maxnreg": gluon_fwd.MAXNREG})  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    ok = False
                    lines.append(f"| {name} | compile FAILED: {type(e).__name__}: {str(e)[:300]} | | |")
                    print(lines[-1], flush=True)
                    continue
                md = ck.metadata
                if md.global_scratch_size != SCRATCH_PER_PROGRAM:
                    ok = False
                regs = _resources(ck.asm["cubin"])
                ok &= regs.endswith("/ 0 / 0")  # no stack, no local memory (spills)
                lines.append(f"| {name} | {md.shared} | {md.global_scratch_size} | {regs} |")
                print(lines[-1], flush=True)
    lines.append("")
    return ok


def env_problem() -> str | None:
    if _IMPORT_ERROR is not None:
        return f"Gluon's Hopper module does not import: {_IMPORT_ERROR}"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "needs an sm_90 GPU"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="against the float64 reference (GPU)")
    ap.add_argument("--bench", action="store_true", help="the issue's packed batch, forward (GPU)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 on the CPU")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    args = ap.parse_args(argv)
    if not (args.check or args.bench or args.compile_only):
        ap.error("give --check, --bench and/or --compile-only")
    lines = ["# Prototype: the Gluon forward over packed documents (issue 22 item 2b)", "",
             f"`{' '.join(sys.argv)}`", ""]  # fmt: skip
    if _IMPORT_ERROR is not None:
        print(f"Gluon is missing: {_IMPORT_ERROR}", file=sys.stderr)
        return 2
    rc = 0
    if args.compile_only:
        rc |= 0 if compile_only(lines) else 1
    if args.check or args.bench:
        why = env_problem()
        if why is not None:
            print(f"gluon_varlen_fwd.py: {why}", file=sys.stderr)
            return 2
        from dilated_attention.timing import results_header

        lines[:1] = results_header("Prototype: the Gluon forward over packed documents (issue 22 item 2b)",
                                   torch.device("cuda"), "python3 " + " ".join(sys.argv))[:6]
        lines.append("")
        if args.check:
            rc |= 0 if check(torch.device("cuda"), lines) else 1
        if args.bench:
            bench(torch.device("cuda"), lines)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
