"""Where a newcomer goes wrong (issue 21): saved models are ready for generation and export, tensor parallelism
states its rule before it shards anything, the Hub helpers take their arguments in the same order, and importing
the package prints nothing."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import transformers
from dint_testing import LAYOUTS, cache_of, tiny_model, with_cache, without_torchao_import_lines
from transformers import PreTrainedModel

from modeling_dint import DintForCausalLM, push_dint_to_hub


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)


def test_saved_config_enables_the_cache_without_changing_the_model(tmp_path):
    model = tiny_model()
    model.config.use_cache = False  # what Trainer leaves behind
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False  # a checkpoint saved mid-training does not turn the cache on in training
    assert DintForCausalLM.from_pretrained(tmp_path).config.use_cache is True


@pytest.mark.skipif(
    not hasattr(PreTrainedModel, "maybe_distribute_model"),
    reason="the check runs in PreTrainedModel.maybe_distribute_model, which transformers 5.17 has and 5.10 has not "
    f"(installed: {transformers.__version__}); without it the check does not run before sharding",
)
def test_tensor_parallel_size_that_splits_differential_heads_is_refused_before_sharding():
    from transformers.distributed.configuration_utils import DistributedConfig

    model = tiny_model(num_attention_heads=4, num_key_value_heads=2)  # num_key_value_heads / 2 = 1
    with pytest.raises(ValueError, match=r"over 2 processes.*divide num_key_value_heads / 2 = 1 .*Allowed: \[1\]"):
        # What from_pretrained(tp_plan="auto") calls before it shards; nothing is sharded when this raises.
        DintForCausalLM.maybe_distribute_model(model, DistributedConfig(tp_size=2), mesh_manager=object())
    biased = tiny_model(num_attention_heads=8, num_key_value_heads=4, attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias=True"):
        DintForCausalLM.maybe_distribute_model(biased, DistributedConfig(tp_size=2), mesh_manager=object())
    gated = tiny_model(num_attention_heads=8, num_key_value_heads=2, differential_attention="v2", lambda_gate=True)
    with pytest.raises(ValueError, match="lambda_gate=True"):
        DintForCausalLM.maybe_distribute_model(gated, DistributedConfig(tp_size=2), mesh_manager=object())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_mask_of_another_length_names_attention_mask_and_both_lengths(layout):
    model = tiny_model(**layout)
    input_ids = torch.randint(2, 128, (2, 6))
    for length in (5, 8):
        mask = torch.ones(2, length, dtype=torch.long)
        mask[0, 0] = 0
        with pytest.raises(ValueError, match=rf"`attention_mask` has length {length}, but the input has 6 tokens"):
            model(input_ids, attention_mask=mask)
    with torch.no_grad():
        cache = cache_of(model(input_ids, use_cache=True))
        step = torch.randint(2, 128, (2, 1))
        with pytest.raises(ValueError, match=r"has length 1, but the input has 1 tokens plus the 6 tokens in the "
                                             r"cache: .*shape \[batch, 7\]"):
            model(step, attention_mask=torch.ones(2, 1, dtype=torch.long), **with_cache(cache))
        # The right length runs (the cache was left as it was by the refusal)
        model(step, attention_mask=torch.ones(2, 7, dtype=torch.long), **with_cache(cache))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_two_processes_on_a_model_with_one_kv_head_pair_fail_with_the_rule(tmp_path):
    tiny_model(num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path / "checkpoint")
    torch.save({"input_ids": torch.randint(2, 128, (1, 8)), "new_tokens": 2}, tmp_path / "inputs.pt")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        os.path.join(TESTS_DIR, "tp_worker.py"),
        str(tmp_path / "checkpoint"), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"), "dint",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ,
                            "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "must divide num_key_value_heads / 2 = 1" in result.stderr
    assert "not enough values to unpack" not in result.stderr


def test_push_dint_to_hub_refuses_the_old_argument_order_before_any_network_call():
    model = tiny_model()
    with pytest.raises(TypeError, match=r"push_dint_to_hub takes \(model, repo_id, tokenizer=None\)"):
        push_dint_to_hub(model, object(), "my-name/dint-tiny")


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-c", "import modeling_dint"],
        [sys.executable, "-m", "modeling_dint.conversion", "--help"],
    ],
    ids=["import", "dint-convert-help"],
)
def test_import_and_cli_help_print_no_warnings(command):
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    # With the `quantization` extra, transformers imports torchao, whose import logs lines of its own: not DINT's.
    assert without_torchao_import_lines(result.stderr) == ""
    stdout = without_torchao_import_lines(result.stdout)
    assert "Failed to load" not in stdout and "Enum subclass" not in stdout


SIDE_EFFECTS = """
import json, logging
from transformers import cache_utils
from transformers.generation.continuous_batching import cache, continuous_api

def snapshot():
    return {
        "PagedAttentionCache.__init__": repr(cache.PagedAttentionCache.__init__),
        "continuous_api names": [repr(continuous_api.PagedAttentionCache), repr(continuous_api.ContinuousBatchingManager)],
        "cache allocators": sorted(cache.ATTN_TYPE_TO_ALLOCATOR),
        "logger filters": {name: [repr(f) for f in logging.getLogger(name).filters]
                           for name in ("", "torch", "torchao", "torch.utils._pytree", "transformers")},
        "logger levels": {name: logging.getLogger(name).level for name in ("", "torch", "torchao", "transformers")},
        "cache layer types": sorted(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING),
    }

before = snapshot()
import modeling_dint, torch
from modeling_dint import DintConfig, DintForCausalLM
model = DintForCausalLM(DintConfig.from_preset("tiny", vocab_size=64, bos_token_id=None, eos_token_id=None)).eval()
model.generate(torch.randint(0, 64, (1, 4)), max_new_tokens=2, do_sample=False)
after = snapshot()
print(json.dumps({"before": before, "after": after}))
"""


def test_importing_the_package_changes_nothing_but_the_registrations():
    """`import modeling_dint` (and a generate()) registers DINT with the Auto classes and its cache-layer type, and
    changes nothing else of transformers or torch: no continuous-batching class is replaced, no logger filtered."""
    pytest.importorskip("transformers.generation.continuous_batching.cache")
    result = subprocess.run([sys.executable, "-c", SIDE_EFFECTS], capture_output=True, text=True, timeout=300,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    snapshots = json.loads(result.stdout.strip().splitlines()[-1])
    before, after = snapshots["before"], snapshots["after"]
    assert after.pop("cache layer types") == sorted([*before.pop("cache layer types"), "dint_attention"])
    assert after == before
