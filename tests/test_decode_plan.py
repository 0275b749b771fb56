"""Decode plans and the direct launch of compiled kernels (kernels/triton_decode.py, kernels/direct_launch.py).

On the CPU (Triton's interpreter) a plan launches through ``kernel[grid](...)``: these tests
check the plan logic itself (what its key separates, which arguments it passes, that a plan hit
gives the per-call path's bits, that a misaligned pointer never reaches a compiled binary, the
A/B switch) and the launcher builder against a stand-in of Triton 3.6's ``CompiledKernel``. The
CUDA tests compare the direct launch with Triton's own launch bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from helpers import device_switch

from dilated_attention import dilated_attention, flags
from dilated_attention.decode import dilated_attention_with_kvcache, triton_unavailable_reason

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _td():
    if triton_unavailable_reason(torch.empty(1, 1, 1, 16, device=DEV)) is not None:
        pytest.skip("triton decode unavailable")
    from dilated_attention.kernels import triton_decode

    return triton_decode


@pytest.fixture(autouse=True)
def _restore_flag():
    flags.set_direct_launch(True)  # these tests are about the plans, whatever the environment says
    yield
    flags.set_direct_launch(None)


ROWS = ((8, 1, 0, 4), (16, 2, 0, 4), (12, 5, 0, 4))


def _inputs(b=2, nq=2, h=4, hkv=2, d=16, c=40, dtype=torch.float32, lens=(40, 23)):
    q = torch.randn(b, nq, h, d, dtype=dtype, device=DEV)
    k = torch.randn(b, c, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(b, c, hkv, d, dtype=dtype, device=DEV)
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=DEV)


def _same(a, b):
    assert torch.equal(a[0], b[0])
    if a[1] is not None and b[1] is not None:
        assert torch.equal(a[1], b[1])


# ------------------------------------------------------------------------------ plan hits = JIT bits


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", ["plain", "leftpad", "full", "gqa1", "fp16"])
def test_plan_hit_equals_per_call_path(seed, causal, case):
    td = _td()
    td._PLANS.clear()
    kw = dict(dtype=torch.float16) if case == "fp16" else {}
    if case == "gqa1":
        kw.update(h=4, hkv=1)
    q, k, v, sl = _inputs(**kw)
    lp = torch.tensor([3, 0], dtype=torch.int32, device=DEV) if case == "leftpad" else None
    if case == "full":
        sl = None
    want = td.decode_triton_jit(q, k, v, sl, lp, ROWS, causal, 0.3)
    first = td.decode_triton(q, k, v, sl, lp, ROWS, causal, 0.3)  # builds the plan
    assert len(td._PLANS) == 1
    again = td.decode_triton(q, k, v, sl, lp, ROWS, causal, 0.3)  # hits it
    assert len(td._PLANS) == 1
    _same(first, want)
    _same(again, want)
    no_lse = td.decode_triton(q, k, v, sl, lp, ROWS, causal, 0.3, need_lse=False)
    assert no_lse[1] is None and torch.equal(no_lse[0], want[0])
    assert len(td._PLANS) == 1  # need_lse is not part of the configuration


def test_plan_key_separates_what_the_binaries_depend_on(seed):
    td = _td()
    q, k, v, sl = _inputs()
    base = td.plan_key(q, k, v, sl, None, ROWS, True, 0.3)
    assert td.plan_key(q.clone(), k.clone(), v.clone(), sl.clone(), None, ROWS, True, 0.3) == base  # other data
    kbig = torch.randn(2, 40, 4, 16, device=DEV)
    k_wide = kbig[:, :, :2]  # same shape, other strides of the same specialisation classes
    assert k_wide.shape == k.shape and k_wide.stride() != k.stride()
    # the cache length and the caches' strides are passed per call: only their classes count
    assert td.plan_key(q, k_wide, kbig[:, :, 2:], sl, None, ROWS, True, 0.3) == base
    assert td.plan_key(q, k[:, :39], v[:, :39], sl, None, ROWS, True, 0.3) == base  # 40 -> 39
    kodd = torch.randn(2, 40, 2, 17, device=DEV)[..., :16]  # strides (1360, 34, 17, 1)
    others = [
        td.plan_key(q, kodd, v, sl, None, ROWS, True, 0.3),  # cache stride class
        td.plan_key(q, k, kodd, sl, None, ROWS, True, 0.3),  # v stride class
        td.plan_key(q, torch.randn(2, 40, 16, 2, device=DEV).transpose(2, 3), v, sl, None, ROWS, True, 0.3),  # headdim stride 2
        td.plan_key(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, sl, None, ROWS, True, 0.3),  # q stride
        td.plan_key(q.half(), k.half(), v.half(), sl, None, ROWS, True, 0.3),  # dtype
        td.plan_key(q, k[:, :32], v[:, :32], sl, None, ROWS, True, 0.3),  # cache length % 16 == 0
        td.plan_key(q, k[:, :1], v[:, :1], sl, None, ROWS, True, 0.3),  # cache length 1 (a constant)
        td.plan_key(q, k, v, sl, None, ROWS, False, 0.3),  # causal
        td.plan_key(q, k, v, sl, None, ROWS, True, 0.31),  # scale
        td.plan_key(q, k, v, sl, None, ROWS[:2], True, 0.3),  # branches
        td.plan_key(q, k, v, sl, sl, ROWS, True, 0.3),  # leftpad given
        td.plan_key(q, k, v, None, None, ROWS, True, 0.3),  # whole cache valid
        td.plan_key(q, k, v, sl, None, ROWS, True, 0.3, block_n=32),  # tuning knob
    ]
    assert all(o != base for o in others)
    assert len(set(others)) == len(others)


def test_plan_arguments_follow_the_kernel_signature(seed):
    # the argument list a plan hands to a launcher is Triton's: every parameter in signature
    # order, constexpr values included, with the per-call strides and sizes
    td = _td()
    td._PLANS.clear()
    q, k, v, sl = _inputs(b=2, nq=3, h=6, hkv=2, d=32, c=50, lens=(50, 31))
    kbig = torch.randn(2, 50, 5, 32, device=DEV)
    k = kbig[:, :, 1:3]  # a strided cache
    td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)
    plan = next(iter(td._PLANS.values()))
    names = list(td._decode_split_kernel.arg_names)
    tail = plan.split_tail(k, v)
    args = dict(zip(names, ("Q", "K", "V", "SEQLENS", "LEFTPAD", "BR", "OP", "LP") + tail, strict=True))
    assert (args["sqb"], args["sqt"], args["sqh"]) == q.stride()[:3]
    assert (args["skb"], args["skn"], args["skh"]) == k.stride()[:3]
    assert (args["svb"], args["svn"], args["svh"]) == v.stride()[:3]
    assert (args["T"], args["C"], args["H"], args["REP"], args["NB"]) == (3, 50, 6, 3, len(ROWS))
    assert (args["D"], args["CAUSAL"], args["HAS_LEFTPAD"], args["SEQ_FULL"], args["PREC"]) == (32, True, False, False, "ieee")
    # another cache of the plan's classes: its own length and strides in the same places
    k2, v2 = kbig[:, :45, 3:5], torch.randn(2, 61, 2, 32, device=DEV)[:, 16:]
    args2 = dict(zip(names, ("Q", "K", "V", "SEQLENS", "LEFTPAD", "BR", "OP", "LP") + plan.split_tail(k2, v2), strict=True))
    assert (args2["skb"], args2["skn"], args2["skh"], args2["svb"], args2["svn"], args2["svh"], args2["C"]) == (
        *k2.stride()[:3], *v2.stride()[:3], 45,
    )
    assert {n: a for n, a in args2.items() if n[:2] not in ("sk", "sv") and n != "C"} == {
        n: a for n, a in args.items() if n[:2] not in ("sk", "sv") and n != "C"
    }
    rnames = list(td._decode_reduce_kernel.arg_names)
    rargs = dict(zip(rnames, ("OP", "LP", "OUT", "LSE") + plan.reduce_tail, strict=True))
    assert (rargs["T"], rargs["H"], rargs["NS"]) == (3, 6, plan.nsplit)
    assert (rargs["sxb"], rargs["sxt"], rargs["sxh"]) == (3 * 6 * 32, 6 * 32, 32)
    # workspace regions: 512-byte aligned, disjoint
    assert plan.lp_off % 128 == 0 and plan.lse_off % 128 == 0
    assert plan.lp_off >= 2 * 3 * 6 * plan.nsplit * 32
    assert plan.lse_off >= plan.lp_off + 2 * 3 * 6 * plan.nsplit
    assert plan.ws_numel == plan.lse_off + 2 * 6 * 3


class _Recorder:
    """Stands in for Triton 3.6's C ``launch``: records (stream, kernel arguments)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *a):
        # grid x, y, z, stream, function, cooperative, pdl, 2 scratch, metadata, 3 hooks/metadata
        assert len(a) > 13 and a[:3] == (1, 1, 1) and a[4:13] == _POST
        self.calls.append((a[3], a[13:]))


