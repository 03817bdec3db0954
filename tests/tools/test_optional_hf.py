"""transformers is the optional [hf] extra: the tools and the CLI import without it, and `example` /
`experiment` then refuse with one line naming the extra, before any --out folder is made."""
import os
import subprocess
import sys
import textwrap

import pytest

from mask_replay.tools import example, experiment
from tests.helpers import assert_one_line_error, run

# What mask_replay.integrations.transformers raises without transformers (tests/tools/test_example.py)
MISSING = "mask_replay.integrations.transformers needs transformers: pip install 'mask-replay[hf]'"


@pytest.mark.parametrize("cmd", [["example"], ["experiment", "--no-progress"]])
def test_commands_without_transformers_name_the_extra_and_write_nothing(monkeypatch, tmp_path, cmd):
    monkeypatch.setattr(example, "HF_MISSING", MISSING)  # as the module sets it when the import failed
    out = tmp_path / "out"
    res = run(*cmd, "--out", out)
    assert res.exit_code == 1, res.output
    assert_one_line_error(res, "pip install 'mask-replay[hf]'")
    assert not out.exists()


def test_require_hf_passes_where_transformers_imports():
    assert example.HF_MISSING is None and experiment.generate is not None
    example.require_hf()


@pytest.mark.slow
def test_tools_and_cli_import_with_transformers_blocked(tmp_path):
    # A fresh interpreter in which `import transformers` fails (sys.modules[name] = None), as on an
    # install without the [hf] extra: every module imports, the commands refuse in one line.
    code = textwrap.dedent(f"""
        import sys
        sys.modules["transformers"] = None
        import mask_replay.tools.example as ex, mask_replay.tools.experiment as exp
        import mask_replay.cli.example, mask_replay.cli.experiment
        from click.testing import CliRunner
        from mask_replay.cli.main import main
        assert ex.HF_MISSING and "mask-replay[hf]" in ex.HF_MISSING, ex.HF_MISSING
        assert "transformers" not in sys.modules or sys.modules["transformers"] is None
        for cmd in (["example"], ["experiment", "--no-progress"]):
            res = CliRunner().invoke(main, cmd + ["--out", {str(tmp_path / "out")!r}])
            print(res.exit_code, res.output.strip())
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("1 mask-replay: error: ") and "mask-replay[hf]" in line
                                   for line in lines), proc.stdout
    assert not (tmp_path / "out").exists()
