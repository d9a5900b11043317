"""Every vLLM internal `modeling_dint/integrations/vllm/modeling_dint_vllm.py` uses (its `VLLM_INTERNALS`), checked
against the installed vLLM: a vLLM release that moves one fails here, by name, before any model runs. Also the plugin's
entry point and the load-time refusals.

Needs vLLM in the python that runs it (`.ci/vllm_env.py`, `.ci/run`'s vLLM stage); skipped elsewhere.
"""

import dataclasses
import importlib.metadata
import importlib.util
import inspect
import os

import pytest


if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed in this python: `python .ci/vllm_env.py` builds the cached virtualenv with vLLM's CPU "
        "build and prints its python; run `<that python> -m pytest tests/test_vllm_internals.py` (.ci/run does)",
        allow_module_level=True,
    )

from modeling_dint import DintConfig  # noqa: E402
from modeling_dint.transformers_compat import installed_release  # noqa: E402
from modeling_dint.integrations.vllm import VLLM_ARCHITECTURE, VLLM_MODEL_CLASS, register  # noqa: E402
from modeling_dint.integrations.vllm import modeling_dint_vllm as dint_vllm  # noqa: E402


def parameters(function) -> set[str]:
    return set(inspect.signature(function).parameters)


def undecorated_init(cls):
    """`cls.__init__` as written: vLLM's `@support_torch_compile` replaces it with a `(*args, vllm_config, prefix,
    **kwargs)` wrapper that holds the original in its closure."""
    for cell in cls.__init__.__closure__ or ():
        if getattr(cell.cell_contents, "__qualname__", None) == f"{cls.__name__}.__init__":
            return cell.cell_contents
    return cls.__init__


def test_written_for_the_installed_release():
    import vllm

    written_for = ", ".join(f"{major}.{minor}" for major, minor in dint_vllm.WRITTEN_FOR_VLLM)
    assert installed_release(vllm.__version__)[:2] in dint_vllm.WRITTEN_FOR_VLLM, (
        f"modeling_dint/integrations/vllm/modeling_dint_vllm.py was written for vLLM {written_for}; "
        f"{vllm.__version__} is installed: check each entry of VLLM_INTERNALS (this file's tests name what moved), "
        "then add the release"
    )


def test_llama_stack_builds_dint_attention():
    from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel

    assert {"vllm_config", "prefix", "layer_type"} <= parameters(undecorated_init(LlamaModel))
    assert "attn_layer_type" in parameters(LlamaDecoderLayer.__init__)
    # LlamaDecoderLayer builds `attn_layer_type` with LlamaAttention's keyword arguments: DINT's takes each of them
    assert parameters(LlamaAttention.__init__) - {"self"} <= parameters(dint_vllm.DintVllmAttention.__init__)
    assert {"positions", "hidden_states"} == parameters(LlamaAttention.forward) - {"self"}
    assert {"gate_proj", "up_proj"} <= {key.strip(".") for key in LlamaModel.hf_to_vllm_mapper.orig_to_new_stacked}


def test_paged_attention_layer():
    from vllm.model_executor.layers.attention import Attention

    expected = {"num_heads", "head_size", "scale", "num_kv_heads", "cache_config", "quant_config", "prefix"}
    assert expected <= parameters(Attention.__init__)


def test_padded_pages_and_the_attention_metadata():
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    assert issubclass(dint_vllm.DintPagedAttention, Attention)
    assert {"get_kv_cache_spec", "bind_kv_cache"} <= set(dir(Attention))
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=dint_vllm.torch.float32)
    padded = dataclasses.replace(spec, page_size_padded=spec.page_size_bytes + 1024)
    assert padded.page_size_bytes == spec.page_size_bytes + 1024  # what vLLM sizes the pool with
    fields = {field.name for field in dataclasses.fields(CPUAttentionMetadata)}
    assert {"num_actual_tokens", "query_start_loc", "block_table", "slot_mapping"} <= fields
    # manager blocks are the kernel's blocks: slot // block_size is the block of the page the row is written to
    assert any(size.base == 32 for size in CPUAttentionBackend.get_supported_kernel_block_sizes())


