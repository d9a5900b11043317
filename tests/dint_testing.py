"""Helpers the tests share: tiny configs and models, built here (nothing is downloaded)."""

import importlib.util
import os
import re

import pytest
import torch

from modeling_dint import DintConfig, DintForCausalLM
from modeling_dint.transformers_compat import CACHE_ARGUMENT


def with_cache(cache) -> dict:
    """The cache as keyword arguments of a forward or generate(), under the installed transformers' name (`cache`
    from 5.24, `past_key_values` before), so that the tests run warning-free on every supported release."""
    return {CACHE_ARGUMENT: cache}


def cache_of(output):
    """The cache a model output returns (`output.cache` from transformers 5.24, `output.past_key_values` before)."""
    return output[CACHE_ARGUMENT]


V2 = {"differential_attention": "v2", "num_key_value_heads": 1}
"""The overrides that make `tiny_config` a DIFF V2 layout: 4 query heads (2 differential heads) over one KV head."""

V2_GATED = {**V2, "lambda_gate": True}
"""`V2` with the lambda gate (`config.lambda_gate`, the V2 converter's start): `tiny_model` draws the gates."""

LAYOUTS = [pytest.param({}, id="v1"), pytest.param(V2, id="v2"), pytest.param(V2_GATED, id="v2-gated")]
"""Both head layouts, and v2 with its lambda gate, for `@pytest.mark.parametrize("layout", LAYOUTS)`; a test passes
`**layout` to `tiny_model`."""


def tiny_config(**overrides) -> DintConfig:
    """A 2-layer DINT with GQA (4 softmax maps = 2 differential heads, 2 KV heads) and non-trivial lambdas."""
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        lambda_std_dev=0.3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    fields.update(overrides)
    return DintConfig(**fields)


def diffllama_config_like(config, **overrides):
    """transformers' `DiffLlamaConfig` with the head layout and sizes of the DINT `config` (v1)."""
    from transformers import DiffLlamaConfig

    fields = {name: getattr(config, name) for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "pad_token_id", "bos_token_id",
        "eos_token_id",
    )}
    return DiffLlamaConfig(**{**fields, **overrides})


def tiny_model(attn_implementation: str = "sdpa", dtype=torch.float32, seed: int = 0, **overrides) -> DintForCausalLM:
    """A tiny DINT LM in eval mode, the same weights for the same seed and config whatever the attention backend;
    its head-norm weights and v2's lambda gates (one of them 0, one negative) are perturbed so that the tests see them
    act."""
    torch.manual_seed(seed)
    config = tiny_config(**overrides)
    config._attn_implementation = attn_implementation
    model = DintForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            norm_weight = getattr(layer.self_attn.head_norm, "weight", None)
            if norm_weight is not None:
                norm_weight.uniform_(0.5, 1.5)
            lambda_gate = getattr(layer.self_attn, "lambda_gate", None)
            if lambda_gate is not None:
                lambda_gate.weight.uniform_(0.5, 1.5)
                lambda_gate.weight[0] = 0.0
                lambda_gate.weight[-1] = -0.7
    return model


def left_padded_batch(vocab_size: int = 128, lengths=(9, 5), pad_token_id: int = 0, seed: int = 0):
    """Random prompts of different lengths, left-padded: returns input_ids and attention_mask `[B, max(lengths)]`."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(2, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def assert_equal_to_rounding(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 8, msg: str | None = None):
    """`actual` equals `expected` to the float's rounding: within `ulps` times the dtype's epsilon times the largest
    |expected| (a few units in the last place of the largest value).

    For results of the same computation on operands at other memory addresses, where the platform promises no bit
    equality: MKL's matrix products (torch's CPU BLAS) sum in an order that depends on the operands' alignment unless
    `MKL_CBWR` is set, and weights loaded from safetensors are 8-byte aligned only (8 bytes off a 64-byte boundary for
    the tiny model) where freshly built ones sit on one. On Intel CPUs the two orders agreed; on an AMD EPYC (MKL's
    AVX2 path) a reload moved the tiny model's logits by 1.2e-7, two units in the last place. A real difference (a
    weight, a dtype, a state) is orders of magnitude larger."""
    tolerance = ulps * torch.finfo(expected.dtype).eps * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=tolerance, msg=msg)


def realigned(model):
    """`model` with every parameter and buffer copied into memory of its own (torch's CPU allocator aligns each
    allocation to 64 bytes, as a freshly built model's weights are): the same values at a freshly built model's
    alignment."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    return model


WITHOUT_THE_PACKAGE = """
import importlib.abc, sys

class BlockPackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "modeling_dint" or name.startswith("modeling_dint."):
            raise ImportError("modeling_dint is not installed in this process")
        return None

sys.meta_path.insert(0, BlockPackage())
"""
"""The start of a script that loads remote code in a process of its own: `import modeling_dint` fails there, so the
model comes from the files saved with the weights."""

TORCHAO_PYTREE_ENUMS = ("KernelPreference", "ScaleCalculationMode")
"""The Enum classes torchao 0.18 (the `quantization` extra) registers as pytree constants when it is imported
(`torchao.quantization.quantize_.common.kernel_preference`, `torchao.prototype.mx_formats.config`): torch 2.13 logs
a deprecation warning for each."""


def without_torchao_import_lines(text: str) -> str:
    """`text` without the lines torchao's own import writes, where torchao is installed (the `quantization` extra):
    transformers imports torchao with every model class, and on a CPU-only torch torchao's logger says "Failed to load
    <torchao's package folder>/_C....so: ..." for each of its CUDA extensions, and torch's pytree logger warns about
    each of torchao's Enum constants. Only those lines go: every other line stays, and all of `text` without torchao."""
    spec = importlib.util.find_spec("torchao")
    if spec is None:
        return text
    package_dir = re.escape(os.path.dirname(spec.origin))
    torchao_lines = [
        re.compile(rf"Failed to load {package_dir}/_C[\w.-]*\.so: "),
        re.compile(
            r"W\d{4} [\d:.]+ +\d+ \S*torch/utils/_pytree\.py:\d+\] "
            rf"<enum '({'|'.join(TORCHAO_PYTREE_ENUMS)})'> is an Enum subclass "
        ),
    ]
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not any(pattern.match(line) for pattern in torchao_lines))
