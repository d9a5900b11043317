"""Shared fixtures. Slow tests (`@pytest.mark.slow`) are deselected unless `-m` is given: `pytest tests -m slow` runs
them alone, `pytest tests -m "slow or not slow"` runs everything."""

import os
import sys

import pytest
import torch


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes over ~30 s; run with `pytest tests -m slow`")
    if not config.option.markexpr:
        config.option.markexpr = "not slow"


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield
