"""verl's actor log-prob pass with and without replay (mask_replay.integrations.verl), in one run, on the CPU.

    make venv-verl
    MASK_REPLAY_EXTENSION=$(ls build-verl/mask_replay/_C*.so) .venv-verl/bin/python benchmarks/bench_verl_logprobs.py

verl 0.9.1's own FSDPEngineWithLMHead.prepare_model_inputs + prepare_model_outputs (rmpad layout; the
engine built without FSDP, as in tests/integrations/verl/verl_helpers.engine) on one micro-batch of
--samples samples (prompt --prompt, response --response tokens), logits from a small LM (embedding d=256,
head [V, d]), V=--vocab, temperature 0.7; supports of mean size ~8 (a heavy-tailed size per row, the
response token included). Timed: the forward (model + log-probs) and forward + backward of the
response log-prob sum; replay off (verl unchanged) and on take turns within each run (medians of --runs
runs after one warm-up round).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from verl import DataProto  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from mask_replay.integrations.verl import trainer  # noqa: E402
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY  # noqa: E402
from tests.integrations.verl.verl_helpers import engine  # noqa: E402


class LM(torch.nn.Module):
    def __init__(self, vocab: int, d: int = 256):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, **_):
        return type("Out", (), {"logits": self.head(torch.tanh(self.emb(input_ids)))})()


def batch(samples: int, prompt: int, response: int, vocab: int):
    g = np.random.default_rng(0)
    prompts = torch.from_numpy(g.integers(0, vocab, (samples, prompt)))
    responses = torch.from_numpy(g.integers(0, vocab, (samples, response)))
    attention = torch.ones(samples, prompt + response, dtype=torch.long)
    supports = []
    for i in range(samples):
        sizes = np.minimum(g.geometric(1 / 8, response), 512)
        rows = [np.unique(np.append(g.integers(0, vocab, k - 1), responses[i, j].item())) for j, k in enumerate(sizes)]
        supports.append({"token_ids": np.concatenate(rows).astype(np.int32),
                         "offsets": np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)})
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                 "attention_mask": attention, "position_ids": attention.cumsum(1) - 1,
                 "response_mask": attention[:, prompt:]},
        non_tensors={SUPPORT_KEY: np.array(supports, dtype=object)})
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, temperature=0.7, use_remove_padding=True, calculate_entropy=False,
                         use_fused_kernels=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=samples)
    return prepare_micro_batches(td)[0][0]


def interleaved_ms(fns: dict, runs: int) -> dict:
    """Median ms of each fn, the fns taking turns within every run (a loaded, shared machine drifts:
    interleaving gives each path the same share of the drift); one warm-up round first."""
    times = {k: [] for k in fns}
    for r in range(runs + 1):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def arguments() -> argparse.Namespace:
    """The micro-batch's shape and the number of runs (shared with bench_verl_megatron_logprobs.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=224)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=5)
    return ap.parse_args()


def main() -> None:
    args = arguments()
    torch.manual_seed(0)
    mb, e, model = batch(args.samples, args.prompt, args.response, args.vocab), engine(), LM(args.vocab)

    def forward(on: bool):
        (trainer.install if on else trainer.uninstall)()
        with torch.no_grad():
            inputs, out_args = e.prepare_model_inputs(mb)
            e.prepare_model_outputs(model(**inputs), out_args, mb, None)

    def forward_backward(on: bool):
        (trainer.install if on else trainer.uninstall)()
        model.zero_grad()
        inputs, out_args = e.prepare_model_inputs(mb)
        out = e.prepare_model_outputs(model(**inputs), out_args, mb, None)["log_probs"]
        no_padding_2_padding(out, mb).sum().backward()

    tokens = args.samples * (args.prompt + args.response)
    print(f"{args.samples} samples x {args.prompt + args.response} tokens = {tokens} rows, V={args.vocab}, "
          f"threads={torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, medians of {args.runs} "
          "interleaved runs")
    ms = interleaved_ms({"forward off": lambda: forward(False), "forward on": lambda: forward(True),
                         "fwd+bwd off": lambda: forward_backward(False), "fwd+bwd on": lambda: forward_backward(True)},
                        args.runs)
    trainer.uninstall()
    for what in ("forward", "fwd+bwd"):
        off, on = ms[f"{what} off"], ms[f"{what} on"]
        print(f"{what:8s} replay off (verl) {off:8.1f} ms   replay on {on:8.1f} ms   on/off {on / off:5.2f}")


if __name__ == "__main__":
    main()
