"""The research harness in examples/research/run.py: its synthetic needle task, its equal-size models, and (slow) the
whole --quick pipeline down to a complete report with finite numbers."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch


REPO_ROOT = Path(__file__).resolve().parents[1]


def load_harness():
    spec = importlib.util.spec_from_file_location("research_run", REPO_ROOT / "examples" / "research" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_needle_batch_layout():
    harness = load_harness()
    vocab = harness.NeedleVocabulary(key_vocab=8, value_vocab=8, filler_vocab=16)
    batch = harness.make_needle_batch(torch.Generator().manual_seed(0), 32, 40, 4, 2, vocab)
    input_ids, labels = batch["input_ids"], batch["labels"]
    assert input_ids.shape == labels.shape == (32, 40)
    # same seed, same examples (the data order every architecture shares)
    again = harness.make_needle_batch(torch.Generator().manual_seed(0), 32, 40, 4, 2, vocab)
    assert torch.equal(input_ids, again["input_ids"])
    for row in range(32):
        tokens = input_ids[row].tolist()
        needle_starts = [i for i, t in enumerate(tokens) if t == vocab.needle_marker]
        assert len(needle_starts) == 4
        needle_keys = [tokens[i + 1] for i in needle_starts]
        assert len(set(needle_keys)) == 4  # distinct keys: each query has one right answer
        # loss only on the answer values, and each answer is the value stored with the queried key
        assert (labels[row] != -100).sum() == 2
        for q in range(2):
            key_position = batch["answer_position"][row, q].item()
            start = batch["needle_start"][row, q].item()
            assert tokens[key_position - 1] == vocab.query_marker
            assert tokens[start : start + 3] == [vocab.needle_marker, tokens[key_position], tokens[key_position + 1]]
            assert labels[row, key_position + 1] == tokens[key_position + 1]
        filler = batch["filler"][row]
        assert all(vocab.first_filler <= t < vocab.size for t, f in zip(tokens, filler.tolist()) if f)
        assert filler.sum() == 40 - 3 * 4 - 3 * 2


def test_architectures_have_equal_size():
    harness = load_harness()
    settings = harness.quick_settings()
    counts = {kind: harness.count_parameters(harness.build_model(kind, 100, 64, settings, 0)) for kind in ("transformer", "diff", "dint")}
    layers, head_dim = settings.num_hidden_layers, settings.head_dim
    # DIFF/DINT = the Transformer + 4 lambda vectors and a head-norm weight of 2*head_dim per layer
    assert counts["diff"] == counts["dint"] == counts["transformer"] + layers * (4 * head_dim + 2 * head_dim)
    no_norm = harness.build_model("no_head_norm", 100, 64, settings, 0)
    assert harness.count_parameters(no_norm) == counts["transformer"] + layers * 4 * head_dim


@pytest.mark.slow
def test_quick_run_writes_complete_report(tmp_path):
    harness = load_harness()
    out = harness.main(["--quick", "--out", str(tmp_path), "--no-progress"])
    report = (out / "report.md").read_text()
    for section in ("## Setup", "## Results", "## Ablations", "## Claims, one by one", "## Why this may differ"):
        assert section in report
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report):
        assert (out / image).stat().st_size > 1000
    assert {"accuracy_vs_length.png", "attention_maps.png"} <= {p.name for p in out.glob("*.png")}
    assert "nan" not in report.lower() and "inf " not in report.lower()

    results = json.loads((out / "results.json").read_text())

    def numbers(value):
        if isinstance(value, dict):
            for v in value.values():
                yield from numbers(v)
        elif isinstance(value, list):
            for v in value:
                yield from numbers(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield value

    assert all(math.isfinite(x) for x in numbers(results))
    seeds = results["settings"]["seeds"]
    assert len(seeds) >= 3
    for kind in ("transformer", "diff", "dint", *results["settings"]["ablations"]):
        assert len(results["needle"][kind]) == len(seeds)
        for record in results["needle"][kind]:
            assert 0 <= record["accuracy"]["1"] <= 1 and 0 <= record["accuracy"]["4"] <= 1
    for kind in ("transformer", "diff", "dint"):
        assert all(r["heldout_perplexity"] > 1 for r in results["lm"][kind])
    # what the formulas guarantee: softmax and DINT rows sum to 1 with no negative Transformer entries, DIFF rows don't
    for record in results["needle"]["dint"] + results["needle"]["transformer"]:
        assert record["max_row_sum_error"] < 1e-4
    assert all(r["negative_fraction"] == 0 for r in results["needle"]["transformer"])
    assert all(r["max_row_sum_error"] > 1e-2 for r in results["needle"]["diff"])
    assert results["wall_seconds"] < 180
