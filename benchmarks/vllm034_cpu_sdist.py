"""Edits that let vLLM 0.34.0's released sdist build and run on this project's CPU machines.

Used by `make venv-vllm-034` (Makefile); never imported. vLLM 0.34 ships no x86 CPU wheel on the registry and
its x86 build assumes a GitHub-fetched oneDNN, a triton-cpu wheel from a GitHub release and a CPU-only torch.
Each edit below is an exact text replacement that must match once in a freshly unpacked sdist (the script stops
with the file and the text otherwise), so a different sdist is refused instead of half-patched:

  sdist <dir>   requirements without the unreachable pins; the x86 `_C` built without oneDNN (its int8/W8A8 and
                oneDNN-GEMM ops left out: vLLM's Python checks for them and falls back to torch's GEMM) and with
                the standalone (no-Triton) MRV2 runner's ops; gcc 12.2 accepted and its ICE avoided; x86 without
                triton-cpu allowed to use the standalone MRV2 runner; the sglang-derived AMX kernels, the Rust
                frontend and the two other x86 `_C` variants (not imported on an AVX-512-BF16 CPU) not built.
  torch <dir>   the venv's torch (a CUDA build from the registry) configured for a CPU-only extension build:
                its Caffe2Config's CUDA discovery off and an empty torch::cudart target in its place.
"""

import sys
from pathlib import Path