_POST = ("function", False, False, None, None, "meta", None, None, None)


def _form(rec):
    """A ``direct_launch.launch_form`` around a recorder."""
    return rec, (1, 1, 1), _POST


def _fake_direct(monkeypatch, td, plan):
    """Give a CPU plan stand-in launchers (a CPU run cannot launch compiled kernels) and the
    device queries they need; returns the recorders. Triton's launch hooks are the real ones
    (none installed)."""
    from dilated_attention.kernels import direct_launch

    monkeypatch.setattr(direct_launch, "current_device", lambda: plan.dev_index)
    monkeypatch.setattr(direct_launch, "current_stream", lambda i: 1234)
    monkeypatch.setattr(direct_launch, "capturing", lambda: False)
    monkeypatch.setattr(td, "_WORKSPACES", {})
    plan.cuda = True  # the GPU branch (stream, reused workspace) on CPU tensors
    split, red = _Recorder(), _Recorder()
    plan._keep_launchers(_form(split), _form(red))
    return split, red


def test_aligned_call_takes_the_launchers_with_the_plan_arguments(seed, monkeypatch):
    td = _td()
    td._PLANS.clear()
    q, k, v, sl = _inputs()
    td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)
    plan = next(iter(td._PLANS.values()))
    split, red = _fake_direct(monkeypatch, td, plan)
    out, lse = td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)
    assert len(split.calls) == 1 and len(red.calls) == 1
    stream, args = split.calls[0]
    assert stream == 1234
    assert args[:5] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), sl.data_ptr(), sl.data_ptr())
    assert args[5] == plan.table_ptr and args[7] == args[6] + plan.lp_off * 4
    assert args[8:] == plan.split_tail(k, v)
    _, rargs = red.calls[0]
    assert rargs[:4] == (args[6], args[7], out.data_ptr(), lse.data_ptr())
    assert rargs[4:] == plan.reduce_tail
    # without lse: the reduction writes the LSE into the workspace's third region
    out2, lse2 = td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3, need_lse=False)
    assert lse2 is None and red.calls[-1][1][3] == split.calls[-1][1][6] + plan.lse_off * 4


@pytest.mark.parametrize("which", ["q", "k", "v", "seqlens", "leftpad"])
def test_misaligned_pointer_never_reaches_a_compiled_binary(seed, monkeypatch, which):
    td = _td()
    td._PLANS.clear()
    b, nq, h, hkv, d, c = 2, 1, 4, 2, 16, 40
    q, k, v, sl = _inputs(b=b, nq=nq, h=h, hkv=hkv, d=d, c=c)
    lp = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    td.decode_triton(q, k, v, sl, lp, ROWS, True, 0.3)
    plan = next(iter(td._PLANS.values()))
    split, red = _fake_direct(monkeypatch, td, plan)

    def shifted(t):  # the same shape and strides, data_ptr 4 bytes past a 16-byte boundary
        flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=DEV)
        view = flat[1 : 1 + t.numel()].view(t.shape)
        view.copy_(t)
        assert view.stride() == t.stride() and view.data_ptr() % 16 != 0
        return view

    args = dict(q=q, k=k, v=v, seqlens=sl, leftpad=lp)
    args[which] = shifted(args[which])
    assert td.plan_key(args["q"], args["k"], args["v"], args["seqlens"], args["leftpad"], ROWS, True, 0.3) in td._PLANS
    got = td.decode_triton(args["q"], args["k"], args["v"], args["seqlens"], args["leftpad"], ROWS, True, 0.3)
    assert split.calls == [] and red.calls == []  # Triton's path, not the plan's binaries
    _same(got, td.decode_triton_jit(q, k, v, sl, lp, ROWS, True, 0.3))


