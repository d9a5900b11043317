"""The operation counts a user reads come from one committed record, bench/results/count_ops/cpu/results.json (which
`python bench/count_ops.py --write` rewrites, with the tables of docs/performance.md), and that record is what the
code dispatches today (issue 57): a change of the model's ops fails here until the record is rewritten, and a number in
the docs that the record lacks fails too.

The docs keep op counts between `<!-- op-counts: begin ... -->` and `<!-- op-counts: end -->`; outside such a region,
the pages that report measurements (docs/performance.md, bench/README.md) state no count of ops.
"""

import json
import re
import shlex
import sys
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parent.parent
RECORD = REPO_ROOT / "bench" / "results" / "count_ops" / "cpu" / "results.json"
DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "bench" / "README.md"]
MEASUREMENT_PAGES = [REPO_ROOT / "docs" / "performance.md", REPO_ROOT / "bench" / "README.md"]
REGION = re.compile(r"<!-- op-counts: begin.*?-->(?P<text>.*?)<!-- op-counts: end -->", re.DOTALL)
LABELS = ("DINT-V1", "DINT-V2", "DIFF-V2", "DIFF V2", "Llama (2h)", "DINT_CPU_KERNEL=0", "2h", "fp32")
COUNT_CLAIM = re.compile(r"\d[\d.]* (?:more |fewer )?(?:tensor |aten |non-view )?ops\b")


def record() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def record_numbers(result: dict) -> set[str]:
    """Every number the record gives: each model's ops per step, each pair's difference per layer (as
    `count_ops.table` renders it, without its sign), and the model's settings."""
    settings = result["settings"]
    layers = settings["num_hidden_layers"]
    numbers = {str(settings[key]) for key in ("seq_len", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                                "num_key_value_heads")}
    for counts in result["counts"].values():
        totals = {name: {step: sum(ops.values()) for step, ops in steps.items()} for name, steps in counts.items()}
        numbers |= {str(total) for steps in totals.values() for total in steps.values()}
        numbers |= {f"{abs(totals[a][step] - totals[b][step]) / layers:.2f}"
                    for a in totals for b in totals for step in totals[a]}
    return numbers


def test_the_record_is_what_count_ops_counts_today():
    result = record()
    command = shlex.split(result["machine"]["command"])
    assert command[:2] == ["python", "bench/count_ops.py"] and "--write" in command, command
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    import count_ops

    counted = count_ops.count_in_settings([argument for argument in command[2:] if argument != "--write"])
    assert set(counted) == set(result["counts"]) == set(count_ops.SETTINGS)
    for setting, counts in counted.items():
        for name, steps in counts.items():
            for step, ops in steps.items():
                recorded = result["counts"][setting][name][step]
                assert ops == recorded, (
                    f"{name} {step} with {setting}: {sum(ops.values())} ops now, {sum(recorded.values())} in "
                    f"{RECORD.relative_to(REPO_ROOT)} (torch {result['machine']['torch']}, transformers "
                    f"{result['machine']['transformers']}); if the change is meant, run `python bench/count_ops.py "
                    f"--write` and update the docs' op-counts regions"
                )


def test_every_op_count_in_the_docs_comes_from_the_record():
    """A region's tables are the record's (`count_ops.table`), whole; its prose quotes only the record's numbers."""
    result = record()
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    import count_ops

    tables = ["\n".join(count_ops.table(counts, result["settings"]["num_hidden_layers"]))
              for counts in result["counts"].values()]
    numbers = record_numbers(result)
    regions = [(path, text) for path in DOCUMENTS for text in REGION.findall(path.read_text(encoding="utf-8"))]
    assert any(path.name == "performance.md" for path, _ in regions), "docs/performance.md quotes the op counts"
    for path, text in regions:
        name = path.relative_to(REPO_ROOT)
        table_lines = [line for line in text.splitlines() if line.startswith("|")]
        allowed = {line for table in tables for line in table.splitlines()}
        assert not [line for line in table_lines if line not in allowed], f"{name}: table rows the record lacks"
        assert all(table in text for table in tables) or not table_lines, f"{name}: quote each of the record's tables whole"
        prose = "\n".join(line for line in text.splitlines() if not line.startswith("|"))
        for label in LABELS:
            prose = prose.replace(label, "")
        prose = re.sub(r"\([^)]*bench/results/count_ops/cpu/[^)]*\)", "", prose)  # the link to the record
        stray = [number for number in re.findall(r"\d[\d.]*\d|\d", prose) if number not in numbers]
        assert not stray, f"{name}: op-count numbers the record lacks: {stray}"


def test_the_measurement_pages_state_no_op_count_outside_a_region():
    for path in MEASUREMENT_PAGES:
        outside = REGION.sub("", path.read_text(encoding="utf-8"))
        claims = COUNT_CLAIM.findall(" ".join(outside.split()))
        assert not claims, f"{path.relative_to(REPO_ROOT)} states op counts outside an op-counts region: {claims}"
