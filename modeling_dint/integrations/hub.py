# Copyright 2026 The DINT for transformers authors. Licensed under the Apache License, Version 2.0.
"""Share DINT models on the Hugging Face Hub: a generated model card, a one-folder save, a one-commit push.

    >>> from modeling_dint import push_dint_to_hub, save_dint_for_hub
    >>> save_dint_for_hub(model, "outputs/dint-tiny", tokenizer=tokenizer)     # weights, remote code, tokenizer, card
    >>> push_dint_to_hub(model, "my-name/dint-tiny", tokenizer=tokenizer)       # the same files, in one commit

Both take (model, where, tokenizer=None, **card options), in that order.

The folder (or repo) holds `model.safetensors`, `config.json` with an `auto_map`, the remote-code files
(`REMOTE_CODE_FILES`), the tokenizer files and `README.md`, so that
`AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True)` loads it where this package is not installed.

A later plain `model.push_to_hub(repo_id)` keeps the card: transformers reloads the README already in the repo. To put
the card beside a `push_to_hub` you ran yourself, upload `dint_model_card(model)` as README.md (see `push_dint_to_hub`).
"""

import os
import tempfile

from huggingface_hub import HfApi, ModelCardData

from ..configuration_dint import DintConfig
from ..modeling_dint import REMOTE_CODE_FILES


DINT_PAPER_ARXIV_ID = "2501.17486"
"""arXiv id of the DINT Transformer paper (Cang et al., 2025)."""

DIFF_PAPER_ARXIV_ID = "2410.05258"
"""arXiv id of the DIFF Transformer paper (Ye et al., 2024), which DINT extends."""

DINT_CITATION = """@article{cang2025dint,
  title   = {DINT Transformer},
  author  = {Cang, Yueyang and others},
  journal = {arXiv preprint arXiv:2501.17486},
  year    = {2025}
}"""

_INTEGRAL_DESCRIPTIONS = {
    "mean": "`A1 - lambda*A2 + lambda*G`, G the running mean over query rows of the signal map A1 (the paper's eq. 5)",
    "softmax": "`A1 - lambda*A2 + lambda*softmax(G)` over the valid keys of each row (the arXiv v2 text)",
    "none": "plain DIFF attention `A1 - lambda*A2` (ablation baseline, no integral term)",
}
_LAYOUT_DESCRIPTIONS = {
    "v1": "DIFF V1's, the paper's (signal maps then noise maps, 2*head_dim value channels per differential head)",
    "v2": "DIFF V2's (query heads 2i and 2i+1 share a KV head: one ordinary attention call, Llama's KV cache)",
}


