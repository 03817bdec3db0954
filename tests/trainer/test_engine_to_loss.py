"""The README's path from a vLLM response to a trainer's loss, end to end.

An "engine" samples with top-p from known logits and answers in vLLM's generate JSON (sampling
mask + processed log-probs); the trainer recomputes the same logits in its [B, T, V] layout with
-100 on prompt and padding positions. With replay the importance ratio of every completion token
must be 1 (same logits, same support); without replay it is the kept mass (< 1).
"""
import json
import os

import pytest
import torch
from click.testing import CliRunner

import mask_replay
from mask_replay.cli.main import main

V, T_PROMPT, TEMP, TOP_P = 64, 3, 0.8, 0.9


def engine_response(logits_per_choice, generator):
    """vLLM /inference/v1/generate JSON for one request with len(logits_per_choice) choices."""
    choices = []
    for index, z in enumerate(logits_per_choice):
        m = mask_replay.capture(z, temperature=TEMP, top_p=TOP_P)
        tokens, lps = [], []
        for r in range(z.shape[0]):
            ids = m.row(r)
            y = int(ids[torch.randint(len(ids), (1,), generator=generator)])
            support = z[r, ids.long()] / TEMP
            tokens.append(y)
            lps.append(float(z[r, y] / TEMP - torch.logsumexp(support, 0)))
        choices.append({
            "index": index, "finish_reason": "length", "token_ids": tokens,
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                     for t, lp in zip(tokens, lps)]},
            "sampling_mask": m.to_lists(),
        })
    return json.loads(json.dumps([{"request_id": "r0", "choices": choices}]))


def test_vllm_response_to_trainer_loss():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3]  # completion lengths of the two sequences
    engine_logits = [torch.randn(n, V, generator=g, dtype=torch.float64) * 3 for n in lengths]
    resp = engine_response([z.float() for z in engine_logits], g)

    # --- the README's lines --------------------------------------------------------------------
    mask = mask_replay.SamplingMask.from_vllm(resp, temperature=TEMP)
    B, T = len(lengths), T_PROMPT + max(lengths)
    labels = torch.full((B, T), -100)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)  # prompt/padding: anything
    for b, (n, z) in enumerate(zip(lengths, engine_logits)):
        labels[b, T_PROMPT:T_PROMPT + n] = torch.tensor(resp[0]["choices"][b]["token_ids"])
        logits[b, T_PROMPT:T_PROMPT + n] = z.float().double()  # the trainer recomputes the same logits
    logits.requires_grad_(True)
    logp = mask_replay.replay_logprobs(logits, mask, labels, temperature=TEMP)
    old = torch.zeros_like(logp)
    old[labels != -100] = mask.logprobs.to(logp)
    ratio = torch.exp(logp - old)[labels != -100]
    loss = -(ratio * 1.0).mean()
    loss.backward()
    # ---------------------------------------------------------------------------------------------

    assert mask.num_rows == sum(lengths)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
    assert logp.shape == (B, T) and bool((logp[labels == -100] == 0).all())
    assert bool((logits.grad[labels == -100] == 0).all())  # no gradient at ignored positions
    # without replay the ratio is the kept mass: strictly below 1 where the support was truncated
    flat = logits.detach()[labels != -100]
    full = mask_replay.full_logprobs(flat, labels[labels != -100], TEMP)
    no_replay = torch.exp(full.double() - mask.logprobs.double())
    kept = mask_replay.kept_mass(flat, mask, TEMP).double()
    torch.testing.assert_close(no_replay, kept, rtol=1e-5, atol=1e-6)
    assert float(kept.min()) < 0.999


# ---- the whole support: engine entry log-probs -> convert -> replay_support_logprobs -> centered loss ----
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")