@pytest.mark.parametrize("layout_name", ["LBHNC", "BLHNC"])
def test_page_tails_hold_the_state_apart_from_the_kv(layout_name):
    """vLLM's own views of padded pages (layer-outermost, as on CPU, and block-outermost): each layer's state table
    views the tails, one per block and layer, none overlapping any K/V or another layer's tail."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    state_shape, num_blocks, num_layers = (4, 64), 5, 2
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    page = spec.page_size_bytes + 4 * state_shape[0] * state_shape[1]
    spec = dataclasses.replace(spec, page_size_padded=page)
    layout = KVCacheLayout[layout_name]
    block_outermost = layout_name.startswith("B")
    tensor = KVCacheTensor(
        size=page * num_blocks * num_layers, layers=["a", "b"],
        layer_stride=page if block_outermost else page * num_blocks,
        block_stride=page * num_layers if block_outermost else page,
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    tables = [dint_vllm.page_tail_state_table(view, dint_vllm.page_tail_state_view(view, state_shape, page))
              for view in views]
    for layer, table in enumerate(tables):
        assert table.shape == (num_blocks, *state_shape)
        table.copy_(torch.arange(num_blocks, dtype=torch.float32)[:, None, None] + 10 * (layer + 1))
    assert all(bool((view == 0).all()) for view in views)
    for view in views:
        view.fill_(-1.0)
    for layer, table in enumerate(tables):
        assert torch.equal(table[:, 0, 0], torch.arange(num_blocks, dtype=torch.float32) + 10 * (layer + 1))
    assert int((raw.view(torch.float32) != -1.0).sum()) == num_layers * num_blocks * state_shape[0] * state_shape[1]
    with pytest.raises(RuntimeError, match="no such tail"):
        dint_vllm.page_tail_state_view(views[0], (4, 128), page)


def test_custom_op_and_compilation():
    import torch
    from vllm.config.compilation import CompilationConfig
    from vllm.forward_context import ForwardContext, get_forward_context  # noqa: F401
    from vllm.utils.torch_utils import direct_register_custom_op

    assert {"op_name", "op_func", "mutates_args", "fake_impl"} <= parameters(direct_register_custom_op)
    assert hasattr(torch.ops.vllm, dint_vllm.INTEGRAL_OP)
    assert f"vllm::{dint_vllm.INTEGRAL_OP}" in CompilationConfig._attention_ops
    assert {"attn_metadata", "no_compile_layers"} <= {field.name for field in dataclasses.fields(ForwardContext)}


def test_weight_loading_helpers():
    from vllm.model_executor.models.utils import AutoWeightsLoader

    assert "ignore_unexpected_prefixes" in parameters(AutoWeightsLoader.__init__)
    assert "mapper" in parameters(AutoWeightsLoader.load_weights)


def test_plugin_entry_point_registers_the_architecture():
    from vllm import ModelRegistry

    entry_points = {entry.name: entry.value for entry in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert entry_points.get("dint") == "modeling_dint.integrations.vllm:register", entry_points
    register()
    register()  # idempotent: vLLM calls it in each process, sometimes twice
    assert VLLM_ARCHITECTURE in ModelRegistry.get_supported_archs()
    assert VLLM_MODEL_CLASS == f"{dint_vllm.__name__}:{dint_vllm.DintForCausalLM.__name__}"


def test_qkv_rows_keep_each_pair_on_one_rank():
    """GQA (8 maps over 4 KV heads, g = 2), two ranks: rank r holds KV pair r, i.e. KV heads r and r + 2, the signal
    maps 2r, 2r+1 that read KV head r and the noise maps 4+2r, 4+2r+1 that read KV head r + 2."""
    config = DintConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    assert dint_vllm.DintVllmV1Attention.local_qkv_rows(config, 0, 2) == ([0, 1, 4, 5], [0, 2])
    assert dint_vllm.DintVllmV1Attention.local_qkv_rows(config, 1, 2) == ([2, 3, 6, 7], [1, 3])
    assert dint_vllm.DintVllmV1Attention.local_qkv_rows(config, 0, 1) == ([0, 1, 4, 5, 2, 3, 6, 7], [0, 2, 1, 3])


def test_v2_qkv_rows_are_llamas_contiguous_blocks():
    """v2 (8 query heads over 2 KV heads: query heads 0-3 read KV head 0, pairs (0, 1), (2, 3)): rank r holds query
    heads 4r..4r+3 and KV head r, as Llama's column-parallel q/k/v."""
    config = DintConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                        differential_attention="v2")
    assert dint_vllm.DintVllmV2Attention.local_qkv_rows(config, 0, 2) == ([0, 1, 2, 3], [0])
    assert dint_vllm.DintVllmV2Attention.local_qkv_rows(config, 1, 2) == ([4, 5, 6, 7], [1])
    assert dint_vllm.integral_state_shape(config, 2) == (2, 32)


def test_each_head_layout_has_its_vllm_attention():
    """The vLLM model builds, for each head layout of the transformers model, its own attention class over the shared
    base (as `DintV1Attention` / `DintV2Attention`): a new layout added to one side is missing from the other here."""
    from modeling_dint.modeling_dint import DINT_ATTENTION_CLASSES

    assert set(dint_vllm.VLLM_ATTENTION_CLASSES) == set(DINT_ATTENTION_CLASSES)
    assert all(issubclass(layout, dint_vllm.DintVllmAttention) for layout in dint_vllm.VLLM_ATTENTION_CLASSES.values())


def test_speculative_decoding_and_kv_connectors_refused_at_load():
    from types import SimpleNamespace

    config = DintConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    for field in ("speculative_config", "kv_transfer_config"):
        vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=config), speculative_config=None,
                                      kv_transfer_config=None)
        setattr(vllm_config, field, "set")
        with pytest.raises(ValueError, match=f"{field}='set'"):
            dint_vllm.DintForCausalLM(vllm_config=vllm_config)


