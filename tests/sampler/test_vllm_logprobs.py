"""The processed-log-probs adapter against engine outputs built as vLLM documents them: per position
the top-N processed log-probs (-inf outside the sampled support), plus the sampled token, in the
offline, completions-JSON, chat-JSON and TRL layouts."""
import json
import math
from types import SimpleNamespace as NS

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mask_replay import SamplingMask, mask_from_trl_vllm, mask_from_vllm_logprobs, vllm_logprobs_settings
from mask_replay.errors import EngineOutputError
from mask_replay.sampler.adapters.vllm_logprobs import JSON_NEG_INF
from tests.helpers import FIXTURES

INF = math.inf


def engine_rows(seed: int, n_tokens: int, vocab: int, max_support: int):
    """(sampled ids, dense supports [T, V] bool, processed log-probs [T, V] float64): what an engine's
    processed log-probs are, log_softmax over the support and -inf outside it."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tokens, vocab, generator=g, dtype=torch.float64) * 2
    support = torch.zeros(n_tokens, vocab, dtype=torch.bool)
    sampled = []
    for t in range(n_tokens):
        size = int(torch.randint(1, max_support + 1, (1,), generator=g))
        ids = torch.randperm(vocab, generator=g)[:size]
        support[t, ids] = True
        sampled.append(int(ids[torch.randint(0, size, (1,), generator=g)]))
    lp = torch.log_softmax(logits.masked_fill(~support, -INF), dim=-1)
    return sampled, support, lp


def top_entries(lp_row: torch.Tensor, n: int, sampled=None) -> list:
    """vLLM's top-N (by value, ties by id) plus the sampled token when it is not among them."""
    order = sorted(range(lp_row.numel()), key=lambda i: (-float(lp_row[i]), i))[:n]
    if sampled is not None and sampled not in order:
        order.append(sampled)
    return [(i, float(lp_row[i])) for i in order]


def offline(sampled, lp, n):
    return [NS(request_id="r0", outputs=[NS(index=0, token_ids=list(sampled),
                                            logprobs=[dict(top_entries(lp[t], n, s)) for t, s in enumerate(sampled)])])]


def as_completions_json(sampled, lp, n, neg_inf=None):
    def v(x):
        return neg_inf if x == -INF else x
    tops = [{f"token_id:{i}": v(x) for i, x in top_entries(lp[t], n, s)} for t, s in enumerate(sampled)]
    return [{"id": "cmpl-0", "choices": [{"index": 0, "logprobs": {
        "tokens": [f"token_id:{s}" for s in sampled],
        "token_logprobs": [v(float(lp[t, s])) for t, s in enumerate(sampled)], "top_logprobs": tops}}]}]


def as_chat_json(sampled, lp, n, neg_inf=None):
    content = []
    for t, s in enumerate(sampled):
        # chat: top_logprobs holds the top N only; the sampled token's value is the entry's own
        tops = [{"token": f"token_id:{i}", "logprob": neg_inf if x == -INF else x} for i, x in top_entries(lp[t], n)]
        content.append({"token": f"token_id:{s}", "logprob": float(lp[t, s]), "top_logprobs": tops})
    return [{"id": "chat-0", "choices": [{"index": 0, "logprobs": {"content": content}}]}]


def as_trl(sampled, lp, n):
    rows = [sorted(top_entries(lp[t], n, s), key=lambda e: -e[1]) for t, s in enumerate(sampled)]
    return [list(sampled)], [[[x for _, x in r] for r in rows]], [[[i for i, _ in r] for r in rows]]


