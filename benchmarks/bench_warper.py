"""Per decoding step: SupportWarper (the capture kernel as a transformers warper, recording the mask)
against transformers' own warper chain in generate's order, and the cost MaskRecorder adds to it.

    python benchmarks/bench_warper.py [--reps 9] [--shapes 8x49152,64x151936]

Each configuration times one step on fp32 scores [B, V] (what generate hands the processors):
  hf chain          transformers' TemperatureLogitsWarper/TopK/TopP as generate builds them
  hf chain+recorder the same with MaskRecorder (and its kept-mass reference) appended
  SupportWarper     one capture pass, -inf outside the support, the mask recorded
Medians in ms (all rows of one shape run round-robin) and ratios in the same run. Logits are
LLM-like (benchmarks/bench_capture.py).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_capture import llm_logits, median_ms  # noqa: E402

from mask_replay.integrations.transformers import MaskRecorder, SupportWarper, hf_warpers  # noqa: E402

CONFIGS = {"top_k=50 top_p=0.9": dict(top_k=50, top_p=0.9),
           "T=1 top_p=0.9": dict(top_p=0.9),
           "T=0.7 top_k=50 top_p=0.95": dict(temperature=0.7, top_k=50, top_p=0.95)}


def step(processors, scores, ids, recorders=()):
    for r in recorders:
        r.reset()  # one decoding step of a fresh generation each time
    x = scores
    for p in processors:
        x = p(ids, x)
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--shapes", default="8x49152,64x151936")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f}")
    for shape in args.shapes.split(","):
        b, v = (int(s) for s in shape.split("x"))
        scores = llm_logits(b, v, torch.float32)
        ids = torch.zeros(b, 1, dtype=torch.long)
        for name, params in CONFIGS.items():
            chain = hf_warpers(**params)
            rec = MaskRecorder()
            chain_rec = hf_warpers(**params, reference=rec.reference) + [rec]
            warper = SupportWarper(**params)
            # the same support up to ties at the cuts (SupportWarper keeps tie groups whole)
            same = torch.isfinite(step(chain, scores, ids)) == torch.isfinite(step([warper], scores, ids, [warper]))
            t = median_ms({
                "hf": lambda: step(chain, scores, ids),
                "hf+rec": lambda: step(chain_rec, scores, ids, [rec]),
                "sw": lambda: step([warper], scores, ids, [warper]),
            }, args.reps)
            print(f"[{b}, {v}] {name:26s} hf chain {t['hf']:8.2f} ms  +recorder {t['hf+rec']:8.2f} ms "
                  f"({t['hf+rec'] - t['hf']:+.2f})  SupportWarper {t['sw']:7.2f} ms  "
                  f"speed-up {t['hf'] / t['sw']:5.1f}x  rows identical {float(same.all(1).float().mean()):.3f}")


if __name__ == "__main__":
    main()
