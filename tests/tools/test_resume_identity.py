"""--resume keys inputs by resolved path and content identity, never by base name: a mask made from
step1/rollout.safetensors is not the mask of step2/rollout.safetensors (same name, rows and
parameters), nor of a file rewritten in place; params of two inputs sharing a base name do not
collide."""
import json
import os

import torch

from mask_replay import SamplingMask
from tests.helpers import rollout_tensors, run, write


def _capture(*args):
    result = run("capture", *args, "--resume")
    assert result.exit_code == 0, result.output
    return result


def test_resume_does_not_skip_a_mask_of_another_file_with_the_same_name(tmp_path):
    (tmp_path / "step1").mkdir()
    (tmp_path / "step2").mkdir()
    one = write(tmp_path / "step1" / "rollout.safetensors", rollout_tensors(seed=1))
    two = write(tmp_path / "step2" / "rollout.safetensors", rollout_tensors(seed=2))
    out = tmp_path / "m.safetensors"
    _capture(one, "-o", out)
    first = SamplingMask.load(str(out))
    result = _capture(two, "-o", out)
    assert "skipped" not in result.stderr
    again = SamplingMask.load(str(out))
    assert again.to_lists() != first.to_lists()
    assert json.loads(again.metadata["inputs"])[0]["path"] == os.path.realpath(two)
    assert "skipped" in _capture(two, "-o", out).stderr  # the same file again: complete


def test_resume_does_not_skip_after_the_input_is_rewritten(tmp_path):
    path = write(tmp_path / "rollout.safetensors", rollout_tensors(seed=1))
    out = tmp_path / "m.safetensors"
    _capture(path, "-o", out)
    write(path, rollout_tensors(seed=3))  # same name, shape and parameters; other logits
    os.utime(path, ns=(os.stat(out).st_mtime_ns, os.stat(out).st_mtime_ns))  # even with an old-looking time
    assert "skipped" not in _capture(path, "-o", out).stderr


def test_inputs_sharing_a_base_name_keep_their_own_params(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    t1, t2 = rollout_tensors(seed=1), rollout_tensors(seed=2)
    t1["top_p"] = torch.tensor(0.5)
    t2.pop("top_p", None)
    one = write(tmp_path / "a" / "rollout.safetensors", t1)
    two = write(tmp_path / "b" / "rollout.safetensors", t2)
    out = tmp_path / "m.safetensors"
    _capture(one, two, "-o", out)
    meta = SamplingMask.load(str(out)).metadata
    names = json.loads(meta["sources"])
    assert names == [os.path.realpath(one), os.path.realpath(two)]
    params = json.loads(meta["params"])
    assert params[names[0]]["top_p"] == "dump" and params[names[1]]["top_p"] != "dump"
    assert "skipped" in _capture(one, two, "-o", out).stderr


def _score(masks, training, js):
    result = run("score", "--masks", masks, "--training", training, "--json", js, "--resume")
    assert result.exit_code == 0, result.output
    return result


def test_score_resume_does_not_keep_a_report_of_another_training_dump(tmp_path):
    """Regression: score --resume parsed the JSON only, so a report made from another training dump
    (same rows, other logits) was kept as this command's output."""
    roll = write(tmp_path / "r.safetensors", rollout_tensors(seed=1))
    masks = tmp_path / "m.safetensors"
    _capture(roll, "-o", masks)
    one = write(tmp_path / "t1.safetensors", {"logits": rollout_tensors(seed=1)["logits"]})
    two = write(tmp_path / "t2.safetensors", {"logits": rollout_tensors(seed=5)["logits"]})
    js = tmp_path / "s.json"
    _score(masks, one, js)
    first = json.loads(js.read_text())
    assert first["inputs"]["training"]["path"] == os.path.realpath(one)
    result = _score(masks, two, js)
    assert "skipped" not in result.stderr and "not made from these" in result.stderr
    second = json.loads(js.read_text())
    assert second["replay"] != first["replay"]
    assert second["inputs"]["training"]["path"] == os.path.realpath(two)
    assert "skipped" in _score(masks, two, js).stderr  # the same inputs again: kept
    write(two, {"logits": rollout_tensors(seed=6)["logits"]})  # rewritten in place
    assert "skipped" not in _score(masks, two, js).stderr
    report = json.loads(js.read_text())
    report.pop("inputs")  # a report without identities (an older version's) is not kept either
    js.write_text(json.dumps(report))
    assert "skipped" not in _score(masks, two, js).stderr
