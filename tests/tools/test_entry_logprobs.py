"""entry_logprobs end to end on the sampler side: capture (exact and engine profiles) against a float64
reference and the engines' float32 arithmetic, the streamed mask file (CLI --entry-logprobs, chunked),
MaskFile chunks, save/load, padded files, convert, inspect, torchrun merges, and the checks."""
import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import mask_replay as mr
from mask_replay import SamplingMask
from mask_replay.files.mask_file import MaskFile
from mask_replay.files.padded_file import load_padded, save_padded
from mask_replay.sampler import profiles
from mask_replay.tools.capture import capture_dumps
from mask_replay.tools.torchrun import merge_masks
from tests.helpers import assert_one_line_error, rollout_tensors, run, torchrun, write

INF = float("inf")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package


def reference_entries(logits, mask, temperature):
    """float64: x = float32(z) / float32(T), log-softmax over each row's support."""
    t = torch.as_tensor(temperature, dtype=torch.float32).reshape(-1, 1)
    x = (logits.float() / t).double().masked_fill(~mask.to_dense(logits.shape[1]), -INF)
    return torch.log_softmax(x, 1)[mask.row_ids(), mask.token_ids.long()]


def sampled_entry(mask):
    rows = mask.row_ids()
    hit = mask.token_ids.long() == mask.sampled[rows]
    return rows[hit], mask.entry_logprobs[hit]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capture_exact_matches_float64_reference(dtype):
    z = (torch.randn(40, 300, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    temp = torch.rand(40, generator=torch.Generator().manual_seed(2)) + 0.3
    temp[3] = 0.0  # greedy: one entry, 0
    mask = mr.capture(z, temperature=temp, top_p=0.95, min_p=0.01, sampled=z.float().argmax(1), entry_logprobs=True)
    assert mask.entry_logprobs.dtype == torch.float32 and mask.entry_logprobs.shape == (mask.nnz,)
    t1 = torch.where(temp == 0, torch.ones_like(temp), temp)
    assert torch.allclose(mask.entry_logprobs.double(), reference_entries(z, mask, t1), atol=1e-6, rtol=0)
    rows, values = sampled_entry(mask)
    assert torch.equal(mask.logprobs[rows], values)  # bit for bit
    # and within float32 rounding of the kernel's sampled log-prob (capture without entries)
    plain = mr.capture(z, temperature=temp, top_p=0.95, min_p=0.01, sampled=z.float().argmax(1))
    assert torch.allclose(plain.logprobs, mask.logprobs, atol=1e-6, rtol=0)
    assert plain == SamplingMask(mask.token_ids, mask.offsets, mask.sampled, plain.logprobs, mask.kept_mass,
                                 mask.extras, mask.metadata)
    mask.validate(z.shape[1])


@pytest.mark.parametrize("profile", ["vllm", "sglang", "hf"])
def test_capture_profiles_use_the_engine_float32_arithmetic(profile):
    z = torch.randn(30, 200, generator=torch.Generator().manual_seed(3)) * 3
    mask = mr.capture(z, temperature=0.7, top_k=40, top_p=0.9, sampled=z.argmax(1), profile=profile,
                      entry_logprobs=True)
    # the engine's arithmetic: float32 log_softmax of the processed logits, -inf off its support
    _, _, _, keep = profiles.engine_support(z, profile, temperature=0.7, top_k=40, top_p=0.9, return_keep=True)
    x = z.float() / torch.tensor(0.7, dtype=torch.float32) if profile != "hf" else z.float() / 0.7
    engine = torch.log_softmax(x.masked_fill(~keep, -INF), dim=1)[keep]
    assert torch.equal(mask.entry_logprobs, engine)
    assert torch.allclose(mask.entry_logprobs.double(), reference_entries(z, mask, 0.7), atol=1e-6, rtol=0)
    rows, values = sampled_entry(mask)
    assert torch.equal(mask.logprobs[rows], values)


def test_save_load_select_concat_align_padded(tmp_path):
    z = torch.randn(12, 50, generator=torch.Generator().manual_seed(4)) * 3
    mask = mr.capture(z, top_p=0.9, sampled=z.argmax(1), entry_logprobs=True)
    mask.extras["sequence"] = torch.arange(12) % 3
    mask.save(tmp_path / "m.safetensors")
    assert "entry_logprobs" in load_file(str(tmp_path / "m.safetensors"))
    back = SamplingMask.load(tmp_path / "m.safetensors")
    assert back == mask and torch.equal(back.entry_logprobs, mask.entry_logprobs)
    part = mask.select_rows(3, 7)
    lo, hi = int(mask.offsets[3]), int(mask.offsets[7])
    assert torch.equal(part.entry_logprobs, mask.entry_logprobs[lo:hi])
    assert SamplingMask.concat([mask.select_rows(0, 3), part, mask.select_rows(7, 12)]) == mask
    aligned = mask.align(sequences=[2, 0])
    want = [r for s in (2, 0) for r in range(12) if r % 3 == s]
    for i, r in enumerate(want):
        a, b = int(aligned.offsets[i]), int(aligned.offsets[i + 1])
        c, d = int(mask.offsets[r]), int(mask.offsets[r + 1])
        assert torch.equal(aligned.entry_logprobs[a:b], mask.entry_logprobs[c:d])
    assert mask.to("cpu") == mask and mask != SamplingMask(mask.token_ids, mask.offsets, mask.sampled, mask.logprobs,
                                                           mask.kept_mass, mask.extras, mask.metadata)
    ids, counts, lp = mask.to_padded()
    assert lp.dtype == torch.float32 and bool((lp[ids < 0] == -INF).all())
    assert SamplingMask.from_padded(ids, counts, entry_logprobs=lp).entry_logprobs.equal(mask.entry_logprobs)
    save_padded(mask, tmp_path / "p.safetensors")
    assert load_padded(tmp_path / "p.safetensors") == mask


@pytest.mark.parametrize("values, problem", [
    (lambda m: m.entry_logprobs[:-1], "entry_logprobs must be a 1-D floating tensor of"),
    (lambda m: m.entry_logprobs.index_fill(0, m.offsets[2:3], float("nan")), "entry_logprobs of row 2 hold nan"),
    (lambda m: m.entry_logprobs.index_fill(0, m.offsets[4:5], INF), "entry_logprobs of row 4 hold inf"),
    (lambda m: m.entry_logprobs.index_add(0, m.offsets[5:6], torch.tensor([0.5])),
     "entry_logprobs of row 5 do not normalise"),
])
def test_validate_names_the_row(values, problem):
    z = torch.randn(8, 30, generator=torch.Generator().manual_seed(5)) * 2
    mask = mr.capture(z, top_k=3, sampled=z.argmax(1), entry_logprobs=True)
    bad = SamplingMask(mask.token_ids, mask.offsets, entry_logprobs=values(mask))
    with pytest.raises(mr.MaskFormatError, match=problem):
        bad.validate()


def test_streamed_capture_cli_matches_the_library_and_reads_back_in_chunks(tmp_path):
    t = rollout_tensors()
    write(tmp_path / "r.safetensors", t)
    out = tmp_path / "m.safetensors"
    result = run("capture", tmp_path / "r.safetensors", "-o", out, "--chunk-rows", "5", "--entry-logprobs")
    assert result.exit_code == 0, result.output
    lib = mr.capture(t["logits"], top_p=t["top_p"].item(), sampled=t["sampled"], entry_logprobs=True)
    got = SamplingMask.load(out)
    assert torch.equal(got.entry_logprobs, lib.entry_logprobs) and torch.equal(got.token_ids, lib.token_ids)
    assert torch.equal(got.logprobs, lib.logprobs)
    with MaskFile(str(out)) as mf:
        chunk = mf.rows(7, 15, t["logits"].shape[1])
        assert torch.equal(chunk.entry_logprobs, lib.select_rows(7, 15).entry_logprobs)
    # without the flag there is no such key; --resume tells the two apart
    plain = tmp_path / "plain.safetensors"
    run("capture", tmp_path / "r.safetensors", "-o", plain)
    assert "entry_logprobs" not in load_file(str(plain))
    before = out.stat().st_mtime_ns
    assert run("capture", tmp_path / "r.safetensors", "-o", out, "--entry-logprobs", "--resume").exit_code == 0
    assert out.stat().st_mtime_ns == before
    inspect = run("inspect", out)
    assert inspect.exit_code == 0 and "entry log-probs" in inspect.output and "one per support entry" in inspect.output


def test_mask_file_with_bad_entry_logprobs_is_one_line_error(tmp_path):
    t = rollout_tensors()
    write(tmp_path / "r.safetensors", t)
    out = tmp_path / "m.safetensors"
    run("capture", tmp_path / "r.safetensors", "-o", out, "--entry-logprobs")
    tensors = load_file(str(out))
    tensors["entry_logprobs"] = tensors["entry_logprobs"][:-1].contiguous()
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    write(tmp_path / "train.safetensors", {"logits": t["logits"]})
    result = run("score", "--masks", tmp_path / "bad.safetensors", "--training", tmp_path / "train.safetensors")
    assert_one_line_error(result, "bad.safetensors", "entry_logprobs")


def test_torchrun_shares_merge_into_the_single_capture(tmp_path):
    t = rollout_tensors(n=21)
    path = write(tmp_path / "r.safetensors", t)
    single = capture_dumps([path], str(tmp_path / "one.safetensors"), progress=False, entry_logprobs=True)
    assert single.mask is None
    parts = [capture_dumps([path], None, rows=r, progress=False, entry_logprobs=True).mask
             for r in ((0, 8), (8, 8), (8, 21))]
    merged = merge_masks(parts, "error")
    assert merged == SamplingMask.load(tmp_path / "one.safetensors")
    empty = capture_dumps([path], None, rows=(0, 0), progress=False, entry_logprobs=True).mask
    assert empty.entry_logprobs is not None and empty.entry_logprobs.numel() == 0


@pytest.mark.slow
def test_torchrun_capture_with_entry_logprobs(tmp_path):
    path = write(tmp_path / "r.safetensors", rollout_tensors(n=30))
    assert run("capture", path, "-o", tmp_path / "one.safetensors", "--entry-logprobs").exit_code == 0
    proc = torchrun(2, "-m", "mask_replay", "capture", path, "-o", str(tmp_path / "two.safetensors"),
                    "--entry-logprobs", "--chunk-rows", "4", cwd=tmp_path, env={"PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "two.safetensors"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_convert_engine_json_keeps_entry_logprobs(tmp_path):
    rows = [[2, 5, 7], [1]]
    lps = torch.log_softmax(torch.tensor([1.0, 2.0, 0.5]), 0).tolist()
    resp = {"request_id": "r", "choices": [{"index": 0, "token_ids": [5, 1], "sampling_mask": rows,
                                            "sampling_mask_logprobs": [lps, [0.0]]}]}
    (tmp_path / "v.json").write_text(json.dumps(resp))
    out = tmp_path / "m.safetensors"
    result = run("convert", tmp_path / "v.json", "-o", out, "--from", "vllm-json")
    assert result.exit_code == 0, result.output
    m = SamplingMask.load(out)
    assert m.entry_logprobs.tolist() == pytest.approx(lps + [0.0])
    assert m.logprobs[0].item() == m.entry_logprobs[1].item()
    # an engine whose entries do not normalise is refused, naming the token
    resp["choices"][0]["sampling_mask_logprobs"] = [[-1.0, -1.0, -1.0], [0.0]]
    (tmp_path / "bad.json").write_text(json.dumps(resp))
    result = run("convert", tmp_path / "bad.json", "-o", tmp_path / "x.safetensors", "--from", "vllm-json")
    assert_one_line_error(result, "token 0", "do not normalise")


# ---- score: support KL and tokens that differ -----------------------------------------------------------
def _score_json(tmp_path, training_logits, *extra):
    out = tmp_path / "score.json"
    write(tmp_path / "train.safetensors", {"logits": training_logits})
    result = run("score", "--masks", tmp_path / "m.safetensors", "--training", tmp_path / "train.safetensors",
                 "--json", out, "--chunk-rows", "7", *extra)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_score_reports_support_kl_and_tokens_different(tmp_path):
    t = rollout_tensors(n=30, v=50, seed=3)
    write(tmp_path / "r.safetensors", t)
    assert run("capture", tmp_path / "r.safetensors", "-o", tmp_path / "m.safetensors", "--entry-logprobs",
               "--temperature", "0.8").exit_code == 0
    same = _score_json(tmp_path, t["logits"])
    assert same["support"]["support_kl_max"] == pytest.approx(0.0, abs=1e-6)
    assert same["support"]["ratio_tokens_different"] == 0.0
    g = torch.Generator().manual_seed(9)
    train = t["logits"] + 0.3 * torch.randn(t["logits"].shape, generator=g)
    report = _score_json(tmp_path, train)
    # the float64 reference of KL(q || p) over each row's support
    mask = SamplingMask.load(tmp_path / "m.safetensors")
    lq = reference_entries(t["logits"], mask, 0.8)
    lp = reference_entries(train, mask, 0.8)
    kl = torch.zeros(mask.num_rows, dtype=torch.float64).index_add(0, mask.row_ids(), lq.exp() * (lq - lp))
    assert report["support"]["support_kl_mean"] == pytest.approx(float(kl.mean()), rel=1e-5)
    assert report["support"]["support_kl_max"] == pytest.approx(float(kl.max()), rel=1e-5)
    rep = mr.replay_logprobs(train, mask, temperature=0.8).double()
    want = float(((rep - mask.logprobs.double()).abs() > 1e-6).double().mean())
    assert report["support"]["ratio_tokens_different"] == pytest.approx(want)
    # a mask file without entries has no such section
    assert run("capture", tmp_path / "r.safetensors", "-o", tmp_path / "m.safetensors",
               "--temperature", "0.8").exit_code == 0
    assert "support" not in _score_json(tmp_path, train)


def test_vllm_sampling_mask_object_logprobs_and_sglang_per_support_mode():
    """vLLM's offline SamplingMask(token_ids, logprobs) object, and SGLang's per-support
    output_token_sampling_logprobs (one list per token aligned with the ids), become entry_logprobs."""
    lp = torch.log_softmax(torch.tensor([2.0, 0.5, 1.0]), 0).tolist()
    obj = SimpleNamespace(token_ids=[[9, 4, 6], [1]], logprobs=[lp, [0.0]])
    completion = SimpleNamespace(index=0, token_ids=[4, 1], logprobs=None, sampling_mask=obj)
    request = SimpleNamespace(request_id="r", outputs=[completion])
    m = SamplingMask.from_vllm([request])
    assert m.to_lists() == [[4, 6, 9], [1]]
    assert m.entry_logprobs.tolist() == pytest.approx([lp[1], lp[2], lp[0], 0.0])  # sorted with the ids
    assert m.logprobs.tolist() == pytest.approx([lp[1], 0.0])
    resp = {"output_ids": [4, 1], "meta_info": {"id": "s", "output_token_sampling_mask": [[9, 4, 6], [1]],
                                                 "output_token_sampling_logprobs": [lp, [0.0]]}}
    s = SamplingMask.from_sglang(resp)
    assert torch.equal(s.entry_logprobs, m.entry_logprobs) and torch.equal(s.token_ids, m.token_ids)
