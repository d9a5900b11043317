"""The package's layout: `modeling_dint/`'s top level holds what travels with a checkpoint, the tools live in
`modeling_dint.integrations`, an import by a tool's old path fails with a message naming the new one, setup.py's entry
points name modules that exist, and a checkpoint saved before the tools moved (commit 81beb7c) loads with the logits it
was saved with, by the package and by the remote code saved with it."""

import ast
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import modeling_dint
from dint_testing import WITHOUT_THE_PACKAGE
from modeling_dint import DintForCausalLM
from modeling_dint.integrations import MOVED_TOOLS


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.dirname(modeling_dint.__file__)


def test_the_top_level_holds_what_travels_with_a_checkpoint():
    top_level = {name for name in os.listdir(PACKAGE_DIR) if name.endswith(".py")}
    assert top_level == {"__init__.py", *modeling_dint.REMOTE_CODE_FILES}
    folders = {name for name in os.listdir(PACKAGE_DIR)
               if os.path.isdir(os.path.join(PACKAGE_DIR, name)) and name != "__pycache__"}
    assert folders == {"integrations"}


@pytest.mark.parametrize("old_path", sorted(MOVED_TOOLS))
def test_an_old_import_path_names_the_new_one(old_path):
    new_path = MOVED_TOOLS[old_path]
    assert importlib.import_module(new_path).__name__ == new_path
    with pytest.raises(ModuleNotFoundError, match=f"{old_path} moved to {new_path}"):
        importlib.import_module(old_path)
    with pytest.raises(ModuleNotFoundError, match=f"import {new_path}"):
        exec(f"from modeling_dint import {old_path.rsplit('.', 1)[1]}", {})
    assert old_path not in sys.modules


IMPORT_SIDE_EFFECTS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, transformers, huggingface_hub, safetensors

    finders = list(sys.meta_path)
    import modeling_dint
    from modeling_dint.integrations import MovedToolsFinder

    added = [finder for finder in sys.meta_path if finder not in finders]
    kept = [finder for finder in sys.meta_path if finder in finders] == finders
    answers = [added[0].find_spec(name) for name in ("json", "modeling_dint.integrations", "modeling_dint.servings")]
    import email.mime.text  # an import after it goes on as before
    print(json.dumps({"added": [type(finder).__name__ for finder in added], "kept": kept,
                      "answers": [answer is None for answer in answers]}))
    """
)


def test_importing_the_package_adds_one_finder_that_answers_for_the_old_paths_only():
    """Importing the package changes nothing of other libraries' imports: it adds one finder to `sys.meta_path`, which
    answers None for every name but the old paths, and leaves the other finders in their order."""
    environment = {**os.environ, "PYTHONPATH": REPO_ROOT}
    result = subprocess.run([sys.executable, "-c", IMPORT_SIDE_EFFECTS_SCRIPT], capture_output=True, text=True,
                            env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"added": ["MovedToolsFinder"], "kept": True, "answers": [True, True, True]}


def setup_entry_points() -> tuple[dict, list]:
    """setup.py's `entry_points` and `packages`, read from its syntax tree."""
    with open(os.path.join(REPO_ROOT, "setup.py"), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    return ast.literal_eval(keywords["entry_points"]), ast.literal_eval(keywords["packages"])


def test_setup_names_the_moved_modules():
    """The console scripts and vLLM's plugin entry point name functions that exist, and the packages setup.py installs
    are every package folder of `modeling_dint/` (the presets and converters come from their own folders)."""
    entry_points, packages = setup_entry_points()
    targets = [entry.split("=", 1)[1].strip() for entries in entry_points.values() for entry in entries]
    assert "modeling_dint.integrations.serve_cli:main" in targets
    assert "modeling_dint.integrations.vllm:register" in targets
    for target in targets:
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target
    package_folders = {
        os.path.relpath(folder, REPO_ROOT).replace(os.sep, ".")
        for folder, _, files in os.walk(PACKAGE_DIR)
        if "__init__.py" in files
    }
    assert package_folders | {"modeling_dint.presets", "modeling_dint.conversion"} == set(packages)


BEFORE_THE_MOVE = "81beb7c"
"""The commit before the tools moved into `modeling_dint/integrations/` (issue 56): the base of that change."""

SAVED_LAYOUTS = {"v1": 2, "v2": 1}
"""The checkpoints the old tree saves: each head layout, with its number of KV heads."""

SAVE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import modeling_dint
    from modeling_dint import DintConfig, DintForCausalLM

    assert modeling_dint.__file__.startswith(sys.argv[1]), modeling_dint.__file__
    saved_logits = {}
    for layout, kv_heads, checkpoint in json.loads(sys.argv[2]):
        torch.manual_seed(0)
        config = DintConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=kv_heads, lambda_std_dev=0.3,
                            differential_attention=layout, pad_token_id=0, bos_token_id=1, eos_token_id=None)
        model = DintForCausalLM(config).eval()
        model.save_pretrained(checkpoint)
        with torch.no_grad():
            saved_logits[checkpoint] = model(torch.tensor([[5, 6, 7, 8, 9, 10]])).logits.flatten().tolist()
    print(json.dumps(saved_logits))
    """
)

REMOTE_CODE_SCRIPT = WITHOUT_THE_PACKAGE + textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM

    logits = {}
    for checkpoint in sys.argv[1:]:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        with torch.no_grad():
            logits[checkpoint] = model(torch.tensor([[5, 6, 7, 8, 9, 10]])).logits.flatten().tolist()
    print(json.dumps(logits))
    """
)