def test_direct_path_needs_idle_hooks_and_runs_on_the_plans_device(seed, monkeypatch):
    # Triton's own launch hooks (knobs.runtime): a HookChain with a hook, a hook of another kind
    # (a plain function, as older Tritons took), then none; another current device last
    td = _td()
    from triton import knobs

    td._PLANS.clear()
    q, k, v, sl = _inputs()
    want = td.decode_triton_jit(q, k, v, sl, None, ROWS, True, 0.3)
    td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)
    plan = next(iter(td._PLANS.values()))
    split, _ = _fake_direct(monkeypatch, td, plan)
    from dilated_attention.kernels import direct_launch

    rt = knobs.runtime
    assert direct_launch.hooks_idle() and not rt.launch_enter_hook.calls and not rt.launch_exit_hook.calls

    def hook(*a, **kw):
        pass

    for name in ("launch_enter_hook", "launch_exit_hook"):
        getattr(rt, name).add(hook)
        try:
            assert not direct_launch.hooks_idle()
            _same(td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3), want)  # Triton's path
        finally:
            getattr(rt, name).remove(hook)
        assert split.calls == [], name
        chain = getattr(rt, name)
        monkeypatch.setattr(rt, name, hook)  # not a HookChain: the general answer (not idle)
        assert not direct_launch.hooks_idle()
        _same(td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3), want)
        assert split.calls == [], name
        monkeypatch.setattr(rt, name, chain)
    td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)  # no hook: the direct launch
    assert len(split.calls) == 1
    # another current device: the call switches to the plan's (the device guard), launches
    # directly there, and leaves the current device as it found it
    sw = device_switch(monkeypatch, plan.dev_index + 1)
    td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)
    assert len(split.calls) == 2 and sw.entered == [plan.dev_index] and sw.current == plan.dev_index + 1


def test_workspace_reused_per_stream_fresh_while_capturing(seed, monkeypatch):
    # the GPU branch of DecodePlan.workspace on CPU tensors: stand-in stream and capture queries
    td = _td()
    from dilated_attention.kernels import direct_launch

    td._PLANS.clear()
    td._WORKSPACES.clear()
    q, k, v, sl = _inputs()
    want = td.decode_triton_jit(q, k, v, sl, None, ROWS, True, 0.3)
    td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)
    plan = next(iter(td._PLANS.values()))
    plan.cuda = True  # the GPU branch; the launches stay the interpreter's
    stream = [7]
    capturing = [False]
    monkeypatch.setattr(direct_launch, "current_stream", lambda i: stream[0])
    monkeypatch.setattr(direct_launch, "capturing", lambda: capturing[0])
    monkeypatch.setattr(direct_launch, "current_device", lambda: plan.dev_index)
    seen = []
    orig = plan._launch_jit.__func__

    def spy(self, ws, *a):
        seen.append(ws.data_ptr())
        return orig(self, ws, *a)

    monkeypatch.setattr(td.DecodePlan, "_launch_jit", spy)
    got = [td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3) for _ in range(2)]
    stream[0] = 8
    got.append(td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3))
    assert seen[0] == seen[1] != seen[2]  # one workspace per stream, reused
    assert len(td._WORKSPACES) == 2
    capturing[0] = True
    got.append(td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3))
    got.append(td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3, reuse_workspace=False))
    assert len(td._WORKSPACES) == 2 and seen[3] not in seen[:3]  # capture: a fresh buffer
    for g in got:
        _same(g, want)
    td._WORKSPACES.clear()


def test_direct_launch_keeps_its_streams_workspace(seed, monkeypatch):
    # on the direct path a plan keeps the workspace of its last eager stream (no lookup per
    # call), takes the table's buffer again when the stream changes or the table was replaced
    # (holding the old one until then), and never keeps a capture's fresh buffer
    import gc
    import weakref

    td = _td()
    from dilated_attention.kernels import direct_launch

    td._PLANS.clear()
    monkeypatch.setattr(td, "_WS_EPOCH", td._WS_EPOCH)
    q, k, v, sl = _inputs()
    td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)
    plan = next(iter(td._PLANS.values()))
    split, _ = _fake_direct(monkeypatch, td, plan)
    stream, capturing, lookups = [7], [False], []
    monkeypatch.setattr(direct_launch, "current_stream", lambda i: stream[0])
    monkeypatch.setattr(direct_launch, "capturing", lambda: capturing[0])
    orig = td._workspace
    monkeypatch.setattr(td, "_workspace", lambda *a: lookups.append(a[1]) or orig(*a))

    def ws_ptr():  # the workspace pointer the last direct launch got (its 7th pointer)
        return split.calls[-1][1][6]

    def call():
        td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)
        return ws_ptr()

    def table_buffer(st):
        return td._WORKSPACES[(plan.dev_index, st, plan.ws_numel)]

    a = call()
    assert call() == a and lookups == [7]  # kept: one lookup for two calls
    assert a == table_buffer(7).data_ptr()
    stream[0] = 8
    b = call()
    assert b != a and lookups == [7, 8] and b == table_buffer(8).data_ptr()
    stream[0] = 7
    assert call() == a and lookups == [7, 8, 7]  # the table's buffer of stream 7 again
    capturing[0] = True
    c = call()
    assert c not in (a, b) and lookups == [7, 8, 7]  # a fresh buffer, not kept
    capturing[0] = False
    assert call() == a and lookups == [7, 8, 7]
    # the table replaced (full, by another plan's stream): the plan still holds its buffer, then
    # takes one of the new table
    old = weakref.ref(table_buffer(7))
    monkeypatch.setattr(td, "_MAX_WORKSPACES", 2)
    epoch = td._WS_EPOCH
    orig(plan.dev_index, 9, plan.ws_numel, plan.device)
    assert td._WS_EPOCH == epoch + 1 and (plan.dev_index, 7, plan.ws_numel) not in td._WORKSPACES
    gc.collect()
    assert old() is not None and plan.ws_state[2] is old()  # held by the plan: never freed under it
    call()
    assert lookups == [7, 8, 7, 7] and plan.ws_state[2] is table_buffer(7)
    gc.collect()
    assert old() is None  # dropped once the plan took the new table's buffer
    assert len(split.calls) == 7