def assert_matches(mask: SamplingMask, sampled, support, lp):
    assert mask.to_lists() == [sorted(torch.nonzero(support[t]).flatten().tolist()) for t in range(len(sampled))]
    assert mask.sampled.tolist() == list(sampled)
    want = torch.cat([lp[t, torch.tensor(r, dtype=torch.long)] for t, r in enumerate(mask.to_lists())])
    torch.testing.assert_close(mask.entry_logprobs.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(mask.logprobs.double(), lp[torch.arange(len(sampled)), torch.tensor(sampled)],
                               atol=1e-6, rtol=0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n_tokens=st.integers(1, 6), vocab=st.integers(2, 40), extra=st.integers(1, 5))
def test_every_layout_reads_the_support_and_its_logprobs(seed, n_tokens, vocab, extra):
    max_support = max(1, vocab // 2)
    sampled, support, lp = engine_rows(seed, n_tokens, vocab, max_support)
    n = min(max_support + extra, vocab)  # more than any support: each row ends in a -inf (or covers V)
    for outputs in (offline(sampled, lp, n), as_completions_json(sampled, lp, n),
                    as_completions_json(sampled, lp, n, neg_inf=JSON_NEG_INF), as_chat_json(sampled, lp, n)):
        assert_matches(mask_from_vllm_logprobs(outputs, logprobs=n, vocab_size=vocab), sampled, support, lp)
    assert_matches(mask_from_trl_vllm(*as_trl(sampled, lp, n), requested=n, vocab_size=vocab), sampled, support, lp)


def test_json_round_trip_with_null_for_minus_inf():
    sampled, support, lp = engine_rows(1, 4, 30, 8)
    outputs = json.loads(json.dumps(as_chat_json(sampled, lp, 10)))
    assert_matches(mask_from_vllm_logprobs(outputs, logprobs=10), sampled, support, lp)


def test_a_row_that_may_be_cut_off_is_refused_with_its_place_and_the_cover():
    sampled, support, lp = engine_rows(2, 3, 30, 12)
    sizes = support.sum(1).tolist()
    n = int(max(sizes))  # the largest row: N finite of N asked, indistinguishable from a cut-off
    t = sizes.index(n)
    with pytest.raises(EngineOutputError, match=rf"request 0 \(id 'r0'\) choice 0 token {t}: .* of the {n} asked"
                       rf".*logprobs={2 * n} or more.*max_logprobs is 20"):
        mask_from_vllm_logprobs(offline(sampled, lp, n), logprobs=n, max_logprobs=20)


def test_the_sampled_token_beyond_the_top_n_is_a_cut_off():
    lp = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0, -INF]], dtype=torch.float64), -1)
    outputs = offline([3], lp, 2)  # top-2 {0, 1} + the sampled 3: all finite, 2 is missing
    with pytest.raises(EngineOutputError, match="token 0: 3 finite log-probs of the 2 asked"):
        mask_from_vllm_logprobs(outputs, logprobs=2)


def test_whole_vocabulary_rows_are_complete():
    lp = torch.log_softmax(torch.tensor([[1.0, 2.0, 0.5]], dtype=torch.float64), -1)
    support = torch.ones(1, 3, dtype=torch.bool)
    assert_matches(mask_from_vllm_logprobs(offline([1], lp, 3), logprobs=3, vocab_size=3), [1], support, lp)
    assert_matches(mask_from_vllm_logprobs(offline([1], lp, 3), logprobs=-1), [1], support, lp)


def test_raw_logprobs_are_not_a_support():
    # logprobs_mode="raw_logprobs": the top-N of the full distribution, never -inf, mass < 1
    lp = torch.log_softmax(torch.randn(1, 50, dtype=torch.float64), -1)
    with pytest.raises(EngineOutputError, match="sum to probability .*processed_logprobs"):
        mask_from_vllm_logprobs(offline([int(lp.argmax())], lp, 10), logprobs=11, vocab_size=50)
    with pytest.raises(EngineOutputError, match="of the 10 asked"):  # N finite of N: refused as cut off first
        mask_from_vllm_logprobs(offline([int(lp.argmax())], lp, 10), logprobs=10, vocab_size=50)


