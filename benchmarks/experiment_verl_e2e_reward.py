"""The reward of `make experiment-verl-e2e`: verl's reward.custom_reward_function (verl's reward loop runs it).

The seed task's score (mask_replay/tools/experiment_task.py: reward): partial credit, so that GRPO's group
advantages are not all zero at 16-32 new tokens (verl's GSM8K scorer needs a "#### N" line a 135M model
rarely writes that early). The parquet's extra_info carries the two addends.
"""
from __future__ import annotations

from mask_replay.tools.experiment_task import Problem, reward


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    problem = Problem(int(extra_info["a"]), int(extra_info["b"]), "")
    if str(problem.answer) != str(ground_truth):
        raise ValueError(f"reward: ground truth {ground_truth!r} is not {problem.a} + {problem.b}")
    return reward(solution_str, problem)
