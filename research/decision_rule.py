# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The research harness's decision rule: percentile-bootstrap intervals over seeds, and the paired verdict every claim
gets (`beats`)."""

import numpy as np

from settings import Settings


def bootstrap_ci(values, settings: Settings) -> tuple[float, float, float]:
    """Mean and 95% percentile-bootstrap interval of the mean (resampling seeds with replacement, fixed rng)."""
    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(settings.bootstrap_seed)
    means = values[rng.integers(0, len(values), (settings.bootstrap_resamples, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(values.mean()), float(low), float(high)


def beats(a, b, settings: Settings, higher_is_better: bool = True) -> tuple[str, tuple]:
    """The pre-registered decision rule. `a` and `b` are per-seed values in the same seed order (paired by seed).
    Returns ("yes" | "reversed" | "no difference", (mean, low, high) of the paired difference a - b): "yes" when the
    95% bootstrap interval of the mean paired difference excludes 0 in `a`'s favour, "reversed" when it excludes 0 the
    other way."""
    difference = bootstrap_ci(np.asarray(a, dtype=float) - np.asarray(b, dtype=float), settings)
    _, low, high = difference
    favour_low, favour_high = (low, high) if higher_is_better else (-high, -low)
    if favour_low > 0:
        return "yes", difference
    if favour_high < 0:
        return "reversed", difference
    return "no difference", difference


def ci_text(values, settings: Settings, digits: int = 3) -> str:
    mean, low, high = bootstrap_ci(values, settings)
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def difference_text(difference: tuple, digits: int = 3) -> str:
    mean, low, high = difference
    return f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"
