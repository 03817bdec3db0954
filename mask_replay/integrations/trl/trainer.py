"""Replay inside TRL's GRPOTrainer (trl 1.16.x): `ReplayGRPOTrainer`, a drop-in subclass.

    trainer = ReplayGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(top_p=0.9, ...), ...)

takes every GRPOTrainer argument. What it changes (read against trl 1.16.0, trainer/grpo_trainer.py):

- generation (transformers, `use_vllm=False`): TRL samples with `model.generate(generation_config=...)`.
  For that call only, generate's own warpers are switched off and transformers' warpers for TRL's
  sampling options (temperature, top_k, top_p, min_p, from the generation config TRL built, so
  `generation_kwargs` count) run in the caller's `logits_processor`, a MaskRecorder last: the
  support recorded is the one transformers sampled from. One SamplingMask per completion (a row per
  completion token) stays on the trainer; the batch carries only `replay_index` [B], which TRL's
  shuffle and split move with the sample like any other per-sample tensor.
- loss side: `_get_per_token_logps_and_entropies`, TRL's one place for old, current and reference
  log-probs, returns log-probs renormalised over each token's recorded support, from the LM head
  weight and the backbone's hidden states (`replay_logprobs_from_hidden`, O(support x d), no
  [tokens, V] logits), with TRL's logit transform (logit_scale folded into the temperature). TRL's
  own fused head still runs (its entropy is what TRL logs and uses, unchanged); a token whose support
  is the whole vocabulary keeps TRL's own log-prob, so with no truncation nothing changes at all.
- metrics `replay/kept_mass/mean` and `replay/support_size/mean` in TRL's logs.

- vLLM generation (`use_vllm=True`, colocate or server; `vllm_mode.py`): with mask_replay's vLLM plugin
  on (MASK_REPLAY_VLLM_SUPPORT=1 where vLLM starts) each completion's support comes with the engine's
  output and vLLM is asked for nothing more than plain TRL asks; without it, the engine is asked for the
  processed log-probs that show the support (top_k + 1, or `replay_top_k_cap` + 1 with that top_k added;
  top-p / min-p alone is refused at construction with the fix) and TRL's sampling log-prob is handed the
  sampled token's entry. Never recomputed on the trainer side.

Public API: `ReplayGRPOTrainer(*GRPOTrainer args, replay_top_k_cap=None, **GRPOTrainer kwargs)`,
`INDEX_KEY`, `TESTED_TRL`; attributes `replay_vllm_support` (vLLM mode: where the supports come from) and
`replay_vllm_settings` (the processed log-probs the engine was asked for; None with the plugin).

Not built yet (each a clear error): transformers continuous batching, tools / environments /
rollout_func (their completions hold tokens nobody sampled), models with a logit multiplier other
than `logit_scale`. A final logit softcap (Gemma 2) takes `softcap.py`'s path: the support's
logits gathered per chunk of rows (O(nnz x d), recomputed in the backward), TRL's transform applied.
"""
from __future__ import annotations

import copy
import numbers
from contextlib import contextmanager
from typing import Optional

import torch
from torch.distributed.tensor import Partial

try:  # trl and transformers are optional dependencies of mask_replay: pip install 'mask-replay[trl]'
    import trl
    from transformers import LogitsProcessorList
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError("mask_replay.integrations.trl needs trl 1.16: pip install 'mask-replay[trl]'") from exc

from mask_replay.errors import InputError
from mask_replay.integrations.transformers import WARPERS_OFF, MaskRecorder, hf_warpers
from mask_replay.integrations.trl import vllm_mode
from mask_replay.integrations.trl.shadow import shadowed
from mask_replay.integrations.trl.softcap import softcapped_support_logprobs
from mask_replay.mask import SamplingMask
from mask_replay.trainer.replay import replay_logprobs_from_hidden

__all__ = ["ReplayGRPOTrainer", "INDEX_KEY", "TESTED_TRL"]

TESTED_TRL = "1.16"
INDEX_KEY = "replay_index"  # the batch key carrying each sample's mask id through TRL's shuffle/split

if not trl.__version__.startswith(TESTED_TRL + "."):
    raise ImportError(f"mask_replay.integrations.trl is built and tested against trl {TESTED_TRL}.x, "
                      f"found trl {trl.__version__}: pip install 'trl=={TESTED_TRL}.0'")

# generation options with a truncation no recorder here reproduces, and their "off" values
_UNRECORDED = {"typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "top_h": (None,),
               "num_beams": (None, 1)}
