"""How often capture's support equals the support the engines' released samplers draw from, per profile.

    python benchmarks/profile_agreement.py [--rows 1000] [--vocab 8192] [--engines hf,sglang,vllm]
        [--real logits.safetensors]

Synthetic LLM-like rows (a few large logits over a Gaussian body), in float32 and rounded to bfloat16
(ties everywhere), under five sampling configurations; --real adds a dump's `logits` (e.g. real-model
logits). Each engine runs its own code (tests/sampler/engine_runners.py); agreement = identical support.
Prints one line per (engine, config, dtype) with the share of rows where the `exact` profile and the
engine's own profile agree with the engine.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root

import mask_replay  # noqa: E402
from mask_replay.sampler.profiles import engine_support  # noqa: E402
from tests.sampler import engine_runners as er  # noqa: E402

CONFIGS = {
    "T1 p.9": dict(temperature=1.0, top_p=0.9),
    "T.7 k50 p.95": dict(temperature=0.7, top_k=50, top_p=0.95),
    "k50 p.9 mp.05": dict(top_k=50, top_p=0.9, min_p=0.05),
    "mp.1": dict(min_p=0.1),
    "k20": dict(top_k=20),
}


def llm_like(n, v, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * 1.5
    heads = torch.randint(0, v, (n, 24), generator=g)
    z.scatter_add_(1, heads, torch.rand(n, 24, generator=g) * 9 + 2)
    return z


def keep_of(z, profile, kw):
    if profile == "exact":
        m = mask_replay.capture(z, **kw)
        keep = torch.zeros(z.shape, dtype=torch.bool)
        rows = torch.repeat_interleave(torch.arange(z.shape[0]), m.lengths())
        keep[rows, m.token_ids.long()] = True
        return keep
    return engine_support(z, profile, return_keep=True, **kw)[3]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1000, help="synthetic rows per cell (0: none)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--engines", default="hf,sglang,vllm")
    ap.add_argument("--real", default=None, help="a dump whose `logits` are added as a third input")
    args = ap.parse_args()
    inputs = {}
    if args.rows > 0:  # --rows 0: only the --real logits
        z = llm_like(args.rows, args.vocab, 0)
        inputs["fp32"] = z
        inputs["bf16"] = z.to(torch.bfloat16).float()
    if args.real:
        from safetensors.torch import load_file

        real = load_file(args.real)["logits"]
        inputs[f"real-{real.dtype}".replace("torch.", "")] = real.float()
    batches = [(name, cfg, x) for cfg in CONFIGS for name, x in inputs.items()]
    engines = [e for e in args.engines.split(",") if e]
    results = {}
    t0 = time.perf_counter()
    if "vllm" in engines:
        keeps = er.vllm_keep_many([(x, CONFIGS[cfg]) for _, cfg, x in batches])
        results["vllm"] = dict(zip([(n, c) for n, c, _ in batches], keeps))
    if "sglang" in engines:
        results["sglang"] = {(n, c): er.sglang_keep(x, capture_path=False, **CONFIGS[c]) for n, c, x in batches}
        results["sglang-capture-path"] = {(n, c): er.sglang_keep(x, capture_path=True, **CONFIGS[c])
                                          for n, c, x in batches}
    if "hf" in engines:
        results["hf"] = {(n, c): er.hf_keep(x, **CONFIGS[c]) for n, c, x in batches}
    print(f"engines ran in {time.perf_counter() - t0:.0f} s; rows per cell: {args.rows}, vocab {args.vocab}")
    print(f"{'engine':22s} {'config':15s} {'input':10s} {'exact':>8s} {'profile':>8s}")
    logits_of = {(n, c): x for n, c, x in batches}
    for engine, res in results.items():
        profile = engine.split("-")[0]
        for (name, cfg), ref in res.items():
            x = logits_of[(name, cfg)]
            rates = []
            for prof in ("exact", profile):
                same = (keep_of(x, prof, CONFIGS[cfg]) == ref).all(1)
                rates.append(100.0 * float(same.double().mean()))
            print(f"{engine:22s} {cfg:15s} {name:10s} {rates[0]:7.2f}% {rates[1]:7.2f}%")


if __name__ == "__main__":
    main()
