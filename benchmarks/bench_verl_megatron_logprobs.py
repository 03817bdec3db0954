"""verl's Megatron log-prob pass with and without replay (mask_replay.integrations.verl.megatron_engine),
tensor parallelism 2 on two CPU gloo ranks, in one run.

    make venv-verl
    MASK_REPLAY_EXTENSION=$(ls build-verl/mask_replay/_C*.so) .venv-verl/bin/python -m torch.distributed.run \
        --standalone --nproc-per-node=2 benchmarks/bench_verl_megatron_logprobs.py

verl 0.9.1's own MegatronEngineWithLMHead.forward_step (THD layout, its forward function, logits
processor, megatron-core 0.16.1's vocab_parallel_cross_entropy) and postprocess_micro_batch_func, with
the engine built as in tests/integrations/verl/verl_megatron_worker.py, on one micro-batch (the FSDP
benchmark's: 8 samples x 256 tokens, supports of mean size ~8), logits from a small column-parallel LM
(embedding d=256, each rank a [V / 2, d] head), V=--vocab, temperature 0.7. Timed on rank 0: forward
(no grad) and forward + backward of the response log-prob sum, replay off (verl unchanged) and on
taking turns within each run, medians of --runs runs after one warm-up round.
"""
from __future__ import annotations

import os
import sys
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.core import parallel_state as mpu  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.megatron import transformer_impl  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from benchmarks.bench_verl_logprobs import arguments, batch, interleaved_ms  # noqa: E402
from mask_replay.integrations.verl import megatron_engine, trainer  # noqa: E402
from tests.integrations.verl.verl_megatron_worker import engine  # noqa: E402


class ColumnParallelLM(torch.nn.Module):
    """This rank's columns of head(tanh(emb(token)))."""

    def __init__(self, vocab: int, rank: int, tp: int, d: int = 256):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(vocab, d, generator=g) * 0.1)
        head = torch.randn(vocab, d, generator=g) * 0.1
        self.head = torch.nn.Parameter(head[rank * vocab // tp:(rank + 1) * vocab // tp].clone())
        self.pre_process = self.post_process = True
        self.config = SimpleNamespace(fp8=None)

    def forward(self, input_ids, **_):
        return torch.tanh(self.emb[input_ids]) @ self.head.T


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = mpu.get_tensor_model_parallel_rank()
    transformer_impl.get_device_id = lambda: "cpu"  # verl's CUDA platform getter, as in the test worker
    mb = batch(args.samples, args.prompt, args.response, args.vocab)
    tu.assign_non_tensor(mb, num_micro_batch=1)
    e, model = engine("thd"), ColumnParallelLM(args.vocab, rank, 2)
    e.model_config.hf_config.vocab_size = args.vocab

    def step(on: bool, backward: bool):
        (megatron_engine.install if on else megatron_engine.uninstall)()
        model.zero_grad()

        def loss(model_output, data, dp_group):
            return no_padding_2_padding(model_output["log_probs"], data).sum(), {}

        with torch.set_grad_enabled(backward):
            out, post = e.forward_step(iter([mb]), model, None, partial(e.postprocess_micro_batch_func,
                                                                         forward_only=not backward, loss_function=loss))
            scaled, _ = post(out)
        if backward:
            scaled.backward()

    tokens = args.samples * (args.prompt + args.response)
    ms = interleaved_ms({"forward off": lambda: step(False, False), "forward on": lambda: step(True, False),
                         "fwd+bwd off": lambda: step(False, True), "fwd+bwd on": lambda: step(True, True)}, args.runs)
    megatron_engine.uninstall()
    trainer.uninstall()
    if rank == 0:
        print(f"TP=2 (gloo), {args.samples} samples x {args.prompt + args.response} tokens = {tokens} rows, "
              f"V={args.vocab}, threads={torch.get_num_threads()} per rank, load average {os.getloadavg()[0]:.1f}, "
              f"medians of {args.runs} interleaved runs (rank 0)")
        for what in ("forward", "fwd+bwd"):
            off, on = ms[f"{what} off"], ms[f"{what} on"]
            print(f"{what:8s} replay off (verl) {off:8.1f} ms   replay on {on:8.1f} ms   on/off {on / off:5.2f}")
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
