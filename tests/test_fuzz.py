"""scripts/fuzz.py on the CPU at tiny sizes: the free mode, the compile pool (templates, variants
within the Triton specialisation classes, the dry-run gate) and several workers; ``--gluon``
(tests/gluon_fuzz_cases.py) as far as a host can run it: its cases pass the Gluon gate (a
predicate written out here, and the library's own checks with the device stood in for), its
variants stay in class and need no other binary in the gate's dry runs (the Gluon gate forced
open), the launch check, the judgement, and the exit 2 where Gluon cannot run.

Under ``TRITON_INTERPRET=1`` nothing compiles, but the gate records the same signatures (the
kernels' constexprs and argument classes) as on a GPU; the CUDA runs are ``gpu_check.sh fuzz``
and ``gpu_check.sh fuzz-gluon``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import sys

import pytest
from helpers import HAS_TRITON, interpreted
from property_cases import random_case, spec_class, variant
from varlen_cases import random_varlen_case
from varlen_cases import variant as varlen_variant

# importable by name (spawned workers unpickle fuzz.work; they inherit this sys.path)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import fuzz  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton unavailable")


def test_variant_keeps_structure_and_classes():
    rng = random.Random(0)
    made = 0
    for _ in range(300):
        t = random_case(rng)
        c = variant(t, rng)
        if c is None:
            continue
        made += 1
        assert (c.h, c.hkv, c.d, c.causal, c.split, len(c.seg)) == (t.h, t.hkv, t.d, t.causal, t.split, len(t.seg))
        assert (c.pad_frac > 0) == (t.pad_frac > 0)
        assert spec_class(c.nk) == spec_class(t.nk) and spec_class(c.nq) == spec_class(t.nq)
        assert spec_class(c.nk - c.nq) == spec_class(t.nk - t.nq) and (c.nq == c.nk) == (t.nq == t.nk)
        assert [spec_class(w) for w in c.seg] == [spec_class(w) for w in t.seg]
        assert [spec_class(r) for r in c.dil] == [spec_class(r) for r in t.dil]
        assert all(1 <= r <= w <= c.nk + 3 for w, r in zip(c.seg, c.dil, strict=True)) and 1 <= c.nq <= c.nk
    assert made > 200
    # values do vary: not the template again
    t = random_case(random.Random(3))
    assert len({variant(t, random.Random(i)) for i in range(20)} - {None}) > 10


def test_varlen_variant_keeps_switches():
    rng = random.Random(1)
    for _ in range(200):
        t = random_varlen_case(rng)
        c = varlen_variant(t, rng)
        if c is None:
            continue
        keep = ("h", "hkv", "d", "causal", "split", "return_lse", "int64", "shared", "offsets_on_device",
                "layout", "check_offsets", "fold", "per_call", "grad", "half")  # fmt: skip
        assert all(getattr(c, f) == getattr(t, f) for f in keep)
        assert len(c.seg) == len(t.seg) and bool(c.klens) == bool(t.klens)
        if t.qlens == t.klens:  # self-attention packing kept (else queries may equal keys by chance)
            assert c.qlens == c.klens
        assert [spec_class(w) for w in c.seg] == [spec_class(w) for w in t.seg]
        assert all(0 <= nq <= nk for nq, nk in zip(c.qlens, c.klens, strict=True))


@interpreted
@needs_triton
def test_gate_records_signatures_without_running():
    gate = fuzz.CompileGate()
    try:
        case = random_case(random.Random(5))
        sigs, err = gate.needs(lambda: fuzz.KINDS["batch"][3](case, "triton", "cpu"))
        assert err is None and sigs and not gate.seen  # recorded, nothing ran
        names = {s[0] for s in sigs}
        assert {"dilated_fwd_kernel", "dilated_bwd_dkdv_kernel", "dilated_bwd_dq_kernel"} <= names
        # the real run launches exactly the signatures the dry run listed
        assert not fuzz.KINDS["batch"][1](case, "triton", "cpu")
        assert gate.seen == sigs
    finally:
        gate.close()
    from dilated_attention.kernels import triton_kernels as kern

    assert type(kern.dilated_fwd_kernel).run is gate.orig


def _summary(out: str) -> dict:
    """The summary lines by their first words (before a colon or a parenthesis)."""
    return {ln.split(":")[0].split(" (")[0]: ln for ln in out.splitlines() if ":" in ln}


@interpreted
@needs_triton
def test_gate_rejects_another_binary():
    # the same case with another constexpr (causal) or another class of an argument (w = 1)
    # needs binaries the first did not launch
    gate = fuzz.CompileGate()
    try:
        run = fuzz.KINDS["batch"][3]
        case = random_case(random.Random(5))
        base, _ = gate.needs(lambda: run(case, "triton", "cpu"))
        other = dataclasses.replace(case, causal=not case.causal)
        assert not gate.needs(lambda: run(other, "triton", "cpu"))[0] <= base
        assert case.seg[0] != 1
        other = dataclasses.replace(case, seg=(1, *case.seg[1:]), dil=(1, *case.dil[1:]))
        assert not gate.needs(lambda: run(other, "triton", "cpu"))[0] <= base
        twin = variant(case, random.Random(0))
        assert twin != case and gate.needs(lambda: run(twin, "triton", "cpu"))[0] <= base
    finally:
        gate.close()


@interpreted
@needs_triton
@pytest.mark.parametrize("varlen,seed", [(False, 11), (True, 5)])
def test_pool_mode_triton(capsys, varlen, seed):
    argv = ["--impl", "triton", "--examples", "4", "--pool", "1", "--seed", str(seed), "--every", "2"]
    rc = fuzz.main(argv + (["--varlen"] if varlen else []))
    out = capsys.readouterr().out
    assert rc == 0, out
    s = _summary(out)
    assert "examples run: 4  mismatches: 0  errors: 0" in s["examples run"]
    assert "compiled signatures" in s and "compile pool" in s
    pool = s["compile pool"]
    assert "1 templates drawn freely, 3 variants run" in pool
    assert "0 binaries compiled for accepted variants" in pool  # the gate held
    assert "fixed per template" in s


@interpreted
@needs_triton
def test_free_mode_counts_signatures(capsys):
    rc = fuzz.main(["--impl", "triton", "--examples", "2", "--pool", "0", "--seed", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "examples run: 2" in out and "compiled signatures:" in out and "compile pool" not in out


def test_workers_split_examples(capsys):
    # spawned workers (the torch impl: no kernels to interpret), examples split 3 + 2
    rc = fuzz.main(["--impl", "torch", "--examples", "5", "--workers", "2", "--seed", "11", "--pool", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "examples run: 5  mismatches: 0  errors: 0" in out
    assert "worker seeds: 11 (3 ex" in out and f"{fuzz.worker_seed(11, 1)} (2 ex" in out
    assert fuzz.worker_seed(11, 0) == 11 and fuzz.worker_seed(11, 1) != 11


def test_mismatch_is_counted(capsys, monkeypatch):
    # a wrong result is reported with its case and exits 1 (the check itself is not loosened)
    import property_cases

    real = property_cases._run

    def wrong(c, impl, dtype, device):
        res = real(c, impl, dtype, device)
        if impl != "reference":
            res["dq"] = res["dq"] + 1.0
        return res

    monkeypatch.setattr(property_cases, "_run", wrong)
    rc = fuzz.main(["--impl", "torch", "--examples", "2", "--seed", "2"])
    out = capsys.readouterr().out
    assert rc == 1 and out.count("MISMATCH Case(") == 2 and "dq: max abs err" in out


# ------------------------------------------------------------------------------ --gluon


def _gate_conditions(c) -> list[str]:
    """The Gluon gate's conditions a case controls, written out again (gluon_fwd.shape_problem /
    problem, gluon_bwd.problem; UNEVEN_BLOCKS and TAIL_SEGMENTS on, as shipped): what fails, by
    name."""
    import torch

    from dilated_attention.branches import branch_head_ranges

    bad = []
    if c.dtype not in (torch.bfloat16, torch.float16):
        bad.append("dtype")
    if c.d not in (64, 128):
        bad.append("headdim")
    if c.b not in (1, 2) or not 1 <= c.h <= 8 or c.h % c.hkv:
        bad.append("batch / heads")
    if not 4 <= c.n <= 4096:
        bad.append("N")
    ranges = branch_head_ranges(c.h, len(c.seg), c.head_assignment)
    for w, r, (hs, he) in zip(c.seg, c.dil, ranges, strict=True):
        t = c.n % w  # the short last segment: blocks of >= 2 rows (batch 2: TAIL_BATCHES, on as shipped)
        if w // r < 2 or r < 1 or (t and t // r < 2):
            bad.append(f"branch ({w}, {r})")
        if he > hs and (w % r or t % r) and hs % r:  # two block lengths: heads from a multiple of r
            bad.append(f"branch ({w}, {r}) heads")
    return bad


def test_gluon_cases_satisfy_the_gate_and_cover_it():
    import gluon_fuzz_cases as G

    rng = random.Random(0)
    seen = set()
    for _ in range(3000):
        c = G.gluon_case(rng)
        assert not _gate_conditions(c) and G.case_problem(c) is None, c
        assert c.b * c.h * c.n * c.n <= G.MAX_SCORES
        lens = [w // r for w, r in zip(c.seg, c.dil, strict=True)]
        seen |= {("dtype", c.bf16), ("d", c.d), ("causal", c.causal), ("split", c.split), ("b", c.b),
                 ("branches", len(c.seg)), ("backward gluon", G.backward_runs_gluon(c))}  # fmt: skip
        seen.add(("kv", "mha" if c.hkv == c.h else "mqa" if c.hkv == 1 else "gqa"))
        if c.dil[0] > 1:
            seen.add("first branch r > 1")
        if any(x % 64 for x in lens):
            seen.add("partial tile")
        if any(x > 128 and x % 128 for x in lens):
            seen.add("several tiles, the last partial")
        if c.n >= 2048:
            seen.add("N >= 2048")
        if any(w % r for w, r in zip(c.seg, c.dil, strict=True)):
            seen.add("blocks of two lengths")
        if any(c.n % w for w in c.seg):
            seen.add("short last segment")
        if any(w > c.n for w in c.seg):
            seen.add("w > N: all short last segment")
        if any(c.n % w and (c.n % w) % r for w, r in zip(c.seg, c.dil, strict=True)):
            seen.add("short last segment of two block lengths")
        if c.b == 2 and G.has_tail(c):
            seen.add("short last segment at batch 2")
        if c.split and any(w % r and hs > 0 for w, r, hs, _ in G.branches_with_heads(c)):
            seen.add("two block lengths on split heads")
    want = {("dtype", True), ("dtype", False), ("d", 64), ("d", 128), ("causal", True), ("causal", False),
            ("split", True), ("split", False), ("b", 1), ("b", 2), ("branches", 1), ("branches", 3),
            ("backward gluon", True), ("backward gluon", False), ("kv", "mha"), ("kv", "mqa"), ("kv", "gqa"),
            "first branch r > 1", "partial tile", "several tiles, the last partial", "N >= 2048",
            "blocks of two lengths", "short last segment", "w > N: all short last segment",
            "short last segment of two block lengths", "two block lengths on split heads",
            "short last segment at batch 2"}  # fmt: skip
    assert want <= seen, want - seen
    # the predicate refuses what the gate refuses
    c = G.gluon_case(random.Random(1))
    for bad in (dataclasses.replace(c, b=3), dataclasses.replace(c, d=16),
                dataclasses.replace(c, dil=tuple(w for w in c.seg)),
                dataclasses.replace(c, b=1, seg=(c.n + 1,), dil=(c.n // 2 + 1,)),  # a tail of one-row blocks
                dataclasses.replace(c, h=4, hkv=4, split=True, seg=(c.n, c.n), dil=(1, 3))):  # fmt: skip
        if bad.n % 3 == 0 and bad.split:  # w % 3 == 0: one block length, nothing to refuse
            continue
        assert G.case_problem(bad) is not None and _gate_conditions(bad), bad


def test_gluon_variants_stay_in_class():
    import gluon_fuzz_cases as G

    rng = random.Random(2)
    made = 0
    for _ in range(300):
        t = G.gluon_case(rng)
        c = G.variant(t, rng)
        if c is None:
            continue
        made += 1
        assert not _gate_conditions(c) and G.case_problem(c) is None, c
        assert (c.h, c.hkv, c.d, c.bf16, c.causal, c.split, len(c.seg)) == (t.h, t.hkv, t.d, t.bf16, t.causal, t.split,
                                                                            len(t.seg))  # fmt: skip
        assert spec_class(c.n) == spec_class(t.n) and spec_class(c.b * c.n * c.h) == spec_class(t.b * t.n * t.h)
        for (w, r), (w0, r0) in zip(zip(c.seg, c.dil, strict=True), zip(t.seg, t.dil, strict=True), strict=True):
            for f in (lambda n, w, r: w, lambda n, w, r: r, lambda n, w, r: w // r, lambda n, w, r: n // w,
                      lambda n, w, r: -(-(w // r) // 128), lambda n, w, r: -(-w // r), lambda n, w, r: n % w,
                      lambda n, w, r: (n % w) // r):  # fmt: skip
                assert spec_class(f(c.n, w, r)) == spec_class(f(t.n, w0, r0)), (t, c)
            assert (w % r > 0, c.n % w > 0) == (w0 % r0 > 0, t.n % w0 > 0), (t, c)
        assert G.case_key(c) == G.case_key(t)
    assert made > 280
    t = G.gluon_case(random.Random(3))
    assert len({G.variant(t, random.Random(i)) for i in range(20)} - {None}) > 10  # values do vary


@needs_triton
def _as_on_sm90(monkeypatch):
    """The Gluon gates' device checks as on an sm_90 GPU (compiled Triton), speed floors 0."""
    from dilated_attention.kernels import gluon_fwd, triton_import

    monkeypatch.setattr(triton_import, "INTERPRET", False)
    monkeypatch.setattr(gluon_fwd, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(gluon_fwd, "MIN_ROWS", 0)
    monkeypatch.setattr(gluon_fwd, "D64_MIN_BLOCK", 0)


def test_gluon_cases_pass_the_librarys_gate(monkeypatch):
    """gluon_fwd.shape_problem and gluon_bwd.problem as on an sm_90 GPU with MIN_ROWS 0 (the
    device checks stood in for): every case passes the forward's, the backward's exactly when
    gluon_fuzz_cases.backward_runs_gluon says so; a case off the gate is refused."""
    import gluon_fuzz_cases as G
    from gluon_cases import OnCuda

    from dilated_attention.branches import branch_head_ranges
    from dilated_attention.kernels import gluon_bwd, gluon_fwd
    from dilated_attention.kernels import triton_launch as L

    _as_on_sm90(monkeypatch)
    monkeypatch.setattr(gluon_bwd, "kernel_module", lambda: object())
    monkeypatch.setattr(gluon_bwd, "_failed", {})

    def problems(c):
        q = OnCuda((c.b, c.n, c.h, c.d), c.dtype)
        k = OnCuda((c.b, c.n, c.hkv, c.d), c.dtype)
        br = L.branch_list(c.seg, c.dil, branch_head_ranges(c.h, len(c.seg), c.head_assignment))
        return gluon_fwd.shape_problem(q, k, k, br), gluon_bwd.problem(q, k, k, c.causal, br, c.h)

    rng = random.Random(4)
    for i in range(400):
        c = G.gluon_case(rng) if i % 2 else G.variant(G.gluon_case(rng), rng)
        if c is None:
            continue
        fwd, bwd = problems(c)
        assert fwd is None, (fwd, c)
        assert (bwd is None) == G.backward_runs_gluon(c), (bwd, c)
    c = G.gluon_case(random.Random(5))
    assert "w // r >= 2" in problems(dataclasses.replace(c, seg=(2,) * len(c.seg), dil=(2,) * len(c.seg)))[0]
    assert problems(dataclasses.replace(c, d=16))[0] is not None


def test_gluon_launch_check():
    import gluon_fuzz_cases as G

    from dilated_attention.kernels import gluon_bwd, gluon_fwd

    c = G.GluonCase(b=1, n=96, h=4, hkv=2, d=64, seg=(32, 96), dil=(1, 3), causal=True, split=False, bf16=True,
                    seed=0)  # fmt: skip
    full = {"fwd": [(32, 1, 0, 4), (96, 3, 0, 4), (32, 1, 0, 4)], "bwd": [(w, r, kern) for w, r in ((32, 1), (96, 3)) for kern in ("dkdv", "dq")]}  # fwd: lo ranges twice
    assert G.launch_problems(c, full) == []
    assert G.launch_problems(c, {"fwd": [], "bwd": []})
    assert G.launch_problems(c, {"fwd": full["fwd"][:1], "bwd": full["bwd"]})  # a branch missing
    assert G.launch_problems(c, {"fwd": full["fwd"], "bwd": full["bwd"][:1]})
    split = dataclasses.replace(c, split=True)  # heads [0, 2) and [2, 4): the Gluon backward refuses
    assert not G.backward_runs_gluon(split)
    assert G.launch_problems(split, {"fwd": [(32, 1, 0, 2), (96, 3, 2, 4)], "bwd": []}) == []
    assert G.launch_problems(split, {"fwd": [(32, 1, 0, 2), (96, 3, 2, 4)], "bwd": full["bwd"]})
    one = dataclasses.replace(c, seg=(96,), dil=(3,), split=True)  # one branch: all heads, the Gluon backward
    assert G.backward_runs_gluon(one)
    assert G.launch_problems(one, {"fwd": [(96, 3, 0, 4)], "bwd": [(96, 3, "dkdv"), (96, 3, "dq")]}) == []
    # counting_launches counts the calls that returned, restores both functions
    real = gluon_fwd.launch_branch, gluon_bwd.launch_branch
    try:
        gluon_fwd.launch_branch = lambda *a, **kw: None

        def boom(*a, **kw):
            raise RuntimeError("out of resources (test)")

        gluon_bwd.launch_branch = boom
        stubs = gluon_fwd.launch_branch, gluon_bwd.launch_branch
        with G.counting_launches() as seen:
            gluon_fwd.launch_branch(*range(6), 32, 1, 0, 4, True)
            with pytest.raises(RuntimeError):
                gluon_bwd.launch_branch(*range(9), 32, 1, True, 0.1)
        assert seen == {"fwd": [(32, 1, 0, 4)], "bwd": []}
        assert (gluon_fwd.launch_branch, gluon_bwd.launch_branch) == stubs
    finally:
        gluon_fwd.launch_branch, gluon_bwd.launch_branch = real


def test_gluon_judge():
    import gluon_fuzz_cases as G
    import torch

    g = torch.Generator().manual_seed(0)
    ref = {n: torch.randn(2, 8, generator=g, dtype=torch.float64) for n in G.NAMES}
    ref["lse"][0, 0] = float("-inf")
    base = {n: (t + 1e-3 * torch.randn(t.shape, generator=g, dtype=torch.float64)).to(torch.bfloat16)
            for n, t in ref.items()}  # fmt: skip
    assert G.judge(ref, base, dict(base), torch.bfloat16) == []
    worse = dict(base, dk=base["dk"] + 0.05)  # > 2x the Triton error + 1e-3
    assert [m.split(":")[0] for m in G.judge(ref, base, worse, torch.bfloat16)] == ["dk"]
    nan = dict(base, out=base["out"].clone())
    nan["out"][1, 1] = float("nan")
    assert G.judge(ref, base, nan, torch.bfloat16) == ["out: NaN"]
    lse = dict(base, lse=base["lse"].clone())
    lse["lse"][0, 0] = 0.0
    assert G.judge(ref, base, lse, torch.bfloat16) == ["lse: -inf pattern differs"]
    # a wrong result both paths share: the gross bound (fp16 tighter than bf16)
    both = {n: t + 0.5 for n, t in base.items()}
    assert any("Triton err" in m for m in G.judge(ref, both, both, torch.float16))
    assert G.judge(ref, {n: t + 0.05 for n, t in base.items()}, {n: t + 0.05 for n, t in base.items()},
                   torch.bfloat16) == []  # fmt: skip


def test_gluon_check_raises_when_gluon_does_not_launch():
    # on the CPU nothing takes the Gluon path: the check raises, it does not pass the case
    import gluon_fuzz_cases as G

    c = G.GluonCase(b=1, n=24, h=2, hkv=1, d=64, seg=(12, 24), dil=(2, 3), causal=True, split=False, bf16=False,
                    seed=3)  # fmt: skip
    with pytest.raises(G.GluonNotLaunched, match="the Gluon forward launched branches"):
        G.check(c, "torch", "cpu")


def test_gluon_mode_refuses_to_run_without_gluon(capsys):
    import gluon_fuzz_cases as G

    assert fuzz.main(["--gluon", "--examples", "3"]) == 2  # --device cpu: never a pass
    err = capsys.readouterr().err
    assert "the Gluon kernels cannot run here" in err and "Nothing was fuzzed (exit 2)" in err
    if G.gluon_unavailable("cuda") is not None:  # this machine: no sm_90 GPU with Gluon
        assert fuzz.main(["--gluon", "--impl", "triton", "--device", "cuda", "--examples", "3"]) == 2
        assert "Nothing was fuzzed" in capsys.readouterr().err
    assert fuzz.main(["--gluon", "--varlen", "--examples", "3"]) == 2  # the Gluon varlen kernels: sm_90 only too
    assert "Nothing was fuzzed" in capsys.readouterr().err
    for bad in (["--gluon", "--impl", "torch"],):
        with pytest.raises(SystemExit) as e:
            fuzz.main(bad)
        assert e.value.code == 2


@needs_triton
def test_gluon_mode_counts_a_fallback_as_an_error(capsys, monkeypatch):
    """--gluon end to end on the CPU with the Gluon gate forced open and the runs stubbed (no
    Gluon kernel can launch here): each case is an ERROR, the exit 1; the worker set MIN_ROWS 0
    and ran variants of its template through the gate."""
    import gluon_fuzz_cases as G
    import torch

    from dilated_attention.kernels import gluon_fwd

    if gluon_fwd.kernel_module() is None:
        pytest.skip("Gluon does not import here")
    monkeypatch.setattr(gluon_fwd, "MIN_ROWS", gluon_fwd.MIN_ROWS)  # restored after the worker's 0
    monkeypatch.setattr(gluon_fwd, "D64_MIN_BLOCK", gluon_fwd.D64_MIN_BLOCK)
    monkeypatch.setattr(G, "gluon_unavailable", lambda device: None)
    monkeypatch.setattr(G, "run", lambda c, impl, device, gluon: {n: torch.zeros(1) for n in G.NAMES})
    rc = fuzz.main(["--gluon", "--examples", "3", "--pool", "1", "--seed", "7"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "fuzz (gluon): impl=triton" in out and out.count("ERROR GluonCase(") == 3
    assert "GluonNotLaunched: the Gluon forward launched branches" in out
    assert "examples run: 3  mismatches: 0  errors: 3" in out and "1 templates drawn freely, 2 variants run" in out
    assert gluon_fwd.MIN_ROWS == 0 and gluon_fwd.D64_MIN_BLOCK == 0
    # --gluon-bwd-tail: the worker turns gluon_bwd.TAIL_SEGMENTS on (and the header says so)
    from dilated_attention.kernels import gluon_bwd

    monkeypatch.setattr(gluon_bwd, "TAIL_SEGMENTS", False)
    fuzz.main(["--gluon", "--gluon-bwd-tail", "--examples", "1", "--pool", "1", "--seed", "7"])
    assert "gluon_bwd.TAIL_SEGMENTS on" in capsys.readouterr().out and gluon_bwd.TAIL_SEGMENTS
    with pytest.raises(SystemExit):
        fuzz.main(["--gluon-bwd-tail"])
    # --gluon-split-phases: the worker turns gluon_bwd.SPLIT_PHASES on
    monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", False)
    fuzz.main(["--gluon", "--gluon-split-phases", "--examples", "1", "--pool", "1", "--seed", "7"])
    assert "gluon_bwd.SPLIT_PHASES on" in capsys.readouterr().out and gluon_bwd.SPLIT_PHASES
    with pytest.raises(SystemExit):
        fuzz.main(["--gluon-split-phases"])
    # no flag: the header states the defaults the workers run (here both switched off)
    monkeypatch.setattr(gluon_bwd, "SPLIT_PHASES", False)
    monkeypatch.setattr(gluon_bwd, "TAIL_SEGMENTS", False)
    fuzz.main(["--gluon", "--examples", "1", "--pool", "1", "--seed", "7"])
    assert "gluon_bwd.TAIL_SEGMENTS off gluon_bwd.SPLIT_PHASES off" in capsys.readouterr().out


@needs_triton
def test_gate_records_gluon_launches_without_running(monkeypatch):
    """CompileGate(gluon=True) over the Gluon path (its gate forced open on the CPU: the dry run
    launches nothing): the Gluon kernels' signatures with their descriptors' classes beside the
    switches-off run's Triton ones; variants of a template need no other binary, another causal
    or headdim does; closing restores every class's dispatch."""
    import gluon_fuzz_cases as G

    from dilated_attention.kernels import gluon_bwd, gluon_fwd, triton_import
    from dilated_attention.kernels import triton_kernels as kern
    from dilated_attention.kernels import triton_launch as L

    if not triton_import.INTERPRET or gluon_fwd.kernel_module() is None:
        pytest.skip("the dry runs run on the CPU under Triton's interpreter, with Gluon importable")
    monkeypatch.setattr(gluon_fwd, "problem", lambda *a: None)  # as on an sm_90 GPU
    monkeypatch.setattr(gluon_bwd, "problem", lambda q, k, v, causal, branches, nh: None if all(
        hs == 0 and he == nh for _, _, hs, he in branches) else "split heads")  # fmt: skip
    monkeypatch.setattr(L.direct_launch, "current_device", lambda: -1)
    classes = {fuzz._run_owner(k) for k in [kern.dilated_fwd_kernel, *fuzz.gluon_kernels()]}
    before = {cls: cls.run for cls in classes}
    gate = fuzz.CompileGate(gluon=True)
    try:
        assert {cls for cls, _ in gate.patched} == classes and all(cls.run is not before[cls] for cls in classes)
        rng = random.Random(6)
        accepted = total = 0
        # float16: the interpreter refuses bf16 (the dry run never computes); split heads last
        split = G.GluonCase(b=1, n=96, h=4, hkv=2, d=64, seg=(32, 96), dil=(1, 3), causal=True, split=True,
                            bf16=False, seed=0)  # fmt: skip
        for t in [dataclasses.replace(G.gluon_case(rng), bf16=False) for _ in range(4)] + [split]:
            base, err = gate.needs(lambda c=t: G.run_impl(c, "triton", "cpu"))
            assert err is None and not gate.seen
            names = {s[0] for s in base}
            gluon = {"gluon_fwd_kernel"}
            if G.backward_runs_gluon(t):
                gluon |= {"gluon.dkdv_kernel", "gluon.dq_kernel"}
            assert {n for n in names if n.startswith("gluon")} == gluon, (names, t)
            assert names & {"dilated_fwd_kernel", "dilated_fwd_folded_kernel"} and "dilated_bwd_dq_kernel" in names
            descs = [a for s in base if s[0].startswith("gluon") for a in s[1] if a.startswith("tensordesc<fp16[")]
            assert descs and all(f",{t.d}]" in a for a in descs)
            for _ in range(10):
                c = G.variant(t, rng)
                if c is None:
                    continue
                total += 1
                accepted += gate.needs(lambda c=c: G.run_impl(c, "triton", "cpu"))[0] <= base
            for other in (dataclasses.replace(t, causal=not t.causal), dataclasses.replace(t, d=192 - t.d)):
                assert not gate.needs(lambda c=other: G.run_impl(c, "triton", "cpu"))[0] <= base
        assert total >= 30 and accepted >= 0.9 * total, (accepted, total)
    finally:
        gate.close()
    assert all(cls.run is before[cls] for cls in classes)


def test_gluon_cases_draw_batch_two_tails_only_under_tail_batches(monkeypatch):
    """gluon_fwd.TAIL_BATCHES (read when drawing): on, the generator draws batch 2 with short
    last segments and its variants keep them; off, neither does, and the predicate refuses them."""
    import gluon_fuzz_cases as G

    from dilated_attention.kernels import gluon_fwd

    def draws(n=300):
        rng = random.Random(7)
        cs = [G.gluon_case(rng) for _ in range(n)]
        return cs + [v for v in (G.variant(c, rng) for c in cs) if v is not None]

    assert any(c.b == 2 and G.has_tail(c) for c in draws())
    monkeypatch.setattr(gluon_fwd, "TAIL_BATCHES", False)
    cs = draws()
    assert not any(c.b == 2 and G.has_tail(c) for c in cs)
    tail = next(c for c in cs if G.has_tail(c))
    assert "TAIL_BATCHES" in G.case_problem(dataclasses.replace(tail, b=2))


def test_gluon_launch_count_takes_split_phases_and_one_call_alike(monkeypatch):
    """The backward's launches are counted per kernel: one launch_branch call with both kernels
    (as shipped) and two calls with one kernel each (gluon_bwd.SPLIT_PHASES) are the same
    launches; a kernel missing or run twice is a problem (the 2026-11-29 H200 split fuzz counted
    calls and called every split case an error)."""
    import gluon_fuzz_cases as G

    from dilated_attention.kernels import gluon_bwd, gluon_fwd

    c = G.GluonCase(b=1, n=20, h=6, hkv=1, d=128, seg=(4,), dil=(1,), causal=False, split=False, bf16=False,
                    seed=1)  # fmt: skip
    monkeypatch.setattr(G, "backward_runs_gluon", lambda case: True)
    monkeypatch.setattr(gluon_fwd, "launch_branch", lambda *a, **kw: None)
    monkeypatch.setattr(gluon_bwd, "launch_branch", lambda *a, **kw: None)
    fwd_args = [(None,) * 6 + tuple(b) for b in G.branches_with_heads(c)]
    bwd = (None,) * 9 + (4, 1, False, 1.0)
    for calls in ([{}], [{"kernels": ("dkdv",)}, {"kernels": ("dq",)}]):
        with G.counting_launches() as seen:
            for a in fwd_args:
                gluon_fwd.launch_branch(*a)
            for kw in calls:
                gluon_bwd.launch_branch(*bwd, add=False, **kw)
        assert G.launch_problems(c, seen) == [], calls
    with G.counting_launches() as seen:
        for a in fwd_args:
            gluon_fwd.launch_branch(*a)
        for kw in ({"kernels": ("dkdv",)}, {"kernels": ("dkdv",)}):
            gluon_bwd.launch_branch(*bwd, **kw)
    assert [p.split(" (w")[0] for p in G.launch_problems(c, seen)] == ["the Gluon backward launched"]


# ------------------------------------------------------------------------------ --gluon --varlen


def test_gluon_varlen_cases_pass_the_librarys_gate(monkeypatch):
    """gluon_varlen.problem and backward_problem as on an sm_90 GPU with the speed gates lifted
    (gluon_varlen_fuzz_cases.varlen_gates_open; the device checks stood in for): every drawn case
    and variant passes both; the draws cover host and device offsets, rows past the documents,
    GQA / MQA, both head dims, r = 1 first or not, and variants keep their key."""
    import gluon_varlen_fuzz_cases as V
    from gluon_cases import OnCuda

    from dilated_attention.kernels import gluon_varlen
    from dilated_attention.kernels import triton_launch as L

    _as_on_sm90(monkeypatch)
    monkeypatch.setattr(gluon_varlen, "kernel_module", lambda: object())
    monkeypatch.setattr(gluon_varlen, "_failed", {})
    monkeypatch.setattr(gluon_varlen, "_bwd_failed", {})

    def problems(c):
        q = OnCuda((1, c.total, c.h, c.d), c.dtype)
        k = OnCuda((1, c.total, c.hkv, c.d), c.dtype)
        br = L.branch_list(c.seg, c.dil, [(0, c.h)] * len(c.seg))
        args = (q, k, k, c.causal, br, True, c.max_len, len(c.lens))
        with V.varlen_gates_open():
            return (gluon_varlen.problem(*args, covered=not c.device_offsets),
                    gluon_varlen.backward_problem(*args, covered=not c.device_offsets))  # fmt: skip

    rng = random.Random(7)
    seen = collections.Counter()
    for _ in range(300):
        c = V.gluon_varlen_case(rng)
        assert V.case_problem(c) is None, c
        assert problems(c) == (None, None), (problems(c), c)
        seen.update({("device", c.device_offsets), ("past", c.past > 0), ("d", c.d), ("r1 first", c.dil[0] == 1),
                     ("kv", "mha" if c.hkv == c.h else "mqa" if c.hkv == 1 else "gqa"),
                     ("empty doc", 0 in c.lens), ("bf16", c.bf16)})  # fmt: skip
        v = V.variant(c, rng)
        if v is not None:
            assert V.case_key(v) == V.case_key(c) and problems(v) == (None, None), (v, c)
            seen["variants"] += 1
    for key in [("device", True), ("device", False), ("past", True), ("past", False), ("d", 64), ("d", 128),
                ("r1 first", True), ("r1 first", False), ("kv", "mha"), ("kv", "mqa"), ("kv", "gqa"),
                ("empty doc", True), ("bf16", True), ("bf16", False)]:  # fmt: skip
        assert seen[key] >= 10, (key, seen)
    assert seen["variants"] >= 150, seen
    c = V.gluon_varlen_case(random.Random(8))
    assert V.case_problem(dataclasses.replace(c, device_offsets=False, past=3)) is not None
    assert "w // r >= 2" in problems(dataclasses.replace(c, seg=(4,), dil=(3,)))[0]


def test_gluon_varlen_reference_pads_the_rows_past_the_documents():
    """The float64 reference of a case with rows past its documents (which hold NaN / inf in the
    inputs): each document's values, then out 0, lse -inf and zero gradients."""
    import gluon_varlen_fuzz_cases as V
    import torch

    c = V.GluonVarlenCase(lens=(20, 0, 1, 30), past=9, max_extra=5, h=2, hkv=1, d=64, seg=(16, 32), dil=(1, 2),
                          causal=True, bf16=False, device_offsets=True, seed=4)  # fmt: skip
    ref = V.run(c, "reference", "cpu", None)
    assert ref["out"].shape == (60, 2, 64) and ref["lse"].shape == (2, 60) and ref["dk"].shape == (60, 1, 64)
    assert all(torch.isfinite(ref[n][:51]).all() for n in ("out", "dq", "dk", "dv"))
    assert torch.isfinite(ref["lse"][:, :51]).all() and (ref["lse"][:, 51:] == float("-inf")).all()
    assert all((ref[n][51:] == 0).all() for n in ("out", "dq", "dk", "dv"))


@interpreted
def test_gluon_varlen_check_through_the_emulated_kernels(monkeypatch):
    """gluon_varlen_fuzz_cases.check end to end on the CPU: the Gluon varlen kernels emulated
    (tests/test_gluon_varlen.py), the Triton varlen kernels interpreted, host offsets, fp16: no
    mismatch; a wrong Gluon result is one; with the Gluon varlen forward refused, the check raises."""
    import gluon_varlen_fuzz_cases as V
    import test_gluon_varlen as T
    import torch

    from dilated_attention.kernels import gluon_varlen

    T._emulate_gluon_varlen(monkeypatch)
    c = V.GluonVarlenCase(lens=(40, 0, 1, 25), past=0, max_extra=0, h=2, hkv=1, d=64, seg=(16, 32), dil=(1, 2),
                          causal=True, bf16=False, device_offsets=False, seed=5)  # fmt: skip
    assert V.check(c, "triton", "cpu") == []
    real = gluon_varlen.forward

    def off_by_a_bit(*a, **kw):
        out, lse = real(*a, **kw)
        return out + 0.25, lse

    monkeypatch.setattr(gluon_varlen, "forward", off_by_a_bit)
    assert any(m.startswith("out:") for m in V.check(c, "triton", "cpu"))
    monkeypatch.setattr(gluon_varlen, "problem", lambda *a, **kw: "refused (test)")
    with pytest.raises(V.GluonNotLaunched, match="expected one forward and one backward"):
        V.check(c, "triton", "cpu")
    assert torch.is_tensor(V.run(c, "reference", "cpu", None)["out"])
