"""examples/train.py under `accelerate launch` with 2 CPU processes (gloo), for DDP and for FSDP (one DintDecoderLayer
per FSDP unit, sharded checkpoints): the run finishes, the training loss falls, the saved model reloads with a low
loss on the held-out text, and a run resumed from a mid-run checkpoint continues it (same global steps, same losses).

Each test launches two 2-process runs (about 1 minute on 2 cores): they are marked slow."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_dint  # noqa: F401  (registers "dint" with the Auto classes)


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SCRIPT = os.path.join(REPO_ROOT, "examples", "train.py")
FSDP_CONFIG = os.path.join(REPO_ROOT, "examples", "accelerate_fsdp.yaml")
DATA_DIR = os.path.join(REPO_ROOT, "examples", "data")
MAX_STEPS = 30
SAVE_STEPS = 15
LOGGING_STEPS = 5


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(strategy: str, output_dir, *extra_args):
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1"]
    launcher += ["--main_process_port", str(_free_port()), "--mixed_precision", "no", "--dynamo_backend", "no"]
    if strategy == "fsdp":
        launcher += ["--config_file", FSDP_CONFIG]
    else:
        launcher += ["--multi_gpu"]  # torchrun-style launch; train.py puts the processes on CPU (gloo) without a GPU
    script_args = [
        "--output_dir", str(output_dir),
        "--max_steps", str(MAX_STEPS),
        "--save_steps", str(SAVE_STEPS),
        "--logging_steps", str(LOGGING_STEPS),
        "--per_device_train_batch_size", "4",
        "--learning_rate", "3e-3",
        "--lr_scheduler_type", "constant",
        "--block_size", "64",
        "--max_train_chars", "150000",
        "--validation_file", "none",
        "--report_to", "none",
        "--disable_tqdm", "true",
        "--dataloader_num_workers", "0",
        *extra_args,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    completed = subprocess.run(
        launcher + [TRAIN_SCRIPT] + script_args,
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    with open(os.path.join(output_dir, "trainer_state.json")) as handle:
        state = json.load(handle)
    losses = {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}
    return completed.stdout + completed.stderr, state, losses


def _heldout_loss(model_dir) -> float:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with open(os.path.join(DATA_DIR, "shakespeare_heldout.txt"), encoding="utf-8") as handle:
        input_ids = tokenizer(handle.read(20_000), return_tensors="pt")["input_ids"][:, : 8 * 64].view(8, 64)
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids).loss.item()


@pytest.mark.slow
@pytest.mark.parametrize("strategy, preset", [("ddp", "tiny"), ("fsdp", "tiny"), ("ddp", "tiny-v2"), ("fsdp", "tiny-v2")])
def test_two_process_training_finishes_learns_saves_and_resumes(tmp_path, strategy, preset):
    log, state, losses = _launch(strategy, tmp_path / "run", "--preset", preset)
    assert "world size 2" in log
    if strategy == "fsdp":
        assert "FSDP on 2 CPU processes" in log
        assert os.path.isdir(tmp_path / "run" / f"checkpoint-{SAVE_STEPS}" / "pytorch_model_fsdp_0")  # sharded
    else:
        assert os.path.isfile(tmp_path / "run" / f"checkpoint-{SAVE_STEPS}" / "model.safetensors")
    assert state["global_step"] == MAX_STEPS
    assert sorted(losses) == list(range(LOGGING_STEPS, MAX_STEPS + 1, LOGGING_STEPS))
    assert losses[MAX_STEPS] < losses[LOGGING_STEPS] - 1.0, losses

    # The final model (gathered from the shards under FSDP) reloads with the tokenizer, and has learned.
    assert _heldout_loss(tmp_path / "run") < 7.0  # ln(4096) = 8.3 for a uniform guess

    # Resume from the mid-run checkpoint into a new folder: the run continues at step SAVE_STEPS + 1 (it saves no
    # checkpoint-SAVE_STEPS of its own; its log history is the checkpoint's, then steps > SAVE_STEPS) and logs the
    # same losses as the uninterrupted run (same data order, optimizer and RNG states restored).
    checkpoint = tmp_path / "run" / f"checkpoint-{SAVE_STEPS}"
    _, resumed_state, resumed_losses = _launch(
        strategy, tmp_path / "resumed", "--preset", preset, "--resume_from_checkpoint", str(checkpoint)
    )
    assert resumed_state["global_step"] == MAX_STEPS
    assert sorted(os.listdir(tmp_path / "resumed")).count(f"checkpoint-{MAX_STEPS}") == 1
    assert not os.path.exists(tmp_path / "resumed" / f"checkpoint-{SAVE_STEPS}")
    assert sorted(resumed_losses) == sorted(losses)
    for step, loss in resumed_losses.items():
        assert loss == pytest.approx(losses[step], abs=2e-3), (step, resumed_losses, losses)
    assert _heldout_loss(tmp_path / "resumed") == pytest.approx(_heldout_loss(tmp_path / "run"), abs=2e-3)


def _load_train_script():
    spec = importlib.util.spec_from_file_location("dint_train_example", TRAIN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_script_one_process_saves_and_resumes(tmp_path, monkeypatch):
    """The default suite's check of examples/train.py: one process, in this interpreter (a few seconds)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    train_script = _load_train_script()
    common = [
        "--max_steps", "8", "--save_steps", "4", "--logging_steps", "2", "--per_device_train_batch_size", "4",
        "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--block_size", "32",
        "--max_train_chars", "20000", "--max_eval_blocks", "16", "--report_to", "none", "--disable_tqdm", "true", "--seed", "0",
    ]  # fmt: skip
    train_script.main(["--output_dir", str(tmp_path / "run"), *common])
    with open(tmp_path / "run" / "trainer_state.json") as handle:
        state = json.load(handle)
    losses = {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}
    assert state["global_step"] == 8 and sorted(losses) == [2, 4, 6, 8]
    assert losses[8] < losses[2], losses
    with open(tmp_path / "run" / "eval_results.json") as handle:
        assert json.load(handle)["eval_loss"] < 8.0  # held-out text, below the uniform ln(4096) = 8.3

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    assert type(reloaded).__name__ == "DintForCausalLM" and reloaded.config.vocab_size == 4096
    assert AutoTokenizer.from_pretrained(tmp_path / "run").pad_token_id == reloaded.config.pad_token_id

    # Resume ("last" = the newest checkpoint of --output_dir) after raising max_steps: the run goes on to step 12.
    train_script.main(
        ["--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", "last", *common, "--max_steps", "12"]
    )
    with open(tmp_path / "run" / "trainer_state.json") as handle:
        resumed_state = json.load(handle)
    resumed_losses = {entry["step"]: entry["loss"] for entry in resumed_state["log_history"] if "loss" in entry}
    assert resumed_state["global_step"] == 12 and sorted(resumed_losses) == [2, 4, 6, 8, 10, 12]
    assert {step: resumed_losses[step] for step in losses} == losses
