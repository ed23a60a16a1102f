"""The extrapolation study end to end on a miniature configuration (the real default is
the same code with bigger numbers), its reuse of finished runs, and its early errors."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import hf_posenc
from hf_posenc.recipes.cli import main
from hf_posenc.recipes.study import StudyConfig, parse_encoding_spec, run_study

MINI = dict(
    encodings=["rope", "alibi", 'expe{"scaling": {"type": "linear", "factor": 2}}'],
    train_length=16,
    multiples=[1, 2, 4],
    steps=2,
    pretrain_steps=3,
    batch_size=4,
    eval_tokens=256,
    vocab_size=300,
    hidden_size=32,
    num_layers=1,
    max_documents=12,
    retrieval_documents=0,  # the passkey experiment (on by default) has its own tests
)


@pytest.mark.slow  # multi-second; CI runs it
def test_default_study_runs_offline_and_writes_the_report(tmp_path, capsys):
    """Embedded default (stdlib corpus, BPE tokenizer, RoPE-pretrained tiny Llama): one row per
    encoding plus the base, one column per evaluation length, table/CSV/JSON/PNG on disk."""
    paths = run_study(StudyConfig(output_dir=str(tmp_path), **MINI))
    out = capsys.readouterr().out
    assert set(paths) == {"table", "csv", "json", "png"}
    assert paths["png"].read_bytes().startswith(b"\x89PNG")
    report = json.loads(paths["json"].read_text())
    text = paths["table"].read_text()
    for label in ["rope (base, no further training)", "rope", "alibi", "expe (scaling linear x2)"]:
        assert label in text and label in out
    assert "loss, nats (ev=4, 64 tok)" in text and "(n=" in text and "increase, nats" in text
    assert "warning: too short" in text  # MINI trains a couple of steps
    assert report["row_kinds"]["rope (base, no further training)"] == "base"
    assert report["row_kinds"]["rope (PI at eval, factor = length/16)"] == "eval-only"
    assert report["row_kinds"]["alibi"] == "trained"
    assert report  # machine-readable copy of the same numbers
    # every run is a reloadable patched checkpoint
    alibi = hf_posenc.from_pretrained(str(tmp_path / "runs" / "alibi" / "final"))
    assert hf_posenc.patch_info(alibi)["encoding"] == "alibi"
    expe_dir = tmp_path / "runs" / "expe_scaling_type_linear_factor_2"
    assert expe_dir.is_dir(), sorted(p.name for p in (tmp_path / "runs").iterdir())
    # the default evaluation-only row of a trained rope: position interpolation at each length,
    # factor 1 at 1x (so it equals the trained rope row there), labelled and listed as eval-only
    results = report["results"]
    interpolated = results["rope (PI at eval, factor = length/16)"]
    assert interpolated[0]["loss_nats"] == results["rope"][0]["loss_nats"]
    assert all(
        a["loss_nats"] != b["loss_nats"] for a, b in zip(interpolated[1:], results["rope"][1:], strict=True)
    )
    # and RoPE + SelfExtend, no training: window 16/2 = 8, group size ceil((64 - 8)/(16 - 8)) + 1 = 8
    selfextend = "rope (selfextend window=8, group_size=8, no training)"
    assert report["metadata"]["eval_only_rows"] == ["rope (PI at eval, factor = length/16)", selfextend]
    assert len(results[selfextend]) == len(MINI["multiples"])
    assert "evaluation only, no training" in out


@pytest.mark.slow  # multi-second; CI runs it
def test_eval_only_rows_evaluate_trained_runs_at_other_parameters(tmp_path, capsys):
    """An explicit evaluation-only row (alibi trained unscaled, evaluated at factor 2) trains
    nothing new and equals the trained alibi weights patched with ALiBi at factor 2 from the start
    (slopes / 2, Al-Khateeb et al. 2023), evaluated on the same tokens."""
    from transformers import AutoTokenizer

    from hf_posenc.recipes.data import read_documents, tokenize_documents
    from hf_posenc.recipes.evaluation import evaluate_lengths, token_budget

    mini = {
        **MINI,
        "encodings": ["alibi"],
        "eval_only": ['alibi@{"scaling": {"type": "linear", "factor": 2}}'],
    }
    report = json.loads(run_study(StudyConfig(output_dir=str(tmp_path), **mini))["json"].read_text())
    row = report["results"]["alibi (x0.5 at eval)"]
    assert report["metadata"]["eval_only_rows"] == ["alibi (x0.5 at eval)"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["alibi"]

    model = hf_posenc.from_pretrained(str(tmp_path / "runs" / "alibi" / "final"))
    hf_posenc.unpatch_model(model)
    hf_posenc.patch_model(model, "alibi", scaling={"type": "linear", "factor": 2.0})
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "base" / "final"))
    documents = read_documents(["builtin:stdlib"], split="validation")
    lengths = [16 * m for m in MINI["multiples"]]
    tokens = tokenize_documents(documents, tokenizer, max_tokens=max(MINI["eval_tokens"], max(lengths)))
    tokens = tokens[: token_budget(tokens.numel(), lengths, MINI["eval_tokens"])]
    expected = evaluate_lengths(model, tokens, 16, MINI["multiples"], batch_size=8, progress=False)
    assert [r["loss_nats"] for r in row] == pytest.approx([r.loss for r in expected], abs=1e-9)


@pytest.mark.slow  # multi-second; CI runs it
def test_selfextend_row_evaluates_the_trained_rope_run_without_training(tmp_path):
    """``rope@selfextend{...}`` equals the trained rope weights patched with selfextend from the start
    (the run's RoPE settings), evaluated on the same tokens; nothing new is trained."""
    from transformers import AutoTokenizer

    from hf_posenc.recipes.data import read_documents, tokenize_documents
    from hf_posenc.recipes.evaluation import evaluate_lengths, token_budget

    mini = {**MINI, "encodings": ["rope"], "eval_only": ['rope@selfextend{"group_size": 2, "window": 4}']}
    report = json.loads(run_study(StudyConfig(output_dir=str(tmp_path), **mini))["json"].read_text())
    label = "rope (selfextend group_size=2, window=4, no training)"
    assert report["metadata"]["eval_only_rows"] == [label]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["rope"]

    model = hf_posenc.from_pretrained(str(tmp_path / "runs" / "rope" / "final"))
    hf_posenc.unpatch_model(model)
    hf_posenc.patch_model(model, "selfextend", group_size=2, window=4)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "base" / "final"))
    documents = read_documents(["builtin:stdlib"], split="validation")
    lengths = [16 * m for m in MINI["multiples"]]
    tokens = tokenize_documents(documents, tokenizer, max_tokens=max(MINI["eval_tokens"], max(lengths)))
    tokens = tokens[: token_budget(tokens.numel(), lengths, MINI["eval_tokens"])]
    expected = evaluate_lengths(model, tokens, 16, MINI["multiples"], batch_size=8, progress=False)
    assert [r["loss_nats"] for r in report["results"][label]] == pytest.approx(
        [r.loss for r in expected], abs=1e-9
    )


