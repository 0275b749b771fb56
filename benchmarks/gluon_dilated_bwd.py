"""Gluon (Triton 3.6) FlashAttention-3-style backward of ONE dilated branch on Hopper (sm_90).

A standalone prototype, not part of the library (the backward counterpart of
benchmarks/gluon_dilated_fwd.py, whose Gluon 3.6 patterns it copies: TMA over 4-D strided
views, a 1-warp loader partition and two consumer warpgroups through ``gl.warp_specialize``,
mbarrier rings, asynchronous ``warpgroup_mma``, setmaxnreg through the worker registers).
Written against Triton 3.6.0's ``triton.experimental.gluon`` exactly.

Math (docs/spec.md): branch (w, r) splits the positions into segments of w rows; query head h
reads the rows ``s*w + c + r*t`` (t = 0..L-1, c = h % r) of segment s; inside such a block it is
plain dense attention (causal inside the block when causal). The exact backward of a branch
uses the FINAL merged out and lse: ``P = exp(S - lse)``, ``delta = rowsum(dO * out)``,
``dS = P * (dP - delta)``, ``dV = P^T dO``, ``dK = scale * dS^T Q``, ``dQ = scale * dS K``.
Restriction of the prototype: ``N % w == 0`` and ``w % r == 0`` (every block has L = w // r
rows). Results: per-branch float32 dq (B, N, H, D), dk, dv (B, N, Hkv, D); ``add=True`` adds
into given float32 buffers instead (the rows of a head's other residues are not touched).

Preprocessing (torch, :func:`prep_rows`): lse (natural log, (B, H, N)) and delta are gathered
into a block-major float32 layout ``[B, H, N/w, Lp]`` (Lp = L rounded up to 128; head h's
residue), lse multiplied by log2(e), -inf (a row without a key) and the padding as +inf (P = 0),
delta padded with 0. The library would fold this into its delta kernel (FA3's preprocess kernel
does the same). Its time is reported separately in --bench.

Kernel 1, dK/dV (:func:`dkdv_kernel`): one program per (key tile of 128 rows of a block,
segment, batch x kv head x residue class); the grid's second axis is B * Hkv * min(rep, r) as
the library's (``h0 = g*rep + i0``, ``c = h0 % r``). It loops over the query heads
``h0, h0 + r, ... < (g+1)*rep`` (GQA: their contributions summed in the same registers, no
atomics: deterministic) and over the query tiles of 64 rows of the block (causal: the tiles
from the key tile's first row on; the first two, which straddle the diagonal, masked).
Partitions: a 1-warp loader (the K and V halves once, then q / dO tiles and their lse / delta
rows, 1-D TMA of the block-major layout, into a ring of STAGES), two consumer warpgroups of 64
key rows each (setmaxnreg 240). Per query tile, transposed form (keys on the wgmma M side, no
transposes of register operands): S^T = K Q^T and dP^T = V dO^T issued back to back (async,
operands in shared memory), P^T = exp2(S^T*scale*log2e - lse2), dV += P^T dO (P^T from
registers), dS^T = P^T (dP^T - delta), dK += dS^T Q (dS^T from registers); then the stage is
released. End: dK *= scale; plain float32 stores (or adds) of the rows t < L.

Kernel 2, dQ (:func:`dq_kernel`): one program per (query tile of 128 rows, segment,
batch x head), the forward's structure: loader (Q and dO halves once, then K / V tiles of BN
rows in a ring), two consumer warpgroups of 64 query rows: S = Q K^T and dP = dO V^T (async),
P = exp2(S*scale*log2e - lse2), dS = P (dP - delta), dQ += dS K (dS from registers);
dQ *= scale; float32 stores. Causal: key tiles up to the program's last row, the tiles from
the first query row on masked.

Masks: rows t >= L of a partial tile are zero-filled by TMA (q, dO, K, V) and padded in the
block-major lse (+inf) and delta (0), so they add exactly zero to every result: only the causal
diagonal needs a mask. Stores are masked to rows t < L.

Usage (GPU machine, Triton 3.6, sm_90)::

    PYTHONPATH=src python3 benchmarks/gluon_dilated_bwd.py --check --bench --out $OUT/gluon_bwd.md

``--compile-only [--sass DIR]`` compiles every variant for sm_90 without a GPU and prints
registers, spills, shared memory and SASS facts; ``--emulate`` runs a float64 torch emulation of
the kernels' index math and tile schedule on the CPU against autograd. Exit 2 when Gluon / its
Hopper module is missing or the GPU is not sm_90.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:  # pragma: no cover
    print("gluon_dilated_bwd: torch is missing")
    sys.exit(2)

try:
    import triton
    from triton.experimental.gluon import language as gl

    _IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001  (any import failure: report and exit 2)
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

LOG2E = 1.4426950408889634

WG_M = 64  # rows of one consumer warpgroup (wgmma M)
BLK = 2 * WG_M  # rows of a program's stationary tile (two consumer warpgroups)
BMQ = 64  # query rows per streamed tile of the dK/dV kernel
LPAD = BLK  # block-major lse / delta rows padded to this multiple (the dQ tile: no mask)

# the kernels live in the library (dilated_attention/kernels/gluon_bwd_kernel.py since the
# twenty-second session); this script launches them per branch
_mod = None
if _IMPORT_ERROR is None:
    try:
        from dilated_attention.kernels import gluon_bwd as _lib
        from dilated_attention.kernels import gluon_fwd as _lib_fwd

        _mod = _lib.kernel_module()
        if _mod is None:
            _IMPORT_ERROR = _lib._import_error
    except Exception as e:  # noqa: BLE001  (PYTHONPATH=src missing, ...)
        _IMPORT_ERROR = f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------ host side

CONSUMER_REGS = 240  # setmaxnreg of each consumer warpgroup (the library's values)
LOADER_REGS = 24
MAXNREG = 168


def _kv_stages(d: int) -> int:
    return _lib.kv_stages(d)


def _dq_bn(d: int) -> int:
    return _lib.dq_bn(d)


def _dq_stages(d: int) -> int:
    return _lib.DQ_STAGES


def env_problem() -> str | None:
    """Why this script cannot run its GPU part here (None: it can)."""
    if _IMPORT_ERROR is not None:
        return f"Gluon or its Hopper module is missing: {_IMPORT_ERROR}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"the GPU is sm_{cap[0]}{cap[1]}, this kernel is for sm_90 (Hopper) only"
    return None


def _block_desc(x: torch.Tensor, w: int, r: int, rows: int):
    """The library's TMA descriptor of the dilated blocks of x (``gluon_fwd.block_desc``)."""
    return _lib_fwd.block_desc(x, w, r, rows)


