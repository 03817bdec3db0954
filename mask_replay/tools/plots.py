"""Plot of a score report over training steps: replay against no replay (matplotlib, no display)."""
from __future__ import annotations

from mask_replay.errors import DumpError
from mask_replay.files.safe_output import atomic_output

PANELS = (
    ("importance_ratio_mean", "mean importance ratio", 1.0),
    ("logp_diff_mean", "mean logp diff (training - rollout)", 0.0),
    ("logp_diff_std", "logp diff std", None),
    ("kl_k3", "approx. KL (k3)", None),
)


def plot_report(report: dict, path, title: str = "rollout vs training log-probs",
                xlabel: str = "training step") -> None:
    """Four panels over steps (or whatever the report's per_step keys count: `xlabel`); written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    per_step = report.get("per_step") or {}
    if not per_step:
        raise DumpError(f"{path}: nothing to plot: the mask file has no 'step' key")
    steps = sorted(per_step, key=int)
    x = [int(s) for s in steps]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for ax, (metric, label, ref) in zip(axes.flat, PANELS):
        for kind, style in (("no_replay", dict(color="tab:red", marker="o", label="no replay")),
                            ("replay", dict(color="tab:blue", marker="s", label="replay"))):
            ax.plot(x, [per_step[s][kind][metric] for s in steps], **style)
        if ref is not None:
            ax.axhline(ref, color="gray", lw=0.8, ls="--")
        if metric == "importance_ratio_mean":
            ax.plot(x, [per_step[s]["kept_mass_mean"] for s in steps], color="gray", ls=":",
                    label="kept mass (rollout)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel(xlabel)
    # steps are integers: no 0.25, 0.5, ... ticks between them (axes share x, one locator is enough)
    axes[0, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0, 0].legend(loc="best", fontsize=8)
    fig.suptitle(f"{title} ({report['tokens']} tokens)")
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