def _recorded_steps(run: Path) -> int:
    return json.loads((run / "final" / "training_run.json").read_text())["config"]["max_steps"]


@pytest.mark.slow  # multi-second (process launches, waits, full runs): CI runs it
def test_runs_are_reused_only_when_their_settings_match(tmp_path, capsys):
    """Same command: every run is reused. Changed --steps: an error naming the difference, nothing
    retrained or relabelled. With --overwrite: the runs are retrained with the new settings."""
    mini = {**MINI, "encodings": ["alibi"]}
    run_study(StudyConfig(output_dir=str(tmp_path), **mini))
    capsys.readouterr()
    run_study(StudyConfig(output_dir=str(tmp_path), **mini))
    out = capsys.readouterr().out
    assert "base (RoPE pretraining): reusing" in out and "alibi: reusing" in out
    before = (tmp_path / "runs" / "alibi" / "final" / "model.safetensors").read_bytes()

    changed = {**mini, "steps": 3}
    with pytest.raises(hf_posenc.InvalidParameterError, match=r"max_steps=3 \(was 2\)"):
        run_study(StudyConfig(output_dir=str(tmp_path), **changed))
    assert _recorded_steps(tmp_path / "runs" / "alibi") == 2
    assert (tmp_path / "runs" / "alibi" / "final" / "model.safetensors").read_bytes() == before

    run_study(StudyConfig(output_dir=str(tmp_path), **changed), overwrite=True)
    assert _recorded_steps(tmp_path / "runs" / "alibi") == 3
    assert json.loads((tmp_path / "results.json").read_text())["metadata"]["study"]["steps"] == 3


