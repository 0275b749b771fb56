"""Gluon (Triton 3.6) FlashAttention-3-style forward of ONE dilated branch on Hopper (issue 24).

Born as a standalone prototype (twenty-first session); since the twenty-second the kernel lives
in the library (``dilated_attention/kernels/gluon_fwd_kernel.py``, with the LSE merge epilogue)
and this script launches it for one branch (FIRST: no merge) to check it against the float64
reference per branch, time it beside the library's Triton per-branch forward and cuDNN, and
compile it on the CPU. The kernel description below is the prototype's; the library's module
docstring is the current one. It needs Triton 3.6's Gluon
(``triton.experimental.gluon``; the API moves between versions: written against 3.6.0 exactly).

Math (docs/spec.md): branch (w, r) splits the positions into segments of w rows; query head h
reads the rows ``s*w + c + r*t`` (t = 0..L-1, c = h % r) of segment s; inside such a block it is
plain dense attention (causal inside the block when causal). Restriction of the prototype:
``N % w == 0`` and ``w % r == 0`` (every block has L = w // r rows); the library keeps its
Triton kernel for the other shapes. Returns (out, lse) of the branch alone: out (B, N, H, D) in
q's dtype and lse (B, H, N) float32 natural log, written at the rows each head reads; the rows a
head does not read in this branch (residue != h % r) keep what the buffers held (zeros and -inf
when the function allocates them).

Kernel (:func:`_dilated_fwd_kernel`), one program per (query tile of BM = 128 rows, segment,
batch x head); three partitions of ``gl.warp_specialize``:
- loader (1 warp, 24 registers): TMA loads of the two Q halves, then the K and V tiles of BN
  rows into a ring of STAGES buffers each, with mbarrier expect-tx (ready) and the consumers'
  release barriers (empty, two arrivals: one per consumer warpgroup).
- two consumer warpgroups (the default partition and one 4-warp worker, 240 registers each
  through setmaxnreg), 64 query rows each, each on its own (FA3: no barrier between them):
  S = Q K^T by async wgmma (Q and K from shared memory), online softmax in fp32 registers (exp2,
  scale folded), O += P V by async wgmma with P from registers (the A operand), software
  pipelined as FA3's intra-warpgroup overlap: the QK^T of tile j is issued before the PV of tile
  j-1, and the softmax of tile j is placed (in the PTX) while that PV is in flight. CPU compile
  finding (2026-11-28, Triton 3.6's ptxas): ptxas moves the ``wgmma.wait_group 0`` of the PV up
  to the first instruction that overwrites a register of the S accumulator (the softmax works
  in place), so in the SASS only the row-max pass overlaps the PV; the exp2 / row-sum pass
  runs after it. Overlap across the two consumer warpgroups is left to the warp scheduler (no
  FA3 ping-pong named barriers: Gluon 3.6 has no named-barrier API).
- epilogue per consumer: O / l into its Q buffer (bf16/fp16), TMA store (rows t >= L clipped by
  the TMA box), lse by plain masked stores.

Strided blocks through TMA: q is viewed as the 4-D tensor [B*N/w, L, r*H, D] with strides
[w*H*D, r*H*D, D, 1] (index (b*nseg + s, t, c*H + h, d)); k and v likewise with Hkv
(GQA: kv head h // (H // Hkv)). A box [1, rows, 1, D] of that view is one 2-D tile of a dilated
block; the shared buffer is ``.reshape``d to the [rows, D] tile that wgmma reads (same bytes;
the compiler infers the 2-D 128-byte-swizzled layout). TMA zero-fills rows t >= L; the scores of keys t >= L (and j > i when
causal) are masked to -inf, only on the tiles that need it. Causal: key tiles past the
program's last row are skipped.

Usage (the GPU machine: Triton 3.6, sm_90)::

    PYTHONPATH=src python3 benchmarks/gluon_dilated_fwd.py --check --bench --out $OUT/gluon_fwd.md

``--compile-only [--sass DIR]`` compiles the variants for sm_90 without a GPU (Triton 3.6 in
the venv of benchmarks/kernel_resources.py) and prints registers, spills, shared memory and the
SASS facts (UTMALDG, HGMMA, SYNCS, USETMAXREG). Exit 2 when Gluon / its Hopper module is missing
or the GPU is not sm_90.
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
    print("gluon_dilated_fwd: torch is missing")
    sys.exit(2)

try:
    import triton
    from triton.experimental.gluon import language as gl

    from dilated_attention.kernels import gluon_fwd

    _mod = gluon_fwd.kernel_module()
    _IMPORT_ERROR = None if _mod is not None else gluon_fwd.import_error()
except Exception as e:  # noqa: BLE001  (any import failure: report and exit 2)
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

LOG2E = 1.4426950408889634


def env_problem() -> str | None:
    """Why this script cannot run its GPU part here (None: it can)."""
    if _IMPORT_ERROR is not None:
        return f"Gluon, its Hopper module or the library is missing: {_IMPORT_ERROR}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"the GPU is sm_{cap[0]}{cap[1]}, this kernel is for sm_90 (Hopper) only"
    return None


def gluon_branch_fwd(
    q,
    k,
    v,
    w: int,
    r: int,
    causal: bool,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
):
    """(out, lse) of the ONE branch (w, r) through the library's Gluon kernel
    (``gluon_fwd.launch_branch`` with FIRST: no merge). q (B, N, H, D), k, v (B, N, Hkv, D),
    contiguous, bf16 or fp16, D 64 or 128, N % w == 0, w % r == 0. out / lse: buffers to write
    into (the rows a head does not read keep their values); None: allocated (zeros / -inf)."""
    bsz, n, nh, d = q.shape
    why = gluon_fwd.problem(q, k, v, causal, [(w, r, 0, nh)])
    if why is not None:
        raise ValueError(why)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    if out is None:
        out = torch.zeros_like(q)
    if lse is None:
        lse = torch.full((bsz, nh, n), float("-inf"), dtype=torch.float32, device=q.device)
    gluon_fwd.launch_branch(q, k, v, out, out, lse, w, r, 0, nh, causal, scale, 0, n // w, 0,
                            True, False, False)  # fmt: skip
    return out, lse


# ------------------------------------------------------------------------------ checking


def _head_blocks(x: torch.Tensor, h: int, c: int, w: int, r: int) -> torch.Tensor:
    """(B, nseg, L, D): head h's rows s*w + c + r*t of x (B, N, heads, D), per segment s."""
    bsz, n, _, d = x.shape
    return x[:, :, h, :].reshape(bsz, n // w, w // r, r, d)[:, :, :, c]


def _reference_head(qh, kh, vh, causal, scale):
    """float64 dense attention on (B, nseg, L, D) blocks: out (same shape), lse (B, nseg, L)."""
    s = torch.matmul(qh.double(), kh.double().transpose(-1, -2)) * scale
    if causal:
        big_l = s.shape[-1]
        s = s.masked_fill(torch.ones(big_l, big_l, dtype=torch.bool, device=s.device).triu(1),
                          float("-inf"))  # fmt: skip
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), vh.double()), lse


