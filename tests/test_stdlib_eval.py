"""The real-text trainer's validation by file (issue 25 item 4): every held-out file scored from
its first byte, alone, packed whole into rows; bits per byte by position in the file."""

from __future__ import annotations

import importlib.util
import math
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from dilated_attention.data import IGNORE, StdlibBytes


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "train_stdlib_bytes.py"
    spec = importlib.util.spec_from_file_location("train_stdlib_bytes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _corpus(tmp_path: Path, val_sizes, train_bytes=3000, seed=0) -> Path:
    """A fake stdlib: validation files of the given sizes (names whose crc32 % 20 == 0) and one
    train file, random printable bytes."""
    g = torch.Generator().manual_seed(seed)
    names, i = [], 0
    while len(names) < len(val_sizes):
        name = f"m{i}.py"
        if zlib.crc32(name.encode()) % 20 == 0:
            names.append(name)
        i += 1
    for name, n in zip(names, val_sizes, strict=True):
        (tmp_path / name).write_bytes(bytes((torch.randint(32, 127, (n,), generator=g)).tolist()))
    train = next(f"t{j}.py" for j in range(100) if zlib.crc32(f"t{j}.py".encode()) % 20 != 0)
    (tmp_path / train).write_bytes(bytes(torch.randint(32, 127, (train_bytes,), generator=g).tolist()))
    return tmp_path


def test_val_packed_rows_hold_whole_files_each_byte_once(tmp_path):
    sizes = [300, 1, 0, 64, 129, 90, 200, 17]  # longer than N, one byte, empty, exact fits
    data = StdlibBytes(128, root=str(_corpus(tmp_path, sizes)))
    n = 128
    rows = data.val_packed(n)
    files = [data.val_data[a:b - 1] for a, b in
             zip(data.val_starts, [*data.val_starts[1:], len(data.val_data)], strict=True)]  # fmt: skip
    seen = []
    for x, y, cu, mx, pos in rows:
        assert x.shape == y.shape == (1, n) and pos.shape == (n,)
        assert cu[0] == 0 and cu[-1] == n and cu.dtype == torch.int32
        assert mx == int((cu[1:] - cu[:-1]).max())
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            if pos[a] < 0:  # the row's padding: one document, nothing scored
                assert (pos[a:b] == -1).all() and (y[0, a:b] == IGNORE).all()
                continue
            assert torch.equal(pos[a:b], torch.arange(b - a))  # positions restart per file
            seen.append((x[0, a:b].clone(), y[0, a:b].clone()))
    assert len(seen) == sum(1 for f in files if f.numel())  # every non-empty file once
    for f in files:
        if not f.numel():
            continue
        x, y = next((sx, sy) for sx, sy in seen if sx.numel() == min(n, f.numel())
                    and torch.equal(sx, f[:n]))  # fmt: skip
        want = torch.cat([f[1 : n + 1], torch.full((max(0, n + 1 - f.numel()),), IGNORE)])
        assert torch.equal(y, want[: x.numel()])  # next byte of the same file, none after its end


def test_files_eval_equals_each_file_alone(tmp_path):
    """evaluate(val="files") (packed rows) gives the bits per byte of running every file alone."""
    mod = _bench()
    n = 128
    data = StdlibBytes(n, root=str(_corpus(tmp_path, [300, 40, 129, 7, 90, 128], seed=1)))
    s = dict(mod.PRESETS["tiny"], impl="torch", device="cpu", seq_len=n, segments=(16, 32, 128),
             rates=(1, 2, 4), local_window=16, val="files")  # fmt: skip
    model, _ = mod.build(s, "dilated", torch.device("cpu"), 0)
    model.eval()
    got = mod.evaluate(model, data, s, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    total = torch.zeros(n, dtype=torch.float64)
    count = torch.zeros(n, dtype=torch.float64)
    with torch.no_grad():
        for x, y in data.val_documents(n):
            logits = model.lm_head(model.hidden_states(x[None]))[0]
            nll = F.cross_entropy(logits.double(), y, reduction="none", ignore_index=IGNORE)
            keep = y != IGNORE
            idx = torch.arange(x.numel())[keep]
            total.index_add_(0, idx, nll[keep])
            count.index_add_(0, idx, torch.ones(idx.numel(), dtype=torch.float64))
    want_all = float(total.sum() / count.sum()) / math.log(2)
    assert abs(got["bpb"] - want_all) < 1e-5
    for a, b in mod.buckets(n, 16):
        want = float(total[a:b].sum() / count[a:b].sum()) / math.log(2)
        assert abs(got[f"bpb[{a},{b})"] - want) < 1e-5, (a, b)
    assert got["curve"] and all(c > 0 for _, _, c in got["curve"])


def test_report_names_the_best_eval(tmp_path):
    """A run's table row gives the lowest validation loss and when it was reached, not only the
    last (a run that overfits reports both)."""
    mod = _bench()
    s = dict(mod.PRESETS["tiny"], impl="torch", device="cpu", preset="tiny", val="files")
    evs = [{"step": k, "train_s": 60.0 * k, "tokens": k, "bpb": v, "bpb[0,32)": v + 0.1, "curve": []}
           for k, v in ((1, 2.0), (2, 1.5), (3, 1.7))]  # fmt: skip
    run = {"attention": "dilated", "seed": 0, "params": 1e6, "evals": evs, "calls": [], "steps": 3,
           "train_s": 180.0, "eval_s": 1.0, "epochs": 1.0}  # fmt: skip
    md = mod.markdown(s, [run], {"versions": {"python": "3"}, "train_files": 1, "train_bytes": 1,
                                 "val_files": 1, "val_bytes": 1, "stdlib_root": "/x",
                                 "command": "c", "device": "cpu", "date": "d"})  # fmt: skip
    row = next(line for line in md.splitlines() if line.startswith("| dilated |"))
    assert "| 1.7000 | 1.5000 (2.0) | 1.6000 |" in row