def test_workspace_table_is_replaced_when_full(seed, monkeypatch):
    td = _td()
    monkeypatch.setattr(td, "_WORKSPACES", {})
    monkeypatch.setattr(td, "_WS_EPOCH", td._WS_EPOCH)
    monkeypatch.setattr(td, "_MAX_WORKSPACES", 2)
    first, epoch = td._WORKSPACES, td._WS_EPOCH
    a = td._workspace(-1, 1, 64, torch.device(DEV))
    assert td._workspace(-1, 1, 64, torch.device(DEV)) is a
    td._workspace(-1, 2, 64, torch.device(DEV))
    assert td._WORKSPACES is first and len(first) == 2 and td._WS_EPOCH == epoch
    td._workspace(-1, 3, 64, torch.device(DEV))
    assert td._WORKSPACES is not first and len(td._WORKSPACES) == 1  # a new table, the old one left as it was
    assert len(first) == 2 and first[(-1, 1, 64)] is a and td._WS_EPOCH == epoch + 1


def test_launchers_kept_only_from_an_aligned_call_on_the_tensors_device(seed, monkeypatch):
    # a plan keeps the binaries of its first launch only when they carry its specialisation:
    # every pointer aligned and compiled for the tensors' device (Triton uses the current one)
    td = _td()
    from dilated_attention.kernels import direct_launch

    td._PLANS.clear()
    q, k, v, sl = _inputs()
    key = td.plan_key(q, k, v, sl, None, ROWS, True, 0.3)
    plan = td.get_plan(key, q, k, v, sl, None, ROWS, True, 0.3)
    plan.cuda = True
    dev = [plan.dev_index + 1]
    made = []
    monkeypatch.setattr(direct_launch, "current_device", lambda: dev[0])
    monkeypatch.setattr(direct_launch, "current_stream", lambda i: 5)
    monkeypatch.setattr(direct_launch, "capturing", lambda: False)
    monkeypatch.setattr(direct_launch, "launch_form", lambda ck, grid: made.append(grid) or _form(_Recorder()))
    monkeypatch.setattr(td, "_WORKSPACES", {})
    td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)  # foreign current device
    assert made == [] and plan.split_go is None
    dev[0] = plan.dev_index
    flat = torch.empty(q.numel() + 8, dtype=q.dtype, device=DEV)
    qm = flat[1 : 1 + q.numel()].view(q.shape)
    qm.copy_(q)
    td.decode_triton(qm, k, v, sl, None, ROWS, True, 0.3)  # misaligned q
    assert made == [] and plan.split_go is None
    td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)
    assert made == [plan.split_grid, plan.reduce_grid] and plan.split_go is not None


def test_plans_are_bounded(seed, monkeypatch):
    td = _td()
    td._PLANS.clear()
    monkeypatch.setattr(td, "_MAX_PLANS", 3)
    q, k, v, sl = _inputs(b=1, nq=1, lens=(30,))
    for scale in (0.1, 0.2, 0.3, 0.4, 0.5):
        td.decode_triton(q, k, v, sl, None, ROWS[:1], True, scale)
    assert len(td._PLANS) == 3
    assert [key[9] for key in td._PLANS] == [0.3, 0.4, 0.5]  # the oldest went first


# ------------------------------------------------------------------------------ public routes


