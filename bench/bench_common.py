# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""What every benchmark script shares: the four models at one size with copied weights, the timed steps, the byte
counts of a cache, and the machine description.

The four models (names used in every result file):
- `dint_fast`:  `DintForCausalLM`, the fast path (sdpa, or the `--attn` backend): O1, O2 from the backend plus a
  running mean of O1 (docs/design.md section 2).
- `dint_eager`: `DintForCausalLM` with `attn_implementation="eager"`: the materializing reference (A1, A2, G, A_final
  built as N x N maps).
- `diffllama`:  transformers' `DiffLlamaForCausalLM`, same backend as `dint_fast`.
- `llama`:      transformers' `LlamaForCausalLM`, same backend, same number of softmax maps and head_dim.
- `dint_v2`:    `DintForCausalLM(differential_attention="v2")` (docs/design.md section 10): the same softmax maps as
  query heads (2h of head_dim), the same KV heads (which must divide h), one attention call over Llama's KV cache.
- `diff_v2`:    `dint_v2` with `integral="none"`: DIFF V2 itself, the same weights (what the integral costs on v2).

Weights: `dint_fast` is initialized from a seed; `dint_eager` loads its state dict; DiffLlama loads every tensor but the
head-norm weights (its group norm has none); Llama loads every tensor whose name and shape it shares (all but the
lambda vectors and head norms); `dint_v2` and `diff_v2` load every tensor Llama loads but o_proj (h*head_dim wide),
and their o_proj and lambda_proj come from the same seed.
"""

import gc
import os
import platform
import re
import shlex
import subprocess
import sys
import time

import torch
from torch import nn

from modeling_dint.transformers_compat import CACHE_ARGUMENT  # `cache` from transformers 5.24, `past_key_values` before


BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
"""Committed results: `results/<script>/<machine kind>/`, the latest run of that script on that kind of machine (git
keeps the earlier ones)."""

MODEL_NAMES = ("dint_fast", "dint_eager", "diffllama", "llama", "dint_v2", "diff_v2")
V2_MODEL_NAMES = ("dint_v2", "diff_v2")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


SIZE_PRESETS = {
    "default": {"hidden_size": 256, "intermediate_size": 688, "num_layers": 4, "num_heads": 8, "num_kv_heads": None,
                "head_dim": None, "vocab_size": 2048, "tie_word_embeddings": False},
    # The size at which issue 31 found DINT slower than DiffLlama (its MLP width was not stated: 2.6875 x hidden, the
    # default's ratio).
    "mid": {"hidden_size": 512, "intermediate_size": 1376, "num_layers": 16, "num_heads": 8, "num_kv_heads": 4,
            "head_dim": None, "vocab_size": 8192, "tie_word_embeddings": False},
    # SmolLM2-135M as `examples/convert_smollm2.py` converts it (`--head-init duplicate`: its 9 heads / 3 KV heads of
    # 64 become 18 softmax maps / 6 KV heads), with the head norm on (the architecture's default).
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_layers": 30, "num_heads": 18,
                     "num_kv_heads": 6, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True},
    # Llama-3.2-1B's shape (32 heads and 8 KV heads of 64 pair as they are).
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8,
           "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True},
}
"""The `--size` presets (random weights: nothing is downloaded). A size flag given beside `--size` overrides the
preset's field."""


def add_model_size_arguments(parser) -> None:
    """The size flags every benchmark script takes (read by `model_size_kwargs`): `--size` picks a preset of
    `SIZE_PRESETS` (default: hidden 256, 4 layers, 8 softmax maps (4 differential heads), head_dim 32, MLP 688, vocab
    2048), the other flags override its fields; and the batch size (default 1)."""
    parser.add_argument("--size", default="default", choices=sorted(SIZE_PRESETS), help="a preset of SIZE_PRESETS")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--intermediate-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--num-heads", type=int, default=None, help="softmax maps (DINT/DiffLlama: H/2 diff. heads)")
    parser.add_argument("--num-kv-heads", type=int, default=None, help="default: --num-heads (must be even)")
    parser.add_argument("--head-dim", type=int, default=None, help="default: hidden size / --num-heads")
    parser.add_argument("--vocab-size", type=int, default=None)


