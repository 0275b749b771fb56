"""benchmarks/sweep.py end to end at CPU size (--tiny), and its rule report / table export."""

from __future__ import annotations

import json
import pathlib
import sys

from dilated_attention.kernels import auto_rule

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import sweep  # noqa: E402


def test_rows_cover_the_issue_axes():
    rows = sweep.ROWS
    assert len(rows) >= 20
    assert {r.batch for r in rows} >= {1, 8}
    assert min(r.seqlen for r in rows) == 8192 and max(r.seqlen for r in rows) == 1048576
    assert any(all(r.seqlen % w for w in r.seg) for r in rows)  # N not a multiple of any w
    assert {(r.nheads, r.nheads_kv) for r in rows} >= {(16, 16), (16, 8), (16, 1), (32, 8), (32, 16), (32, 1)}
    assert {r.headdim for r in rows} == {64, 128}
    assert {len(r.seg) for r in rows} >= {3, 8}
    assert max(max(r.dil) for r in rows) == 64
    assert any({6, 12} <= set(r.dil) for r in rows)
    assert any(w % d for r in rows for w, d in zip(r.seg, r.dil, strict=True))
    assert {max(r.seg) for r in rows} >= {8192} and any(max(r.seg) >= r.seqlen for r in rows)
    assert {r.causal for r in rows} == {False, True} and {r.dtype for r in rows} == {"bf16", "fp16"}
    assert sweep.HEADLINE in {r.name for r in rows}


def test_ab_rows_are_short_block_d64_and_named_apart():
    """AB_ROWS (split_ab.py's triton_launch.SHORT_D64 rows): head dim 64 with every block shorter
    than gluon_fwd.D64_MIN_BLOCK rows, beside the one sweep row of that kind; names apart from
    the sweep's; rows_named finds both kinds, the sweep runs only ROWS unless named."""
    from dilated_attention.geometry import max_block_length
    from dilated_attention.kernels import gluon_fwd

    def short(r):
        return r.headdim == 64 and max(max_block_length(r.seqlen, w, d) for w, d in zip(r.seg, r.dil, strict=True)) \
            < gluon_fwd.D64_MIN_BLOCK

    assert all(short(r) for r in sweep.AB_ROWS)
    assert [r.name for r in sweep.ROWS if short(r)] == ["8br-paper-d64-fp16-causal"]
    assert not {r.name for r in sweep.AB_ROWS} & {r.name for r in sweep.ROWS}
    names = ["8br-paper-d64-fp16-causal", sweep.AB_ROWS[0].name]
    assert [r.name for r in sweep.rows_named(names)] == names


def test_tiny_sweep_writes_results(tmp_path, capsys):
    names = ["n100000-causal"]  # one row (N not a multiple of any w, causal): CI time
    # --impls torch: the Triton interpreter would dominate the time and checks nothing the
    # interpreter tests do not (the script's triton column is the same code path as torch's)
    sweep.main(["--tiny", "--rows", ",".join(names), "--out", str(tmp_path), "--no-peers", "--impls", "torch"])
    data = json.loads((tmp_path / "sweep.json").read_text())
    names = [r.name for r in sweep.ROWS if r.name in names]  # the sweep's priority order
    assert [r["row"]["name"] for r in data["rows"]] == names
    for res in data["rows"]:
        assert {"torch", "dense"} <= set(res["impls"])
        for impl in ("torch", "dense"):
            m = res["impls"][impl]
            assert "error" not in m, m
            assert m["fwd_ms"] > 0 and m["fb_ms"] > 0 and m["fwd_tf"] > 0
        assert res["auto_library"] in ("torch", "triton")
        assert res["auto_rule_fb"] in ("torch", "triton")
    md = (tmp_path / "sweep.md").read_text()
    assert "| n100000-causal |" in md and "rule within 5%" in md
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith(names[-1])  # summary table last

    # the exported table is valid source for auto_rule and reproduces the fastest impl
    src = sweep.emit_table(data["rows"])
    ns = dict(vars(auto_rule))
    exec(src, ns)
    table = ns["MEASURED"]
    assert len(table) == 2 * len(names)
    for m in table:
        assert auto_rule.choose_impl(m.shape, table=table) == auto_rule.fastest(m)


def _fake(name, torch_fb, triton_fb, causal=False):
    r = next(r for r in sweep.ROWS if r.name == name)._replace(causal=causal)
    imp = lambda ms: {"fwd_ms": ms / 3, "fb_ms": ms, "fwd_tf": 1.0, "fb_tf": 1.0}  # noqa: E731
    return {"row": r._asdict(), "impls": {"torch": imp(torch_fb), "triton": imp(triton_fb)},
            "auto_library": "triton"}


def test_rule_report_flags_slow_picks():
    results = [_fake("headline", 50.0, 40.0), _fake("b2-64k-7br-r64", 60.0, 120.0)]
    text, ok, ok_loo = sweep.rule_report(results)
    # with the full table the rule reproduces every fastest impl; the library's fixed
    # "triton" is slow on the second row and is marked so
    assert ok == 4
    assert "triton (slow)" in text
    # leave-one-out: each row is decided by the other, which has the opposite winner
    assert ok_loo < 4
