# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Why the research harness queries one needle per example: with two teacher-forced queries the second is answered
by elimination.

    python examples/research/elimination_check.py [--kinds diff dint] [--steps 600]

Trains each kind (hidden 64, 64 tokens, seed 0, lr 1e-3: the rate the 2026-11-25 two-query run chose for DIFF and
DINT; its Transformer's was 2e-3, so `--kinds transformer` here is not that run's setting) for `--steps` steps on the
two-query task (two distinct needles queried, the second after the first's answer), then prints the
accuracy of each query separately on the harness's test sets. Answering the first query with a random needle's value
and the second with a needle value not answered yet scores 1/N and 1/(N-1): at N=2, 0.5 and 1.0. About 1 minute per
kind on one core.
"""

import argparse
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as harness  # noqa: E402


def per_query_accuracy(model, test_set: dict) -> list[float]:
    """Greedy accuracy of query 0 and query 1 separately: `[R]` floats."""
    with torch.no_grad():
        predictions = model(input_ids=test_set["input_ids"]).logits.argmax(-1)
    rows = torch.arange(len(predictions))
    accuracies = []
    for q in range(test_set["answer_position"].shape[1]):
        key_position = test_set["answer_position"][:, q]
        answers = test_set["input_ids"][rows, key_position + 1]
        accuracies.append((predictions[rows, key_position] == answers).float().mean().item())
    return accuracies


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--kinds", nargs="+", default=["diff", "dint"])
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = harness.Settings(needle_queries=2)
    vocab = harness.NeedleVocabulary(settings.key_vocab, settings.value_vocab, settings.filler_vocab)
    for kind in args.kinds:
        model = harness.build_model(kind, vocab.size, 256, settings, 64, 0)
        generator = torch.Generator().manual_seed(0)
        validation = harness.make_mixed_needle_batch(
            torch.Generator().manual_seed(settings.validation_seed + 64), 64, 64, settings.needle_counts, 2, vocab
        )
        # the harness's own optimizer, schedule and clipping, for exactly --steps steps (one evaluation, at the end)
        harness.train_to_convergence(
            model,
            lambda: harness.make_mixed_needle_batch(generator, 32, 64, settings.needle_counts, 2, vocab),
            [validation], 1e-3, args.steps, args.steps, args.steps, settings,
        )
        model.eval()
        for count in (2, 4, 6):
            first, second = per_query_accuracy(model, harness.needle_test_set(settings, vocab, 64, count))
            print(f"{kind} N={count}: query 1 {first:.3f}, query 2 {second:.3f}; random then elimination predicts "
                  f"{1 / count:.3f}, {1 / (count - 1):.3f}", flush=True)


if __name__ == "__main__":
    main()
