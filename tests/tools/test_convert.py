"""`mask-replay convert --from padded` / `--from mask --to padded` chunk by chunk, on the command line:
the same files as the whole-mask path, the summary line, and hostile entry log-probs and counts
refused in one line that names the row, with the output left as it was."""
import pytest
import torch

from mask_replay import SamplingMask
from mask_replay.files.padded_file import load_padded, save_padded
from mask_replay.tools.convert import Tally, convert_file
from tests.helpers import assert_clean, assert_one_line_error, run, write

ROWS = [[1, 4, 9], [2], [], [0, 3, 5, 7], [6, 8], [1, 2, 3], [9], [4, 5]]
BAD = 6  # a row of the fourth chunk of 2


def example_mask() -> SamplingMask:
    mask = SamplingMask.from_lists(ROWS)
    g = torch.Generator().manual_seed(0)
    parts = [torch.log_softmax(torch.randn(len(r), generator=g, dtype=torch.float64), 0).float() for r in ROWS]
    mask.entry_logprobs = torch.cat(parts)
    mask.sampled = torch.tensor([r[-1] if r else 0 for r in ROWS])
    mask.logprobs = torch.stack([p[-1] if len(p) else torch.tensor(float("nan")) for p in parts])
    mask.extras["sequence"] = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    return mask


def test_cli_chunked_both_ways_matches_the_whole_mask_path(tmp_path):
    mask = example_mask()
    m, p, back = tmp_path / "m.safetensors", tmp_path / "p.safetensors", tmp_path / "b.safetensors"
    mask.save(m)
    result = run("convert", m, "-o", p, "--from", "mask", "--to", "padded", "--width", 5, "--chunk-rows", 3)
    assert result.exit_code == 0, result.output
    assert "8 rows, 16 ids, widest row 4, 3 sequences, log-probs: yes" in result.output
    save_padded(mask, tmp_path / "want.safetensors", 5)
    assert p.read_bytes() == (tmp_path / "want.safetensors").read_bytes()
    result = run("convert", p, "-o", back, "--from", "padded", "--chunk-rows", 1, "--vocab-size", 10)
    assert result.exit_code == 0, result.output
    assert "8 rows, 16 ids, widest row 4, 3 sequences, log-probs: yes" in result.output
    load_padded(p).save(tmp_path / "want_back.safetensors")
    assert back.read_bytes() == (tmp_path / "want_back.safetensors").read_bytes()
    torch.testing.assert_close(SamplingMask.load(back).tensors(), mask.tensors(), rtol=0, atol=0, equal_nan=True)


def test_tally_of_chunks_is_the_summary_of_the_whole():
    mask = example_mask()
    whole, parts = Tally(), Tally()
    whole.add(mask)
    for a in range(0, 8, 3):
        parts.add(mask.select_rows(a, min(8, a + 3)))
    assert parts.summary() == whole.summary()
    assert whole.summary().sequences == 3 and whole.summary().widest_row == 4


def test_chunk_rows_is_refused_for_engine_json(tmp_path):
    assert_one_line_error(run("convert", tmp_path / "r.json", "-o", tmp_path / "o.safetensors", "--from", "vllm-json",
                              "--chunk-rows", 4), "--chunk-rows applies to --from padded and --from mask only")


def _hostile_padded(case):
    mask = example_mask()
    ids, counts, lp = mask.to_padded(4)
    tensors = {"ids": ids, "counts": counts, "entry_logprobs": lp, "sampled": mask.sampled,
               "logprobs": mask.logprobs}
    if case == "nan":
        lp[BAD, 0] = float("nan")
    elif case == "+inf":
        lp[BAD, 0] = float("inf")
    elif case in ("1e39", "-1e300"):  # finite in float64, beyond float32
        lp = tensors["entry_logprobs"] = lp.double()
        lp[BAD, 0] = float(case)
    elif case == "not normalised":
        lp[BAD, :3] = -0.5
    elif case == "integer dtype":
        tensors["entry_logprobs"] = torch.zeros(8, 4, dtype=torch.int32)
    elif case == "shape":
        tensors["entry_logprobs"] = torch.zeros(8, 5)
    elif case == "count > width":
        counts[BAD] = 5
    elif case == "negative count":
        counts[BAD] = -2
    return tensors


@pytest.mark.parametrize("case, needles", [
    ("nan", ["row 6", "hold nan"]),
    ("+inf", ["row 6", "hold inf"]),
    ("1e39", ["row 6: entry log-prob 1e+39 is out of float32 range"]),
    ("-1e300", ["row 6: entry log-prob -1e+300 is out of float32 range"]),
    ("not normalised", ["row 6", "do not normalise"]),
    ("integer dtype", ["entry_logprobs must be a floating tensor of shape [8, 4]", "torch.int32"]),
    ("shape", ["entry_logprobs must be a floating tensor of shape [8, 4]", "(8, 5)"]),
    ("count > width", ["row 6: count 5 is outside [0, 4]"]),
    ("negative count", ["row 6: count -2 is outside [0, 4]"]),
])
def test_hostile_padded_input_is_one_line_and_overwrites_nothing(tmp_path, case, needles):
    p = write(tmp_path / "p.safetensors", _hostile_padded(case))
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"kept")
    for chunk in ("1", "4", "100"):
        result = run("convert", p, "-o", out, "--from", "padded", "--chunk-rows", chunk)
        assert_one_line_error(result, "p.safetensors", *needles)
        assert out.read_bytes() == b"kept"
        assert_clean(tmp_path)


@pytest.mark.parametrize("case, needles", [
    ("nan", ["row 6", "hold nan"]),
    ("+inf", ["row 6", "hold inf"]),
    ("not normalised", ["row 6", "do not normalise"]),
    ("integer dtype", ["key 'entry_logprobs'", "must be a float tensor, got int32"]),  # the header check
    ("shape", ["key 'entry_logprobs'", "1-D float tensor of 16 entries"]),
])
def test_hostile_mask_input_is_one_line_and_overwrites_nothing(tmp_path, case, needles):
    tensors = example_mask().tensors()
    lp, lo = tensors["entry_logprobs"], int(example_mask().offsets[BAD])
    if case == "nan":
        lp[lo] = float("nan")
    elif case == "+inf":
        lp[lo] = float("inf")
    elif case == "not normalised":
        lp[lo] -= 5.0
    elif case == "integer dtype":
        tensors["entry_logprobs"] = torch.zeros(16, dtype=torch.int32)
    elif case == "shape":
        tensors["entry_logprobs"] = torch.zeros(17)
    m = write(tmp_path / "m.safetensors", tensors)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"kept")
    for chunk in ("1", "5"):
        result = run("convert", m, "-o", out, "--from", "mask", "--to", "padded", "--chunk-rows", chunk)
        assert_one_line_error(result, "m.safetensors", *needles)
        assert out.read_bytes() == b"kept"
        assert_clean(tmp_path)


def test_convert_file_to_padded_names_a_wider_row_before_writing(tmp_path):
    example_mask().save(tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="row 3 has 4 ids, more than the width 3"):
        convert_file(str(tmp_path / "m.safetensors"), str(tmp_path / "p.safetensors"), source="mask",
                     target="padded", width=3, chunk_rows=2)
    assert_clean(tmp_path, "p.safetensors")
