"""transformers integration: a registered "dilated" attention with one branch w >= N, r = 1 is
exactly causal dense attention, so a Llama model's logits equal its own "sdpa" logits."""

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