def format_parameter_count(num_parameters: int) -> str:
    """A short human-readable count, e.g. 1234567 -> "1.23M", 830_000_000 -> "830M"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if num_parameters >= scale:
            return f"{num_parameters / scale:.3g}{unit}"
    return str(num_parameters)


def dint_model_card(
    model,
    model_name: str | None = None,
    *,
    license: str | None = "apache-2.0",
    base_model: str | None = None,
    datasets: list[str] | None = None,
    tags: list[str] | None = None,
    training_summary: str | None = None,
    eval_results: dict[str, float] | None = None,
    repo_id: str | None = None,
) -> str:
    """The README.md (YAML metadata + Markdown) of a DINT model for the Hub.

    Args:
        model (`DintPreTrainedModel`): the model, or its `DintConfig`; a config alone gives no parameter count.
        model_name (`str`, *optional*): the card's title; defaults to the last part of `repo_id`, else "DINT model".
        license (`str`, *optional*, defaults to `"apache-2.0"`): the Hub license id, None to leave it out.
        base_model (`str`, *optional*): the checkpoint this one was converted or fine-tuned from (Hub metadata).
        datasets (`list[str]`, *optional*): Hub ids of the training data sets (metadata).
        tags (`list[str]`, *optional*): more tags; `dint` and `arxiv:2501.17486` are always there.
        training_summary (`str`, *optional*): Markdown describing how the model was trained.
        eval_results (`dict[str, float]`, *optional*): metric name -> value, shown as a table.
        repo_id (`str`, *optional*): the repo id, used in the usage snippet (default: `path/to/this/model`).

    Returns:
        `str`: the card, starting with `---` YAML front matter that the Hub validates (library_name `transformers`,
        pipeline_tag `text-generation`, tags, and a `dint` block with the integral mode and the parameter count).
    """
    config = model if isinstance(model, DintConfig) else getattr(model, "config", None)
    if not isinstance(config, DintConfig) and getattr(config, "model_type", None) != "dint":
        raise TypeError(
            f"`dint_model_card` describes a DINT model: pass a DintPreTrainedModel or a DintConfig, got "
            f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r})."
        )
    num_parameters = None if model is config else sum(parameter.numel() for parameter in model.parameters())
    parameter_bytes = None if model is config else sum(p.numel() * p.element_size() for p in model.parameters())
    dtype = None if model is config else str(next(model.parameters()).dtype).replace("torch.", "")
    layout = getattr(config, "differential_attention", "v1")
    if layout == "v2" and getattr(config, "lambda_gate", False):
        lambda_init = ("none: lambda = lambda_gate * sigmoid(lambda_proj(x)) per token and differential head (a "
                       "learned gate per head, not in DIFF V2)")
    elif layout == "v2":
        lambda_init = "none: lambda = sigmoid(lambda_proj(x)) per token and differential head"
    elif config.lambda_init is None:
        lambda_init = "depth schedule 0.8 - 0.6*exp(-0.3*layer)"
    else:
        lambda_init = f"{config.lambda_init} (constant)"
    all_tags = ["dint", f"arxiv:{DINT_PAPER_ARXIV_ID}"]
    all_tags += [tag for tag in (tags or []) if tag not in all_tags]
    dint_metadata = {
        "differential_attention": layout,
        "integral": config.integral,
        "lambda_init": config.lambda_init,
        "head_norm": config.head_norm,
        "lambda_gate": getattr(config, "lambda_gate", False),
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
    }
    if num_parameters is not None:
        dint_metadata["num_parameters"] = num_parameters
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        base_model=base_model,
        datasets=datasets,
        tags=all_tags,
        dint=dint_metadata,
    )
    if model_name is None:
        model_name = repo_id.split("/")[-1] if repo_id else "DINT model"
    load_id = repo_id or "path/to/this/model"
    size = "" if num_parameters is None else f" with {format_parameter_count(num_parameters)} parameters"

    lines = [
        "---",
        card_data.to_yaml(),
        "---",
        "",
        f"# {model_name}",
        "",
        f"A [DINT Transformer](https://arxiv.org/abs/{DINT_PAPER_ARXIV_ID}) (differential-integral attention, Cang et "
        f"al., 2025){size}: a Llama-style decoder whose attention adds an integral term to "
        f"[DIFF attention](https://arxiv.org/abs/{DIFF_PAPER_ARXIV_ID}), so that every row of the attention map sums "
        "to 1.",
        "",
        "| | |",
        "| --- | --- |",
        f"| integral mode | `{config.integral}`: {_INTEGRAL_DESCRIPTIONS.get(config.integral, config.integral)} |",
        f"| head layout | `{layout}`: {_LAYOUT_DESCRIPTIONS.get(layout, layout)} |",
    ]
    if num_parameters is not None:
        lines.append(f"| parameters | {num_parameters:,} ({format_parameter_count(num_parameters)}) |")
        lines.append(f"| weights | {parameter_bytes / 2**20:.1f} MiB in {dtype} |")
    lines += [
        f"| layers | {config.num_hidden_layers} |",
        f"| hidden size / MLP size | {config.hidden_size} / {config.intermediate_size} |",
        f"| softmax maps (differential heads) / KV heads | {config.num_attention_heads} "
        f"({config.num_attention_heads // 2}) / {config.num_key_value_heads} |",
        f"| head dim | {config.head_dim} |",
        f"| lambda_init | {lambda_init} |",
        f"| per-head RMSNorm | {'on' if config.head_norm else 'off'}"
        f"{'' if not config.head_norm or config.head_norm_affine else ' (no weight)'} |",
        f"| vocabulary / max positions | {config.vocab_size} / {config.max_position_embeddings} |",
        "",
        "## Usage",
        "",
        f"The modeling code travels with the weights ({', '.join(f'`{name}`' for name in REMOTE_CODE_FILES)}), so "
        "transformers loads the model with `trust_remote_code=True`, without the `modeling_dint` package:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{load_id}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{load_id}", trust_remote_code=True)',
        'inputs = tokenizer("To be, or not to be", return_tensors="pt")',
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0]))",
        "```",
        "",
        "Read remote code before you trust it; pin a `revision=<commit sha>` to load exactly the code you read.",
    ]
    if training_summary:
        lines += ["", "## Training", "", training_summary.strip()]
    if eval_results:
        lines += ["", "## Evaluation", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {name} | {value:.4g} |" for name, value in eval_results.items()]
    lines += ["", "## Citation", "", "```bibtex", DINT_CITATION, "```", ""]
    return "\n".join(lines)


def save_dint_for_hub(model, save_directory: str | os.PathLike, tokenizer=None, **card_kwargs) -> str:
    """Writes what a Hub repo of the model holds into `save_directory`: `model.save_pretrained` (safetensors,
    config.json with `auto_map`, the remote-code files, generation config), the tokenizer's files if given, and
    README.md from `dint_model_card(model, **card_kwargs)`. Returns the README's path."""
    model.save_pretrained(save_directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(save_directory)
    readme_path = os.path.join(save_directory, "README.md")
    with open(readme_path, "w", encoding="utf-8") as handle:
        handle.write(dint_model_card(model, **card_kwargs))
    return readme_path


def push_dint_to_hub(
    model,
    repo_id: str,
    tokenizer=None,
    *,
    commit_message: str = "Upload DINT model",
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    **card_kwargs,
):
    """Pushes a DINT model, its tokenizer (if given) and its generated model card to `repo_id`, in one commit.

    The same files as `save_dint_for_hub`; `card_kwargs` go to `dint_model_card` (its `repo_id` defaults to this
    one). The Hub endpoint and token are huggingface_hub's (`HF_ENDPOINT`, `HF_TOKEN`, `hf auth login`).

    To keep transformers' own `model.push_to_hub(repo_id)` instead, upload the card beside it:

        >>> model.push_to_hub(repo_id); tokenizer.push_to_hub(repo_id)
        >>> HfApi().upload_file(path_or_fileobj=dint_model_card(model, repo_id=repo_id).encode(),
        ...                     path_in_repo="README.md", repo_id=repo_id)

    Returns:
        `huggingface_hub.CommitInfo`: `.oid` is the new commit's sha, to pin with `from_pretrained(revision=...)`.
    """
    if not isinstance(repo_id, str) and isinstance(tokenizer, str):
        raise TypeError(
            f"push_dint_to_hub takes (model, repo_id, tokenizer=None), as save_dint_for_hub takes (model, "
            f"save_directory, tokenizer=None); got a {type(repo_id).__name__} as repo_id and the string {tokenizer!r} "
            "as tokenizer (the argument order of version 0.1.0 before this change): swap them."
        )
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    card_kwargs.setdefault("repo_id", repo_id)
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        save_dint_for_hub(model, folder, tokenizer=tokenizer, **card_kwargs)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message,
            revision=revision,
            create_pr=create_pr,
        )


__all__ = [
    "DINT_PAPER_ARXIV_ID",
    "dint_model_card",
    "format_parameter_count",
    "push_dint_to_hub",
    "save_dint_for_hub",
]
