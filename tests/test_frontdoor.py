"""The front door: validate once, pick once, run a validated core (issue 23, items 1, 7, 8).

- ``dilated_attention`` never re-enters itself (autocast, headdim 0) and never calls the public
  decode entry point for a short query;
- the torch path's two tactics (one fused call with a log-multiplicity bias for tiny CPU calls,
  the grouped blocks otherwise) both equal the float64 reference, forward and backward;
- ``kernels/select.py`` answers availability once per key and picks the decode impl, and is
  the one interpreter check (it reads ``TRITON_INTERPRET`` as Triton does);
- ``LongNetLM.generate``'s argument rules.
"""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import dilated_attention as da
from dilated_attention import api
from dilated_attention.kernels import select, torch_dilated
from dilated_attention.reference import dilated_attention_reference

# awkward lengths: not multiples of any w; Nq < Nk too (bottom-right aligned, with gradients so
# that the decode route does not apply)
CASES = [
    # (nq, nk, h, hkv, seg, dil, head_assignment)
    (37, 37, 4, 2, (8, 16), (1, 2), "all"),
    (29, 29, 6, 3, (5, 12, 29), (1, 3, 4), "split"),  # split: rows of some heads have no key
    (23, 41, 4, 1, (16, 32), (2, 4), "all"),  # MQA, queries shorter than keys, no r=1 branch
    (64, 64, 2, 2, (16, 32, 64), (1, 2, 4), "all"),  # the tiny shape
]