# generate's own warpers switched off for the recorded call. A generation_config passed to generate has
# its None values filled from the model's own (transformers 5.24.0, `_prepare_generation_config`), so
# min_p is off as 0 (keeps every token); a model's top_h is refused (_UNRECORDED), none is left to fill.
_CALL_OFF = {**WARPERS_OFF, "min_p": 0.0}
# logit multipliers TRL's fused head knows besides logit_scale; not folded here yet
_OTHER_SCALES = ("output_multiplier", "lm_head_multiplier", "logits_scaling")


def _check_top_k_cap(cap) -> None:
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Integral) or cap < 1):
        raise InputError(f"replay_top_k_cap must be an integer >= 1 or None, got {cap!r}")


def _check_generation_kwargs(cfg) -> None:
    """GRPOConfig.generation_kwargs, both generation modes: the temperature replay renormalises at is
    GRPOConfig.temperature, so a different one there would record at one and replay at the other."""
    given = getattr(cfg, "generation_kwargs", None)
    if isinstance(given, dict) and "temperature" in given and given["temperature"] != cfg.temperature:
        raise InputError(f"generation_kwargs temperature={given['temperature']!r} differs from GRPOConfig.temperature="
                         f"{cfg.temperature!r}: replay renormalises at GRPOConfig's (set the temperature there)")


def _refuse(what: str, why: str) -> None:
    raise NotImplementedError(f"ReplayGRPOTrainer: {what} is not supported yet ({why})")


def _logit_scale(config) -> float:
    """The factor TRL's fused head multiplies the logits by, or an error where replay cannot match it."""
    text = config.get_text_config()
    for name in _OTHER_SCALES:
        if getattr(text, name, None) is not None:
            _refuse(f"a model config with {name}", "only logit_scale is folded into the temperature")
    scale = getattr(text, "logit_scale", None)
    scale = 1.0 if scale is None else float(scale)
    if not scale > 0:
        _refuse(f"logit_scale {scale}", "a non-positive scale cannot be folded into the temperature")
    return scale


def _gathered(param):
    """The whole of a sharded (DTensor) parameter, its gradient averaged back onto the shards.

    A plain `full_tensor()` hands each rank only its own batch's gradient for its shard (its backward
    takes the local chunk of a gradient it assumes replicated), which FSDP2's reduce-scatter never
    sees: the ranks' updates would differ. "avg" over every mesh dimension is FSDP2's mean over the
    data-parallel ranks, and leaves a gradient that is already equal on all ranks (a tensor-parallel
    dimension, same batch) unchanged."""
    return param.full_tensor(grad_placements=[Partial("avg")] * param.device_mesh.ndim)


def _per_sequence(mask: SamplingMask, lengths: list[int], *, completions=None, eos=(),
                  vocab_size: Optional[int] = None) -> list[SamplingMask]:
    """The recorder's mask (rows sequence-major) cut into one mask per completion; a completion whose
    token count differs from its rows is an error naming it and the first position without a row.
    With `completions`, a completion longer than its rows whose last row is one of `eos` (generate's
    EOS, from generation_kwargs, not the tokenizer's that TRL cuts at) gets whole-vocabulary rows for
    generate's padding after it: nobody sampled those tokens, and replay keeps TRL's own log-prob there."""
    counts = torch.bincount(mask.extras["sequence"].long().cpu(), minlength=len(lengths)).tolist()
    out, start = [], 0
    for i, (rows, tokens) in enumerate(zip(counts, lengths)):
        part = mask.select_rows(start, start + rows)
        start += rows
        if completions is not None and 0 < rows < tokens and int(part.sampled[-1]) in eos:
            part = SamplingMask.concat([part, _unsampled_rows(completions[i][rows:], vocab_size, part)])
        elif rows != tokens:
            raise InputError(f"completion {i}: the recorded support has {rows} rows but the completion has "
                             f"{tokens} tokens (first position without a match: {min(rows, tokens)})")
        out.append(part)
    return out


def _unsampled_rows(tokens, vocab_size: int, like: SamplingMask) -> SamplingMask:
    """Whole-vocabulary rows for tokens nobody sampled (kept mass 1), with `like`'s per-row fields."""
    n = len(tokens)
    fields = {"sampled": torch.as_tensor(list(tokens), dtype=torch.int64)}
    if like.kept_mass is not None:
        fields["kept_mass"] = torch.ones(n, dtype=like.kept_mass.dtype)
    return SamplingMask(torch.arange(vocab_size, dtype=torch.int32).repeat(n),
                        torch.arange(n + 1, dtype=torch.int64) * vocab_size, **fields).to(like.device)


