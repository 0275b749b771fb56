"""Shared fixtures: every test draws fresh random inputs (the seed is printed on failure)."""

from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. triton.jit binds interpreter or
# compiled mode when a kernel is defined, so the mode is set here, once, before any test module
# imports a kernel module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (set DA_TEST_SEED to replay one); printed so a failure can be replayed."""
    s = int(os.environ.get("DA_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"DA_TEST_SEED={s}")
    torch.manual_seed(s)
    return s


CUDA_SKIP_REASON = "needs a CUDA GPU"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
