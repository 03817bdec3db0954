"""The TRL experiment's figure: per step, TRL's IS ratio mean (min..max band), the signed mean
old - sampling log-prob difference, approximate KL (k3) and reward, replay off and on."""
from __future__ import annotations

from mask_replay.files.safe_output import atomic_output
from mask_replay.tools.experiment_plots import COLORS, LABELS

PANELS = (("is_ratio_mean", "TRL IS ratio mean (band: min..max)"), ("logp_diff_mean", "mean old - sampling log-prob"),
          ("kl_k3", "approx. KL (k3)"), ("reward", "reward"))


def plot_runs(runs: dict, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (key, label) in zip(axes, PANELS):
        for name, run in runs.items():
            xs = [s["step"] for s in run["steps"] if s.get(key) is not None]
            ys = [s[key] for s in run["steps"] if s.get(key) is not None]
            if not ys:
                continue
            ax.plot(xs, ys, marker="o", ms=3, color=COLORS[name], label=LABELS[name])
            if key == "is_ratio_mean":
                lo = [s["is_ratio_min"] for s in run["steps"] if s.get(key) is not None]
                hi = [s["is_ratio_max"] for s in run["steps"] if s.get(key) is not None]
                ax.fill_between(xs, lo, hi, color=COLORS[name], alpha=0.15)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("training step")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