@pytest.mark.slow  # four miniature studies
def test_finished_runs_trained_on_since_edited_data_are_not_reused(tmp_path, capsys):
    """A data file edited between two studies: the settings name the same file, its tokens are
    not the same, so reusing the finished runs would report runs trained on the old text as if
    trained on the new. Refused in one line naming the change, nothing retrained; with
    --overwrite every run is retrained on the new text, and then reused."""
    from hf_posenc.recipes.data import stdlib_documents

    documents = list(stdlib_documents())[:12]
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    mini = {**MINI, "encodings": ["alibi"], "data": [str(data)], "eval_data": [str(data)]}
    out = tmp_path / "study"
    run_study(StudyConfig(output_dir=str(out), **mini))
    before = (out / "runs" / "alibi" / "final" / "model.safetensors").read_bytes()

    documents[3] = documents[3].replace("def ", "fed ")
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    with pytest.raises(hf_posenc.InvalidParameterError) as caught:
        run_study(StudyConfig(output_dir=str(out), **mini))
    message = str(caught.value)
    assert "\n" not in message and "training data: " in message and "--overwrite" in message, message
    assert (out / "runs" / "alibi" / "final" / "model.safetensors").read_bytes() == before

    capsys.readouterr()
    run_study(StudyConfig(output_dir=str(out), **mini), overwrite=True)
    printed = capsys.readouterr().out
    assert "base (RoPE pretraining): retraining" in printed and "alibi: retraining" in printed, printed
    run_study(StudyConfig(output_dir=str(out), **mini))
    printed = capsys.readouterr().out
    assert "base (RoPE pretraining): reusing" in printed and "alibi: reusing" in printed, printed


@pytest.mark.slow  # multi-second; CI runs it
def test_ctrl_c_leaves_a_checkpoint_and_the_same_command_continues(tmp_path, monkeypatch, capsys):
    """A real SIGINT during a run's step 2 of 4: the step finishes, a checkpoint is saved, the
    command exits with code 130; the same command resumes from that checkpoint and finishes."""
    from hf_posenc.recipes.training import loop

    original = loop.check_finite_loss
    fired = []

    def sigint_once(loss, step):  # the base trains 1 step, so step 2 is alibi's
        if step == 2 and not fired:
            fired.append(step)
            os.kill(os.getpid(), signal.SIGINT)
        return original(loss, step)

    monkeypatch.setattr(loop, "check_finite_loss", sigint_once)
    settings = {**MINI, "steps": 4, "pretrain_steps": 1, "multiples": [1, 2]}
    argv = ["study", "--output-dir", str(tmp_path), "--encodings", "alibi"]
    for key, value in settings.items():
        if key != "encodings":
            argv += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "run the same command again" in err
    run = tmp_path / "runs" / "alibi"
    assert (run / "checkpoint-2").is_dir() and not (run / "final").exists()

    monkeypatch.setattr(loop, "check_finite_loss", original)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "alibi: resuming" in out and "resuming from" in out and "(step 2)" in out
    assert [step for step, _ in json.loads((run / "final" / "losses.json").read_text())] == [1, 2, 3, 4]


@pytest.mark.slow  # interrupted, refused and retrained miniature studies
def test_an_interrupted_run_on_since_edited_data_is_refused_then_retrained(tmp_path, monkeypatch, capsys):
    """A run interrupted at step 2, its data file edited before the same command: the resume
    would go on with other tokens. Refused in one line in the study's words (before, train's
    advice to use --overwrite could not be followed through the study); with --overwrite the
    run is trained again from step 1 on the new text."""
    from training_runs import base_workspace

    from hf_posenc.recipes.training import loop

    root = base_workspace(tmp_path / "work")
    data = root / "data.txt"
    original = loop.check_finite_loss
    fired = []

    def sigint_once(loss, step):
        if step == 2 and not fired:
            fired.append(step)
            os.kill(os.getpid(), signal.SIGINT)
        return original(loss, step)

    monkeypatch.setattr(loop, "check_finite_loss", sigint_once)
    argv = ["study", "--output-dir", str(tmp_path / "study"), "--base-model", str(root / "base")]
    argv += ["--encodings", "alibi", "--data", str(data), "--train-length", "16", "--multiples", "1", "2"]
    argv += ["--steps", "4", "--batch-size", "4", "--eval-tokens", "64", "--retrieval-documents", "0"]
    argv += ["--eval-data", str(data)]  # (a local file has no held-out split)
    assert main(argv) == 130
    run = tmp_path / "study" / "runs" / "alibi"
    assert (run / "checkpoint-2").is_dir() and not (run / "final").exists()
    monkeypatch.setattr(loop, "check_finite_loss", original)

    data.write_text(data.read_text().replace("def ", "fed ", 1))
    capsys.readouterr()
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"study: the interrupted run in {str(run)!r}" in errors[0], errors
    assert "training data: " in errors[0] and "--overwrite" in errors[0], errors
    assert not (run / "final").exists()

    assert main([*argv, "--overwrite"]) == 0
    assert "resuming from" not in capsys.readouterr().out
    assert [step for step, _ in json.loads((run / "final" / "losses.json").read_text())] == [1, 2, 3, 4]


