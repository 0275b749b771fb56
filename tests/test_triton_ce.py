"""The cross-entropy kernel of the fused LM loss (kernels/triton_ce.py) against the torch formula,
and ``linear_cross_entropy_sum`` (models/linear_ce.py) with the kernel against it without the
kernel and against plain ``F.cross_entropy(F.linear(h, w).float())``.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
at tiny sizes, with small ``block_v`` so that a row takes several blocks, the last one partial;
``flags.set_ce_kernel(True)`` is what lets linear_ce use it there ("auto", the default, takes it
on CUDA only). The ``cuda`` test runs a realistic size (V = 50304) under bf16 autocast.

Tolerances: the kernel and the torch code compute the same float32 formula on the same widened
inputs, so the loss agrees to float32 rounding (the exponentials may differ in the last bits) and
the gradient to one rounding in the logits' dtype: exact-ish in fp32, one bf16 ulp (relative
2^-7) in bf16, because Triton's interpreter rounds float32 to bfloat16 by truncation where torch
and the GPU round to nearest.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dilated_attention import flags
from dilated_attention.models import linear_ce
from dilated_attention.models.linear_ce import linear_cross_entropy_sum
from dilated_attention.models.longnet import chunked_cross_entropy
from helpers import needs_backend

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IGNORE = -100
GRAD_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-7),
    torch.float16: dict(rtol=2**-10, atol=1e-7),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-7),
}

pytestmark = needs_backend("triton_ce", "cross-entropy", 0)


def _kernel():
    from dilated_attention.kernels.triton_ce import ce_loss_grad_

    return ce_loss_grad_


@pytest.fixture
def ce_on():
    flags.set_ce_kernel(True)
    yield
    flags.set_ce_kernel(None)


def _torch_formula(x: torch.Tensor, t: torch.Tensor, ignore_index: int = IGNORE):
    """The per-row loss and the float32 gradient softmax - onehot (0 on ignored rows) of logits x."""
    xf = x.float()
    valid = t != ignore_index
    tcl = t.clamp(min=0)
    lse = xf.logsumexp(1)
    loss = torch.where(valid, lse - xf.gather(1, tcl[:, None])[:, 0], 0.0)
    g = (xf - lse[:, None]).exp()
    g[torch.arange(x.shape[0]), tcl] -= 1.0
    return loss, g * valid[:, None]


def _logits(gen, rows, v, dtype, ignore=0.3):
    x = (3 * torch.randn(rows, v, generator=gen)).to(dtype).to(DEV)
    t = torch.randint(0, v, (rows,), generator=gen)
    t[torch.rand(rows, generator=gen) < ignore] = IGNORE
    return x, t.to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, v, block_v", [
    (1, 37, 16),   # one row; V not a multiple of BLOCK_V (3 blocks, the last 5 wide)
    (9, 37, 16),
    (6, 64, 16),   # V a multiple of BLOCK_V
    (5, 200, None),  # the default block (256 here: one partial block)
    (4, 3, 4),     # V smaller than the block
])  # fmt: skip
def test_kernel_matches_torch_formula(seed, dtype, rows, v, block_v):
    gen = torch.Generator().manual_seed(seed)
    x, t = _logits(gen, rows, v, dtype)
    if rows > 1:
        t[1] = IGNORE  # an ignored row, always
        t[0] = v - 1  # a target in the last (partial) block
    want_loss, want_g = _torch_formula(x, t)
    y = x.clone()
    loss = _kernel()(y, t, IGNORE, block_v=block_v)
    assert loss.dtype == torch.float32 and loss.shape == (rows,)
    assert y.dtype == dtype and y.data_ptr() != x.data_ptr()
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.float(), want_g.to(dtype).float(), **GRAD_TOL[dtype])
    ignored = t == IGNORE
    assert (loss[ignored] == 0).all() and (y[ignored] == 0).all()
    # each valid row's gradient sums to 0 (softmax sums to 1, minus the one-hot)
    sums = y.float().sum(1)[~ignored]
    torch.testing.assert_close(sums, torch.zeros_like(sums), rtol=0, atol=v * 2**-7)


def test_kernel_loss_only_leaves_the_logits(seed):
    gen = torch.Generator().manual_seed(seed)
    x, t = _logits(gen, 5, 37, torch.bfloat16)
    y = x.clone()
    loss = _kernel()(y, t, IGNORE, write_grad=False, block_v=16)
    torch.testing.assert_close(loss, _torch_formula(x, t)[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(y, x)


def test_kernel_custom_ignore_index_and_bad_target(seed):
    """Another ignore_index (here 0: a real class id); a target outside [0, V) that is not
    ignored gives a NaN loss for its row, never a read outside the row."""
    gen = torch.Generator().manual_seed(seed)
    x, t = _logits(gen, 6, 37, torch.float32, ignore=0.0)
    t[2], t[3], t[4] = 0, 37, -5
    y = x.clone()
    loss = _kernel()(y, t, 0, block_v=16)
    ok = torch.tensor([True, True, False, False, False, True], device=t.device)
    want_loss, want_g = _torch_formula(x[ok], t[ok], ignore_index=0)
    torch.testing.assert_close(loss[ok], want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y[ok], want_g, **GRAD_TOL[torch.float32])
    assert loss[2] == 0 and (y[2] == 0).all()
    assert loss[3:5].isnan().all()


def test_kernel_empty_and_strided_rows(seed):
    """No rows: nothing launched; a row stride larger than V (a view of a wider buffer): only
    the view's columns are read and written."""
    gen = torch.Generator().manual_seed(seed)
    none = _kernel()(torch.empty(0, 37, device=DEV), torch.empty(0, dtype=torch.long, device=DEV), IGNORE)
    assert none.shape == (0,)
    x, t = _logits(gen, 4, 50, torch.float32, ignore=0.0)
    buf = x.clone()
    view = buf[:, :37]
    t = t.clamp(max=36)
    loss = _kernel()(view, t, IGNORE, block_v=16)
    want_loss, want_g = _torch_formula(x[:, :37], t)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(view, want_g, **GRAD_TOL[torch.float32])
    assert torch.equal(buf[:, 37:], x[:, 37:])
    with pytest.raises(ValueError, match="unit stride"):
        _kernel()(x[:, :37].t().contiguous().t(), t, IGNORE)


