"""Does Triton's automatic warp specialization apply on Hopper? (issue 24; CPU only, no GPU)

    /tmp/t36/bin/python benchmarks/probe_warp_specialize.py 90    # sm_90 (H100 / H200)
    /tmp/t36/bin/python benchmarks/probe_warp_specialize.py 100   # sm_100 (Blackwell)

Compiles one flash-attention forward loop (``tl.range(..., warp_specialize=WS)``) for the
target given, WS False and True, and says whether the TTGIR has a ``ttg.warp_specialize``
region and the PTX ``setmaxnreg`` (producer / consumer register split) and ``wgmma``.
2026-11-28, triton 3.6.0 (the GPU image's): sm_90 compiles the same code with WS True as
without (no region, no setmaxnreg: the flag is ignored); sm_100 gets the region and setmaxnreg.
Run it with the venv of benchmarks/kernel_resources.py's docstring (Triton 3.6 and numpy).
"""

import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def attn_fwd(
    Q, K, V, O, N, sq, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr
):
    pid = tl.program_id(0)
    offs_m = pid * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * sq + offs_d[None, :])
    m_i = tl.full([BM], -float("inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for n0 in tl.range(0, N, BN, warp_specialize=WS):
        offs_n = n0 + tl.arange(0, BN)
        k = tl.load(K + offs_n[:, None] * sq + offs_d[None, :])
        v = tl.load(V + offs_n[:, None] * sq + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m_i = m_new
    tl.store(O + offs_m[:, None] * sq + offs_d[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


target = GPUTarget("cuda", int(sys.argv[1]) if len(sys.argv) > 1 else 90, 32)
for ws in (False, True):
    sig = {
        "Q": "*bf16",
        "K": "*bf16",
        "V": "*bf16",
        "O": "*bf16",
        "N": "i32",
        "sq": "i32",
        "D": "constexpr",
        "BM": "constexpr",
        "BN": "constexpr",
        "WS": "constexpr",
    }
    consts = {"D": 128, "BM": 128, "BN": 64, "WS": ws}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    try:
        ck = triton.compile(
            ASTSource(attn_fwd, sig, consts, attrs),
            target=target,
            options={"num_warps": 8, "num_stages": 2},
        )
        ttgir, ptx = ck.asm["ttgir"], ck.asm["ptx"]
        print(
            f"sm_{target.arch} WS={ws}: compiled; ttg.warp_specialize in TTGIR: "
            f"{'ttg.warp_specialize' in ttgir}; setmaxnreg in PTX: {'setmaxnreg' in ptx}; "
            f"wgmma in PTX: {'wgmma' in ptx}"
        )
    except Exception as e:
        print(f"WS={ws}: {type(e).__name__}: {str(e)[:400]}")
