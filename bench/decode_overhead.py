# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""What a decoding step costs beyond its arithmetic: per-token time of tiny models with 16 layers at batch 1, where
Python, the dispatcher and the op count are nearly all of it, as in eager decoding of a 1B model on a GPU (launch-bound:
the GPU waits on the host). A CPU-side proxy for `bench/gpu_bf16.py`'s eager decode target (DINT-V2 / Llama with 2h
query heads <= 1.05), measured without a GPU.

    python bench/decode_overhead.py                  # bench/results/decode_overhead/cpu/results_auto.{json,md}
    python bench/decode_overhead.py --position-ids   # generate()'s inputs: results_auto_position_ids.{json,md}

The models are `gpu_bf16.py`'s (`--smoke` shapes: hidden 64, 4 softmax maps, 2 KV heads, vocab 256; `--layers`
layers), fp32, the dynamic cache after a 16-token prompt. A round decodes `--tokens` tokens with every model, in turns
of `--block` steps (the order rotates per turn): a model's steps run back to back as in real decoding, and the models
share every stretch of the machine's speed, which on the 2-core EPYC VM drifts by tens of percent within seconds. (One
step per turn read every DINT ratio 2-5% higher: each step then starts on caches another model filled. Whole rounds per
turn put seconds between the pair's samples.) A ratio is the median over the rounds of the per-round ratios (paired
median). One thread, the garbage collector off.
"""

import argparse
import copy
import os
import statistics
import sys
import time
import types

import torch


BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import bench_common  # noqa: E402
import gpu_bf16  # noqa: E402
from run_benchmark import timed_region  # noqa: E402


MODELS = ("dint_v2", "diff_v2", "llama_2h", "llama_h", "dint_v1", "diffllama")
FLOORS = ("diff_v2_floor", "dint_v2_floor", "llama_attention_in_dint")
"""Three bench-only reconstructions from DIFF-V2's weights, each with its own attention forward (`floor_forward`): DIFF
V2's arithmetic alone (one product for the queries and lambda, the attention call, sigmoid, one addcmul: what eager
torch cannot go below), DINT-V2's (DIFF V2's, plus the running sum added in place and one more addcmul per layer, and
the count once per forward), and Llama's attention (lambda and the noise maps dropped: what DINT's model costs around
its attention). Their outputs are not the models' (the last's is not even a model's); only their time is of use."""
PAIRS = (
    ("dint_v2", "llama_2h"), ("dint_v2", "diff_v2"), ("diff_v2", "llama_2h"), ("dint_v1", "diffllama"),
    ("diff_v2_floor", "llama_2h"), ("dint_v2_floor", "diff_v2_floor"), ("dint_v2_floor", "llama_2h"),
    ("llama_attention_in_dint", "llama_2h"),
)


def floor_forward(self, hidden_states, position_embeddings, attention_mask, integral_layout=None, dint_path=None,
                  **kwargs):
    """A `DintV2Attention.forward` with nothing but the ops: `FLOORS`. `self.floor` names which."""
    from modeling_dint.modeling_dint import ALL_ATTENTION_FUNCTIONS, CACHE_ARGUMENT, apply_rotary_pos_emb

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_channels = self.num_heads * self.head_dim
    if self.floor != "llama_attention_in_dint":
        product = torch.nn.functional.linear(hidden_states, self.query_lambda_weight)
        query_states = product[..., :query_channels]
        lambda_ = torch.sigmoid(product[..., query_channels:]).unsqueeze(-1)
    else:
        query_states = self.q_proj(hidden_states)
    query_states = query_states.view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    cache = kwargs.pop(CACHE_ARGUMENT, None)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    attn_output, _ = attention_interface(
        self, query_states, key_states, value_states, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
    )
    signal_output, noise_output = attn_output.unflatten(2, (-1, 2)).unbind(3)
    if self.floor == "diff_v2_floor":
        attn_output = torch.addcmul(signal_output, lambda_, noise_output, value=-1)
    elif self.floor == "dint_v2_floor":
        attn_output = dint_floor_combination(self, signal_output, noise_output, lambda_)
    else:
        attn_output = signal_output
    return self.o_proj(attn_output.reshape(*input_shape, -1)), None


def dint_floor_combination(attention, signal_output, noise_output, lambda_):
    """`dint_v2_floor`'s integral: the running sum S `[B, 1, heads, C]` per layer and the count per forward (layer 0),
    kept in `attention.floor_state` (shared by the layers), then `O1 - lambda * (O2 - S / c)` in two addcmul."""
    state = attention.floor_state
    if signal_output.shape[1] > 1:  # the prompt (not timed): its sums
        state[attention.layer_idx] = signal_output.float().sum(1, keepdim=True)
        state["count"] = torch.full((signal_output.shape[0], 1, 1, 1), float(signal_output.shape[1]))
        state["inverse"] = state["count"].reciprocal()
    else:
        if attention.layer_idx == 0:
            state["inverse"] = state["count"].add_(1).reciprocal()
        state[attention.layer_idx].add_(signal_output)
    noise_minus_integral = torch.addcmul(noise_output, state[attention.layer_idx], state["inverse"], value=-1)
    return torch.addcmul(signal_output, lambda_, noise_minus_integral, value=-1)


