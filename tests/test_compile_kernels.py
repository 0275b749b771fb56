"""The models' Triton kernels inside ``torch.compile`` graphs (issue 23, item 5): the fused rotary,
the LayerNorm and the fused loss run as the custom ops ``dilated_attention::rotary``,
``::layer_norm`` (+ ``::layer_norm_backward``) and ``::linear_ce`` where the eager path would run
them, instead of the torch code that Inductor fused into slower kernels.

CPU: the kernels in Triton's interpreter (switches forced on), ``torch.library.opcheck`` on each
op (schema, fake implementation, autograd registration), and a LongNet training step compiled
with ``fullgraph=True`` whose graph holds the three ops, its loss and gradients equal to eager.
CUDA: the same step under Inductor.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dilated_attention import flags
from dilated_attention.models.longnet import LongNetConfig, LongNetLM

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@contextlib.contextmanager
def kernels_on(on: bool = True):
    """The three switches forced on (the interpreter on the CPU included) or off, then back to
    their defaults."""
    for fn in (flags.set_fused_rotary, flags.set_triton_layernorm, flags.set_ce_kernel):
        fn(on)
    try:
        yield
    finally:
        for fn in (flags.set_fused_rotary, flags.set_triton_layernorm, flags.set_ce_kernel):
            fn(None)


def _interpreter_or_cuda():
    from dilated_attention.kernels.triton_import import INTERPRET, triton

    if triton is None:
        pytest.skip("needs triton")
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU, or a CUDA GPU")
    return "cpu" if INTERPRET else "cuda"


def test_rotary_op_opcheck(seed):
    dev = _interpreter_or_cuda()
    from dilated_attention.kernels.triton_rotary import rotary_op

    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(2, 5, 3, 8, generator=g).to(dev).requires_grad_()
    k = torch.randn(2, 5, 1, 8, generator=g).to(dev).requires_grad_()
    ang = torch.randn(1, 5, 1, 4, generator=g).to(dev)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    torch.library.opcheck(rotary_op, (q, k, cos, sin, cos, sin, False))
    # the op's values and gradients: the rotate-half formula through autograd
    def formula(x):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    qo, ko = rotary_op(q, k, cos, sin, cos, sin, False)
    torch.testing.assert_close(qo, formula(q))
    torch.testing.assert_close(ko, formula(k))
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    got = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    want = torch.autograd.grad((formula(q), formula(k)), (q, k), (gq, gk))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_op_opcheck(seed, bias):
    dev = _interpreter_or_cuda()
    from dilated_attention.kernels.triton_layernorm import layer_norm_op

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(3, 7, 24, generator=g).to(dev).requires_grad_()
    w = torch.randn(24, generator=g).to(dev).requires_grad_()
    b = torch.randn(24, generator=g).to(dev).requires_grad_() if bias else None
    torch.library.opcheck(layer_norm_op, (x, w, b, 1e-5, torch.float32))
    y = layer_norm_op(x, w, b, 1e-5, torch.float32)[0]
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (24,), w, b, 1e-5), atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(y.square().sum(), [t for t in (x, w, b) if t is not None])
    want = torch.autograd.grad(torch.nn.functional.layer_norm(x, (24,), w, b, 1e-5).square().sum(),
                               [t for t in (x, w, b) if t is not None])  # fmt: skip
    for a, e in zip(grads, want, strict=True):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", [True, False])
def test_linear_ce_op_opcheck(seed, kernel):
    dev = _interpreter_or_cuda()
    from dilated_attention.models.linear_ce import linear_ce_op

    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(13, 8, generator=g).to(dev).requires_grad_()
    w = torch.randn(20, 8, generator=g).to(dev).requires_grad_()
    t = torch.randint(0, 20, (13,), generator=g).to(dev)
    t[3] = -100
    flags.set_ce_kernel(kernel)
    try:
        torch.library.opcheck(linear_ce_op, (h, w, t, -100, 4, torch.float32, True, True))
        total = linear_ce_op(h, w, t, -100, 4, torch.float32, True, True)[0]
        got = torch.autograd.grad(total * 0.5, (h, w))
    finally:
        flags.set_ce_kernel(None)
    want_total = torch.nn.functional.cross_entropy(h @ w.T, t, reduction="sum")
    want = torch.autograd.grad(want_total * 0.5, (h, w))
    torch.testing.assert_close(total, want_total, atol=1e-4, rtol=1e-5)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


class _Recorder:
    """A torch.compile backend that records the ops of the forward and backward graphs and runs
    them as aot_eager does (aot_autograd with the graphs called as they are)."""

    def __init__(self):
        self.targets: set[str] = set()

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def record(g, _inputs):
            self.targets.update(str(n.target) for n in g.graph.nodes if n.op == "call_function")
            return g.forward

        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)


def _step(model, idx, targets, autocast_dtype):
    with torch.autocast(idx.device.type, dtype=autocast_dtype):
        _, loss = model(idx, targets)
    loss.backward()
    return loss.detach()


def _close(a, b, atol, rtol, rel_norm, msg=""):
    if rel_norm is None:
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=msg)
    else:  # low precision under Inductor: other fusions round elsewhere; compare as a whole
        err = (a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)
        assert err <= rel_norm, (msg, float(err))


def _compiled_against_eager(dev, impl, backend, autocast_dtype, seed, atol, rtol, rel_norm=None):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    cfg = LongNetConfig(vocab_size=64, dim=64, n_layer=2, n_head=4, n_kv_head=2, segment_lengths=(8, 16),
                        dilation_rates=(1, 2), impl=impl)  # fmt: skip
    eager = LongNetLM(cfg).to(dev)
    compiled_model = LongNetLM(cfg).to(dev)
    compiled_model.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 64, (2, 40), device=dev)
    targets = torch.randint(0, 64, (2, 40), device=dev)
    targets[0, :7] = -100
    with kernels_on():
        want = _step(eager, idx, targets, autocast_dtype)
        got = _step(torch.compile(compiled_model, fullgraph=True, backend=backend), idx, targets, autocast_dtype)
    _close(got, want, atol, rtol, rel_norm, "loss")
    for (name, a), (_, b) in zip(compiled_model.named_parameters(), eager.named_parameters(), strict=True):
        _close(a.grad, b.grad, atol, rtol, rel_norm, name)


def test_compiled_step_calls_the_kernels_cpu(seed):
    """fullgraph=True, fp16 autocast on the CPU, the kernels forced on in the interpreter: the
    forward and backward graphs hold the rotary, LayerNorm (and its backward) and fused-loss ops;
    loss and gradients equal eager's (the same kernels there, through their Functions)."""
    if _interpreter_or_cuda() != "cpu":
        pytest.skip("the CPU arm (TRITON_INTERPRET=1)")
    rec = _Recorder()
    _compiled_against_eager("cpu", "reference", rec, torch.float16, seed, 2e-3, 2e-3)
    for op in ("rotary", "layer_norm", "layer_norm_backward", "linear_ce"):
        assert any(f"dilated_attention.{op}." in t for t in rec.targets), (op, sorted(rec.targets))


