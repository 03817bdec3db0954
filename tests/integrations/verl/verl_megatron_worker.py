"""Replay in verl's Megatron engine on CPU ranks (gloo), run by test_megatron_engine.py:

    python -m torch.distributed.run --standalone --nproc-per-node=2 verl_megatron_worker.py tp
    python -m torch.distributed.run --standalone --nproc-per-node=4 verl_megatron_worker.py tp-cp

tp: tensor parallelism 2, in each of verl's three layouts: thd (verl's packing, each sample padded to a
multiple of TP), thd-bucket (plus the static bucket pad on the last sample), bshd (use_remove_padding=
False), and a bfloat16 pass, the bad-input errors. tp-cp: TP = 2 x context parallelism 2 (verl's zigzag chunks), THD
with and without the bucket pad. megatron-core's parallel_state is initialised for real (gloo), so
verl's preprocess_thd_engine / _bshd_engine, postprocess_*_engine and megatron-core's
vocab_parallel_cross_entropy all run with their real process groups. verl runs from
MegatronEngineWithLMHead.forward_step (its forward function, logits processor, log-probs) through
postprocess_micro_batch_func (a loss function, metrics) and no_padding_2_padding. No process-group
getter is stood in for. Stand-ins: the engine is built without __init__ (no mbridge, no model load)
with only the attributes those methods read; verl's device getter transformer_impl.get_device_id
returns "cpu" (verl's CUDA platform has no CPU device id); the model is a toy column-parallel head:
rank r holds vocabulary columns [r * 22, (r + 1) * 22) of logits(token, position) = E[token] +
P[position in its sequence], over a vocabulary padded from 40 (hf_config.vocab_size) to 44 columns,
as Megatron pads it; under CP the toy places each row at the position RoPE would give it (verl passes
no position ids outside MTP).
Megatron's own schedule (forward_backward_func) and its GPTModel are not run.

Checked on every rank, per micro-batch: the response log-probs against the float64 reference over the
recorded supports (the full padded softmax where nothing or the whole vocabulary is recorded), this
TP rank's parameter-gradient columns (summed over the CP ranks) against the reference's, the replay
metrics (their values without CP: with it each rank's cover its own rows), bit-identity with replay off
at every row not replayed.
"""
import os
import sys
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from megatron.core import parallel_state as mpu  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.megatron import transformer_impl  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

from mask_replay.errors import InputError, OutsideSupportError  # noqa: E402
from mask_replay.integrations.verl import megatron_engine, trainer  # noqa: E402
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY  # noqa: E402
from tests.helpers import end_distributed_worker  # noqa: E402
from tests.integrations.verl import verl_helpers as h  # noqa: E402

T = 0.8
TP, PADDED = 2, 44  # h.V = 40 real ids, padded to 44 columns: 22 per rank
PROMPTS, RESPONSES = [3, 1, 4, 2, 5], [5, 2, 6, 1, 4]


