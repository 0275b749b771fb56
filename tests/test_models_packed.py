"""Packed documents through the modules and LongNetLM: the result on each document equals that
document run alone (positions, rotary and segments restart per document); pack_documents."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import DilatedAttention, MultiheadDilatedAttention, dilated_attention
from dilated_attention.data import IGNORE, pack_documents
from dilated_attention.models import LongNetConfig, LongNetLM

SEG, DIL = (4, 8, 16), (1, 2, 4)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("packed_row", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_dilated_attention_module_cu_seqlens(packed_row, causal, seed):
    lengths = [9, 1, 20, 3]
    n = sum(lengths)
    cu = _cu(lengths)
    q = torch.randn(n, 4, 8, dtype=torch.float64)
    k = torch.randn(n, 2, 8, dtype=torch.float64)
    v = torch.randn(n, 2, 8, dtype=torch.float64)
    mod = DilatedAttention(SEG, DIL, impl="torch")
    args = (q[None], k[None], v[None]) if packed_row else (q, k, v)
    out = mod(*args, is_causal=causal, cu_seqlens=cu)
    assert out.shape == args[0].shape
    out = out[0] if packed_row else out
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want = dilated_attention(q[None, a:b], k[None, a:b], v[None, a:b], SEG, DIL, causal=causal, impl="reference")
        torch.testing.assert_close(out[a:b], want[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_module_cu_seqlens_equals_each_document(batch_first, seed):
    lengths = [6, 17, 2, 11]
    n = sum(lengths)
    cu = _cu(lengths)
    mha = MultiheadDilatedAttention(32, 4, SEG, DIL, num_kv_heads=2, impl="torch", batch_first=batch_first).double()
    x = torch.randn(n, 32, dtype=torch.float64, requires_grad=True)
    out, w = mha(x, x, x, is_causal=True, cu_seqlens=cu)
    assert w is None and out.shape == x.shape
    row = x[None] if batch_first else x[:, None]
    out_row, _ = mha(row, row, row, is_causal=True, cu_seqlens=cu, max_seqlen=17)
    torch.testing.assert_close(out_row.reshape(n, 32), out, rtol=0, atol=0)
    gx = torch.autograd.grad(out.sum(), x)[0]
    want_g = torch.zeros_like(x)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        xi = x[a:b].detach().requires_grad_()
        xr = xi[None] if batch_first else xi[:, None]
        wi, _ = mha(xr, xr, xr, is_causal=True)
        torch.testing.assert_close(out[a:b], wi.reshape(b - a, 32), rtol=0, atol=1e-12)
        want_g[a:b] = torch.autograd.grad(wi.sum(), xi)[0]
    torch.testing.assert_close(gx, want_g, rtol=0, atol=1e-11)


def test_module_cu_seqlens_errors():
    mod = DilatedAttention(SEG, DIL)
    q = torch.randn(5, 2, 4)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="key_padding_mask with cu_seqlens"):
        mod(q, q, q, key_padding_mask=torch.zeros(1, 5, dtype=torch.bool), cu_seqlens=cu)
    with pytest.raises(ValueError, match="max_seqlen is given without cu_seqlens"):
        mod(q[None], q[None], q[None], max_seqlen=5)
    with pytest.raises(ValueError, match="one packed row"):
        mod(torch.randn(2, 5, 2, 4), torch.randn(2, 5, 2, 4), torch.randn(2, 5, 2, 4), cu_seqlens=cu)
    mha = MultiheadDilatedAttention(8, 2, SEG, DIL)
    x = torch.randn(5, 8)
    with pytest.raises(ValueError, match="need_weights, attn_mask and key_padding_mask"):
        mha(x, x, x, torch.zeros(1, 5, dtype=torch.bool), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"must be \(total, embed_dim=8\)"):
        mha(torch.randn(2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8), cu_seqlens=cu)


def _model(seed, **over):
    torch.manual_seed(seed)
    cfg = LongNetConfig.preset(
        "tiny", segment_lengths=SEG, dilation_rates=DIL, n_kv_head=2, impl="torch", n_layer=2, **over
    )
    return LongNetLM(cfg).double()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_longnet_packed_logits_and_grads_equal_each_document_alone(checkpointing, seed):
    model = _model(seed, checkpoint_activations=checkpointing).train()
    docs = [torch.randint(0, 128, (n,)) for n in (5, 1, 17, 9, 30, 2)]
    x, y, cu, mx = pack_documents(docs, 24)
    logits, loss = model(x, y, cu_seqlens=cu, loss_reduction="sum")
    flat_logits, flat_x, flat_y = logits.reshape(-1, logits.shape[-1]), x.reshape(-1), y.reshape(-1)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    want_loss = 0.0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want, lo = model(flat_x[None, a:b], flat_y[None, a:b], loss_reduction="sum")
        torch.testing.assert_close(flat_logits[a:b], want[0], rtol=0, atol=1e-10)
        want_loss = want_loss + lo
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-10)
    want_g = torch.autograd.grad(want_loss, list(model.parameters()))
    for g, w in zip(grads, want_g, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("give_max", [False, True], ids=["no_max_seqlen", "max_seqlen"])
def test_longnet_packed_cuda_no_host_sync(seed, give_max):
    """Packed rows with host offsets (as pack_documents makes them) through LongNetLM on the
    GPU, fused kernel, bf16 autocast: a forward and backward never synchronises the host after a
    first call, whether max_seqlen is passed or read from the host offsets; the logits equal
    those of the device-offsets call."""
    torch.manual_seed(seed)
    cfg = LongNetConfig.preset("tiny", segment_lengths=(64, 128, 256), dilation_rates=(1, 2, 4),
                               n_kv_head=2, impl="triton", n_layer=2)  # fmt: skip
    model = LongNetLM(cfg).cuda().eval()  # no dropout: the two routes' logits compare
    docs = [torch.randint(0, 128, (n,)) for n in (300, 1, 77, 512, 90)]
    x, y, cu, mx = pack_documents(docs, 256)
    x, y = x.cuda(), y.cuda()

    def step(offsets):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = model(x, cu_seqlens=offsets, max_seqlen=mx if give_max else None)
        logits.float().square().mean().backward()
        return logits.detach()

    first = step(cu)  # first calls: compilation and one-time probes may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(cu)
        step(cu)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    torch.testing.assert_close(first, step(cu.cuda()))  # device offsets (the filled route)


def test_longnet_packed_differs_from_unpacked(seed):
    # the test above cannot pass by ignoring cu_seqlens: the same row unpacked gives other logits
    model = _model(seed).eval()
    x = torch.randint(0, 128, (1, 20))
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    with torch.no_grad():
        packed, _ = model(x, cu_seqlens=cu)
        plain, _ = model(x)
    assert not torch.allclose(packed[0, 9:], plain[0, 9:])


def test_longnet_packed_errors(seed):
    model = _model(seed).eval()
    x = torch.randint(0, 128, (1, 8))
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D integer tensor"):
        model(x, cu_seqlens=[0, 8])
    with pytest.raises(ValueError, match="last entry of cu_seqlens_q"):
        model(x, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="without a KV cache or start_pos"):
        model(x, start_pos=0, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))


def test_pack_documents():
    docs = [torch.arange(1, 6), [7], torch.arange(10, 30), torch.tensor([], dtype=torch.long), torch.arange(40, 43)]
    x, y, cu, mx = pack_documents(docs, 8, pad_id=0)
    assert x.shape == (4, 8) and y.shape == (4, 8)
    flat = x.reshape(-1)
    assert flat[:29].tolist() == [*range(1, 6), 7, *range(10, 30), *range(40, 43)]
    assert (flat[29:] == 0).all()
    # documents, with the row ends (8, 16, 24) cutting the third one, and the padding
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 6, 8, 16, 24, 26, 29, 32]
    assert mx == 8
    fy = y.reshape(-1)
    assert fy[:5].tolist() == [2, 3, 4, 5, IGNORE]  # no prediction across documents
    assert fy[5].item() == IGNORE
    assert fy[7].item() == 12  # a document cut by a row end still predicts its next token
    assert fy[25].item() == IGNORE and fy[26:29].tolist() == [41, 42, IGNORE]
    assert (fy[29:] == IGNORE).all()
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        pack_documents(docs, 0)
    with pytest.raises(ValueError, match="document 0 must be a 1-D integer"):
        pack_documents([torch.rand(3)], 4)


def test_readme_packing_block_runs_as_written():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Packed documents (varlen)", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "README.md", "exec"), {})
    promised = re.findall(r"# (torch\.Size\(.*)$", code, re.M)
    assert buf.getvalue().splitlines() == [p.strip() for p in promised]


def test_stdlib_packed_batch_documents_are_files(tmp_path):
    from dilated_attention.data import StdlibBytes

    for i in range(40):  # file i: one repeated letter (neighbours differ), then its newline
        (tmp_path / f"m{i:02d}.py").write_bytes(bytes([97 + i % 26]) * (3 + 7 * i % 23))
    data = StdlibBytes(16, root=str(tmp_path))
    x, y, cu, mx = data.packed_batch(4, seed=3, step=7)
    xb, yb = data.batch(4, seed=3, step=7)
    assert torch.equal(x, xb)  # the same crops as the plain batch
    assert mx <= 16 and cu.dtype == torch.int32
    assert set(range(0, 65, 16)) <= set(cu.tolist()) and len(cu) > 6
    fx, fy, fyb = x.reshape(-1), y.reshape(-1), yb.reshape(-1)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        doc = fx[a:b].tolist()
        assert 10 not in doc[:-1], (a, b, doc)  # a file's newline is its last byte
        assert len({c for c in doc if c != 10}) <= 1, (a, b, doc)  # one file per document
    # no target crosses a file: a file's last byte (its newline) predicts nothing
    assert torch.equal(fy == IGNORE, fx == 10)
    assert torch.equal(fy[fx != 10], fyb[fx != 10])


def test_stdlib_trainer_packs_documents(tmp_path):
    # the real-text trainer's --pack: a CPU run of a few steps on packed crops writes its report
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "train_stdlib_bytes.py"
    spec = importlib.util.spec_from_file_location("train_stdlib_bytes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "packed"
    rc = mod.main(["--tiny", "--pack", "--attention", "dilated", "--max-minutes", "0.01",
                   "--seq-len", "256", "--val-seqs", "1", "--out", str(out)])  # fmt: skip
    assert rc == 0
    rep = json.loads((tmp_path / "packed.json").read_text())
    assert rep["settings"]["pack"] is True
    run = rep["runs"][0]
    assert run["steps"] >= 1 and all(v == v for _, v in run["train_bpb_curve"])  # no NaN
    assert "packed" in (tmp_path / "packed.md").read_text()
