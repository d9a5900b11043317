"""Tensor-parallel worker, launched by tests/test_tensor_parallel.py as
`torchrun --nproc_per_node N tests/tp_worker.py CHECKPOINT INPUTS OUTPUT PLAN`.

Loads the DINT checkpoint with its own tensor-parallel plan (`DistributedConfig(tp_plan="auto")`, gloo on CPU): `PLAN`
"dint" keeps the config's `base_model_tp_plan` (v1's or v2's), "llama" replaces it with Llama's; runs one forward and a
short greedy generation, and rank 0 saves the logits and tokens.
"""

import os
import sys

import torch
import torch.distributed as dist

from modeling_dint import DintConfig, DintForCausalLM
from modeling_dint.integrations.release_bridges import tensor_parallel_arguments


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_plan import LLAMA_TP_PLAN  # noqa: E402


def main():
    checkpoint, inputs_path, output_path, plan_name = sys.argv[1:5]
    torch.set_num_threads(1)
    if plan_name == "llama":  # shows why Llama's plan is wrong for v1 (in this worker process only)
        DintConfig.base_model_tp_plan = LLAMA_TP_PLAN
    model = DintForCausalLM.from_pretrained(checkpoint, **tensor_parallel_arguments(), dtype=torch.float32).eval()
    inputs = torch.load(inputs_path)
    q_proj = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        logits = model(inputs["input_ids"]).logits
        tokens = model.generate(inputs["input_ids"], max_new_tokens=inputs["new_tokens"], do_sample=False)
    if dist.get_rank() == 0:
        torch.save(
            {
                "logits": logits,
                "tokens": tokens,
                "world_size": dist.get_world_size(),
                "q_proj_weight_type": type(q_proj.weight).__name__,
                "q_proj_local_rows": q_proj.weight.to_local().shape[0] if hasattr(q_proj.weight, "to_local") else None,
            },
            output_path,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
