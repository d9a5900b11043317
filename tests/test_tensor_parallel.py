"""Tensor parallelism (issue 10): a plan whose shards keep each signal map with its noise map, its KV heads and both
halves of its V (tests/tp_plan.py), checked as a layout and, in a slow test, with 2 CPU processes (torchrun, gloo)
loading the model with `tp_plan="auto"`: logits and greedy tokens equal the single-process model's."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from dint_testing import tiny_model
from tp_plan import (
    DINT_TP_PLAN,
    DINT_V2_TP_PLAN,
    LLAMA_TP_PLAN,
    differential_head_layout,
    shard_rows,
    v2_differential_head_layout,
)


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 4, 8


def heads_of_rows(rows, head_dim):
    return {row // head_dim for row in rows}


def rank_of_each_differential_head(plan, world_size):
    """For each differential head, the set of ranks holding its query maps, its key heads and its value heads."""
    layout = differential_head_layout(NUM_HEADS, NUM_KV_HEADS)
    styles = {name: plan[f"layers.*.self_attn.{name}"] for name in ("q_proj", "k_proj", "v_proj")}
    heads_on_rank = {
        (name, rank): heads_of_rows(shard_rows(width * HEAD_DIM, styles[name], rank, world_size), HEAD_DIM)
        for name, width in (("q_proj", NUM_HEADS), ("k_proj", NUM_KV_HEADS), ("v_proj", NUM_KV_HEADS))
        for rank in range(world_size)
    }
    ranks = {}
    for head, needs in layout.items():
        ranks[head] = {
            rank
            for rank in range(world_size)
            for name, key in (("q_proj", "query_heads"), ("k_proj", "key_heads"), ("v_proj", "value_heads"))
            if needs[key] & heads_on_rank[(name, rank)]
        }
    return ranks


def test_dint_plan_keeps_each_differential_head_on_one_shard():
    ranks = rank_of_each_differential_head(DINT_TP_PLAN, world_size=2)
    assert all(len(owners) == 1 for owners in ranks.values()), ranks
    # o_proj "rowwise" gives rank r the contiguous input block r: the differential heads r*H/4 .. (r+1)*H/4 - 1.
    assert [ranks[head].pop() for head in range(NUM_HEADS // 2)] == [0, 0, 1, 1]


def test_llama_plan_splits_signal_and_noise_maps_across_shards():
    ranks = rank_of_each_differential_head(LLAMA_TP_PLAN, world_size=2)
    assert all(len(owners) == 2 for owners in ranks.values()), ranks


def test_v2_plan_keeps_each_differential_head_its_kv_head_and_lambda_row_on_one_shard():
    """v2 (query heads 2j, 2j+1 of one KV head): Llama's colwise q/k/v and a colwise lambda_proj keep each differential
    head whole on one rank, and o_proj's rowwise input block r is rank r's heads, in order."""
    num_heads, num_kv_heads, world_size = 8, 2, 2
    plan = {name: DINT_V2_TP_PLAN[f"layers.*.self_attn.{name}"] for name in ("q_proj", "k_proj", "v_proj", "lambda_proj")}
    widths = {"q_proj": (num_heads, HEAD_DIM), "k_proj": (num_kv_heads, HEAD_DIM), "v_proj": (num_kv_heads, HEAD_DIM),
              "lambda_proj": (num_heads // 2, 1)}
    keys = {"q_proj": "query_heads", "k_proj": "key_heads", "v_proj": "value_heads", "lambda_proj": "lambda_rows"}
    owners = {}
    for head, needs in v2_differential_head_layout(num_heads, num_kv_heads).items():
        owners[head] = {
            rank
            for rank in range(world_size)
            for name, (units, width) in widths.items()
            if needs[keys[name]] & heads_of_rows(shard_rows(units * width, plan[name], rank, world_size), width)
        }
    assert all(len(ranks) == 1 for ranks in owners.values()), owners
    assert [owners[head].pop() for head in range(num_heads // 2)] == [0, 0, 1, 1]  # o_proj rowwise: blocks in order
    assert DINT_V2_TP_PLAN["layers.*.self_attn.o_proj"] == "rowwise"


def test_tensor_parallel_size_rule_of_each_layout():
    from modeling_dint import DintConfig

    DintConfig(num_attention_heads=8, num_key_value_heads=4, hidden_size=64).check_tensor_parallel_size(2)
    with pytest.raises(ValueError, match="must divide num_key_value_heads / 2 = 2"):
        DintConfig(num_attention_heads=8, num_key_value_heads=4, hidden_size=64).check_tensor_parallel_size(4)
    v2 = DintConfig(num_attention_heads=8, num_key_value_heads=4, hidden_size=64, differential_attention="v2",
                    attention_bias=True)
    v2.check_tensor_parallel_size(4)  # v2's colwise shards a bias with its rows
    with pytest.raises(ValueError, match="must divide num_key_value_heads = 4"):
        v2.check_tensor_parallel_size(3)


def test_plan_names_existing_linear_modules():
    model = tiny_model(num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS, hidden_size=64)
    module_names = {name for name, _ in model.model.named_modules()}
    for pattern in DINT_TP_PLAN:
        assert pattern.replace("*", "0") in module_names, pattern
    model = tiny_model(num_attention_heads=NUM_HEADS, num_key_value_heads=2, differential_attention="v2")
    module_names = {name for name, _ in model.model.named_modules()}
    assert model.config.base_model_tp_plan == DINT_V2_TP_PLAN
    for pattern in DINT_V2_TP_PLAN:
        assert pattern.replace("*", "0") in module_names, pattern


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_process_forward(tmp_path, plan_name):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not installed")
    output_path = tmp_path / f"{plan_name}.pt"
    command = [
        torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()),
        os.path.join(TESTS_DIR, "tp_worker.py"),
        str(tmp_path / "checkpoint"), str(tmp_path / "inputs.pt"), str(output_path), plan_name,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(output_path)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("layout", [pytest.param({"num_key_value_heads": NUM_KV_HEADS}, id="v1"),
                                    pytest.param({"num_key_value_heads": 2, "differential_attention": "v2"}, id="v2")])
def test_two_cpu_processes_with_tp_plan_auto_match_the_single_process_model(tmp_path, layout):
    model = tiny_model(num_attention_heads=NUM_HEADS, hidden_size=64, **layout)
    model.save_pretrained(tmp_path / "checkpoint")
    input_ids = torch.randint(2, 128, (2, 12))
    torch.save({"input_ids": input_ids, "new_tokens": 6}, tmp_path / "inputs.pt")
    with torch.no_grad():
        expected_logits = model(input_ids).logits
        expected_tokens = model.generate(input_ids, max_new_tokens=6, do_sample=False, use_cache=False)

    sharded = run_two_process_forward(tmp_path, "dint")  # the layout's own plan
    assert sharded["world_size"] == 2 and sharded["q_proj_weight_type"] == "DTensor"
    assert sharded["q_proj_local_rows"] == NUM_HEADS * HEAD_DIM // 2  # really sharded
    torch.testing.assert_close(sharded["logits"], expected_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(sharded["tokens"], expected_tokens)

    if model.config.differential_attention == "v1":
        # Llama's plan runs but computes something else: each rank pairs signal maps with other signal maps.
        llama_sharded = run_two_process_forward(tmp_path, "llama")
        assert (llama_sharded["logits"] - expected_logits).abs().max() > 1e-2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "slow or not slow", "-v"]))
