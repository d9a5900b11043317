# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Train (or fine-tune) a DINT causal LM on a plain-text file with transformers' Trainer.

The same script runs on one process and, unchanged, under Accelerate on several (DDP, FSDP):

    # one process, the repository's Shakespeare corpus, the "tiny" preset
    python examples/train.py --output_dir runs/tiny --max_steps 200

    # DDP on 2 processes (GPUs, or CPU processes with gloo where there is no GPU)
    accelerate launch --multi_gpu --num_processes 2 examples/train.py --output_dir runs/ddp ...
    # (same as: torchrun --nproc_per_node 2 examples/train.py ...; note that `accelerate launch --cpu` starts a
    # single process whatever --num_processes says, in accelerate 1.15)

    # FSDP on 2 processes, DintDecoderLayer as the wrap unit, sharded checkpoints (CPU processes too)
    accelerate launch --config_file examples/accelerate_fsdp.yaml examples/train.py --output_dir runs/fsdp ...

    # continue a run from its last checkpoint (or name one: --resume_from_checkpoint runs/tiny/checkpoint-100)
    python examples/train.py --output_dir runs/tiny --max_steps 400 --resume_from_checkpoint last

Every `TrainingArguments` field is a flag (--learning_rate, --save_steps, --bf16, --activation_checkpointing, ...).
Defaults that differ from Trainer's are the main job's recipe (`TRAINING_RECIPE` in examples/main_job.py): batch 8,
learning rate 3e-3 with a cosine schedule and 5% warm-up, weight decay 0.1, gradient clipping at 1, and a loss line
every 2% of the steps beside the progress bar; any flag you pass overrides them.
The text is tokenized whole and cut into blocks of `--block_size` tokens (plays run on across block boundaries);
the model comes from a preset of `modeling_dint` (`--preset`, sized to the tokenizer) or from `--model_name_or_path`.
At the end the model and tokenizer are saved to `--output_dir`, loadable with `AutoModelForCausalLM.from_pretrained`.
"""

import logging
import math
import os
import sys
from dataclasses import dataclass, field

import torch

from modeling_dint import DintConfig, DintForCausalLM
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from main_job import TRAINING_RECIPE  # noqa: E402  (the main job's optimizer, schedule and logging)


logger = logging.getLogger(__name__)

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@dataclass
class ScriptArguments:
    train_file: str = field(
        default=os.path.join(DATA_DIR, "shakespeare_train.txt"), metadata={"help": "Plain-text training file."}
    )
    validation_file: str | None = field(
        default=os.path.join(DATA_DIR, "shakespeare_heldout.txt"),
        metadata={"help": "Plain-text held-out file, evaluated at the end (and at eval_steps); 'none' to skip."},
    )
    tokenizer_name: str = field(
        default=os.path.join(DATA_DIR, "tokenizer"), metadata={"help": "Tokenizer folder (AutoTokenizer)."}
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A saved DINT model to fine-tune; by default a new model from --preset."}
    )
    preset: str = field(default="tiny", metadata={"help": "modeling_dint preset for a new model (e.g. tiny, 830m)."})
    block_size: int = field(default=256, metadata={"help": "Tokens per training example (the main job's)."})
    max_train_chars: int | None = field(
        default=None, metadata={"help": "Read only the first N characters of each text file (quick runs)."}
    )
    max_eval_blocks: int | None = field(default=None, metadata={"help": "Evaluate on the first N held-out blocks."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "sdpa, eager, flash_attention_2, ..."})


class TokenBlocks(torch.utils.data.Dataset):
    """Consecutive, non-overlapping blocks of `block_size` tokens of one text; labels = input_ids (the model shifts)."""

    def __init__(self, token_ids: list[int], block_size: int):
        num_blocks = len(token_ids) // block_size
        if num_blocks == 0:
            raise ValueError(f"The text has {len(token_ids)} tokens, fewer than one block of {block_size}.")
        self.token_ids = torch.tensor(token_ids[: num_blocks * block_size]).view(num_blocks, block_size)

    def __len__(self):
        return self.token_ids.shape[0]

    def __getitem__(self, index):
        input_ids = self.token_ids[index]
        return {"input_ids": input_ids, "labels": input_ids.clone()}


def read_blocks(path: str, tokenizer, block_size: int, max_chars: int | None) -> TokenBlocks:
    with open(path, encoding="utf-8") as handle:
        text = handle.read() if max_chars is None else handle.read(max_chars)
    return TokenBlocks(tokenizer(text)["input_ids"], block_size)


def build_model(script_args: ScriptArguments, tokenizer) -> DintForCausalLM:
    if script_args.model_name_or_path is not None:
        return AutoModelForCausalLM.from_pretrained(
            script_args.model_name_or_path, attn_implementation=script_args.attn_implementation
        )
    config = DintConfig.from_preset(
        script_args.preset,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config.max_position_embeddings = max(config.max_position_embeddings, script_args.block_size)
    return DintForCausalLM._from_config(config, attn_implementation=script_args.attn_implementation)


def enable_fsdp_on_cpu_processes(training_args: TrainingArguments) -> None:
    """Accelerate (1.15) turns FSDP on only for accelerator processes: on CPU processes (gloo) it silently falls back to
    DDP. When FSDP is asked for (by `accelerate launch` with an FSDP config, or by `--fsdp`) and the processes run on
    CPU, set up Accelerate's shared state with the FSDP plugin before the Trainer builds its Accelerator, which then
    uses it. torch's FSDP2 (`fully_shard`) runs on CPU with gloo."""
    fsdp_requested = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or bool(training_args.fsdp)
    if not fsdp_requested or training_args.world_size < 2 or training_args.device.type != "cpu":
        return
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin

    fsdp_plugin = FullyShardedDataParallelPlugin(**(training_args.fsdp_plugin_args or {}))
    mixed_precision = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no"
    state = AcceleratorState(
        mixed_precision=mixed_precision,
        cpu=True,
        fsdp_plugin=fsdp_plugin,
        dynamo_plugin=TorchDynamoPlugin(),
        _from_accelerator=True,
    )
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = fsdp_plugin
    logger.info("FSDP on %d CPU processes (FSDP version %d).", training_args.world_size, fsdp_plugin.fsdp_version)


