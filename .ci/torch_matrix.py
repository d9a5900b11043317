#!/usr/bin/env python3
"""DINT on the torch releases users have, each with the newest transformers, in a virtualenv of its own: prints a
table torch -> tests.

    python .ci/torch_matrix.py           # fast: the oldest torch setup.py declares and the newest pip installs (CI)
    python .ci/torch_matrix.py --full    # FULL_RELEASES as well, and the default suite; writes .ci/torch_matrix.md

Each virtualenv (`venvs.py`, in `$DINT_MATRIX_DIR`, default `~/.cache/dint-matrix`) gets `torch==X` first (the CPU
build where PyTorch's CPU index is reachable; otherwise PyPI's default build, a CUDA build that runs on a CPU), then
the package with its `test` extra (`pip install -e .[test]`, which resolves the newest transformers), and runs the
core tests (fast mode) or the default suite (`--full`). Below the floor, `import modeling_dint` must fail with the
one clear message (`--full`: a torch release below it).
"""

import argparse
import os
import re
import sys
import time

from venvs import REPO_ROOT, ensure_venv, newest_torch, pytest_summary, repository_install, run


FULL_RELEASES = ("2.11.0", "2.13.0")
"""Releases between the floor and the newest that `--full` checks too."""
BELOW_FLOOR_RELEASE = "2.8.0"
"""The release below the floor (its CPU flex_attention does not compile): `import modeling_dint` must refuse it."""
CORE_TESTS = (
    "tests/test_transformers_compat.py",
    "tests/test_modeling.py",
    "tests/test_generation.py",
    "tests/test_cache.py",
    "tests/test_contract.py",
)


def declared_floor() -> str:
    """The torch floor `setup.py` declares (`torch>=X`)."""
    with open(os.path.join(REPO_ROOT, "setup.py"), encoding="utf-8") as file:
        return re.search(r'"torch>=([\d.]+)"', file.read()).group(1)


def torch_venv(venv_dir: str, release: str) -> str:
    return ensure_venv(os.path.join(venv_dir, f"torch-{release}"), f"torch=={release}", ["-e", f"{REPO_ROOT}[test]"])


def check_release(venv_dir: str, release: str, test_args: list[str]) -> list[str]:
    """One row of the table: torch, transformers, the tests' summary, their time."""
    python = torch_venv(venv_dir, release)
    versions = run([python, "-c", "import torch, transformers; print(torch.__version__, transformers.__version__)"])
    torch_version, transformers_version = versions.stdout.split() if versions.returncode == 0 else (release, "?")
    summary, seconds, passed = pytest_summary(python, test_args)
    return [torch_version, transformers_version, summary if passed else f"FAIL: {summary}", f"{seconds:.0f} s"]


def check_below_floor(venv_dir: str) -> str:
    """Below the floor, `import modeling_dint` fails at once with the one clear message."""
    python = ensure_venv(os.path.join(venv_dir, f"torch-{BELOW_FLOOR_RELEASE}"), f"torch=={BELOW_FLOOR_RELEASE}",
                         ["transformers<6", "safetensors"])
    # the package without its dependencies: they would replace the torch below the floor
    with repository_install():
        install = run([python, "-m", "pip", "install", "--quiet", "--no-deps", "-e", REPO_ROOT])
    if install.returncode != 0:
        return "FAIL: install: " + install.stderr.strip().splitlines()[-1]
    result = run([python, "-c", "import modeling_dint"], cwd="/")
    message = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    clear = result.returncode != 0 and f"DINT needs torch >= {declared_floor()}" in message
    return f"{'pass' if clear else 'FAIL'}: {message}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="more releases, the default suite, and below the floor")
    parser.add_argument("--venv-dir", default=os.environ.get("DINT_MATRIX_DIR", "~/.cache/dint-matrix"))
    args = parser.parse_args()

    started = time.time()
    venv_dir = os.path.expanduser(args.venv_dir)
    releases = [declared_floor(), *(FULL_RELEASES if args.full else ()), newest_torch()]
    test_args = ["tests"] if args.full else list(CORE_TESTS)
    rows = []
    for release in dict.fromkeys(releases):
        row = check_release(venv_dir, release, test_args)
        print(" | ".join(row), flush=True)
        rows.append(row)
    failed = any(row[2].startswith("FAIL") for row in rows)
    lines = [
        "| torch | transformers | " + ("default suite" if args.full else "core tests") + " | time |",
        "| --- | --- | --- | --- |",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    if args.full:
        below = check_below_floor(venv_dir)
        failed |= below.startswith("FAIL")
        lines += ["", f"torch {BELOW_FLOOR_RELEASE} (below the floor), `import modeling_dint`: {below}"]
    table = "\n".join(lines)
    print("\n" + table)
    print(f"\ntorch matrix ({'full' if args.full else 'fast'}): {time.time() - started:.0f} s")
    if args.full:
        with open(os.path.join(REPO_ROOT, ".ci", "torch_matrix.md"), "w", encoding="utf-8") as file:
            file.write(f"# DINT on torch releases\n\nOutput of `python .ci/torch_matrix.py --full` (CPU, "
                       f"{os.cpu_count()} cores; torch from PyPI is a CUDA build run on the CPU).\n\n{table}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