def _row_desc(x: torch.Tensor, rows: int):
    return _lib._row_desc(x, rows)


def prep_rows(x: torch.Tensor, w: int, r: int, pad_value: float, mult: float = 1.0):
    """The library's block-major lse / delta rows (``gluon_bwd.prep_rows``)."""
    return _lib.prep_rows(x, w, r, pad_value, mult)


def prep_bwd(dout, out, lse, w, r):
    """(lse2, delta) block-major (see the module docstring); delta = rowsum(dO * out)."""
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return (prep_rows(lse, w, r, float("inf"), LOG2E), prep_rows(delta, w, r, 0.0))


def _check_args(q, k, v, w, r):
    bsz, n, nh, d = q.shape
    hkv = k.shape[2]
    if n % w or w % r:
        raise ValueError(f"prototype restriction: N % w == 0 and w % r == 0 (N={n}, w={w}, r={r})")
    if d not in (64, 128) or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"D must be 64 or 128 and the dtype bf16 or fp16 (D={d}, {q.dtype})")
    if nh % hkv or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != d:
        raise ValueError("shapes: q (B, N, H, D), k and v (B, N, Hkv, D), H % Hkv == 0")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        raise ValueError("q, k, v must be contiguous")


def gluon_branch_dkdv(q, k, v, dout, lse2, delta, w, r, causal, scale, dk=None, dv=None,
                      add=False):  # fmt: skip
    """float32 dK, dV (B, N, Hkv, D) of the branch (w, r); lse2 / delta block-major
    (:func:`prep_bwd`). dk / dv: buffers to write (add=True: add) into; None: zeros."""
    bsz, n, nh, d = q.shape
    hkv = k.shape[2]
    rep = nh // hkv
    big_l, nseg = w // r, n // w
    lp = lse2.shape[-1]
    if dk is None:
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    if dv is None:
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    nnb = triton.cdiv(big_l, BLK)
    ni = min(rep, r)
    grid = (nnb * nseg, bsz * hkv * ni)
    _mod.dkdv_kernel[grid](
        _block_desc(q, w, r, BMQ), _block_desc(dout, w, r, BMQ), _block_desc(k, w, r, WG_M),
        _block_desc(v, w, r, WG_M), _row_desc(lse2, BMQ), _row_desc(delta, BMQ), dk, dv,
        scale * LOG2E, scale, big_l, w, nseg, nnb, r, nh, hkv, rep, ni, lp,
        BMQ=BMQ, D=d, STAGES=_kv_stages(d), CAUSAL=causal, ADD=add,
        CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return dk, dv


def gluon_branch_dq(q, k, v, dout, lse2, delta, w, r, causal, scale, dq=None, add=False):
    """float32 dQ (B, N, H, D) of the branch (w, r) (see :func:`gluon_branch_dkdv`)."""
    bsz, n, nh, d = q.shape
    hkv = k.shape[2]
    big_l, nseg = w // r, n // w
    lp = lse2.shape[-1]
    if dq is None:
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    nmb = triton.cdiv(big_l, BLK)
    bn = _dq_bn(d)
    grid = (nmb * nseg, bsz * nh)
    _mod.dq_kernel[grid](
        _block_desc(q, w, r, WG_M), _block_desc(dout, w, r, WG_M), _block_desc(k, w, r, bn),
        _block_desc(v, w, r, bn), dq, lse2, delta, scale * LOG2E, scale, big_l, w, nseg, nmb,
        r, nh, hkv, lp, BN=bn, D=d, STAGES=_dq_stages(d), CAUSAL=causal, ADD=add,
        CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return dq


def gluon_branch_bwd(q, k, v, dout, out, lse, w, r, causal, softmax_scale=None):
    """(dq, dk, dv) float32 of the ONE branch (w, r), given the final out and lse."""
    _check_args(q, k, v, w, r)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    lse2, delta = prep_bwd(dout, out, lse, w, r)
    dk, dv = gluon_branch_dkdv(q, k, v, dout, lse2, delta, w, r, causal, scale)
    dq = gluon_branch_dq(q, k, v, dout, lse2, delta, w, r, causal, scale)
    return dq, dk, dv


# ------------------------------------------------------------------------------ CPU compile


def _desc_sig(dtype_name, rows, d):
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype_name]
    lay = gl.NVMMASharedLayout.get_default_for([1, rows, 1, d], gdt)
    return f"tensordesc<{dtype_name}[1, {rows}, 1, {d}],{lay!r}>"


def _row_sig():
    lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    return f"tensordesc<fp32[{BMQ}],{lay!r}>"


def _signature(kernel: str, d: int, causal: bool, dtype_name: str, add: bool, classes: bool = False):
    """(kernel, signature, constexprs, attrs) of one variant for triton.compile (``classes``: a
    length class of a branch with w % r != 0, gluon_fwd.UNEVEN_BLOCKS)."""
    cst = {"D": d, "CAUSAL": causal, "ADD": add, "CLASSES": classes, "CONSUMER_REGS": CONSUMER_REGS,
           "LOADER_REGS": LOADER_REGS}  # fmt: skip
    if kernel == "dkdv":
        sig = {"q_desc": _desc_sig(dtype_name, BMQ, d), "do_desc": _desc_sig(dtype_name, BMQ, d),
               "k_desc": _desc_sig(dtype_name, WG_M, d), "v_desc": _desc_sig(dtype_name, WG_M, d),
               "l_desc": _row_sig(), "dl_desc": _row_sig(), "DK": "*fp32", "DV": "*fp32",
               "qk_scale": "fp32", "sm_scale": "fp32", "L": "i32", "W": "i32", "NSEG": "i32",
               "NNB": "i32", "R": "i32", "H": "i32", "HKV": "i32", "REP": "i32", "NI": "i32",
               "LP": "i32", "C0": "i32", "CW": "i32"}  # fmt: skip
        cst.update({"BMQ": BMQ, "STAGES": _kv_stages(d)})
        attrs = {(6,): [["tt.divisibility", 16]], (7,): [["tt.divisibility", 16]]}
        fn = _mod.dkdv_kernel
    else:
        bn = _dq_bn(d)
        sig = {"q_desc": _desc_sig(dtype_name, WG_M, d), "do_desc": _desc_sig(dtype_name, WG_M, d),
               "k_desc": _desc_sig(dtype_name, bn, d), "v_desc": _desc_sig(dtype_name, bn, d),
               "DQ": "*fp32", "LSE2": "*fp32", "DELTA": "*fp32", "qk_scale": "fp32",
               "sm_scale": "fp32", "L": "i32", "W": "i32", "NSEG": "i32", "NMB": "i32",
               "R": "i32", "H": "i32", "HKV": "i32", "LP": "i32", "NHB": "i32", "C0": "i32",
               "CW": "i32"}  # fmt: skip
        cst.update({"BN": bn, "STAGES": _dq_stages(d)})
        attrs = {(4,): [["tt.divisibility", 16]], (5,): [["tt.divisibility", 16]],
                 (6,): [["tt.divisibility", 16]]}  # fmt: skip
        fn = _mod.dq_kernel
    for key in cst:
        sig[key] = "constexpr"
    return fn, sig, cst, attrs


SASS_FACTS = ("UTMALDG", "HGMMA", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "SYNCS", "USETMAXREG",
              "BAR.SYNC", "LDL", "STL", "LDS", "STS", "STG", "MUFU.EX2")  # fmt: skip


def variants():
    """(kernel, dtype, D, causal, add, classes) of every compiled variant: all with one block
    length, and a length class (w % r != 0: add only) of each kernel, D and causality in bf16."""
    return ([(kern, dt, d, causal, add, False) for kern in ("dkdv", "dq") for dt in ("bf16", "fp16")
             for d in (128, 64) for causal in (False, True) for add in (False, True)]
            + [(kern, "bf16", d, causal, True, True) for kern in ("dkdv", "dq") for d in (128, 64)
               for causal in (False, True)])  # fmt: skip


def compile_only(lines: list[str], sass_dir: str | None, only: str | None = None) -> bool:
    """Compile the variants for sm_90 without a GPU; registers, spills, smem, SASS facts."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    lines += [f"## sm_90 compile (CPU, triton {triton.__version__})", "",
              "| variant | regs (cap) | stack / local | smem bytes | setmaxnreg values | "
              + " | ".join(SASS_FACTS) + " |", "|---" * (5 + len(SASS_FACTS)) + "|"]  # fmt: skip
    ok = True
    for kern, dtype_name, d, causal, add, classes in variants():
        name = f"{kern} {dtype_name} D={d} causal={causal} add={add}" + (" classes" if classes else "")
        if only and only not in name:
            continue
        fn, sig, consts, attrs = _signature(kern, d, causal, dtype_name, add, classes)
        try:
            ck = triton.compile(GluonASTSource(fn, sig, consts, attrs),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "maxnreg": MAXNREG})  # fmt: skip
        except Exception as e:  # noqa: BLE001
            ok = False
            msg = f"| {name} | compile FAILED: {type(e).__name__}: {str(e)[:2000]} |"
            print(msg)
            lines.append(msg)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(tmp, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(ck.asm["cubin"])
            res = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage",
                                  cubin], capture_output=True, text=True).stdout  # fmt: skip
            sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                                  capture_output=True, text=True).stdout  # fmt: skip
        reg = re.search(r"REG:(\d+)", res)
        stack = re.search(r"STACK:(\d+)", res)
        local = re.search(r"LOCAL:(\d+)", res)
        maxnreg = sorted({int(x, 16) for x in re.findall(r"USETMAXREG\.\S+ (?:UP\d, )?"
                                                         r"0x([0-9a-f]+)", sass)})  # fmt: skip
        counts = [str(len(re.findall(re.escape(p), sass))) for p in SASS_FACTS]
        row = (f"| {name} | {reg.group(1) if reg else '?'} ({MAXNREG}) | "
               f"{stack.group(1) if stack else '?'} / {local.group(1) if local else '?'} | "
               f"{ck.metadata.shared} | {maxnreg} | " + " | ".join(counts) + " |")  # fmt: skip
        print(row, flush=True)
        lines.append(row)
        if sass_dir:
            os.makedirs(sass_dir, exist_ok=True)
            stem = os.path.join(sass_dir, f"gluon_bwd_{kern}_{dtype_name}_d{d}_c{int(causal)}"
                                          f"_a{int(add)}" + ("_classes" if classes else ""))  # fmt: skip
            for ext, text in (("sass", sass), ("ptx", ck.asm["ptx"]), ("ttgir", ck.asm["ttgir"])):
                with open(f"{stem}.{ext}", "w") as f:
                    f.write(text)
    lines.append("")
    return ok


# ------------------------------------------------------------------------------ reference


def _head_blocks(x: torch.Tensor, h: int, c: int, w: int, r: int) -> torch.Tensor:
    """(B, nseg, L, D) view: head h's rows s*w + c + r*t of x (B, N, heads, D), per segment s."""
    bsz, n, _, d = x.shape
    return x[:, :, h, :].reshape(bsz, n // w, w // r, r, d)[:, :, :, c]


def _attn(qh, kh, vh, causal, scale):
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        big_l = s.shape[-1]
        s = s.masked_fill(torch.ones(big_l, big_l, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))  # fmt: skip
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), vh), lse