# (file, old, new): exact, once
SDIST_EDITS = [
    # torch 2.14.0+cpu is not on the registry (the venv's torch 2.14.1 is used); triton-cpu is a GitHub release
    # address; torchvision/torchaudio/torchcodec would pull a different torch and are not needed here
    ("requirements/cpu.txt",
     'torch==2.14.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x" or '
     'platform_machine == "aarch64"\n', ""),
    ("requirements/cpu.txt",
     'torch==2.14.0; platform_system == "Darwin" or platform_machine == "ppc64le" or platform_machine == "riscv64"\n',
     ""),
    ("requirements/cpu.txt", 'torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"\n', ""),
    ("requirements/cpu.txt", 'torchvision; platform_machine != "riscv64"\n', ""),
    ("requirements/cpu.txt",
     'torchcodec >= 0.14; platform_machine != "riscv64" and platform_machine != "ppc64le"\n', ""),
    ("requirements/cpu.txt",
     'triton @ https://github.com/triton-lang/triton-cpu/releases/download/v3.8.0/triton-3.8.0+cpu-cp311-cp311-'
     'manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl ; platform_machine == "x86_64" and python_version == "3.11"\n',
     ""),
    ("requirements/cpu.txt",
     'triton @ https://github.com/triton-lang/triton-cpu/releases/download/v3.8.0/triton-3.8.0+cpu-cp312-abi3-'
     'manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl ; platform_machine == "x86_64" and python_version >= "3.12"\n',
     ""),
    # Debian 12's gcc is 12.2.0; the kernels built here compile with it (the one ICE is fixed below)
    ("cmake/cpu_extension.cmake", "CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3))",
     "CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.2))"),
    # no oneDNN on x86: its source would come from GitHub (dnnl_helper.cpp needs oneDNN's private headers, so a
    # binary oneDNN from a registry does not do)
    ("cmake/cpu_extension.cmake", "if (ENABLE_X86_ISA OR (ASIMD_FOUND AND NOT APPLE_SILICON_FOUND) OR POWER9_FOUND",
     "if ((ASIMD_FOUND AND NOT APPLE_SILICON_FOUND) OR POWER9_FOUND"),
    ("cmake/cpu_extension.cmake",
     '        "csrc/cpu/cpu_isa.cpp"\n        "csrc/cpu/dnnl_kernels.cpp"\n        "csrc/cpu/mamba_cpu.cpp"\n',
     '        "csrc/cpu/cpu_isa.cpp"\n        "csrc/cpu/block_table.cpp"\n        "csrc/cpu/input_batch.cpp"\n'
     '        "csrc/cpu/mamba_cpu.cpp"\n'),
    ("cmake/cpu_extension.cmake", "    set(_C_LIBS numa dnnl_ext)\n", "    set(_C_LIBS numa)\n"),
    ("cmake/cpu_extension.cmake",
     '    target_compile_definitions(_C PRIVATE "-DCPU_CAPABILITY_AMXBF16")\n',
     '    target_compile_definitions(_C PRIVATE "-DCPU_CAPABILITY_AMXBF16" VLLM_STANDALONE_CPU_MRV2 VLLM_NO_ONEDNN)\n'),
    ("csrc/cpu/torch_bindings.cpp",
     "  // Quantization\n#if defined(__AVX512F__) || defined(__AVX2__) ||",
     "  // Quantization\n#if !defined(VLLM_NO_ONEDNN) && (defined(__AVX512F__) || defined(__AVX2__) ||"),
    ("csrc/cpu/torch_bindings.cpp",
     "    defined(__riscv_v) || defined(__s390x__)\n  // Helper function to release oneDNN handlers",
     "    defined(__riscv_v) || defined(__s390x__))\n  // Helper function to release oneDNN handlers"),
    # gcc 12.2 internal compiler error on a local constexpr inside a lambda-heavy kernel; static keeps the value
    ("csrc/cpu/sgl-kernels/flash_mla.cpp", "  constexpr int64_t kBLOCK_H_MAX = 16;\n  const int64_t BLOCK_H",
     "  static constexpr int64_t kBLOCK_H_MAX = 16;\n  const int64_t BLOCK_H"),
    # the sgl-kernels (AMX GEMM / MoE / MLA / quantised kernels from sglang) left out but for conv.cpp, whose
    # ops are registered outside their block: half of _C's build time on 2 cores, not used by the dense
    # fp32 / bf16 models run here (bf16 linear then goes to torch, as vLLM does without AMX)
    ("cmake/cpu_extension.cmake", "        SOURCES ${VLLM_EXT_SRC_AVX512} ${VLLM_EXT_SRC_SGL}\n",
     '        SOURCES ${VLLM_EXT_SRC_AVX512} "csrc/cpu/sgl-kernels/conv.cpp"\n'),
    ("csrc/cpu/torch_bindings.cpp", "#include <torch/all.h>\n#include \"ops.h\"",
     "#include <torch/all.h>\n#define VLLM_NO_SGL_KERNELS 1\n#include \"ops.h\""),
    ("csrc/cpu/torch_bindings.cpp",
     "  // sgl-kernels\n#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VNNI__)\n",
     "  // sgl-kernels\n#if !defined(VLLM_NO_SGL_KERNELS) && defined(__AVX512BF16__) && defined(__AVX512F__) && "
     "defined(__AVX512VNNI__)\n"),
    ("csrc/cpu/torch_bindings.cpp",
     "#if (defined(__AVX512BF16__) && defined(__AVX512F__) && \\\n"
     "     defined(__AVX512VNNI__)) ||                        \\\n    defined(__riscv)\n",
     "#if !defined(VLLM_NO_SGL_KERNELS) && ((defined(__AVX512BF16__) && defined(__AVX512F__) && \\\n"
     "     defined(__AVX512VNNI__)) || defined(__riscv))\n"),
    ("vllm/model_executor/layers/utils.py",
     "def check_cpu_sgl_kernel(n: int, k: int, dtype: torch.dtype) -> bool:\n",
     "def check_cpu_sgl_kernel(n: int, k: int, dtype: torch.dtype) -> bool:\n"
     "    if not hasattr(torch.ops._C, \"convert_weight_packed\"):\n        return False\n"),
    # x86 without triton-cpu: the standalone MRV2 runner instead of the refusal (its ops are in _C above)
    ("vllm/platforms/cpu.py",
     "        if cls.get_cpu_architecture() == CpuArchEnum.X86 and not HAS_TRITON:\n",
     "        if cls.get_cpu_architecture() == CpuArchEnum.X86 and not HAS_TRITON and False:\n"),
    ("vllm/platforms/cpu.py",
     "        return not HAS_TRITON and cls.get_cpu_architecture() != CpuArchEnum.X86\n",
     "        return True\n"),
    # only _C is imported on an AVX-512-BF16 CPU (CpuPlatform.import_kernels); the Rust frontend (an optional,
    # separate server binary) would fetch crates from outside the registries this project uses
    ("setup.py",
     '        ext_modules.append(CMakeExtension(name="vllm._C_AVX512"))\n'
     '        ext_modules.append(CMakeExtension(name="vllm._C_AVX2"))\n', ""),
    ("setup.py", "    rust_extensions=rust_extensions,\n", "    rust_extensions=[],\n"),
]

TORCH_EDITS = [
    ("share/cmake/Caffe2/Caffe2Config.cmake",
     "if(1)\n  # The file public/cuda.cmake exclusively uses CAFFE2_USE_*.",
     "if(NOT TARGET torch::cudart)\n  add_library(torch::cudart INTERFACE IMPORTED)\nendif()\n"
     "if(0)\n  # The file public/cuda.cmake exclusively uses CAFFE2_USE_*."),
]


def apply(root: Path, edits) -> None:
    for rel, old, new in edits:
        path = root / rel
        text = path.read_text()
        if text.count(old) != 1:
            sys.exit(f"{path}: expected exactly one {old[:70]!r}, found {text.count(old)}: not the released file")
        path.write_text(text.replace(old, new))


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("sdist", "torch"):
        sys.exit("usage: vllm034_cpu_sdist.py sdist <unpacked vllm-0.34.0> | torch <torch package dir>")
    apply(Path(sys.argv[2]), SDIST_EDITS if sys.argv[1] == "sdist" else TORCH_EDITS)


if __name__ == "__main__":
    main()
