"""lm-evaluation-harness on a saved DINT, fully offline (the recipe of examples/eval_lm_harness.md): `lm_eval --model
hf` with trust_remote_code on the local task examples/lm_eval_task/shakespeare_heldout; its bits per byte must equal
the one computed here from the model's own log-probabilities.

Needs `pip install lm-eval==0.4.13`; skipped without it. Slow (~1 min: lm_eval's start-up dominates).
"""

import glob
import json
import math
import os
import shutil
import subprocess

import pytest
import torch

from modeling_dint import DintConfig, DintForCausalLM, save_dint_for_hub


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_DIR = os.path.join(REPO_ROOT, "examples", "lm_eval_task")
TOKENIZER_DIR = os.path.join(REPO_ROOT, "examples", "data", "tokenizer")


def lm_eval_command() -> list[str]:
    executable = shutil.which("lm_eval") or shutil.which("lm-eval")
    if executable is None:
        pytest.skip("lm-eval is not installed (pip install lm-eval==0.4.13)")
    return [executable]


def reference_bits_per_byte(model, tokenizer, passages: list[str]) -> float:
    """-sum log2 p(text) / bytes, each passage scored after one prefix token (bos) in a single window, as lm-eval's
    loglikelihood_rolling does when the passage fits the model's context."""
    total_logprob, total_bytes = 0.0, 0
    for text in passages:
        token_ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(token_ids) <= model.config.max_position_embeddings
        input_ids = torch.tensor([token_ids])
        with torch.no_grad():
            logprobs = model(input_ids).logits.float().log_softmax(-1)
        total_logprob += logprobs[0, :-1].gather(-1, input_ids[0, 1:, None]).sum().item()
        total_bytes += len(text.encode("utf-8"))
    return -total_logprob / total_bytes / math.log(2)


@pytest.mark.slow
def test_lm_eval_harness_offline_on_a_saved_dint(tmp_path):
    from transformers import AutoTokenizer

    command = lm_eval_command()
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    torch.manual_seed(0)
    # A context long enough for every passage to be one window, so the reference below is exact.
    config = DintConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), max_position_embeddings=1024, lambda_std_dev=0.3,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = DintForCausalLM(config).eval()
    model_dir = tmp_path / "dint-tiny"
    save_dint_for_hub(model, model_dir, tokenizer=tokenizer)

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    result = subprocess.run(
        command + [
            "--model", "hf",
            "--model_args", f"pretrained={model_dir},trust_remote_code=True,dtype=float32",
            "--tasks", "shakespeare_heldout",
            "--include_path", TASK_DIR,
            "--device", "cpu",
            "--batch_size", "4",
            "--output_path", str(tmp_path / "results"),
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, f"lm_eval failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    (results_file,) = glob.glob(str(tmp_path / "results" / "**" / "results_*.json"), recursive=True)
    with open(results_file) as handle:
        metrics = json.load(handle)["results"]["shakespeare_heldout"]
    assert metrics["sample_len"] == 24
    bits_per_byte = metrics["bits_per_byte,none"]
    assert math.isfinite(bits_per_byte) and math.isfinite(metrics["word_perplexity,none"])
    assert metrics["byte_perplexity,none"] == pytest.approx(2**bits_per_byte, rel=1e-9)

    with open(os.path.join(TASK_DIR, "shakespeare_heldout.jsonl"), encoding="utf-8") as handle:
        passages = [json.loads(line)["text"] for line in handle if line.strip()]
    assert bits_per_byte == pytest.approx(reference_bits_per_byte(model, tokenizer, passages), rel=1e-4)