def test_greedy_rows_are_the_argmax():
    lp = torch.log_softmax(torch.tensor([[0.1, 2.0, 0.5, 2.0]], dtype=torch.float64), -1)  # a tie: 1 and 3
    for s in (1, 3):  # whichever tied id the engine drew
        mask = mask_from_vllm_logprobs(offline([s], lp, 1), logprobs=1, temperature=0.0)
        assert mask.to_lists() == [[s]] and mask.entry_logprobs.tolist() == [0.0] and mask.logprobs.tolist() == [0.0]
    with pytest.raises(EngineOutputError, match="greedy .* not the most probable"):
        mask_from_vllm_logprobs(offline([0], lp, 1), logprobs=1, temperature=0.0)


def _broken(edit):
    sampled, _, lp = engine_rows(3, 3, 20, 5)
    out = as_completions_json(sampled, lp, 8)
    edit(out[0]["choices"][0]["logprobs"], sampled)
    return out


def _set_top(t, key, value):
    def edit(lp, sampled):
        lp["top_logprobs"][t][key if key != "sampled" else f"token_id:{sampled[t]}"] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set_top(1, "sampled", float("nan")), r"choice 0 token 1, id \d+: log-prob nan"),
    (_set_top(2, "token_id:19", float("inf")), "token 2, id 19: log-prob inf"),
    (_set_top(0, "sampled", "x"), "token 0, id .*: log-prob 'x' is not a number"),
    (_set_top(0, "hello", -1.0), "token 0: token 'hello' is not 'token_id:<id>'"),
    (lambda lp, s: lp["top_logprobs"].pop(), "3 tokens, 2 top_logprobs"),
    (lambda lp, s: lp.pop("tokens"), "no 'tokens'"),
    (lambda lp, s: lp["top_logprobs"].__setitem__(1, [1, 2]), "token 1: top_logprobs is"),
    (lambda lp, s: lp["top_logprobs"][0].__setitem__(f"token_id:{s[0]}", None),
     "token 0: the generated token .* has log-prob -inf"),
])
def test_malformed_outputs_are_named(edit, message):
    with pytest.raises(EngineOutputError, match=message):
        mask_from_vllm_logprobs(_broken(edit), logprobs=8)


def test_duplicate_ids_and_missing_sampled_token_offline():
    lp = torch.log_softmax(torch.tensor([[1.0, 0.0, -INF]], dtype=torch.float64), -1)
    out = offline([0], lp, 3)
    out[0].outputs[0].logprobs[0].pop(0)
    with pytest.raises(EngineOutputError, match="token 0: its log-probs hold no entry for the generated token 0"):
        mask_from_vllm_logprobs(out, logprobs=3)
    ids, lps = [[[0, 0, 2]]], [[[math.log(0.5), math.log(0.5), -INF]]]
    with pytest.raises(EngineOutputError, match="completion 0 token 0: token id 0 appears twice"):
        mask_from_trl_vllm([[0]], lps, ids, requested=2)
    with pytest.raises(EngineOutputError, match="completion 0: 1 tokens, 2 logprobs rows"):
        mask_from_trl_vllm([[0]], [lps[0] * 2], [ids[0] * 2], requested=2)
    with pytest.raises(EngineOutputError, match="more than logprobs=1"):
        mask_from_vllm_logprobs(offline([0], lp, 3), logprobs=1)


def test_bad_arguments():
    sampled, _, lp = engine_rows(4, 2, 10, 3)
    for bad in (0, -2, 2.5, True, None):
        with pytest.raises(EngineOutputError, match="logprobs must be"):
            mask_from_vllm_logprobs(offline(sampled, lp, 5), logprobs=bad)
    with pytest.raises(EngineOutputError, match="request 0: neither"):
        mask_from_vllm_logprobs([42], logprobs=5)
    with pytest.raises(EngineOutputError, match="no logprobs"):
        mask_from_vllm_logprobs([NS(outputs=[NS(index=0, token_ids=[1], logprobs=None)])], logprobs=5)


