"""mask_replay.tools.experiment_trl: the batch statistics against a float64 reference, flag checks, the
reward on TRL's completions and the merge of an earlier run (no trl or vllm needed)."""
import json
import math
from dataclasses import asdict

import pytest
import torch

from mask_replay.errors import InputError
from mask_replay.tools.experiment_trl import TrlExperimentConfig, _earlier_runs, batch_stats, task_reward
from mask_replay.tools.experiment_trl_plots import plot_runs


def test_batch_stats_match_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    sampling = -torch.rand(3, 5, generator=g) * 3
    old = sampling + torch.randn(3, 5, generator=g) * 0.1 - 0.05
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    sampling[0, 1] = float("nan")  # a token the engine could not score: left out
    got = batch_stats({"old_per_token_logps": old, "sampling_per_token_logps": sampling, "completion_mask": mask})
    d = [float(old[i, j]) - float(sampling[i, j]) for i in range(3) for j in range(5)
         if mask[i, j] and not math.isnan(float(sampling[i, j]))]
    mean = sum(d) / len(d)
    std = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    k3 = sum(math.expm1(x) - x for x in d) / len(d)
    factor = sum(math.exp(x) for x in d) / len(d)
    assert got["logp_diff_mean"] == pytest.approx(mean, abs=1e-6) and mean < 0  # signed: old below sampling
    assert got["logp_diff_std"] == pytest.approx(std, abs=1e-6)
    assert got["kl_k3"] == pytest.approx(k3, abs=1e-7) and k3 > 0
    assert got["token_factor_mean"] == pytest.approx(factor, abs=1e-6)


def test_batch_stats_without_engine_logprobs_are_none():
    out = batch_stats({"completion_mask": torch.ones(1, 2)})
    assert out == dict.fromkeys(("logp_diff_mean", "logp_diff_std", "kl_k3", "token_factor_mean"))


@pytest.mark.parametrize("kwargs, flag", [({"generation": "sglang"}, "--generation"),
                                          ({"runs": ("replay", "both")}, "--runs"),
                                          ({"group_size": 1}, "--group-size")])
def test_bad_flags_name_the_flag(kwargs, flag):
    with pytest.raises(InputError, match=flag):
        TrlExperimentConfig(**kwargs).check()


def test_task_reward_reads_trl_completions():  # "14 + 17 = 31" starts with an integer 17 off the sum
    completions = [[{"role": "assistant", "content": "31"}], [{"role": "assistant", "content": "14 + 17 = 31"}], "30"]
    assert task_reward(completions, a=[14, 14, 14], b=[17, 17, 17]) == [1.0, 0.5 + 0.5 / 18, 0.75]


def test_an_earlier_run_of_the_same_config_is_kept(tmp_path):
    cfg = TrlExperimentConfig(runs=("replay",))
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"config": {**asdict(TrlExperimentConfig(runs=("no_replay",))), "runs": ["no_replay"]},
                                "runs": {"no_replay": {"steps": []}, "replay": {"steps": [1]}}}))
    assert _earlier_runs(str(path), cfg) == {"no_replay": {"steps": []}}
    assert _earlier_runs(str(path), TrlExperimentConfig(runs=("replay",), steps=3)) == {}
    assert _earlier_runs(str(tmp_path / "missing.json"), cfg) == {}


def test_the_figure_draws_only_the_panels_with_values(tmp_path):
    """transformers generation: no engine log-probs, so no IS ratio / difference / KL panels (they
    were drawn empty); vLLM: all five."""
    step = {"step": 0, "reward": 0.2, "is_ratio_mean": None, "logp_diff_mean": None, "kl_k3": None}
    runs = {"no_replay": {"steps": [dict(step)]},
            "replay": {"steps": [dict(step, **{"replay/kept_mass/mean": 0.93})]}}
    path = tmp_path / "t.png"
    assert plot_runs(runs, path, "t") == ["reward", "replay/kept_mass/mean"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    full = dict(step, is_ratio_mean=0.4, is_ratio_min=0.2, is_ratio_max=0.6, logp_diff_mean=-0.07, kl_k3=3e-3)
    runs["no_replay"]["steps"] = [full]
    assert plot_runs(runs, path, "t") == ["is_ratio_mean", "logp_diff_mean", "kl_k3", "reward",
                                          "replay/kept_mass/mean"]
