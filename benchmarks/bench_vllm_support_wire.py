"""What the vLLM plugin's support blocks cost between engine and API, and in the API process (issue 44 §3).

Run with the engine venv's Python (real vLLM classes: `LogprobsTensors.tolists`, `LogprobsLists.
slice_request`, `EngineCoreOutput(s)` and vLLM's `MsgpackEncoder`, the path a step takes from the engine
core to the API process):

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/bench_vllm_support_wire.py \
        --logits /tmp/smol_logits.safetensors   # benchmarks/real_logits.py --dtype float32
    PYTHONPATH=$PWD .venv-vllm-034/bin/python benchmarks/bench_vllm_support_wire.py \
        --logits /tmp/smol_logits.safetensors --ids-dtype int64   # vLLM 0.34's classes, MRV2's int64 ids

1. bytes: per (V, B, sampling) one decode step of B requests whose supports come from real SmolLM2 logits
   (rows taken in turn from the dump, T = 1; top-p by vLLM's rule, top-k with ties kept; a sampled id drawn
   from each support). `wire.encode` on the rows, then the plugin's narrowing wrappers on vLLM's own
   `tolists` / `slice_request`, each request's `EngineCoreOutput` encoded by vLLM's `MsgpackEncoder`:
   the bytes the blocks add to the message (with minus without them), per token, against the CSR minimum
   (min(4 |K|, V / 8) + 8 bytes a row; the whole vocabulary costs its 8-byte header here, below that).
   Also the device-to-host bytes of the fixed-width tensor (a DMA the host never reads past each row's
   prefix), and what the issue-38 wire sent (every row padded to the step's widest). V = 151,936: the
   same supports with their ids scattered through a fixed random injection of [0, 49152) into
   [0, 151936) (SmolLM2 has 49,152 ids); untruncated rows there are the whole 151,936.
2. API: a recorded stream (T steps of B requests, one token each, the engine core's per-request lists)
   driven through the plugin's `_update_sample_logprobs` / `_new_completion_output` wrappers on
   vLLM-shaped stand-ins whose own bodies do nothing, against the same stand-ins unwrapped, alternated,
   medians (the recorded stream frozen out of the garbage collector's scans, as vLLM freezes its start-up
   heap; the collector on while timing): wrapped minus unwrapped per token, for DELTA and CUMULATIVE streams
   (an output every step: AsyncLLM's streaming, verl's rollout server) and FINAL_ONLY (`LLM.generate`, TRL
   colocate); then the first read of the supports (the lazy decode) per token: every DELTA output, each request's last
   CUMULATIVE / FINAL_ONLY output.
3. encode (`--parts encode`): the sampler half's host work on a CPU engine per step of B = 1, 8, 32, 256 real
   rows (`> -inf` and `wire.encode`'s numpy path), against a softmax of the same [B, V] logits timed in the
   same loop; its share of an engine step is this over the step time `bench_vllm_support.py` gives.
Prints one JSON line per figure, then `RESULT {...}`.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import numpy as np
import torch

from mask_replay.integrations.vllm_support import _patching, narrowing, outputs, wire

SETTINGS = {"top_p 0.9": ("top_p", 0.9), "top_p 0.95": ("top_p", 0.95), "top_p 0.99": ("top_p", 0.99),
            "top_k 50": ("top_k", 50), "untruncated": ("none", None)}
SMALL_V = 49152


def supports_of(logits: torch.Tensor, kind: str, value) -> torch.Tensor:
    """bool [B, V]: the rows' supports at T = 1 (vLLM's top-p: drop a token when the mass before it, in
    descending order, already exceeds p; top-k: every logit >= the k-th, ties kept)."""
    z = logits.float()
    if kind == "none":
        return torch.ones_like(z, dtype=torch.bool)
    if kind == "top_k":
        kth = z.topk(value, dim=-1).values[:, -1:]
        return z >= kth
    order = z.argsort(-1, descending=True)
    probs = z.gather(1, order).softmax(-1)
    keep_sorted = (probs.cumsum(-1) - probs) <= value
    return torch.zeros_like(z, dtype=torch.bool).scatter(1, order, keep_sorted)


def scattered(support: torch.Tensor, vocab: int, injection: torch.Tensor, untruncated: bool) -> torch.Tensor:
    if untruncated:
        return torch.ones(support.shape[0], vocab, dtype=torch.bool)
    out = torch.zeros(support.shape[0], vocab, dtype=torch.bool)
    out[:, injection] = support
    return out


def drawn(support: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.multinomial(support.float(), 1, generator=g)[:, 0]


def step_lists(support: torch.Tensor, sampled: torch.Tensor, LogprobsTensors, with_blocks: bool, ids_dtype):
    """One decode step as the engine core sees it after the device-to-host copy: N = 0 (ids = the
    sampled token, then the blocks; int64 ids, MRV2's, hold two block words a column)."""
    ids = sampled[:, None].to(ids_dtype)
    if with_blocks:
        ids = torch.cat([ids, wire.as_columns(wire.encode(support, sampled), ids_dtype)], 1)
    rows = support.shape[0]
    return LogprobsTensors(ids, torch.zeros(rows, 1), torch.zeros(rows, dtype=torch.int64)).tolists()


def message_bytes(lists, EngineCoreOutput, EngineCoreOutputs, encoder) -> int:
    outs = [EngineCoreOutput(request_id=f"r{r}", new_token_ids=[int(lists.logprob_token_ids[r, 0])],
                             new_logprobs=lists.slice_request(r, 1)) for r in range(lists.logprob_token_ids.shape[0])]
    return sum(len(memoryview(b).cast("B")) for b in encoder.encode(EngineCoreOutputs(outputs=outs)))


def bytes_figures(logits, vocab, rows, setting, classes, g, ids_dtype) -> dict:
    LogprobsTensors, EngineCoreOutput, EngineCoreOutputs, encoder, injection = classes
    kind, value = SETTINGS[setting]
    start = int(torch.randint(0, logits.shape[0], (1,), generator=g))
    take = logits[(start + torch.arange(rows)) % logits.shape[0]]
    support = supports_of(take, kind, value)
    if vocab != SMALL_V:
        support = scattered(support, vocab, injection, kind == "none")
    sampled = drawn(support, g)
    counts = support.sum(1).numpy().astype(np.int64)
    words = wire.bitmask_words(vocab)
    with_b = message_bytes(step_lists(support, sampled, LogprobsTensors, True, ids_dtype), EngineCoreOutput,
                           EngineCoreOutputs, encoder)
    without = message_bytes(step_lists(support, sampled, LogprobsTensors, False, ids_dtype), EngineCoreOutput,
                            EngineCoreOutputs, encoder)
    csr_min = np.minimum(4 * counts, vocab / 8) + 8
    listed = counts[counts <= words]
    old_width = words if ((counts > words) & (counts < vocab)).any() else (listed.max() if listed.size else 0)
    return {"V": vocab, "B": rows, "sampling": setting, "ids": str(ids_dtype).removeprefix("torch."),
            "mean_support": round(float(counts.mean()), 1),
            "wire_bytes_per_token": round((with_b - without) / rows, 1),
            "csr_min_bytes_per_token": round(float(csr_min.mean()), 1),
            "ratio": round((with_b - without) / float(csr_min.sum()), 3),
            "d2h_bytes_per_token": 4 * (wire.HEADER + words),
            "issue38_bytes_per_token": 4 * (wire.HEADER + int(old_width))}


class Output:
    __slots__ = ("token_ids", "sampling_support")

    def __init__(self, token_ids):
        self.token_ids = token_ids


def stand_ins():
    """LogprobsProcessor / RequestState with vLLM 0.32's signatures and nothing in their bodies: what is
    timed is the plugin's wrappers alone."""

    class LogprobsProcessor:
        def _update_sample_logprobs(self, logprobs_lists):
            return None

    class RequestState:
        def __init__(self, request_id, output_kind):
            self.request_id, self.output_kind, self.logprobs_processor = request_id, output_kind, LogprobsProcessor()

        def _new_completion_output(self, token_ids, finish_reason, stop_reason):
            return Output(token_ids)

    return LogprobsProcessor, RequestState


def drive(state_cls, stream, rows, kind) -> tuple[float, list]:
    """(seconds, the outputs made): DELTA an output of the new token every step, CUMULATIVE of all tokens so
    far every step, FINAL_ONLY of all tokens at the end."""
    states = [state_cls(f"r{r}", kind) for r in range(rows)]
    new, prefixes = [7], [[7] * (s + 1) for s in range(len(stream))]
    made = []
    t = time.perf_counter()
    for s, step in enumerate(stream):
        out_now = kind != "FINAL_ONLY" or s == len(stream) - 1
        for state, lists in zip(states, step):
            state.logprobs_processor._update_sample_logprobs(lists)
            if out_now:
                made.append(state._new_completion_output(new if kind == "DELTA" else prefixes[s], None, None))
    return time.perf_counter() - t, made


def api_figures(logits, setting, rows, steps, reps, classes, g, ids_dtype) -> dict:
    LogprobsTensors = classes[0]
    kind, value = SETTINGS[setting]
    stream = []
    for s in range(steps):
        take = logits[(s * rows + torch.arange(rows)) % logits.shape[0]]
        support = supports_of(take, kind, value)
        lists = step_lists(support, drawn(support, g), LogprobsTensors, True, ids_dtype)
        stream.append([lists.slice_request(r, 1) for r in range(rows)])
    # The recorded stream is this benchmark's fixture, not the API process's heap (there each step's lists are
    # gone after the step): frozen out of the collector's scans, as vLLM freezes its static heap after start-up
    # (vllm/utils/gc_utils.py freeze_gc_heap). The collector stays on while timing: what the wrappers allocate
    # pays its collections.
    gc.collect()
    gc.freeze()
    figures = {}
    for kind in ("DELTA", "CUMULATIVE", "FINAL_ONLY"):
        plain_t, wrapped_t, read_t = [], [], []
        for rep in range(reps):
            for wrapped in ((False, True) if rep % 2 == 0 else (True, False)):
                processor_cls, state_cls = stand_ins()
                if wrapped:
                    outputs.install(processor_cls, state_cls, "DELTA")
                made = None
                gc.collect()  # the previous run's outputs gone before this one starts
                dt, made = drive(state_cls, stream, rows, kind)
                if wrapped:  # the reader: every DELTA output (each holds its own rows), else each request's last
                    read = made if kind == "DELTA" else made[-rows:]
                    t = time.perf_counter()
                    for out in read:
                        out.sampling_support.token_ids
                    read_t.append(time.perf_counter() - t)
                    _patching.undo()
                (wrapped_t if wrapped else plain_t).append(dt)
        tokens = rows * steps
        figures[kind] = {"wrapper_us_per_token": round((statistics.median(wrapped_t) - statistics.median(plain_t))
                                                         / tokens * 1e6, 3),
                          "unwrapped_us_per_token": round(statistics.median(plain_t) / tokens * 1e6, 3),
                          "lazy_decode_us_per_token": round(statistics.median(read_t) / tokens * 1e6, 3)}
    gc.unfreeze()
    return {"sampling": setting, "B": rows, "steps": steps, **figures}


def encode_figures(logits, rows, setting, reps) -> dict:
    """The sampler half's host work on a CPU engine, per step of `rows` real rows: the support read off the
    processed logits (`> -inf`) and `wire.encode` (its numpy path), against a softmax of the same logits
    timed in the same loop (what the sampler computes anyway for its log-probs)."""
    kind, value = SETTINGS[setting]
    take = logits[torch.arange(rows) % logits.shape[0]]
    support = supports_of(take, kind, value)
    processed = take.masked_fill(~support, float("-inf"))
    sampled = drawn(support, torch.Generator().manual_seed(rows))
    plugin_t, softmax_t = [], []
    for _ in range(reps):
        t = time.perf_counter()
        wire.encode(processed > float("-inf"), sampled, None)
        plugin_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.softmax(processed, dim=-1)
        softmax_t.append(time.perf_counter() - t)
    plugin, softmax = statistics.median(plugin_t), statistics.median(softmax_t)
    return {"B": rows, "sampling": setting, "plugin_ms_per_step": round(plugin * 1e3, 3),
            "softmax_ms_per_step": round(softmax * 1e3, 3), "plugin_over_softmax": round(plugin / softmax, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--logits", required=True, help="a dump of benchmarks/real_logits.py (float32)")
    ap.add_argument("--steps", type=int, default=64, help="steps of the API stream")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--api-batch", type=int, default=256)
    ap.add_argument("--parts", default="bytes,api", help="which figures, comma-separated: bytes, api, encode")
    ap.add_argument("--ids-dtype", default="int32", choices=("int32", "int64"),
                    help="the log-prob id tensor's dtype: int32 (the V1 runner's) or int64 (Model Runner V2's)")
    args = ap.parse_args()
    from safetensors.torch import load_file
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors
    from vllm.v1.serial_utils import MsgpackEncoder

    torch.set_num_threads(1)
    ids_dtype = getattr(torch, args.ids_dtype)
    logits = load_file(args.logits)["logits"].float()
    assert logits.shape[1] == SMALL_V, logits.shape
    g = torch.Generator().manual_seed(0)
    injection = torch.randperm(151936, generator=g)[:SMALL_V]
    narrowing.install(LogprobsTensors, LogprobsLists)
    classes = (LogprobsTensors, EngineCoreOutput, EngineCoreOutputs, MsgpackEncoder(), injection)
    results = {"bytes": [], "api": [], "encode": []}
    for vocab in (SMALL_V, 151936) if "bytes" in args.parts else ():
        for rows in (1, 64, 256):
            for setting in SETTINGS:
                fig = bytes_figures(logits, vocab, rows, setting, classes, g, ids_dtype)
                results["bytes"].append(fig)
                print(json.dumps(fig), flush=True)
    for rows in (1, 8, 32, 256) if "encode" in args.parts else ():
        for setting in ("top_p 0.9", "top_k 50", "untruncated"):
            fig = encode_figures(logits, rows, setting, 9 * args.reps)
            results["encode"].append(fig)
            print(json.dumps(fig), flush=True)
    for setting in SETTINGS if "api" in args.parts else ():
        fig = api_figures(logits, setting, args.api_batch, args.steps, args.reps, classes, g, ids_dtype)
        results["api"].append(fig)
        print(json.dumps(fig), flush=True)
    _patching.undo()
    import vllm
    print("RESULT " + json.dumps({"vllm": vllm.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                  "load_avg": os.getloadavg()[0], **results}))


if __name__ == "__main__":
    main()