def test_agrees_with_the_sampling_mask_path():
    """A response carrying both vLLM's sampling_mask (Model Runner V2) and processed top-N log-probs
    (the recorded fixture's rows and values, as the top-N lists vLLM would return)."""
    with open(f"{FIXTURES}/vllm_generate_mask_logprobs.json") as f:
        responses = json.load(f)
    n = 1 + max(len(r) for resp in responses for ch in resp["choices"] for r in ch["sampling_mask"])
    for resp in responses:
        for ch in resp["choices"]:
            for t, entry in enumerate(ch["logprobs"]["content"]):
                ids, vals = ch["sampling_mask"][t], ch["sampling_mask_logprobs"][t]
                tops = sorted(zip(ids, vals), key=lambda e: -e[1])
                pad = [i for i in range(n + 1) if i not in ids][: n - len(tops)]
                entry["top_logprobs"] = ([{"token": f"token_id:{i}", "logprob": v} for i, v in tops] +
                                         [{"token": f"token_id:{i}", "logprob": JSON_NEG_INF} for i in pad])
    via_mask = SamplingMask.from_vllm(responses)
    via_logprobs = mask_from_vllm_logprobs(responses, logprobs=n)
    assert via_logprobs.to_lists() == via_mask.to_lists()
    assert via_logprobs.sampled.tolist() == via_mask.sampled.tolist()
    torch.testing.assert_close(via_logprobs.entry_logprobs, via_mask.entry_logprobs, atol=1e-6, rtol=0)


def test_settings():
    s = vllm_logprobs_settings(top_k=20, top_p=0.9)
    assert s.engine == {"logprobs_mode": "processed_logprobs", "max_logprobs": 21} and s.request == {"logprobs": 21}
    assert vllm_logprobs_settings(temperature=0.0).logprobs == 1
    s = vllm_logprobs_settings(top_p=0.9, top_k_cap=64)
    assert s.logprobs == 65 and s.sampling["top_k"] == 64 and "cut to 64" in s.cost
    assert vllm_logprobs_settings(min_p=0.1, vocab_size=49152).logprobs == 49152
    assert vllm_logprobs_settings(top_k=100, vocab_size=50).logprobs == 50
    for kwargs, message in [({"top_p": 0.9}, "pass vocab_size .* or top_k_cap"), ({"top_p": 0.0}, "top_p = 0"),
                            ({"temperature": -1.0}, "temperature"), ({"top_k": -3}, "top_k must be"),
                            ({"top_p": 1.5}, r"top_p must be in \[0, 1\]"), ({"top_k_cap": 0, "top_p": 0.5}, "cap")]:
        with pytest.raises(EngineOutputError, match=message):
            vllm_logprobs_settings(**kwargs)


def test_settings_cover_the_rows_they_are_for():
    """What the helper asks for is enough for the guard: a top-k support of exactly k ids."""
    k = 5
    s = vllm_logprobs_settings(top_k=k)
    logits = torch.randn(1, 40, dtype=torch.float64)
    keep = logits[0].topk(k).indices
    support = torch.zeros(1, 40, dtype=torch.bool)
    support[0, keep] = True
    lp = torch.log_softmax(logits.masked_fill(~support, -INF), -1)
    assert_matches(mask_from_vllm_logprobs(offline([int(keep[0])], lp, s.logprobs), logprobs=s.logprobs),
                   [int(keep[0])], support, lp)


def tied_rows(values, sampled, n):
    """One position whose support is `values` (finite logits, -inf elsewhere) as vLLM CPU's top-k keeps it,
    in the offline layout with the top-N processed log-probs."""
    lp = torch.log_softmax(torch.tensor([values], dtype=torch.float64), -1)
    return offline([sampled], lp, n), lp