def test_config_file_is_fed_back_and_dry_run_loads_nothing(tmp_path, capsys):
    """study_config.json of one study, given to --config, reproduces its settings; flags override
    it; --dry-run prints the plan and trains nothing."""
    config = {**MINI, "encodings": ["alibi", "t5"], "output_dir": str(tmp_path / "study")}
    (tmp_path / "settings.yaml").write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in config.items()))
    assert main(["study", "--config", str(tmp_path / "settings.yaml"), "--steps", "7", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out and "train    alibi: 7 steps" in out and "train    t5: 7 steps" in out
    assert "base (RoPE pretraining): 3 steps" in out
    assert not (tmp_path / "study" / "base").exists() and not (tmp_path / "study" / "runs").exists()
    (tmp_path / "bad.json").write_text(json.dumps({"stepz": 3}))
    assert main(["study", "--config", str(tmp_path / "bad.json"), "--dry-run"]) == 2
    assert "unknown setting(s) stepz" in capsys.readouterr().err


def test_plot_labels_are_readable():
    from hf_posenc.recipes.study import display_label

    assert display_label('expe{"scaling": {"type": "linear", "factor": 2}}') == "expe (scaling linear x2)"
    assert display_label('t5{"num_buckets": 16}') == "t5 (num_buckets=16)"
    assert display_label("rotary") == "rope"


def test_encoding_specs_parse_names_aliases_and_json():
    assert parse_encoding_spec("rotary") == ("rope", {})
    assert parse_encoding_spec('t5{"num_buckets": 8}') == ("t5", {"num_buckets": 8})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--encodings", "alibbi"], "Did you mean 'alibi'"),
        (["--encodings", "expe{oops"], "not JSON"),
        (["--data", "no/such/file.txt"], "no/such/file.txt"),
        # a local file has no held-out split: its "validation split" was the training text itself
        (
            ["--data", __file__],
            "holds local files, which have no held-out split: the losses would be measured",
        ),
        (["--base-model", "./my-llama"], "'./my-llama' does not exist"),
        (["--encodings", 't5{"num_buckets": -1}'], "num_buckets"),
        (["--steps", "0"], "steps=0"),
        (["--max-documents", "0"], "study: max_documents=0 is not allowed; allowed: an integer >= 1"),
        (
            ["--encodings", "alibi", "--eval-only", "t5@interpolate"],
            "TRAINED is one of the study's encodings: alibi",
        ),
        (["--encodings", "nope", "--eval-only", "nope@interpolate"], "nope"),
        (["--encodings", "alibi", "--eval-only", "alibi@{oops"], "is neither JSON nor 'interpolate'"),
        (
            ["--encodings", "alibi", "--eval-only", 'alibi@{"max_distance": 3}'],
            "has no parameter 'max_distance'",
        ),
        (
            ["--encodings", "alibi", "--eval-only", "alibi@selfextend"],
            "selfextend does not evaluate alibi runs",
        ),
        (["--encodings", "rope", "--eval-only", 'rope@selfextend{"group_size": 0}'], "group_size=0"),
        (["--encodings", "rope", "--eval-only", "rope@selfextnd"], "unknown encoding 'selfextnd'"),
    ],
)
def test_bad_input_is_refused_before_any_training(tmp_path, capsys, argv, message):
    code = main(["study", "--output-dir", str(tmp_path / "out"), *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "base").exists()


def test_unwritable_output_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["study", "--output-dir", str(tmp_path / "file")]) == 2
    assert "file" in capsys.readouterr().err
