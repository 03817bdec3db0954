"""The experiment's task: two-number additions answered by a number, from a prompt set shipped with the
package (data/experiment_prompts.json, split into train and held-out prompts), and the reward read from
the answer's text.

Reward in [0, 1]: 0.5 when the answer starts with an integer (the format the prompt asks for) plus
0.5 / (1 + |n - sum|) for the first integer n of the answer: 0.5 for the sum, 0.25 one off, and so on.
SmolLM2-135M-Instruct mostly restates the question ("14 + 17 = ...") at first, so the format half is
what the first steps move; the graded half keeps a signal inside a group after that (an all-or-nothing
sum gave every answer of a group the same reward within two steps, and GRPO advantages of zero).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from mask_replay.errors import DumpError

PROMPTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "experiment_prompts.json")
SYSTEM_PROMPT = "Answer briefly."  # replaces the chat template's long default system prompt (shorter rollouts)
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    prompt: str

    @property
    def answer(self) -> int:
        return self.a + self.b


def load_prompts(path: str = PROMPTS_FILE) -> dict:
    """{"train": [Problem], "held_out": [Problem]}; errors name the file and the key."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise DumpError(f"{path}: cannot read the prompt set ({exc})") from None
    template = data.get("template") if isinstance(data, dict) else None
    if not isinstance(template, str):
        raise DumpError(f"{path}: key 'template': missing or not a string")
    out = {}
    for split in ("train", "held_out"):
        items = data.get(split)
        if not isinstance(items, list) or not items:
            raise DumpError(f"{path}: key '{split}': missing or empty")
        problems = []
        for i, item in enumerate(items):
            if not (isinstance(item, dict) and isinstance(item.get("a"), int) and isinstance(item.get("b"), int)):
                raise DumpError(f"{path}: key '{split}': item {i} is not {{'a': int, 'b': int}}")
            problems.append(Problem(item["a"], item["b"], template.format(a=item["a"], b=item["b"])))
        out[split] = problems
    return out


def reward(text: str, problem: Problem) -> float:
    """0.5 for an answer that starts with an integer, plus 0.5 / (1 + distance of its first integer from
    the sum)."""
    stripped = text.strip()
    first = _INTEGER.search(stripped)
    if first is None:
        return 0.0
    starts = first.start() == 0
    return 0.5 * starts + 0.5 / (1 + abs(int(first.group()) - problem.answer))


def encode(tokenizer, problems):
    """Left-padded batch of chat prompts (a tokenizer without a chat template gets the bare prompt)."""
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                                {"role": "user", "content": p.prompt}],
                                               tokenize=False, add_generation_prompt=True) for p in problems]
    else:
        texts = [p.prompt for p in problems]
    return tokenizer(texts, return_tensors="pt", padding=True)
