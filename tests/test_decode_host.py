"""The eager decode step's host-side shortcuts (issue 23 item 6) compute exactly what the
per-layer code computes.

A decode step of :class:`LongNetLM` computes once per step, for all layers, what each layer used
to compute for itself (the cache slots ``pos % capacity`` and the int32 cache lengths:
``DecodeIndex``), takes a 0-dim position as its own (1,) position vector (no ``arange``), skips
the identity dropout calls in eval mode, and rotates with the fused kernel without the
``autograd.Function`` when nothing needs a gradient. Each test compares against the per-layer /
previous computation bit for bit (``torch.equal``), over dtype x GQA x cache lengths that cross
the segment boundaries of every branch.
"""

from __future__ import annotations

import os

import pytest
import torch

from dilated_attention import flags
from dilated_attention.models import longnet as ln
from dilated_attention.models.longnet import LongNetConfig, LongNetLM

DTYPES = [torch.float32, torch.bfloat16]


def _model(dtype, kv, seed=0, **over):
    cfg = LongNetConfig.preset("tiny", n_kv_head=kv, **over)
    torch.manual_seed(seed)
    return LongNetLM(cfg).to(dtype).eval()


def _per_layer_step(model, tok, pos):
    """The previous decode step: every layer builds its own rotary table and its own cache
    slots and lengths (``rope=None``, ``step=None``), positions ``pos + arange(1)``, dropout
    modules called."""
    p = pos + torch.arange(tok.shape[1])
    x = model.emb_dropout(model.tok_emb(tok))
    for layer in model.layers:
        a = layer.attn
        h = layer.attn_norm(x)
        b, t, e = h.shape
        q = a.q_proj(h).view(b, t, a.n_head, a.head_dim)
        k = a.k_proj(h).view(b, t, a.n_kv_head, a.head_dim)
        v = a.v_proj(h).view(b, t, a.n_kv_head, a.head_dim)
        q, k = a.rotary.rotate(q, k, a.rotary.table(p, q.dtype))
        a.kv_cache.write(p, k, v)
        seqlens = (p[-1:] + 1).to(torch.int32).expand(b).contiguous()
        y = a.attention.decode(q, a.kv_cache.k, a.kv_cache.v, seqlens, is_causal=a.causal)
        x = x + layer.dropout(a.out_proj(a.norm(y.reshape(b, t, e))))
        f = layer.ffn
        x = x + layer.dropout(f.fc2(f.norm(f.dropout(torch.nn.functional.gelu(f.fc1(layer.ffn_norm(x)))))))
    return model.lm_head(model.norm(x)[:, -1])


def _caches(model):
    return [(lay.attn.kv_cache.k.clone(), lay.attn.kv_cache.v.clone()) for lay in model.layers]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv", [None, 2, 1])
