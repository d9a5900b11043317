# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""`dint-convert` (also `python -m modeling_dint.conversion`): convert a checkpoint folder to DINT (or DINT to
DiffLlama). Run with `--help` for the options."""

import argparse
import logging
import sys

from modeling_dint.configuration_dint import INTEGRAL_MODES

from .checkpoint import DTYPES
from .convert import SOURCE_FORMATS, convert_checkpoint
from .llama import DIFFERENTIAL_ATTENTIONS, HEAD_INITS
from .reference import ROTARY_LAYOUTS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dint-convert",
        description=(
            "Convert a Hugging Face checkpoint folder to DINT: Llama / Mistral / Qwen2 (tensors copied, new lambda "
            "vectors and head norms; or --differential-attention v2: DIFF V2's layout at the source's KV cache and "
            "function), DiffLlama (one to one), Microsoft's reference Diff-Transformer layout (--source-format "
            "reference-diff) and its DIFF V2 attention (--source-format reference-diff-v2); or a DINT model with "
            "integral 'none' to DiffLlama."
        ),
    )
    parser.add_argument("source", help="source checkpoint folder (config.json + safetensors or .bin weights)")
    parser.add_argument("output", help="output folder (must not exist unless --force)")
    parser.add_argument("--source-format", default="auto", choices=SOURCE_FORMATS,
                        help="source layout; 'auto' reads config.json's model_type (default: auto)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="dtype of the written weights; 'auto' keeps the source's (default: auto)")
    parser.add_argument("--integral", default="mean", choices=INTEGRAL_MODES,
                        help="integral mode of the DINT model; 'none' is plain DIFF attention (default: mean)")
    parser.add_argument("--differential-attention", default=None, choices=DIFFERENTIAL_ATTENTIONS,
                        help="Llama-family sources: the DINT head layout, 'v1' (the paper's) or 'v2' (DIFF V2's: "
                             "the source's KV cache, q_proj twice as wide, starts at the source's function with a "
                             "lambda gate at 0) (default: v1)")
    parser.add_argument("--head-init", default=None, choices=HEAD_INITS,
                        help="Llama-family sources to v1: 'copy' the tensors (needs even head counts) or 'duplicate' "
                             "every head so the DINT model computes the source's function exactly (default: copy)")
    parser.add_argument("--lambda-std-dev", type=float, default=None,
                        help="Llama-family sources to v1: std of the new lambda vectors (default: 0.1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the new lambda vectors (v1) or lambda_proj (v2) (default: 0)")
    parser.add_argument("--rotary", default="interleaved", choices=ROTARY_LAYOUTS,
                        help="reference-diff and reference-diff-v2 sources: RoPE channel layout of the checkpoint "
                             "(default: interleaved)")
    parser.add_argument("--accept-sliding-window-difference", action="store_true",
                        help="Mistral / Qwen2 sources that attend within a sliding window: convert them anyway; DINT "
                             "attends to the whole causal prefix, so the logits equal the source's only up to the "
                             "window's length (without it such a source is refused)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors shard, e.g. 5GB or 500MB (default: 5GB)")
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit status. Every expected failure (a refused or unreadable source, an invalid
    config, an output that cannot or must not be written) is one line on stderr and status 2. The last line of a
    conversion says what the converted model computes against the source (`ConversionPlan.outcome`)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        plan = convert_checkpoint(
            args.source,
            args.output,
            source_format=args.source_format,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            force=args.force,
            progress=not args.quiet,
            integral=args.integral,
            head_init=args.head_init,
            lambda_std_dev=args.lambda_std_dev,
            seed=args.seed,
            rotary=args.rotary,
            differential_attention=args.differential_attention,
            accept_sliding_window_difference=args.accept_sliding_window_difference,
        )
    except (ValueError, OSError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)  # KeyError quotes it
        print(f"dint-convert: error: {' '.join(message.split())}", file=sys.stderr)
        return 2
    print(f"Wrote {plan.model_class.__name__} ({len(plan.tensors)} tensors) to {args.output}: {plan.outcome}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