def resolve_model_size(args) -> None:
    """Fills the size flags left unset (None) in `args` from the `--size` preset; a no-op on resolved `args`."""
    for field, value in SIZE_PRESETS[args.size].items():
        if getattr(args, field, None) is None:
            setattr(args, field, value)
    args.num_kv_heads = args.num_kv_heads or args.num_heads
    args.head_dim = args.head_dim or args.hidden_size // args.num_heads


def model_size_kwargs(args) -> dict:
    """The config fields shared by the four models, from the size flags (`add_model_size_arguments`) and
    `args.max_positions`."""
    resolve_model_size(args)
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": max(args.max_positions, 64),
        "tie_word_embeddings": args.tie_word_embeddings,
        "use_cache": True,
    }


def build_model(name: str, size_kwargs: dict, attn: str, dtype: torch.dtype, device: str, seed: int = 0):
    """Builds one of `MODEL_NAMES` with the weights that `dint_fast` gets from `seed` (copied where shapes allow).

    Every model is built from the same seed, so building one alone (a memory probe in a fresh process) gives the
    same weights as building all four together.
    """
    return build_models({name: (name, attn)}, size_kwargs, dtype, device, seed)[name]


def build_models(
    models: dict[str, tuple[str, str]], size_kwargs: dict, dtype: torch.dtype, device: str, seed: int = 0
) -> dict:
    """Builds models with the weights `dint_fast` gets from `seed`, shared: every model holds the same weight tensors
    (one copy in memory, so that three 1B models fit), DINT's lambda vectors in fp32 as `from_pretrained(dtype=...)`
    keeps them (`_keep_in_fp32_modules_strict`).

    Args:
        models: `{label: (one of MODEL_NAMES, attention implementation)}` (`dint_eager` is always "eager").

    Returns:
        `{label: model}` in eval mode, on `device`, in `dtype`.
    """
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM, LlamaConfig, LlamaForCausalLM

    from modeling_dint import DintConfig, DintForCausalLM

    torch.manual_seed(seed)
    reference = DintForCausalLM(DintConfig(**size_kwargs))
    keep_fp32 = set(reference._keep_in_fp32_modules_strict)
    # One tensor per storage: the tied embedding and LM head stay one tensor after the cast.
    converted, shared = {}, {}
    for key, tensor in reference.state_dict().items():
        target_dtype = torch.float32 if key.rsplit(".", 1)[-1] in keep_fp32 else dtype
        cache_key = (tensor.data_ptr(), target_dtype)
        if cache_key not in converted:
            converted[cache_key] = nn.Parameter(tensor.to(device=device, dtype=target_dtype), requires_grad=True)
        shared[key] = converted[cache_key]
    buffers = {key: buffer.to(device) for key, buffer in reference.named_buffers()}
    v2_shared = shared
    if any(name in V2_MODEL_NAMES for name, _ in models.values()):
        # v2's own tensors (o_proj from h*head_dim, lambda_proj), from the same seed
        torch.manual_seed(seed + 1)
        v2_reference = DintForCausalLM(DintConfig(**size_kwargs, differential_attention="v2"))
        v2_shared = dict(shared)
        for key, tensor in v2_reference.state_dict().items():
            if "o_proj" in key or "lambda_proj" in key:
                v2_shared[key] = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=True)
        del v2_reference
    del reference, converted

    classes = {
        "dint_fast": (DintForCausalLM, DintConfig, ()),
        "dint_eager": (DintForCausalLM, DintConfig, ()),
        "diffllama": (DiffLlamaForCausalLM, DiffLlamaConfig, ("head_norm",)),
        "llama": (LlamaForCausalLM, LlamaConfig, ("head_norm", "lambda_")),
        "dint_v2": (DintForCausalLM, DintConfig, ("head_norm", "lambda_", "o_proj")),
        "diff_v2": (DintForCausalLM, DintConfig, ("head_norm", "lambda_", "o_proj")),
    }
    built = {}
    for label, (name, attn) in models.items():
        if name not in classes:
            raise ValueError(f"model name {name!r} is not one of {MODEL_NAMES}")
        model_class, config_class, allowed_left_out = classes[name]
        implementation = "eager" if name == "dint_eager" else attn
        fields = size_kwargs
        if name in V2_MODEL_NAMES:
            fields = {**size_kwargs, "differential_attention": "v2", "integral": "mean" if name == "dint_v2" else "none"}
        with torch.device("meta"):
            model = model_class._from_config(config_class(**fields), attn_implementation=implementation)
        _load_shared_tensors(model, v2_shared if name in V2_MODEL_NAMES else shared, buffers, allowed_left_out)
        if name == "diffllama" and dtype != torch.float32:
            # DiffLlama keeps no tensor in fp32 (from_pretrained(dtype=...) casts its lambda vectors too).
            for module in model.modules():
                for attribute in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                    if isinstance(getattr(module, attribute, None), nn.Parameter):
                        setattr(module, attribute, nn.Parameter(getattr(module, attribute).to(dtype)))
        built[label] = model.eval()
    return built


