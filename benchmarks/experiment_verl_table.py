"""The verl experiment's two runs side by side: OUT/off.json + OUT/on.json -> OUT/experiment_verl.json and a
markdown table per step on stdout (docs/experiment_verl.md). Plain Python: no verl, no torch.

    python benchmarks/experiment_verl_table.py OUT
"""
from __future__ import annotations

import json
import os
import sys

# (column, key in the run's step record, format)
COLUMNS = (("verl probs_diff mean / max", ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max"),
            "{:.2e} / {:.2e}"),
           ("rollout_corr kl / k3_kl", ("rollout_corr/kl", "rollout_corr/k3_kl"), "{:.2e} / {:.2e}"),
           ("rollout_corr IS mean (min..max)", ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_min",
                                                "rollout_corr/rollout_is_max"), "{:.5f} ({:.5f}..{:.5f})"),
           ("signed mean old - rollout", ("signed_mean_old_minus_rollout",), "{:.2e}"),
           ("mean exp(old - rollout)", ("exp_old_minus_rollout_mean",), "{:.4f}"))


def cell(step: dict, keys, fmt: str) -> str:
    values = [step.get(k) for k in keys]
    return "n/a" if any(v is None for v in values) else fmt.format(*values)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: experiment_verl_table.py OUT (the folder with off.json and on.json)")
    out = sys.argv[1]
    runs = {}
    for setting in ("off", "on"):
        path = os.path.join(out, f"{setting}.json")
        try:
            with open(path, encoding="utf-8") as f:
                runs[setting] = json.load(f)
        except (OSError, ValueError) as exc:
            sys.exit(f"experiment_verl_table: {path}: cannot read ({exc})")
    with open(os.path.join(out, "experiment_verl.json"), "w", encoding="utf-8") as f:
        json.dump(runs, f, indent=1)
    head = ["step", "replay"] + [c[0] for c in COLUMNS] + ["kept mass (replay/kept_mass)", "support size",
                                                           "reward", "pg_loss", "grad_norm"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    steps = max(len(r["steps"]) for r in runs.values())
    for i in range(steps):
        for setting, run in runs.items():
            if i >= len(run["steps"]):
                continue
            s = run["steps"][i]
            row = [str(i), setting] + [cell(s, keys, fmt) for _, keys, fmt in COLUMNS]
            row += [cell(s, ("actor/replay/kept_mass/mean",), "{:.4f}"),
                    cell(s, ("actor/replay/support_size/mean",), "{:.1f}"), cell(s, ("reward",), "{:.3f}"),
                    cell(s, ("actor/pg_loss",), "{:.4f}"), cell(s, ("actor/grad_norm",), "{:.3f}")]
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
