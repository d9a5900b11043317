"""The tensor-parallel plan of DINT (DintConfig.base_model_tp_plan), and the reference layout it must give.

q_proj's output holds H softmax maps, the H/2 signal maps then the H/2 noise maps; k_proj and v_proj hold the KV
heads, whose first half pairs with the signal maps (and holds V's first half) and second half with the noise maps
(V's second half). Llama's "colwise" cuts each output into contiguous blocks, so with 2 shards rank 0 would get every
signal map and rank 1 every noise map: no rank could form `A1 - lambda*A2 + lambda*G`. "packed_colwise"
(split_factor 2) cuts each half into N blocks and gives rank r block r of both halves: the signal maps of
differential heads [r*H/(2N), (r+1)*H/(2N)), their noise maps, their KV heads and both halves of their V. The local
module then has the same layout as a model with H/N heads, so the attention code runs unchanged. o_proj reads the
differential heads in order, 2*head_dim channels each: "rowwise" gives rank r exactly its own heads' channels.
Requires N to divide num_key_value_heads/2, and attention_bias=False (packed_colwise shards a 1-D bias contiguously).
"""

from modeling_dint.configuration_dint import V1_TP_PLAN, V2_TP_PLAN


DINT_TP_PLAN = V1_TP_PLAN  # the plan the package ships for v1 (one source of truth)
DINT_V2_TP_PLAN = V2_TP_PLAN  # and for v2: Llama's q/k/v "colwise", plus lambda_proj

LLAMA_TP_PLAN = {**DINT_TP_PLAN, **{f"layers.*.self_attn.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")}}


def shard_rows(num_rows: int, style: str, rank: int, world_size: int) -> list[int]:
    """Output rows of a linear layer that `style` ("colwise" or "packed_colwise" with split factor 2) gives `rank`."""
    if style == "colwise":
        block = num_rows // world_size
        return list(range(rank * block, (rank + 1) * block))
    half = num_rows // 2
    block = half // world_size
    return [offset + row for offset in (0, half) for row in range(rank * block, (rank + 1) * block)]


def differential_head_layout(num_attention_heads: int, num_key_value_heads: int) -> dict[int, dict[str, set[int]]]:
    """For each differential head j: the softmax maps (q heads) and KV heads it reads, in the unsharded model
    (DiffLlama's layout: signal map j, noise map j + H/2; query head h reads KV head h // (H / H_kv); V's two halves
    are KV heads k and k + H_kv/2 for k = the signal map's KV head)."""
    groups = num_attention_heads // num_key_value_heads
    layout = {}
    for head in range(num_attention_heads // 2):
        signal_kv, noise_kv = head // groups, (head + num_attention_heads // 2) // groups
        value_first_half = signal_kv % (num_key_value_heads // 2)
        layout[head] = {
            "query_heads": {head, head + num_attention_heads // 2},
            "key_heads": {signal_kv, noise_kv},
            "value_heads": {value_first_half, value_first_half + num_key_value_heads // 2},
        }
    return layout


def v2_differential_head_layout(num_attention_heads: int, num_key_value_heads: int) -> dict[int, dict[str, set[int]]]:
    """For each differential head j of a v2 model: its query heads (2j signal, 2j+1 noise), its KV head (query head h
    reads KV head h // (H / H_kv)), and its row of lambda_proj (j)."""
    groups = num_attention_heads // num_key_value_heads
    return {
        head: {"query_heads": {2 * head, 2 * head + 1}, "key_heads": {2 * head // groups},
               "value_heads": {2 * head // groups}, "lambda_rows": {head}}
        for head in range(num_attention_heads // 2)
    }
