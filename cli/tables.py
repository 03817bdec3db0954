"""The tables and report lines commands print (rich): capture's summary, score's report, the
log-prob mismatch warning. Shared by capture, score and demo."""
from rich.table import Table

from mask_replay.cli.common import console, fmt


def print_summary(summary, output):
    s = summary.stats()
    table = Table(title=f"capture -> {output}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("rows", s["rows"]), ("vocab", s["vocab"]), ("nnz (support entries)", s["nnz"]),
        ("support size mean", s["support_mean"]), ("support size median", s["support_median"]),
        ("support size p99", s["support_p99"]), ("support size max", s["support_max"]),
        ("singleton share", s["singleton_share"]),
    ]
    if s["outside_support_rows"]:
        rows.append(("rows flagged outside support", s["outside_support_rows"]))
    rows += [("bytes written", f"{s['bytes_written']:,}"), ("seconds", s["seconds"]),
             ("throughput rows/s", s["rows_per_s"]), ("throughput GB/s (logits)", s["gb_per_s"])]
    for name, value in rows:
        table.add_row(name, fmt(value))
    console().print(table)


ROWS = (
    ("importance ratio mean", "importance_ratio_mean"), ("importance ratio median", "importance_ratio_median"),
    ("logp diff mean", "logp_diff_mean"), ("logp diff std", "logp_diff_std"), ("KL k1", "kl_k1"),
    ("KL k3", "kl_k3"), ("chi2", "chi2"), ("frac r outside [0.9, 1.1]", "frac_outside_0.9_1.1"),
    ("sequences", "sequences"), ("sequence ratio mean", "sequence_ratio_mean"),
    ("sequence ratio median", "sequence_ratio_median"), ("sequence ratio std", "sequence_ratio_std"),
    ("sequence log-ratio mean", "sequence_log_ratio_mean"), ("sequence log-ratio std", "sequence_log_ratio_std"),
)


def print_report(report: dict, err: bool = False) -> None:
    out = console(err=err)
    table = Table(title=f"{report['tokens']} tokens, rollout kept mass mean {fmt(report['kept_mass_mean'])}",
                  title_justify="left")
    table.add_column("metric (r = exp(training - rollout))")
    table.add_column("no replay", justify="right", style="red")
    table.add_column("replay", justify="right", style="blue")
    for label, key in ROWS:
        if key in report["replay"]:
            table.add_row(label, fmt(report["no_replay"][key]), fmt(report["replay"][key]))
    out.print(table)
    if report["per_step"]:
        steps = Table(title="per step", title_justify="left")
        for col in ("step", "tokens", "kept mass", "ratio (no replay)", "ratio (replay)",
                    "KL k3 (no replay)", "KL k3 (replay)"):
            steps.add_column(col, justify="right")
        for s, m in sorted(report["per_step"].items(), key=lambda kv: int(kv[0])):
            steps.add_row(s, str(m["tokens"]), fmt(m["kept_mass_mean"]),
                          fmt(m["no_replay"]["importance_ratio_mean"]), fmt(m["replay"]["importance_ratio_mean"]),
                          fmt(m["no_replay"]["kl_k3"]), fmt(m["replay"]["kl_k3"]))
        out.print(steps)


def report_mismatch(report, err) -> None:
    """One line on stderr when a dump's rollout_logprobs disagree with the captured support's."""
    if not report or not report.get("rows"):
        return
    gap = report.get("worst_gap")
    gap_text = f", gap {gap:.3g} nats" if gap is not None else ""
    err.print(f"mask-replay: warning: {report['rows']} of {report['rows_compared']} rows: rollout_logprobs "
              f"differ from the captured support's by more than {report['tolerance']:g} nats (worst row "
              f"{report['worst_row']}{gap_text}); likely cause: {report['likely_cause']}. Per row: "
              f"extras['logprob_mismatch'] in the mask file.", soft_wrap=True)
