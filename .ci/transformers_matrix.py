#!/usr/bin/env python3
"""DINT on the transformers releases it supports, each in its own virtualenv: prints a table release -> check.

    python .ci/transformers_matrix.py           # fast: the oldest and the newest supported release (`.ci/run`)
    python .ci/transformers_matrix.py --full    # every release of FULL_RELEASES; writes .ci/transformers_matrix.md

A virtualenv per release lives in `$DINT_MATRIX_DIR` (default `~/.cache/dint-matrix`, outside the repository) and is
created on first use (`venvs.py`): torch==2.13.0 (the CPU build) first, so that nothing pulls a CUDA build, then
transformers==X, accelerate and pytest. The checks, per release X:

- remote code: a checkpoint saved by the package under the newest release loads with `trust_remote_code=True`
  while `import modeling_dint` is blocked; its logits equal the reference saved with it (fp32, 1e-5), and greedy,
  sampled (seeded), beam, static-cache and cached-continuation generation give the reference tokens; `Trainer` runs a
  few steps (finite loss that falls);
- saved under X -> newest: the trained model, saved under X, loads under the newest release with the logits it had;
- core tests: the package, installed against X (`pip install -e . transformers==X` also checks `install_requires`),
  passes a core subset of the test suite (fast mode: on the oldest release; `.ci/run`'s default suite covers the
  newest);
- below the floor (4.57.6): `import modeling_dint` and a remote-code load both fail with the one clear error.

This file is also the worker the virtualenvs run (`--worker ...`): the orchestrating side imports the standard
library only.

Why not nox: its sessions (one virtualenv each, parametrized by release, reused with `-r`) would replace only the
virtualenv management (`venvs.py`, ~50 lines shared with `torch_matrix.py`). The matrix chains results across
virtualenvs (a reference saved under the newest release, loaded under each, saved again and loaded under the newest)
into one table: as nox sessions that is files passed between sessions ordered by `requires=`, a table session that
reads them, and nox itself to install before CI can run anything; not shorter, and the chain is less visible.
"""

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

from venvs import ensure_venv, pytest_summary, repository_install


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_RELEASES = ("5.5.4", "5.10.4", "5.17.0", "5.20.2", "5.23.0", "5.24.0")
"""The oldest supported release, releases in between, and the newest (docs/supported-releases.md's table lists these)."""
FAST_RELEASES = (FULL_RELEASES[0], "5.17.0", FULL_RELEASES[-1])
"""CI's default: the oldest, the newest, and 5.17.0, the release of the lent GPU machines' image and one of 5.15-5.20,
whose `PreTrainedConfig.__post_init__` assigns `base_model_tp_plan` for tied embeddings (a DintConfig without the
plan's setter failed there, unseen by the two ends)."""
BELOW_FLOOR_RELEASE = "4.57.6"
TORCH_REQUIREMENT = "torch==2.13.0"
CORE_TESTS = (
    "tests/test_transformers_compat.py",
    "tests/test_modeling.py",
    "tests/test_generation.py",
    "tests/test_attention.py",
    "tests/test_padding.py",
    "tests/test_cache.py",
    # generate()'s compiled decoding step, one graph for the whole generation: how each release hands the step its
    # masks differs (5.5 to 5.17 passed a view of the growing 2D mask at batch 1, and the step recompiled every token)
    "tests/test_contract.py::test_compiled_static_cache_generation_compiles_the_decode_step_once",
)
FAST_CORE_TESTS = (*CORE_TESTS[:3], CORE_TESTS[-1])
REMOTE_CHECKS = ("logits", "greedy", "sampled", "beam", "static cache", "cached continuation", "Trainer")
LOGITS_TOLERANCE = 1e-5


# ----------------------------------------------------------------------------------------------------- orchestration
def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def release_venv(venv_dir: str, release: str) -> str:
    """The python of the virtualenv for transformers `release` (created on first use)."""
    requirements = [f"transformers=={release}", "accelerate>=1.10", "pytest>=8"]
    return ensure_venv(os.path.join(venv_dir, f"transformers-{release}"), TORCH_REQUIREMENT, requirements)


def worker(python: str, mode: str, *args: str, block_package: bool = True) -> dict:
    """Runs this file as `--worker mode` with `python`; returns the JSON it prints last (or the failure's tail)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    env["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="dint-matrix-modules-")  # a fresh copy of the remote code
    if block_package:
        env["DINT_MATRIX_BLOCK_PACKAGE"] = "1"
    else:
        env["PYTHONPATH"] = REPO_ROOT
    result = run([python, os.path.abspath(__file__), "--worker", mode, *args], env=env, cwd=tempfile.gettempdir())
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (result.stdout + result.stderr)[-2000:]}


def core_tests(python: str, release: str, test_files: tuple[str, ...]) -> str:
    """Installs the package against `release` and runs `test_files`; returns pytest's summary (e.g. '12 passed')."""
    with repository_install():
        install = run([python, "-m", "pip", "install", "--quiet", "-e", REPO_ROOT, f"transformers=={release}"])
    if install.returncode != 0:
        return "FAIL: install: " + install.stderr.strip().splitlines()[-1]
    summary, _, passed = pytest_summary(python, list(test_files))
    return summary if passed else f"FAIL: {summary}"


