"""The table of `make experiment-verl-e2e` from verl's own logged metrics (OUT/off.jsonl, OUT/on.jsonl: verl's file
logger, one line per step), into OUT/experiment_verl_e2e.json and printed as the markdown of docs/experiment_verl.md.

Exits 1 when a setting logged no step, and when a check the issue asks for fails: off must show the kept mass
(the TIS weights' mean below 1, their min near top_p), on must show TIS weights of 1 within 1e-4.
"""
from __future__ import annotations

import json
import os
import sys

COLUMNS = [("rollout_corr/rollout_is_mean", "IS mean", "{:.5f}"), ("rollout_corr/rollout_is_min", "IS min", "{:.5f}"),
           ("rollout_corr/rollout_is_max", "IS max", "{:.5f}"),
           ("training/rollout_probs_diff_max", "probs_diff max", "{:.2e}"),
           ("actor/replay/kept_mass/mean", "replay kept_mass", "{:.4f}"),
           ("actor/replay/support_size/mean", "support size", "{:.1f}"),
           ("critic/score/mean", "reward", "{:.3f}"), ("actor/pg_loss", "pg_loss", "{:.4f}"),
           ("actor/grad_norm", "grad_norm", "{:.3f}"), ("timing_s/gen", "gen s", "{:.1f}"),
           ("timing_s/update_weights", "weight sync s", "{:.1f}"), ("timing_s/step", "step s", "{:.1f}")]
TOL = 1e-4


def load(out: str, setting: str) -> list:
    path = os.path.join(out, f"{setting}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def cell(data: dict, key: str, fmt: str) -> str:
    value = data.get(key)
    return fmt.format(value) if isinstance(value, (int, float)) else "n/a"


def main(out: str) -> int:
    runs = {s: load(out, s) for s in ("off", "on")}
    with open(os.path.join(out, "experiment_verl_e2e.json"), "w") as f:
        json.dump(runs, f, indent=1)
    print("| step | replay | " + " | ".join(c[1] for c in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    steps = max((len(v) for v in runs.values()), default=0)
    for i in range(steps):
        for setting, records in runs.items():
            if i < len(records):
                data = records[i]["data"]
                cells = " | ".join(cell(data, key, fmt) for key, _, fmt in COLUMNS)
                print(f"| {records[i]['step']} | {setting} | {cells} |")
    failures = [f"{s}: no step logged" for s, v in runs.items() if not v]
    for record in runs["on"]:
        d = record["data"]
        for key in ("rollout_corr/rollout_is_min", "rollout_corr/rollout_is_max"):
            if key not in d or abs(d[key] - 1) > TOL:
                failures.append(f"on, step {record['step']}: {key} = {d.get(key)} is not 1 within {TOL}")
    for record in runs["off"]:
        d = record["data"]
        if not d.get("rollout_corr/rollout_is_mean", 1) < 1 - TOL:
            failures.append(f"off, step {record['step']}: rollout_is_mean {d.get('rollout_corr/rollout_is_mean')} "
                            "shows no kept mass")
    for line in failures:
        print("experiment_verl_e2e_table:", line, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: experiment_verl_e2e_table.py OUT")
    sys.exit(main(sys.argv[1]))