def test_public_routes_reach_one_plan(seed, monkeypatch):
    td = _td()
    td._PLANS.clear()
    seg, dil = [8, 16], [1, 2]
    q, k, v, _ = _inputs(b=1, nq=1, lens=(40,))
    got = [dilated_attention(q, k, v, seg, dil, causal=True, impl="triton", return_lse=True) for _ in range(2)]
    assert len(td._PLANS) == 1  # dilated_attention(q_one_row, k, v): the whole-cache plan
    got += [dilated_attention_with_kvcache(q, k, v, 40, seg, dil, causal=True, impl="triton", return_lse=True) for _ in range(2)]
    assert len(td._PLANS) == 2  # the kv-cache route reads cache_seqlens: its own plan
    ref = dilated_attention(q.double(), k.double(), v.double(), seg, dil, causal=True, impl="reference", return_lse=True)
    for o, lse in got:
        torch.testing.assert_close(o.double(), ref[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(lse.double(), ref[1].double(), atol=1e-5, rtol=0)
    _same(got[0], got[2])
    # without return_lse the plan still runs (the LSE goes to its workspace)
    out = dilated_attention(q, k, v, seg, dil, causal=True, impl="triton")
    assert torch.equal(out, got[0][0])


def test_auto_decode_route_uses_the_decode_rule(seed, monkeypatch):
    # impl="auto" with a decode-shaped call: the decode route's rule (pick_decode_impl("auto"):
    # the Triton decode kernel on CUDA), never the dense rule measured on training calls
    from dilated_attention import api

    picked, dense = [], []
    orig = api.pick_decode_impl
    monkeypatch.setattr(api, "pick_decode_impl", lambda impl, q: picked.append(impl) or orig(impl, q))
    monkeypatch.setattr(api, "pick_impl", lambda *a, **kw: dense.append(1) or "torch")
    q, k, v, _ = _inputs(b=1, nq=1, lens=(40,))
    dilated_attention(q, k, v, [8, 16], [1, 2], causal=True)
    assert picked == ["auto"] and dense == []
    # an explicit impl too: the decode rule alone decides (pick_decode_impl raises where the
    # decode kernel cannot run; the fused kernel's limits do not apply to the decode route)
    dilated_attention(q, k, v, [8, 16], [1, 2], causal=True, impl="torch")
    assert picked == ["auto", "torch"] and dense == []
    with pytest.raises(ValueError, match="impl='triton' cannot run here"):
        dilated_attention(q.double(), k.double(), v.double(), [8, 16], [1, 2], causal=True, impl="triton")


def test_switch_routes_to_the_per_call_path(seed, monkeypatch):
    td = _td()
    calls = []
    orig = td.decode_triton_jit
    monkeypatch.setattr(td, "decode_triton_jit", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    q, k, v, sl = _inputs()
    on = dilated_attention_with_kvcache(q, k, v, sl, [8, 16], [1, 2], impl="triton", return_lse=True)
    assert calls == []
    flags.set_direct_launch(False)
    off = dilated_attention_with_kvcache(q, k, v, sl, [8, 16], [1, 2], impl="triton", return_lse=True)
    assert calls == [1]
    _same(on, off)
    monkeypatch.setenv(flags.ENV_DIRECT_LAUNCH, "0")
    flags.set_direct_launch(None)  # the environment, read at the next call
    assert not flags.direct_launch_enabled()
    monkeypatch.setenv(flags.ENV_DIRECT_LAUNCH, "1")
    assert not flags.direct_launch_enabled()  # not re-read on every call
    flags.set_direct_launch(None)
    assert flags.direct_launch_enabled()
    monkeypatch.delenv(flags.ENV_DIRECT_LAUNCH)
    flags.set_direct_launch(None)
    assert flags.direct_launch_enabled()  # on unless turned off (verified on an H100, 2026-11-25)
    with pytest.raises(TypeError, match="set_direct_launch"):
        flags.set_direct_launch("no")


# ------------------------------------------------------------------------------ the launcher builder


class _FakeLauncher:
    """Stands in for Triton 3.6's ``CudaLauncher`` (class name and attributes)."""

    def __init__(self):
        self.global_scratch_size = 0
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = False
        self.calls = []
        self.launch = lambda *a: self.calls.append(a)


_FakeLauncher.__name__ = "CudaLauncher"


class _FakeCompiled:
    def __init__(self):
        self.function = 77
        self.packed_metadata = (4, 1, 0)
        self._run = _FakeLauncher()

    @property
    def run(self):
        return self._run


def test_launcher_passes_triton_36_layout(monkeypatch):
    from dilated_attention.kernels import direct_launch

    monkeypatch.setattr(direct_launch, "unavailable_reason", lambda: None)
    ck = _FakeCompiled()
    go = direct_launch.launcher(ck, (5, 3))
    assert go is not None
    go(999, (10, 20, 1.5, "tf32"))
    # Triton 3.6 (JITFunction.run / CompiledKernel.__getitem__ with no hook): grid x, y, z,
    # stream, function, cooperative, pdl, global scratch, profile scratch, packed metadata,
    # launch metadata, enter hook, exit hook, then every kernel argument
    assert ck.run.calls == [(5, 3, 1, 999, 77, False, False, None, None, (4, 1, 0), None, None, None, 10, 20, 1.5, "tf32")]


def test_launch_form_is_the_launchers_call_inlined(monkeypatch):
    # DecodePlan.launch calls launch(*pre, stream, *post, *args) itself: the same C call as go()
    from dilated_attention.kernels import direct_launch

    monkeypatch.setattr(direct_launch, "unavailable_reason", lambda: None)
    ck = _FakeCompiled()
    ck.run.launch_pdl = True  # cooperative and PDL told apart
    direct_launch.launcher(ck, (5, 3))(999, (10, 20, 1.5, "tf32"))
    launch, pre, post = direct_launch.launch_form(ck, (5, 3))
    assert launch is ck.run.launch and pre == (5, 3, 1)
    launch(*pre, 999, *post, 10, 20, 1.5, "tf32")
    # Triton 3.6's layout (see test_launcher_passes_triton_36_layout), both ways
    want = (5, 3, 1, 999, 77, False, True, None, None, (4, 1, 0), None, None, None, 10, 20, 1.5, "tf32")
    assert ck.run.calls == [want, want]


def test_launcher_refuses_what_it_cannot_launch(monkeypatch):
    from dilated_attention.kernels import direct_launch

    for build in (direct_launch.launcher, direct_launch.launch_form):
        monkeypatch.undo()
        assert build(None, (1,)) is None  # the interpreter returns no kernel
        monkeypatch.setattr(direct_launch, "unavailable_reason", lambda: None)
        ck = _FakeCompiled()
        ck.run.global_scratch_size = 128
        assert build(ck, (1,)) is None  # needs scratch memory: Triton's path
        ck = _FakeCompiled()
        ck._run = object()  # another launcher class
        assert build(ck, (1,)) is None


class _JitSpy:
    """Stands in for a ``triton.jit`` kernel on a GPU: runs the interpreted kernel and returns a
    stand-in ``CompiledKernel``, recording the arguments Triton's path received."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls = []
        self.compiled = _FakeCompiled()

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            self.kernel[grid](*args, **kwargs)
            return self.compiled

        return call


@pytest.mark.parametrize("need_lse", [True, False])
def test_direct_launch_repeats_tritons_arguments(seed, monkeypatch, need_lse):
    # end to end on stand-ins: the plan's first call goes through "Triton" (a spy), whose
    # compiled kernel is then launched directly; the direct launch must pass, position by
    # position, what Triton's path was given (tensors as their data pointers)
    td = _td()
    from dilated_attention.kernels import direct_launch

    td._PLANS.clear()
    q, k, v, sl = _inputs()
    lp = torch.tensor([1, 0], dtype=torch.int32, device=DEV)
    split, red = _JitSpy(td._decode_split_kernel), _JitSpy(td._decode_reduce_kernel)
    monkeypatch.setattr(td, "_decode_split_kernel", split)
    monkeypatch.setattr(td, "_decode_reduce_kernel", red)
    monkeypatch.setattr(direct_launch, "unavailable_reason", lambda: None)
    monkeypatch.setattr(direct_launch, "current_stream", lambda i: 3)
    monkeypatch.setattr(direct_launch, "capturing", lambda: False)
    monkeypatch.setattr(direct_launch, "hooks_idle", lambda: True)
    monkeypatch.setattr(td, "_WORKSPACES", {})
    key = td.plan_key(q, k, v, sl, lp, ROWS, True, 0.3)
    plan = td.get_plan(key, q, k, v, sl, lp, ROWS, True, 0.3)
    plan.cuda = True
    monkeypatch.setattr(direct_launch, "current_device", lambda: plan.dev_index)
    first = td.decode_triton(q, k, v, sl, lp, ROWS, True, 0.3, need_lse=need_lse)
    assert plan.split_go is not None and len(split.calls) == 1
    td.decode_triton(q, k, v, sl, lp, ROWS, True, 0.3, need_lse=need_lse)
    assert len(split.calls) == 1 and len(red.calls) == 1  # the second call did not use Triton's path
    as_ptr = lambda a: a.data_ptr() if isinstance(a, torch.Tensor) else a  # noqa: E731
    for spy in (split, red):
        grid, jit_args, _ = spy.calls[0]
        (direct,) = spy.compiled.run.calls
        g = tuple(grid) + (1,) * (3 - len(grid))
        assert direct[:13] == (*g, 3, 77, False, False, None, None, (4, 1, 0), None, None, None)
        want = tuple(as_ptr(a) for a in jit_args)
        got = direct[13:]
        assert len(got) == len(want) == len(spy.kernel.arg_names)
        if spy is split:
            assert got == want  # same workspace (one per stream), same inputs
        else:  # out (and lse, if asked for) are fresh per call
            fresh = {2, 3} if need_lse else {2}
            assert all(got[i] == want[i] for i in range(len(want)) if i not in fresh)
    ref = td.decode_triton_jit(q, k, v, sl, lp, ROWS, True, 0.3)
    assert torch.equal(first[0], ref[0])


def test_direct_launch_of_a_growing_cache_passes_each_steps_length_and_strides(seed, monkeypatch):
    # a cache that grows by views of one buffer, then by fresh tensors (whose batch stride grows
    # too): the plan of the first step launches its kept binary on every later step of the same
    # specialisation classes, with that step's cache pointers, length and strides: parameter by
    # parameter what Triton's own path gets for that step. A length of another class (32) takes
    # Triton's path, through a plan of its own.
    td = _td()
    from dilated_attention.kernels import direct_launch

    td._PLANS.clear()
    q, kb, vb, sl = _inputs(b=2, nq=1, c=40, lens=(17, 20))
    split, red = _JitSpy(td._decode_split_kernel), _JitSpy(td._decode_reduce_kernel)
    monkeypatch.setattr(td, "_decode_split_kernel", split)
    monkeypatch.setattr(td, "_decode_reduce_kernel", red)
    monkeypatch.setattr(direct_launch, "unavailable_reason", lambda: None)
    monkeypatch.setattr(direct_launch, "current_stream", lambda i: 3)
    monkeypatch.setattr(direct_launch, "capturing", lambda: False)
    monkeypatch.setattr(direct_launch, "hooks_idle", lambda: True)
    monkeypatch.setattr(td, "_WORKSPACES", {})
    k, v = kb[:, :20], vb[:, :20]
    plan = td.get_plan(td.plan_key(q, k, v, sl, None, ROWS, True, 0.3), q, k, v, sl, None, ROWS, True, 0.3)
    plan.cuda = True
    monkeypatch.setattr(direct_launch, "current_device", lambda: plan.dev_index)
    td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)  # Triton's path: keeps the binary
    assert plan.split_go is not None and len(split.calls) == 1
    names = list(split.kernel.arg_names)
    steps = [(kb[:, :n], vb[:, :n]) for n in (21, 22, 23)]
    steps += [(torch.randn(2, n, 2, 16, device=DEV), torch.randn(2, n, 2, 16, device=DEV)) for n in (24, 25)]
    for k, v in steps:
        n = k.shape[1]
        td.decode_triton(q, k, v, sl, None, ROWS, True, 0.3)
        assert len(split.calls) == 1 and len(td._PLANS) == 1, n  # the direct launch, the same plan
        direct = dict(zip(names, split.compiled.run.calls[-1][13:], strict=True))
        td.decode_triton_jit(q, k, v, sl, None, ROWS, True, 0.3)  # what Triton's path gets
        _, jit_args, jit_kw = split.calls.pop()
        jit = dict(zip(names, jit_args, strict=False)) | {a: jit_kw[a] for a in names if a in jit_kw}  # constexprs by name
        assert (direct["C"], direct["skb"], direct["svb"]) == (n, k.stride(0), v.stride(0))
        for a in names:
            if a in ("OP", "LP"):  # the plan's workspace, the per-call path's fresh buffers
                continue
            want = jit[a].data_ptr() if isinstance(jit[a], torch.Tensor) else jit[a]
            assert direct[a] == want, (n, a)
    td.decode_triton(q, kb[:, :32], vb[:, :32], sl, None, ROWS, True, 0.3)  # C % 16 == 0
    assert len(split.calls) == 2 and len(td._PLANS) == 2


def test_this_process_reports_why_it_cannot_launch_directly():
    from dilated_attention.kernels import direct_launch

    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert isinstance(direct_launch.unavailable_reason(), str)  # interpreter: the plans use Triton's path
    assert isinstance(direct_launch.hooks_idle(), bool)


# ------------------------------------------------------------------------------ GPU: direct vs JIT


def _cuda_cases():
    g = torch.Generator(device="cuda").manual_seed(0)
    seg, dil = [2048, 4096, 8192], [1, 2, 4]
    cases = []
    for b, nq, h, hkv, d, c, dt in [
        (1, 1, 32, 8, 128, 4096, torch.bfloat16),
        (2, 3, 8, 8, 64, 10000, torch.float16),
        (3, 1, 12, 4, 128, 9000, torch.float32),
    ]:
        q = torch.randn(b, nq, h, d, dtype=dt, device="cuda", generator=g)
        k = torch.randn(b, c, hkv, d, dtype=dt, device="cuda", generator=g)
        v = torch.randn(b, c, hkv, d, dtype=dt, device="cuda", generator=g)
        sl = torch.randint(nq, c + 1, (b,), dtype=torch.int32, device="cuda", generator=g)
        cases.append((f"{b}x{nq}x{h}/{hkv}x{d} {dt}", q, k, v, sl))
    # a non-contiguous cache (heads of a wider buffer, (batch, heads, seq, d) storage)
    q, k, v, sl = cases[0][1:]
    kw = torch.randn(1, 16, 4096, 128, dtype=torch.bfloat16, device="cuda", generator=g).transpose(1, 2)[:, :, 4:12]
    vw = torch.randn(1, 16, 4096, 128, dtype=torch.bfloat16, device="cuda", generator=g).transpose(1, 2)[:, :, 2:10]
    cases.append(("strided cache", q, kw, vw, sl))
    # misaligned views (2 bytes past a 16-byte boundary)
    flat = torch.empty(q.numel() + 8, dtype=q.dtype, device="cuda")
    qm = flat[1 : 1 + q.numel()].view(q.shape)
    qm.copy_(q)
    cases.append(("misaligned q", qm, k, v, sl))
    flatk = torch.empty(k.numel() + 8, dtype=k.dtype, device="cuda")
    km = flatk[8 : 8 + k.numel()].view(k.shape)  # 16 bytes: aligned again
    km.copy_(k)
    cases.append(("shifted but aligned k", q, km, v, sl))
    return seg, dil, cases


@pytest.mark.cuda
def test_cuda_direct_launch_equals_triton_launch():
    td = _td()
    from dilated_attention.kernels import direct_launch

    seg, dil, cases = _cuda_cases()
    td._PLANS.clear()
    for name, q, k, v, sl in cases:
        for causal in (True, False):
            for full in (False, True):
                for _ in range(2):  # build the plan, then hit it
                    flags.set_direct_launch(True)
                    got = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=causal, return_lse=True) if not full else dilated_attention(q, k, v, seg, dil, causal=causal, return_lse=True, impl="triton")
                    flags.set_direct_launch(False)
                    want = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=causal, return_lse=True) if not full else dilated_attention(q, k, v, seg, dil, causal=causal, return_lse=True, impl="triton")
                    assert torch.equal(got[0], want[0]), (name, causal, full)
                    assert torch.equal(got[1], want[1]), (name, causal, full)
                    flags.set_direct_launch(True)
                    no_lse = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=causal) if not full else dilated_attention(q, k, v, seg, dil, causal=causal, impl="triton")
                    assert torch.equal(no_lse, want[0]), (name, causal, full)  # the LSE in the workspace
    flags.set_direct_launch(None)
    if direct_launch.unavailable_reason() is None:
        # every aligned plan found its compiled kernels' launchers
        assert all(p.split_go is not None for p in td._PLANS.values()), [
            (k[0], k[1]) for k, p in td._PLANS.items() if p.split_go is None
        ]
    else:
        pytest.skip(f"direct launch unavailable here: {direct_launch.unavailable_reason()}")


@pytest.mark.cuda
def test_cuda_two_streams_and_graph_capture():
    # workspaces per stream: interleaved calls on two streams give the single-stream bits; a
    # captured call (its own workspace) replays to the eager bits
    _td()
    seg, dil, cases = _cuda_cases()
    _, q, k, v, sl = cases[0]
    want = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(4):
        with torch.cuda.stream(s1):
            outs.append(dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True))
        with torch.cuda.stream(s2):
            outs.append(dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True))
    torch.cuda.synchronize()
    for o in outs:
        assert torch.equal(o[0], want[0]) and torch.equal(o[1], want[1])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        og, lg = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True)
    eager = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True)  # reuses the eager workspace
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(og, want[0]) and torch.equal(lg, want[1]) and torch.equal(eager, want[0])


@pytest.mark.cuda
def test_cuda_plans_keep_workspaces_across_streams_and_table_replacements(monkeypatch):
    # two plans (both front doors) on three streams, with a table of two workspaces: every call
    # takes another stream's buffer or a replaced table's, the plans' kept buffers change hands;
    # every result must be the single-stream one, bit for bit, and no output is overwritten later
    td = _td()
    seg, dil, cases = _cuda_cases()
    _, q, k, v, sl = cases[0]
    want_kv = dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True)
    want_da = dilated_attention(q, k, v, seg, dil, causal=True, return_lse=True, impl="triton")
    monkeypatch.setattr(td, "_MAX_WORKSPACES", 2)
    epoch = td._WS_EPOCH
    streams = [torch.cuda.Stream() for _ in range(3)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for i in range(12):
        with torch.cuda.stream(streams[i % 3]):
            outs.append(("kv", dilated_attention_with_kvcache(q, k, v, sl, seg, dil, causal=True, return_lse=True)))
        with torch.cuda.stream(streams[(i + 1) % 3]):
            outs.append(("da", dilated_attention(q, k, v, seg, dil, causal=True, return_lse=True, impl="triton")))
    torch.cuda.synchronize()
    assert td._WS_EPOCH > epoch  # the table was replaced while plans held its buffers
    for route, (o, lse) in outs:
        w = want_kv if route == "kv" else want_da
        assert torch.equal(o, w[0]) and torch.equal(lse, w[1]), route


# ------------------------------------------------------------------------------ the A/B script


def test_ab_decode_tiny_runs(tmp_path):
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    out = tmp_path / "ab.md"
    res = subprocess.run(
        [sys.executable, str(root / "benchmarks/ab_decode.py"), "--tiny", "--iters", "1", "--rounds", "1",
         "--warmup", "0", "--caches", "64", "--no-train", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    text = out.read_text()
    assert "| 64 | kvcache |" in text and "| 64 | dilated_attention |" in text
    assert "plans with launchers" in text and "wrote" in res.stdout


@pytest.mark.parametrize("script", ["host_cost_decode_cpu.py", "host_parts_decode.py"])
def test_host_cost_scripts_tiny_runs(script):
    # the host-cost scripts stand in for the plans' launches and device queries on the CPU:
    # they follow DecodePlan's internals, so a change there must keep them running
    import os
    import pathlib
    import subprocess
    import sys

    if torch.cuda.is_available() and script == "host_parts_decode.py":
        pytest.skip("on a GPU this script times the real calls: run it by hand")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root / "src"), TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, str(root / "benchmarks" / script), "--calls", "40", "--rounds", "1", "--cache", "256"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 8, res.stdout
    if script == "host_cost_decode_cpu.py":  # the calls per call of a steady kv call (test_decode_fast's bound)
        row = next(r for r in rows if r.startswith("| with_kvcache triton |"))
        assert int(row.split("|")[4]) <= 25, row


# ------------------------------------------------------------------------------ training launches (DirectKernel)


class _FakeJit:
    """A stand-in ``triton.jit`` kernel with parameters (A, B, n, s, BLOCK): records Triton's
    path and returns a stand-in compiled kernel."""

    arg_names = ["A", "B", "n", "s", "BLOCK"]

    def __init__(self):
        self.calls = []
        self.compiled = _FakeCompiled()

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw)) or self.compiled


def _direct_kernel(monkeypatch):
    from dilated_attention.kernels import direct_launch

    monkeypatch.setattr(direct_launch, "tensor_device", lambda t: 0)
    monkeypatch.setattr(direct_launch, "current_device", lambda: 0)
    monkeypatch.setattr(direct_launch, "current_stream", lambda i: 9)
    monkeypatch.setattr(direct_launch, "hooks_idle", lambda: True)
    monkeypatch.setattr(direct_launch, "unavailable_reason", lambda: None)
    fake = _FakeJit()
    return fake, direct_launch.DirectKernel(fake, 2, max_plans=4)


def test_direct_kernel_launches_what_triton_was_given(monkeypatch):
    fake, dk = _direct_kernel(monkeypatch)
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.float16)
    dk[(3, 2)](a, b, 5, 7, BLOCK=16, num_warps=4)  # Triton's path, the compiled kernel kept
    dk[(3, 2)](a, b, 5, 7, BLOCK=16, num_warps=4)  # direct
    assert len(fake.calls) == 1
    (direct,) = fake.compiled.run.calls
    assert direct == (3, 2, 1, 9, 77, False, False, None, None, (4, 1, 0), None, None, None,
                      a.data_ptr(), b.data_ptr(), 5, 7, 16)  # fmt: skip


def test_direct_kernel_key_misses(monkeypatch):
    fake, dk = _direct_kernel(monkeypatch)
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.float16)
    dk[(3, 2)](a, b, 5, 7, BLOCK=16, num_warps=4)
    variants = [
        ((3, 2), (a, b, 5, 8), dict(BLOCK=16, num_warps=4)),  # an integer argument
        ((3, 2), (a, b, 5, 7), dict(BLOCK=32, num_warps=4)),  # a constexpr
        ((3, 2), (a, b, 5, 7), dict(BLOCK=16, num_warps=8)),  # a launch option
        ((3, 2), (a, b.float(), 5, 7), dict(BLOCK=16, num_warps=4)),  # a dtype
        ((4, 2), (a, b, 5, 7), dict(BLOCK=16, num_warps=4)),  # the grid
    ]
    for grid, args, kw in variants:
        n = len(fake.calls)
        dk[grid](*args, **kw)
        assert len(fake.calls) == n + 1  # a new key: Triton's path
    assert fake.compiled.run.calls == []
    assert len(dk.plans) == 4  # bounded: the oldest key went
    # a misaligned tensor takes Triton's path even for a known key
    flat = torch.zeros(80)
    am = flat[1:65]
    assert am.data_ptr() % 16 != 0
    n = len(fake.calls)
    dk[(4, 2)](am, b, 5, 7, BLOCK=16, num_warps=4)
    assert len(fake.calls) == n + 1 and fake.compiled.run.calls == []


def test_direct_kernel_switch_and_unknown_layouts(monkeypatch):
    fake, dk = _direct_kernel(monkeypatch)
    a, b = torch.zeros(64), torch.zeros(64)
    flags.set_direct_launch(False)
    dk[(1,)](a, b, 5, 7, BLOCK=16)
    dk[(1,)](a, b, 5, 7, BLOCK=16)
    assert len(fake.calls) == 2 and dk.plans == {}
    flags.set_direct_launch(None)
    dk[(1,)](a, b, 5, 7)  # BLOCK left to its default: no argument list to keep
    dk[(1,)](a, b, 5, 7)
    assert len(fake.calls) == 4 and fake.compiled.run.calls == []
    dk[(1,)](a, b, 5, a, BLOCK=16)  # a tensor after the first n_ptr arguments
    dk[(1,)](a, b, 5, a, BLOCK=16)
    assert len(fake.calls) == 6 and fake.compiled.run.calls == []


def _train_case(g, b, n, h, hkv, d, dt, kpm):
    q = torch.randn(b, n, h, d, dtype=dt, device="cuda", generator=g, requires_grad=True)
    k = torch.randn(b, n, hkv, d, dtype=dt, device="cuda", generator=g, requires_grad=True)
    v = torch.randn(b, n, hkv, d, dtype=dt, device="cuda", generator=g, requires_grad=True)
    do = torch.randn(b, n, h, d, dtype=dt, device="cuda", generator=g)
    mask = (torch.rand(b, n, device="cuda", generator=g) < 0.1) if kpm else None
    return q, k, v, do, mask


@pytest.mark.cuda
def test_cuda_training_direct_launch_equals_triton_launch():
    from dilated_attention.kernels import direct_launch, triton_launch

    if direct_launch.unavailable_reason() is not None:
        pytest.skip(f"direct launch unavailable here: {direct_launch.unavailable_reason()}")
    g = torch.Generator(device="cuda").manual_seed(0)
    seg, dil = [512, 1024, 2048], [1, 2, 4]
    for b, n, h, hkv, d, dt, kpm in [
        (1, 4096, 8, 8, 64, torch.bfloat16, False),
        (2, 2048, 8, 2, 128, torch.float16, True),
        (1, 2048, 4, 4, 32, torch.float32, False),
    ]:
        q, k, v, do, mask = _train_case(g, b, n, h, hkv, d, dt, kpm)
        for causal in (True, False):
            res = {}
            for direct in (True, False, True):  # the first True builds the plans, the last hits them
                flags.set_direct_launch(direct)
                out, lse = dilated_attention(q, k, v, seg, dil, causal=causal, key_padding_mask=mask,
                                             impl="triton", return_lse=True)  # fmt: skip
                grads = torch.autograd.grad(out, (q, k, v), do)
                res.setdefault(direct, []).append((out, lse, *grads))
            flags.set_direct_launch(None)
            want = res[False][0]
            for got in res[True]:
                for x, y in zip(got, want, strict=True):
                    assert torch.equal(x, y), (b, n, h, hkv, d, dt, kpm, causal)
    assert any(p for p in triton_launch._FWD.plans.values()) or any(p for p in triton_launch._FWD_FOLDED.plans.values())
    assert any(p for p in triton_launch._DKDV.plans.values()) and any(p for p in triton_launch._DQ.plans.values())