def reference_bwd(q, k, v, dout, w, r, causal, scale):
    """float64 single-branch attention on the gathered blocks with autograd: out (B, N, H, D)
    float64 (zero at the rows a head does not read), lse (B, H, N) float64 (-inf there), and
    dq, dk, dv float64 (dk, dv summed over the query heads of a kv head)."""
    bsz, n, nh, d = q.shape
    hkv = k.shape[2]
    rep = nh // hkv
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((bsz, nh, n), float("-inf"), dtype=torch.float64, device=q.device)
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float64, device=q.device)
    for h in range(nh):
        c, g = h % r, h // rep
        qh = _head_blocks(q, h, c, w, r).double().requires_grad_()
        kh = _head_blocks(k, g, c, w, r).double().requires_grad_()
        vh = _head_blocks(v, g, c, w, r).double().requires_grad_()
        o, lh = _attn(qh, kh, vh, causal, scale)
        gq, gk, gv = torch.autograd.grad(o, (qh, kh, vh), _head_blocks(dout, h, c, w, r).double())
        _head_blocks(out, h, c, w, r).copy_(o.detach())
        lse[:, h].view(bsz, n // w, w // r, r)[:, :, :, c] = lh.detach()
        _head_blocks(dq, h, c, w, r).copy_(gq)
        _head_blocks(dk, g, c, w, r).add_(gk)
        _head_blocks(dv, g, c, w, r).add_(gv)
    return out, lse, dq, dk, dv


# ------------------------------------------------------------------------------ CPU emulation


def _tma_box(x4: torch.Tensor, blk: int, t0: int, col: int, rows: int) -> torch.Tensor:
    """A [1, rows, 1, D] TMA box of the 4-D view x4 [B*N/w, L, r*heads, D] at (blk, t0, col),
    rows past L zero-filled (as the hardware). The coordinates of the dimensions the box does
    not span (blk, col) must be inside the view: the emulation's out-of-bounds check."""
    big_l, d = x4.shape[1], x4.shape[3]
    assert 0 <= blk < x4.shape[0] and 0 <= col < x4.shape[2] and t0 >= 0, (blk, t0, col)
    box = torch.zeros(rows, d, dtype=x4.dtype)
    hi = min(t0 + rows, big_l)
    if hi > t0:
        box[: hi - t0] = x4[blk, t0:hi, col]
    return box


def _row_box(flat: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    assert 0 <= start and start + rows <= flat.numel(), (start, rows, flat.numel())
    box = torch.zeros(rows, dtype=flat.dtype)
    hi = min(start + rows, flat.numel())
    if hi > start:
        box[: hi - start] = flat[start:hi]
    return box


def _view4(x: torch.Tensor, w: int, r: int) -> torch.Tensor:
    b, n, heads, d = x.shape
    return x.as_strided((b * (n // w), w // r, r * heads, d), (w * heads * d, r * heads * d, d, 1))


def emulate_dkdv(q, k, v, dout, lse2, delta, w, r, causal, scale):
    """float64 emulation of :func:`dkdv_kernel`: its grid, the loader's TMA coordinates (with
    zero fill), the consumers' loops, masks and stores. Also asserts that loader and consumers
    walk the same tiles and that no result element is stored twice."""
    bsz, n, nh, d = q.shape
    hkv = k.shape[2]
    rep = nh // hkv
    big_l, nseg = w // r, n // w
    lp = lse2.shape[-1]
    q4, do4, k4, v4 = (_view4(x, w, r) for x in (q, dout, k, v))
    l_flat, d_flat = lse2.reshape(-1), delta.reshape(-1)
    dk = torch.zeros(k.shape, dtype=torch.float64)
    dv = torch.zeros(v.shape, dtype=torch.float64)
    hits = torch.zeros(bsz, n, hkv, dtype=torch.int64)
    nnb = -(-big_l // BLK)
    ni = min(rep, r)
    for pid0 in range(nnb * nseg):
        for pid_x in range(bsz * hkv * ni):
            pid_n, s = pid0 % nnb, pid0 // nnb
            b, g, i0 = pid_x // (hkv * ni), (pid_x // ni) % hkv, pid_x % ni
            h_start = g * rep + i0
            c = h_start % r
            nhl = ((g + 1) * rep - h_start + r - 1) // r
            # the grid has min(rep, r) programs per kv head, from its first min(rep, r) heads:
            # none is empty, even with r > H (residues without a query head get no program;
            # their dK / dV rows stay as the wrapper allocated them: zeros, or untouched with
            # add). An empty program (nhl = 0) would still be safe: no q tile loaded, the K / V
            # halves loaded and zeros stored (added), which this emulation does alike.
            assert nhl >= 1 and h_start + (nhl - 1) * r < (g + 1) * rep <= nh
            n_lo = pid_n * BLK
            blk = b * nseg + s
            kv_col = c * hkv + g
            n_qt_all = -(-big_l // BMQ)
            if causal:
                m_first, n_qt = n_lo, n_qt_all - n_lo // BMQ
                n_diag = min(n_qt, BLK // BMQ)
            else:
                m_first, n_qt, n_diag = 0, n_qt_all, 0
            # loader: the (head, tile) stream
            loads = []
            for hi in range(nhl):
                h = h_start + hi * r
                assert h % r == c and h // rep == g
                lrow = ((b * nh + h) * nseg + s) * lp
                for j in range(n_qt):
                    m = m_first + j * BMQ
                    assert 0 <= m < big_l and m + BMQ <= lp  # inside this head's padded rows
                    loads.append((_tma_box(q4, blk, m, c * nh + h, BMQ),
                                  _tma_box(do4, blk, m, c * nh + h, BMQ),
                                  _row_box(l_flat, lrow + m, BMQ),
                                  _row_box(d_flat, lrow + m, BMQ), m))  # fmt: skip
            for wg in range(2):
                key0 = n_lo + wg * WG_M
                kt = _tma_box(k4, blk, key0, kv_col, WG_M).double()
                vt = _tma_box(v4, blk, key0, kv_col, WG_M).double()
                dkw = torch.zeros(WG_M, d, dtype=torch.float64)
                dvw = torch.zeros(WG_M, d, dtype=torch.float64)
                cnt = 0
                for _hi in range(nhl):
                    for masked, js in ((True, range(n_diag)), (False, range(n_diag, n_qt))):
                        for j in js:
                            qt, dot, l2, dl, m_ld = loads[cnt]
                            m = m_first + j * BMQ
                            assert m == m_ld
                            qt, dot = qt.double(), dot.double()
                            pt = torch.exp2(kt @ qt.T * (scale * LOG2E) - l2.double()[None, :])
                            keys = key0 + torch.arange(WG_M)
                            qrows = m + torch.arange(BMQ)
                            if masked:
                                pt = torch.where(keys[:, None] <= qrows[None, :], pt, 0.0)
                            elif causal:  # an unmasked tile must need no mask
                                assert bool((keys[:, None] <= qrows[None, :]).all())
                            dvw += pt @ dot
                            dpt = vt @ dot.T
                            dkw += (pt * (dpt - dl.double()[None, :])) @ qt
                            cnt += 1
                assert cnt == len(loads)
                dkw *= scale
                for i in range(WG_M):
                    t = key0 + i
                    if t < big_l:
                        pos = blk * w + c + r * t
                        bb, p = divmod(pos, n)
                        dk[bb, p, g] += dkw[i]
                        dv[bb, p, g] += dvw[i]
                        hits[bb, p, g] += 1
    assert int(hits.max()) <= 1, "a dK/dV row stored twice"
    return dk, dv


def emulate_dq(q, k, v, dout, lse2, delta, w, r, causal, scale):
    """float64 emulation of :func:`dq_kernel` (grid, TMA coordinates, loops, masks, stores)."""
    bsz, n, nh, d = q.shape
    hkv = k.shape[2]
    big_l, nseg = w // r, n // w
    lp = lse2.shape[-1]
    bn = _dq_bn(d)
    q4, do4, k4, v4 = (_view4(x, w, r) for x in (q, dout, k, v))
    l_flat, d_flat = lse2.reshape(-1), delta.reshape(-1)
    dq = torch.zeros(q.shape, dtype=torch.float64)
    hits = torch.zeros(bsz, n, nh, dtype=torch.int64)
    nmb = -(-big_l // BLK)
    for pid0 in range(nmb * nseg):
        for bh in range(bsz * nh):
            pid_m, s = pid0 % nmb, pid0 // nmb
            b, h = bh // nh, bh % nh
            c, hk = h % r, h // (nh // hkv)
            assert hk < hkv
            q_row0 = pid_m * BLK
            blk = b * nseg + s
            lrow = ((b * nh + h) * nseg + s) * lp
            n_kv = -(-big_l // bn)
            if causal:
                n_tiles = min(n_kv, -(-(q_row0 + BLK) // bn))
                n_full = min(q_row0 // bn, n_tiles)
            else:
                n_tiles = n_full = n_kv
            kts = [(_tma_box(k4, blk, j * bn, c * hkv + hk, bn).double(),
                    _tma_box(v4, blk, j * bn, c * hkv + hk, bn).double()) for j in range(n_tiles)]  # fmt: skip
            for wg in range(2):
                row0 = q_row0 + wg * WG_M
                qt = _tma_box(q4, blk, row0, c * nh + h, WG_M).double()
                dot = _tma_box(do4, blk, row0, c * nh + h, WG_M).double()
                assert lrow + row0 + WG_M <= lrow + lp
                l2 = l_flat[lrow + row0 : lrow + row0 + WG_M].double()
                dl = d_flat[lrow + row0 : lrow + row0 + WG_M].double()
                dqw = torch.zeros(WG_M, d, dtype=torch.float64)
                rows = row0 + torch.arange(WG_M)
                for j in range(n_tiles):
                    kt, vt = kts[j]
                    p = torch.exp2(qt @ kt.T * (scale * LOG2E) - l2[:, None])
                    cols = j * bn + torch.arange(bn)
                    if j >= n_full:
                        p = torch.where(cols[None, :] <= rows[:, None], p, 0.0)
                    elif causal:
                        assert bool((cols[None, :] <= rows[:, None]).all())
                    dp = dot @ vt.T
                    dqw += (p * (dp - dl[:, None])) @ kt
                if causal:  # no key past the last tile is visible to these rows
                    assert n_tiles == n_kv or n_tiles * bn > int(rows.max())
                dqw *= scale
                for i in range(WG_M):
                    t = row0 + i
                    if t < big_l:
                        pos = blk * w + c + r * t
                        bb, p_ = divmod(pos, n)
                        dq[bb, p_, h] += dqw[i]
                        hits[bb, p_, h] += 1
    assert int(hits.max()) <= 1, "a dQ row stored twice"
    return dq


def emulate_cases(full: bool = False):
    """(B, N, H, Hkv, D, w, r, causal) of --emulate: multi-tile, partial tiles (L = 192, 64,
    L < 64), GQA with several heads per residue, MQA with r > rep, B = 2, both dQ tile widths;
    MHA and MQA with r > H (residues without any query head; the --check cases that met the
    illegal address on the H200, 2026-11-28, scaled down; full (--emulate-big): also that case
    itself, ~6 min of CPU)."""
    cases = []
    for causal in (False, True):
        cases += [(1, 512, 4, 2, 16, 512, 1, causal), (1, 960, 4, 2, 16, 960, 5, causal),
                  (2, 512, 4, 4, 16, 256, 4, causal), (1, 1024, 8, 1, 16, 1024, 16, causal),
                  (1, 640, 8, 2, 16, 320, 2, causal), (1, 256, 2, 1, 16, 256, 8, causal),
                  (1, 960, 2, 1, 128, 960, 5, causal),  # D=128: the dQ kernel's BN = 64
                  (1, 1024, 4, 4, 16, 1024, 8, causal),  # MHA, r = 8 > H = 4
                  (1, 4096, 8, 8, 64, 4096, 16, causal),  # MHA, r = 16 > H = 8, D = 64, L = 256
                  (1, 4096, 8, 1, 64, 4096, 16, causal),  # MQA, r = 16 > H = 8, D = 64
                  (1, 2048, 8, 8, 64, 256, 4, causal),  # MHA, (256, 4): L = 64
                  (1, 1920, 8, 8, 64, 960, 5, causal)]  # MHA, (960, 5): L = 192  # fmt: skip
    if full:  # the first failing --check case itself: L = 2048, 16 x 16 tiles per program
        cases.append((1, 32768, 8, 8, 64, 32768, 16, False))
    return cases


def run_emulate(lines: list[str], full: bool = False) -> bool:
    lines += ["## --emulate (CPU, float64 emulation of the kernels' index math and schedule)", "",
              "| result | case | dq | dk | dv | (max abs error vs float64 autograd) |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    ok_all = True
    for bsz, n, nh, hkv, d, w, r, causal in emulate_cases(full):
        torch.manual_seed(1)
        q, dout = (torch.randn(bsz, n, nh, d).bfloat16().double() for _ in range(2))
        k, v = (torch.randn(bsz, n, hkv, d).bfloat16().double() for _ in range(2))
        scale = d**-0.5
        out, lse, rq, rk, rv = reference_bwd(q, k, v, dout, w, r, causal, scale)
        # the block-major rows in float64 (prep_rows' math; float64 isolates index errors)
        lse2 = _prep_rows64(lse, w, r, float("inf"), LOG2E)
        delta = _prep_rows64((dout * out).sum(-1).transpose(1, 2), w, r, 0.0, 1.0)
        ek, ev = emulate_dkdv(q, k, v, dout, lse2, delta, w, r, causal, scale)
        eq = emulate_dq(q, k, v, dout, lse2, delta, w, r, causal, scale)
        errs = [(a - b).abs().max().item() for a, b in ((eq, rq), (ek, rk), (ev, rv))]
        ok = max(errs) < 1e-9
        ok_all &= ok
        line = (f"| {'PASS' if ok else 'FAIL'} | B={bsz} N={n} H={nh} Hkv={hkv} D={d} (w,r)=({w},{r}) "
                f"causal={causal} | {errs[0]:.1e} | {errs[1]:.1e} | {errs[2]:.1e} | |")  # fmt: skip
        print(line, flush=True)
        lines.append(line)
    lines += ["", f"**emulate: {'all PASS' if ok_all else 'FAIL'}**", ""]
    return ok_all


def _prep_rows64(x, w, r, pad_value, mult):
    """:func:`prep_rows` in float64 (for the emulation)."""
    bsz, nh, n = x.shape
    big_l, nseg = w // r, n // w
    lp = -(-big_l // LPAD) * LPAD
    x5 = x.double().reshape(bsz, nh, nseg, big_l, r)
    cidx = (torch.arange(nh) % r).view(1, nh, 1, 1, 1)
    y = x5.gather(-1, cidx.expand(bsz, nh, nseg, big_l, 1)).squeeze(-1) * mult
    y = torch.where(y == float("-inf"), torch.full_like(y, float("inf")), y)
    out = torch.full((bsz, nh, nseg, lp), pad_value, dtype=torch.float64)
    out[..., :big_l] = y
    return out


# ------------------------------------------------------------------------------ checking (GPU)

ABS_FLOOR = 2e-3  # absolute slack added to 2x SDPA's error (gradients of randn inputs are O(1))


def _sdpa_grads(q, k, v, dout, w, r, causal, scale):
    """dq, dk, dv (float64, dk / dv summed over heads in float64) of torch SDPA's backward
    (flash backend, efficient as the fallback; the input dtype) on the same blocks, head by
    head. Every tensor handed to SDPA, the upstream gradient included, is contiguous.

    Not cuDNN: its backward graph cache is keyed on the shapes and the q / k / v strides only,
    and cuDNN >= 9.5.1 takes dO with its own strides, so a graph built for one dO layout is
    replayed on another of the same shape. The strided per-head dO view (row stride r*H*D)
    made the MHA cases (H = 8) replay the graphs of the GQA cases (H = 16) before them: dO
    read at twice its row stride (errors 0.4-0.8), and at (32768, 16) past the end of the
    tensor (the illegal memory access of the 2026-11-28 H200 run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bsz, n, nh, d = q.shape
    hkv = k.shape[2]
    rep = nh // hkv
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float64, device=q.device)
    big_l, nseg = w // r, n // w
    for h in range(nh):
        c, g = h % r, h // rep
        args = [_head_blocks(x, i, c, w, r).reshape(bsz * nseg, 1, big_l, d).contiguous()
                .requires_grad_() for x, i in ((q, h), (k, g), (v, g))]  # fmt: skip
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(*args, is_causal=causal,
                                                                 scale=scale)  # fmt: skip
        go = _head_blocks(dout, h, c, w, r).reshape(bsz * nseg, 1, big_l, d).contiguous()
        gq, gk, gv = torch.autograd.grad(o, args, go)
        shp = (bsz, nseg, big_l, d)
        _head_blocks(dq, h, c, w, r).copy_(gq.reshape(shp))
        _head_blocks(dk, g, c, w, r).add_(gk.reshape(shp).double())
        _head_blocks(dv, g, c, w, r).add_(gv.reshape(shp).double())
    return dq, dk, dv


class CaseError(RuntimeError):
    """A check case raised: ``phase`` says in which step (each step ends in a synchronize)."""

    def __init__(self, phase: str, err: BaseException):
        super().__init__(f"{phase}: {type(err).__name__}: {err}")
        self.phase, self.err = phase, err


def _phase(name: str, fn):
    """fn() then a device synchronize: an asynchronous CUDA error is charged to this step."""
    try:
        res = fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        raise CaseError(name, e) from e
    return res


def check_case(bsz, n, nh, hkv, d, w, r, causal, dtype, seed=0):
    """One exactness case: returns (ok, line); raises :class:`CaseError` naming the step."""
    torch.manual_seed(seed)
    dev = "cuda"
    q, dout = (torch.randn(bsz, n, nh, d, device=dev, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(bsz, n, hkv, d, device=dev, dtype=dtype) for _ in range(2))
    scale = d**-0.5
    out, lse, rq, rk, rv = _phase("float64 reference",
                                  lambda: reference_bwd(q, k, v, dout, w, r, causal, scale))  # fmt: skip
    out_d, lse_f = out.to(dtype), lse.float()  # the final out / lse, as the library holds them

    def gluon():
        return gluon_branch_bwd(q, k, v, dout, out_d, lse_f, w, r, causal, scale)

    got = _phase("gluon kernels (1st run)", gluon)
    again = _phase("gluon kernels (2nd run)", gluon)
    det = all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    sd = _phase("SDPA comparator", lambda: _sdpa_grads(q, k, v, dout, w, r, causal, scale))
    ok, parts = det, []
    for name, g_, s_, ref in zip(("dq", "dk", "dv"), got, sd, (rq, rk, rv), strict=True):
        e_g = (g_.double() - ref).abs().max().item()
        e_s = (s_ - ref).abs().max().item()
        lim = 2 * e_s + ABS_FLOOR
        finite = bool(torch.isfinite(g_).all())
        ok &= finite and e_g <= lim
        parts.append(f"{name} {e_g:.2e} (SDPA {e_s:.2e}, lim {lim:.2e}){'' if finite else ' NaN'}")
    line = (f"| {'PASS' if ok else 'FAIL'} | "
            + case_name((bsz, n, nh, hkv, d, w, r, causal, dtype)) + " | " + " | ".join(parts)
            + f" | {'bitwise' if det else 'DIFFERS'} |")  # fmt: skip
    return ok, line


def case_name(case) -> str:
    """The label of a check case (what --cases matches against), e.g.
    ``B=1 N=32768 H=8 Hkv=8 D=64 bf16 (w,r)=(32768,16) causal=False``."""
    bsz, n, nh, hkv, d, w, r, causal, dtype = case
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return (f"B={bsz} N={n} H={nh} Hkv={hkv} D={d} {dname} (w,r)=({w},{r}) "
            f"causal={causal}")  # fmt: skip


def _is_cuda_error(e: BaseException) -> bool:
    """A device-side error (illegal address, launch failure...): the CUDA context is lost."""
    acc = getattr(torch, "AcceleratorError", None)
    if acc is not None and isinstance(e, acc):
        return True
    msg = str(e)
    return "CUDA error" in msg or "illegal memory access" in msg or "unspecified launch" in msg


def check_cases():
    """(B, N, H, Hkv, D, w, r, causal, dtype) of --check."""
    branches = [(2048, 1, 8192), (4096, 2, 8192), (32768, 16, 32768), (256, 4, 4096),
                (960, 5, 3840)]  # (w, r, N); (960, 5): L = 192, a partial tile  # fmt: skip
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            for d in (64, 128):
                for nh, hkv in ((16, 4), (8, 8), (8, 1)):
                    for w, r, n in branches:
                        cases.append((1, n, nh, hkv, d, w, r, causal, dtype))
            cases.append((2, 8192, 16, 4, 128, 4096, 2, causal, dtype))
            cases.append((2, 3840, 8, 1, 64, 960, 5, causal, dtype))
    return cases


def select_cases(quick: bool = False, patterns: list[str] | None = None) -> list:
    """The check cases to run, in :func:`check_cases` order: --quick's subset and / or those
    whose :func:`case_name` contains one of patterns (any)."""
    cases = check_cases()
    if quick:  # a smoke subset: GQA 16/4, D=128, a partial tile and r=2, both dtypes / causal
        cases = [c for c in cases if (c[2], c[3], c[4]) == (16, 4, 128) and c[5] in (960, 4096)]
    if patterns:
        cases = [c for c in cases if any(p in case_name(c) for p in patterns)]
    return cases


def run_check(lines: list[str], quick: bool = False,
              patterns: list[str] | None = None) -> tuple[bool, bool]:  # fmt: skip
    """(all passed, the CUDA context was lost): stops at the first CUDA error."""
    cases = select_cases(quick, patterns)
    print(f"check: {len(cases)} case(s)", flush=True)
    lines += ["## --check (float64 autograd reference on the gathered blocks)", "",
              f"Limit per gradient: 2 x the max abs error of torch SDPA's backward (flash / "
              f"efficient backend, same dtype) + {ABS_FLOOR}; determinism: two runs bitwise "
              f"equal.", "", f"{len(cases)} case(s)"
              + (f" (--cases {' / '.join(repr(p) for p in patterns)})" if patterns else ""), "",
              "| result | case | dq | dk | dv | determinism |", "|---|---|---|---|---|---|"]  # fmt: skip
    all_ok = bool(cases)
    if not cases:
        lines.append("| FAIL | no case selected | | | | |")
    for i, case in enumerate(cases):
        try:
            ok, line = check_case(*case)
        except Exception as e:  # noqa: BLE001  (a failing case is reported, the rest still run)
            err = e.err if isinstance(e, CaseError) else e
            ok, line = False, f"| FAIL | {case_name(case)} | {str(e)[:300]} | | | |"
            if _is_cuda_error(err):  # the context is poisoned: every later case would fail too
                print(line, flush=True)
                lines.append(line)
                msg = (f"STOPPED at the first CUDA error: case {case_name(case)} "
                       f"(tuple {case}), in {getattr(e, 'phase', 'an unknown step')}; "
                       f"{len(cases) - i - 1} later case(s) not run (the CUDA context is lost: "
                       f"rerun them in a fresh process, e.g. with --cases)")  # fmt: skip
                print(msg, flush=True)
                lines += ["", f"**{msg}**", "", "**check: FAIL**", ""]
                return False, True
        all_ok &= ok
        print(line, flush=True)
        lines.append(line)
    lines += ["", f"**check: {'all PASS' if all_ok else 'FAIL'}**", ""]
    return all_ok, False


# ------------------------------------------------------------------------------ benchmark


def median_ms(fn, warmup: int = 3, iters: int = 15) -> float:
    """Median CUDA-event milliseconds of fn() (the library's timer, ``timing.median_ms``)."""
    from dilated_attention import timing

    return timing.median_ms(fn, "cuda", warmup, iters)


def _library():
    """The library's triton_launch module, or None when src is not importable."""
    try:
        from dilated_attention.kernels import triton_launch
    except Exception as e:  # noqa: BLE001
        print(f"library Triton backward unavailable ({type(e).__name__}: {e}); PYTHONPATH=src?")
        return None
    return triton_launch


def _kernel_ms(fn, names, iters: int = 5) -> dict:
    """Mean CUDA time (ms) per call of the kernels whose name contains each of names."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    tot = dict.fromkeys(names, 0.0)
    for ev in prof.key_averages():
        for nm in names:
            if nm in ev.key:
                tot[nm] += ev.device_time_total / 1e3 / iters  # us -> ms
    return tot


def run_bench(lines: list[str], n: int = 131072, nh: int = 16, d: int = 128) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bsz, dtype = 1, torch.bfloat16
    branches = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(bsz, n, nh, d, device="cuda", dtype=dtype) for _ in range(4))
    scale = d**-0.5
    lib = _library()
    rows = []
    print(f"bench: B={bsz} N={n} H={nh} D={d} bf16; TF/s = 2.5 x forward FLOPs / time")
    for causal in (False, True):
        for w, r in branches:
            big_l, nseg = w // r, n // w
            flops = 2.5 * 4.0 * big_l * big_l * d * bsz * nseg * nh * (0.5 if causal else 1.0)
            if lib is not None:
                out, lse = lib.forward(q, k, v, None, [w], [r], causal, scale, [(0, nh)],
                                       fold=False)  # fmt: skip
            else:  # plausible values: timing only
                out = torch.randn_like(q)
                lse = torch.full((bsz, nh, n), 8.0, device="cuda")
            lse2, delta = prep_bwd(dout, out, lse, w, r)
            t_p = median_ms(lambda: prep_bwd(dout, out, lse, w, r))  # noqa: B023
            t_kv = median_ms(lambda: gluon_branch_dkdv(q, k, v, dout, lse2, delta, w, r, causal,  # noqa: B023
                                                       scale))  # fmt: skip
            t_q = median_ms(lambda: gluon_branch_dq(q, k, v, dout, lse2, delta, w, r, causal,  # noqa: B023
                                                    scale))  # fmt: skip
            t_l = t_lkv = t_lq = float("nan")
            if lib is not None:
                try:

                    def call(out=out, lse=lse, w=w, r=r, causal=causal):
                        return lib.backward_per_call(dout, q, k, v, None, out, lse, [w], [r],
                                                     causal, scale, [(0, nh)])  # fmt: skip

                    t_l = median_ms(call)
                    km = _kernel_ms(call, ["dkdv", "bwd_dq"])
                    t_lkv, t_lq = km["dkdv"] or float("nan"), km["bwd_dq"] or float("nan")
                except Exception as e:  # noqa: BLE001
                    print(f"library backward failed: {type(e).__name__}: {e}")
            # dense ceiling: cuDNN SDPA backward on contiguous blocks of the same FLOPs
            qd, kd, vd = (torch.randn(bsz * nseg, nh, big_l, d, device="cuda", dtype=dtype)
                          .requires_grad_() for _ in range(3))  # fmt: skip
            t_c = float("nan")
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    od = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd,
                                                                          is_causal=causal,
                                                                          scale=scale)  # fmt: skip
                god = torch.randn_like(od)

                def dense_bwd(od=od, ins=(qd, kd, vd), god=god):
                    return torch.autograd.grad(od, ins, god, retain_graph=True)

                t_c = median_ms(dense_bwd)
            except Exception as e:  # noqa: BLE001
                print(f"cuDNN SDPA backward failed: {type(e).__name__}: {e}")
            qd = kd = vd = od = god = dense_bwd = None  # free before the next branch
            # per-kernel TF/s: dK/dV does 4 of the 5 backward GEMMs (S, dP, dV, dK), dQ 4 of 5
            # too (S, dP, dQ + its own recompute): each reported against the useful 2.5x
            t_g = t_kv + t_q
            row = (f"| {w} | {r} | {big_l} | {causal} | {t_kv:.3f} | {t_q:.3f} | {t_g:.3f} | "
                   f"{flops / t_g / 1e9:.0f} | {t_p:.3f} | {t_l:.3f} | {flops / t_l / 1e9:.0f} | "
                   f"{t_lkv:.3f} | {t_lq:.3f} | {t_c:.3f} | {flops / t_c / 1e9:.0f} | "
                   f"{t_l / t_g:.2f} |")  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    lines += [f"## --bench: B={bsz} N={n} H={nh} D={d} bf16, one branch per row", "",
              "Times: median of 15 CUDA-event timed calls after 3 warm-up calls (ms). TF/s = "
              "useful backward FLOPs (2.5 x the forward's 4 L^2 D per block and head, halved "
              "when causal) / time. Gluon = dK/dV kernel + dQ kernel (prep = torch gather of "
              "the block-major lse / delta, not included: the library's delta kernel would "
              "write it); library = `triton_launch.backward_per_call` on the single branch "
              "(whole call: delta kernel, dK/dV, dQ, buffers), its dK/dV and dQ kernels from "
              "torch.profiler; cuDNN = SDPA backward (CUDNN_ATTENTION) on contiguous "
              "(B*N/w, H, L, D) tensors.", "",
              "| w | r | L | causal | Gluon dK/dV ms | Gluon dQ ms | Gluon ms | Gluon TF/s | "
              "prep ms | library ms | library TF/s | lib dK/dV ms | lib dQ ms | cuDNN ms | "
              "cuDNN TF/s | library / Gluon |", "|---" * 16 + "|", *rows, ""]  # fmt: skip


# ------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exactness vs float64 (GPU)")
    ap.add_argument("--bench", action="store_true", help="headline-shape timing (GPU)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 on the CPU")
    ap.add_argument("--quick", action="store_true", help="with --check: a 12-case smoke subset")
    ap.add_argument("--cases", action="append", default=None, metavar="SUBSTR",
                    help="with --check: only the cases whose label (e.g. 'B=1 N=32768 H=8 Hkv=8 "
                         "D=64 bf16 (w,r)=(32768,16) causal=False') contains SUBSTR; repeat: "
                         "any of them; --list-cases prints the labels")  # fmt: skip
    ap.add_argument("--list-cases", action="store_true",
                    help="print the labels of the selected check cases and exit")  # fmt: skip
    ap.add_argument("--only", default=None, help="with --compile-only: variants containing this")
    ap.add_argument("--emulate", action="store_true", help="float64 CPU emulation of the kernels")
    ap.add_argument("--emulate-big", action="store_true",
                    help="with --emulate: also the full-size first failing --check case (slow)")  # fmt: skip
    ap.add_argument("--sass", default=None, help="with --compile-only: write SASS/PTX/TTGIR here")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    args = ap.parse_args(argv)
    if args.list_cases:
        for c in select_cases(args.quick, args.cases):
            print(case_name(c))
        return 0
    if not (args.check or args.bench or args.compile_only or args.emulate):
        ap.error("give --check, --bench, --compile-only and/or --emulate")
    lines = ["# Gluon FA3-style dilated backward (one branch)", "", f"`{' '.join(sys.argv)}`", ""]
    rc = 0
    if args.emulate:
        rc |= 0 if run_emulate(lines, args.emulate_big) else 1
    if args.compile_only or args.check or args.bench:
        if _IMPORT_ERROR is not None:
            print(f"gluon_dilated_bwd: cannot run: Gluon or its Hopper module is missing: "
                  f"{_IMPORT_ERROR}")  # fmt: skip
            return 2
        lines.append(f"triton {triton.__version__}")
    if args.compile_only:
        rc |= 0 if compile_only(lines, args.sass, args.only) else 1
    if args.check or args.bench:
        why = env_problem()
        if why is not None:
            print(f"gluon_dilated_bwd: cannot run on this machine: {why}")
            return 2
        from dilated_attention import timing  # command, device, versions, date

        lines += [*timing.results_header("run", device="cuda")[2:], ""]
        lost = False
        if args.check:
            ok, lost = run_check(lines, args.quick, args.cases)
            rc |= 0 if ok else 1
        if args.bench and lost:
            print("gluon_dilated_bwd: --bench skipped: the CUDA context was lost in --check")
            lines += ["--bench skipped: the CUDA context was lost in --check", ""]
        elif args.bench:
            run_bench(lines)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"report: {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