def run_python(script: str, *arguments: str, cwd, pythonpath: str | None) -> dict:
    """The JSON the script prints last, run in a process of its own (one per script: a process costs seconds)."""
    # The eager integral: the old tree's CPU op would be built again (a source of its own), half a minute per machine
    environment = {**os.environ, "HF_HOME": os.path.join(cwd, "hf_home"), "HF_HUB_OFFLINE": "1",
                   "DINT_CPU_KERNEL": "0"}
    environment.pop("PYTHONPATH", None)
    if pythonpath is not None:
        environment["PYTHONPATH"] = pythonpath
    result = subprocess.run([sys.executable, "-c", script, *arguments], capture_output=True, text=True, cwd=cwd,
                            env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_checkpoint_saved_before_the_move_loads_with_its_logits(tmp_path):
    """A model of each head layout saved by the package at `BEFORE_THE_MOVE` (its files taken from git, in a process
    of their own) loads with the logits it was saved with: by this package, and by the remote code saved with it in a
    process without the package."""
    old_tree = tmp_path / "old"
    old_tree.mkdir()
    archive = subprocess.run(["git", "-C", REPO_ROOT, "archive", BEFORE_THE_MOVE, "modeling_dint"],
                             capture_output=True, timeout=120)
    assert archive.returncode == 0, (
        f"this test reads commit {BEFORE_THE_MOVE} from the repository's git history: {archive.stderr.decode()[-500:]}"
    )
    subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive.stdout, check=True, timeout=120)
    assert (old_tree / "modeling_dint" / "serving.py").exists()  # the tree before the move

    checkpoints = {layout: str(tmp_path / f"checkpoint-{layout}") for layout in SAVED_LAYOUTS}
    to_save = [(layout, kv_heads, checkpoints[layout]) for layout, kv_heads in SAVED_LAYOUTS.items()]
    saved_logits = run_python(SAVE_SCRIPT, str(old_tree), json.dumps(to_save), cwd=str(tmp_path),
                              pythonpath=str(old_tree))
    remote_logits = run_python(REMOTE_CODE_SCRIPT, *checkpoints.values(), cwd=str(tmp_path), pythonpath=None)
    for layout, checkpoint in checkpoints.items():
        expected = torch.tensor(saved_logits[checkpoint])
        model = DintForCausalLM.from_pretrained(checkpoint).eval()
        assert model.config.differential_attention == layout
        with torch.no_grad():
            logits = model(torch.tensor([[5, 6, 7, 8, 9, 10]])).logits.flatten()
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=f"{layout}: this package")
        torch.testing.assert_close(torch.tensor(remote_logits[checkpoint]), expected, rtol=1e-5, atol=1e-5,
                                   msg=f"{layout}: the remote code")
