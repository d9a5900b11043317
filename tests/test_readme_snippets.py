"""Every ```python block of README.md, docs/*.md and examples/*.md runs as written (issue 21).

The blocks of one file run in order, in one fresh Python process, in a scratch folder that holds a link to the repo's
`examples/` (so `examples/data/tokenizer` resolves as it does in a clone): like a user pasting them one after the
other, so a later block may use the names an earlier one defined. A docs/ page continues from the README's quick start
(its examples use the quick start's `model`, `tokenizer` and the folder `outputs/my-dint`, as the page says at its
top), so its blocks run after that one block, `quick_start()`, in the same process, as a user who ran the quick start
first would run them. examples/*.md stand alone. A block that cannot run in the default suite says why in an HTML
comment on the line right before it, which this test reads:

    <!-- snippet: slow -->              runs in the slow suite only (`pytest tests -m slow`): over ~10 s here
    <!-- snippet: gpu -->               needs a CUDA device: runs where there is one (skipped with the reason otherwise)
    <!-- snippet: torchrun 2 -->        a script for `torchrun --nproc_per_node 2 script.py`: the slow suite saves it
                                        to a file and runs it that way, after the blocks before it
    <!-- snippet: skip REASON -->       never runs here (e.g. it uploads to the Hub); the reason is shown in the skip
    <!-- snippet: needs MODULE -->      needs a package of an optional extra (e.g. torchao, the `quantization` extra):
                                        runs with the default blocks where MODULE is installed (CI installs the extra
                                        and runs this test again), and is listed as not run elsewhere

A block without a comment runs in the default suite. An unknown kind fails the test, so a typo cannot hide a block.
What the blocks write must go under `outputs/` (which .gitignore covers): a file or folder they leave anywhere else in
the scratch folder fails the test, as it would litter a clone's root.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch


REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
DOCUMENTS = [README, *DOCS, *sorted((REPO_ROOT / "examples").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*snippet:\s*(?P<kind>\S+)\s*(?P<detail>.*?)\s*-->\s*$")
KINDS = ("default", "slow", "gpu", "torchrun", "skip", "needs")
MODES = {
    "default": {"default"},
    "slow": {"default", "slow", "torchrun"},
    "gpu": {"default", "slow", "gpu"},
}
"""The block kinds each test mode runs."""


@dataclass
class Snippet:
    document: str  # path relative to the repo
    line: int  # 1-based line of the opening ```python
    code: str
    kind: str  # one of KINDS
    detail: str  # the skip reason, the process count for torchrun, or the module a `needs` block imports

    @property
    def label(self) -> str:
        return f"{self.document}:{self.line}"

    def runs_in(self, mode: str) -> bool:
        if self.kind == "needs":
            return "default" in MODES[mode] and importlib.util.find_spec(self.detail) is not None
        return self.kind in MODES[mode]


def python_snippets(path: Path) -> list[Snippet]:
    """The ```python blocks of a Markdown file, with the kind their marker comment gives (default without one)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    snippets, index = [], 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            start = index
            index += 1
            body = []
            while lines[index].strip() != "```":
                body.append(lines[index])
                index += 1
            marker = MARKER.match(lines[start - 1].strip()) if start > 0 else None
            kind, detail = (marker["kind"], marker["detail"]) if marker else ("default", "")
            snippets.append(Snippet(str(path.relative_to(REPO_ROOT)), start + 1, "\n".join(body) + "\n", kind, detail))
        index += 1
    return snippets


def quick_start() -> Snippet:
    """The README's quick start: its first ```python block after the "## Quick start" heading."""
    heading = README.read_text(encoding="utf-8").splitlines().index("## Quick start") + 1
    return next(snippet for snippet in python_snippets(README) if snippet.line > heading)


def document_snippets(path: Path) -> list[Snippet]:
    """The blocks a document's test runs, in order: a docs/ page's own after the README's quick start."""
    own = python_snippets(path)
    return [quick_start(), *own] if path in DOCS else own


