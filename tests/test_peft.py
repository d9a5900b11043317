"""PEFT LoRA on DINT's attention and MLP projections (the module names are Llama's): it trains, merges into the base
weights with the same logits, and saves / reloads with the same logits."""

import peft
import pytest
import torch
from dint_testing import LAYOUTS, tiny_model


LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_config():
    return peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGET_MODULES, task_type="CAUSAL_LM"
    )


def _repeating_batch(vocab_size=128, seed=0):
    """Rows that repeat a short random pattern: easy to learn, so a few LoRA steps lower the loss clearly."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randint(2, vocab_size, (4, 6), generator=generator)
    return patterns.repeat(1, 6)  # [4, 36]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_trains_merges_saves_and_reloads(tmp_path, layout):
    base = tiny_model(**layout)
    lora_model = peft.get_peft_model(base, _lora_config())

    # Every projection of every layer got an adapter; only the adapters train.
    wrapped = {name.rsplit(".", 1)[-1] for name, module in lora_model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == set(LORA_TARGET_MODULES)
    trainable = [name for name, parameter in lora_model.named_parameters() if parameter.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert len(trainable) == 2 * len(LORA_TARGET_MODULES) * base.config.num_hidden_layers

    input_ids = _repeating_batch()
    optimizer = torch.optim.AdamW([p for p in lora_model.parameters() if p.requires_grad], lr=1e-2)
    lora_model.train()
    losses = []
    for _ in range(30):
        loss = lora_model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    lora_model.eval()

    probe = _repeating_batch(seed=1)
    with torch.no_grad():
        adapted_logits = lora_model(input_ids=probe).logits
        with lora_model.disable_adapter():
            base_logits = lora_model(input_ids=probe).logits
    assert (adapted_logits - base_logits).abs().max() > 1e-2  # the adapters changed the model

    # Save and reload the adapter onto a fresh copy of the same base model.
    lora_model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(tiny_model(**layout), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=probe).logits, adapted_logits, rtol=0, atol=1e-5)

    # Merge: a plain DintForCausalLM with the same logits, which saves and reloads as one.
    merged = lora_model.merge_and_unload()
    assert type(merged).__name__ == "DintForCausalLM"
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=probe).logits, adapted_logits, rtol=0, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    merged_reloaded = type(merged).from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged_reloaded(input_ids=probe).logits, adapted_logits, rtol=0, atol=1e-5)
