"""`mask-replay score` on hostile inputs: one error line naming the file, key and row, exit != 0, and
an existing --json report left as it was; a file of 0 rows scores to a report of nulls."""
import errno
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mask_replay.tools import score_stats
from tests.helpers import assert_one_line_error, rollout_tensors, run, write

KEEP = "an earlier report\n"


@pytest.fixture
def files(tmp_path):
    t = rollout_tensors()
    rollout = write(tmp_path / "r.safetensors", t)
    masks = tmp_path / "m.safetensors"
    assert run("capture", rollout, "-o", masks, "--entry-logprobs").exit_code == 0
    training = write(tmp_path / "t.safetensors", {"logits": t["logits"] + 0.1})
    out = tmp_path / "s.json"
    out.write_text(KEEP)
    return str(masks), training, out


def _refused(result, out, *needles):
    assert_one_line_error(result, *needles)
    assert out.read_text() == KEEP


def test_training_dump_with_other_rows_than_the_mask_file(tmp_path, files):
    masks, _, out = files
    short = write(tmp_path / "short.safetensors", {"logits": rollout_tensors(n=10)["logits"]})
    _refused(run("score", "--masks", masks, "--training", short, "--json", out), out,
             "short.safetensors", "key 'logits'", "10 rows but the mask file", "has 24 rows")


@pytest.mark.parametrize("value, problem", [(float("nan"), "hold nan"), (float("inf"), "hold inf"),
                                            (-float("inf"), "do not normalise")])
def test_entry_logprobs_that_are_no_logprobs(tmp_path, files, value, problem):
    masks, training, out = files
    tensors = load_file(masks)
    with safe_open(masks, "pt") as f:
        meta = f.metadata()
    tensors["entry_logprobs"][int(tensors["offsets"][5])] = value
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    _refused(run("score", "--masks", bad, "--training", training, "--json", out, "--chunk-rows", "4"), out,
             "bad.safetensors", "entry_logprobs of row 5", problem)


@pytest.mark.parametrize("which", ["--masks", "--training"])
def test_empty_files(tmp_path, files, which):
    masks, training, out = files
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    args = {"--masks": masks, "--training": training, which: empty}
    _refused(run("score", *[x for kv in args.items() for x in kv], "--json", out), out,
             "empty.safetensors", "0 bytes")


def test_zero_rows_score_to_nulls(tmp_path):
    t = rollout_tensors(n=0)
    rollout = write(tmp_path / "r.safetensors", t)
    masks = tmp_path / "m.safetensors"
    assert run("capture", rollout, "-o", masks).exit_code == 0
    training = write(tmp_path / "t.safetensors", {"logits": torch.zeros(0, t["logits"].shape[1])})
    out = tmp_path / "s.json"
    result = run("score", "--masks", masks, "--training", training, "--json", out)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["tokens"] == 0 and report["per_step"] == {} and report["kept_mass_mean"] is None
    assert all(v is None for k in ("replay", "no_replay") for v in report[k].values())
    # --resume keeps it: the report answers these inputs
    again = run("score", "--masks", masks, "--training", training, "--json", out, "--resume")
    assert again.exit_code == 0 and "skipped (--resume)" in again.stderr


def test_a_full_disk_for_the_median_files_names_the_folder(tmp_path, files, monkeypatch):
    masks, training, out = files

    class Full:
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    monkeypatch.setattr(score_stats.tempfile, "TemporaryFile", lambda **kw: Full())
    monkeypatch.setattr(score_stats.tempfile, "gettempdir", lambda: "/the/tmp")
    _refused(run("score", "--masks", masks, "--training", training, "--json", out), out,
             "/the/tmp: No space left on device (score's median values", "set TMPDIR")

