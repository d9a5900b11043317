# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Why the research harness never shows an answer in the input: with two teacher-forced queries the second is
answered by elimination.

    python research/elimination_check.py [--kinds diff dint] [--steps 600]

Trains each kind (hidden 64 as 4 heads of 16, 64 tokens, seed 0, lr 1e-3) for `--steps` steps on the paper's
two-query format (two distinct needles queried as `QUERY key value`, the second after the first's teacher-forced
answer; the format of the 2026-11-25 run), then prints the accuracy of each query separately on held-out examples.
Answering the first query with a random needle's value and the second with a needle value not answered yet scores 1/N
and 1/(N-1): at N=2, 0.5 and 1.0. The harness's task (`tasks.make_needle_batch` with the answers not in the input)
leaves nothing to eliminate without matching keys. A few minutes per kind on one core.
"""

import argparse
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluation import needle_accuracy  # noqa: E402
from model_shapes import build_model  # noqa: E402
from settings import Settings  # noqa: E402
from tasks import NeedleVocabulary, concatenate_needle_batches, make_needle_batch  # noqa: E402
from training import train_to_convergence  # noqa: E402


def two_query_batch(generator: torch.Generator, batch_size: int, context: int, needle_counts, vocab) -> dict:
    """An equal share of each needle count, min(2, N) needles queried with their answers teacher-forced."""
    per_count = batch_size // len(needle_counts)
    return concatenate_needle_batches([
        make_needle_batch(generator, per_count, context, count, vocab, query_count=min(2, count),
                                  answers_in_input=True, layout="haystack")
        for count in needle_counts
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["diff", "dint"])
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = Settings(attention_heads=4, head_dim=16)  # the model of the 2026-11-25 runs
    vocab = NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    for kind in args.kinds:
        model = build_model("transformer_per_map" if kind == "transformer" else kind, vocab.size, 256, settings, 64, 0)
        generator = torch.Generator().manual_seed(0)
        validation = two_query_batch(torch.Generator().manual_seed(1), 256, 64, settings.needle_counts, vocab)
        # the harness's own training step, optimizer, schedule and clipping, for exactly --steps steps
        train_to_convergence(
            model, lambda: two_query_batch(generator, 32, 64, settings.needle_counts, vocab), validation, 1e-3,
            args.steps, args.steps, args.steps, settings,
        )
        for count in (2, 4, 6):
            test = two_query_batch(torch.Generator().manual_seed(10_000 + count), 256, 64, (count,), vocab)
            every_query, first_query = needle_accuracy(model, test, settings.device)
            second_query = 2 * every_query - first_query  # two queries per example
            print(f"{kind} N={count}: query 1 {first_query:.3f}, query 2 {second_query:.3f}; random then elimination "
                  f"predicts {1 / count:.3f}, {1 / (count - 1):.3f}", flush=True)


if __name__ == "__main__":
    main()