def test_a_tie_at_the_top_k_cut_is_accepted_when_the_mass_proves_the_row_whole():
    # top_k 3, the 3rd and 4th logits tied: vLLM CPU keeps both (4 ids), so top_k + 1 = 4 log-probs are all finite
    out, lp = tied_rows([2.0, 1.5, 1.0, 1.0, -INF, -INF], 3, 4)
    mask = mask_from_vllm_logprobs(out, logprobs=4, top_k=3)
    assert mask.to_lists() == [[0, 1, 2, 3]]
    torch.testing.assert_close(mask.entry_logprobs.double(), lp[0, :4], atol=1e-6, rtol=0)
    # without top_k nothing tells the row whole: the hint is a larger N, never the one that failed
    with pytest.raises(EngineOutputError, match=r"4 finite log-probs of the 4 asked: .* ask for logprobs=8 or more"):
        mask_from_vllm_logprobs(out, logprobs=4)
    # a third tied id left out by the top-4 (5 in the support): the mass is short, refused with the tie named
    out, _ = tied_rows([2.0, 1.5, 1.0, 1.0, 1.0, -INF], 3, 4)
    with pytest.raises(EngineOutputError, match=r"top_k 3-th value is tied .* ask for logprobs=8 or more"):
        mask_from_vllm_logprobs(out, logprobs=4, top_k=3)
    # a tie too small for the mass check to see one more: refused
    out, _ = tied_rows([30.0, 20.0, 1.0, 1.0, -INF], 2, 4)
    with pytest.raises(EngineOutputError, match="tied"):
        mask_from_vllm_logprobs(out, logprobs=4, top_k=3)
    # below the k-th rank nothing may be tied (1.5 is not the 3rd value): the usual cut-off
    out, _ = tied_rows([2.0, 1.5, 1.5, 1.0, 0.5, -INF], 0, 4)
    with pytest.raises(EngineOutputError, match="of the 4 asked: the support may be cut off; ask"):
        mask_from_vllm_logprobs(out, logprobs=4, top_k=3)
    # where top_k + 1 is more than was asked, that is the hint
    with pytest.raises(EngineOutputError, match=r"ask for logprobs=6 \(the request's top_k \+ 1\)"):
        mask_from_vllm_logprobs(out, logprobs=4, top_k=5)


def test_vocab_size_must_be_positive():
    for bad in (0, -5):
        with pytest.raises(EngineOutputError, match=rf"vocab_size must be >= 1, got {bad}"):
            vllm_logprobs_settings(top_p=0.9, vocab_size=bad)
        with pytest.raises(EngineOutputError, match=rf"vocab_size must be an integer >= 1, got {bad}"):
            mask_from_vllm_logprobs(offline([0], torch.zeros(1, 1, dtype=torch.float64), 1), logprobs=1,
                                    vocab_size=bad)


@pytest.mark.parametrize("token", ["token_id:1_000", "token_id: 3", "token_id:+3", "token_id:-3", "token_id:3 ",
                                   "token_id:\u0663", "token_id:\uff13", "token_id:"])
def test_token_strings_vllm_never_sends_are_refused(token):
    sampled, _, lp = engine_rows(5, 2, 20, 4)
    out = as_completions_json(sampled, lp, 6)
    out[0]["choices"][0]["logprobs"]["tokens"][1] = token
    with pytest.raises(EngineOutputError, match=r"token 1: token .* is not 'token_id:<id>'"):
        mask_from_vllm_logprobs(out, logprobs=6)


def test_offline_token_ids_as_numpy_or_tensor():
    np = pytest.importorskip("numpy")
    sampled, support, lp = engine_rows(6, 4, 30, 6)
    for wrap in (np.array, torch.tensor):
        out = offline(sampled, lp, 7)
        out[0].outputs[0].token_ids = wrap(sampled)
        assert_matches(mask_from_vllm_logprobs(out, logprobs=7), sampled, support, lp)


@pytest.mark.parametrize("value", [-INF, None, 0.5])
def test_greedy_row_with_no_log_probability_is_refused(value):
    out = [{"id": "g", "choices": [{"index": 0, "logprobs": {
        "tokens": ["token_id:1"], "token_logprobs": [value], "top_logprobs": [{"token_id:1": value}]}}]}]
    with pytest.raises(EngineOutputError, match=r"token 0: greedy \(temperature 0\) but the generated token 1 has "
                                                r"log-prob"):
        mask_from_vllm_logprobs(out, logprobs=1, temperature=0.0)
