"""The main job (examples/main_job.py, the README's first command) in its --quick form: it trains, saves a model that
reloads through the Auto classes, writes the loss plot and the model card, and prints the next steps."""

import json
import os
import subprocess
import sys

import torch
import yaml


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_job_quick(tmp_path):
    output_dir = tmp_path / "dint-tiny"
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "main_job.py"), "--quick",
         "--output_dir", str(output_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, f"main_job failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "Next steps:" in result.stdout and str(output_dir.resolve()) in result.stdout
    assert "reference run" not in result.stdout  # --quick leaves examples/main_job_results/metrics.json alone
    assert "Failed to load" not in result.stdout + result.stderr  # no torchao import noise

    files = set(os.listdir(output_dir))
    assert {
        "model.safetensors", "config.json", "generation_config.json", "configuration_dint.py", "modeling_dint.py",
        "cache_dint.py", "tokenizer.json", "tokenizer_config.json", "README.md", "training_loss.png", "metrics.json",
    } <= files
    assert not [name for name in files if (output_dir / name).is_dir()], "only the model's files belong in the folder"
    assert (output_dir / "training_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((output_dir / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_dint.DintForCausalLM"
    )

    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["heldout_perplexity_after"] < 0.8 * metrics["heldout_perplexity_before"]
    assert metrics["reload_max_logit_difference"] == 0.0
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
