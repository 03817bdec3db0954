"""The score plot: integer ticks on the training-step axis, the title naming its data."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mask_replay.tools.plots import plot_report  # noqa: E402


def _report(steps):
    m = {"importance_ratio_mean": 1.0, "logp_diff_mean": 0.0, "logp_diff_std": 0.1, "kl_k3": 0.01}
    per_step = {str(s): {"tokens": 4, "kept_mass_mean": 0.9, "replay": m, "no_replay": m} for s in steps}
    return {"tokens": 4 * len(steps), "per_step": per_step}


def test_step_axis_has_integer_ticks_and_title(tmp_path, monkeypatch):
    seen = {}
    real_close = plt.close

    def keep(fig):  # look at the figure before plot_report closes it
        ax = fig.axes[0]
        lo, hi = ax.get_xlim()
        seen["ticks"] = [t for t in ax.get_xticks() if lo <= t <= hi]
        seen["title"] = fig._suptitle.get_text()
        real_close(fig)

    monkeypatch.setattr(plt, "close", keep)
    plot_report(_report([0, 1, 2]), tmp_path / "p.png", title="run: train.safetensors")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert seen["ticks"] and all(float(t).is_integer() for t in seen["ticks"]), seen["ticks"]
    assert seen["title"].startswith("run: train.safetensors")