def _adapter_state(model):
    """A PEFT model's (adapters enabled, active adapters), None for a plain model: TRL scores its
    reference with the policy's own module, the adapter disabled or switched to "ref"."""
    if not hasattr(model, "peft_config") or not hasattr(model, "has_active_enabled_adapter"):  # peft's PeftModel
        return None
    return bool(model.has_active_enabled_adapter), tuple(model.active_adapters)


@contextmanager
def _recording_generate(model, chain: list, recorder: MaskRecorder, eos, captured: dict):
    """For the duration, `model.generate` also runs `chain` (recorder last) and tells the recorder which
    sequences its stopping criteria end; the output is kept in `captured`."""
    original = model.generate

    def generate(*args, **kwargs):
        recorder.reset()
        recorder.eos_token_id = eos
        kwargs["logits_processor"] = LogitsProcessorList(list(kwargs.get("logits_processor") or []) + chain)
        kwargs["stopping_criteria"] = recorder.watch(kwargs.get("stopping_criteria"))
        captured["output"] = original(*args, **kwargs)
        return captured["output"]

    with shadowed(model, generate=generate):  # an instance attribute: shadows the method for this call only
        yield


class ReplayGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose log-probs are renormalised over the support each token was sampled from."""

    def __init__(self, *args, replay_top_k_cap: Optional[int] = None, **kwargs):
        cfg = kwargs.get("args", args[2] if len(args) > 2 else None)
        if cfg is not None and getattr(cfg, "use_transformers_continuous_batching", False):
            _refuse("use_transformers_continuous_batching=True", "generate_batch takes no logits processor")
        _check_top_k_cap(replay_top_k_cap)
        if cfg is not None:
            _check_generation_kwargs(cfg)
        super().__init__(*args, **kwargs)
        if self.tools or self.rollout_func is not None or self.environment_factories is not None:
            _refuse("tools, environments or rollout_func", "their completions hold tokens nobody sampled")
        self._replay_scale = _logit_scale(self.accelerator.unwrap_model(self.model).config)
        # a final softcap is not linear in the logits: that path gathers the support's logits (softcap.py)
        self._replay_softcap = getattr(self.accelerator.unwrap_model(self.model).config.get_text_config(),
                                       "final_logit_softcapping", None)
        self._replay_top_k_cap = replay_top_k_cap
        # the policy's adapter state (PEFT): kept mass is measured in it, never with the reference's
        self._replay_policy_adapter = _adapter_state(self.accelerator.unwrap_model(self.model))
        if not self.use_vllm:  # every sampling source checked now: refused by name, or recorded
            self._sampling()
        self._replay_masks: dict[int, SamplingMask] = {}
        self._replay_owned = {"train": [], "eval": []}  # ids of each mode's latest generation
        self._replay_next = 0
        self._replay_active = None  # replay_index [B] of the batch being scored
        self.replay_vllm_support = self.replay_vllm_settings = None
        if self.use_vllm:  # the plugin's supports, or the log-probs that show them (vllm_mode.py)
            self.replay_vllm_support = vllm_mode.configure_engine(
                self.vllm_generation, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                min_p=self.min_p, vocab_size=self._replay_vocab_size(), top_k_cap=replay_top_k_cap)
            self.replay_vllm_settings = self.replay_vllm_support.settings

    # -- generation ---------------------------------------------------------------------------------
    def _sampling(self):
        """(temperature, top_k, top_p, min_p, EOS ids) that `generate` samples with: TRL's generation config
        (GRPOConfig, generation_kwargs) completed from the model's own generation config and then
        transformers' defaults (top_k 50 where none is set), as generate completes it (transformers
        5.24.0, generation/utils.py, `_prepare_generation_config`, which is called here); `top_k` is
        replay_top_k_cap where none is set. An option whose support no recorder here reproduces is an
        InputError naming the key and where it came from."""
        model = self.accelerator.unwrap_model(self.model)
        c, _ = model._prepare_generation_config(copy.deepcopy(self.generation_config))
        if c.do_sample is not True:
            raise InputError(f"generation option {self._source('do_sample')}={c.do_sample!r}: replay records the "
                             "support each token was sampled from (greedy decoding samples nothing)")
        for key, off in _UNRECORDED.items():
            value = getattr(c, key, None)
            if value not in off:
                raise InputError(f"generation option {self._source(key)}={value!r}: its support cannot be recorded "
                                 "(mask_replay records temperature, top_k, top_p and min_p)")
        if c.temperature != self.temperature:  # not from generation_kwargs (checked before): from the model
            raise InputError(f"generation option {self._source('temperature')}={c.temperature!r} differs from "
                             f"GRPOConfig.temperature={self.temperature!r}: replay renormalises at GRPOConfig's")
        top_k = c.top_k or self._replay_top_k_cap
        eos = c.eos_token_id if c.eos_token_id is not None else self.eos_token_ids  # where generate stops
        eos = eos.tolist() if isinstance(eos, torch.Tensor) else eos
        eos = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        return float(c.temperature), top_k, c.top_p, c.min_p, eos

    def _source(self, key: str) -> str:
        """Where generate's value of `key` comes from, for errors."""
        if key in (self.args.generation_kwargs or {}):
            return f"generation_kwargs {key}"
        if getattr(self.generation_config, key, None) is not None:
            return f"GRPOConfig {key}"
        model = self.accelerator.unwrap_model(self.model)
        if getattr(model.generation_config, key, None) is not None:
            return f"the model's generation_config {key}"
        return f"transformers' default {key}"

    def _replay_vocab_size(self) -> int:
        model = self.accelerator.unwrap_model(self.model)
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        return int(model.get_output_embeddings().weight.shape[0])

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm:
            with vllm_mode.recording(self.vllm_generation, temperature=self.temperature,
                                     vocab_size=self._replay_vocab_size(), support=self.replay_vllm_support,
                                     accelerator=self.accelerator) as recorded:
                completion_ids, logprobs = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            mask = recorded()
            if mask is None:
                raise RuntimeError("ReplayGRPOTrainer: TRL generated without its vLLM engine; nothing was recorded")
            self._keep(_per_sequence(mask, [len(c) for c in completion_ids]))
            return completion_ids, logprobs
        recorder, captured = MaskRecorder(), {}
        temperature, top_k, top_p, min_p, eos = self._sampling()
        recorder.temperature = float(temperature)
        chain = hf_warpers(temperature, top_k, top_p, min_p, reference=recorder.reference) + [recorder]
        model = self.accelerator.unwrap_model(self.model_wrapped)
        sampling_config = self.generation_config
        self.generation_config = copy.deepcopy(sampling_config)
        for key, value in _CALL_OFF.items():  # the chain above is the only truncation applied
            setattr(self.generation_config, key, value)
        try:
            with _recording_generate(model, chain, recorder, eos, captured):
                completion_ids, logprobs = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        finally:
            self.generation_config = sampling_config
        if "output" not in captured:
            raise RuntimeError("ReplayGRPOTrainer: TRL generated without model.generate; nothing was recorded")
        # rows end at TRL's EOS (its completions end there) or at generate's (its padding follows)
        ends = sorted(set(eos) | set(self.eos_token_ids))
        masks = _per_sequence(recorder.mask(captured["output"], eos_token_id=ends), [len(c) for c in completion_ids],
                              completions=completion_ids, eos=set(eos), vocab_size=self._replay_vocab_size())
        self._keep(masks)
        return completion_ids, logprobs

    def _keep(self, masks: list[SamplingMask]) -> None:
        mode = "train" if self.model.training else "eval"
        for old in self._replay_owned[mode]:  # that mode's previous generation is fully consumed
            self._replay_masks.pop(old, None)
        ids = list(range(self._replay_next, self._replay_next + len(masks)))
        self._replay_next += len(masks)
        self._replay_masks.update(zip(ids, masks))
        self._replay_owned[mode] = ids
        self._replay_active = torch.tensor(ids, dtype=torch.int64, device=self.accelerator.device)
        # vLLM reports no kept mass: it is measured from the policy's logits at its first scoring (_replay)
        self._replay_kept_pending = any(m.kept_mass is None for m in masks)
        kept = (torch.cat([m.kept_mass.double() for m in masks]) if masks and not self._replay_kept_pending
                else torch.zeros(0, dtype=torch.float64))
        size = torch.cat([m.lengths().double() for m in masks]) if masks else torch.zeros(0, dtype=torch.float64)
        totals = torch.stack([kept.sum(), size.sum(), torch.tensor(float(size.numel()), dtype=torch.float64)])
        totals = self.accelerator.gather(totals.to(self.accelerator.device)).reshape(-1, 3).sum(0)
        n = max(totals[2].item(), 1.0)
        if not self._replay_kept_pending:
            self._metrics[mode]["replay/kept_mass/mean"].append(totals[0].item() / n)
        self._metrics[mode]["replay/support_size/mean"].append(totals[1].item() / n)

    def _log_kept_from_logps(self, model, trl_logps, replayed, window) -> None:
        """kept mass = exp(log pi_V - log pi_K) per token, from the policy's first scoring of the batch."""
        if not getattr(self, "_replay_kept_pending", False) or model not in (self.model, self.model_wrapped):
            return
        if _adapter_state(self.accelerator.unwrap_model(model)) != self._replay_policy_adapter:
            return  # TRL's PEFT reference (the same module, its adapter off): not the policy
        self._replay_kept_pending = False
        kept = torch.exp(trl_logps.detach() - replayed.detach()).double()[window]
        totals = torch.stack([kept.sum(), torch.tensor(float(kept.numel()), dtype=torch.float64, device=kept.device)])
        totals = self.accelerator.gather(totals.to(self.accelerator.device)).reshape(-1, 2).sum(0)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["replay/kept_mass/mean"].append(totals[0].item() / max(totals[1].item(), 1.0))

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        output[INDEX_KEY] = self._replay_active
        self._replay_active = None
        return output

    # -- loss side ----------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        if INDEX_KEY not in inputs:
            raise KeyError(f"ReplayGRPOTrainer: the batch has no '{INDEX_KEY}' (was it generated by this trainer?)")
        self._replay_active = inputs[INDEX_KEY]
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._replay_active = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if self._replay_active is None:
            raise RuntimeError("ReplayGRPOTrainer: log-probs asked for outside a batch this trainer generated")
        unwrapped = self.accelerator.unwrap_model(model)
        head_model = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
        hidden = []
        hook = head_model.base_model.register_forward_hook(  # TRL's fused head calls the backbone as a module
            lambda module, inp, out: hidden.append(out.last_hidden_state))
        try:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        finally:
            hook.remove()
        replayed = self._replay(head_model, torch.cat(hidden), input_ids, attention_mask, logits_to_keep, logps)
        self._log_kept_from_logps(model, logps, replayed, attention_mask[:, -logits_to_keep:].bool())
        return replayed, entropies, aux

    def _replay(self, head_model, hidden, input_ids, attention_mask, k, trl_logps):
        index = self._replay_active.tolist()
        if len(index) != input_ids.shape[0]:
            raise InputError(f"{len(index)} replay indices for a batch of {input_ids.shape[0]} samples")
        masks = []
        for b, i in enumerate(index):
            if i not in self._replay_masks:
                raise InputError(f"sample {b}: no recorded support for replay_index {i}")
            masks.append(self._replay_masks[i])
        lengths = torch.tensor([m.num_rows for m in masks], device=input_ids.device)
        window = attention_mask[:, -k:].bool()
        position = torch.arange(k, device=input_ids.device)
        covered = position[None, :] < lengths[:, None]
        if bool((window & ~covered).any()) or bool((lengths > k).any()):
            bad = int(torch.nonzero((window & ~covered).any(1) | (lengths > k))[0])
            tokens = int(window[bad].sum())
            raise InputError(f"sample {bad} (replay_index {index[bad]}): the support has {masks[bad].num_rows} rows "
                             f"but the completion has {tokens} tokens (position {min(masks[bad].num_rows, tokens)} "
                             "has no row)")
        b_idx, p_idx = torch.nonzero(covered, as_tuple=True)  # sample-major, positions ascending: the masks' order
        lm_head = head_model.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        if hasattr(weight, "full_tensor"):  # FSDP2 DTensor (the head resharded after the forward): gather it
            weight, bias = _gathered(weight), _gathered(bias) if bias is not None else None
        h = hidden[:, :-1][:, -k:][b_idx, p_idx].to(weight.device)
        if self.args.cast_lm_head_to_fp32:
            h, weight = h.float(), weight.float()
            bias = bias.float() if bias is not None else None
        h = h.to(weight.dtype)
        labels = input_ids[:, -k:][b_idx, p_idx]
        mask = SamplingMask.concat(masks).to(weight.device)
        with torch.autocast(weight.device.type, enabled=False):
            if self._replay_softcap is None:
                lp = replay_logprobs_from_hidden(h, weight, mask, labels, self.temperature / self._replay_scale, bias)
            else:
                lp = softcapped_support_logprobs(h, weight, bias, mask, labels, logit_scale=self._replay_scale,
                                                 softcap=float(self._replay_softcap), temperature=self.temperature)
        out = trl_logps.new_zeros(trl_logps.shape).index_put((b_idx, p_idx), lp.to(trl_logps.dtype))
        out = out.masked_fill(~window, 0.0)  # TRL's zeros at masked positions (truncated completions)
        whole = torch.zeros_like(window)
        whole[b_idx, p_idx] = mask.lengths().to(window.device) == weight.shape[0]
        return torch.where(whole, trl_logps, out)  # nothing cut: TRL's own value, bit for bit