@pytest.mark.parametrize("rolling", [False, True])
@torch.no_grad()
def test_decode_step_equals_per_layer_step(dtype, kv, rolling):
    """generate's eager step (model._decode_step) against the per-layer step on a second copy of
    the model, token by token from position 27 to 160 (the tiny preset's segments 32, 128, 256:
    every step's logits and the whole caches bit for bit."""
    m1, m2 = _model(dtype, kv), _model(dtype, kv)
    b, t, n = 2, 27, 133
    cap = m1.rolling_capacity(16) if rolling else t + n + 1
    for m in (m1, m2):
        m.setup_cache(b, cap)
    torch.manual_seed(1)
    prompt = torch.randint(0, m1.cfg.vocab_size, (b, t))
    for c0 in range(0, t, 16):
        last1 = m1._hidden_last(prompt[:, c0 : c0 + 16], c0)
        last2 = m2._hidden_last(prompt[:, c0 : c0 + 16], c0)
    assert torch.equal(last1, last2)
    step = m1._decode_step(b, t, "eager")
    for s in range(n):
        tok = last1.argmax(-1, keepdim=True)
        last1 = step(tok, t + s)
        last2 = _per_layer_step(m2, tok, torch.tensor(t + s))
        assert torch.equal(last1, last2), f"step {s} (position {t + s})"
    for (k1, v1), (k2, v2) in zip(_caches(m1), _caches(m2), strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv", [None, 2])
@torch.no_grad()
def test_decode_logits_match_full_forward(dtype, kv):
    """Each eager decode step's logits equal the full forward's last-position logits (to
    rounding: another attention path) across the segment boundaries 32 and 128."""
    m = _model(dtype, kv)
    torch.manual_seed(2)
    prompt = torch.randint(0, m.cfg.vocab_size, (1, 30))
    idx, steps = m.generate(prompt, 110, temperature=0.0, return_logits=True, decode="eager")
    tol = 6e-2 if dtype == torch.bfloat16 else 1e-4
    for s in (1, 2, 3, 98, 99, 100, 109):  # positions 31..33 (first boundary), 128..130, 139
        full, _ = m(idx[:, : 30 + s])
        torch.testing.assert_close(steps[s].float(), full[:, -1].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_rotary_positions_one_token(dtype):
    """A 0-dim start position of one token gives the (1,) int64 vector start + arange(1)."""
    start = torch.tensor(4097, dtype=dtype)
    got = ln.rotary_positions(start, 1, start.device)
    want = start + torch.arange(1)
    assert got.dtype == torch.int64 and got.shape == (1,) and torch.equal(got, want.to(torch.int64))
    assert torch.equal(ln.rotary_positions(start, 3, start.device), start + torch.arange(3))


def test_decode_index_values():
    """DecodeIndex: the slots and int32 lengths the per-layer code computed, once per key."""
    pos = torch.tensor([300])
    d = ln.DecodeIndex(pos)
    assert torch.equal(d.slots(128), pos % 128) and d.slots(128) is d.slots(128)
    assert torch.equal(d.slots(1000), pos % 1000)
    lens = d.seqlens(3)
    assert lens.dtype == torch.int32 and lens.is_contiguous() and lens.tolist() == [301] * 3
    assert d.seqlens(3) is lens


@torch.no_grad()
def test_attention_without_step_builds_its_own():
    """Attention.forward called alone while decoding (step None) gives what the model's step
    gives (the per-layer fallback)."""
    m1, m2 = _model(torch.float32, 2), _model(torch.float32, 2)
    for m in (m1, m2):
        m.setup_cache(1, 64)
        m._hidden_last(torch.arange(10)[None], 0)
    x = torch.randn(1, 1, m1.cfg.dim)
    pos = torch.tensor(10)
    a1, a2 = m1.layers[0].attn, m2.layers[0].attn
    y1 = a1(x, pos)
    y2 = a2(x, pos, None, None, ln.DecodeIndex(ln.rotary_positions(pos, 1, x.device)))
    assert torch.equal(y1, y2)


def test_dropout_still_applies_in_training():
    """Training mode keeps the dropout calls (the eval shortcut is only for eval)."""
    m = _model(torch.float32, None, dropout=0.5)
    m.train()
    idx = torch.randint(0, m.cfg.vocab_size, (1, 16))
    torch.manual_seed(3)
    a, _ = m(idx)
    torch.manual_seed(4)
    b, _ = m(idx)
    assert not torch.equal(a, b)  # different dropout masks
    m.eval()
    c, _ = m(idx)
    d, _ = m(idx)
    assert torch.equal(c, d)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_fused_no_grad_equals_function(dtype):
    """rotary_fused without a gradient to record (the Function skipped) gives the Function's
    bits; with one it still records the Function (a backward exists)."""
    from dilated_attention.kernels.triton_rotary import _RotaryFunction, rotary_fused

    torch.manual_seed(5)
    q = torch.randn(2, 3, 4, 16).to(dtype)
    k = torch.randn(2, 3, 2, 16).to(dtype)
    rot = ln.Rotary(16)
    tab = rot.table(torch.arange(100, 103), dtype)
    args = (tab.cos_q, tab.sin_q, tab.cos_k, tab.sin_k)
    with torch.no_grad():
        fast = rotary_fused(q, k, *args)
        ref = _RotaryFunction.apply(q, k, *args, False)
    assert all(torch.equal(x, y) for x, y in zip(fast, ref, strict=True))
    plain = rotary_fused(q, k, *args)  # grad enabled but nothing requires it
    assert all(torch.equal(x, y) and not x.requires_grad for x, y in zip(plain, ref, strict=True))
    qg = q.clone().requires_grad_()
    qo, ko = rotary_fused(qg, k, *args)
    assert qo.grad_fn is not None and torch.equal(qo.detach(), ref[0])
    qo.float().sum().backward()
    assert qg.grad is not None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("kv", [None, 2])
@torch.no_grad()
def test_decode_step_fused_rotary_equals_per_layer_step(kv):
    """The same comparison as above with the fused rotary kernel (interpreter) in both."""
    flags.set_fused_rotary(True)
    try:
        m1, m2 = _model(torch.bfloat16, kv), _model(torch.bfloat16, kv)
        b, t, n = 1, 30, 5
        for m in (m1, m2):
            m.setup_cache(b, t + n + 1)
        prompt = torch.randint(0, m1.cfg.vocab_size, (b, t))
        last1, last2 = m1._hidden_last(prompt, 0), m2._hidden_last(prompt, 0)
        step = m1._decode_step(b, t, "eager")
        for s in range(n):
            tok = last1.argmax(-1, keepdim=True)
            last1 = step(tok, t + s)
            last2 = _per_layer_step(m2, tok, torch.tensor(t + s))
            assert torch.equal(last1, last2)
        # the step's rotation writes the caches itself (rotary_into_cache): the same rows
        for (k1, v1), (k2, v2) in zip(_caches(m1), _caches(m2), strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    finally:
        flags.set_fused_rotary(None)


def _qkv_fused(attn) -> bool:
    """Whether the layer's decode steps took the one q/k/v GEMM (its concatenated weight kept on
    the KV cache)."""
    got = attn.kv_cache.qkv
    return got is not None and got[1] is not None


def _decode_run(model, prompt, n, edit=None, after_prefill=None):
    """Prefill ``prompt``, then ``n`` eager decode steps of fixed tokens (the same in every run:
    a greedy choice could differ between runs at a rounding tie); ``edit(model)`` after the
    first step (``after_prefill(model)`` before the first). The logits of every step."""
    b, t = prompt.shape
    model.setup_cache(b, t + n + 1)
    last = model._hidden_last(prompt, 0)
    if after_prefill is not None:
        after_prefill(model)
    step = model._decode_step(b, t, "eager")
    out = []
    toks = (torch.arange(b * n, device=prompt.device).reshape(b, n) * 7 + 3) % model.cfg.vocab_size
    for s in range(n):
        last = step(toks[:, s : s + 1], t + s)
        out.append(last.clone())
        if s == 0 and edit is not None:
            edit(model)
    return out


@pytest.mark.parametrize("kv", [None, 1])
@torch.no_grad()
def test_decode_qkv_is_one_gemm_that_follows_the_weights(kv, monkeypatch):
    """A decode step computes q, k and v with one GEMM over the concatenated weights (kept on the
    layer's KV cache) and makes the concatenation again when a weight changes in place (an
    optimiser step), is replaced (``.data =``) or a bias changes: each step's logits match the
    three-GEMM path (FUSED_QKV_MAX_BYTES = 0) run the same way."""
    torch.manual_seed(3)
    prompt = torch.randint(0, LongNetConfig.preset("tiny").vocab_size, (2, 21))

    def edit(m):
        a0, a1 = m.layers[0].attn, m.layers[-1].attn
        a0.k_proj.weight.mul_(1.5)  # in place: same tensor, same storage, new version
        a1.v_proj.weight.data = a1.v_proj.weight.data * -1.0  # another storage
        a1.q_proj.bias.add_(0.25)

    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(ln, "FUSED_QKV_MAX_BYTES", 8 * 2**20 if fused else 0)
        m = _model(torch.float32, kv)
        runs[fused] = _decode_run(m, prompt, 6, edit)
        took = [_qkv_fused(lay.attn) for lay in m.layers]
        assert all(took) if fused else not any(took)
    ref = _decode_run(_model(torch.float32, kv), prompt, 6)  # no edit: the edits must show
    assert (runs[True][-1] - ref[-1]).abs().max() > 1e-3
    for a, c in zip(runs[True], runs[False], strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_decode_qkv_not_fused_in_grad_mode():
    """In grad mode (a frozen model: decoding itself is inference only) a decode step keeps the
    three Linears: a concatenation made there would be recorded by autograd and kept with the
    cache. Its logits match the fused step's."""
    m = _model(torch.float32, None).requires_grad_(False)
    torch.manual_seed(4)
    prompt = torch.randint(0, m.cfg.vocab_size, (1, 9))
    out = {}
    for grad in (True, False):
        with torch.no_grad():
            m.setup_cache(1, 16)
            m._hidden_last(prompt, 0)
        with torch.set_grad_enabled(grad):
            out[grad] = m._hidden_last(prompt[:, :1], torch.full((), 9, dtype=torch.long))
        assert _qkv_fused(m.layers[0].attn) != grad
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", [None, 1])
def test_decode_of_a_model_made_under_inference_mode(kv):
    """A model built and loaded under ``torch.inference_mode`` (its weights are inference
    tensors: no version counter to key the q/k/v concatenation on) decodes with the three
    Linears, and its logits equal those of the same weights as ordinary tensors (fused), step
    for step; ``generate`` there gives the same tokens (it raised before)."""
    m = _model(torch.float32, kv)
    with torch.inference_mode():
        mi = LongNetLM(m.cfg).eval()
        mi.load_state_dict(m.state_dict())
    assert mi.layers[0].attn.q_proj.weight.is_inference()
    torch.manual_seed(5)
    prompt = torch.randint(0, m.cfg.vocab_size, (2, 13))
    with torch.no_grad():
        ref = _decode_run(m, prompt, 5)
        assert _qkv_fused(m.layers[0].attn)
    with torch.inference_mode():
        got = _decode_run(mi, prompt, 5)
        assert mi.layers[0].attn.kv_cache.qkv is None or not _qkv_fused(mi.layers[0].attn)
        toks = mi.generate(prompt, max_new_tokens=6, temperature=0)
    for a, c in zip(got, ref, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(toks, m.generate(prompt, max_new_tokens=6, temperature=0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv", [None, 2])
@torch.no_grad()
def test_decode_step_fused_norms_match_the_blocks(dtype, kv, monkeypatch):
    """With the LayerNorm kernels on (the default on CUDA; here the interpreter) a decode step
    runs ``_decode_layers``: each residual add fused into the next LayerNorm and the FFN's GELU
    into its sub-LayerNorm, 3 launches per layer. Every step's logits match the blocks' own
    forward (switch off) to rounding, across the segment boundaries."""
    from dilated_attention.kernels import triton_layernorm as tln

    if tln.unavailable_reason(torch.zeros(1, 8), True) is not None or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter")
    calls = []
    real = tln._prologue_ln
    monkeypatch.setattr(tln, "_prologue_ln", lambda *a: calls.append(a[-1]) or real(*a))
    torch.manual_seed(5)
    prompt = torch.randint(0, LongNetConfig.preset("tiny").vocab_size, (2, 29))
    runs = {}
    for on in (True, False):
        flags.set_triton_layernorm(on)
        try:
            m = _model(dtype, kv)
            runs[on] = _decode_run(m, prompt, 6)
        finally:
            flags.set_triton_layernorm(None)
    n_layer = m.cfg.n_layer
    assert calls.count(False) == 2 * n_layer * 6 and calls.count(True) == n_layer * 6  # add, gelu
    for a, c in zip(runs[True], runs[False], strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
        else:  # the interpreter truncates to bf16 where the GPU rounds: a few ulps per layer
            assert (a.float() - c.float()).norm() <= 3e-2 * c.float().norm()


@pytest.mark.cuda
@pytest.mark.parametrize("kv", [None, 2])
@torch.no_grad()
def test_cuda_decode_fusions_match_the_blocks(kv, monkeypatch):
    """On CUDA by default (switch "auto") a decode step takes one q/k/v GEMM and the fused norms;
    its logits, bf16, against the same steps with both off (FUSED_QKV_MAX_BYTES = 0, the
    LayerNorm switch off), the preset's structure with wider heads, across segment boundaries."""
    from dilated_attention.kernels import triton_layernorm as tln

    calls = []
    real = tln._prologue_ln
    monkeypatch.setattr(tln, "_prologue_ln", lambda *a: calls.append(a[-1]) or real(*a))
    cfg = LongNetConfig.preset("tiny", n_kv_head=kv)
    torch.manual_seed(6)
    prompt = torch.randint(0, cfg.vocab_size, (2, 29), device="cuda")
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(ln, "FUSED_QKV_MAX_BYTES", 8 * 2**20 if on else 0)
        flags.set_triton_layernorm(None if on else False)
        try:
            torch.manual_seed(0)
            m = LongNetLM(cfg).to("cuda", torch.bfloat16).eval()
            runs[on] = _decode_run(m, prompt, 40)
            assert _qkv_fused(m.layers[0].attn) == on
        finally:
            flags.set_triton_layernorm(None)
    assert calls.count(True) == cfg.n_layer * 40
    for a, c in zip(runs[True], runs[False], strict=True):
        assert (a.float() - c.float()).norm() <= 2e-2 * c.float().norm()


@pytest.mark.parametrize("where", ["q_proj", "v_proj_wrapped", "block", "ffn_norm", "global"])
@torch.no_grad()
def test_decode_fusions_keep_hooks_and_wrappers(where, monkeypatch):
    """A forward hook (on a projection, a block, a LayerNorm, or global) or a projection wrapped
    by an adapter still acts in a decode step: the fusion that would bypass that module's forward
    is not taken, and the step's logits show the hook's change."""
    from torch.nn.modules import module as modmod

    handles = []
    flags.set_triton_layernorm(True)  # the fused norms in the interpreter, as on CUDA
    try:
        torch.manual_seed(7)
        prompt = torch.randint(0, LongNetConfig.preset("tiny").vocab_size, (1, 13))
        plain = _decode_run(_model(torch.float32, None), prompt, 3)
        m = _model(torch.float32, None)
        a = m.layers[1].attn

        def tilt(t):  # not a shift or a scale: a LayerNorm after it would undo those
            return t + torch.linspace(-1.0, 1.0, t.shape[-1])

        def bump(mod, inp, out):
            return tilt(out)

        def hook(m):  # after the prefill: only the decode steps can show the hook
            a = m.layers[1].attn
            if where == "q_proj":
                handles.append(a.q_proj.register_forward_hook(bump))
            elif where == "v_proj_wrapped":

                class Adapter(torch.nn.Linear):  # a subclass that changes its output (LoRA-like)
                    def forward(self, x):
                        return tilt(super().forward(x))

                new = Adapter(a.v_proj.in_features, a.v_proj.out_features)
                new.load_state_dict(a.v_proj.state_dict())
                a.v_proj = new
            elif where == "block":
                handles.append(m.layers[0].register_forward_hook(bump))
            elif where == "ffn_norm":
                handles.append(m.layers[0].ffn_norm.register_forward_hook(bump))
            else:
                handles.append(torch.nn.modules.module.register_module_forward_hook(
                    lambda mod, inp, out: tilt(out) if mod is m.layers[0].ffn_norm else None
                ))  # fmt: skip

        hooked = _decode_run(m, prompt, 3, after_prefill=hook)
    finally:
        for h in handles:
            h.remove()
        flags.set_triton_layernorm(None)
    assert not modmod._global_forward_hooks
    for h, p in zip(hooked, plain, strict=True):
        assert (h - p).abs().max() > 1e-3  # the hook's change reached the logits
    if where in ("q_proj", "v_proj_wrapped"):
        assert not _qkv_fused(a)


@pytest.mark.parametrize("which", ["block", "ffn"])
@torch.no_grad()
def test_decode_fused_norms_keep_a_module_left_in_training(which):
    """A block or FFN left in training mode in an eval model (``model.eval()`` then
    ``layers[0].train()``) applies its dropout in a decode step: the fused norms, which would skip
    it, are not taken. Same logits as with the LayerNorm kernels off, under the same seed, and
    unlike the all-eval model's."""
    torch.manual_seed(8)
    prompt = torch.randint(0, LongNetConfig.preset("tiny").vocab_size, (1, 13))

    def run(on, train):
        flags.set_triton_layernorm(on)
        try:
            m = _model(torch.float32, None, dropout=0.5)

            def partly_train(m):
                (m.layers[0] if which == "block" else m.layers[0].ffn).train()
                torch.manual_seed(9)

            return _decode_run(m, prompt, 3, after_prefill=partly_train if train else None)
        finally:
            flags.set_triton_layernorm(None)

    fused, unfused, plain = run(True, True), run(False, True), run(True, False)
    for f, u, p in zip(fused, unfused, plain, strict=True):
        torch.testing.assert_close(f, u, rtol=1e-4, atol=1e-4)
        assert (f - p).abs().max() > 1e-3  # the dropout acted
