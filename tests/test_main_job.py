"""The main job (examples/main_job.py, the README's first command) in its --quick form: it trains, saves a model that
reloads through the Auto classes, writes the loss plot and the model card, and prints the next steps."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from dint_testing import without_torchao_import_lines

from modeling_dint import REMOTE_CODE_FILES


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_RECORD = os.path.join(REPO_ROOT, "examples", "main_job_results", "metrics.json")


def load_main_job():
    spec = importlib.util.spec_from_file_location("main_job", os.path.join(REPO_ROOT, "examples", "main_job.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_update_reference_targets_the_committed_record():
    """The README's first command (`python examples/main_job.py`) must not rewrite the record its second command's
    tests compare the README against; --quick must not replace the default run's model."""
    main_job = load_main_job()
    default, quick = main_job.parse_args([]), main_job.parse_args(["--quick"])
    assert not default.update_reference and not quick.update_reference
    assert default.output_dir == "outputs/dint-tiny" and quick.output_dir == "outputs/dint-tiny-quick"
    assert main_job.parse_args(["--update_reference", "--output_dir", "elsewhere"]).update_reference
    for other_settings in (["--quick"], ["--max_steps", "10"], ["--threads", "2"]):
        with pytest.raises(SystemExit):
            main_job.parse_args(["--update_reference", *other_settings])


def test_main_job_quick(tmp_path):
    output_dir = tmp_path / "dint-tiny"
    with open(REFERENCE_RECORD, "rb") as file:
        record_before = file.read()
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "main_job.py"), "--quick",
         "--output_dir", str(output_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, f"main_job failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "Next steps:" in result.stdout and str(output_dir.resolve()) in result.stdout
    assert "reference run" not in result.stdout  # --quick leaves examples/main_job_results/metrics.json alone
    with open(REFERENCE_RECORD, "rb") as file:
        assert file.read() == record_before
    # No import noise of DINT's (with the `quantization` extra, torchao's own import lines are torchao's)
    for output in (result.stdout, result.stderr):
        assert "Failed to load" not in without_torchao_import_lines(output)

    files = set(os.listdir(output_dir))
    assert {
        "model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "README.md", "training_loss.png", "metrics.json", *REMOTE_CODE_FILES,
    } <= files
    assert not [name for name in files if (output_dir / name).is_dir()], "only the model's files belong in the folder"
    assert (output_dir / "training_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((output_dir / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_dint.DintForCausalLM"
    )

    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["heldout_perplexity_after"] < 0.8 * metrics["heldout_perplexity_before"]
    # The reloaded weights sit where safetensors put them (8-byte aligned only), the trained ones on a 64-byte boundary:
    # MKL (without `MKL_CBWR`) may sum in another order there, and does on AMD CPUs. Equal to the float's rounding, a
    # few units in the last place of the largest logit (0.0 on the Intel CPUs measured so far).
    rounding = 8 * torch.finfo(torch.float32).eps * metrics["reload_max_abs_logit"]
    assert metrics["reload_max_logit_difference"] <= rounding, (metrics["reload_max_logit_difference"], rounding)
    # Step 6 reloaded it in a process where `import modeling_dint` fails: the class is the remote code's.
    assert metrics["reloaded_class"].startswith("transformers_modules.") and metrics["threads"] == 1
    assert metrics["sample"].startswith("MACBETH.")

    card = (output_dir / "README.md").read_text()
    metadata = yaml.safe_load(card.split("---\n", 2)[1])
    assert metadata["library_name"] == "transformers" and "dint" in metadata["tags"]
    assert metadata["dint"]["num_parameters"] == metrics["num_parameters"]
    assert "![training loss](training_loss.png)" in card

    # The saved folder reloads here too, through the Auto classes, with the tokenizer.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(output_dir, trust_remote_code=True)
    assert model.num_parameters() == metrics["num_parameters"] and len(tokenizer) == model.config.vocab_size
    with torch.no_grad():
        logits = model(**tokenizer("MACBETH.\nSo foul and fair a day", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()