# ------------------------------------------------------------------- linear_cross_entropy_sum

def _data(gen, m=45, e=16, v=37, dtype=torch.float32, ignore=0.2):
    h = torch.randn(m, e, generator=gen, dtype=dtype).to(DEV).requires_grad_()
    w = torch.randn(v, e, generator=gen, dtype=dtype).to(DEV).requires_grad_()
    t = torch.randint(0, v, (m,), generator=gen)
    t[torch.rand(m, generator=gen) < ignore] = IGNORE
    return h, w, t.to(DEV)


def _fused(h, w, t, kernel: bool, autocast: bool, chunk_rows: int):
    flags.set_ce_kernel(kernel)
    try:
        with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = linear_cross_entropy_sum(h, w, t, ignore_index=IGNORE, chunk_rows=chunk_rows)
        return (loss, *torch.autograd.grad(loss, (h, w)))
    finally:
        flags.set_ce_kernel(None)


def _plain(h, w, t, autocast: bool):
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=IGNORE, reduction="sum")
    return (loss, *torch.autograd.grad(loss, (h, w)))


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 16, 100])
def test_linear_ce_with_kernel_equals_without_and_plain(seed, monkeypatch, autocast, chunk_rows):
    gen = torch.Generator().manual_seed(seed)
    h, w, t = _data(gen)
    calls = []
    kernel = _kernel()

    def spy(*a, **k):
        calls.append(a[0].dtype)
        return kernel(*a, **k)

    monkeypatch.setattr(linear_ce, "_CE_KERNEL", [spy])
    got = _fused(h, w, t, True, autocast, chunk_rows)
    cdtype = torch.bfloat16 if autocast else torch.float32
    assert calls == [cdtype] * -(-h.shape[0] // chunk_rows)  # one launch per chunk, in cdtype
    torch_path = _fused(h, w, t, False, autocast, chunk_rows)
    assert len(calls) == -(-h.shape[0] // chunk_rows)  # the torch path launched nothing
    plain = _plain(h, w, t, autocast)
    for a, b, c, name in zip(got, torch_path, plain, ("loss", "dh", "dweight")):
        assert a.dtype == b.dtype == c.dtype, name
        if not autocast:
            tol = dict(rtol=1e-5, atol=1e-5)
        elif name == "loss":
            tol = dict(rtol=1e-5, atol=1e-4)
        else:  # bf16 matmuls of a gradient that may differ by one bf16 ulp (interpreter
            # truncation), rounded to bf16: a few bf16 ulps of the tensor's scale
            tol = dict(rtol=2**-6, atol=2**-6 * b.abs().max().item())
        torch.testing.assert_close(a, b, **tol, msg=f"kernel vs torch path: {name}")
        torch.testing.assert_close(a, c, **tol, msg=f"kernel vs plain: {name}")


def test_switch_picks_the_kernel(monkeypatch):
    """"on": the kernel in the interpreter too; "off": never; "auto": CUDA only; float64: never."""
    h = torch.zeros(2, 4, device=DEV)
    flags.set_ce_kernel(True)
    try:
        assert linear_ce._ce_kernel(h) is not None
        assert linear_ce._ce_kernel(h.double()) is None
        flags.set_ce_kernel(False)
        assert linear_ce._ce_kernel(h) is None
        flags.set_ce_kernel(None)
        monkeypatch.delenv(flags.ENV_CE_KERNEL, raising=False)
        assert flags.ce_kernel_mode() == flags.CE_KERNEL_DEFAULT == "auto"
        assert (linear_ce._ce_kernel(h) is not None) == h.is_cuda
        for env, mode in (("0", "off"), ("1", "on"), ("AUTO", "auto"), ("yes", "auto")):
            monkeypatch.setenv(flags.ENV_CE_KERNEL, env)
            flags.set_ce_kernel(None)  # read again at the next ask
            assert flags.ce_kernel_mode() == mode, env
        with pytest.raises(TypeError, match="True, False or None"):
            flags.set_ce_kernel(1)
    finally:
        flags.set_ce_kernel(None)


def test_chunked_fused_loss_with_kernel(seed, ce_on):
    """chunked_cross_entropy(fused=True) under bf16 autocast with the kernel against the
    checkpointed chunks (the plain loss): value and gradients, with dropped ignored rows."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 23, 16, generator=gen).to(DEV).requires_grad_()
    w = torch.randn(37, 16, generator=gen).to(DEV).requires_grad_()
    t = torch.randint(0, 37, (2, 23), generator=gen).to(DEV)
    t[0, :4] = IGNORE
    out = {}
    for fused in (True, False):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = chunked_cross_entropy(h, w, t, chunk_rows=8, fused=fused)
        out[fused] = (loss, *torch.autograd.grad(loss, (h, w)))
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.cuda
def test_cuda_realistic_size(seed):
    """V = 50304, 4000 rows in chunks of 1333 (as at 8K x 4), bf16 autocast: the kernel against
    the torch path (loss, dh, dweight) and the kernel's logits buffer against the torch formula;
    the kernel path holds no float32 copy of a chunk's logits (peak memory)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, e, v, step = 4000, 768, 50304, 1333
    h = (torch.randn(m, e, device="cuda", generator=gen)).requires_grad_()
    w = (0.02 * torch.randn(v, e, device="cuda", generator=gen)).requires_grad_()
    t = torch.randint(0, v, (m,), device="cuda", generator=gen)
    t[:50] = IGNORE
    res, peak = {}, {}
    for kernel in (True, False):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        res[kernel] = _fused(h, w, t, kernel, True, step)
        torch.cuda.synchronize()
        peak[kernel] = torch.cuda.max_memory_allocated() - base
    for a, b, name in zip(res[True], res[False], ("loss", "dh", "dweight")):
        tol = dict(rtol=1e-4, atol=1e-3) if name == "loss" else dict(rtol=1e-2, atol=1e-4)
        torch.testing.assert_close(a, b, **tol, msg=name)
    assert peak[False] - peak[True] >= 2 * step * v * 2, peak  # the float32 chunk is gone
    # the kernel alone on one chunk of bf16 logits (the GPU rounds to nearest, as torch does)
    x = (h[:step].detach().bfloat16() @ w.detach().bfloat16().T).contiguous()
    want_loss, want_g = _torch_formula(x, t[:step])
    y = x.clone()
    loss = _kernel()(y, t[:step], IGNORE)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y.float(), want_g.bfloat16().float(), rtol=2**-7, atol=1e-6)
