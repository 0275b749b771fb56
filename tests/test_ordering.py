"""Hilbert ordering: the permutation, its locality, and modules with ordering="hilbert".

The curve is checked against a plain recursive port of the generalized Hilbert ("gilbert")
reference; modules are checked against applying the permutation by hand around the plain module,
forward and backward in float64; the sequence-parallel exchange runs on 2 gloo ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from dilated_attention import DilatedAttention, MultiheadDilatedAttention
from dilated_attention.ordering import hilbert_permutation, permute_sequence


def _sgn(v: int) -> int:
    return (v > 0) - (v < 0)


def _gilbert(x, y, ax, ay, bx, by):
    """Recursive generalized Hilbert curve (J. Cerveny's gilbert2d), the oracle."""
    w, h = abs(ax + ay), abs(bx + by)
    dax, day, dbx, dby = _sgn(ax), _sgn(ay), _sgn(bx), _sgn(by)
    if h == 1 or w == 1:
        sx, sy, m = (dax, day, w) if h == 1 else (dbx, dby, h)
        for i in range(m):
            yield x + i * sx, y + i * sy
        return
    ax2, ay2, bx2, by2 = ax // 2, ay // 2, bx // 2, by // 2
    if 2 * w > 3 * h:
        if abs(ax2 + ay2) % 2 and w > 2:
            ax2, ay2 = ax2 + dax, ay2 + day
        yield from _gilbert(x, y, ax2, ay2, bx, by)
        yield from _gilbert(x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by)
    else:
        if abs(bx2 + by2) % 2 and h > 2:
            bx2, by2 = bx2 + dbx, by2 + dby
        yield from _gilbert(x, y, bx2, by2, ax2, ay2)
        yield from _gilbert(x + bx2, y + by2, ax, ay, bx - bx2, by - by2)
        yield from _gilbert(
            x + (ax - dax) + (bx2 - dbx),
            y + (ay - day) + (by2 - dby),
            -bx2,
            -by2,
            -(ax - ax2),
            -(ay - ay2),
        )


def _gilbert_perm(height: int, width: int) -> list[int]:
    if width >= height:
        cells = _gilbert(0, 0, width, 0, 0, height)
    else:
        cells = _gilbert(0, 0, 0, height, width, 0)
    return [y * width + x for x, y in cells]


def _steps(height: int, width: int) -> torch.Tensor:
    """L1 grid distance between consecutive cells along the curve, shape (H*W - 1,)."""
    perm, _ = hilbert_permutation(height, width)
    r, c = perm // width, perm % width
    return r.diff().abs() + c.diff().abs()


SIZES = [
    (1, 1),
    (1, 17),
    (17, 1),
    (2, 2),
    (3, 5),
    (5, 3),
    (7, 7),
    (8, 8),
    (6, 10),
    (37, 53),
    (53, 37),
    (64, 64),
    (128, 96),
    (96, 128),
    (100, 3),
    (512, 384),
]


@pytest.mark.parametrize("height,width", SIZES)
def test_bijection_and_inverse(height, width):
    n = height * width
    perm, inv = hilbert_permutation(height, width)
    assert perm.dtype == inv.dtype == torch.int64 and perm.shape == inv.shape == (n,)
    assert torch.equal(torch.sort(perm).values, torch.arange(n))
    assert torch.equal(inv[perm], torch.arange(n))
    assert torch.equal(perm[inv], torch.arange(n))
    x = torch.randn(2, n, 3)
    assert torch.equal(x[:, perm][:, inv], x)  # inverse restores order exactly


def test_matches_recursive_gilbert():
    sizes = [(h, w) for h in range(1, 10) for w in range(1, 10)]
    sizes += [(13, 31), (31, 13), (16, 12), (37, 53), (53, 37)]
    for h, w in sizes:
        assert hilbert_permutation(h, w)[0].tolist() == _gilbert_perm(h, w), (h, w)


@pytest.mark.parametrize("side", [1, 2, 4, 8, 16, 64, 256])
def test_power_of_two_squares_are_4_connected(side):
    if side > 1:
        assert bool((_steps(side, side) == 1).all())
    perm, _ = hilbert_permutation(side, side)
    # Starts at a corner and the first 4**k cells fill a 2**k x 2**k block (a true Hilbert curve).
    assert int(perm[0]) == 0
    for k in range(1, int(math.log2(side)) + 1):
        blk = perm[: 4**k]
        r, c = blk // side, blk % side
        assert int(r.max() - r.min()) == int(c.max() - c.min()) == 2**k - 1


def test_other_sizes_mostly_4_connected():
    # gilbert keeps every step a 4-neighbour step except at most one diagonal step per grid.
    # (Checked offline for every grid up to 69x69; here a spread of awkward sizes.)
    gen = torch.Generator().manual_seed(0)
    sizes = [(h, w) for h in (2, 3, 5, 6, 7, 9) for w in (2, 3, 4, 5, 7, 10, 11)]
    sizes += [tuple(int(v) for v in torch.randint(1, 120, (2,), generator=gen)) for _ in range(30)]
    worst = 1.0
    for h, w in sizes:
        if h * w < 2:
            continue
        s = _steps(h, w)
        assert int(s.max()) <= 2, (h, w)
        assert int((s != 1).sum()) <= 1, (h, w)
        worst = min(worst, float((s == 1).float().mean()))
    assert worst > 0.9
    for h, w in [(37, 53), (128, 96), (512, 384)]:
        assert float((_steps(h, w) == 1).float().mean()) > 0.999


def test_device_and_cache():
    p1, i1 = hilbert_permutation(12, 9, device="cpu")
    p2, _ = hilbert_permutation(12, 9)
    assert p1 is not p2 and torch.equal(p1, p2)  # fresh copies of one cached permutation
    assert p1.device.type == "cpu" and i1.device.type == "cpu"


@pytest.mark.parametrize("bad", [(0, 4), (4, 0), (-1, 3), (2.5, 3), ("a", 3)])
def test_bad_grid(bad):
    with pytest.raises(ValueError, match="grid sizes"):
        hilbert_permutation(*bad)


@pytest.mark.parametrize("grid", [None, (4,), (0, 4), (4, -2)])
def test_module_bad_grid(grid):
    with pytest.raises(ValueError, match="grid"):
        DilatedAttention([4], [1], ordering="hilbert", grid=grid)


def test_module_mismatched_lengths():
    m = DilatedAttention([4], [1], impl="torch", ordering="hilbert", grid=(3, 5))
    q = torch.randn(1, 15, 2, 4)
    with pytest.raises(ValueError, match=r"grid=\(3, 5\).*15.*seqlen_q=14"):
        m(q[:, :14], q[:, :14], q[:, :14])
    with pytest.raises(ValueError, match=r"seqlen_q=10, seqlen_k=15"):
        m(q[:, :10], q, q)


def _locality(height: int, width: int, seg: int, order: torch.Tensor) -> float:
    """Mean Euclidean grid distance over all pairs of tokens sharing a segment of length seg."""
    rc = torch.stack([order // width, order % width], 1).double()  # (N, 2) in sequence order
    total, pairs = 0.0, 0
    for s in range(0, order.numel(), seg):
        blk = rc[s : s + seg]
        d = torch.cdist(blk, blk)
        m = blk.shape[0]
        total += float(d.sum()) / 2
        pairs += m * (m - 1) // 2
    return total / pairs


def test_locality_64x64():
    perm, _ = hilbert_permutation(64, 64)
    hil = _locality(64, 64, 64, perm)
    row = _locality(64, 64, 64, torch.arange(64 * 64))
    print(f"64x64, segments of 64: row-major {row:.2f}, hilbert {hil:.2f}, ratio {hil / row:.3f}")
    assert hil / row < 0.3
    # Also for a non-power-of-two grid and a segment that is not a square block.
    perm, _ = hilbert_permutation(37, 53)
    hil = _locality(37, 53, 128, perm)
    row = _locality(37, 53, 128, torch.arange(37 * 53))
    assert hil / row < 0.5


# ----------------------------------------------------------------------------------------------
# Modules: ordering="hilbert" == permutation by hand around the plain module
# ----------------------------------------------------------------------------------------------

H, W = 5, 7  # N = 35, not a multiple of the segments: exercises short last segments
SEG, DIL = [8, 16], [1, 2]


def _mask(b, n):
    m = torch.rand(b, n) < 0.25
    m[:, 0] = False
    return m


@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_dilated_attention_hilbert_matches_manual(impl, causal, padding):
    n = H * W
    perm, inv = hilbert_permutation(H, W)
    hil = DilatedAttention(SEG, DIL, impl=impl, ordering="hilbert", grid=(H, W))
    plain = DilatedAttention(SEG, DIL, impl=impl)
    q = torch.randn(2, n, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, n, 2, 8, dtype=torch.float64, requires_grad=True)  # GQA
    v = torch.randn(2, n, 2, 8, dtype=torch.float64, requires_grad=True)
    mask = _mask(2, n) if padding else None
    g = torch.randn(2, n, 4, 8, dtype=torch.float64)

    out = hil(q, k, v, is_causal=causal, key_padding_mask=mask)
    grads = torch.autograd.grad(out, (q, k, v), g)

    pm = None if mask is None else mask[:, perm]
    ref = plain(q[:, perm], k[:, perm], v[:, perm], is_causal=causal, key_padding_mask=pm)[:, inv]
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # And it really is a different computation from the row-major one (segments differ).
    assert not torch.allclose(out, plain(q, k, v, is_causal=causal, key_padding_mask=mask))


@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("causal", [False, True])
def test_multihead_hilbert_matches_manual(impl, causal):
    n = H * W
    perm, inv = hilbert_permutation(H, W)
    torch.manual_seed(0)
    hil = MultiheadDilatedAttention(
        32,
        4,
        SEG,
        DIL,
        impl=impl,
        num_kv_heads=2,
        ordering="hilbert",
        grid=(H, W),
        dtype=torch.float64,
    )
    plain = MultiheadDilatedAttention(
        32, 4, SEG, DIL, impl=impl, num_kv_heads=2, dtype=torch.float64
    )
    plain.load_state_dict(hil.state_dict())
    x = torch.randn(2, n, 32, dtype=torch.float64)
    mask = _mask(2, n)
    g = torch.randn(2, n, 32, dtype=torch.float64)

    out, none = hil(x, x, x, is_causal=causal, key_padding_mask=mask)
    assert none is None
    out.backward(g)
    # Everything after attention is per token, so permuting the input and un-permuting the
    # output of the plain module is the same function.
    ref, _ = plain(
        x[:, perm], x[:, perm], x[:, perm], is_causal=causal, key_padding_mask=mask[:, perm]
    )
    ref = ref[:, inv]
    ref.backward(g)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for (name, p1), p2 in zip(hil.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_permute_sequence_grad_and_mask():
    x = torch.randn(3, 12, 2, dtype=torch.float64, requires_grad=True)
    y = permute_sequence(x, (3, 4))
    perm, inv = hilbert_permutation(3, 4)
    assert torch.equal(y, x[:, perm])
    assert torch.equal(permute_sequence(y, (3, 4), inverse=True), x)
    assert torch.autograd.gradcheck(lambda t: permute_sequence(t, (3, 4)), (x,))
    m = torch.rand(3, 12) < 0.5
    assert torch.equal(permute_sequence(m, (3, 4)), m[:, perm])


# ----------------------------------------------------------------------------------------------
# Sequence-parallel: 2 gloo ranks, file:// rendezvous (no mock of torch.distributed)
# ----------------------------------------------------------------------------------------------


def _sp_worker(rank: int, world: int, grid: tuple[int, int]):
    # run by dist_utils.run_distributed: process group set up, and a barrier before it is
    # destroyed (a rank that tears down while its peer still talks to it aborts the peer)
    h, w = grid
    n = h * w
    s = n // world
    gen = torch.Generator().manual_seed(1234)  # same global tensors on every rank
    x = torch.randn(2, n, 3, 4, dtype=torch.float64, generator=gen)
    g = torch.randn(2, n, 3, 4, dtype=torch.float64, generator=gen)
    mask = torch.rand(2, n, generator=gen) < 0.5
    perm, inv = hilbert_permutation(h, w)
    lo, hi = rank * s, (rank + 1) * s

    xl = x[:, lo:hi].clone().requires_grad_(True)
    y = permute_sequence(xl, grid, group=dist.group.WORLD)
    assert torch.equal(y, x[:, perm][:, lo:hi]), "forward exchange"
    y.backward(g[:, lo:hi])
    # d/dx of sum(g_shard * x[perm]_shard) summed over ranks = g[inv] (global), sharded.
    assert torch.equal(xl.grad, g[:, inv][:, lo:hi]), "backward exchange"
    back = permute_sequence(y.detach(), grid, inverse=True, group=dist.group.WORLD)
    assert torch.equal(back, x[:, lo:hi]), "round trip"
    ml = permute_sequence(mask[:, lo:hi], grid, group=dist.group.WORLD)
    assert ml.dtype == torch.bool and torch.equal(ml, mask[:, perm][:, lo:hi]), "mask"

    # Lengths are checked against the per-rank share of the grid.
    m = DilatedAttention(
        [4], [1], impl="torch", process_group=dist.group.WORLD, ordering="hilbert", grid=grid
    )
    try:
        m(xl[:, :-1], xl[:, :-1], xl[:, :-1])
    except ValueError as e:
        assert "per rank" in str(e), str(e)
    else:
        raise AssertionError("expected a ValueError for a wrong shard length")

    # Full module, if the sequence-parallel dilated attention is available in this build.
    try:
        from dilated_attention.distributed import sequence_parallel  # noqa: F401
    except ImportError:
        return
    q = torch.randn(1, n, 2, 4, dtype=torch.float64, generator=gen)
    go = torch.randn(1, n, 2, 4, dtype=torch.float64, generator=gen)
    pad = torch.rand(1, n, generator=gen) < 0.2
    pad[:, 0] = False
    qg = q.clone().requires_grad_(True)
    plain = DilatedAttention([4, 8], [1, 2], impl="torch", ordering="hilbert", grid=grid)
    ref = plain(qg, qg, qg, is_causal=True, key_padding_mask=pad)
    (ref_grad,) = torch.autograd.grad(ref, qg, go)
    m = DilatedAttention(
        [4, 8],
        [1, 2],
        impl="torch",
        process_group=dist.group.WORLD,
        ordering="hilbert",
        grid=grid,
    )
    ql = q[:, lo:hi].clone().requires_grad_(True)
    out = m(ql, ql, ql, is_causal=True, key_padding_mask=pad[:, lo:hi])
    torch.testing.assert_close(out, ref[:, lo:hi], rtol=1e-10, atol=1e-10)
    (grad,) = torch.autograd.grad(out, ql, go[:, lo:hi])
    torch.testing.assert_close(grad, ref_grad[:, lo:hi], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("grid", [(6, 10), (8, 8)])
def test_sequence_parallel_exchange_gloo(grid):
    run_distributed(_sp_worker, 2, grid)


def test_hilbert_attention_takes_a_callable(seed):
    """The ordering leaf calls the attention it is given (no module, no private method): the
    callable sees q, k, v in Hilbert order and its output is put back in row-major order."""
    from dilated_attention.ordering import hilbert_attention

    h, w = 4, 6
    q, k, v = (torch.randn(2, h * w, 2, 8, dtype=torch.float64) for _ in range(3))
    seen = {}

    def attend(q_, k_, v_, is_causal, key_padding_mask):
        seen.update(q=q_, causal=is_causal, mask=key_padding_mask)
        return v_ * 2

    out = hilbert_attention(attend, (h, w), q, k, v, is_causal=True)
    perm, _ = hilbert_permutation(h, w)
    torch.testing.assert_close(seen["q"], q[:, perm])
    assert seen["causal"] is True and seen["mask"] is None
    torch.testing.assert_close(out, v * 2)


def test_hilbert_permutation_returns_copies():
    perm, inv = hilbert_permutation(4, 4)
    x = torch.arange(16.0).view(1, 16, 1)
    before = permute_sequence(x, (4, 4))
    perm.zero_()
    inv.zero_()
    perm2, inv2 = hilbert_permutation(4, 4)
    assert sorted(perm2.tolist()) == list(range(16))
    assert torch.equal(inv2[perm2], torch.arange(16))
    assert torch.equal(permute_sequence(x, (4, 4)), before)
