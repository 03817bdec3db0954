"""The TRL experiment's figure: per step, TRL's IS ratio mean (min..max band), the signed mean
old - sampling log-prob difference, approximate KL (k3), reward and the kept mass replay removed,
replay off and on. Only the panels some run has values for are drawn (transformers generation has
no engine log-probs, so no IS ratio, difference or KL)."""
from __future__ import annotations

from mask_replay.files.safe_output import atomic_output
from mask_replay.tools.experiment_plots import COLORS, LABELS

PANELS = (("is_ratio_mean", "TRL IS ratio mean (band: min..max)"), ("logp_diff_mean", "mean old - sampling log-prob"),
          ("kl_k3", "approx. KL (k3)"), ("reward", "reward"),
          ("replay/kept_mass/mean", "kept mass replay removed"))


def _points(run: dict, key: str):
    steps = [s for s in run["steps"] if s.get(key) is not None]
    return [s["step"] for s in steps], [s[key] for s in steps], steps


def plot_runs(runs: dict, path, title: str) -> list:
    """Draws the figure to `path` (atomically); returns the keys of the panels drawn."""
    import matplotlib  # optional heavy dependency, only for the figure

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    panels = [(k, label) for k, label in PANELS if any(_points(run, k)[1] for run in runs.values())]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4 * max(len(panels), 1), 3.2), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for name, run in runs.items():
            xs, ys, steps = _points(run, key)
            if not ys:
                continue
            ax.plot(xs, ys, marker="o", ms=3, color=COLORS[name], label=LABELS[name])
            if key == "is_ratio_mean":
                ax.fill_between(xs, [s["is_ratio_min"] for s in steps], [s["is_ratio_max"] for s in steps],
                                color=COLORS[name], alpha=0.15)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("training step")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return [k for k, _ in panels]
