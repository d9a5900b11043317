#!/usr/bin/env python3
"""The Triton integral kernel on a machine without a GPU, under Triton's interpreter (`TRITON_INTERPRET=1`), in
virtualenvs of their own (`venvs.py`, cached in `$DINT_MATRIX_DIR`, default `~/.cache/dint-matrix`): prints a table
triton -> tests, and fails if a row fails.

    python .ci/triton_stage.py

- the Triton of the lent GPUs' image (`DEVICE_TRITON`, with numpy < 2.3: its interpreter turns one-element arrays
  into Python integers in a way numpy 2.4 refuses): every kernel variant compiled for sm_80 and sm_90 by Triton's
  compiler (what the interpreter never runs);
- the newest Triton (with the newest numpy): the compilation, the kernel's tests against the eager ops under the
  interpreter, then `MODEL_TESTS` with `DINT_INTEGRAL_KERNEL=triton`, so that forwards, backwards and cached
  generations of whole models, both head layouts, run through the kernel (the CPU C++ kernel of the default suite
  steps aside for it).

The interpreter runs the kernels in numpy, tens of times slower than the eager ops: CI runs the kernel's tests under
one interpreter, the newest (`python -m pytest tests/test_integral_triton_kernel.py` with `TRITON_INTERPRET=1` runs them
under the device's, as the README says), and the model tests of generation, training and the v2 layout; padding and
packed documents reach the kernel as row flags, which the kernel's own tests cover.

Both with torch 2.13.0, the package's `test` extra and the newest transformers.
"""

import os
import sys

from venvs import REPO_ROOT, ensure_venv, newest_release, pytest_summary, run


DEVICE_TRITON = "3.6.0"
"""The Triton of the lent GPU machines' image (torch 2.11 with CUDA 13)."""
COMPILE_TESTS = ("tests/test_integral_triton_compile.py",)
"""Every kernel variant through Triton's compiler to sm_80 and sm_90 cubins (no interpreter, no GPU)."""
KERNEL_TESTS = ("tests/test_integral_triton_kernel.py",)
MODEL_TESTS = ("tests/test_generation.py", "tests/test_v2.py", "tests/test_finetuning.py")
INTERPRETER = {"TRITON_INTERPRET": "1"}
COMPILER = {"TRITON_INTERPRET": "0"}


def triton_venv(venv_dir: str, release: str, numpy_requirement: str) -> str:
    return ensure_venv(os.path.join(venv_dir, f"triton-{release}"), "torch==2.13.0",
                       ["-e", f"{REPO_ROOT}[test]", f"triton=={release}", numpy_requirement])


def row(python: str, tests: tuple[str, ...], environment: dict) -> tuple[list[str], bool]:
    versions = run([python, "-c", "import triton, numpy, transformers; "
                    "print(triton.__version__, numpy.__version__, transformers.__version__)"])
    triton_version, numpy_version, transformers_version = (
        versions.stdout.split() if versions.returncode == 0 else ("?", "?", "?")
    )
    summary, seconds, passed = pytest_summary(python, list(tests), environment)
    passed = passed and " passed" in f" {summary}"  # every test skipped (a GPU here, the interpreter off) is no pass
    variables = " ".join(f"{key}={value}" for key, value in environment.items())
    cells = [triton_version, numpy_version, transformers_version, f"`{variables}` {' '.join(tests)}",
             summary if passed else f"FAIL: {summary}", f"{seconds:.0f} s"]
    return cells, passed


def main() -> int:
    venv_dir = os.environ.get("DINT_MATRIX_DIR", os.path.expanduser("~/.cache/dint-matrix"))
    newest = newest_release("triton")
    all_passed = True
    device_python = triton_venv(venv_dir, DEVICE_TRITON, "numpy<2.3")
    newest_python = triton_venv(venv_dir, newest, "numpy")
    plan = [
        (device_python, COMPILE_TESTS, COMPILER),
        (newest_python, COMPILE_TESTS, COMPILER),
        (newest_python, KERNEL_TESTS, INTERPRETER),
        (newest_python, MODEL_TESTS, {**INTERPRETER, "DINT_INTEGRAL_KERNEL": "triton"}),
    ]
    print("| triton | numpy | transformers | tests | result | time |\n| --- | --- | --- | --- | --- | --- |", flush=True)
    for python, tests, environment in plan:
        cells, passed = row(python, tests, environment)
        all_passed &= passed
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