def _sdpa_head(qh, kh, vh, causal, scale):
    """torch SDPA (flash / cuDNN backend) in the input dtype on the same blocks."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bsz, nseg, big_l, d = qh.shape
    args = [x.reshape(bsz * nseg, 1, big_l, d) for x in (qh, kh, vh)]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        o = torch.nn.functional.scaled_dot_product_attention(*args, is_causal=causal, scale=scale)
    return o.reshape(bsz, nseg, big_l, d)


def check_case(bsz, n, nh, hkv, d, w, r, causal, dtype, seed=0):
    """One exactness case: returns (ok, line)."""
    torch.manual_seed(seed)
    dev = "cuda"
    q = torch.randn(bsz, n, nh, d, device=dev, dtype=dtype)
    k = torch.randn(bsz, n, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(bsz, n, hkv, d, device=dev, dtype=dtype)
    scale = d**-0.5
    out, lse = gluon_branch_fwd(q, k, v, w, r, causal, scale)
    torch.cuda.synchronize()
    rep = nh // hkv
    err_o = err_s = err_l = 0.0
    for h in range(nh):
        c = h % r
        qh = _head_blocks(q, h, c, w, r)
        kh, vh = _head_blocks(k, h // rep, c, w, r), _head_blocks(v, h // rep, c, w, r)
        ref_o, ref_l = _reference_head(qh, kh, vh, causal, scale)
        got_o = _head_blocks(out, h, c, w, r).double()
        got_l = lse[:, h, :].reshape(bsz, n // w, w // r, r)[:, :, :, c].double()
        sd_o = _sdpa_head(qh, kh, vh, causal, scale).double()
        err_o = max(err_o, (got_o - ref_o).abs().max().item())
        err_s = max(err_s, (sd_o - ref_o).abs().max().item())
        err_l = max(err_l, ((got_l - ref_l).abs() / ref_l.abs().clamp_min(1.0)).max().item())
    floor = 1e-3
    ok_o = err_o <= 2 * err_s + floor
    ok_l = err_l <= 1e-3
    finite = bool(torch.isfinite(out).all()) and not bool(torch.isnan(lse).any())
    ok = ok_o and ok_l and finite
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    line = (f"| {'PASS' if ok else 'FAIL'} | B={bsz} N={n} H={nh} Hkv={hkv} D={d} {name} "
            f"(w,r)=({w},{r}) causal={causal} | out err {err_o:.2e} (SDPA {err_s:.2e}, "
            f"limit {2 * err_s + floor:.2e}) | lse rel {err_l:.2e} |")  # fmt: skip
    return ok, line


def check_cases():
    """(B, N, H, Hkv, D, w, r, causal, dtype) of --check."""
    branches = [
        (2048, 1, 8192),
        (4096, 2, 8192),
        (32768, 16, 32768),
        (256, 4, 4096),
        (960, 5, 3840),
    ]  # (w, r, N); (960, 5): L = 192, a partial key / query tile
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            for d in (64, 128):
                for nh, hkv in ((16, 4), (8, 8)):
                    for w, r, n in branches:
                        cases.append((1, n, nh, hkv, d, w, r, causal, dtype))
            cases.append((2, 8192, 16, 4, 128, 4096, 2, causal, dtype))
            cases.append((2, 4096, 8, 8, 64, 256, 4, causal, dtype))
    return cases


def run_check(lines: list[str]) -> bool:
    lines += ["## --check (float64 reference on the gathered blocks)", "",
              "| result | case | out max abs error | lse max rel error |", "|---|---|---|---|"]  # fmt: skip
    all_ok = True
    for case in check_cases():
        try:
            ok, line = check_case(*case)
        except Exception as e:  # noqa: BLE001  (a failing case is reported, the rest still run)
            ok, line = False, f"| FAIL | {case} | {type(e).__name__}: {str(e)[:300]} | |"
        all_ok &= ok
        print(line, flush=True)
        lines.append(line)
    lines += ["", f"**check: {'all PASS' if all_ok else 'FAIL'}**", ""]
    return all_ok


# ------------------------------------------------------------------------------ benchmark


def median_ms(fn, warmup: int = 3, iters: int = 15) -> float:
    """Median CUDA-event milliseconds of fn() (the library's timer, ``timing.median_ms``)."""
    from dilated_attention import timing

    return timing.median_ms(fn, "cuda", warmup, iters)


def _library_fwd():
    """The library's per-branch Triton forward (fold off), or None when src is not importable."""
    try:
        from dilated_attention.kernels import triton_launch
    except Exception as e:  # noqa: BLE001
        print(f"library Triton forward unavailable ({type(e).__name__}: {e}); PYTHONPATH=src?")
        return None

    def fwd(q, k, v, w, r, causal, scale):
        nh = q.shape[2]
        return triton_launch.forward(q, k, v, None, [w], [r], causal, scale, [(0, nh)],
                                     fold=False)  # fmt: skip

    return fwd


def run_bench(lines: list[str], n: int = 131072, nh: int = 16, d: int = 128) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bsz, dtype = 1, torch.bfloat16
    branches = [(2048, 1), (4096, 2), (8192, 4), (16384, 8), (32768, 16)]
    torch.manual_seed(0)
    q = torch.randn(bsz, n, nh, d, device="cuda", dtype=dtype)
    k = torch.randn(bsz, n, nh, d, device="cuda", dtype=dtype)
    v = torch.randn(bsz, n, nh, d, device="cuda", dtype=dtype)
    scale = d**-0.5
    lib = _library_fwd()
    out = torch.zeros_like(q)
    lse = torch.full((bsz, nh, n), float("-inf"), dtype=torch.float32, device="cuda")
    rows = []
    print(f"bench: B={bsz} N={n} H={nh} D={d} bf16; TF/s = useful FLOPs / time")
    for causal in (False, True):
        for w, r in branches:
            big_l, nseg = w // r, n // w
            flops = 4.0 * big_l * big_l * d * bsz * nseg * nh * (0.5 if causal else 1.0)
            t_g = median_ms(lambda: gluon_branch_fwd(q, k, v, w, r, causal, scale, out, lse))  # noqa: B023
            t_l = float("nan")
            if lib is not None:
                try:
                    t_l = median_ms(lambda: lib(q, k, v, w, r, causal, scale))  # noqa: B023
                except Exception as e:  # noqa: BLE001
                    print(f"library forward failed: {type(e).__name__}: {e}")
            # dense ceiling: cuDNN on contiguous blocks with the branch's FLOPs (B*nseg blocks
            # per head: each head reads one residue class)
            qd = torch.randn(bsz * nseg, nh, big_l, d, device="cuda", dtype=dtype)
            kd, vd = torch.randn_like(qd), torch.randn_like(qd)

            def dense(qd=qd, kd=kd, vd=vd, causal=causal):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(
                        qd, kd, vd, is_causal=causal, scale=scale
                    )

            try:
                t_c = median_ms(dense)
            except Exception as e:  # noqa: BLE001
                print(f"cuDNN SDPA failed: {type(e).__name__}: {e}")
                t_c = float("nan")
            del qd, kd, vd
            tf = [flops / t / 1e9 for t in (t_g, t_l, t_c)]
            row = (f"| {w} | {r} | {big_l} | {causal} | {t_g:.3f} | {tf[0]:.0f} | {t_l:.3f} | "
                   f"{tf[1]:.0f} | {t_c:.3f} | {tf[2]:.0f} | {t_l / t_g:.2f} |")  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    lines += [f"## --bench: B={bsz} N={n} H={nh} D={d} bf16, one branch per row", "",
              "Times: median of 15 CUDA-event timed calls after 3 warm-up calls (ms). TF/s = "
              "useful FLOPs (4 L^2 D per block and head, halved when causal) / time. Gluon: "
              "this kernel; library: `triton_launch.forward(..., fold=False)` on the single "
              "branch; cuDNN: SDPA (CUDNN_ATTENTION) on contiguous (B*N/w, H, L, D) tensors "
              "(the same FLOPs: the dense ceiling).", "",
              "| w | r | L | causal | Gluon ms | Gluon TF/s | library ms | library TF/s | "
              "cuDNN ms | cuDNN TF/s | library / Gluon |",
              "|---|---|---|---|---|---|---|---|---|---|---|", *rows, ""]  # fmt: skip


# ------------------------------------------------------------------------------ CPU compile


def _signature(d: int, causal: bool, dtype_name: str = "bf16", first: bool = False,
               comp: bool = True, classes: bool = False):  # fmt: skip
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype_name]

    def desc(rows):
        lay = gl.NVMMASharedLayout.get_default_for([1, rows, 1, d], gdt)
        return f"tensordesc<{dtype_name}[1, {rows}, 1, {d}],{lay!r}>"

    sig = {"q_desc": desc(_mod.WG_M), "k_desc": desc(gluon_fwd.KV_BN),
           "v_desc": desc(gluon_fwd.KV_BN), "o_desc": desc(_mod.WG_M), "lo_desc": desc(_mod.WG_M),
           "LSE": "*fp32", "qk_scale": "fp32", "N": "i32", "L": "i32", "W": "i32", "NSEG": "i32",
           "S0": "i32", "LO_NSEG": "i32", "LO_S0": "i32", "R": "i32", "H": "i32", "HKV": "i32",
           "HS": "i32", "NHB": "i32", "C0": "i32", "CW": "i32",
           "BN": "constexpr", "D": "constexpr", "STAGES": "constexpr", "CAUSAL": "constexpr",
           "FIRST": "constexpr", "COMP": "constexpr", "STORE_LO": "constexpr",
           "CLASSES": "constexpr", "CONSUMER_REGS": "constexpr", "LOADER_REGS": "constexpr"}  # fmt: skip
    consts = {"BN": gluon_fwd.KV_BN, "D": d, "STAGES": gluon_fwd.stages(d), "CAUSAL": causal,
              "FIRST": first, "COMP": comp, "STORE_LO": comp, "CLASSES": classes,
              "CONSUMER_REGS": gluon_fwd.CONSUMER_REGS, "LOADER_REGS": gluon_fwd.LOADER_REGS}  # fmt: skip
    return sig, consts


