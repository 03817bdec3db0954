"""verl's actor path with replay off and on, on a real model (SmolLM2-135M, FSDP2, one gloo rank, CPU), one run.

    MASK_REPLAY_EXTENSION=$(ls build-verl/mask_replay/_C*.so) .venv-verl/bin/python benchmarks/bench_verl_actor.py \\
        --rollout OUT/rollout_off_0.npz          # a rollout of benchmarks/experiment_verl.py (16 completions)

The same batch (verl's agent-loop post-processing of the recorded rollout, supports included) through verl's
own RayPPOTrainer._compute_old_log_prob (forward) and _update_actor (forward + backward + optimizer step at
lr 0, so the weights stay put), the two settings taking turns within each run (mask_replay's trainer patches
installed / removed in between); medians of --runs runs after one warm-up round. The stand-ins are those of
benchmarks/experiment_verl.py (no Ray, a CPU platform for verl, sdpa attention).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import experiment_verl as ev  # noqa: E402  (sets verl's CPU platform before verl's engine modules load)
import torch  # noqa: E402
from verl.trainer.ppo.core_algos import AdvantageEstimator  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402

from mask_replay.integrations.verl import trainer as verl_replay  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollout", required=True, help="an .npz written by benchmarks/experiment_verl_rollout.py")
    ap.add_argument("--model", default=os.environ.get("MASK_REPLAY_MODEL_DIR", "/tmp/mask-replay-smollm2"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--group", type=int, default=4, help="completions per prompt in the rollout file")
    ap.add_argument("--micro-batch", type=int, default=8)
    a = ap.parse_args()
    if os.environ.get("MASK_REPLAY_VERL", "") not in ("", "0"):
        sys.exit("bench_verl_actor: leave MASK_REPLAY_VERL unset (the benchmark installs and removes replay itself)")
    data = np.load(a.rollout, allow_pickle=True)
    data = {k: data[k] for k in data.files}
    n = len(data["reward"])
    args = SimpleNamespace(model=a.model, prompts=n // a.group, group=a.group, micro_batch=a.micro_batch, lr=0.0,
                           temperature=float(data["temperature"]), top_p=float(data["top_p"]), steps=1,
                           max_new_tokens=max(len(r) for r in data["response_ids"]))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=["cpu"])(
        FSDPEngineWithLMHead)
    cfg = ev.verl_config(args)
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    driver = SimpleNamespace(config=cfg, actor_rollout_wg=worker, distillation_config=None)
    batch = ev.agent_loop_batch(cfg, worker.actor.model_config.tokenizer, data)
    old, _ = RayPPOTrainer._compute_old_log_prob(driver, batch)
    full = batch.union(old)
    full.batch["token_level_rewards"] = full.batch["rm_scores"]
    full = compute_advantage(full, adv_estimator=AdvantageEstimator.GRPO, num_repeat=a.group, config=cfg.algorithm)

    def log_prob(on: bool):
        (verl_replay.install if on else verl_replay.uninstall)()
        RayPPOTrainer._compute_old_log_prob(driver, batch)

    def update(on: bool):
        (verl_replay.install if on else verl_replay.uninstall)()
        RayPPOTrainer._update_actor(driver, full)

    fns = {"compute_log_prob off": lambda: log_prob(False), "compute_log_prob on": lambda: log_prob(True),
           "update_actor off": lambda: update(False), "update_actor on": lambda: update(True)}
    times = {k: [] for k in fns}
    for r in range(a.runs + 1):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[k].append(time.perf_counter() - t0)
    verl_replay.uninstall()
    tokens = int(batch.batch["response_mask"].sum())
    print(f"{n} samples, {tokens} response tokens, micro-batch {a.micro_batch}, threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}, medians of {a.runs} interleaved runs")
    for what in ("compute_log_prob", "update_actor"):
        off, on = statistics.median(times[f"{what} off"]), statistics.median(times[f"{what} on"])
        spread = {s: f"{min(times[f'{what} {s}']):.2f}..{max(times[f'{what} {s}']):.2f}" for s in ("off", "on")}
        print(f"{what:17s} off {off:7.2f} s ({spread['off']})   on {on:7.2f} s ({spread['on']})   "
              f"on/off {on / off:5.2f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
