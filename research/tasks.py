# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The research harness's tasks and data: the synthetic multi-needle retrieval (multi-query associative recall) and
language modelling on the repo's Shakespeare corpus, as batches of scored answers."""

import dataclasses
import math

import torch
from transformers import AutoTokenizer

from settings import DATA_DIR, Settings


@dataclasses.dataclass
class NeedleVocabulary:
    """Token ids of the synthetic retrieval task: 0 pad, 1 NEEDLE, 2 QUERY, then keys, values, filler."""

    key_vocab: int
    value_vocab: int
    filler_vocab: int
    needle_marker: int = 1
    query_marker: int = 2

    @property
    def first_key(self) -> int:
        return 3

    @property
    def first_value(self) -> int:
        return 3 + self.key_vocab

    @property
    def first_filler(self) -> int:
        return 3 + self.key_vocab + self.value_vocab

    @property
    def size(self) -> int:
        return self.first_filler + self.filler_vocab


ANSWER_FIELDS = (
    "answer_rows", "answer_columns", "answers", "query_index", "needle_count", "needle_start", "value_position"
)
"""The per-answer `[R]` fields of a needle batch (R = every query of every example, flattened row by row)."""

NEEDLE_LAYOUTS = ("pairs_first", "haystack")


def make_needle_batch(
    generator: torch.Generator, batch_size: int, context: int, needle_count: int, vocab: NeedleVocabulary,
    query_count: int | None = None, answers_in_input: bool = False, layout: str = "pairs_first",
) -> dict:
    """Multi-query retrieval examples of exactly `context` tokens, made in a few tensor operations. Every example has
    `needle_count` needles (distinct keys, distinct values) and `query_count` (default: every needle) queries of
    distinct needles in random order; the answer, the queried needle's value, is predicted at the query's key.

    Layouts:
    - `"pairs_first"` (multi-query associative recall as in Zoology, Arora et al. 2023): the needles are `key value`
      pairs side by side at the start; after them random filler, in which each query is its key alone, at random
      places. The answer is not in the input after its query.
    - `"haystack"`: random filler with the needles as `NEEDLE key value` triples at random non-overlapping places,
      then the query section, each query `QUERY key` (the answer not in the input), or `QUERY key value` with
      `answers_in_input=True` (the DIFF paper's format: the answer is teacher-forced).
    Either way a later query cannot be answered by eliminating the values answered before without matching keys.

    Returns a dict: `input_ids [B, context]`, the bool masks `filler [B, context]` (the filler tokens) and `needles
    [B, context]` (every needle's tokens), and per answer, flattened to `[R]` with R = B * query_count, in the order
    of the queries in each example: `answer_rows`, `answer_columns` (the query key's position, whose next-token
    prediction is scored), `answers` (the value), `query_index` (0 for the first query of its example),
    `needle_count`, `needle_start` and `value_position` (the first and the last token of the queried needle).
    """
    if layout not in NEEDLE_LAYOUTS:
        raise ValueError(f"`layout` must be one of {NEEDLE_LAYOUTS}, got {layout!r}.")
    if answers_in_input and layout != "haystack":
        raise ValueError("`answers_in_input=True` needs `layout='haystack'` (the answer follows `QUERY key`).")
    query_count = needle_count if query_count is None else query_count
    needle_width = 2 if layout == "pairs_first" else 3
    query_width = 1 if layout == "pairs_first" else (3 if answers_in_input else 2)
    free_slots = context - needle_width * needle_count - query_width * query_count  # filler tokens
    if free_slots < 0 or query_count > needle_count or needle_count > min(vocab.key_vocab, vocab.value_vocab):
        raise ValueError(
            f"context {context} cannot hold {needle_count} needles and {query_count} queries (at most "
            f"{min(vocab.key_vocab, vocab.value_vocab)} needles, at most one query per needle)."
        )
    batch_rows = torch.arange(batch_size)[:, None]
    input_ids = vocab.first_filler + torch.randint(vocab.filler_vocab, (batch_size, context), generator=generator)
    keys = vocab.first_key + torch.rand(batch_size, vocab.key_vocab, generator=generator).argsort(-1)[:, :needle_count]
    values = vocab.first_value + torch.rand(batch_size, vocab.value_vocab, generator=generator).argsort(-1)[
        :, :needle_count
    ]
    if layout == "pairs_first":
        starts = (needle_width * torch.arange(needle_count)).expand(batch_size, needle_count)
        needle_tokens = (keys, values)
        pairs_end = needle_width * needle_count
        # the queries' places: query_count distinct positions after the pairs, in order
        query_columns = pairs_end + torch.rand(batch_size, context - pairs_end, generator=generator).argsort(-1)[
            :, :query_count
        ].sort(-1).values
    else:
        haystack = context - query_width * query_count
        # sorted gaps: needle i starts after `offsets[:, i]` filler tokens
        offsets = torch.randint(free_slots + 1, (batch_size, needle_count), generator=generator).sort(-1).values
        starts = offsets + needle_width * torch.arange(needle_count)  # [B, N]
        needle_tokens = (vocab.needle_marker, keys, values)
        query_columns = (haystack + 1 + query_width * torch.arange(query_count)).expand(batch_size, query_count)
    needles = torch.zeros(batch_size, context, dtype=torch.bool)
    for offset, tokens in enumerate(needle_tokens):
        input_ids[batch_rows, starts + offset] = tokens
        needles[batch_rows, starts + offset] = True
    queried = torch.rand(batch_size, needle_count, generator=generator).argsort(-1)[:, :query_count]  # [B, Q]
    answers = values.gather(1, queried)
    input_ids[batch_rows, query_columns] = keys.gather(1, queried)
    not_filler = needles.clone()  # the needles and the queries
    not_filler[batch_rows, query_columns] = True
    if layout == "haystack":
        input_ids[batch_rows, query_columns - 1] = vocab.query_marker
        not_filler[:, context - query_width * query_count :] = True
        if answers_in_input:
            input_ids[batch_rows, query_columns + 1] = answers
    flat = (batch_size * query_count,)
    needle_start = starts.gather(1, queried)
    return {
        "input_ids": input_ids,
        "filler": ~not_filler,
        "needles": needles,
        "answer_rows": batch_rows.expand(batch_size, query_count).reshape(flat),
        "answer_columns": query_columns.reshape(flat),
        "answers": answers.reshape(flat),
        "query_index": torch.arange(query_count).expand(batch_size, query_count).reshape(flat),
        "needle_count": torch.full(flat, needle_count),
        "needle_start": needle_start.reshape(flat),
        "value_position": (needle_start + needle_width - 1).reshape(flat),
    }


