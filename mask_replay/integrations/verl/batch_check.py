"""The driver's check that a rollout batch carries a recorded support row for every response token (no verl import).

With ``MASK_REPLAY_VERL=1``, a batch without supports means the rollout side did not record: the variable
did not reach a Ray worker, mask-replay's plugin failed to load there (verl logs a plugin's load error at
debug level only), or the rollout is not verl's vLLM server. The trainer would then compute verl's own
full-vocabulary log-probs, i.e. train without replay while the run says replay is on. driver.py calls
``check_batch_supports`` on each batch before verl's first log-prob pass, so such a run stops at its first
step, before any update, with one error naming the setting.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from mask_replay.errors import InputError
from mask_replay.integrations.verl.support_rows import SUPPORT_KEY

__all__ = ["check_batch_supports", "response_lengths"]

SETTING = "MASK_REPLAY_VERL"
_WHY = ("set MASK_REPLAY_VERL=1 in every Ray worker (main_ppo forwards it in the runtime env), check that "
        "mask_replay imports there, and use actor_rollout_ref.rollout.name=vllm")


def response_lengths(attention_mask: Any, prompt_length: int) -> np.ndarray:
    """Each sample's response length by verl's rule: the attention mask's sum over the response columns."""
    mask = np.asarray(attention_mask)
    if mask.ndim != 2 or not 0 <= prompt_length <= mask.shape[1]:
        raise InputError(f"attention_mask of shape {mask.shape} with a prompt of {prompt_length} columns",
                         key="attention_mask")
    return mask[:, prompt_length:].astype(np.int64).sum(axis=1)


def _rows(support: Any) -> int:
    if isinstance(support, Mapping):
        offsets = support.get("offsets")
    else:
        offsets = getattr(support, "offsets", None)
    if offsets is None:
        return -1
    offsets = np.asarray(offsets)
    return int(offsets.shape[0]) - 1 if offsets.ndim == 1 and offsets.shape[0] >= 1 else -1


def check_batch_supports(non_tensor_batch: Mapping[str, Any], lengths: Any) -> None:
    """One InputError naming MASK_REPLAY_VERL unless every sample's support has one row per response token.

    non_tensor_batch: the DataProto's non_tensor_batch; lengths: int [samples], each response's length."""
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if SUPPORT_KEY not in non_tensor_batch:
        raise InputError(f"{SETTING}=1 but the rollout batch carries no '{SUPPORT_KEY}': the rollout workers did "
                         "not record supports, so this run would train without replay", key=SETTING, hint=_WHY)
    supports = non_tensor_batch[SUPPORT_KEY]
    if len(supports) != lengths.shape[0]:
        raise InputError(f"{SETTING}=1: the batch has {lengths.shape[0]} responses but {len(supports)} "
                         f"'{SUPPORT_KEY}' entries", key=SETTING, hint=_WHY)
    for sample, (support, length) in enumerate(zip(supports, lengths)):
        if length == 0:
            continue
        rows = -1 if support is None else _rows(support)
        if rows != int(length):
            got = "no recorded support" if rows < 0 else f"{rows} support rows"
            raise InputError(f"{SETTING}=1: sample {sample} has {int(length)} response tokens but {got}; "
                             "this run would train that sample without replay", key=SETTING, hint=_WHY)