def cell(result: dict, check: str) -> str:
    if "error" in result:
        return "FAIL"
    return "pass" if result["checks"].get(check) else "FAIL"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help=f"every release of {FULL_RELEASES} (slow mode)")
    parser.add_argument("--venv-dir", default=os.environ.get("DINT_MATRIX_DIR", "~/.cache/dint-matrix"))
    parser.add_argument("--output", help="markdown file for the table (with --full: .ci/transformers_matrix.md)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("worker_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return run_worker(args.worker, args.worker_args)

    started = time.time()
    releases = FULL_RELEASES if args.full else FAST_RELEASES
    test_files = CORE_TESTS if args.full else FAST_CORE_TESTS
    venv_dir = os.path.expanduser(args.venv_dir)
    output = args.output or (os.path.join(REPO_ROOT, ".ci", "transformers_matrix.md") if args.full else None)
    work = tempfile.mkdtemp(prefix="dint-matrix-")
    pythons = {release: release_venv(venv_dir, release) for release in (*releases, BELOW_FLOOR_RELEASE)}
    newest = releases[-1]
    print(f"virtualenvs ready in {time.time() - started:.0f} s ({venv_dir})", flush=True)

    reference = os.path.join(work, "saved-by-package-under-newest")
    made = worker(pythons[newest], "reference", reference, block_package=False)
    if "error" in made:
        print(f"could not build the reference checkpoint under transformers {newest}:\n{made['error']}")
        return 1

    rows, failed = [], False
    for release in releases:
        remote = worker(pythons[release], "remote", reference, os.path.join(work, f"saved-under-{release}"))
        back = worker(pythons[newest], "load-saved", os.path.join(work, f"saved-under-{release}"))
        if args.full or release != newest:
            tests = core_tests(pythons[release], release, test_files)
        else:
            tests = "not run in fast mode (the default suite runs on the newest release)"
        row = [release, *(cell(remote, check) for check in REMOTE_CHECKS), cell(back, "logits"), tests]
        failed |= any(value.startswith("FAIL") for value in row)
        rows.append(row)
        print(" | ".join(row), flush=True)
        for result in (remote, back):
            if "error" in result:
                print(result["error"])
    floor = worker(pythons[BELOW_FLOOR_RELEASE], "below-floor", reference, block_package=False)
    floor_cells = [cell(floor, "import modeling_dint"), cell(floor, "remote-code load")]
    failed |= "FAIL" in floor_cells
    if "error" in floor:
        print(floor["error"])

    header = ["transformers", *REMOTE_CHECKS, "saved here, loaded by newest", "core tests"]
    lines = [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        f"transformers {BELOW_FLOOR_RELEASE} (below the floor): the clear error on `import modeling_dint`: "
        f"{floor_cells[0]}; on a remote-code load: {floor_cells[1]}. Message: {floor.get('message', '-')}",
    ]
    table = "\n".join(lines)
    print("\n" + table)
    print(f"\ntransformers matrix ({'full' if args.full else 'fast'}): {time.time() - started:.0f} s")
    if output:
        with open(output, "w", encoding="utf-8") as file:
            file.write(
                f"# DINT on transformers releases\n\nOutput of `python .ci/transformers_matrix.py"
                f"{' --full' if args.full else ''}` (torch 2.13.0 CPU; core tests: {' '.join(test_files)}).\n\n"
                f"{table}\n"
            )
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------- workers
def run_worker(mode: str, worker_args: list[str]) -> int:
    if os.environ.get("DINT_MATRIX_BLOCK_PACKAGE"):
        block_package()
    results = {"worker": mode}
    try:
        results.update(WORKERS[mode](*worker_args))
    except Exception as error:  # the orchestrator prints it in the table's failure details
        import traceback

        results = {"error": traceback.format_exc()[-2000:] + repr(error)}
    print(json.dumps(results))
    return 0


def block_package() -> None:
    """Makes `import modeling_dint` fail, as on a machine where only the checkpoint's remote code is available."""
    import importlib.abc

    class BlockModelingDint(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "modeling_dint" or name.startswith("modeling_dint."):
                raise ImportError(f"{name} is blocked: the checkpoint must load by its remote code")

    sys.meta_path.insert(0, BlockModelingDint())


def fixed_batch():
    """Two left-padded prompts of the tiny vocabulary (128 tokens), the same under every release."""
    import torch

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, 128, (2, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :3], attention_mask[1, :3] = 0, 0
    return input_ids, attention_mask


def model_outputs(model) -> dict:
    """Logits and the tokens of every decoding mode the matrix compares, for `fixed_batch()`."""
    import torch

    input_ids, attention_mask = fixed_batch()
    common = dict(attention_mask=attention_mask, max_new_tokens=6, pad_token_id=0)
    outputs = {}
    with torch.no_grad():
        outputs["logits"] = model(input_ids, attention_mask=attention_mask).logits
        outputs["greedy"] = model.generate(input_ids, do_sample=False, **common)
        torch.manual_seed(1234)
        outputs["sampled"] = model.generate(input_ids, do_sample=True, top_k=0, **common)
        outputs["beam"] = model.generate(input_ids, do_sample=False, num_beams=3, **common)
        outputs["static cache"] = model.generate(input_ids, do_sample=False, cache_implementation="static", **common)
        first = model.generate(input_ids, do_sample=False, return_dict_in_generate=True, **common)
        continued_mask = torch.cat([attention_mask, attention_mask.new_ones(2, 6)], dim=-1)
        # The cache under the release's name: `cache` from 5.24 (Llama's forward, which DINT's is), `past_key_values`
        # before
        cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        outputs["cached continuation"] = model.generate(
            first.sequences,
            **{cache_name: first[cache_name]},
            **{**common, "attention_mask": continued_mask},
            do_sample=False,
        )
    return outputs


def compare_outputs(outputs: dict, reference: dict) -> dict:
    import torch

    checks = {}
    for name, value in outputs.items():
        if name == "logits":
            checks[name] = torch.allclose(value, reference[name], atol=LOGITS_TOLERANCE, rtol=LOGITS_TOLERANCE)
        else:
            checks[name] = torch.equal(value, reference[name])
    return checks


def load_remote(checkpoint: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    if type(model).__module__.startswith("modeling_dint"):
        raise RuntimeError(f"loaded {type(model).__module__}, not the checkpoint's remote code")
    return model


def worker_reference(checkpoint: str) -> dict:
    """Under the newest release, with the package: a tiny DINT, saved with its reference outputs."""
    import torch

    sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))
    from dint_testing import tiny_model

    model = tiny_model()
    model.save_pretrained(checkpoint)
    torch.save(model_outputs(model), os.path.join(checkpoint, "reference_outputs.pt"))
    return {"checks": {"saved": True}}


def worker_remote(checkpoint: str, save_to: str) -> dict:
    """Loads the newest release's checkpoint by remote code, compares, trains a few steps, saves under this release."""
    import math

    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    model = load_remote(checkpoint)
    reference = torch.load(os.path.join(checkpoint, "reference_outputs.pt"))
    checks = compare_outputs(model_outputs(model), reference)

    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": row, "labels": row} for row in torch.randint(2, 128, (8, 16), generator=generator)]
    arguments = TrainingArguments(
        output_dir=os.path.join(save_to, "trainer"),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model.train(), args=arguments, train_dataset=examples)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    checks["Trainer"] = len(losses) == 6 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]

    model.eval().save_pretrained(save_to)
    with torch.no_grad():
        input_ids, attention_mask = fixed_batch()
        torch.save(model(input_ids, attention_mask=attention_mask).logits, os.path.join(save_to, "saved_logits.pt"))
    return {"checks": checks, "transformers": transformers.__version__, "losses": losses}


