"""Independent check of a recorded mask against what transformers sampled from: re-run transformers'
own warpers (generate's order: temperature, top-k, top-p, min-p) on the raw logits of every step and
take the finite set. Shared by the integration and example tests."""
import torch


def hf_support(raw: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x = raw.float()
    ids = torch.zeros(raw.shape[0], 1, dtype=torch.long)
    if temperature != 1.0:
        x = TemperatureLogitsWarper(temperature)(ids, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p is not None and top_p < 1.0:
        x = TopPLogitsWarper(top_p)(ids, x)
    if min_p is not None:
        x = MinPLogitsWarper(min_p)(ids, x)
    return x


def expected_rows(sequences, prompt_len, eos):
    eos = [eos] if isinstance(eos, int) else list(eos)
    """(sequence, position) of every generated token up to and including its sequence's first EOS."""
    rows = []
    for b, seq in enumerate(sequences[:, prompt_len:].tolist()):
        for t, tok in enumerate(seq):
            rows.append((b, t))
            if tok in eos:
                break
    return rows


def check_mask(out, mask, prompt_len, eos, temperature=1.0, top_k=None, top_p=None, min_p=None, sampler=hf_support):
    """Assert row by row that the mask is the support `sampler` gives on the raw logits (output_logits),
    that the sampled token lies in it, and that logprobs/kept_mass match. Returns rows checked."""
    rows = expected_rows(out.sequences, prompt_len, eos)
    assert list(zip(mask.extras["sequence"].tolist(), mask.extras["position"].tolist())) == rows
    steps = {}  # the warpers run on the whole batch of a step, as in generate (same sort calls)
    for i, (b, t) in enumerate(rows):
        if t not in steps:
            steps[t] = sampler(out.logits[t], temperature, top_k, top_p, min_p)
        raw, processed = out.logits[t][b: b + 1], steps[t][b]
        want = torch.nonzero(torch.isfinite(processed)).flatten().tolist()
        assert mask.row(i).tolist() == want, f"row {i} (sequence {b}, position {t})"
        y = int(out.sequences[b, prompt_len + t])
        assert int(mask.sampled[i]) == y and y in want
        logp = torch.log_softmax(processed.double(), 0)[y]
        assert abs(float(mask.logprobs[i]) - float(logp)) < 1e-5
        if mask.kept_mass is not None:
            x = raw[0].double() / temperature
            kept = torch.exp(torch.logsumexp(x[want], 0) - torch.logsumexp(x, 0))
            assert abs(float(mask.kept_mass[i]) - float(kept)) < 1e-5
    return len(rows)
