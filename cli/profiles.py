"""What `mask-replay capture --profile` adds to the command's output: the log-prob mismatch report."""


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
