"""LongNetLM.generate: static KV cache, chunked prefill, decode path, rolling cache, CUDA graphs.

Judged against full forward passes without any cache (the model's own definition), across
several segment boundaries of every branch.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention.models import LongNetConfig, LongNetLM, longnet


def _model(dtype=torch.float64, device="cpu", **kw) -> LongNetLM:
    base = dict(
        vocab_size=50, dim=32, n_layer=2, n_head=4, n_kv_head=2, ffn_dim=48,
        segment_lengths=(8, 16, 32), dilation_rates=(1, 2, 4), impl="torch",
    )  # fmt: skip
    base.update(kw)
    return LongNetLM(LongNetConfig(**base)).to(device=device, dtype=dtype).eval()


def _manual_greedy(m, prompt, n):
    """Greedy decoding by full forward passes over the growing sequence (no cache)."""
    idx, logits = prompt, []
    for _ in range(n):
        lg, _ = m(idx)
        logits.append(lg[:, -1])
        idx = torch.cat([idx, lg[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx, logits


@pytest.mark.parametrize("prefill_chunk", [None, 5])
@pytest.mark.parametrize("kw", [{}, dict(head_assignment="split"), dict(segment_lengths=(6, 16), dilation_rates=(2, 3))])
def test_generate_equals_manual_loop(seed, prefill_chunk, kw):
    m = _model(**kw)
    prompt = torch.randint(0, 50, (2, 11))
    out, steps = m.generate(prompt, 30, temperature=0.0, return_logits=True, prefill_chunk=prefill_chunk)
    want, want_logits = _manual_greedy(m, prompt, 30)
    assert torch.equal(out, want) and not m.has_cache
    for got, ref in zip(steps, want_logits, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("prefill_chunk", [None, 7])
@pytest.mark.parametrize("kw", [{}, dict(segment_lengths=(6, 16), dilation_rates=(2, 3))])
def test_rolling_cache_equals_full_cache(seed, prefill_chunk, kw):
    # 150 positions: the ring buffer (lcm(w) - 1 + 64 slots) wraps, several segments of each branch
    m = _model(**kw)
    prompt = torch.randint(0, 50, (2, 40))
    full, lf = m.generate(prompt, 110, temperature=0.0, return_logits=True, prefill_chunk=prefill_chunk)
    roll, lr = m.generate(prompt, 110, temperature=0.0, return_logits=True, prefill_chunk=prefill_chunk, rolling=True)
    assert m.rolling_capacity(prefill_chunk or max(m.cfg.segment_lengths)) < 150
    assert torch.equal(full, roll)
    for a, b in zip(lf, lr, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_rolling_cache_memory_does_not_grow(seed, monkeypatch):
    sizes = []
    init = longnet.KVCache.__init__

    def spy(self, batch, capacity, *a, **kw):
        sizes.append(capacity)
        init(self, batch, capacity, *a, **kw)

    monkeypatch.setattr(longnet.KVCache, "__init__", spy)
    m = _model()
    prompt = torch.randint(0, 50, (1, 9))
    caps = {}
    for n in (5, 60, 300):
        sizes.clear()
        m.generate(prompt, n, temperature=0.0, rolling=True)
        caps[n] = set(sizes)
    assert caps[5] == caps[60] == caps[300] and len(caps[5]) == 1
    sizes.clear()
    m.generate(prompt, 300, temperature=0.0)
    assert sizes[0] == 309  # the full cache holds every position


def test_sampling_with_generator_is_reproducible(seed):
    m = _model()
    prompt = torch.randint(0, 50, (2, 5))
    outs = [
        m.generate(prompt, 12, temperature=0.9, top_k=7, generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    ]
    assert torch.equal(outs[0], outs[1]) and outs[0].shape == (2, 17) and outs[0].max() < 50


def test_generate_validates():
    m = _model()
    with pytest.raises(ValueError, match="decode must be"):
        m.generate(torch.zeros(1, 3, dtype=torch.long), 2, decode="fast")
    with pytest.raises(ValueError, match="needs a CUDA model"):
        m.generate(torch.zeros(1, 3, dtype=torch.long), 2, decode="graph")


def test_generate_compiled_step_on_cpu(seed, monkeypatch):
    # decode="compile" traces the decode step (custom op + fake) without graph breaks; on the CPU
    # with the aot_eager backend (inductor's C++ build is slow; the cuda test runs inductor)
    compile_ = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, mode=None, **kw: compile_(fn, backend="aot_eager", **kw)
    )
    m = _model(dtype=torch.float32)
    prompt = torch.randint(0, 50, (1, 6))
    got = m.generate(prompt, 4, temperature=0.0, decode="compile")
    want = m.generate(prompt, 4, temperature=0.0, decode="eager")
    assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("decode", ["graph", "compile"])
def test_cuda_generate_graph_equals_eager(seed, decode):
    m = _model(dtype=torch.float32, device="cuda", impl="auto", dim=128, n_head=4, n_kv_head=2)
    prompt = torch.randint(0, 50, (2, 100), device="cuda")
    got, lg = m.generate(prompt, 70, temperature=0.0, return_logits=True, decode=decode)
    want, lw = m.generate(prompt, 70, temperature=0.0, return_logits=True, decode="eager")
    assert torch.equal(got, want)
    for a, b in zip(lg, lw, strict=True):  # inductor may fuse the step's ops differently
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    ref, rl = _manual_greedy(m, prompt, 70)
    for a, b in zip(lg, rl, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sample_top_k_keeps_exactly_k_tokens(seed):
    # (a mutation keeping k + 1 tokens went unnoticed: 2026-11-30 audit)
    logits = torch.randn(64, 20, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    top3 = logits.topk(3).indices
    for _ in range(20):
        assert torch.equal(longnet._sample(logits, 1.0, 1, g), logits.argmax(-1, keepdim=True))
        assert (longnet._sample(logits, 5.0, 3, g) == top3).any(-1).all()


def test_sample_weights_are_softmax_of_logits_over_temperature(monkeypatch):
    seen = []
    real = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda p, num_samples, generator=None: seen.append(p)
                        or real(p, num_samples, generator=generator))  # fmt: skip
    logits = torch.tensor([[0.0, -1.0, -3.0], [2.0, 2.5, -1.0]])
    longnet._sample(logits, 0.5, None)
    torch.testing.assert_close(seen[0], torch.softmax(logits.double() / 0.5, -1))
    longnet._sample(logits, 2.0, 2)
    want = torch.softmax(torch.tensor([[0.0, -1.0, float("-inf")], [2.0, 2.5, float("-inf")]], dtype=torch.float64) / 2.0, -1)
    torch.testing.assert_close(seen[1], want)


def test_rolling_cache_with_prefill_chunks_over_64_rows(seed):
    # below 64-row chunks the decode rows' spare room hid a capacity one slot short (audit M06):
    # chunks of 65 with w (4, 8), a chunk starting 7 past a multiple of lcm(w) = 8
    m = _model(n_layer=1, segment_lengths=(4, 8), dilation_rates=(1, 2))
    assert m.rolling_capacity(65) == 8 - 1 + 65
    prompt = torch.randint(0, 50, (1, 65 * 8 + 5))
    full = m.generate(prompt, 3, temperature=0.0, prefill_chunk=65)
    roll = m.generate(prompt, 3, temperature=0.0, prefill_chunk=65, rolling=True)
    assert torch.equal(roll, full)


def test_generate_under_cpu_autocast(seed):
    # the cache was allocated in the parameters' dtype while autocast's projections gave bf16:
    # generate (and any cached forward) raised in the cache write. Now the cache takes the
    # autocast dtype; the first step's logits are the float32 ones to bf16 rounding
    m = _model(dtype=torch.float32)
    prompt = torch.randint(0, 50, (2, 11))
    _, ref = m.generate(prompt, 1, temperature=0.0, return_logits=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m.setup_cache(2, 16)
        assert m.layers[0].attn.kv_cache.k.dtype == torch.bfloat16
        m.clear_cache()
        out, got = m.generate(prompt, 4, temperature=0.0, return_logits=True)
    assert out.shape == (2, 15)
    scale = ref[0].abs().max().item()
    assert (got[0].float() - ref[0].float()).abs().max().item() <= 0.05 * scale