class ToyColumnParallelLM(torch.nn.Module):
    """This rank's vocabulary columns of logits = E[token] + P[position within its sequence]."""

    def __init__(self, seed: int, rank: int, dtype=torch.float32, tp: int = TP):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.E_full = torch.randn(h.V, PADDED, generator=g) * 2
        self.P_full = torch.randn(h.MAX_POS, PADDED, generator=g)
        cols = slice(rank * PADDED // tp, (rank + 1) * PADDED // tp)
        self.cols = cols
        self.E = torch.nn.Parameter(self.E_full[:, cols].to(dtype))
        self.P = torch.nn.Parameter(self.P_full[:, cols].to(dtype))
        self.pre_process = self.post_process = True
        self.config = SimpleNamespace(fp8=None)

    def forward(self, input_ids, attention_mask=None, position_ids=None, packed_seq_params=None, **_):
        cp = mpu.get_context_parallel_world_size()
        if packed_seq_params is not None and cp > 1:  # THD under CP: this rank's two chunks of each sample
            position_ids = self.zigzag_positions(packed_seq_params.cu_seqlens_q_padded.tolist(), input_ids.shape[1],
                                                 cp, mpu.get_context_parallel_rank())
        elif packed_seq_params is not None:  # THD: [1, S]; the position within each padded sample
            cu = packed_seq_params.cu_seqlens_q_padded.to(torch.int64)
            at = torch.arange(input_ids.shape[1])
            position_ids = (at - cu[torch.searchsorted(cu[1:], at, right=True)])[None]
        return self.E[input_ids] + self.P[position_ids.clamp(max=h.MAX_POS - 1)]


    @staticmethod
    def zigzag_positions(cu: list, local: int, cp: int, r: int) -> torch.Tensor:
        """Positions of this CP rank's rows: of each sample (padded length L), the chunks [h * r, h * (r + 1))
        and [L - h * (r + 1), L - h * r), h = L / (2 cp), where RoPE would place them."""
        pos = torch.zeros(local, dtype=torch.long)
        for a, b in zip(cu[:-1], cu[1:]):
            start, half = a // cp, (b - a) // cp // 2
            pos[start:start + half] = torch.arange(half * r, half * (r + 1))
            pos[start + half:start + 2 * half] = torch.arange(b - a - half * (r + 1), b - a - half * r)
        return pos[None]


def engine(layout: str) -> transformer_impl.MegatronEngineWithLMHead:
    e = transformer_impl.MegatronEngineWithLMHead.__new__(transformer_impl.MegatronEngineWithLMHead)
    e.engine_config = SimpleNamespace(use_fused_kernels=False, use_remove_padding=layout != "bshd",
                                      pad_to_length=layout == "thd-bucket", pad_to_length_bucket=16,
                                      dynamic_context_parallel=False, context_parallel_size=1,
                                      entropy_from_logits_with_chunking=False)
    e.enable_routing_replay = False
    e.model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=["ToyForCausalLM"], vocab_size=h.V),
                                     mtp=SimpleNamespace(enable=False, enable_train=False),
                                     tokenizer=SimpleNamespace(pad_token_id=0))
    e.tf_config = SimpleNamespace(calculate_per_token_loss=False)
    return e


def run(e, model, mb, weights):
    """verl's forward_step and postprocess_micro_batch_func with a loss sum(weights * response log-probs);
    returns the response log-probs [B, R] (with their graph) and the micro-batch's metrics, after backward."""
    seen = []

    def loss_function(model_output, data, dp_group):
        lp = no_padding_2_padding(model_output["log_probs"], data)
        seen.append(lp)
        return (weights * lp).sum(), {}

    output, post = e.forward_step(iter([mb]), model, logits_processor_func=None,
                                  postprocess_micro_batch_func=partial(e.postprocess_micro_batch_func,
                                                                       forward_only=False, loss_function=loss_function))
    scaled_loss, out = post(output)
    model.zero_grad()
    scaled_loss.backward()
    return seen[0], out["metrics"]


def reference(model, mb, replay: bool = True):
    """float64 response log-probs [B, R] token by token, the mean kept mass and mean |K| over the
    replayed rows; a row not replayed is over all PADDED columns (verl's own softmax). For a bfloat16
    model, from the bfloat16 logits verl forms (E + P, then / T, each rounded to bfloat16), no gradients."""
    E, P = model.E_full.double().requires_grad_(), model.P_full.double().requires_grad_()
    bf16 = model.E.dtype == torch.bfloat16
    ids, cu = mb["input_ids"].values(), mb["input_ids"].offsets()
    lengths = mb["attention_mask"][:, mb["prompts"].shape[1]:].sum(1)
    out = [[torch.zeros((), dtype=torch.float64)] * mb["responses"].shape[1] for _ in range(len(lengths))]
    kept, sizes = [], []
    for i, s in enumerate(tu.get(mb, SUPPORT_KEY)):
        start = int(cu[i + 1]) - int(lengths[i])
        for j in range(int(lengths[i])):
            row = torch.as_tensor(s["token_ids"][s["offsets"][j]:s["offsets"][j + 1]] if s is not None else [],
                                  dtype=torch.long)
            t = start + j - 1 - int(cu[i])  # the predicting token's position within its sequence
            if bf16:
                x = ((model.E_full.bfloat16()[ids[start + j - 1]] + model.P_full.bfloat16()[t])
                     / torch.tensor(T).bfloat16()).double()
            else:
                x = (E[ids[start + j - 1]] + P[t]) / T
            y = int(ids[start + j])
            if replay and 0 < len(row) < h.V:
                out[i][j] = x[y] - torch.logsumexp(x[row], 0)
                kept.append(float(torch.exp(torch.logsumexp(x[row], 0) - torch.logsumexp(x, 0))))
                sizes.append(len(row))
            else:
                out[i][j] = x[y] - torch.logsumexp(x, 0)
    lp = torch.stack([torch.stack(r) for r in out])
    return lp, E, P, (np.mean(kept), np.mean(sizes)) if kept else None