def test_load_time_refusals_name_the_field():
    with pytest.raises(ValueError, match="integral='softmax'"):
        DintConfig(hidden_size=128, num_attention_heads=8, integral="softmax").check_paged_serving()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide num_key_value_heads / 2 = 2"):
        DintConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=4).check_tensor_parallel_heads(4)


# ------------------------------------------------------------------------- the same internals, in a source tree
# The CUDA build (vllm==0.33.0: torch 2.14.0, CUDA libraries) cannot be installed on CI's CPU machine; its source can
# be read. `python .ci/vllm_env.py --cuda-source` extracts the wheel's python files (once, into the cache) and prints
# the folder; DINT_VLLM_CUDA_SOURCE=<it> makes the test below read it beside the installed vLLM's.
SOURCE_INTERNALS = [
    # (file under vllm/, class or function, names it must define: parameters of a function, members of a class)
    ("model_executor/models/llama.py", "LlamaModel.__init__", {"vllm_config", "prefix", "layer_type"}),
    ("model_executor/models/llama.py", "LlamaDecoderLayer.__init__", {"vllm_config", "prefix", "attn_layer_type"}),
    ("model_executor/models/llama.py", "LlamaModel", {"hf_to_vllm_mapper", "embed_input_ids", "load_weights"}),
    ("model_executor/layers/attention/attention.py", "Attention.__init__",
     {"num_heads", "head_size", "scale", "num_kv_heads", "cache_config", "quant_config", "prefix"}),
    ("model_executor/layers/attention_layer_base.py", "AttentionLayerBase", {"bind_kv_cache", "get_kv_cache_spec"}),
    ("v1/kv_cache_interface.py", "AttentionSpec", {"page_size_padded", "page_size_bytes"}),
    ("v1/kv_cache_interface.py", "create_kv_cache_views", {"raw", "spec", "num_blocks", "layout", "kv_cache_tensor"}),
    ("v1/attention/backends/cpu_attn.py", "CPUAttentionMetadata",
     {"num_actual_tokens", "query_start_loc", "block_table", "slot_mapping"}),
    ("v1/attention/backends/flash_attn.py", "FlashAttentionMetadata",
     {"num_actual_tokens", "query_start_loc", "block_table", "slot_mapping"}),
    ("config/compilation.py", "CompilationConfig", {"_attention_ops"}),
    ("forward_context.py", "ForwardContext", {"attn_metadata", "no_compile_layers"}),
    ("forward_context.py", "get_forward_context", set()),
    ("config/vllm.py", "get_current_vllm_config", set()),
    ("utils/torch_utils.py", "direct_register_custom_op", {"op_name", "op_func", "mutates_args", "fake_impl"}),
    ("model_executor/models/utils.py", "AutoWeightsLoader.__init__", {"ignore_unexpected_prefixes"}),
    ("model_executor/models/utils.py", "AutoWeightsLoader.load_weights", {"mapper"}),
    ("model_executor/models/utils.py", "extract_layer_index", set()),
    ("model_executor/models/utils.py", "maybe_prefix", set()),
]
"""`VLLM_INTERNALS` as names in source files: what the tests above check on the installed vLLM, read with `ast`."""


def source_definitions(path: str, qualified_name: str) -> set[str] | None:
    """The names `qualified_name` defines in the python file `path` (a function's parameters; a class's methods,
    annotated fields, assigned attributes and enum members), or None where the file or the definition is missing."""
    import ast

    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as file:
        scope = ast.parse(file.read()).body
    node = None
    for part in qualified_name.split("."):
        node = next((item for item in scope if getattr(item, "name", None) == part), None)
        if node is None:
            return None
        scope = getattr(node, "body", [])
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        arguments = node.args
        return {argument.arg for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names.update(target.id for target in item.targets if isinstance(target, ast.Name))
    return names


def source_trees() -> list[tuple[str, str]]:
    import vllm

    trees = [(f"installed vllm {vllm.__version__}", os.path.dirname(vllm.__file__))]
    cuda_source = os.environ.get("DINT_VLLM_CUDA_SOURCE")
    if cuda_source:
        trees.append((f"CUDA build source {cuda_source}", os.path.join(cuda_source, "vllm")))
    return trees


@pytest.mark.parametrize("tree", source_trees(), ids=lambda tree: tree[0])
def test_source_defines_every_internal(tree):
    label, root = tree
    problems = []
    for relative_path, qualified_name, required in SOURCE_INTERNALS:
        defined = source_definitions(os.path.join(root, relative_path), qualified_name)
        if defined is None:
            problems.append(f"{relative_path}: {qualified_name} is gone")
        elif not required <= defined:
            problems.append(f"{relative_path}: {qualified_name} lacks {sorted(required - defined)}")
    llama_attention = source_definitions(os.path.join(root, "model_executor/models/llama.py"), "LlamaAttention.__init__")
    if llama_attention is not None and not llama_attention <= parameters(dint_vllm.DintVllmAttention.__init__):
        problems.append(f"LlamaAttention.__init__ takes {sorted(llama_attention - parameters(dint_vllm.DintVllmAttention.__init__))} "
                        "that DintVllmAttention does not")
    assert not problems, f"{label}: vLLM internals DINT uses have changed:\n" + "\n".join(problems)