SASS_FACTS = ("UTMALDG", "UTMASTG", "HGMMA", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "SYNCS",
              "USETMAXREG", "BAR.SYNC", "LDL", "STL", "LDS", "STS", "SHFL", "MUFU.EX2")  # fmt: skip


def compile_only(lines: list[str], sass_dir: str | None) -> bool:
    """Compile the variants for sm_90 without a GPU; registers, spills, smem, SASS facts."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    lines += [f"## sm_90 compile (CPU, triton {triton.__version__})", "",
              "| variant | regs (cap) | stack / local | smem bytes | setmaxnreg values | "
              + " | ".join(SASS_FACTS) + " |", "|---" * (5 + len(SASS_FACTS)) + "|"]  # fmt: skip
    ok = True
    for dtype_name in ("bf16", "fp16"):
        # the last two: a length class of a branch with w % r != 0 (gluon_fwd.UNEVEN_BLOCKS)
        variants = ((128, False, True, False, False), (128, False, False, True, False),
                    (128, True, True, True, False), (128, True, False, False, False),
                    (64, False, False, True, False), (64, True, True, False, False),
                    (128, True, False, True, True), (64, False, True, False, True))
        for d, causal, first, comp, classes in variants:
            name = f"{dtype_name} D={d} causal={causal} first={first} comp={comp}"
            name += " classes" if classes else ""
            sig, consts = _signature(d, causal, dtype_name, first, comp, classes)
            attrs = {(5,): [["tt.divisibility", 16]]}
            try:
                ck = triton.compile(GluonASTSource(_mod.gluon_fwd_kernel, sig, consts, attrs),
                                    target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": 4,
                                             "maxnreg": gluon_fwd.MAXNREG})  # fmt: skip
            except Exception as e:  # noqa: BLE001
                ok = False
                msg = f"| {name} | compile FAILED: {type(e).__name__}: {str(e)[:300]} |"
                print(msg)
                lines.append(msg)
                continue
            with tempfile.TemporaryDirectory() as tmp:
                cubin = os.path.join(tmp, "k.cubin")
                with open(cubin, "wb") as f:
                    f.write(ck.asm["cubin"])
                res = subprocess.run([os.path.join(tools, "cuobjdump"),
                                      "--dump-resource-usage", cubin],
                                     capture_output=True, text=True).stdout  # fmt: skip
                sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                                      capture_output=True, text=True).stdout  # fmt: skip
            reg = re.search(r"REG:(\d+)", res)
            stack = re.search(r"STACK:(\d+)", res)
            local = re.search(r"LOCAL:(\d+)", res)
            maxnreg = sorted({int(x, 16) for x in re.findall(r"USETMAXREG\.\S+ (?:UP\d, )?"
                                                             r"0x([0-9a-f]+)", sass)})  # fmt: skip
            counts = [str(len(re.findall(re.escape(p), sass))) for p in SASS_FACTS]
            row = (f"| {name} | {reg.group(1) if reg else '?'} ({gluon_fwd.MAXNREG}) | "
                   f"{stack.group(1) if stack else '?'} / {local.group(1) if local else '?'}"
                   f" | {ck.metadata.shared} | {maxnreg} | " + " | ".join(counts) + " |")  # fmt: skip
            print(row, flush=True)
            lines.append(row)
            if sass_dir:
                os.makedirs(sass_dir, exist_ok=True)
                # one file per variant (a refactor's check: `diff -r` of two dumps, since the
                # SASS carries no source lines)
                stem = os.path.join(sass_dir, f"gluon_fwd_{dtype_name}_d{d}_c{int(causal)}_f{int(first)}"
                                              f"_m{int(comp)}_k{int(classes)}")  # fmt: skip
                for ext, text in (("sass", sass), ("ptx", ck.asm["ptx"]),
                                  ("ttgir", ck.asm["ttgir"])):  # fmt: skip
                    with open(f"{stem}.{ext}", "w") as f:
                        f.write(text)
    lines.append("")
    return ok


# ------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exactness vs float64 (GPU)")
    ap.add_argument("--bench", action="store_true", help="headline-shape timing (GPU)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 on the CPU")
    ap.add_argument("--sass", default=None, help="with --compile-only: write SASS/PTX/TTGIR here")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    args = ap.parse_args(argv)
    if not (args.check or args.bench or args.compile_only):
        ap.error("give --check, --bench and/or --compile-only")
    lines = ["# Gluon FA3-style dilated forward (one branch), issue 24", "",
             f"`{' '.join(sys.argv)}`", ""]  # fmt: skip
    if _IMPORT_ERROR is not None:
        print(f"gluon_dilated_fwd: cannot run: Gluon or its Hopper module is missing: "
              f"{_IMPORT_ERROR}")  # fmt: skip
        return 2
    lines.append(f"triton {triton.__version__}")
    rc = 0
    if args.compile_only:
        rc |= 0 if compile_only(lines, args.sass) else 1
    if args.check or args.bench:
        why = env_problem()
        if why is not None:
            print(f"gluon_dilated_fwd: cannot run on this machine: {why}")
            return 2
        from dilated_attention import timing  # command, device, versions, date

        lines += [*timing.results_header("run", device="cuda")[2:], ""]
        if args.check and not run_check(lines):
            rc = 1
        if args.bench:
            run_bench(lines)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"report: {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
