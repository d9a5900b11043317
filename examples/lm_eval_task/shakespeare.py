# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""The `shakespeare_heldout` task's data: passages of the held-out plays (Macbeth, Twelfth Night), read from
shakespeare_heldout.jsonl beside this file, so the task runs offline from any working directory.

Rebuild the jsonl from examples/data/shakespeare_heldout.txt with `python examples/lm_eval_task/shakespeare.py`.
"""

import json
import re
from pathlib import Path


TASK_DIR = Path(__file__).resolve().parent
PASSAGES_FILE = TASK_DIR / "shakespeare_heldout.jsonl"
HELDOUT_TEXT = TASK_DIR.parent / "data" / "shakespeare_heldout.txt"
PASSAGES_PER_PLAY = 12
PASSAGE_CHARS = 1200


def load_heldout_passages(**kwargs):
    """lm-eval's `custom_dataset` hook: `{"test": datasets.Dataset}` with one `text` column (keyword arguments, the
    task's metadata, are ignored)."""
    import datasets

    with open(PASSAGES_FILE, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc, results):
    """Per-passage loglikelihood with the word and byte counts that the perplexity metrics normalize by."""
    (loglikelihood,) = results
    num_words = len(re.split(r"\s+", doc["text"].strip()))
    num_bytes = len(doc["text"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, num_words),
        "byte_perplexity": (loglikelihood, num_bytes),
        "bits_per_byte": (loglikelihood, num_bytes),
    }


def build_passages() -> list[dict]:
    """Evenly spaced passages of each held-out play: whole paragraphs (blank-line separated) of about
    PASSAGE_CHARS characters, skipping each play's front matter (its first 5% of paragraphs)."""
    passages = []
    plays = [play.strip() for play in HELDOUT_TEXT.read_text(encoding="utf-8").split("\n\n\n") if play.strip()]
    for play in plays:
        paragraphs = play.split("\n\n")
        title = paragraphs[0].strip()
        first = len(paragraphs) // 20
        for index in range(PASSAGES_PER_PLAY):
            start = first + index * (len(paragraphs) - first) // PASSAGES_PER_PLAY
            chunk = []
            while start < len(paragraphs) and sum(len(p) + 2 for p in chunk) < PASSAGE_CHARS:
                chunk.append(paragraphs[start])
                start += 1
            passages.append({"play": title, "text": "\n\n".join(chunk)})
    return passages


if __name__ == "__main__":
    passages = build_passages()
    with open(PASSAGES_FILE, "w", encoding="utf-8") as handle:
        for passage in passages:
            handle.write(json.dumps(passage, ensure_ascii=False) + "\n")
    print(f"wrote {len(passages)} passages to {PASSAGES_FILE}")