def _load_shared_tensors(model, shared: dict, buffers: dict, allowed_left_out: tuple[str, ...]) -> None:
    """Gives `model` (built on the meta device) the tensors of `shared` whose name and shape it has, the very
    tensors (no copy), and the reference's buffers (RoPE's inverse frequencies, not in a state dict) by name; fails
    if a tensor of `model` is left without a source or a source tensor other than `allowed_left_out` has no target."""
    target_state = model.state_dict()
    matching = {k: v for k, v in shared.items() if k in target_state and target_state[k].shape == v.shape}
    left_out = [k for k in shared if k not in matching and not any(part in k for part in allowed_left_out)]
    missing = [k for k in target_state if k not in matching]
    if left_out or missing:
        raise RuntimeError(
            f"{type(model).__name__}: weights could not be copied one to one (source tensors without target: "
            f"{left_out[:5]}, target tensors without source: {missing[:5]})"
        )
    model.load_state_dict(matching, strict=True, assign=True)
    for key, buffer in model.named_buffers():
        if buffer.is_meta:
            module_name, _, buffer_name = key.rpartition(".")
            source = buffers.get(key)
            if source is None or source.shape != buffer.shape:
                raise RuntimeError(f"{type(model).__name__}: buffer {key} has no source of its shape")
            model.get_submodule(module_name)._buffers[buffer_name] = source
    still_meta = [key for key, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if still_meta:
        raise RuntimeError(f"{type(model).__name__}: tensors left on the meta device: {still_meta[:5]}")


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_input_ids(seq_len: int, batch_size: int, vocab_size: int, device: str, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + seq_len)
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator).to(device)


def forward_step(model, input_ids: torch.Tensor) -> None:
    """An inference forward pass over the whole sequence: no gradient, no cache, logits of every position."""
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)


def train_step(model, input_ids: torch.Tensor) -> None:
    """Forward with the language-modeling loss, then backward (the gradients are dropped first)."""
    model.zero_grad(set_to_none=True)
    outputs = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    outputs.loss.backward()


def prefill(model, input_ids: torch.Tensor):
    """Runs the prompt with a fresh cache; returns `(cache, next_token [B, 1])`."""
    with torch.no_grad():
        outputs = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    return outputs[CACHE_ARGUMENT], outputs.logits[:, -1:].argmax(-1)


def decode_step(model, cache, next_token: torch.Tensor) -> torch.Tensor:
    """One greedy token with the cache (the cache grows by one position); returns the next token `[B, 1]`."""
    with torch.no_grad():
        outputs = model(input_ids=next_token, use_cache=True, **{CACHE_ARGUMENT: cache})
    return outputs.logits[:, -1:].argmax(-1)


