"""benchmarks/bench_varlen.py end to end at CPU size (--tiny): every row runs (or, for dense
varlen attention without CUDA, says why), the FLOP counts are the documents' own, and the
results file is written."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_varlen  # noqa: E402

from dilated_attention.flops import dilated_flops, dilated_flops_varlen  # noqa: E402


def test_document_lengths_cover_the_total():
    lens = bench_varlen.document_lengths(131072, 8192, 1.0, 0)
    assert sum(lens) == 131072 and min(lens) >= 1 and len(lens) > 4
    assert lens == bench_varlen.document_lengths(131072, 8192, 1.0, 0)  # seeded


def test_varlen_flops_sum_over_documents():
    seg, dil = [8, 16], [1, 2]
    lens_q, lens_k = [5, 0, 17], [9, 3, 17]
    want = sum(dilated_flops(1, a, b, 4, 16, seg, dil, True) for a, b in zip(lens_q, lens_k) if a)
    assert dilated_flops_varlen(lens_q, lens_k, 4, 16, seg, dil, True) == want > 0
    # one document = the batch count; packing never adds pairs across documents
    assert dilated_flops_varlen([40], [40], 4, 16, seg, dil) == dilated_flops(1, 40, 40, 4, 16, seg, dil)
    assert dilated_flops_varlen([20, 20], [20, 20], 4, 16, seg, dil) < dilated_flops(1, 40, 40, 4, 16, seg, dil)
    with pytest.raises(ValueError, match="seqlens_q"):
        dilated_flops_varlen([1, 2], [3], 4, 16, seg, dil)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the --tiny smoke test runs on the CPU")
def test_tiny_bench_writes_results(tmp_path):
    out = tmp_path / "varlen.md"
    rows = bench_varlen.main(["--tiny", "--rounds", "3", "--out", str(out)])
    text = out.read_text()
    names = [r["name"][:3] for r in rows]
    assert names.count("(a)") == names.count("(a'") == names.count("(b)") == names.count("(c)") == 1
    for r in rows:
        if r["name"].startswith(("(a)", "(a')", "(b)", "(c)", "(d) dense SDPA")):
            assert "error" not in r, r
            assert r["fwd_ms"] > 0 and r["fb_ms"] > 0 and r["flops"] > 0
    assert "torch" in text and "| True | (a) varlen packed" in text and "target <= 1.1" in text
    assert "unchecked device offsets (uncovered rows filled)" in text  # gluon_varlen.FILL_UNCOVERED_ONLY, on
    ra = next(r for r in rows if r["name"].startswith("(a)"))
    assert len(ra["fb_rounds"]) == 3 and ra["fb_ms"] == sorted(ra["fb_rounds"])[1]  # the median
    # --ratio-only: rows (a) and (b), the ratio line without the padded comparison
    rows = bench_varlen.main(["--tiny", "--ratio-only", "--rounds", "2", "--out", str(out)])
    assert [r["name"][:3] for r in rows] == ["(a)", "(b)"]
    line = next(ln for ln in out.read_text().splitlines() if ln.startswith("- causal=True"))
    assert "median of 2 interleaved rounds" in line and "padded not run (--ratio-only)" in line


def test_block_model_counts_tiles_and_useful_pairs():
    """varlen_block_model: tiles as the kernels tile a block (full tiles, causal up to the
    diagonal); its useful pairs agree with flops.py's count."""
    import varlen_block_model as bm

    assert bm.block_work(128, 128, 64, True) == (128 * 129 // 2, 2 * 128 * 64)
    assert bm.block_work(130, 128, 64, True) == (130 * 131 // 2, (2 + 3) * 128 * 64)
    assert bm.block_work(100, 64, 64, False) == (100 * 100, 4 * 64 * 64)
    assert bm.block_work(0, 64, 64, True) == (0, 0)
    br, heads = [(8, 1), (16, 2), (64, 4)], 4
    for causal in (False, True):
        got = bm.stream_work([5, 17, 100, 1], br, heads, 16, 16, causal)
        want = dilated_flops_varlen([5, 17, 100, 1], [5, 17, 100, 1], heads, 1, [w for w, _ in br],
                                    [r for _, r in br], causal)  # fmt: skip
        # flops.py: 4 * D * pairs (QK^T and PV) per pair count, over heads
        assert 4 * sum(u for u, _ in got) == want, (causal, got, want)
    text = bm.report([5, 17, 100], br, heads, {"fwd": (16, 16)}, True)
    assert "| fwd | 16 x 16 |" in text


def test_block_model_per_branch_from_a_profile(tmp_path):
    """--profile: the per-launch table of a profile_varlen.py file, per kernel in launch order,
    against the count; a kernel with another number of launches than branches is skipped."""
    import varlen_block_model as bm

    md = tmp_path / "p.md"
    md.write_text("# x\n\n## Per launch, in order (us)\n\n| # | varlen kernel | varlen us | one-sequence "
                  "kernel | one us |\n|---|---|---:|---|---:|\n"
                  "| 0 | dilated_fwd_kernel | 30.0 | dilated_fwd_kernel | 20.0 |\n"
                  "| 1 | dilated_fwd_kernel | 10.0 | dilated_fwd_kernel | 10.0 |\n"
                  "| 2 | dilated_bwd_dq_kernel | 5.0 | dilated_bwd_dq_kernel | 5.0 |\n"
                  "\n## Sums\n\n| 9 | dilated_fwd_kernel | 1.0 | dilated_fwd_kernel | 1.0 |\n")
    assert bm.per_launch_times(str(md)) == {"dilated_fwd_kernel": ([30.0, 10.0], [20.0, 10.0]),
                                            "dilated_bwd_dq_kernel": ([5.0], [5.0])}  # fmt: skip
    br, lens = [(8, 1), (32, 4)], [5, 40, 19]
    text = bm.per_branch_report(lens, br, 4, {"fwd": (16, 16), "dq": (16, 16)}, True, str(md))
    p, o = bm.stream_work(lens, br, 4, 16, 16, True), bm.stream_work([64], br, 4, 16, 16, True)
    u0 = p[0][0] / o[0][0]
    row = next(line for line in text.splitlines() if line.startswith("| fwd | 8, 1 |"))
    assert row.split("|")[3].strip() == "1.500" and row.split("|")[8].strip() == f"{30 - 20 * u0:.0f}"
    assert "| dq | 1 launches for 2 branches: skipped |" in text


def test_profile_varlen_lists_compiled_variants(monkeypatch):
    """profile_varlen's register table: the constexprs that tell variants apart, by name whether
    Triton keys them by name or by (index,) path; a kernel without compiled variants says so."""
    import types

    import profile_varlen as pv

    from dilated_attention.kernels import triton_kernels as tk

    ck = types.SimpleNamespace(src=types.SimpleNamespace(constexprs={(1,): True, "BM": 64}),
                               metadata=types.SimpleNamespace(num_warps=4, num_stages=2),
                               n_regs=255, n_spills=232)  # fmt: skip
    fake = types.SimpleNamespace(arg_names=["Q", "VARLEN"], device_caches={0: ({"key": ck}, None)})
    monkeypatch.setattr(tk, "dilated_bwd_dkdv_kernel", fake)
    monkeypatch.setattr(tk, "dilated_bwd_dq_kernel", types.SimpleNamespace(device_caches={}))
    rows = pv.compiled_resources()
    assert "| dilated_bwd_dkdv_kernel | VARLEN=True, BM=64 | 4 | 2 | 255 | 232 |" in rows, rows
    assert any(r.startswith("| dilated_bwd_dq_kernel | no compiled variants") for r in rows), rows
    # Triton 3.6 (the H100 image): no constexprs on src; read from the kernel cache's key
    key = "[('*bf16', 'D'), ('i32', ''), ('constexpr', True), ('constexpr', 64)]CUDAOptions(num_warps=4)"
    ck.src = None
    fake.arg_names = ["Q", "N", "VARLEN", "BM"]
    fake.device_caches = {0: ({key: ck}, None)}
    rows = pv.compiled_resources()
    assert "| dilated_bwd_dkdv_kernel | VARLEN=True, BM=64 | 4 | 2 | 255 | 232 |" in rows, rows
    assert pv.constexprs_from_cache_key("[('s', ']'), ('constexpr', 2)]x", ["A", "B"]) == {"B": 2}
    for bad in ("(1, 2)", "[('constexpr', 1)]", "[('constexpr', 1), ('constexpr', 2)", 7):
        assert pv.constexprs_from_cache_key(bad, ["A", "B"]) == {}, bad


def test_profile_varlen_api_step_is_the_direct_step():
    """profile_varlen's API step (host offsets, dilated_attention_varlen, autograd) gives the
    gradients of its direct launches (_step) on the same packed stream (the two sides of its
    API-vs-direct section compute the same thing; Triton's interpreter, tiny sizes)."""
    pytest.importorskip("triton")
    import profile_varlen as pv

    from dilated_attention.branches import branch_head_ranges
    from dilated_attention.kernels import triton_launch as L

    if not L.INTERPRET:
        pytest.skip("the interpreter case (TRITON_INTERPRET=1)")
    lens, h, d = [40, 7, 65, 1], 2, 16
    seg, dil = [16, 32], [1, 2]
    total = sum(lens)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, total, h, d) for _ in range(4))
    cu = pv._offsets(lens, "cpu")
    docs = L.Docs(cu, cu, max(lens), max(lens), True)
    ranges = branch_head_ranges(h, len(seg), "all")
    for causal in (False, True):
        api = pv._api_step(q, k, v, do, cu, max(lens), seg, dil, causal, d**-0.5)
        direct = pv._step(q, k, v, do, seg, dil, causal, d**-0.5, ranges, docs, None)
        for a, b in zip(api, direct, strict=True):
            torch.testing.assert_close(a, b[0], atol=1e-5, rtol=1e-5)
        assert api[0].abs().sum() > 0


