"""Quick start: build a tiny DINT, generate a few tokens, save it in Hub format and reload it via the Auto classes.

    python examples/quickstart.py [--output_dir outputs/quickstart]
"""

import argparse
import os

import torch

from modeling_dint import DintConfig, DintForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer


TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tokenizer")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/quickstart")
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = DintConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    model = DintForCausalLM(config).eval()
    print(f"Built a DINT with {model.num_parameters():,} parameters (integral={config.integral!r}, "
          f"{config.num_hidden_layers} layers, {config.num_attention_heads // 2} differential heads).")

    inputs = tokenizer("To be, or not to be", return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    print("Generated (untrained, so gibberish):", repr(tokenizer.decode(generated[0], skip_special_tokens=True)))

    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(args.output_dir).eval()
    regenerated = reloaded.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(generated, regenerated), "the reloaded model generates other tokens"
    print(f"Saved to {args.output_dir} (safetensors + remote code) and reloaded as {type(reloaded).__name__}: "
          "same tokens.")


if __name__ == "__main__":
    main()