def floor_model(diff_v2, floor: str):
    """A copy of DIFF-V2 whose attentions run `floor_forward` (`FLOORS`)."""
    model = copy.deepcopy(diff_v2)
    floor_state = {}
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.floor, attention.floor_state = floor, floor_state
        with torch.no_grad():
            attention.fuse_query_lambda()
        attention.forward = types.MethodType(floor_forward, attention)
    return model


def interleaved_rounds(
    models: dict, prompt: torch.Tensor, rounds: int, tokens: int, block: int, position_ids: bool = False
) -> dict:
    """Greedy decoding with the dynamic cache, model forward by forward (no generate() around it): per round, each
    model decodes `tokens` tokens, `block` steps at a time in turn (the order rotates per turn); with `position_ids`,
    each step is given its position, as generate() gives it. `{name: [seconds per token, one per round]}`, after a
    warm-up round."""
    from transformers import DynamicCache

    names = list(models)
    step_kwargs = [  # made before the clock runs
        {"position_ids": torch.tensor([[prompt.shape[1] + step]])} if position_ids else {} for step in range(tokens)
    ]
    samples = {name: [] for name in names}
    with torch.no_grad(), timed_region("cpu"):  # the garbage collector off, as in the other benchmarks
        for round_index in range(rounds + 1):
            caches = {name: DynamicCache(config=models[name].config) for name in names}
            logits = {
                name: models[name](prompt, **{bench_common.CACHE_ARGUMENT: caches[name]}, use_cache=True).logits
                for name in names
            }
            spent = dict.fromkeys(names, 0.0)
            for turn in range(0, tokens, block):
                shift = (round_index + turn // block) % len(names)
                for name in names[shift:] + names[:shift]:
                    model, cache, model_logits = models[name], caches[name], logits[name]
                    started = time.perf_counter()
                    for step in range(turn, min(turn + block, tokens)):
                        token = model_logits[:, -1:].argmax(-1)
                        model_logits = model(
                            token, **step_kwargs[step], **{bench_common.CACHE_ARGUMENT: cache}, use_cache=True
                        ).logits
                    spent[name] += time.perf_counter() - started
                    logits[name] = model_logits
            if round_index:  # round 0 warms up
                for name in names:
                    samples[name].append(spent[name] / tokens)
    return samples


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per model and round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block", type=int, default=8, help="steps a model decodes before the next model's turn")
    parser.add_argument(
        "--position-ids", action="store_true",
        help="give each step its position ids, as generate() does (DINT then checks for a document restart per row)",
    )
    parser.add_argument("--output-dir", default=bench_common.results_dir("decode_overhead", "cpu"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shapes = gpu_bf16.parse_args(["--device", "cpu", "--smoke"])
    shapes.layers = args.layers
    models = {name: model.float() for name, model in gpu_bf16.build_models(shapes, MODELS).items()}
    models.update({floor: floor_model(models["diff_v2"], floor) for floor in FLOORS})
    prompt = torch.randint(0, models["dint_v2"].config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))

    samples = interleaved_rounds(models, prompt, args.rounds, args.tokens, args.block, args.position_ids)
    result = {
        "argv": sys.argv,
        "machine": bench_common.machine_info("cpu"),
        "seconds_per_token": samples,
        "median_ms_per_token": {name: 1e3 * statistics.median(samples[name]) for name in samples},
        "paired_ratios": {
            f"{a} / {b}": statistics.median(x / y for x, y in zip(samples[a], samples[b])) for a, b in PAIRS
        },
    }
    layers = args.layers
    kernel_setting = os.environ.get("DINT_INTEGRAL_KERNEL") or "auto"  # one file per setting: `results_<setting>`
    inputs = "_position_ids" if args.position_ids else ""  # and per inputs: `results_<setting>_position_ids`
    result["integral_kernel"] = kernel_setting
    lines = [
        "# Decoding overhead: tiny models, batch 1, the CPU (a proxy for launch-bound eager decoding on a GPU)", "",
        f"Machine: {result['machine']['processor']}, {result['machine']['torch_threads']} thread, load average "
        f"{result['machine']['load_average_1_5_15']}; torch {result['machine']['torch']}, transformers "
        f"{result['machine']['transformers']}; commit {result['machine']['git_commit']}; "
        f"{result['machine']['date_utc']}.",
        f"Command: `DINT_INTEGRAL_KERNEL={kernel_setting} python {' '.join(sys.argv)}`; {layers} layers, {args.rounds} "
        f"rounds of {args.tokens} tokens in turns of {args.block}.", "",
        "| model | ms per token | per token / layers (us) |", "| --- | ---: | ---: |",
        *(f"| {name} | {ms:.3f} | {1e3 * ms / layers:.1f} |" for name, ms in result["median_ms_per_token"].items()),
        "", "| pair | paired median ratio |", "| --- | ---: |",
        *(f"| {pair} | {ratio:.3f} |" for pair, ratio in result["paired_ratios"].items()),
    ]
    output = os.path.join(args.output_dir, f"results_{kernel_setting}{inputs}.json")
    bench_common.write_result(result, output, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
