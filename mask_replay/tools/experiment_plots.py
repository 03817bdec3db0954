"""The experiment's two figures: the four metric panels of `demo` (plots.plot_report) with each run's
own log-probs over training steps, and reward with clip fraction."""
from __future__ import annotations

from mask_replay.files.safe_output import atomic_output
from mask_replay.tools.plots import plot_report

COLORS = {"no_replay": "tab:red", "replay": "tab:blue"}
LABELS = {"no_replay": "replay off", "replay": "replay on"}


def metrics_report(runs: dict) -> dict:
    """A score report (plot_report's format) whose `replay` curve is the replay run's and whose
    `no_replay` curve is the no-replay run's, each over all mu passes of a step; a run that was not
    done is stood in for by the other run's second computation."""
    per_step, tokens = {}, 0
    any_run = next(iter(runs.values()))
    for i, line in enumerate(any_run.steps):
        entry = {}
        for kind in ("replay", "no_replay"):
            source = runs.get(kind, any_run).steps[i]
            entry[kind] = source[kind]
        entry["kept_mass_mean"] = runs.get("no_replay", any_run).steps[i]["kept_mass_mean"]
        entry["tokens"] = line["tokens"]
        tokens += line["tokens"]
        per_step[str(line["step"])] = entry
    return {"tokens": tokens, "per_step": per_step}


def plot_metrics(runs: dict, path, title: str) -> None:
    plot_report(metrics_report(runs), path, title=title, xlabel="training step")


def plot_reward(runs: dict, path, title: str) -> None:
    """Left: reward (train rollouts, solid; held-out, dashed); right: clip fraction; both runs."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        steps = [ln["step"] for ln in run.steps]
        color = COLORS[name]
        left.plot(steps, [ln["reward_train"] for ln in run.steps], color=color, marker="o", ms=3,
                  label=f"{LABELS[name]}: train rollouts")
        held = [(ln["step"], ln["reward_held_out"]) for ln in run.steps if ln["reward_held_out"] is not None]
        held.append((len(run.steps), run.steps[-1].get("reward_held_out_after")))
        held = [(s, r) for s, r in held if r is not None]
        left.plot([s for s, _ in held], [r for _, r in held], color=color, ls="--", marker="^",
                  label=f"{LABELS[name]}: held-out")
        right.plot(steps, [ln["clip_fraction"] for ln in run.steps], color=color, marker="o", ms=3, label=LABELS[name])
    left.set_title("mean reward (held-out: before the step's update)")
    right.set_title("clip fraction (|ratio - 1| > eps, all mu passes)")
    for ax in (left, right):
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)