def save_final_model(trainer: Trainer, output_dir: str) -> None:
    """Writes the model (config with its auto_map, safetensors, the modeling files) and the tokenizer to `output_dir`.
    Under FSDP with sharded checkpoints (`fsdp_state_dict_type: SHARDED_STATE_DICT`, good for resuming big runs), the
    Trainer saves no final model: gather the full state dict on every rank and write it from the main process."""
    fsdp_plugin = trainer.accelerator.state.fsdp_plugin if trainer.is_fsdp_enabled else None
    if fsdp_plugin is None or "FULL_STATE_DICT" in str(fsdp_plugin.state_dict_type):
        trainer.save_model(output_dir)
        return
    state_dict = trainer.accelerator.get_state_dict(trainer.model)  # a collective: every rank takes part
    if trainer.args.should_save:
        trainer.accelerator.unwrap_model(trainer.model).save_pretrained(output_dir, state_dict=state_dict)
        trainer.processing_class.save_pretrained(output_dir)
    trainer.accelerator.wait_for_everyone()


def default_training_flags() -> list[str]:
    """The main job's recipe as command-line flags, placed before the user's (argparse keeps the last value given)."""
    flags = [f"--{name}={value}" for name, value in TRAINING_RECIPE.items()]
    if not torch.accelerator.is_available():
        flags.append("--dataloader_pin_memory=False")  # pinned memory needs an accelerator; torch warns without one
    return flags


def main(argv=None):
    if not torch.accelerator.is_available():
        # No GPU: run on CPU, also under `accelerate launch --multi_gpu` / FSDP (whose launcher does not pass `--cpu`
        # on): with this, Accelerate sets up CPU processes with the gloo backend instead of one process per GPU.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    argv = sys.argv[1:] if argv is None else list(argv)
    script_args, training_args = parser.parse_args_into_dataclasses(args=default_training_flags() + argv)
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        level=logging.INFO if training_args.process_index == 0 else logging.WARNING,
        stream=sys.stdout,
    )
    set_seed(training_args.seed)

    tokenizer = AutoTokenizer.from_pretrained(script_args.tokenizer_name)
    train_dataset = read_blocks(script_args.train_file, tokenizer, script_args.block_size, script_args.max_train_chars)
    eval_dataset = None
    if script_args.validation_file and script_args.validation_file.lower() != "none":
        eval_dataset = read_blocks(
            script_args.validation_file, tokenizer, script_args.block_size, script_args.max_train_chars
        )
        if script_args.max_eval_blocks is not None:
            num_eval_blocks = min(script_args.max_eval_blocks, len(eval_dataset))
            eval_dataset = torch.utils.data.Subset(eval_dataset, range(num_eval_blocks))
    model = build_model(script_args, tokenizer)
    logger.info(
        "DINT model: %.2fM parameters, %d training blocks of %d tokens, world size %d",
        model.num_parameters() / 1e6,
        len(train_dataset),
        script_args.block_size,
        training_args.world_size,
    )

    if training_args.ddp_find_unused_parameters is None:
        training_args.ddp_find_unused_parameters = False  # every DINT parameter takes part in every forward
    enable_fsdp_on_cpu_processes(training_args)

    resume_from_checkpoint = training_args.resume_from_checkpoint
    if resume_from_checkpoint == "last":
        resume_from_checkpoint = get_last_checkpoint(training_args.output_dir)
        if resume_from_checkpoint is None:
            raise ValueError(f"--resume_from_checkpoint last: no checkpoint-* folder in {training_args.output_dir}.")

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    train_result = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    if eval_dataset is not None:
        eval_metrics = trainer.evaluate()
        eval_metrics["eval_perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50.0))
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
    trainer.save_state()
    save_final_model(trainer, training_args.output_dir)


if __name__ == "__main__":
    main()
