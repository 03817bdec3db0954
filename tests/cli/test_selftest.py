"""`mask-replay selftest`: one line per case, a summary table, exit 0 when every case passes and 1
(with the failing case named) when one does not."""
import torch
from click.testing import CliRunner

from mask_replay.cli.main import main
from mask_replay.tools import selftest as st


def run(*args):
    return CliRunner().invoke(main, ["selftest", *args], catch_exceptions=False)


def test_quick_subset_passes_with_a_line_per_case_and_a_summary():
    result = run("--device", "cpu", "--quick", "--only", "40x200 fp32")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    case_lines = [ln for ln in lines if ln.startswith("ok   ")]
    assert len(case_lines) >= 20 and all("40x200 fp32" in ln for ln in case_lines)
    assert "selftest: cpu vs float64 references (quick)" in result.output
    for op in ("capture", "capture_fixed", "replay_fwd", "replay_bwd", "kept_mass", "full_fwd", "full_bwd"):
        assert f"│ {op} " in result.output, op
    assert lines[-1].startswith(f"selftest PASSED: {len(case_lines)} cases, 0 failed")


def test_a_wrong_kernel_result_fails_the_command(monkeypatch):
    class Spoiled:
        def __getattr__(self, name):
            real = getattr(torch.ops.mask_replay, name)
            return (lambda *a: real(*a) * 1.001) if name == "kept_mass" else real

    monkeypatch.setattr(st, "KERNELS", Spoiled())
    result = run("--device", "cpu", "--quick", "--only", "6x1000 fp32")
    assert result.exit_code == 1, result.output
    failed = [ln for ln in result.output.splitlines() if ln.startswith("FAIL")]
    assert failed and all(ln.startswith("FAIL kept_mass 6x1000 fp32") and "kept_mass[" in ln for ln in failed)
    assert "selftest FAILED" in result.output.splitlines()[-1]


def test_bad_device_and_empty_selection_are_one_line_errors():
    for args, needle in ((["--device", "tpu"], "--device tpu"), (["--only", "no such case"], "--only no such case")):
        result = run(*args, "--quick")
        assert result.exit_code == 1
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("mask-replay: error: ") and needle in lines[0], result.stderr


def test_a_long_mismatch_stays_on_one_line(monkeypatch):
    class Dropping:  # capture loses the last token of the last row: a long detail line
        def __getattr__(self, name):
            real = getattr(torch.ops.mask_replay, name)
            if name != "capture":
                return real
            return lambda *a: (lambda ids, off, lz: (ids[:-1], torch.cat([off[:-1], off[-1:] - 1]), lz))(*real(*a))

    monkeypatch.setattr(st, "KERNELS", Dropping())
    result = run("--device", "cpu", "--quick", "--only", "capture 40x200 fp32 top_k=50")
    assert result.exit_code == 1
    failed = [ln for ln in result.output.splitlines() if ln.startswith("FAIL capture 40x200 fp32 top_k=50 ")]
    assert len(failed) == 1 and "token(s) the reference requires are missing (first id" in failed[0], result.output
