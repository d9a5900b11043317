"""The Triton integral kernels compile for NVIDIA GPUs with Triton's own compiler, on a machine without a GPU.

Triton's interpreter (`tests/test_integral_triton_kernel.py` under `TRITON_INTERPRET=1`) checks what the kernels
compute, in numpy; it never runs Triton's compiler, so a kernel the interpreter runs may still fail to compile for a GPU
(a type the compiler infers differently, a construct it does not lower). Here every variant the package launches
(each combination of the kernels' compile-time flags, fp32, bf16 and fp16, head sizes 64 to 256, one chunk and
several) goes through Triton's
real pipeline down to a cubin for an Ampere (sm_80) and a Hopper (sm_90) GPU, with the `ptxas` Triton ships: a driver
that answers with the target and launches nothing stands in for CUDA's.

    python -m pytest tests/test_integral_triton_compile.py        # Triton installed, TRITON_INTERPRET unset
    python tests/test_integral_triton_compile.py 90               # each variant's registers on sm_90

Written for Triton 3.6 (the lent GPU machines') to 3.9: it sets `triton.runtime.driver`'s active driver and wraps
`JITFunction.run` (compile only: `warmup=True`), and fails loudly where a Triton release changes either. Skipped where
Triton is missing, under the interpreter, or where a GPU is present (the kernel tests compile for it there)."""

import collections
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import modeling_dint.integral_triton_kernel as triton_kernel
from modeling_dint.integral_cpu_kernel import DOCUMENT_START, ROW_VALID


pytestmark = pytest.mark.skipif(
    not triton_kernel.triton_available() or triton_kernel.interpreted() or torch.cuda.is_available(),
    reason="needs Triton without its interpreter (TRITON_INTERPRET unset) on a machine without a GPU",
)

DTYPES_AND_CHANNELS = (
    (torch.float32, 128), (torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64), (torch.bfloat16, 256),
)
KERNELS = {
    "_chunk_tails_kernel", "_chunk_scan_kernel", "_integral_forward_kernel", "_integral_backward_kernel",
}


class CompileOnlyDriver:
    """What `JITFunction.run` asks of the active driver before it compiles: a device, a stream and the target."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


def register_usage(cubin: bytes) -> str | None:
    """`cuobjdump -res-usage`'s line for the kernel (`REG:.. STACK:.. SHARED:..`), with the cuobjdump Triton ships."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", file.name], capture_output=True, text=True).stdout
    return next((line.strip() for line in usage.splitlines() if "REG:" in line), None)


def launch_every_variant() -> None:
    """`integral_forward` and `integral_backward` on CPU tensors (never read: nothing launches) for every variant:
    both head layouts (v1's head norm with its weight; v2's lambda per row), one chunk and several, with and without a
    carry (and every row's state), with and without the state's gradient, documents restarting, three dtypes, head
    sizes 64, 128 and 256."""
    batch_size, heads = 2, 3
    # head sizes 64, 128 and 256 take each tile shape (`CHUNK_ROWS` x `BLOCK_CHANNELS`) the launches choose
    for dtype, channels in DTYPES_AND_CHANNELS:
        for head_layout in ("v1", "v2"):
            for length in (1, 100):  # one chunk (a decoding step), several
                attention_output = torch.zeros(batch_size, length, 2 * heads, channels, dtype=dtype)
                if head_layout == "v2":
                    signal, noise = attention_output[:, :, 0::2], attention_output[:, :, 1::2]
                    lambda_ = torch.zeros(batch_size, length, heads, 1)
                else:
                    signal, noise = attention_output.chunk(2, dim=2)
                    lambda_ = torch.tensor(0.5)
                weight = torch.ones(channels) if head_layout == "v1" else None
                inverse_count = torch.ones(batch_size, length)
                row_flags = torch.full((batch_size, length), ROW_VALID, dtype=torch.uint8)
                row_flags[:, length // 2] |= DOCUMENT_START
                for carry in (None, torch.zeros(batch_size, heads, channels)):
                    output, _, _, inclusive, restarts = triton_kernel.integral_forward(
                        signal, noise, lambda_, inverse_count, row_flags, carry, weight, head_layout == "v1", 1e-5,
                        store_running=carry is not None,
                    )
                    for grad_last in (None, torch.zeros(batch_size, heads, channels)):
                        inputs = triton_kernel.IntegralInputs(
                            signal, noise, lambda_, inverse_count, row_flags, carry, inclusive, weight
                        )
                        triton_kernel.integral_backward(
                            torch.zeros_like(output), grad_last, inputs, restarts, head_layout == "v1", 1e-5,
                            torch.empty_like(signal), torch.empty_like(noise),
                        )


def compile_every_variant(capability: int, patch) -> list[dict]:
    """Compiles every variant for `sm_<capability>` (`patch(obj, name, value)` sets an attribute until the caller
    restores it); returns one record per launch: the kernel, the dtype, its compile-time arguments, the cubin."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled = []
    compile_and_launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = compile_and_launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append({
            "kernel": self.__name__,
            "dtype": str((args[0][0] if isinstance(args[0], tuple) else args[0]).dtype).removeprefix("torch."),
            "arch": kernel.metadata.target.arch,
            "options": {key: value for key, value in kwargs.items() if key.isupper() or key == "num_warps"},
            "cubin": kernel.asm["cubin"],
        })
        return kernel

    patch(driver, "_active", CompileOnlyDriver(capability))
    patch(JITFunction, "run", compile_only)
    for name in KERNELS:  # compiled kernels are cached per device index: a cache of this target's alone
        kernel = getattr(triton_kernel, name)
        patch(kernel, "device_caches", collections.defaultdict(kernel.create_binder))
    launch_every_variant()
    return compiled


# Triton 3.9 announces that its default for FP fusion changes in 3.10; the kernels take the default of the release
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset:UserWarning")
@pytest.mark.parametrize("capability", [80, 90], ids=["sm_80", "sm_90"])
def test_every_kernel_variant_compiles_for_the_gpu(capability, monkeypatch):
    compiled = compile_every_variant(capability, monkeypatch.setattr)
    assert {record["kernel"] for record in compiled} == KERNELS
    assert all(record["arch"] == capability for record in compiled)
    for name in KERNELS:  # each compile-time flag of each kernel compiled both ways
        options = [record["options"] for record in compiled if record["kernel"] == name]
        for flag in (flag for flag, value in options[0].items() if isinstance(value, bool)):
            assert {option[flag] for option in options} == {False, True}, (name, flag)
    forward_tiles = {(record["options"]["CHUNK_ROWS"], record["options"]["BLOCK_CHANNELS"])
                     for record in compiled if record["kernel"] == "_integral_forward_kernel"}
    assert forward_tiles == {(16, 64), (64, 64), (16, 128), (32, 128), (16, 256)}


def main(argv: list[str]) -> None:
    """Prints each distinct variant's registers and stack for `sm_<argv[0]>` (default 90)."""
    with pytest.MonkeyPatch.context() as patches:
        compiled = compile_every_variant(int(argv[0]) if argv else 90, patches.setattr)
    seen = set()
    for record in compiled:
        key = (record["kernel"], record["dtype"], tuple(sorted(record["options"].items())))
        if key not in seen:
            seen.add(key)
            options = " ".join(f"{name}={value}" for name, value in sorted(record["options"].items()))
            print(f"{record['kernel']:26s} {record['dtype']:8s} {register_usage(record['cubin'])}  {options}")


if __name__ == "__main__":
    main(sys.argv[1:])
