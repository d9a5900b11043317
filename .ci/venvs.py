"""Virtualenvs for the CI matrices (`transformers_matrix.py`, `torch_matrix.py`): one per combination of releases,
created on first use in a cache folder outside the repository and reused while its recipe is unchanged; pip's wheel
cache makes a re-creation quick. Standard library only (the orchestrating side runs on any python).

torch is installed first and pinned, so that nothing below it pulls another build: from PyTorch's CPU index where
it is reachable (`torch==X` then resolves to the CPU build `X+cpu`), else from the pip configuration (a mirror,
find-links) or PyPI, whose Linux wheels are CUDA builds that run on a CPU too (several GB with their CUDA libraries).
"""

import contextlib
import fcntl
import os
import re
import subprocess
import sys
import tempfile
import time


TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# An unreachable index costs seconds instead of a minute of retries.
PIP_INSTALL = ["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--retries", "1", "--timeout", "20"]
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


@contextlib.contextmanager
def repository_install():
    """Held around every `pip install` of this repository: setuptools writes its metadata (`modeling_dint.egg-info`)
    into the tree, and CI's two lanes install it side by side (`.ci/run` sets `DINT_CI_INSTALL_LOCK`)."""
    lock_path = os.environ.get("DINT_CI_INSTALL_LOCK") or os.path.join(tempfile.gettempdir(), "dint-ci-install.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_venv(path: str, torch_requirement: str, requirements: list[str]) -> str:
    """The python of the virtualenv at `path` with `torch_requirement` (e.g. `torch==2.13.0`) and `requirements`,
    created unless it is already there with the same recipe. Raises with pip's output when an install fails.

    A requirement on this repository (`-e REPO_ROOT[test]`) is part of the recipe without its path: a virtualenv a
    clone elsewhere made (CI clones to a new folder) is kept, and only the package is installed again, from here
    (seconds, where making the virtualenv again takes minutes; pip adds a dependency `setup.py` gained since, and
    upgrades nothing: the recipe's releases are what it pins)."""
    python = os.path.join(path, "bin", "python")
    marker = os.path.join(path, ".dint-matrix-ready")
    installed_from = os.path.join(path, ".dint-matrix-repository")
    recipe = " ".join([torch_requirement, *requirements]).replace(REPO_ROOT, "<repository>")
    repository_requirements = [requirement for requirement in requirements if REPO_ROOT in requirement]
    # (a marker written before the recipe dropped the path names the clone's path: read as this form too)
    if os.path.exists(marker) and re.sub(r"-e \S+?(\[\w+\])", r"-e <repository>\1", open(marker).read()) == recipe:
        if repository_requirements and _read(installed_from) != REPO_ROOT:
            with repository_install():
                checked([python, *PIP_INSTALL, "--extra-index-url", TORCH_CPU_INDEX, torch_requirement, "-e",
                         *repository_requirements])
    else:
        checked([sys.executable, "-m", "venv", "--clear", path])
        checked([python, *PIP_INSTALL, "--extra-index-url", TORCH_CPU_INDEX, torch_requirement])
        with repository_install() if repository_requirements else contextlib.nullcontext():
            checked([python, *PIP_INSTALL, *requirements])
    for file_path, content in ((marker, recipe), (installed_from, REPO_ROOT)):
        with open(file_path, "w") as file:
            file.write(content)
    return python


def _read(path: str) -> str | None:
    return open(path).read() if os.path.exists(path) else None


def checked(command: list[str]) -> None:
    """Runs `command`; raises with its output where it fails."""
    result = run(command)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def newest_release(package: str, index: str | None = None) -> str:
    """The newest release of `package` pip installs here (its configuration's constraints included), e.g. "2.14.1"
    for torch (from PyTorch's CPU index too)."""
    result = run([sys.executable, *PIP_INSTALL, "--dry-run", "--no-deps", "--ignore-installed", "--report", "-",
                  *(["--extra-index-url", index] if index else []), package])
    if result.returncode != 0:
        raise RuntimeError(f"pip could not resolve {package}:\n{result.stderr[-3000:]}")
    import json

    report = json.loads(result.stdout)
    return report["install"][0]["metadata"]["version"].split("+")[0]


def newest_torch() -> str:
    """The newest torch release pip installs here, e.g. "2.14.1"."""
    return newest_release("torch", TORCH_CPU_INDEX)


def pytest_summary(python: str, test_args: list[str], environment: dict | None = None) -> tuple[str, float, bool]:
    """Runs pytest with `test_args` in the repository (with `environment`'s variables set); returns its summary line
    ('188 passed, 4 skipped'), the seconds it took and whether it passed."""
    started = time.time()
    result = run([python, "-m", "pytest", *test_args, "-q", "-p", "no:cacheprovider"], cwd=REPO_ROOT,
                 env={**os.environ, **environment} if environment else None)
    seconds = time.time() - started
    lines = result.stdout.strip().splitlines()
    summary = lines[-1] if lines else result.stderr[-500:]
    summary = re.sub(r"\s+in [\d.]+s.*$", "", summary.strip("= "))
    if result.returncode != 0:
        failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        print("\n".join(failures[:30]) or result.stdout[-3000:] + result.stderr[-3000:], flush=True)
    return summary, seconds, result.returncode == 0
