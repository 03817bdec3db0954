"""Shared pieces of the real-verl tests (imported only where verl 0.9.1 is installed: `make check-verl`).

A batch as verl's agent loop hands it to the trainer (left-padded prompts, right-padded responses,
one support per sample in non_tensor_batch), verl's own FSDPEngineWithLMHead with only the attributes
its prepare_model_inputs / prepare_model_outputs read (no FSDP wrapping, no model load), a toy LM
whose logits at a position depend on the token and its position id (so verl's packing, padding and
Ulysses slicing all matter), and the float64 reference of the response log-probs.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from mask_replay.integrations.verl.support_rows import SUPPORT_KEY

V = 40
MAX_POS = 32


def make_batch(seed: int, prompt_lens, response_lens, *, whole_rows=(), empty_rows=()) -> DataProto:
    """A DataProto of len(prompt_lens) samples; each response row holds its token plus random others.
    whole_rows / empty_rows: (sample, position) pairs recorded as the whole vocabulary / nothing."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = len(prompt_lens), max(prompt_lens), max(response_lens)
    prompts = torch.zeros(b, p, dtype=torch.long)
    responses = torch.zeros(b, r, dtype=torch.long)
    attention = torch.zeros(b, p + r, dtype=torch.long)
    supports, uids = [], []
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens)):
        prompts[i, p - pl:] = torch.randint(0, V, (pl,), generator=g)
        responses[i, :rl] = torch.randint(0, V, (rl,), generator=g)
        attention[i, p - pl:p + rl] = 1
        rows = []
        for j in range(rl):
            if (i, j) in empty_rows:
                rows.append([])
            elif (i, j) in whole_rows:
                rows.append(list(range(V)))
            else:
                k = int(torch.randint(1, 6, (1,), generator=g))
                rows.append(sorted(set(torch.randint(0, V, (k,), generator=g).tolist()) | {int(responses[i, j])}))
        supports.append({"token_ids": np.array([t for row in rows for t in row], dtype=np.int32),
                         "offsets": np.cumsum([0] + [len(row) for row in rows]).astype(np.int64)})
        uids.append(f"sample-{i}")
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                 "attention_mask": attention, "position_ids": position_ids, "response_mask": attention[:, p:]},
        non_tensors={SUPPORT_KEY: np.array(supports, dtype=object), "uid": np.array(uids, dtype=object)})


def to_engine_batch(data: DataProto, temperature: float, **non_tensor):
    """What ray_trainer hands compute_log_prob / update_actor: to_tensordict, then no padding."""
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, temperature=temperature, use_remove_padding=True, calculate_entropy=False,
                         use_fused_kernels=False, **non_tensor)
    return td


def engine(sp_size: int = 1, pad_to_length_bucket: int = 0) -> FSDPEngineWithLMHead:
    """verl's own FSDPEngineWithLMHead, built without __init__: only what the two methods read."""
    e = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    e.pad_to_length = pad_to_length_bucket > 0
    e.pad_to_length_bucket = pad_to_length_bucket
    e.ulysses_sequence_parallel_size = sp_size
    e.use_ulysses_sp = sp_size > 1
    e.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    e.module = SimpleNamespace(config=SimpleNamespace())  # not a vision model
    return e


class ToyLM(torch.nn.Module):
    """logits(token, position) = E[token] + P[position]: no attention, so any slicing of the packed
    sequence gives every rank the logits of its own positions."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.E = torch.nn.Parameter(torch.randn(V, V, generator=g) * 2)
        self.P = torch.nn.Parameter(torch.randn(MAX_POS, V, generator=g))

    def forward(self, input_ids, position_ids, **_):
        return SimpleNamespace(logits=self.E[input_ids] + self.P[position_ids])


def response_logprobs(e: FSDPEngineWithLMHead, model: ToyLM, micro_batch) -> torch.Tensor:
    """verl's forward_step up to the log-probs, then verl's no_padding_2_padding: [B, max_response]."""
    model_inputs, output_args = e.prepare_model_inputs(micro_batch)
    out = e.prepare_model_outputs(model(**model_inputs), output_args, micro_batch, None)
    return no_padding_2_padding(out["log_probs"], micro_batch)


def reference(model: ToyLM, micro_batch, temperature: float, replay: bool = True) -> torch.Tensor:
    """float64 response log-probs [B, max_response] token by token: over the recorded row where one is
    recorded (non-empty, not the whole vocabulary), over the whole vocabulary otherwise."""
    E, P = model.E.double(), model.P.double()
    ids, cu = micro_batch["input_ids"].values(), micro_batch["input_ids"].offsets()
    pos = micro_batch["position_ids"].values()
    resp = micro_batch["responses"]
    lengths = micro_batch["attention_mask"][:, micro_batch["prompts"].shape[1]:].sum(1)
    supports = list(tu.get(micro_batch, SUPPORT_KEY))
    out = torch.zeros(resp.shape, dtype=torch.float64)
    rows = []
    for i in range(resp.shape[0]):
        start = int(cu[i + 1]) - int(lengths[i])
        s = supports[i]
        for j in range(int(lengths[i])):
            at = start + j - 1
            x = (E[ids[at]] + P[pos[at]]) / temperature
            row = s["token_ids"][s["offsets"][j]:s["offsets"][j + 1]]
            y = int(ids[start + j])
            support = torch.as_tensor(row, dtype=torch.long) if replay and 0 < len(row) < V else torch.arange(V)
            rows.append((i, j, x[y] - torch.logsumexp(x[support], 0)))
    for i, j, v in rows:
        out = out.index_put((torch.tensor([i]), torch.tensor([j])), v.reshape(1))
    return out


def kept_and_sizes(model: ToyLM, micro_batch, temperature: float):
    """float64 (mean kept mass exp(lse_K - lse_V), mean |K|) over the recorded rows (non-empty, not the
    whole vocabulary) of a micro-batch, token by token."""
    E, P = model.E.double().detach(), model.P.double().detach()
    ids, cu = micro_batch["input_ids"].values(), micro_batch["input_ids"].offsets()
    pos = micro_batch["position_ids"].values()
    lengths = micro_batch["attention_mask"][:, micro_batch["prompts"].shape[1]:].sum(1)
    kept, sizes = [], []
    for i, s in enumerate(tu.get(micro_batch, SUPPORT_KEY)):
        start = int(cu[i + 1]) - int(lengths[i])
        for j in range(int(lengths[i])):
            row = s["token_ids"][s["offsets"][j]:s["offsets"][j + 1]]
            if 0 < len(row) < V:
                x = (E[ids[start + j - 1]] + P[pos[start + j - 1]]) / temperature
                kept.append(float(torch.exp(torch.logsumexp(x[torch.as_tensor(row, dtype=torch.long)], 0)
                                            - torch.logsumexp(x, 0))))
                sizes.append(len(row))
    return sum(kept) / len(kept), sum(sizes) / len(sizes)
