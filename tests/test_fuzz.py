"""scripts/fuzz.py on the CPU at tiny sizes: the free mode, the compile pool (templates, variants
within the Triton specialisation classes, the dry-run gate) and several workers.

Under ``TRITON_INTERPRET=1`` nothing compiles, but the gate records the same signatures (the
kernels' constexprs and argument classes) as on a GPU; the CUDA run is ``gpu_check.sh fuzz``.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys

import pytest
from helpers import HAS_TRITON
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


@needs_triton
def test_gate_records_signatures_without_running():
    gate = fuzz.CompileGate()
    try:
        case = random_case(random.Random(5))
        sigs, err = gate.needs(lambda: fuzz.KINDS[False][3](case, "triton", "cpu"))
        assert err is None and sigs and not gate.seen  # recorded, nothing ran
        names = {s[0] for s in sigs}
        assert {"dilated_fwd_kernel", "dilated_bwd_dkdv_kernel", "dilated_bwd_dq_kernel"} <= names
        # the real run launches exactly the signatures the dry run listed
        assert not fuzz.KINDS[False][1](case, "triton", "cpu")
        assert gate.seen == sigs
    finally:
        gate.close()
    from dilated_attention.kernels import triton_kernels as kern

    assert type(kern.dilated_fwd_kernel).run is gate.orig


def _summary(out: str) -> dict:
    """The summary lines by their first words (before a colon or a parenthesis)."""
    return {ln.split(":")[0].split(" (")[0]: ln for ln in out.splitlines() if ":" in ln}


@needs_triton
def test_gate_rejects_another_binary():
    # the same case with another constexpr (causal) or another class of an argument (w = 1)
    # needs binaries the first did not launch
    gate = fuzz.CompileGate()
    try:
        run = fuzz.KINDS[False][3]
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
