"""transformers integration: a registered "dilated" attention with one branch w >= N, r = 1 is
exactly causal dense attention, so a Llama model's logits and greedy generations equal its own
"sdpa" ones (dynamic and static caches, left-padded batches); with real dilated branches a static
cache equals a dynamic one, each row of a left-padded batch equals that row alone, and packed
documents equal each document alone."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dilated_attention.integrations.hf import register_dilated_attention  # noqa: E402


def _llama(attn_implementation: str, num_kv_heads: int):
    cfg = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=128,
    )
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_llama_dense_branch_equals_sdpa(num_kv_heads):
    n = 45
    register_dilated_attention([64], [1], name="dilated_test_dense", impl="torch")
    ref = _llama("sdpa", num_kv_heads)
    model = _llama("dilated_test_dense", num_kv_heads)
    model.load_state_dict(ref.state_dict())
    assert model.config._attn_implementation == "dilated_test_dense"
    idx = torch.randint(0, 100, (2, n))
    with torch.no_grad():
        want = ref(idx).logits
        got = model(idx).logits
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_llama_generate_with_cache_and_dilated_branches():
    # real dilated branches + HF's KV cache: greedy decoding equals recomputation without cache
    register_dilated_attention([8, 16], [1, 2], name="dilated_test_branches", impl="torch")
    model = _llama("dilated_test_branches", 2)
    idx = torch.randint(0, 100, (1, 13))
    with torch.no_grad():
        out = model.generate(
            idx,
            max_new_tokens=6,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            eos_token_id=None,
        )
        out_nc = model.generate(
            idx,
            max_new_tokens=6,
            do_sample=False,
            use_cache=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert torch.equal(out, out_nc)


def test_register_validates():
    with pytest.raises(ValueError, match="larger than its segment"):
        register_dilated_attention([4], [8])


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_llama_generate_uses_decode_path_and_equals_manual_loop(num_kv_heads, monkeypatch):
    # HF's DynamicCache hands the attention function q (1 row) and the whole cached k, v: the
    # call goes to the decode path; greedy generate equals a loop of full forward passes
    import dilated_attention.decode as decode

    calls = []
    # the decode implementation: dilated_attention reaches it without the public entry point
    orig = decode._run
    monkeypatch.setattr(decode, "_run", lambda *a, **kw: calls.append(a[0].shape[1]) or orig(*a, **kw))
    register_dilated_attention([8, 16], [1, 2], name="dilated", impl="torch")
    model = _llama("dilated", num_kv_heads)
    torch.manual_seed(1)
    idx = torch.randint(0, 100, (2, 13))
    n_new = 20  # positions 13..32: several segment boundaries of both branches
    with torch.no_grad():
        out = model.generate(
            idx, max_new_tokens=n_new, do_sample=False, use_cache=True, pad_token_id=0,
            eos_token_id=None,
        )  # fmt: skip
        seq = idx
        for _ in range(n_new):
            logits = model(seq, use_cache=False).logits[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    # every decode step of every layer took the decode path with one query row
    assert calls.count(1) == (n_new - 1) * model.config.num_hidden_layers


# ------------------------------------------------------------------ exact generation (issue 22)

GEN = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def _llama_seeded(attn_implementation: str, seed: int):
    cfg = transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def _left_padded(batch: int, n: int, pads: list[int]):
    """(ids, attention_mask) of ``batch`` rows of n tokens, row b left-padded by pads[b]."""
    idx = torch.randint(1, 100, (batch, n))
    mask = torch.ones(batch, n, dtype=torch.long)
    for row, p in enumerate(pads):
        mask[row, :p] = 0
        idx[row, :p] = 0
    return idx, mask


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 3])
def test_generate_dense_branch_equals_sdpa(cache, batch, seed):
    # one branch w >= every length, r = 1: dilated attention is causal dense attention, so
    # greedy generation equals sdpa's token for token. Static caches hand over the whole
    # buffer (unfilled slots must never be attended); left-padded rows start at their first
    # real token.
    register_dilated_attention([64], [1], name="dilated_test_gen_dense", impl="torch")
    ref = _llama_seeded("sdpa", seed)
    model = _llama_seeded("dilated_test_gen_dense", seed)
    idx, mask = _left_padded(batch, 9, [0, 3, 5][:batch])
    kw = dict(GEN, max_new_tokens=10)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        want = ref.generate(idx, attention_mask=mask, **kw)
        got = model.generate(idx, attention_mask=mask, **kw)
    assert torch.equal(got, want)


def test_generate_left_padded_multi_branch_static_equals_dynamic_equals_alone(seed, monkeypatch):
    # real branches (segments 4 and 8, dilation 2): the generated tokens of a left-padded row
    # equal those of the row alone (its segments start at its first real token), with the
    # static cache equal to the dynamic one
    import dilated_attention.decode as decode

    calls = []
    orig = decode._run  # (q, k_cache, v_cache, cache_seqlens, cache_leftpad, ...)
    monkeypatch.setattr(
        decode, "_run", lambda *a, **kw: calls.append((*a[0].shape[:2], a[4] is not None)) or orig(*a, **kw)
    )
    register_dilated_attention([4, 8], [1, 2], name="dilated_test_gen_multi", impl="torch")
    model = _llama_seeded("dilated_test_gen_multi", seed)
    pads = [0, 3, 6]
    idx, mask = _left_padded(3, 10, pads)
    kw = dict(GEN, max_new_tokens=9)  # positions up to 18: several segment boundaries
    with torch.no_grad():
        dyn = model.generate(idx, attention_mask=mask, **kw)
        static = model.generate(idx, attention_mask=mask, cache_implementation="static", **kw)
        assert torch.equal(static, dyn)
        # the decode steps of the padded batch ran as one decode call per layer (3 rows, 1 query)
        # reading the cache in place (cache_leftpad = each row's first real slot)
        assert calls.count((3, 1, True)) == 2 * (kw["max_new_tokens"] - 1) * model.config.num_hidden_layers
        for row, p in enumerate(pads):
            alone = model.generate(idx[row : row + 1, p:], **kw)
            assert torch.equal(dyn[row, p:], alone[0]), f"row {row} (left pad {p})"
            alone_static = model.generate(idx[row : row + 1, p:], cache_implementation="static", **kw)
            assert torch.equal(alone_static, alone), f"row {row} alone, static cache"


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_logits_and_grads_equal_row_alone(side, seed):
    # one forward pass of a padded batch: the logits of each row's real tokens equal the row
    # alone, and so do the gradients of a loss on them (training with a padding mask)
    register_dilated_attention([4, 8], [1, 2], name="dilated_test_pad_logits", impl="torch")
    model = _llama_seeded("dilated_test_pad_logits", seed)
    pads = [0, 2, 7]
    idx, mask = _left_padded(3, 19, pads)
    if side == "right":
        idx, mask = idx.flip(1), mask.flip(1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    w = torch.randn(3, 19, 100, dtype=torch.float64) * mask[..., None]
    got = model(idx, attention_mask=mask, position_ids=pos).logits
    grads = torch.autograd.grad((got * w).sum(), list(model.parameters()))
    want_loss = 0.0
    for row, p in enumerate(pads):
        real = slice(p, None) if side == "left" else slice(0, 19 - p)
        want = model(idx[row : row + 1, real]).logits[0]
        torch.testing.assert_close(got[row, real], want, rtol=1e-9, atol=1e-9)
        want_loss = want_loss + (want * w[row, real]).sum()
    want_g = torch.autograd.grad(want_loss, list(model.parameters()))
    for g, wg in zip(grads, want_g, strict=True):
        torch.testing.assert_close(g, wg, rtol=1e-8, atol=1e-9)


def _packed(lengths):
    ids = torch.randint(1, 100, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, pos, cu


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_packed_logits_equal_each_document_alone(how, seed, monkeypatch):
    # documents packed in one row (DataCollatorWithFlattening): position_ids restart at 0, or
    # the flash-attention keyword arguments give the offsets; no document sees another
    import dilated_attention.integrations.hf as hf

    seen = []
    orig = hf.dilated_attention_varlen
    monkeypatch.setattr(
        hf, "dilated_attention_varlen", lambda *a, **kw: seen.append(a[3].tolist()) or orig(*a, **kw)
    )
    register_dilated_attention([4, 8], [1, 2], name="dilated_test_packed", impl="torch")
    model = _llama_seeded("dilated_test_packed", seed)
    lengths = [7, 1, 13, 5]
    ids, pos, cu = _packed(lengths)
    kw = {}
    if how == "cu_seq_lens":
        kw = dict(
            cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths)
        )
    with torch.no_grad():
        got = model(ids, position_ids=pos, **kw).logits[0]
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            want = model(ids[:, a:b]).logits[0]
            torch.testing.assert_close(got[a:b], want, rtol=1e-9, atol=1e-9)
    assert seen and all(c == cu.tolist() for c in seen)  # the documents went to the varlen path


def test_mask_with_hole_raises():
    from dilated_attention.integrations.hf import make_attention_function

    fn = make_attention_function([4], [1], impl="torch")
    q = torch.randn(1, 2, 5, 8)
    mask = torch.tensor([[1, 0, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="padding between real tokens"):
        fn(torch.nn.Module(), q, q, q, mask)


def test_beam_search_and_assisted_decoding_are_exact():
    """Beam search (HF reorders the cache between steps) and assisted decoding (a drafter's
    tokens checked several rows at a time against the cache, rejected ones rolled back): with one
    dense branch beam search equals sdpa's; with real dilated branches beam search with the cache
    equals it without, and assisted greedy decoding equals plain greedy decoding, token for token."""
    register_dilated_attention([64], [1], name="dilated_test_dense", impl="torch")
    register_dilated_attention([8, 16], [1, 2], name="dilated_test_branches", impl="torch")
    ref = _llama("sdpa", 2)
    dense = _llama("dilated_test_dense", 2)
    branches = _llama("dilated_test_branches", 2)
    dense.load_state_dict(ref.state_dict())
    branches.load_state_dict(ref.state_dict())
    drafter = _llama("sdpa", 4)  # other weights: some drafts are rejected
    torch.manual_seed(1)
    idx = torch.randint(1, 100, (1, 14))
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        beams = dense.generate(idx, max_new_tokens=6, num_beams=3, **kw)
        assert torch.equal(beams, ref.generate(idx, max_new_tokens=6, num_beams=3, **kw))
        beams = branches.generate(idx, max_new_tokens=6, num_beams=3, **kw)
        assert torch.equal(beams, branches.generate(idx, max_new_tokens=6, num_beams=3, use_cache=False, **kw))
        greedy = branches.generate(idx, max_new_tokens=20, **kw)
        assert torch.equal(greedy, branches.generate(idx, max_new_tokens=20, assistant_model=drafter, **kw))


class _Layer(torch.nn.Module):
    """An attention module as the function sees it: ``config``, ``layer_idx``, maybe a window."""

    def __init__(self, **config):
        super().__init__()
        self.config = type("Cfg", (), config)()
        self.layer_idx = 0
        self.is_causal = True


@pytest.mark.parametrize("layer, kwargs, v_dim, match", [
    (_Layer(), dict(s_aux=torch.zeros(4)), 8, "passes s_aux="),  # GPT-OSS's attention sinks
    (_Layer(), dict(sinks=torch.zeros(4)), 8, "passes sinks="),
    (_Layer(), dict(position_bias=torch.zeros(1, 4, 6, 6)), 8, "passes position_bias="),  # T5
    (_Layer(), dict(some_future_bias=torch.zeros(3)), 8, "passes some_future_bias="),
    (_Layer(layer_types=["sliding_attention"], sliding_window=4), {}, 8, "layer 0 is 'sliding_attention'"),
    (_Layer(layer_types=["chunked_attention"], attention_chunk_size=4), {}, 8, "layer 0 is 'chunked_attention'"),
    (_Layer(sliding_window=4), {}, 8, "config.sliding_window=4"),  # PhiMoE: no layer types
    (_Layer(attention_chunk_size=4), {}, 8, "config.attention_chunk_size=4"),
    (_Layer(), {}, 4, "value head size 4 != query/key head size 8"),  # DeepSeek-V3's MLA
])  # fmt: skip
def test_attention_the_function_cannot_compute_is_refused(layer, kwargs, v_dim, match):
    """What a model means by its attention beyond q, k, v and the padding mask (sinks, a relative
    position bias, a window that only its mask holds, another value head size) raises: it was
    dropped, a silently other model (GPT-OSS, T5, Qwen2-MoE / PhiMoE / Llama 4 windows)."""
    fn = register_dilated_attention([8], [1], name="dilated_test_refuse", impl="torch")
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    v = torch.randn(1, 2, 6, v_dim)
    with pytest.raises(ValueError, match=match):
        fn(layer, q, k, v, None, **kwargs)
    # the same layer without what it refuses runs: full-attention layer types, windows unset,
    # Qwen2's sliding_window with use_sliding_window False, position tensors
    ok = [_Layer(layer_types=["full_attention"], sliding_window=4), _Layer(sliding_window=4096, use_sliding_window=False)]
    for fine in ok:
        out, _ = fn(fine, q, k, torch.randn(1, 2, 6, 8), None, position_ids=torch.arange(6)[None])
        assert out.shape == (1, 6, 4, 8)


def test_t5_relative_position_bias_is_refused():
    """A real model through transformers: T5 hands its relative position bias to the attention
    function, which dropped it (logits off by 0.15 against sdpa with one dense branch)."""
    register_dilated_attention([64], [1], name="dilated_test_t5", impl="torch")
    cfg = transformers.T5Config(vocab_size=50, d_model=32, d_kv=8, d_ff=32, num_layers=1,
                                num_decoder_layers=1, num_heads=4, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    cfg._attn_implementation = "dilated_test_t5"
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    ids = torch.randint(1, 50, (1, 9))
    with torch.no_grad(), pytest.raises(ValueError, match="passes position_bias="):
        model(input_ids=ids, decoder_input_ids=ids[:, :4])


_FAMILY = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
FAMILIES = {  # (model class, config class, extra config): families beyond Llama, GQA where they have it
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=24)),  # head_dim != hidden / heads
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(head_dim=24)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(pad_token_id=0)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(num_key_value_heads=None, rotary_pct=0.5)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_dense_branch_equals_sdpa(family):
    """One dense branch is each family's own sdpa attention, on a left-padded batch (the real
    rows' logits)."""
    model_cls, cfg_cls, extra = FAMILIES[family]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"this transformers has no {model_cls}")
    register_dilated_attention([4096], [1], name="dilated_test_families", impl="torch")
    kw = {**_FAMILY, **extra}
    kw = {k: v for k, v in kw.items() if v is not None or k == "sliding_window"}
    models = []
    for impl in ("sdpa", "dilated_test_families"):
        cfg = getattr(transformers, cfg_cls)(**kw)
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        models.append(getattr(transformers, model_cls)(cfg).double().eval())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (2, 19), generator=g)
    mask = torch.ones(2, 19, dtype=torch.long)
    mask[1, :5], ids[1, :5] = 0, 0  # left padding on row 1
    assert models[1].config._attn_implementation == "dilated_test_families"
    with torch.no_grad():
        want, got = (m(input_ids=ids, attention_mask=mask).logits for m in models)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-9, atol=1e-9)


