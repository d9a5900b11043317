"""The Shakespeare corpus and tokenizer carried in examples/data/ (built by examples/data/build_data.py)."""

import os

import pytest
from transformers import AutoTokenizer


DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data")
TRAIN_PATH = os.path.join(DATA_DIR, "shakespeare_train.txt")
HELDOUT_PATH = os.path.join(DATA_DIR, "shakespeare_heldout.txt")
TOKENIZER_DIR = os.path.join(DATA_DIR, "tokenizer")
PLAY_SEPARATOR = "\n\n\n"


def _read(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_corpus_files_are_real_text_without_boilerplate():
    train_text = _read(TRAIN_PATH)
    heldout_text = _read(HELDOUT_PATH)
    assert 2_000_000 < len(train_text) < 3_500_000
    assert 100_000 < len(heldout_text) < 400_000
    # Whole plays: 21 in train, 2 held out, each with a title line and dialogue.
    train_plays = train_text.split(PLAY_SEPARATOR)
    heldout_plays = heldout_text.split(PLAY_SEPARATOR)
    assert len(train_plays) == 21
    assert len(heldout_plays) == 2
    assert heldout_plays[0].startswith("MACBETH") and heldout_plays[1].startswith("TWELFTH NIGHT")
    assert "To be, or not to be" in train_text
    assert "To-morrow, and to-morrow, and to-morrow" in heldout_text
    # No held-out play leaks into the training text.
    assert "To-morrow, and to-morrow, and to-morrow" not in train_text
    for text in (train_text, heldout_text):
        assert "gutenberg" not in text.lower()
        assert "\r" not in text


def test_tokenizer_round_trips_heldout_text_exactly(tokenizer):
    heldout_text = _read(HELDOUT_PATH)
    paragraph = heldout_text.split(PLAY_SEPARATOR)[0][20_000:22_000]
    for text in (paragraph, heldout_text, "Ünïcödé 漢字 🎭\ttabs   and spaces\r\n"):
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Byte-level BPE on the training text compresses English prose well below one token per byte.
    assert len(tokenizer(paragraph)["input_ids"]) < len(paragraph) / 2.5


def test_tokenizer_special_tokens(tokenizer):
    assert len(tokenizer) == 4096
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.unk_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    # Padding a batch uses the pad id, on the left (batched generation), and the special tokens encode to single ids.
    batch = tokenizer(["Who's there?", "Nay, answer me: stand, and unfold yourself."], padding=True)
    assert tokenizer.padding_side == "left" and batch["input_ids"][0][0] == tokenizer.pad_token_id
    assert tokenizer("<|endoftext|>")["input_ids"] == [tokenizer.eos_token_id]


def test_tokenizer_chat_template(tokenizer):
    messages = [{"role": "user", "content": "Who's there?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>\nWho's there?<|endoftext|>\n<|assistant|>\n"
