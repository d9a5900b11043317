# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The research harness's evaluation of a trained model: needle accuracy, held-out perplexity, and the eager attention
analysis (where the answer query looks, row sums, negative entries, the maps for the heatmaps)."""

import math

import torch

from model_shapes import final_attention_maps
from modeling_dint import DintForCausalLM, dint_attention_map
from tasks import next_token_batch
from training import answer_logits, to_device



@torch.no_grad()
def needle_accuracy(model, batch: dict, device: str, chunk: int = 64) -> tuple[float, float]:
    """Exact-match accuracy of the greedy answer (argmax over the whole vocabulary): over every query, and over the
    first query of each example (the elimination control), in chunks of `chunk` examples."""
    model.eval()
    hits = []
    for start in range(0, len(batch["input_ids"]), chunk):
        rows = (batch["answer_rows"] >= start) & (batch["answer_rows"] < start + chunk)
        part = to_device({
            "input_ids": batch["input_ids"][start : start + chunk],
            "answer_rows": batch["answer_rows"][rows] - start,
            "answer_columns": batch["answer_columns"][rows],
        }, device)
        logits = answer_logits(model, part["input_ids"], part["answer_rows"], part["answer_columns"])
        hits.append((logits.argmax(-1).cpu() == batch["answers"][rows]).float())
    hits = torch.cat(hits)
    return hits.mean().item(), hits[batch["query_index"] == 0].mean().item()


@torch.no_grad()
def stream_perplexity(model, stream: torch.Tensor, context: int, device: str, chunk: int = 16) -> float:
    """exp(mean next-token loss) over contiguous non-overlapping windows of `stream`."""
    model.eval()
    window_count = (len(stream) - 1) // context
    windows = stream[: window_count * context].view(window_count, context)
    total, count = 0.0, 0
    for start in range(0, window_count, chunk):
        batch = to_device(next_token_batch(windows[start : start + chunk]), device)
        logits = answer_logits(model, batch["input_ids"], batch["answer_rows"], batch["answer_columns"])
        total += torch.nn.functional.cross_entropy(logits, batch["answers"], reduction="sum").item()
        count += len(batch["answers"])
    return math.exp(total / count)


@torch.no_grad()
def attention_statistics(model, kind: str, batch: dict) -> tuple[dict, dict]:
    """Eager-attention analysis of held-out needle examples (every example has the same needle count).

    Returns the statistics, over every query (the answer query: the query key, where the answer is predicted), of:
    the answer share (the mass of the answer query's last-layer row, mean over heads, on the queried needle's
    tokens), the filler share, the share per other needle (the mass on the other needles' tokens / their number: key
    matching shows as an answer share well above it), the previous-token score of the first layer (the largest, over
    heads, mean attention from the queried needle's value to its key: the first half of an induction circuit), the
    fraction of negative causal entries of the final maps over all layers, the worst |row sum - 1|; and, for example
    0, the maps of the last layer's first head (A1, A2, G, A_final; the Transformer: its softmax map as A_final) as
    lists for the heatmaps.
    """
    model.eval()
    model.set_attn_implementation("eager")
    try:
        outputs = model(input_ids=batch["input_ids"].to(model.device), output_attentions=True,
                        output_hidden_states=True)
    finally:
        model.set_attn_implementation("sdpa")
    final_maps = [layer_map.cpu() for layer_map in final_attention_maps(model, kind, outputs.attentions,
                                                                         hidden_states=outputs.hidden_states)]
    length = batch["input_ids"].shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    negative, entries, worst_row_error = 0, 0, 0.0
    for layer_map in final_maps:
        negative += (layer_map[..., causal] < 0).sum().item()
        entries += layer_map[..., causal].numel()
        worst_row_error = max(worst_row_error, (layer_map.sum(-1) - 1).abs().max().item())

    rows, columns = batch["answer_rows"], batch["answer_columns"]
    needle_start, value_position = batch["needle_start"], batch["value_position"]
    answer_maps = final_maps[-1].mean(dim=1)[rows, columns]  # [R, T]: each answer query's last-layer row
    every_needle = batch["needles"][rows]  # [R, T]: every needle's tokens
    positions = torch.arange(length)
    queried = (positions >= needle_start[:, None]) & (positions <= value_position[:, None])  # the queried needle's
    other_needles = (batch["needle_count"] - 1).clamp(min=1)
    previous_token = final_maps[0][rows, :, value_position, value_position - 1]  # [R, heads]
    statistics = {
        "answer_share": (answer_maps * queried).sum(-1).mean().item(),
        "filler_share": (answer_maps * batch["filler"][rows]).sum(-1).mean().item(),
        "other_needle_share": ((answer_maps * (every_needle & ~queried)).sum(-1) / other_needles).mean().item(),
        "previous_token_score": previous_token.mean(0).max().item(),
        "negative_fraction": negative / entries,
        "max_row_sum_error": worst_row_error,
    }

    if not isinstance(model, DintForCausalLM) or model.config.differential_attention == "v2":
        return statistics, {"A_final": final_maps[-1][0, 0].tolist()}  # V2: lambda per token, no G of one lambda
    layer_maps = outputs.attentions[-1][0:1].float().cpu()
    half = layer_maps.shape[1] // 2
    lambda_full = model.model.layers[-1].self_attn.lambda_full().detach().cpu()
    signal, noise = layer_maps[0, 0], layer_maps[0, half]
    # G from the package's mean integral: G = (A_final(mean) - A1 + lambda * A2) / lambda
    mean_final = dint_attention_map(layer_maps, lambda_full, integral="mean")[0, 0]
    integral = (mean_final - signal + lambda_full * noise) / lambda_full
    maps = {
        "A1": signal.tolist(),
        "A2": noise.tolist(),
        "G": integral.tolist(),
        "A_final": final_maps[-1][0, 0].tolist(),
        "lambda": lambda_full.item(),
    }
    return statistics, maps
