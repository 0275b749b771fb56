"""One compiled graph (issue 23, item 4): ``torch.compile(LongNetLM(...), fullgraph=True)`` traces a
whole training step (forward with targets, some of them -100, then backward) without a graph
break, and its loss and gradients equal eager. CPU: ``impl="reference"`` (``aot_eager``: the graph
capture is what is tested, not a code generator); CUDA: the fused op under inductor.
"""

from __future__ import annotations

import pytest
import torch

from dilated_attention.models.longnet import LongNetConfig, LongNetLM, chunked_cross_entropy


def _step(model, idx, targets):
    _, loss = model(idx, targets)
    loss.backward()
    return loss.detach()


def _check_one_graph(impl, device, dtype, backend, seed, atol, rtol, dim=32):
    torch._dynamo.reset()
    cfg = LongNetConfig(vocab_size=64, dim=dim, n_layer=2, n_head=4, n_kv_head=2, segment_lengths=(8, 16),
                        dilation_rates=(1, 2), impl=impl)
    eager = LongNetLM(cfg).to(device=device, dtype=dtype)
    compiled_model = LongNetLM(cfg).to(device=device, dtype=dtype)
    compiled_model.load_state_dict(eager.state_dict())
    idx = torch.randint(0, 64, (2, 40), device=device)
    targets = torch.randint(0, 64, (2, 40), device=device)
    targets[0, :7] = -100
    targets[1, 30:] = -100
    want = _step(eager, idx, targets)
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    got = _step(compiled, idx, targets)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    for (name, a), (_, b) in zip(compiled_model.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=atol, rtol=rtol, msg=name)


def test_training_step_is_one_graph_cpu_reference(seed):
    _check_one_graph("reference", "cpu", torch.float64, "aot_eager", seed, 1e-9, 1e-7)


def test_chunked_cross_entropy_compiles_without_host_sync(seed):
    """Several chunks, some rows ignored: compiled (fullgraph) equals eager, values and grads."""
    torch._dynamo.reset()
    h = torch.randn(3, 11, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 20, (3, 11))
    t[0, :4] = -100
    t[2, 5] = -100

    def f(h, w, t):
        return chunked_cross_entropy(h, w, t, chunk_rows=4)

    want = f(h, w, t)
    gw = torch.autograd.grad(want, (h, w))
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(h, w, t)
    gg = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got, want)
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a, b)
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).reshape(-1, 20), t.reshape(-1))
    torch.testing.assert_close(got, ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_training_step_is_one_graph_cuda_fused(seed):
    # impl="triton": the fused custom op (fake implementation, registered autograd) in the graph
    # head dim 16: the smallest the fused kernel takes
    _check_one_graph("triton", "cuda", torch.float32, "inductor", seed, 2e-4, 2e-4, dim=64)