def test_one_sequence_on_the_triton_kernels_turns_both_gluon_switches_off(monkeypatch):
    """Row (b'): the whole call (forward, and the backward autograd runs inside it) sees both
    Gluon switches off; the defaults come back after it, also when it raises."""
    from dilated_attention import flags

    monkeypatch.delenv(flags.ENV_GLUON_FWD, raising=False)
    monkeypatch.delenv(flags.ENV_GLUON_BWD, raising=False)
    seen = []
    bench_varlen._without_gluon(lambda: seen.append((flags.gluon_forward_enabled(), flags.gluon_backward_enabled())))()
    assert seen == [(False, False)]
    assert flags.gluon_forward_enabled() and flags.gluon_backward_enabled()

    def boom():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        bench_varlen._without_gluon(boom)()
    assert flags.gluon_forward_enabled() and flags.gluon_backward_enabled()


def test_block_model_counts_programs_in_a_hand_worked_case():
    """varlen_block_model.stream_programs / stream_work: one document of 300 rows, w 256, r 2, two
    heads, tiles of 128: segments of 256 and 44 rows, blocks of 128 / 128 and 22 / 22 rows
    (c = 0, 1), one tile each."""
    import varlen_block_model as bm

    t = 128 * 128
    assert bm.stream_programs([300], [(256, 2)], 2, 128) == [4]
    assert bm.stream_work([300], [(256, 2)], 2, 128, 128, False) == [(2 * 128**2 + 2 * 22**2, 4 * t)]
    assert bm.stream_work([300], [(256, 2)], 2, 128, 128, True) == [(2 * 128 * 129 // 2 + 2 * 22 * 23 // 2, 4 * t)]
    # a block of 300 rows (w past the document, r 1): 3 tiles, 9 pairs, 6 causal
    assert bm.stream_programs([300], [(512, 1)], 1, 128) == [3]
    assert bm.stream_work([300], [(512, 1)], 1, 128, 128, False)[0][1] == 9 * t
    assert bm.stream_work([300], [(512, 1)], 1, 128, 128, True)[0][1] == 6 * t
    assert bm.stream_programs([0, 300], [(512, 1)], 1, 128) == [3]  # an empty document: nothing
    assert bm.stream_work([0, 300], [(512, 1)], 1, 128, 128, True)[0][1] == 6 * t
    assert "| 4 / 4 |" in bm.report([300], [(256, 2)], 2, {"fwd": (128, 128)}, False)