def concatenate_needle_batches(parts: list[dict]) -> dict:
    """One batch of the examples of `parts` (same context length), in order; the answers' rows follow."""
    batch = {key: torch.cat([part[key] for part in parts]) for key in ("input_ids", "filler", "needles", *ANSWER_FIELDS)}
    row_offsets = torch.cumsum(torch.tensor([0] + [len(part["input_ids"]) for part in parts[:-1]]), 0)
    batch["answer_rows"] = torch.cat([part["answer_rows"] + offset for part, offset in zip(parts, row_offsets)])
    return batch


def make_mixed_needle_batch(
    generator: torch.Generator, batch_size: int, context: int, needle_counts, vocab: NeedleVocabulary,
    layout: str = "pairs_first",
) -> dict:
    """`batch_size // len(needle_counts)` examples per needle count N, every needle queried (the training and
    validation batches): a fixed number of answers, so every training step has the same shapes."""
    per_count = batch_size // len(needle_counts)
    return concatenate_needle_batches(
        [make_needle_batch(generator, per_count, context, count, vocab, layout=layout) for count in needle_counts]
    )


def needle_test_set(settings: "Settings", vocab: NeedleVocabulary, length: int, count: int) -> dict:
    """The held-out test examples of one (length, needle count): a seed of their own, never trained on."""
    generator = torch.Generator().manual_seed(settings.test_seed + 1000 * length + count)
    return make_needle_batch(generator, settings.test_examples, length, count, vocab, layout=settings.needle_layout)


_CORPUS_CACHE = {}


def load_corpus(settings: Settings) -> dict:
    """Token streams of the Shakespeare corpus: train and validation (the last `lm_validation_fraction` of the
    training text, never trained on; its first `lm_validation_tokens` + 1 tokens) and the held-out test plays (their
    first `lm_test_tokens` + 1); and the vocabulary size. Tokenized once per process."""
    if "tokens" not in _CORPUS_CACHE:
        tokenizer = AutoTokenizer.from_pretrained(DATA_DIR / "tokenizer")
        _CORPUS_CACHE["tokens"] = {
            name: tokenizer((DATA_DIR / f"shakespeare_{name}.txt").read_text(), return_attention_mask=False)["input_ids"]
            for name in ("train", "heldout")
        }
        _CORPUS_CACHE["vocab_size"] = len(tokenizer)
    train_ids, test_ids = _CORPUS_CACHE["tokens"]["train"], _CORPUS_CACHE["tokens"]["heldout"]
    split = int(len(train_ids) * (1 - settings.lm_validation_fraction))
    return {
        "train": torch.tensor(train_ids[:split]),
        "validation": torch.tensor(train_ids[split:][: settings.lm_validation_tokens + 1]),
        "test": torch.tensor(test_ids[: settings.lm_test_tokens + 1]),
        "vocab_size": _CORPUS_CACHE["vocab_size"],
    }


def next_token_batch(input_ids: torch.Tensor) -> dict:
    """Language modelling as answers: every position but the last is scored on the next token (`input_ids [B, T]`;
    R = B * (T - 1) answers), in the layout of a needle batch."""
    batch_size, length = input_ids.shape
    return {
        "input_ids": input_ids,
        "answer_rows": torch.arange(batch_size).repeat_interleave(length - 1),
        "answer_columns": torch.arange(length - 1).repeat(batch_size),
        "answers": input_ids[:, 1:].reshape(-1),
    }


def make_lm_batch(generator: torch.Generator, stream: torch.Tensor, batch_size: int, context: int) -> dict:
    """`batch_size` random windows of `context` tokens of `stream`."""
    starts = torch.randint(len(stream) - context, (batch_size,), generator=generator)
    return next_token_batch(stream[starts[:, None] + torch.arange(context)])


def validation_needle_counts(settings: Settings) -> tuple:
    """The needle counts of the validation set: every trained and every tested count."""
    return tuple(sorted(set(settings.train_needle_counts) | set(settings.needle_counts)))


def plateau_loss(settings: Settings) -> float:
    """The validation loss of a model that gives each of the N needle values probability 1/N: mean of ln N over the
    validation answers (N answers per example, the same number of examples per count)."""
    counts = validation_needle_counts(settings)
    return sum(n * math.log(n) for n in counts) / sum(counts)