def check_micro_batch(e, model, mb, rank):
    mask = mb["attention_mask"][:, mb["prompts"].shape[1]:].bool()
    w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * mask
    lp, metrics = run(e, model, mb, w)
    grads = [model.E.grad.clone(), model.P.grad.clone()]
    cp = mpu.get_context_parallel_world_size()
    for g in grads:  # each CP rank's backward reaches only its own rows (verl gathers the others detached);
        dist.all_reduce(g, group=mpu.get_context_parallel_group())  # Megatron's DP x CP all-reduce sums them
    ref, E, P, stats = reference(model, mb)
    (w.double() * ref).sum().backward()
    torch.testing.assert_close(lp.detach().double() * mask, ref.detach() * mask, atol=2e-6, rtol=0)
    for g, r in zip(grads, [E.grad[:, model.cols], P.grad[:, model.cols]]):
        torch.testing.assert_close(g.double(), r, atol=4e-6, rtol=0)
    assert (ref - reference(model, mb, replay=False)[0]).abs().max() > 0.1  # replay changes these rows
    kept, size = stats
    if cp == 1:  # under CP each rank's metrics cover its own rows
        assert abs(metrics[trainer.KEPT_MASS] - kept) < 1e-6 and abs(metrics[trainer.SUPPORT_SIZE] - size) < 1e-12, \
            (metrics, stats)
    else:
        assert 0 < metrics[trainer.KEPT_MASS] <= 1 and metrics[trainer.SUPPORT_SIZE] >= 1, metrics

    # replay off: verl's own values; bit-identical at every row replay leaves alone
    megatron_engine.uninstall()
    lp_off, metrics_off = run(e, model, mb, w)
    megatron_engine.install()
    assert trainer.KEPT_MASS not in metrics_off
    torch.testing.assert_close(lp_off.detach().double() * mask, reference(model, mb, replay=False)[0].detach() * mask,
                               atol=2e-6, rtol=0)
    replayed = replayed_rows(mb)
    untouched = mask & ~replayed
    assert untouched.sum() >= 2 and replayed.sum() >= 3
    assert torch.equal(lp.detach()[untouched], lp_off.detach()[untouched])


def check_bfloat16(e, model, mb):
    """bfloat16 logits (megatron-core's cross entropy then works on a float32 copy): log-probs against the
    float64 reference from the same bfloat16 logits, bit-identity with replay off where replay leaves a row."""
    mask = mb["attention_mask"][:, mb["prompts"].shape[1]:].bool()
    w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4)) * mask
    lp, metrics = run(e, model, mb, w)
    assert model.E.grad is not None and model.E.grad.abs().sum() > 0
    torch.testing.assert_close(lp.detach().double() * mask, reference(model, mb)[0] * mask, atol=2e-6, rtol=0)
    megatron_engine.uninstall()
    lp_off, _ = run(e, model, mb, w)
    megatron_engine.install()
    untouched = mask & ~replayed_rows(mb)
    assert torch.equal(lp.detach()[untouched], lp_off.detach()[untouched])
    assert (lp - lp_off).detach().abs().max() > 0.1