def _paligemma(attn_implementation: str):
    tc = transformers.GemmaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    vc = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    cfg = transformers.PaliGemmaConfig(text_config=tc.to_dict(), vision_config=vc.to_dict(), image_token_index=299,
                                       projection_dim=64)  # fmt: skip
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return transformers.PaliGemmaForConditionalGeneration(cfg).double().eval()


def test_paligemma_prefix_lm_is_refused_and_causal_use_is_exact():
    """PaliGemma's token_type_ids make its prefix (image and prompt) bidirectional: that mask was
    dropped, a silently other model (logits off by 0.018 in float32). The registered mask function
    now refuses it; the same model without token_type_ids (causal) equals its sdpa attention."""
    pytest.importorskip("transformers.models.paligemma")
    register_dilated_attention([4096], [1], name="dilated_test_pg", impl="torch")
    ref, model = _paligemma("sdpa"), _paligemma("dilated_test_pg")
    model.load_state_dict(ref.state_dict())
    ids = torch.cat([torch.full((1, 16), 299), torch.randint(0, 290, (1, 12))], 1)
    pix = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    tt = torch.zeros_like(ids)
    tt[:, 22:] = 1  # prefix: 16 image tokens and 6 prompt tokens; suffix: 6 tokens
    with torch.no_grad():
        with pytest.raises(ValueError, match="attend later ones and not others"):
            model(input_ids=ids, pixel_values=pix, token_type_ids=tt)
        torch.testing.assert_close(model(input_ids=ids, pixel_values=pix).logits,
                                   ref(input_ids=ids, pixel_values=pix).logits, rtol=1e-9, atol=1e-9)  # fmt: skip