def test_compiled_step_without_the_switches_keeps_the_torch_code(seed):
    """The switches off: the graph has none of the three ops (the torch code, as before)."""
    torch._dynamo.reset()
    cfg = LongNetConfig(vocab_size=64, dim=64, n_layer=1, n_head=4, n_kv_head=2, segment_lengths=(8, 16),
                        dilation_rates=(1, 2), impl="reference", fused_loss=False)  # fmt: skip
    model = LongNetLM(cfg)
    idx = torch.randint(0, 64, (2, 40))
    rec = _Recorder()
    with kernels_on(False):
        _step(torch.compile(model, fullgraph=True, backend=rec), idx, idx, torch.bfloat16)
    ops = ("dilated_attention.rotary.", "dilated_attention.layer_norm", "dilated_attention.linear_ce.")
    assert not [t for t in rec.targets if t.startswith(ops)], sorted(rec.targets)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_step_calls_the_kernels_cuda(seed):
    """Inductor, bf16 autocast, the fused attention op and the three kernel ops: loss and
    gradients equal eager's."""
    _compiled_against_eager("cuda", "triton", "inductor", torch.bfloat16, seed, 0, 0, rel_norm=2e-2)


def test_the_trace_time_helpers_carry_dynamos_constant_mark():
    """``longnet._constant_for_dynamo`` sets by hand the mark that
    ``torch.compiler.assume_constant_result`` sets (so that importing the models does not import
    Dynamo): if a torch release marks such functions otherwise, this fails, and the compiled
    tests above would trace into the helper instead."""
    import subprocess
    import sys

    from dilated_attention.models import longnet

    def probe():
        return 0

    marked = torch.compiler.assume_constant_result(probe)
    assert vars(marked) == {"_dynamo_marked_constant": True}, vars(marked)
    assert getattr(longnet._compiled_kernel, "_dynamo_marked_constant", False) is True
    code = "import sys, dilated_attention.models.longnet; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr  # importing the models loads no Dynamo