def worker_load_saved(checkpoint: str) -> dict:
    """Under the newest release: loads a model saved under another release by remote code; its logits must match."""
    import torch

    model = load_remote(checkpoint)
    input_ids, attention_mask = fixed_batch()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    expected = torch.load(os.path.join(checkpoint, "saved_logits.pt"))
    return {"checks": {"logits": torch.allclose(logits, expected, atol=LOGITS_TOLERANCE, rtol=LOGITS_TOLERANCE)}}


def worker_below_floor(checkpoint: str) -> dict:
    """Below the floor, both the package and the remote code must fail with the one clear error."""
    import transformers

    messages = {}
    try:
        import modeling_dint  # noqa: F401
    except ImportError as error:
        messages["import modeling_dint"] = str(error)
    block_package()
    try:
        load_remote(checkpoint)
    except ImportError as error:
        messages["remote-code load"] = str(error)

    def is_clear(message: str | None) -> bool:
        installed = transformers.__version__
        return bool(message) and message.startswith("DINT needs transformers >= ") and installed in message

    checks = {name: is_clear(messages.get(name)) for name in ("import modeling_dint", "remote-code load")}
    return {"checks": checks, "message": messages.get("remote-code load", "")}


WORKERS = {
    "reference": worker_reference,
    "remote": worker_remote,
    "load-saved": worker_load_saved,
    "below-floor": worker_below_floor,
}


if __name__ == "__main__":
    sys.exit(main())