def test_mask_function_check_on_its_own():
    from dilated_attention.integrations.hf import _mask_function_problem

    q = torch.arange(0, 10)

    def causal(b, h, qi, ki):
        return ki <= qi

    blocks = torch.tensor([[0, 0, 0, 1, 1, -1, -1, -1, -1, -1, -1], [-1] * 11])

    def prefix(b, h, qi, ki):  # PaliGemma's overlay: same non-negative block id
        return causal(b, h, qi, ki) | ((blocks[b, qi] == blocks[b, ki]) & (blocks[b, qi] >= 0))

    assert _mask_function_problem(2, q, 11, 0, causal) is None
    assert _mask_function_problem(2, q, 11, 0, lambda *a: torch.tensor(True)) is None  # bidirectional
    assert "later ones" in _mask_function_problem(2, q, 11, 0, prefix)
    assert _mask_function_problem(2, q[-1:], 11, 0, prefix) is None  # the last row: no later key
    # only the second row's pairs are shown: causal there
    assert _mask_function_problem(1, q, 11, 0, lambda b, h, qi, ki: prefix(b + 1, h, qi, ki)) is None


@pytest.mark.parametrize("dtype", [torch.bool, torch.float64])
def test_4d_mask_causal_with_padding_is_read_and_others_are_refused(dtype, seed):
    """A 4-D mask handed to the model as is (transformers passes it through): a causal mask
    with left padding gives the 2-D mask's logits; a prefix-LM mask, a window, or masks that
    differ per head raise instead of being reduced to their last row."""
    register_dilated_attention([4, 8], [1, 2], name="dilated_test_4d", impl="torch")
    model = _llama_seeded("dilated_test_4d", seed)
    pads = [0, 3]
    idx, mask = _left_padded(2, 11, pads)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = mask.bool()
    causal = torch.ones(11, 11, dtype=torch.bool).tril()
    allowed = (keep[:, None, :] & causal[None])[:, None]  # (B, 1, N, N)

    def as_mask(a):
        if dtype == torch.bool:
            return a
        return torch.zeros(a.shape, dtype=dtype).masked_fill(~a, torch.finfo(dtype).min)

    with torch.no_grad():
        want = model(idx, attention_mask=mask, position_ids=pos).logits
        got = model(idx, attention_mask=as_mask(allowed), position_ids=pos).logits
        for row, p in enumerate(pads):
            torch.testing.assert_close(got[row, p:], want[row, p:], rtol=1e-9, atol=1e-9)
        prefix = allowed.clone()
        prefix[:, :, 3:6, 3:6] = keep[:, None, None, 3:6]  # a bidirectional prefix in row 0
        window = allowed & torch.ones(11, 11, dtype=torch.bool).triu(-3)  # a window of 4
        for bad in (prefix, window):
            with pytest.raises(ValueError, match="4-D attention_mask is not a causal mask"):
                model(idx, attention_mask=as_mask(bad), position_ids=pos)
        heads = allowed.expand(2, 4, 11, 11).clone()
        heads[:, 1] = window[:, 0]
        with pytest.raises(ValueError, match="differs between heads"):
            model(idx, attention_mask=as_mask(heads), position_ids=pos)


