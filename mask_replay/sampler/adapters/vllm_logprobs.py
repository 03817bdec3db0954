"""vLLM processed log-probs -> mask fields: the support of any vLLM build (V1 runner, CPU, no
Model Runner V2), read off the top-N log-probs the engine returns.

With `logprobs_mode="processed_logprobs"` vLLM reports each position's log-probs after temperature
and truncation (min-p, top-k, top-p): -inf outside the support it sampled from, and the support's
renormalised log-probs inside it. So the returned entries with a finite log-prob ARE the support,
and their values are its per-entry log-probs, whenever N (the request's `logprobs=`) exceeds the
support's size. The guard below refuses every row where that cannot be told.

Accepted layouts (vLLM is not imported; objects are read by duck typing):
  - offline `RequestOutput`s (or `CompletionOutput`s): per position a dict token id -> Logprob;
  - the OpenAI-compatible `/v1/completions` JSON (`logprobs.tokens`, `token_logprobs`,
    `top_logprobs`) and `/v1/chat/completions` JSON (`logprobs.content[t].top_logprobs`), with
    `return_tokens_as_token_ids=True` so that tokens arrive as "token_id:<id>". The server sends
    -inf as null or clamped to -9999.0: both read as -inf (a real log-prob is far above it);
  - what TRL 1.16's vLLM generation returns (`mask_from_trl_vllm`): per sequence, per token, the
    log-probs and their token ids, sorted by rank, NaN already replaced by None.

Ties at the top-k cut (read against vLLM 0.32.0, v1/sample/ops/topk_topp_sampler.py): without Triton
(the CPU builds) `apply_top_k_only` and `apply_top_k_top_p_pytorch` keep every token whose logit is
not below the k-th largest, so a support can hold more than top_k ids when the k-th value is tied,
and top_k + 1 log-probs then come back all finite. Such a row is accepted when its finite entries
provably are the whole support (`top_k` given): the support lies within the values >= the k-th, so
any id left out would be one more tie at the k-th value, worth exp(that log-prob); when that worth
exceeds twice the mass tolerance, a row whose finite entries hold all the probability lacks none.
Otherwise the error asks for a larger N (ties can be any number: the hint is twice the N asked).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from mask_replay.errors import EngineOutputError
from mask_replay.mask import SamplingMask
from mask_replay.sampler.adapters.common import Completion, _is_int, _is_real, as_list, build_mask, get, has

# vLLM's OpenAI-compatible server clamps -inf log-probs to this value (JSON has no -inf).
JSON_NEG_INF = -9999.0
# A row's finite entries must hold all the probability: |log sum p| within float32 rounding of
# the engine's log-softmax over up to 10^5 entries (the same bound csr.check_entry_logprobs uses).
ROW_MASS_TOLERANCE = 1e-4
# what vLLM sends with return_tokens_as_token_ids=True: ASCII digits only (no sign, space or "_")
_TOKEN_ID = re.compile(r"token_id:([0-9]+)")


def mask_from_vllm_logprobs(outputs: Any, *, logprobs: int, max_logprobs: Optional[int] = None,
                            temperature: Optional[float] = None, step: Optional[int] = None,
                            vocab_size: Optional[int] = None, top_k: Optional[int] = None) -> SamplingMask:
    """One mask row per generated token (requests in order, completions by index), its ids the
    entries with a finite processed log-prob, `entry_logprobs` their values.

    `logprobs` is the N every request asked for (-1: the whole vocabulary), `max_logprobs` the
    engine's cap (named in errors only). `temperature=0` marks greedy requests: their support is
    the sampled token alone (vLLM reports greedy rows' log-probs untruncated), which must be the
    rank-1 entry. A row whose support may be cut off (N finite entries of N asked) is an error
    naming request, choice and token, and the `logprobs=` that would cover it. `top_k` (the requests'
    top_k, when they set one) lets a row whose k-th value is tied be told complete (module doc)."""
    need = _Need(logprobs, max_logprobs, temperature, vocab_size, top_k)
    completions = []
    for r, request in enumerate(outputs if isinstance(outputs, (list, tuple)) else [outputs]):
        for label, key, tokens, positions in _choices(request, r):
            completions.append(_completion(label, key, tokens, positions, need))
    return build_mask(completions, engine="vllm", temperature=temperature, step=step, vocab_size=vocab_size)


def mask_from_trl_vllm(completion_ids, logprobs, logprob_token_ids, *, requested: int,
                       max_logprobs: Optional[int] = None, temperature: Optional[float] = None,
                       step: Optional[int] = None, vocab_size: Optional[int] = None,
                       top_k: Optional[int] = None) -> SamplingMask:
    """The mask of TRL's vLLM generation (`VLLMGeneration.generate` / `VLLMClient.generate`, colocate
    or server): `completion_ids` [seq][token], `logprobs` and `logprob_token_ids` [seq][token][entry]
    as TRL returns them with `logprobs=requested` (None: NaN or null; read as -inf, so that a
    support entry lost that way fails the row's mass check). Rows in sequence order, one per token."""
    need = _Need(requested, max_logprobs, temperature, vocab_size, top_k)
    seqs = as_list(completion_ids, "completion_ids")
    lps = as_list(logprobs, "logprobs")
    ids = as_list(logprob_token_ids, "logprob_token_ids")
    if not len(seqs) == len(lps) == len(ids):
        raise EngineOutputError(f"TRL vLLM output: {len(seqs)} completions, {len(lps)} logprobs lists and "
                                f"{len(ids)} logprob_token_ids lists (one each per completion)")
    completions = []
    for s, (tokens, lp, tid) in enumerate(zip(seqs, lps, ids)):
        label = f"completion {s}"
        tokens, lp, tid = (as_list(x, f"{label}: {n}") for x, n in
                           ((tokens, "completion_ids"), (lp, "logprobs"), (tid, "logprob_token_ids")))
        if not len(tokens) == len(lp) == len(tid):
            raise EngineOutputError(f"{label}: {len(tokens)} tokens, {len(lp)} logprobs rows and {len(tid)} "
                                    "logprob_token_ids rows")
        positions = []
        for t, (vals, keys) in enumerate(zip(lp, tid)):
            vals = as_list(vals, f"{label} token {t}: logprobs")
            keys = as_list(keys, f"{label} token {t}: logprob_token_ids")
            if len(vals) != len(keys):
                raise EngineOutputError(f"{label} token {t}: {len(vals)} log-probs for {len(keys)} token ids")
            positions.append(list(zip(keys, vals)))
        completions.append(_completion(label, [s], tokens, positions, need))
    return build_mask(completions, engine="vllm", temperature=temperature, step=step, vocab_size=vocab_size)


class _Need:
    """The request settings a row is judged against, checked once."""

    def __init__(self, logprobs, max_logprobs, temperature, vocab_size, top_k):
        if not _is_int(logprobs) or not (logprobs == -1 or logprobs >= 1):
            raise EngineOutputError(f"logprobs must be the N each request asked for (an integer >= 1, or -1 for the "
                                    f"whole vocabulary), got {logprobs!r}")
        if max_logprobs is not None and not _is_int(max_logprobs):
            raise EngineOutputError(f"max_logprobs must be an integer, got {max_logprobs!r}")
        if temperature is not None and not (_is_real(temperature) and temperature >= 0):
            raise EngineOutputError(f"temperature must be a number >= 0, got {temperature!r}")
        if vocab_size is not None and not (_is_int(vocab_size) and vocab_size >= 1):
            raise EngineOutputError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        if top_k is not None and not _is_int(top_k):
            raise EngineOutputError(f"top_k must be an integer or None, got {top_k!r}")
        self.n, self.max_logprobs, self.vocab_size = int(logprobs), max_logprobs, vocab_size
        self.top_k = int(top_k) if top_k is not None and top_k > 0 else None  # 0 / -1: off
        self.greedy = temperature is not None and temperature == 0

    def cover_hint(self, tied: bool = False) -> str:
        """A different N that covers the row: the request's top_k + 1 where that is more than was asked,
        else (a tie at the k-th value, or top_k unknown) twice the N asked."""
        if self.top_k is not None and self.top_k + 1 > self.n and not tied:
            more = f"logprobs={self.top_k + 1} (the request's top_k + 1)"
        else:
            more = f"logprobs={2 * self.n} or more" if self.n != -1 else "a larger logprobs="
        cap = f" (the engine's max_logprobs is {self.max_logprobs}: raise it too)" if self.max_logprobs else \
            " (and the engine's max_logprobs at least as large)"
        return f"{more}{cap}; for top-p / min-p only requests, see vllm_logprobs_settings"


def _choices(request, r: int):
    """(label, key, generated token ids, per position [(id, log-prob or None), ...]) per completion."""
    rid = get(request, "request_id", get(request, "id"))
    name = f"request {r}" + (f" (id {rid!r})" if rid is not None else "")
    if has(request, "token_ids") and not has(request, "choices") and not has(request, "outputs"):
        choices = [request]
    elif has(request, "outputs") or has(request, "choices"):
        choices = get(request, "outputs", None) if has(request, "outputs") else get(request, "choices")
        if choices is None:
            raise EngineOutputError(f"{name}: no completions (outputs / choices is null)")
        choices = as_list(choices, f"{name}: choices")
    else:
        raise EngineOutputError(f"{name}: neither a vLLM RequestOutput (outputs), a CompletionOutput (token_ids) "
                                f"nor an OpenAI-compatible response (choices): {type(request).__name__}")
    indexed = []
    for j, ch in enumerate(choices):
        idx = None if ch is None or isinstance(ch, (bool, int, float, str, list, tuple)) else get(ch, "index", j)
        if type(idx) is not int:
            raise EngineOutputError(f"{name} choice at position {j}: not a completion with an integer index")
        if idx in {i for i, _ in indexed}:
            raise EngineOutputError(f"{name}: two choices have index {idx}")
        indexed.append((idx, ch))
    for idx, ch in sorted(indexed, key=lambda p: p[0]):
        label = f"{name} choice {idx}"
        tokens, positions = _positions(ch, label)
        yield label, [rid if rid is not None else r, idx], tokens, positions


def _positions(ch, label: str):
    lp = get(ch, "logprobs")
    if lp is None:
        raise EngineOutputError(f"{label}: no logprobs (request logprobs=N with the engine's "
                                "logprobs_mode='processed_logprobs')")
    if isinstance(lp, dict) and "content" in lp:  # chat completions
        content = as_list(lp["content"] if lp["content"] is not None else [], f"{label}: logprobs.content")
        tokens, positions = [], []
        for t, e in enumerate(content):
            if not isinstance(e, dict) or "token" not in e or "top_logprobs" not in e:
                raise EngineOutputError(f"{label} token {t}: logprobs.content entry lacks 'token' / 'top_logprobs'")
            tok = _token_id(e["token"], f"{label} token {t}")
            tops = as_list(e["top_logprobs"] or [], f"{label} token {t}: top_logprobs")
            row = []
            for top in tops:
                if not isinstance(top, dict) or "token" not in top:
                    raise EngineOutputError(f"{label} token {t}: a top_logprobs entry lacks 'token'")
                row.append((_token_id(top["token"], f"{label} token {t}"), top.get("logprob")))
            if tok not in {i for i, _ in row}:  # vLLM always returns the sampled token: keep its value too
                row.append((tok, e.get("logprob")))
            tokens.append(tok)
            positions.append(row)
        return _check_token_ids(ch, tokens, label), positions
    if isinstance(lp, dict):  # completions
        for k in ("tokens", "top_logprobs"):
            if lp.get(k) is None:
                raise EngineOutputError(f"{label}: logprobs has no '{k}' (completions layout)")
        toks = as_list(lp["tokens"], f"{label}: logprobs.tokens")
        tops = as_list(lp["top_logprobs"], f"{label}: logprobs.top_logprobs")
        vals = as_list(lp.get("token_logprobs") or [None] * len(toks), f"{label}: logprobs.token_logprobs")
        if not len(toks) == len(tops) == len(vals):
            raise EngineOutputError(f"{label}: {len(toks)} tokens, {len(tops)} top_logprobs, {len(vals)} "
                                    "token_logprobs (truncated logprobs?)")
        tokens, positions = [], []
        for t, (tok, top, val) in enumerate(zip(toks, tops, vals)):
            tok = _token_id(tok, f"{label} token {t}")
            if not isinstance(top, dict):
                raise EngineOutputError(f"{label} token {t}: top_logprobs is {top!r}, expected a dict"[:300])
            row = [(_token_id(k, f"{label} token {t}"), v) for k, v in top.items()]
            if tok not in {i for i, _ in row}:
                row.append((tok, val))
            tokens.append(tok)
            positions.append(row)
        return _check_token_ids(ch, tokens, label), positions
    # offline CompletionOutput: token_ids + per position {id: Logprob}
    ids = get(ch, "token_ids")  # a list, a numpy array or a tensor: never its truth value
    tokens = as_list(ids if ids is not None else [], f"{label}: token_ids")
    positions = as_list(lp, f"{label}: logprobs")
    if len(positions) != len(tokens):
        raise EngineOutputError(f"{label}: {len(positions)} logprobs positions for {len(tokens)} generated tokens")
    rows = []
    for t, pos in enumerate(positions):
        if not hasattr(pos, "items"):
            raise EngineOutputError(f"{label} token {t}: logprobs position is {type(pos).__name__}, expected a "
                                    "dict token id -> Logprob")
        rows.append([(k, v if v is None or _is_real(v) else getattr(v, "logprob", v)) for k, v in pos.items()])
    return tokens, rows


def _token_id(token, where: str) -> int:
    """"token_id:123" (return_tokens_as_token_ids=True) -> 123; a decoded string cannot be mapped back."""
    match = _TOKEN_ID.fullmatch(token) if isinstance(token, str) else None
    if match:
        return int(match.group(1))
    raise EngineOutputError(f"{where}: token {token!r} is not 'token_id:<id>' (start the server with "
                            "--return-tokens-as-token-ids, or send return_tokens_as_token_ids=true)"[:300])


def _check_token_ids(ch, tokens: list, label: str) -> list:
    """Where the response also carries `token_ids` (vLLM's return_token_ids), they must agree."""
    ids = get(ch, "token_ids")
    if ids is not None and as_list(ids, f"{label}: token_ids") != tokens:
        raise EngineOutputError(f"{label}: token_ids disagree with the tokens of its logprobs")
    return tokens


def _value(v, where: str) -> float:
    if v is None:
        return -math.inf
    if not _is_real(v):
        raise EngineOutputError(f"{where}: log-prob {v!r} is not a number"[:300])
    v = float(v)
    if math.isnan(v) or v == math.inf:
        raise EngineOutputError(f"{where}: log-prob {v} is not a log-probability")
    return -math.inf if v <= JSON_NEG_INF else v


def _completion(label: str, key: list, tokens: list, positions: list, need: _Need) -> Completion:
    rows, entries, token_lps = [], [], []
    for t, (tok, row) in enumerate(zip(tokens, positions)):
        where = f"{label} token {t}"
        if not _is_int(tok):
            raise EngineOutputError(f"{where}: generated token {tok!r} is not an integer id")
        vals = {}
        for k, v in row:
            if not _is_int(k):
                raise EngineOutputError(f"{where}: log-prob entry id {k!r} is not an integer token id")
            if k in vals:
                raise EngineOutputError(f"{where}: token id {k} appears twice in its log-probs")
            vals[k] = _value(v, f"{where}, id {k}")
        if tok not in vals:
            raise EngineOutputError(f"{where}: its log-probs hold no entry for the generated token {tok}")
        if need.n != -1 and len(vals) > need.n + 1:
            raise EngineOutputError(f"{where}: {len(vals)} log-prob entries, more than logprobs={need.n} (+ the "
                                    "sampled token) allows: pass the logprobs= the requests used")
        if need.greedy:
            best = max(vals.values())
            if not -math.inf < vals[tok] <= 0:
                raise EngineOutputError(f"{where}: greedy (temperature 0) but the generated token {tok} has log-prob "
                                        f"{vals[tok]} (null / -inf, or above 0): not a log-probability")
            if vals[tok] < best:
                raise EngineOutputError(f"{where}: greedy (temperature 0) but the generated token {tok} is not the "
                                        "most probable entry")
            ids, lps = [int(tok)], [0.0]
        else:
            if vals[tok] == -math.inf:
                raise EngineOutputError(f"{where}: the generated token {tok} has log-prob -inf (or null): it is "
                                        "not in the support it was sampled from")
            ids = [int(k) for k, v in vals.items() if v > -math.inf]
            lps = [vals[k] for k in ids]
            _check_complete(where, len(ids), len(vals), lps, need)
        rows.append(ids)
        entries.append(lps)
        token_lps.append(lps[ids.index(tok)])
    return Completion(label, tokens, rows, token_lps, entries, key)


def _check_complete(where: str, n_finite: int, n_returned: int, lps: list, need: _Need) -> None:
    """The exactness guard: the finite entries are the whole support only if (a) they hold all
    the probability and (b) the engine returned fewer finite entries than asked for, or a -inf
    among them (a top-N list of N finite values may stop short of the support)."""
    whole_vocab = need.n == -1 or (need.vocab_size is not None and n_finite >= need.vocab_size)
    top = max(lps)
    mass = top + math.log(math.fsum(math.exp(v - top) for v in lps))
    if not whole_vocab and n_finite >= need.n and n_finite == n_returned:
        tied = _tied_at_k(lps, need)
        # complete only if one more tie (worth exp(tied)) would have failed the mass check
        if not (tied is not None and math.exp(tied) > 2 * ROW_MASS_TOLERANCE and abs(mass) <= ROW_MASS_TOLERANCE):
            why = (f" (the top_k {need.top_k}-th value is tied down to the last: vLLM keeps every tie of it)"
                   if tied is not None else "")
            raise EngineOutputError(f"{where}: {n_finite} finite log-probs of the {need.n} asked: the support may be "
                                    f"cut off{why}; ask for {need.cover_hint(tied is not None)}")
    if not abs(mass) <= ROW_MASS_TOLERANCE:
        raise EngineOutputError(f"{where}: the finite log-probs sum to probability {math.exp(mass):.6g}, not 1: "
                                "not processed log-probs (start the engine with logprobs_mode='processed_logprobs')")


def _tied_at_k(lps: list, need: _Need) -> Optional[float]:
    """The k-th largest value when every finite entry from the k-th on equals it (a tie at the top-k
    cut that fills the N asked), else None."""
    k = need.top_k
    if k is None or len(lps) <= k:
        return None
    ranked = sorted(lps, reverse=True)
    return ranked[k - 1] if ranked[k - 1] == ranked[-1] else None


@dataclass
class VllmLogprobsSettings:
    """What an engine and its requests need for `mask_from_vllm_logprobs`: `engine` (keyword arguments
    of vllm.LLM / flags of `vllm serve`), `request` (of SamplingParams / the request JSON, on top of
    the sampling settings), `logprobs` (the N to pass to the adapter) and `cost`, in words."""

    engine: dict
    request: dict
    logprobs: int
    cost: str
    sampling: dict = field(default_factory=dict)  # the sampling settings, a top_k cap applied


def vllm_logprobs_settings(*, temperature: float = 1.0, top_k: Optional[int] = None,
                           top_p: Optional[float] = None, min_p: Optional[float] = None,
                           vocab_size: Optional[int] = None, top_k_cap: Optional[int] = None) -> VllmLogprobsSettings:
    """The settings under which processed log-probs show the whole support.

    The support has at most top_k ids, so top_k + 1 log-probs always end in a -inf (or cover the
    vocabulary): the guard can tell the row is complete. A request with only top-p / min-p has a
    support of up to the whole vocabulary: that costs `vocab_size` log-probs per token, unless a
    `top_k_cap` is given, which adds top_k = cap to the sampling settings (a change of the sampled
    distribution whenever the top-p / min-p support is larger than the cap: say so in the run's
    records). Greedy (temperature 0) needs 1 log-prob: its support is the argmax."""
    if not _is_real(temperature) or not temperature >= 0 or not math.isfinite(temperature):
        raise EngineOutputError(f"temperature must be a finite number >= 0, got {temperature!r}")
    for name, v in (("top_p", top_p), ("min_p", min_p)):
        if v is not None and (not _is_real(v) or not 0 <= v <= 1):
            raise EngineOutputError(f"{name} must be in [0, 1], got {v!r}")
    if top_p is not None and top_p == 0:
        raise EngineOutputError("top_p = 0 keeps no token: vLLM refuses it, and so does this")
    for name, v in (("top_k", top_k), ("top_k_cap", top_k_cap), ("vocab_size", vocab_size)):
        if v is not None and not _is_int(v):
            raise EngineOutputError(f"{name} must be an integer, got {v!r}")
    if top_k is not None and top_k < -1:
        raise EngineOutputError(f"top_k must be >= 1, or 0 / -1 (off), got {top_k}")
    if top_k_cap is not None and top_k_cap < 1:
        raise EngineOutputError(f"top_k_cap must be >= 1, got {top_k_cap}")
    if vocab_size is not None and vocab_size < 1:
        raise EngineOutputError(f"vocab_size must be >= 1, got {vocab_size}")
    k = top_k if top_k is not None and top_k > 0 else None
    sampling = {"temperature": temperature, "top_k": top_k if top_k is not None else -1}
    if top_p is not None:
        sampling["top_p"] = top_p
    if min_p is not None:
        sampling["min_p"] = min_p
    if temperature == 0:
        n, cost = 1, "greedy: 1 log-prob per token (the support is the sampled argmax)"
    elif k is not None:
        n = k + 1
        cost = f"{n} log-probs per token (top_k {k} + 1, so that each row ends in a -inf)"
    elif top_k_cap is not None:
        k = top_k_cap
        sampling["top_k"] = k
        n = k + 1
        cost = (f"{n} log-probs per token, with top_k = {k} added to the sampling: the support is cut to "
                f"{k} ids where top-p / min-p would keep more")
    else:
        if vocab_size is None:
            raise EngineOutputError("a request without top_k (top-p / min-p only, or no truncation) may sample from "
                                    "the whole vocabulary: pass vocab_size (to ask for every log-prob) or top_k_cap")
        n = int(vocab_size)
        cost = (f"{n} log-probs per token (the whole vocabulary: top-p / min-p alone bound no support size); "
                "pass top_k_cap to ask for fewer")
    if vocab_size is not None and k is not None and k >= vocab_size:
        n = int(vocab_size)
    engine = {"logprobs_mode": "processed_logprobs", "max_logprobs": n}
    return VllmLogprobsSettings(engine=engine, request={"logprobs": n}, logprobs=n, cost=cost, sampling=sampling)