def _grads(fn, q, k, v, do):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    out.backward(do)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("tactic", ["dense", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_torch_tactics_equal_reference(seed, monkeypatch, tactic, dtype, causal, case):
    nq, nk, h, hkv, seg, dil, ha = case
    if tactic == "grouped":  # force the per-group path for every size
        monkeypatch.setattr(torch_dilated, "_DENSE_MAX_SCORES", 0)
    else:
        assert h * nq * nk <= torch_dilated._DENSE_MAX_SCORES
    q = torch.randn(2, nq, h, 16, dtype=dtype)
    k = torch.randn(2, nk, hkv, 16, dtype=dtype)
    v = torch.randn(2, nk, hkv, 16, dtype=dtype)
    do = torch.randn(2, nq, h, 16, dtype=dtype)
    kw = dict(causal=causal, head_assignment=ha, return_lse=True)
    got = _grads(lambda a, b, c: da.dilated_attention(a, b, c, seg, dil, impl="torch", **kw), q, k, v, do)

    def ref(a, b, c):
        out, lse = dilated_attention_reference(
            a.double(), b.double(), c.double(), seg, dil, causal=causal, head_assignment=ha
        )
        return out, lse

    want = _grads(ref, q, k, v, do.double())
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        a = a.double()
        assert torch.equal(torch.isneginf(a), torch.isneginf(b)), name
        fin = torch.isfinite(b)
        assert not a.isnan().any(), name
        t = max(tol, 1e-6) if name == "lse" else tol  # lse is float32 by contract
        assert (a[fin] - b[fin]).abs().max() <= t * (1 + b[fin].abs().max()), name


def test_dense_tactic_rows_without_keys_are_zero(seed):
    # split heads with r = 2: half the rows of the second group's heads select no key
    q, k, v = (torch.randn(1, 12, 2, 8, requires_grad=True) for _ in range(3))
    out, lse = da.dilated_attention(q, k, v, [4, 4], [1, 2], head_assignment="split", impl="torch", return_lse=True)
    assert torch.isneginf(lse).any()
    dead = torch.isneginf(lse).transpose(1, 2)  # (B, N, H)
    assert (out[dead] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def _count_calls(monkeypatch):
    calls = []
    real = api.dilated_attention

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(api, "dilated_attention", counting)
    return counting, calls


def test_autocast_and_headdim0_do_not_reenter_the_front_door(monkeypatch, seed):
    fn, calls = _count_calls(monkeypatch)
    q, k, v = (torch.randn(1, 20, 2, 16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(q, k, v, [8], [2], impl="torch")
    assert out.dtype == torch.bfloat16 and len(calls) == 1
    calls.clear()
    z = torch.randn(1, 20, 2, 0)
    out, lse = fn(z, z, z, [8], [2], impl="torch", return_lse=True)
    assert len(calls) == 1 and out.shape == z.shape
    # lse = log(number of keys counted with multiplicity): the reference on one zero feature
    _, want = dilated_attention_reference(
        torch.zeros(1, 20, 2, 1, dtype=torch.float64), *(torch.zeros(1, 20, 2, 1, dtype=torch.float64),) * 2,
        (8,), (2,), softmax_scale=1.0,
    )
    torch.testing.assert_close(lse.double(), want)


def test_short_query_reaches_decode_without_the_public_entry(monkeypatch, seed):
    from dilated_attention import decode

    def refuse(*a, **kw):
        raise AssertionError("dilated_attention called the public dilated_attention_with_kvcache")

    monkeypatch.setattr(decode, "dilated_attention_with_kvcache", refuse)
    q = torch.randn(2, 3, 4, 16, dtype=torch.float64)
    k, v = (torch.randn(2, 50, 2, 16, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        out, lse = da.dilated_attention(q, k, v, [16, 32], [1, 2], causal=True, impl="torch", return_lse=True)
    want, want_lse = dilated_attention_reference(q, k, v, (16, 32), (1, 2), causal=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-6, rtol=1e-6)


def test_backend_reason_asked_once_per_key(monkeypatch):
    calls = []
    real = select._compute_reason

    def counting(*a):
        calls.append(a)
        return real(*a)

    monkeypatch.setattr(select, "_compute_reason", counting)
    monkeypatch.setattr(select, "_REASONS", {})
    q = torch.empty(1, 4, 2, 16)
    for _ in range(3):
        select.triton_unavailable_reason(q, q)
        select.pick_impl("auto", q, q, 0.0, segment_lengths=(4,), dilation_rates=(1,))
    assert len(calls) == 1
    select.triton_unavailable_reason(q.double())
    assert len(calls) == 2


_SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

_INTERPRET_PROBE = """
import torch
from dilated_attention.kernels import direct_launch, select
asked = select.interpreting()
from dilated_attention.kernels import triton_kernels, triton_launch, triton_ops
import triton
made = not isinstance(triton_kernels.dilated_fwd_kernel, triton.runtime.JITFunction)
cpu = triton_ops.unavailable_reason(torch.zeros(1, 8, 2, 16)) is None
print(asked, made, triton_launch.INTERPRET, "TRITON_INTERPRET" in str(direct_launch.unavailable_reason()), cpu)
"""


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("On", True), ("0", False), ("2", False)])
def test_one_interpreter_check_reads_the_variable_as_triton_does(value, on):
    # a fresh process per value: the mode is fixed at the first question. Every module agrees
    # with the kernels triton.jit actually defined ("true" used to be read as off by select and
    # "2" as on by direct_launch, while Triton reads them the other way).
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET=value, PYTHONPATH=str(_SRC))
    out = subprocess.run([sys.executable, "-c", _INTERPRET_PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    asked, made, launch, interpreted, cpu = (w == "True" for w in out.stdout.split())
    assert made == on, f"triton.jit made interpreted={made} for TRITON_INTERPRET={value!r}"
    assert asked == launch == interpreted == cpu == on


def test_no_module_reads_the_interpreter_variable():
    # the "interpreter mode is detected three ways": now only Triton reads it, through
    # triton_import.INTERPRET, which select.interpreting returns
    pkg = _SRC / "dilated_attention"
    readers = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*.py")
                     if 'environ.get("TRITON_INTERPRET"' in p.read_text()
                     or "environ['TRITON_INTERPRET']" in p.read_text()
                     or 'environ["TRITON_INTERPRET"]' in p.read_text()
                     or 'getenv("TRITON_INTERPRET"' in p.read_text())
    assert readers == []


def test_inlined_decode_shape_rules_agree_with_select():
    # api.py's and decode.py's fast paths inline select.decode_shaped (a frame less per decode
    # call): the same answer on every (nq, nk) near the edges
    from dilated_attention import decode

    edge = select.MAX_DECODE_ROWS
    for nq in (0, 1, 2, edge - 1, edge, edge + 1, 200):
        for nk in (1, nq - 1, nq, nq + 1, 500):
            q, k = torch.empty(1, nq, 1, 1), torch.empty(1, max(nk, 1), 1, 1)
            shaped = select.decode_shaped(nq, k.shape[1])
            assert shaped == (k.shape[1] > nq and nq <= edge)
            key = decode.fast_key("da", q, k, k, [4], [1], False, None, "all", "auto")
            assert (key is not None) == shaped, (nq, nk)


def test_pick_decode_impl_rules():
    q = torch.empty(1, 1, 2, 16)
    assert select.pick_decode_impl("auto", q) == "torch"  # never the Triton interpreter
    assert select.pick_decode_impl("torch", q) == "torch"
    with pytest.raises(ValueError, match="impl must be one of"):
        select.pick_decode_impl("reference", q)
    reason = select.backend_reason("triton_decode", "cpu", torch.float64, 16)
    assert reason is not None  # float64 is not a kernel dtype
    with pytest.raises(ValueError, match="cannot run here"):
        select.pick_decode_impl("triton", q.double())


def test_describe_call_errors_name_the_value():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="impl must be one of"):
        da.dilated_attention(q, q, q, [4], [1], impl="fast")
    with pytest.raises(TypeError, match="bool"):
        da.dilated_attention(q, q, q, [True], [1])
    with pytest.raises(TypeError, match="causal must be a bool"):
        da.dilated_attention(q, q, q, [4], [1], causal="no")
    # a bool equal to a cached int branch list is still refused (the branch cache is exact-int)
    da.dilated_attention(q, q, q, [1], [1])
    with pytest.raises(TypeError, match="bool"):
        da.dilated_attention(q, q, q, [True], [1])


# ------------------------------------------------------------------------- generate's arguments
def _tiny_lm():
    from dilated_attention.models.longnet import LongNetConfig, LongNetLM

    cfg = LongNetConfig(vocab_size=32, dim=16, n_layer=1, n_head=2, segment_lengths=(4, 8),
                        dilation_rates=(1, 2), impl="torch")
    return LongNetLM(cfg).eval()


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(temperature=-1.0), ValueError, "temperature must be a finite number >= 0"),
        (dict(temperature=math.nan), ValueError, "temperature must be a finite number >= 0"),
        (dict(temperature=math.inf), ValueError, "temperature must be a finite number >= 0"),
        (dict(temperature="hot"), TypeError, "temperature must be a number"),
        (dict(top_k=0), ValueError, "top_k must be None or an int >= 1"),
        (dict(top_k=-3), ValueError, "top_k must be None or an int >= 1"),
        (dict(top_k=2.5), TypeError, "top_k must be None or an int"),
        (dict(prefill_chunk=0), ValueError, "prefill_chunk must be None or an int >= 1"),
        (dict(prefill_chunk=-4), ValueError, "prefill_chunk must be None or an int >= 1"),
        (dict(prefill_chunk=True), TypeError, "prefill_chunk must be None or an int"),
    ],
)
def test_generate_argument_rules(kw, err, match):
    m = _tiny_lm()
    with pytest.raises(err, match=match):
        m.generate(torch.zeros(1, 3, dtype=torch.long), 2, **kw)


@pytest.mark.parametrize("n, err, match", [
    (2.5, TypeError, r"max_new_tokens must be an int >= 1, got 2.5 \(float\)"),  # failed inside torch.zeros
    ("3", TypeError, r"max_new_tokens must be an int >= 1, got '3' \(str\)"),
    (True, TypeError, "max_new_tokens must be an int"),
    (0, ValueError, "max_new_tokens >= 1"),
])  # fmt: skip
def test_generate_max_new_tokens_rules(n, err, match):
    with pytest.raises(err, match=match):
        _tiny_lm().generate(torch.zeros(1, 3, dtype=torch.long), n)


def test_generate_tiny_temperature_samples_the_most_likely_token(seed):
    # a valid temperature (finite, > 0) so small that logits / temperature overflowed to inf:
    # multinomial got NaN weights and raised; now the most likely token's logit is 0 first
    m = _tiny_lm()
    prompt = torch.randint(0, 32, (2, 5))
    greedy = m.generate(prompt, 3, temperature=0)
    for t in (1e-40, 1e-300):
        assert torch.equal(m.generate(prompt, 3, temperature=t), greedy), t


@pytest.mark.parametrize(
    "idx",
    [torch.zeros(3, dtype=torch.long), torch.zeros(1, 3), torch.zeros(1, 1, 3, dtype=torch.long), [[1, 2, 3]]],
    ids=["1d", "float", "3d", "list"],
)
def test_generate_prompt_rules(idx):
    with pytest.raises(TypeError, match=r"idx must be a \(B, T\) int64 or int32 tensor"):
        _tiny_lm().generate(idx, 2)


def test_generate_accepts_valid_edges(seed):
    m = _tiny_lm()
    prompt = torch.randint(0, 32, (1, 5))
    g = torch.Generator().manual_seed(seed)
    out = m.generate(prompt, 3, temperature=0.5, top_k=1, prefill_chunk=2, generator=g)
    greedy = m.generate(prompt, 3, temperature=0, prefill_chunk=1)
    assert torch.equal(out, greedy)  # top_k=1 sampling is greedy


@pytest.mark.skipif(not select.interpreting(), reason="Triton's interpreter only (TRITON_INTERPRET=1)")
def test_interpreter_refuses_bf16_attention_and_auto_stays_exact(seed):
    """Triton's interpreter computes the attention kernels' bf16 products wrongly (outputs ~1e8
    from inputs ~1, no error): an explicit impl='triton' with bf16 on the CPU raises, dense,
    packed and decode alike, and impl='auto' runs the torch path, close to the reference."""
    pytest.importorskip("triton")
    seg, dil = (8, 16), (1, 2)
    q, k, v = (torch.randn(1, 16, 2, 16).bfloat16() for _ in range(3))
    with pytest.raises(ValueError, match="bfloat16 in Triton's interpreter"):
        da.dilated_attention(q, k, v, seg, dil, impl="triton")
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="bfloat16 in Triton's interpreter"):
        da.dilated_attention_varlen(q[0], k[0], v[0], cu, cu, 11, 11, seg, dil, impl="triton")
    with pytest.raises(ValueError, match="bfloat16 in Triton's interpreter"):
        da.dilated_attention_with_kvcache(q[:, :1], k, v, 16, seg, dil, impl="triton")
    got = da.dilated_attention(q, k, v, seg, dil, causal=True)
    want = dilated_attention_reference(q.double(), k.double(), v.double(), seg, dil, causal=True)[0]
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)
    # float32 and float16 still run the kernel under the interpreter
    assert select.backend_reason("triton", "cpu", torch.float32, 16) is None
    assert select.backend_reason("triton", "cpu", torch.float16, 16) is None
    assert select.backend_reason("triton_decode", "cpu", torch.bfloat16, 16) is not None