def _tensor_bytes(value) -> int:
    """Bytes of every tensor in `value` (a tensor, or lists / tuples / dicts of them, nested)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    return 0


def cache_layer_bytes(cache) -> list[dict]:
    """Per cache layer: `kv_bytes` (keys + values) and `integral_bytes` (every other tensor attribute of the layer
    object: DINT's integral statistics, the recorded rows for `crop` included; 0 for Llama and DiffLlama)."""
    per_layer = []
    for layer in cache.layers:
        kv_bytes = _tensor_bytes(getattr(layer, "keys", None)) + _tensor_bytes(getattr(layer, "values", None))
        integral_bytes = sum(
            _tensor_bytes(value) for attribute, value in vars(layer).items() if attribute not in ("keys", "values")
        )
        per_layer.append({"kv_bytes": kv_bytes, "integral_bytes": integral_bytes})
    return per_layer


def collect_garbage(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def machine_kind(device: str) -> str:
    """The kind of machine a result is filed under: "cpu", or the GPU's model in lower case ("h200", "h100")."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(device)
    match = re.search(r"\b([A-Z]+\d+)", name.replace("NVIDIA", ""))
    return match.group(1).lower() if match else re.sub(r"\W+", "_", name.lower()).strip("_")


def results_dir(script: str, device: str) -> str:
    """`bench/results/<script>/<machine kind>/`, where a run of `script` (a file name or path) files its results."""
    return os.path.join(RESULTS_DIR, os.path.splitext(os.path.basename(script))[0], machine_kind(device))


def command_line() -> str:
    """The command that started this process, as typed from the repository root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO_ROOT)
    return " ".join(["python", script, *(shlex.quote(argument) for argument in sys.argv[1:])])


def machine_info(device: str) -> dict:
    """The machine and the versions a result depends on, and the command that measured it."""
    import transformers

    info = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": _total_memory_gb(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "git_commit": _git_commit(),
        "load_average_1_5_15": load_average(),
        "command": command_line(),
    }
    try:
        import modeling_dint

        info["modeling_dint"] = getattr(modeling_dint, "__version__", "unknown")
    except ImportError:
        info["modeling_dint"] = None
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        try:
            import flash_attn

            info["flash_attn"] = flash_attn.__version__
        except ImportError:
            info["flash_attn"] = None
    return info


def run_header(machine: dict) -> str:
    """The Markdown lines that open every result file: date, machine, versions, commit and command (from
    `machine_info`; "not recorded" for what an older result lacks)."""

    def field(key):
        value = machine.get(key)
        return "not recorded" if value in (None, "") else value

    if machine.get("gpu"):
        where = f"{machine['gpu']} (CUDA {field('cuda')}), host {field('processor')}"
    else:
        where = f"{field('processor')}, {field('cpu_count')} CPUs, {field('torch_threads')} torch thread(s)"
    load = machine.get("load_average_at_start") or machine.get("load_average_before")
    load_text = f"{load} at the start, {field('load_average_1_5_15')} at the end" if load else field("load_average_1_5_15")
    return "\n".join([
        f"- date: {field('date_utc')}",
        f"- machine: {where}; load average (1, 5, 15 min): {load_text}",
        f"- torch {field('torch')}, transformers {field('transformers')}",
        f"- commit: {field('git_commit')}",
        f"- command: `{field('command')}`",
    ]) + "\n"


def write_result(result: dict, output: str, markdown: str) -> None:
    """Writes `result` to `output` (JSON) and `markdown` next to it (`.md`) after the run's header (`run_header` of
    `result["machine"]`), and prints the markdown. `output` is normally under `results_dir(script, device)`."""
    import json

    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as file:
        json.dump(result, file, indent=1)
        file.write("\n")
    markdown = run_header(result.get("machine") or {}) + "\n" + markdown
    with open(os.path.splitext(output)[0] + ".md", "w") as file:
        file.write(markdown)
    print(markdown)


def load_average() -> list[float] | None:
    """The system's 1, 5 and 15 minute load averages: other work on the same cores shows up here."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            match = re.search(r"model name\s*:\s*(.+)", cpuinfo.read())
        return match.group(1).strip() if match else platform.processor()
    except OSError:
        return platform.processor()


def _total_memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as meminfo:
            return round(int(re.search(r"MemTotal:\s+(\d+)", meminfo.read()).group(1)) / 2**20, 1)
    except (OSError, AttributeError):
        return None


def _git_commit() -> str | None:
    try:
        commit = subprocess.run(
            ["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", REPO_ROOT, "status", "--porcelain", "--", "modeling_dint"], capture_output=True, text=True
        ).stdout.strip()
        return commit + ("+dirty(modeling_dint)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def python_executable() -> str:
    return sys.executable