def _fixture(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


@pytest.mark.parametrize("fixture, source", [("vllm_generate_mask_logprobs.json", "vllm-json"),
                                             ("sglang_generate_mask_logprobs.json", "sglang-json")])
def test_engine_support_logprobs_to_score_centered_loss(tmp_path, fixture, source):
    """vLLM's sampling_mask_logprobs / SGLang's output_token_sampling_mask_logprobs (written from the
    documented response shapes, ids in the engine's order, most probable first) -> `mask-replay convert`
    -> a mask file with entry_logprobs -> the trainer's replayed support log-probs on the same logits
    -> score_centered_pg. The engine's logits are known (engine_to_loss_logits.json)."""
    known = _fixture("engine_to_loss_logits.json")
    temp, vocab = known["temperature"], known["vocab_size"]
    engine_logits = [torch.tensor(z) for z in known["logits"]]
    out = tmp_path / "masks.safetensors"
    result = CliRunner().invoke(main, ["convert", os.path.join(FIXTURES, fixture), "-o", str(out), "--from", source,
                                       "--temperature", str(temp), "--vocab-size", str(vocab)])
    assert result.exit_code == 0, result.output

    # --- README's lines ---------------------------------------------------------------------------------
    mask = mask_replay.SamplingMask.load(out)                                   # entry_logprobs kept
    B, T = len(engine_logits), T_PROMPT + max(z.shape[0] for z in engine_logits)
    labels = torch.full((B, T), -100)
    logits = torch.randn(B, T, vocab, generator=torch.Generator().manual_seed(1))  # prompt/padding: anything
    resp = _fixture(fixture)
    for b, z in enumerate(engine_logits):
        tokens = resp[0]["choices"][b]["token_ids"] if source == "vllm-json" else resp[b]["output_ids"]
        labels[b, T_PROMPT:T_PROMPT + z.shape[0]] = torch.tensor(tokens)
        logits[b, T_PROMPT:T_PROMPT + z.shape[0]] = z                        # the trainer recomputes them
    logits.requires_grad_(True)
    lp = mask_replay.replay_support_logprobs(logits, mask, labels, temperature=temp)         # [nnz]
    advantages = torch.tensor([1.0, -0.5])[:, None].expand(B, T)
    loss, metrics = mask_replay.score_centered_pg(lp, mask.entry_logprobs, mask, advantages, labels=labels)
    loss.sum().backward()
    # ----------------------------------------------------------------------------------------------------

    assert mask.entry_logprobs is not None and mask.nnz == sum(len(r) for r in mask.to_lists())
    # same logits, same support: the trainer's entries are the engine's, the sampled one is mask.logprobs
    torch.testing.assert_close(lp, mask.entry_logprobs, rtol=0, atol=1e-6)
    rows = mask.row_ids()
    at_y = mask.token_ids.long() == mask.sampled[rows]
    torch.testing.assert_close(mask.entry_logprobs[at_y], mask.logprobs, rtol=0, atol=0)
    # p = q: every weight is 1, the coefficients are q (they sum to 1 per token), nothing truncated
    assert float(metrics["score_centering/coefficient_l1"]) == pytest.approx(1.0, abs=1e-5)
    assert float(metrics["ratio_truncated_frac"]) == 0.0
    assert loss.shape == (B, T) and bool((loss[labels == -100] == 0).all())
    assert bool((logits.grad[labels == -100] == 0).all())
    # the gradient is -A (grad lp_y - sum_v q_v grad lp_v) and sum_v q_v grad lp_v = 0 at p = q:
    # it equals the plain policy gradient of the sampled log-probs
    z = logits.detach().clone().requires_grad_(True)
    logp = mask_replay.replay_logprobs(z, mask, labels, temperature=temp)
    (-(advantages * logp)[labels != -100].sum()).backward()
    torch.testing.assert_close(logits.grad, z.grad, rtol=1e-5, atol=1e-6)
    # the singleton rows (|S| = 1) have no gradient at all
    single = torch.nonzero(mask.lengths() == 1)[:, 0]
    kept = torch.nonzero(labels.reshape(-1) != -100)[:, 0]
    for r in single.tolist():
        assert not bool(logits.grad.reshape(-1, vocab)[kept[r]].any())
