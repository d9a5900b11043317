"""The numbers the README states about the main job come from the committed record of its last reference run,
examples/main_job_results/metrics.json (which `python examples/main_job.py --update_reference` rewrites), so that the
text cannot go stale silently (issue 21).

The README (its "Install and run" section today) keeps these numbers between `<!-- main-job-numbers: begin ... -->`
and `<!-- main-job-numbers: end -->`; the test finds that region wherever it lives, in README.md or a docs/ page, and
there must be exactly one. Each phrase below, rendered from metrics.json, must appear there, and no other digit may: a
number added to the paragraph without a phrase here fails the test, as does a re-run whose numbers the text does not
quote yet.
"""

import json
import re
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parent.parent
RECORD = REPO_ROOT / "examples" / "main_job_results" / "metrics.json"
DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
REGION = re.compile(r"<!-- main-job-numbers: begin.*?-->(?P<text>.*?)<!-- main-job-numbers: end -->", re.DOTALL)


def readme_phrases(metrics: dict) -> list[str]:
    """The phrases of the README's main-job paragraph, rendered from the run's metrics."""
    minutes, seconds = divmod(round(metrics["total_seconds"]), 60)
    threads = metrics["threads"]
    return [
        f"perplexity {metrics['heldout_perplexity_before']:.0f} -> {metrics['heldout_perplexity_after']:.1f}",
        f"{metrics['max_steps']} steps of {metrics['batch_size']} x {metrics['block_size']} tokens",
        f"{metrics['num_parameters']:,} parameters",
        f"on {threads} torch thread{'s' if threads > 1 else ''}",
        f"in {minutes} min {seconds:02d} s",
        f"on a {metrics['cpu_count']}-core machine",
        f"peak memory {metrics['peak_memory_gb']:.1f} GB",
        f"({metrics['date']})",
    ]


def test_record_is_a_complete_reference_run():
    metrics = json.loads(RECORD.read_text(encoding="utf-8"))
    assert metrics["command"] == "python examples/main_job.py"  # the defaults: what the README's command runs
    assert metrics["reload_max_logit_difference"] == 0.0
    assert metrics["reloaded_class"].startswith("transformers_modules.")  # the code saved with the weights
    assert metrics["heldout_perplexity_after"] < metrics["heldout_perplexity_before"] / 10


def test_every_main_job_number_in_the_readme_comes_from_the_record():
    metrics = json.loads(RECORD.read_text(encoding="utf-8"))
    regions = [(path, text) for path in DOCUMENTS for text in REGION.findall(path.read_text(encoding="utf-8"))]
    assert len(regions) == 1, f"one main-job-numbers region in README.md and docs/, found {len(regions)}"
    path, text = regions[0]
    name = path.relative_to(REPO_ROOT)
    text = " ".join(text.split())  # the paragraph's line breaks do not matter
    for phrase in readme_phrases(metrics):
        assert phrase in text, f"{name} should say {phrase!r} (from {RECORD.relative_to(REPO_ROOT)})"
        text = text.replace(phrase, "")
    leftover_numbers = re.findall(r"\d[\d,.]*", text)
    assert not leftover_numbers, f"numbers in {name}'s main-job paragraph that metrics.json lacks: {leftover_numbers}"
