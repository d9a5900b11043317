"""bench/ shows which script answers what and where its evidence lives (issue 56): every script is in bench/README.md's
table, and bench/results/ holds one folder per script and kind of machine (`<script>/<cpu|h100|h200|...>/`) whose
Markdown files each open with the run's date, machine, releases, commit and command; no name carries history (issue
numbers, `_idle`, `_focus`, `_rerun`: git keeps the earlier runs)."""

import re
from pathlib import Path


BENCH = Path(__file__).resolve().parent.parent / "bench"
RESULTS = BENCH / "results"
HEADER = ("- date: ", "- machine: ", "- torch ", "- commit: ", "- command: ")
HISTORY_IN_NAMES = re.compile(r"issue\d|_idle|_focus|_rerun")


def test_every_script_is_in_the_readme_table():
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Scripts\n", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    listed = {re.match(r"\| `([^`]+)`", line).group(1) for line in table}
    scripts = {path.name for path in BENCH.glob("*.py")}
    assert not scripts - listed, f"scripts missing from bench/README.md's table: {sorted(scripts - listed)}"
    assert not listed - scripts, f"bench/README.md's table names scripts that do not exist: {sorted(listed - scripts)}"


def test_results_are_filed_by_script_and_machine_kind():
    for path in RESULTS.rglob("*"):
        if path.is_dir():
            continue
        relative = path.relative_to(RESULTS)
        assert len(relative.parts) >= 3, f"bench/results/{relative}: not under <script>/<machine kind>/"
        script, kind = relative.parts[:2]
        assert (BENCH / f"{script}.py").exists(), f"bench/results/{relative}: no script bench/{script}.py"
        assert kind == "cpu" or re.fullmatch(r"[a-z]+\d+", kind), f"bench/results/{relative}: {kind!r} is no machine kind"
        assert not HISTORY_IN_NAMES.search(str(relative)), f"bench/results/{relative}: history in the name"
        assert path.suffix != ".png", f"bench/results/{relative}: no page shows plots"


def test_every_result_names_its_run():
    for path in RESULTS.rglob("*.md"):
        opening = path.read_text(encoding="utf-8").splitlines()[:5]
        if path.name == "README.md":  # a folder's own account of a GPU session, with its device and commit
            opening = path.read_text(encoding="utf-8")
            assert "commit" in opening and "torch" in opening, f"{path}: name the commit and the releases"
            continue
        assert [line[: len(start)] for line, start in zip(opening, HEADER)] == list(HEADER), (
            f"{path.relative_to(BENCH)} does not open with the run's header (bench_common.run_header)"
        )