def _hf_qkv(nq=8, nk=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, nq, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, nk, 8, dtype=torch.float64, generator=g) for _ in range(2))
    return q, k, v


def test_module_without_is_causal_attends_causally():
    # a decoder module with no is_causal attribute and no is_causal argument: causal (audit H06)
    from dilated_attention import dilated_attention
    from dilated_attention.integrations.hf import make_attention_function

    fn = make_attention_function([4, 8], [1, 2], impl="torch")
    q, k, v = _hf_qkv()
    got, _ = fn(torch.nn.Module().eval(), q, k, v, None)
    want = dilated_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), [4, 8], [1, 2],
                             causal=True, impl="reference")  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_left_padded_decode_step_with_an_all_padding_row_gives_zeros():
    # one row all padding in a left-padded decode step: zeros there (audit H07: it attended
    # over the padding), the other row as the row alone
    from dilated_attention.integrations.hf import make_attention_function

    fn = make_attention_function([4, 8], [1, 2], impl="torch")
    q, k, v = _hf_qkv(nq=1)
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[0, :2] = False
    keep[1, :] = False
    m = torch.nn.Module().eval()
    m.is_causal = True
    with torch.no_grad():
        out, _ = fn(m, q, k, v, keep)
        alone, _ = fn(m, q[:1], k[:1, :, 2:], v[:1, :, 2:], None)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[:1], alone, rtol=1e-12, atol=1e-12)


def test_mask_function_check_falls_back_to_vmap():
    # a mask function that cannot take broadcast index tensors (chained indexing) is evaluated
    # per pair by vmap, as transformers does for such functions
    from dilated_attention.integrations.hf import _mask_function_problem

    blocks = torch.tensor([[0, 0, 1, 1, 2, 3], [5, 6, 7, 8, 9, 10]])

    def same_block(b, h, qi, ki):
        return (ki <= qi) | (blocks[b][qi] == blocks[b][ki])

    with pytest.raises(IndexError):  # the broadcast form indeed fails
        same_block(torch.arange(2)[:, None], 0, torch.arange(5)[None, :], torch.arange(1, 6)[None, :])
    assert "later ones" in _mask_function_problem(2, torch.arange(6), 6, 0, same_block)
    assert _mask_function_problem(1, torch.arange(6), 6, 0, lambda b, h, qi, ki: same_block(b + 1, h, qi, ki)) is None
