"""`mask-replay capture|score` under torchrun (gloo): the same mask file and bit-equal JSON values
for 2 and 3 ranks as for one process; the first bad row reported as one process reports it; a
killed or hung rank fails the run with no output left behind; --resume."""
import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

import mask_replay
from mask_replay.cli.main import main
from mask_replay.files.mask_file import file_metadata
from mask_replay.tools.capture import capture_dumps
from mask_replay.tools.launch import share
from mask_replay.tools.torchrun import merge_masks
from tests.helpers import torchrun

# every test here launches torchrun (several Python processes importing torch)
pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "torchrun_worker.py")
ROWS = (23, 18)  # two rollout files; 41 rows split unevenly over 2 and 3 ranks
V = 60


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Rollout dumps, a training dump, and the single-process mask file and report."""
    d = tmp_path_factory.mktemp("dist_cli")
    g = torch.Generator().manual_seed(7)
    training = []
    for i, n in enumerate(ROWS):
        z = 3 * torch.randn(n, V, generator=g)
        sampled = torch.multinomial(torch.softmax(z, 1), 1, generator=g)[:, 0]  # some fall outside top-p
        save_file({"logits": z, "sampled": sampled, "top_p": torch.rand(n, generator=g) * 0.5 + 0.45,
                   "step": torch.arange(n) // 6 + 10 * i, "sequence": torch.arange(n) % 4},
                  str(d / f"rollout{i}.safetensors"))
        training.append(z + 0.2 * torch.randn(n, V, generator=g))
    save_file({"logits": torch.cat(training)}, str(d / "training.safetensors"))
    os.chdir(d)
    run_cli("capture", "rollout0.safetensors", "rollout1.safetensors", "-o", "masks1.safetensors", "--outside", "flag")
    run_cli("score", "--masks", "masks1.safetensors", "--training", "training.safetensors", "--json", "score1.json")
    return d


def _capture_args(out):
    return ["capture", "rollout0.safetensors", "rollout1.safetensors", "-o", out, "--outside", "flag",
            "--chunk-rows", "5"]


def _mask_file(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("nproc", [2, 3])
def test_capture_and_score_do_not_depend_on_ranks(data, nproc):
    # capture through the worker script, which records the logits rows each rank read
    proc = torchrun(nproc, WORKER, *_capture_args(f"masks{nproc}.safetensors"), cwd=data,
                    env={"MASK_REPLAY_TEST_TRACE": f"read{nproc}_"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    base, extra = divmod(sum(ROWS), nproc)
    shares = [base + (r < extra) for r in range(nproc)]
    for r in range(nproc):  # each rank streamed exactly its contiguous share of the rows
        read = json.loads((data / f"read{nproc}_{r}.json").read_text())
        first = sum(shares[:r])
        want = [i for i in range(first, first + shares[r])]
        got = [i + (ROWS[0] if name == "rollout1.safetensors" else 0) for name, a, b in read for i in range(a, b)]
        assert got == want, (r, read)
    got, got_meta = _mask_file(data / f"masks{nproc}.safetensors")
    want, want_meta = _mask_file(data / "masks1.safetensors")
    assert got.keys() == want.keys() and "outside_support" in want  # some rows flagged: merged too
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert got_meta == want_meta

    proc = torchrun(nproc, "-m", "mask_replay", "score", "--masks", f"masks{nproc}.safetensors", "--training",
                    "training.safetensors", "--json", f"score{nproc}.json", "--chunk-rows", "4", cwd=data)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((data / f"score{nproc}.json").read_text())
    assert report.pop("run") == {"world_size": nproc, "rows_per_rank": shares}
    one = json.loads((data / "score1.json").read_text())
    # the same metrics, every float exactly; `inputs` names each run's own mask file
    assert report.pop("inputs")["masks"]["path"].endswith(f"masks{nproc}.safetensors")
    assert one.pop("inputs")["masks"]["path"].endswith("masks1.safetensors")
    assert report == one
    assert report["per_step"] and "sequences" in report["replay"]


def test_first_bad_row_is_reported_as_one_process_does(data):
    z = _mask_file(data / "training.safetensors")[0]["logits"].clone()
    z[39, 5] = float("nan")  # in the last rank's rows
    z[30, 2] = float("inf")  # the first bad row, in the second rank's rows
    save_file({"logits": z}, str(data / "bad.safetensors"))
    args = ["score", "--masks", "masks1.safetensors", "--training", "bad.safetensors", "--json", "bad.json"]
    single = CliRunner().invoke(main, args)
    assert single.exit_code == 1 and "+inf at row 30" in single.output
    proc = torchrun(3, "-m", "mask_replay", *args, cwd=data)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mask-replay: error:")]
    assert errors == [single.output.strip().splitlines()[-1]], proc.stderr[-3000:]
    assert not (data / "bad.json").exists()


def _leftovers(folder, stem):
    return [n for n in os.listdir(folder) if stem in n]


def test_killed_rank_fails_the_run_and_writes_nothing(data):
    proc = torchrun(2, WORKER, *_capture_args("killed.safetensors"), cwd=data,
                    env={"MASK_REPLAY_TEST_FAIL": "1:kill"})
    assert proc.returncode != 0
    assert "mask-replay: error: rank 0:" in proc.stderr, proc.stderr[-3000:]
    assert _leftovers(data, "killed") == []  # neither the output nor a temporary file


def test_hung_rank_times_out(data):
    # 10-20 s on a quiet machine; the bound is wider than the helper's 60 s because, after the 5 s collective
    # timeout, torchrun's teardown of the hung rank (SIGTERM, then up to 30 s before SIGKILL) comes on top of two
    # ranks' start-up, which a loaded CI machine stretches: a 60 s bound timed out there once (2026-12-08)
    proc = torchrun(2, WORKER, "score", "--masks", "masks1.safetensors", "--training", "training.safetensors",
                    "--json", "hung.json", cwd=data, timeout=180,
                    env={"MASK_REPLAY_TEST_FAIL": "1:hang", "MASK_REPLAY_DIST_TIMEOUT": "5"})
    assert proc.returncode != 0
    assert "another rank died or hung (timeout MASK_REPLAY_DIST_TIMEOUT=5 s)" in proc.stderr, proc.stderr[-3000:]
    assert "Ranks 1 failed to pass monitoredBarrier" in proc.stderr
    assert _leftovers(data, "hung") == []


def test_resume_skips_complete_outputs_only(data):
    out = data / "resume.safetensors"
    args = ["capture", "rollout0.safetensors", "rollout1.safetensors", "-o", out, "--outside", "flag", "--resume"]
    first = run_cli(*args)
    assert "skipped" not in first.output and out.exists()
    before = out.stat().st_mtime_ns
    assert "complete for these inputs: skipped" in run_cli(*args).output
    assert out.stat().st_mtime_ns == before
    # another parameter, or another input list: not this command's output, so recomputed
    for other in (args + ["--top-p", "0.5"], args[:1] + args[2:]):
        assert "skipped" not in run_cli(*other).output
    # a file that is not a whole mask file is recomputed too
    out.write_bytes(out.read_bytes()[:100])
    assert "skipped" not in run_cli(*args).output
    assert _mask_file(out)[0].keys() == _mask_file(data / "masks1.safetensors")[0].keys()

    score = ["score", "--masks", "masks1.safetensors", "--training", "training.safetensors", "--json", "r.json",
             "--resume"]
    assert "skipped" not in run_cli(*score).output
    assert "r.json is complete: skipped" in run_cli(*score).output
    assert "skipped" not in run_cli(*score, "--plot", "r.png").output  # the plot was missing
    (data / "r.json").write_text('{"tokens": 3')
    assert "skipped" not in run_cli(*score).output
    assert json.loads((data / "r.json").read_text()) == json.loads((data / "score1.json").read_text())


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shares_tile_the_rows(world):
    for n in range(12):
        bounds = [share(n, world, r) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
        sizes = [b - a for a, b in bounds]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_shares_merge_into_the_single_capture(data):
    """In one process: per-share captures (one share empty, one spanning both files, flagged rows
    in some shares only) merge into the mask one capture writes (rows 0-40 of 23 + 18)."""
    paths = ["rollout0.safetensors", "rollout1.safetensors"]
    parts = [capture_dumps(paths, None, outside="flag", rows=r, progress=False).mask
             for r in ((0, 17), (17, 17), (17, 30), (30, 41))]
    assert [m.num_rows for m in parts] == [17, 0, 13, 11]
    assert "outside_support" not in parts[2].extras  # no flagged row there: the merge restores the column
    merged = merge_masks(parts, "flag")
    single = mask_replay.SamplingMask.load(str(data / "masks1.safetensors"))
    assert merged == single and file_metadata(merged.metadata) == file_metadata(single.metadata)


def _rollout_with_engine_logprobs(path, n, seed, engine_shift):
    """A dump with rollout_logprobs: rows whose engine log-prob is off by `engine_shift[i]` nats."""
    g = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(n, V, generator=g)
    sampled = torch.argmax(z, 1)
    lp = torch.log_softmax(z, 1).gather(1, sampled[:, None])[:, 0]  # unprocessed: differs under top-p
    save_file({"logits": z, "sampled": sampled, "top_p": torch.tensor(0.9), "rollout_logprobs": lp + engine_shift},
              str(path))


def test_capture_with_engine_logprobs_and_profile_does_not_depend_on_ranks(tmp_path, monkeypatch):
    """The log-prob mismatch report (metadata) and stderr warning cover every rank's rows, with
    global row numbers, as one process writes them; the per-row codes merge too. Regression: rank 0
    wrote its own share's report (its rows only) and no warning was printed."""
    shift = torch.zeros(30)
    shift[25] = 2.0  # the worst row is in rank 1's share
    _rollout_with_engine_logprobs(tmp_path / "lp.safetensors", 30, 3, shift)
    args = ["capture", "lp.safetensors", "-o", "{}", "--profile", "vllm", "--chunk-rows", "4"]
    monkeypatch.chdir(tmp_path)  # restored after the test: the module's other tests run in `data`
    single = run_cli(*[a.format("one.safetensors") for a in args])
    proc = torchrun(2, "-m", "mask_replay", *[a.format("two.safetensors") for a in args], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got, got_meta = _mask_file(tmp_path / "two.safetensors")
    want, want_meta = _mask_file(tmp_path / "one.safetensors")
    assert got.keys() == want.keys() and "logprob_mismatch" in want
    assert all(torch.equal(got[k], want[k]) for k in want)
    report = json.loads(want_meta["logprob_mismatch"])
    assert report["rows_compared"] == 30 and report["worst_row"] == 25
    assert got_meta == want_meta
    warning = [ln for ln in single.stderr.splitlines() if "warning" in ln]
    assert warning and "worst row 25" in warning[0]
    assert "worst row 25" in proc.stderr


def test_empty_share_of_a_dump_with_engine_logprobs_merges_into_the_single_capture(tmp_path):
    """A dump of 0 rows with rollout_logprobs: the in-memory share (torchrun) carries the empty
    logprob_mismatch column the streamed file has. Regression: it was missing from the merged file."""
    _rollout_with_engine_logprobs(tmp_path / "empty.safetensors", 0, 4, torch.zeros(0))
    path = str(tmp_path / "empty.safetensors")
    capture_dumps([path], str(tmp_path / "one.safetensors"), profile="vllm", progress=False)
    share_mask = capture_dumps([path], None, profile="vllm", rows=(0, 0), progress=False).mask
    merged = merge_masks([share_mask, share_mask], "error")
    single = mask_replay.SamplingMask.load(str(tmp_path / "one.safetensors"))
    assert "logprob_mismatch" in single.extras
    assert merged == single


def test_score_of_an_engine_mask_does_not_depend_on_ranks(tmp_path, monkeypatch):
    """An engine mask (convert from vLLM JSON): no kept_mass, so each rank computes it on its
    training rows and rank 0 gathers it with the log-probs (combine); an unsampled row (empty
    support) is left out. The report equals one process's, every float."""
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "vllm_generate.json")
    monkeypatch.chdir(tmp_path)  # restored after the test: the module's other tests run in `data`
    run_cli("convert", fixture, "-o", "engine.safetensors", "--from", "vllm-json", "--temperature", "0.7")
    mask = mask_replay.SamplingMask.load("engine.safetensors")
    assert mask.kept_mass is None and int((mask.lengths() == 0).sum()) == 1
    g = torch.Generator().manual_seed(11)
    save_file({"logits": 2 * torch.randn(mask.num_rows, 16, generator=g)}, "train.safetensors")
    args = ["score", "--masks", "engine.safetensors", "--training", "train.safetensors", "--chunk-rows", "2"]
    single = run_cli(*args, "--json", "one.json")
    assert "1 row with an empty support" in single.stderr
    proc = torchrun(2, "-m", "mask_replay", *args, "--json", "two.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two, one = json.loads((tmp_path / "two.json").read_text()), json.loads((tmp_path / "one.json").read_text())
    assert two.pop("run") == {"world_size": 2, "rows_per_rank": [3, 3]}
    assert two == one and one["tokens"] == mask.num_rows - 1 and one["kept_mass_mean"] > 0
