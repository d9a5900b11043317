"""transformers' common model tests against DINT, in both layouts: `tests/test_transformers_common.py` with
`ModelTesterMixin` (`tests/test_modeling_common.py`) and `ConfigTester` (`tests/test_configuration_common.py`) from
the sdist of the transformers release this python has (PyPI's wheel carries no tests). Standard library only.

The two files are extracted once per release into ~/.cache/dint-matrix/transformers-tests/<release>/ as the package
`transformers_tests`; `parameterized` (a test dependency of transformers that DINT's `.[test]` extra lacks) is installed
beside them when this python lacks it, so the virtualenv stays as `.[test]` made it. The sdist lacks three modules the
two files import (`exporters/test_export.py`, `generation/test_utils.py`, `utils/test_configuration_utils.py`): the
test module says what stands in for them.

    python .ci/transformers_common.py [pytest arguments]
"""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.metadata import version


SDIST_FILES = ("tests/test_modeling_common.py", "tests/test_configuration_common.py")
PACKAGE = "transformers_tests"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "dint-matrix", "transformers-tests")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--retries", "1", "--timeout", "20"]


def fetch_common_tests(release: str) -> str:
    """The folder holding the package `transformers_tests` with `SDIST_FILES` of transformers `release`, fetched with
    pip from its sdist unless already cached."""
    folder = os.path.join(CACHE, release)
    package = os.path.join(folder, PACKAGE)
    if all(os.path.isfile(os.path.join(package, os.path.basename(name))) for name in SDIST_FILES):
        return folder
    with tempfile.TemporaryDirectory() as download:
        subprocess.run([*PIP, "download", "--quiet", f"transformers=={release}", "--no-binary", ":all:", "--no-deps",
                        "--dest", download], check=True)
        (sdist,) = glob.glob(os.path.join(download, "transformers-*.tar.gz"))
        staging = tempfile.mkdtemp(dir=CACHE if os.path.isdir(CACHE) else None)
        with tarfile.open(sdist) as archive:
            for name in SDIST_FILES:
                source = archive.extractfile(f"transformers-{release}/{name}")
                with open(os.path.join(staging, os.path.basename(name)), "wb") as file:
                    file.write(source.read())
        # test_configuration_common imports `transformers` from its own folder (`direct_transformers_import`), which
        # takes the installed one once an `__init__.py` is there.
        open(os.path.join(staging, "__init__.py"), "w").close()
    os.makedirs(folder, exist_ok=True)
    shutil.rmtree(package, ignore_errors=True)  # an incomplete earlier fetch
    os.replace(staging, package)
    return folder


def parameterized_path(folder: str) -> str | None:
    """A folder to put on PYTHONPATH for `parameterized`, installed there where this python lacks it; None where it
    has it."""
    if importlib.util.find_spec("parameterized") is not None:
        return None
    site = os.path.join(folder, "site")
    if not os.path.isdir(os.path.join(site, "parameterized")):
        subprocess.run([*PIP, "install", "--quiet", "--target", site, "parameterized"], check=True)
    return site


def main() -> int:
    started = time.time()
    release = version("transformers")
    os.makedirs(CACHE, exist_ok=True)
    folder = fetch_common_tests(release)
    environment = {**os.environ, "DINT_TRANSFORMERS_TESTS": folder}
    site = parameterized_path(folder)
    if site is not None:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [site, environment.get("PYTHONPATH")]))
    print(f"transformers {release}: common tests from its sdist in {folder} ({time.time() - started:.0f} s)",
          flush=True)
    command = [sys.executable, "-m", "pytest", "tests/test_transformers_common.py", "-q", "-p", "no:cacheprovider",
               "-rs", "-W", "ignore::pytest.PytestUnknownMarkWarning", *sys.argv[1:]]
    return subprocess.run(command, cwd=REPO_ROOT, env=environment).returncode


if __name__ == "__main__":
    sys.exit(main())
