"""The process-level switch (flags.py): read when used, settable by a function, no import-time state."""

from __future__ import annotations

import pytest
import torch

from dilated_attention import flags
from dilated_attention.kernels import block_attention


@pytest.fixture(autouse=True)
def _restore():
    yield
    flags.set_cudnn_attention(None)


def test_environment_read_when_used(monkeypatch):
    monkeypatch.delenv(flags.ENV_CUDNN, raising=False)
    assert flags.cudnn_attention_enabled()
    monkeypatch.setenv(flags.ENV_CUDNN, "0")  # after import: still seen
    assert not flags.cudnn_attention_enabled()
    monkeypatch.setenv(flags.ENV_CUDNN, "1")
    assert flags.cudnn_attention_enabled()


def test_setter_overrides_environment_and_none_restores_it(monkeypatch):
    monkeypatch.setenv(flags.ENV_CUDNN, "0")
    flags.set_cudnn_attention(True)
    assert flags.cudnn_attention_enabled()
    flags.set_cudnn_attention(None)
    assert not flags.cudnn_attention_enabled()
    monkeypatch.delenv(flags.ENV_CUDNN)
    flags.set_cudnn_attention(False)
    assert not flags.cudnn_attention_enabled()


# the three kernel switches with the modes "on" / "off" / "auto": (setter, getter, env, default)
_MODE_SWITCHES = {
    "rotary": (flags.set_fused_rotary, flags.fused_rotary_mode, flags.ENV_FUSED_ROTARY, flags.ROTARY_DEFAULT),
    "ce": (flags.set_ce_kernel, flags.ce_kernel_mode, flags.ENV_CE_KERNEL, flags.CE_KERNEL_DEFAULT),
    "layernorm": (flags.set_triton_layernorm, flags.triton_layernorm_mode, flags.ENV_TRITON_LAYERNORM,
                  flags.LAYERNORM_DEFAULT),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_MODE_SWITCHES))
def test_mode_switch(name, monkeypatch):
    """set_*: True ("on"), False ("off"), None; the environment (0 off, 1 on, auto in any case,
    anything else or nothing the default, "auto") read once after each set; anything but a bool
    or None refused."""
    set_, mode, env, default = _MODE_SWITCHES[name]
    try:
        monkeypatch.setenv(env, "0")
        set_(None)
        assert mode() == "off"
        monkeypatch.setenv(env, "1")
        assert mode() == "off"  # read once since the last set
        set_(None)
        assert mode() == "on"
        monkeypatch.setenv(env, "AUTO")
        set_(None)
        assert mode() == "auto"
        monkeypatch.setenv(env, "yes")
        set_(None)
        assert mode() == default == "auto"  # not 0, 1 or auto: the default
        monkeypatch.delenv(env)
        set_(None)
        assert mode() == "auto"  # the shipped default
        set_(True)
        assert mode() == "on"
        set_(False)
        assert mode() == "off"
        with pytest.raises(TypeError, match="True, False or None"):
            set_(1)
    finally:
        set_(None)


@pytest.mark.parametrize("bad", ["0", 0, 1, "off"])
def test_setter_rejects_non_bool(bad):
    with pytest.raises(TypeError, match="True, False or None"):
        flags.set_cudnn_attention(bad)


def test_no_import_time_switch_left_in_the_kernels():
    """The switch is not copied into a module constant at import (it would ignore the setter)."""
    assert not hasattr(block_attention, "_CUDNN_ENABLED")
    assert not hasattr(block_attention, "_CUDNN_LSE_4D")


@pytest.mark.cuda
def test_setter_steers_the_block_backend():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN attention is used on compute capability >= 9 only")
    q = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    on = block_attention.pick_backend(q, q)
    flags.set_cudnn_attention(False)
    assert block_attention.pick_backend(q, q) == "flash"
    flags.set_cudnn_attention(None)
    assert block_attention.pick_backend(q, q) == on
