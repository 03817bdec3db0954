"""The README's path from a vLLM response to a trainer's loss, end to end.

An "engine" samples with top-p from known logits and answers in vLLM's generate JSON (sampling
mask + processed log-probs); the trainer recomputes the same logits in its [B, T, V] layout with
-100 on prompt and padding positions. With replay the importance ratio of every completion token
must be 1 (same logits, same support); without replay it is the kept mass (< 1).
"""
import json

import torch

import mask_replay

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