def replayed_rows(mb) -> torch.Tensor:
    """bool [B, R]: the response rows recorded as neither nothing nor the whole vocabulary."""
    out = torch.zeros(mb["responses"].shape, dtype=torch.bool)
    for i, s in enumerate(tu.get(mb, SUPPORT_KEY)):
        if s is None:
            continue
        n = np.diff(s["offsets"])
        out[i, :len(n)] = torch.as_tensor((n > 0) & (n < h.V))
    return out


def check_bad_input(e, model, rank):
    data = h.make_batch(5, PROMPTS[:2], RESPONSES[:2])
    s = data.non_tensor_batch[SUPPORT_KEY][1]
    data.non_tensor_batch[SUPPORT_KEY][1] = {"token_ids": s["token_ids"][:s["offsets"][-2]],
                                             "offsets": s["offsets"][:-1]}
    mb = micro_batches(data)[0]
    try:
        run(e, model, mb, torch.zeros(mb["responses"].shape))
        raise AssertionError("a support with a row too few was accepted")
    except InputError as exc:
        assert "sample 1: the support has 1 rows but the response has 2 tokens" in str(exc), str(exc)
    data = h.make_batch(5, PROMPTS[:2], RESPONSES[:2])
    s = data.non_tensor_batch[SUPPORT_KEY][0]
    y = int(data.batch["responses"][0, 2])
    row = s["token_ids"][s["offsets"][2]:s["offsets"][3]]
    s["token_ids"][s["offsets"][2]:s["offsets"][3]] = np.where(row == y, (y + 1) % h.V if (y + 1) % h.V not in row
                                                               else (y + 2) % h.V, row)
    s["token_ids"][s["offsets"][2]:s["offsets"][3]].sort()
    try:
        mb = micro_batches(data)[0]
        run(e, model, mb, torch.zeros(mb["responses"].shape))
        raise AssertionError("a response token outside its support was accepted")
    except OutsideSupportError as exc:
        assert f"sample 0, response position 2: token {y} is not in its recorded support" in str(exc), str(exc)


def micro_batches(data):
    td = h.to_engine_batch(data, T, use_dynamic_bsz=False, micro_batch_size_per_gpu=len(data))
    mbs = prepare_micro_batches(td)[0]
    for mb in mbs:
        tu.assign_non_tensor(mb, num_micro_batch=1)
    return mbs


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    tp, cp = {"tp": (TP, 1), "cp": (1, 2), "tp-cp": (TP, 2)}[mode]
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    rank = mpu.get_tensor_model_parallel_rank()
    transformer_impl.get_device_id = lambda: "cpu"  # verl's CUDA platform getter; the test runs on the CPU
    megatron_engine.install()
    model = ToyColumnParallelLM(12, rank, tp=tp)
    # odd lengths (verl pads each THD sample to a multiple of TP), one row recorded as the whole
    # vocabulary, one recorded empty, one sample without a support
    data = h.make_batch(11, PROMPTS, RESPONSES, whole_rows={(2, 2)}, empty_rows={(0, 3)})
    data.non_tensor_batch[SUPPORT_KEY][4] = None
    if cp > 1:
        for layout in ("thd", "thd-bucket"):
            for mb in micro_batches(data):
                check_micro_batch(engine(layout), model, mb, rank)
            print(f"rank {dist.get_rank()}: tp={mpu.get_tensor_model_parallel_world_size()} "
                  f"cp={mpu.get_context_parallel_world_size()} {layout} ok", flush=True)
        return
    for layout in ("thd", "thd-bucket", "bshd"):
        for mb in micro_batches(data):
            check_micro_batch(engine(layout), model, mb, rank)
        print(f"rank {rank}: {layout} ok", flush=True)
    check_bfloat16(engine("thd"), ToyColumnParallelLM(12, rank, torch.bfloat16), micro_batches(data)[0])
    print(f"rank {rank}: bfloat16 ok", flush=True)
    check_bad_input(engine("thd"), model, rank)
    megatron_engine.uninstall()
    trainer.uninstall()
    print(f"rank {rank}: ok", flush=True)
    mpu.destroy_model_parallel()
    end_distributed_worker()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tp")
