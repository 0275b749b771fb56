"""benchmarks/profile_step.py (issue 23 item 5: where the eager LongNet step loses to compiled):
its kernel / op classifier on the names a CUDA profile gives, and the whole script at CPU size
(--tiny: eager, compiled with aot_eager and the dense baseline profiled, CPU ops for kernels)."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_step  # noqa: E402


@pytest.mark.parametrize("name, origin, want", [
    ("dilated_fwd_kernel", "DilatedAttention", "attention"),
    ("dilated_bwd_dkdv_kernel", "bwd _EagerFusedBackward", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>(Flash_fwd_params)", "DilatedAttention", "attention"),
    ("_rotary_kernel", "rotary", "rotary"),
    ("_ce_loss_grad_kernel", "loss", "cross-entropy"),
    ("_ce_loss_grad_kernel", "unattributed", "cross-entropy"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "Linear", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "bwd Linear", "gemm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float)", "LayerNorm", "layernorm"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float>(long)", "bwd LayerNorm", "layernorm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)>", "Linear", "cast/copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "bwd torch::autograd::AccumulateGrad", "grad accumulation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "Block", "residual/other elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "FeedForward", "gelu"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float>", "ce", "cross-entropy"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "bwd ce", "cross-entropy"),
    ("void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>>", "optimizer", "optimizer"),
    ("void at::native::(anonymous namespace)::fused_adamw_kernel", "optimizer", "optimizer"),
    ("Memset (Device)", "zero_grad", "optimizer"),
    ("Memset (Device)", "bwd Linear", "memset/fill"),
    ("Memcpy HtoD (Pageable -> Device)", "unattributed", "memcpy"),
    ("triton_per_fused__log_softmax__to_copy_nll_loss_forward_3", "unattributed", "cross-entropy"),
    ("triton_red_fused_native_layer_norm_native_layer_norm_backward_7", "unattributed", "layernorm"),
    ("triton_poi_fused__to_copy_cat_mul_neg_5", "unattributed", "rotary"),
    ("triton_poi_fused_gelu_12", "unattributed", "gelu"),
    ("triton_poi_fused__to_copy_2", "unattributed", "cast/copy"),
    ("aten::addmm", "Linear", "gemm"),
    ("aten::nonzero", "loss", "host sync"),
    ("aten::item", "optimizer", "optimizer"),
])  # fmt: skip
def test_categories_of_cuda_kernel_and_op_names(name, origin, want):
    assert profile_step.category(name, origin) == want


def test_triton_kernel_names_read_from_the_source():
    assert "dilated_fwd_kernel" in profile_step.ATTN_KERNELS
    assert "dilated_bwd_dq_kernel" in profile_step.ATTN_KERNELS
    assert set(profile_step.ROTARY_KERNELS) == {"_rotary_kernel", "_rotary_cache_kernel"}  # training, decode
    assert profile_step.CE_KERNELS == ("_ce_loss_grad_kernel",)


def _category_rows(text: str, section: str) -> dict:
    """category -> [eager count, eager ms, compiled count, ...] of a '### Per category' table."""
    body = text.split(section, 1)[1].split("### Per category", 1)[1].split("###", 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and cells[0] not in ("category", "") and not cells[0].startswith("---"):
            rows[cells[0]] = [float(c) for c in cells[1:]]
    return rows


@pytest.mark.slow  # the whole script at CPU size, compile (aot_eager) included: ~30 s
@pytest.mark.skipif(torch.cuda.is_available(), reason="the --tiny smoke test runs on the CPU")
def test_tiny_profile_writes_the_tables(tmp_path):
    out = tmp_path / "profile_step.md"
    assert profile_step.main(["--tiny", "--iters", "2", "--warmup", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# LongNet training step profile, eager vs compiled")
    assert "- versions:" in text and "torch" in text
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    for arm in ("eager", "eager plain", "compiled", "dense"):
        assert re.search(rf"\| N128 x 2 \| {arm} \| [0-9.]+ \|", summary), arm
    rows = _category_rows(text, "## N128 x 2")
    total = rows.pop("**total**")
    # the categories add up to the total, per arm (counts exactly, times to rounding)
    for col in range(0, len(total) - 1, 2):
        assert sum(r[col] for r in rows.values()) == total[col]
        assert sum(r[col + 1] for r in rows.values()) == pytest.approx(total[col + 1], abs=0.01 * len(rows) + 1e-3)
    # a training step has all of these, in every arm (the optimizer stays eager when compiled)
    for cat in ("gemm", "layernorm", "cross-entropy", "optimizer"):
        assert all(rows[cat][col] > 0 for col in (0, 2, 4, 6)), cat
    # the eager rotary is the torch code on the CPU: labelled through its wrapper, fwd and bwd
    assert rows["rotary"][0] > 0
    origins = text.split("### Eager by origin", 1)[1].split("###", 1)[0]
    # the eager arm has the defaults: the fused loss computes its gradients in forward ("loss")
    for o in ("| Linear |", "| bwd Linear |", "| optimizer |", "| loss |", "| bwd loss |", "| rotary |"):
        assert o in origins, o
    assert "### Top 25 CPU ops, compiled" in text
    # the labels are gone afterwards: the model code is as it was
    from dilated_attention.models import longnet

    assert longnet._ce_sum.__name__ == "_ce_sum"
    assert longnet.chunked_cross_entropy.__name__ == "chunked_cross_entropy"


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def elapsed_us(self):
        return self.end - self.start


class _Ev:
    """The fields of a profiler FunctionEvent that profile_step.analyse reads."""

    def __init__(self, name, start, end, parent=None, device=torch.autograd.DeviceType.CPU, id=0, seq=-1,
                 annotation=False):  # fmt: skip
        self.name, self.device_type, self.id, self.sequence_nr = name, device, id, seq
        self.is_user_annotation = annotation
        self.time_range, self.is_async, self.cpu_parent, self.cpu_children = _Range(start, end), False, parent, []
        self.linked_correlation_id = 0
        self.cpu_time_total = self.self_cpu_time_total = end - start
        if parent is not None:
            parent.cpu_children.append(self)


def test_analyse_attributes_cuda_kernels_to_their_launch():
    """The CUDA branch of analyse on a made-up trace (no GPU here): a forward Linear's weight
    cast and GEMM, the backward GEMM of that Linear's node, a grad accumulation, an optimizer
    kernel; kernels matched to their runtime launch by correlation id, overlaps counted once."""
    cuda = torch.autograd.DeviceType.CUDA
    lin = _Ev("mod:Linear", 0, 100)
    to = _Ev("aten::_to_copy", 1, 10, lin, seq=5)
    _Ev("cudaLaunchKernel", 2, 3, to, id=11)
    mm = _Ev("aten::addmm", 10, 20, lin, seq=6)
    _Ev("cudaLaunchKernel", 11, 12, mm, id=12)
    node = _Ev("autograd::engine::evaluate_function: AddmmBackward0", 200, 300, seq=6)
    bmm = _Ev("aten::mm", 201, 210, _Ev("AddmmBackward0", 200, 299, node, seq=6))
    _Ev("cuLaunchKernelEx", 202, 203, bmm, id=13)
    acc = _Ev("aten::add_", 301, 310, _Ev("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 300, 320))
    _Ev("cudaLaunchKernel", 302, 303, acc, id=14)
    opt = _Ev("aten::_foreach_add_", 401, 410, _Ev("optimizer", 400, 420))
    _Ev("cudaLaunchKernel", 402, 403, opt, id=15)
    kernels = [
        _Ev("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda>", 5, 15, device=cuda, id=11),
        _Ev("sm90_xmma_gemm_bf16bf16_bf16f32", 15, 45, device=cuda, id=12),  # 15-45 overlaps nothing
        _Ev("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", 210, 250, device=cuda, id=13),
        _Ev("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", 240, 260, device=cuda, id=14),
        _Ev("void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>>", 410, 430, device=cuda, id=15),
        _Ev("Memset (Device)", 500, 501, device=cuda, id=99),  # no launch found: unattributed
        # user annotations mirrored on the GPU timeline: spans, not kernels (left out), flagged
        # by the profiler or known by name
        _Ev("mod:Linear", 0, 100, device=cuda, id=11, annotation=True),
        _Ev("mod:LayerNorm", 100, 200, device=cuda, id=12),
        _Ev("da:ce", 100, 200, device=cuda, id=12),
        _Ev("Optimizer.step#AdamW.step", 400, 440, device=cuda, id=15),
        _Ev("forward", 0, 200, device=cuda, id=11),
    ]
    cpu = [e for e in (lin, to, mm, node, bmm, acc, opt)]
    everything = cpu + [c for e in cpu for c in e.cpu_children] + kernels
    res = profile_step.analyse(list(dict.fromkeys(everything)), torch.device("cuda"))
    assert res["n"] == 6 and res["memops"] == 1
    assert res["sum_ms"] == pytest.approx((10 + 30 + 40 + 20 + 20 + 1) / 1e3)
    assert res["busy_ms"] == pytest.approx((10 + 30 + 50 + 20 + 1) / 1e3)  # 210-260 once
    assert res["origins"]["Linear"] == [2, 40.0]
    assert res["origins"]["bwd Linear"] == [1, 40.0]  # the node's forward op was in mod:Linear
    assert res["origins"]["unattributed"] == [1, 1.0]
    cats = {k: v[0] for k, v in res["cats"].items()}
    assert cats == {"cast/copy": 1, "gemm": 2, "grad accumulation": 1, "optimizer": 1, "memset/fill": 1}


def test_gaps_charge_idle_to_the_kernel_that_ends_it():
    """gaps(): each idle gap goes to the kernel after it, host-late when that kernel's launch began
    after the gap opened; overlapping kernels leave no gap; the largest gap names the innermost
    host op running when it opened."""
    from types import SimpleNamespace as NS

    it = profile_step.Item
    items = [it("k1", "a", 10, 0, 10, -5), it("void k2<int>(x)", "b", 10, 15, 25, 12),  # 5 us, launched late
             it("k3", "c", 5, 40, 45, 20),  # 15 us, launched before the gap opened: queued
             it("k4", "c", 5, 44, 50, 41)]  # overlaps k3: no gap  # fmt: skip
    cpu = [NS(is_async=False, time_range=NS(start=0, end=100), name="step"),
           NS(is_async=False, time_range=NS(start=8, end=20), name="cudaStreamSynchronize"),
           NS(is_async=True, time_range=NS(start=9, end=30), name="async")]  # fmt: skip
    g = profile_step.gaps(items, cpu)
    assert g["n"] == 2 and g["span_ms"] == pytest.approx(0.05)
    assert g["idle_ms"] == pytest.approx(0.020) and g["host_late_ms"] == pytest.approx(0.005)
    assert g["by_origin"] == {"b": [1, 5.0, 5.0], "c": [1, 15.0, 0.0]}
    first, second = g["largest"]
    assert (first["us"], first["kernel"], first["host_op"], first["launch_after_us"]) == (15, "k3", "step", -5)
    assert (second["kernel"], second["host_op"]) == ("k2", "cudaStreamSynchronize")
    lines = profile_step.idle_tables({"arm": {"idle": g}})
    assert "| arm | 0.050 | 0.020 | 0.005 | 2 |" in lines


def test_host_spans_take_the_outermost_of_each_group():
    from types import SimpleNamespace as NS

    def ev(name, start, end, parent=None):
        return NS(name=name, is_async=False, time_range=NS(start=start, end=end, elapsed_us=lambda: end - start),
                  cpu_parent=parent)  # fmt: skip

    fwd = ev("forward", 0, 100)
    op = ev("dilated_attention::triton_fwd", 10, 40, fwd)
    inner = ev("dilated_attention::rotary", 12, 20, op)  # inside another op: not counted again
    node = ev("autograd::engine::evaluate_function: MulBackward0", 50, 60, fwd)
    got = profile_step.host_spans([fwd, op, inner, node, ev("## Call CompiledFxGraph abc", 60, 90, fwd)])
    assert got == {"phase forward": [1, 100], "op triton_fwd": [1, 30], "bwd node MulBackward0": [1, 10],
                   "graph (all)": [1, 30]}  # fmt: skip


def test_settings_set_and_restore_module_switches():
    from dilated_attention.kernels import gluon_fwd

    pairs = profile_step.parse_settings("gluon_fwd.DIRECT_LAUNCH=0, gluon_fwd.MIN_ROWS=5")
    assert pairs == [("gluon_fwd.DIRECT_LAUNCH", 0), ("gluon_fwd.MIN_ROWS", 5)]
    before = (gluon_fwd.DIRECT_LAUNCH, gluon_fwd.MIN_ROWS)
    with profile_step.settings(pairs):
        assert gluon_fwd.DIRECT_LAUNCH is False and gluon_fwd.MIN_ROWS == 5
    assert (gluon_fwd.DIRECT_LAUNCH, gluon_fwd.MIN_ROWS) == before
    for bad in ("gluon_fwd.NO_SUCH=1", "DIRECT_LAUNCH=1", "gluon_fwd.DIRECT_LAUNCH"):
        with pytest.raises(SystemExit, match="--set / --compiled-ab"):
            profile_step.parse_settings(bad)


@pytest.mark.slow  # compile (aot_eager) at CPU size: ~30 s
@pytest.mark.skipif(torch.cuda.is_available(), reason="the --tiny smoke test runs on the CPU")
def test_tiny_profile_with_ab_arm_rounds_and_cprofile(tmp_path):
    """--compiled-ab adds an arm of the same compiled model with the switches set; --ab-rounds
    alternates both; --cprofile adds the host tables with callers."""
    out = tmp_path / "p.md"
    assert profile_step.main(["--tiny", "--iters", "2", "--warmup", "1", "--no-plain", "--no-dense",
                              "--compiled-ab", "gluon_fwd.DIRECT_LAUNCH=0", "--ab-rounds", "2",
                              "--cprofile", "compiled", "--cprofile-steps", "1", "--out", str(out)]) == 0  # fmt: skip
    text = out.read_text()
    assert re.search(r"\| N128 x 2 \| compiled \[gluon_fwd.DIRECT_LAUNCH=0\] \| [0-9.]+ \|", text)
    ab = text.split("### Interleaved A/B", 1)[1]
    assert re.search(r"\| 1 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|", ab) and "median ratio" in ab
    assert "### Host Python per step, compiled" in text and "| function | callers |" in text
    assert "### Host time of the profiled step by span" in text and "| phase forward | 1 |" in text