RUNNER = r"""
import json, subprocess, sys, time, traceback

snippets = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for snippet in snippets:
    started = time.perf_counter()
    print(f"=== {snippet['label']} ({snippet['kind']})", flush=True)
    try:
        if snippet["kind"] == "torchrun":
            script = f"snippet_{snippet['line']}.py"
            with open(script, "w") as handle:
                handle.write(snippet["code"])
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", snippet["detail"] or "2",
                       script]
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
            print(result.stdout[-3000:], flush=True)
            if result.returncode != 0:
                raise RuntimeError(f"torchrun exited with {result.returncode}:\n{result.stderr[-6000:]}")
        else:
            exec(compile(snippet["code"], snippet["label"], "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"SNIPPET FAILED: {snippet['label']}", flush=True)
        sys.exit(1)
    print(f"=== ok in {time.perf_counter() - started:.1f} s", flush=True)
"""


def run_snippets(snippets: list[Snippet], scratch: Path) -> subprocess.CompletedProcess:
    (scratch / "examples").symlink_to(REPO_ROOT / "examples", target_is_directory=True)
    (scratch / "snippets.json").write_text(json.dumps([asdict(s) | {"label": s.label} for s in snippets]))
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-c", RUNNER, "snippets.json"],
        cwd=scratch, capture_output=True, text=True, timeout=1800, env=environment,
    )


def test_every_marker_is_known_and_every_document_has_runnable_blocks():
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for line in text.splitlines():
            marker = MARKER.match(line.strip())
            if marker:
                assert marker["kind"] in KINDS, f"{path.name}: unknown snippet kind {marker['kind']!r} in {line!r}"
                if marker["kind"] in ("skip", "needs"):
                    assert marker["detail"], f"{path.name}: a {marker['kind']} snippet says what: {line!r}"
        snippets = python_snippets(path)
        assert text.count("```python") == len(snippets)
        # a marker stands right before its block: one anywhere else would silently mark nothing
        marker_lines = sum(bool(MARKER.match(line.strip())) for line in text.splitlines())
        assert marker_lines == sum(s.kind != "default" for s in snippets), path.name
    assert any(s.kind == "default" for s in python_snippets(README))
    assert quick_start().kind == "default" and "outputs/my-dint" in quick_start().code


def snippet_cases():
    for path in DOCUMENTS:
        snippets = python_snippets(path)
        if not snippets:
            continue
        name = str(path.relative_to(REPO_ROOT))
        if any(s.kind in ("default", "needs") for s in snippets):  # a page of skipped blocks only has no case
            yield pytest.param(path, "default", id=f"{name}-default")
        if any(s.kind in ("slow", "torchrun") for s in snippets):
            yield pytest.param(path, "slow", id=f"{name}-slow", marks=pytest.mark.slow)
        if any(s.kind == "gpu" for s in snippets):
            yield pytest.param(
                path, "gpu", id=f"{name}-gpu",
                marks=[pytest.mark.slow,
                       pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu snippets need a CUDA device")],
            )


@pytest.mark.parametrize("path, mode", list(snippet_cases()))
def test_python_blocks_run_as_written(path, mode, tmp_path):
    snippets = document_snippets(path)
    selected = [s for s in snippets if s.runs_in(mode)]
    result = run_snippets(selected, tmp_path)
    output = result.stdout + "\n" + result.stderr
    failed = re.search(r"SNIPPET FAILED: (\S+)", result.stdout)
    assert result.returncode == 0, (
        f"{failed[1] if failed else 'the snippet runner'} failed ({mode} mode):\n{output[-8000:]}"
    )
    assert result.stdout.count("=== ok in") == len(selected)
    # what the blocks write goes under outputs/ (ignored by git), never loose into the clone's root
    runner_files = {"examples", "snippets.json"} | {f"snippet_{s.line}.py" for s in selected if s.kind == "torchrun"}
    left = sorted(entry.name for entry in tmp_path.iterdir() if entry.name not in runner_files | {"outputs"})
    assert not left, f"{path.name}'s blocks wrote {left} outside outputs/"
    not_run = [f"{s.label} ({s.kind} {s.detail})".strip() for s in snippets if not s.runs_in(mode)]
    if not_run:
        print(f"{mode} mode did not run: {not_run}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "slow or not slow", "-v"]))
