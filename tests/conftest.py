"""Shared fixtures. Slow tests (`@pytest.mark.slow`) are deselected unless `-m` is given: `pytest tests -m slow` runs
them alone, `pytest tests -m "slow or not slow"` runs everything."""

import os
import sys

import pytest
import torch


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))


KNOWN_EXTERNAL_WARNINGS = [
    # transformers 5.23's masking_utils passes `_compile=` to torch's create_block_mask (flex_attention masks); torch
    # 2.13 deprecates the flag but still honours it. Not our call.
    "ignore:_compile flag on create_block_mask:DeprecationWarning",
    # torch's own torch/utils/mkldnn.py decorates with torch.jit.script_method when torch.fx's optimization module is
    # first imported (by torch.compile / flex_attention); torch warns about its own code.
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
    # peft 0.17 reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model; our code and tests
    # use `is_activation_checkpointing`.
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
]
"""Warnings raised by installed libraries about their own code, known to be harmless here; each says why."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes over ~30 s; run with `pytest tests -m slow`")
    for warning_filter in KNOWN_EXTERNAL_WARNINGS:
        config.addinivalue_line("filterwarnings", warning_filter)
    if not config.option.markexpr:
        config.option.markexpr = "not slow"


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield
