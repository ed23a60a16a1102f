"""``hf-posenc lm-eval`` end to end, offline: lm-eval's packaged task definitions on the local
fixture files (tests/fixtures/lm_eval), tiny checkpoints with a BPE tokenizer, both modes
(recipe and passthrough to lm-eval's own CLI), and every bad input rejected before lm-eval runs."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

import hf_posenc  # noqa: E402
from hf_posenc.recipes.cli import main  # noqa: E402
from hf_posenc.recipes.data import stdlib_documents  # noqa: E402
from hf_posenc.recipes.integrations.lm_eval_tasks import (  # noqa: E402
    PRESETS,
    plan_tasks,
    read_task_yaml,
    select_tasks,
    write_task_configs,
)
from hf_posenc.recipes.tiny import tiny_model  # noqa: E402
from hf_posenc.recipes.tokenizer import train_bpe_tokenizer  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures" / "lm_eval"
SUBJECTS = ["abstract_algebra", "philosophy"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A plain tiny Llama and the same model patched with ALiBi, each saved with its tokenizer."""
    root = tmp_path_factory.mktemp("lm_eval_checkpoints")
    tokenizer = train_bpe_tokenizer(itertools.islice(stdlib_documents(), 4), vocab_size=320)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = tiny_model("llama", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **ids)
    dirs = {"plain": root / "plain", "alibi": root / "alibi"}
    model.save_pretrained(dirs["plain"])
    hf_posenc.patch_model(model, "alibi")
    model.save_pretrained(dirs["alibi"])
    for folder in dirs.values():
        tokenizer.save_pretrained(folder)
    return dirs


@pytest.fixture(autouse=True)
def lm_eval_logging_follows_capture():
    """lm-eval's CLI binds a log handler to the sys.stderr of the moment (pytest's capture);
    drop it after each test so later tests do not log to a closed stream."""
    yield
    import logging

    import lm_eval.utils

    logger = logging.getLogger("lm_eval")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True
    lm_eval.utils._LOGGING_CONFIGURED = False


def lm_eval_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["lm-eval", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def results_files(output: Path) -> dict[str, dict]:
    """lm-eval's results JSON under ``output``, keyed by the checkpoint folder's name."""
    found = {}
    for path in output.glob("*/results_*.json"):
        results = json.loads(path.read_text())
        found[Path(results["config"]["model_args"]["pretrained"]).name] = results
    return found


def assert_accuracies(results: dict, names) -> None:
    for name in names:
        assert 0.0 <= results["results"][name]["acc,none"] <= 1.0, name


@pytest.mark.slow  # multi-second (process launches, waits, full runs): CI runs it
def test_paper_preset_on_local_data_compares_checkpoints(checkpoints, tmp_path, capsys):
    """The paper preset runs the four packaged tasks 0-shot on the fixture files for a patched
    checkpoint and a plain one patched through model_args (encoding=t5,num_buckets=16), writes
    lm-eval's JSON per model and prints one table with a column per model."""
    output = tmp_path / "out"
    code, out, err = lm_eval_cli(
        capsys, "--preset", "paper", "--pretrained", checkpoints["alibi"],
        "--model_args", f"pretrained={checkpoints['plain']},encoding=t5,num_buckets=16",
        "--data-dir", FIXTURES, "--mmlu-subjects", *SUBJECTS, "--limit", 2, "--output", output,
    )  # fmt: skip
    assert code == 0, err
    found = results_files(output)
    assert set(found) == {"alibi", "plain"}
    tasks = ["hellaswag", "arc_easy", "arc_challenge", "mmlu", *(f"mmlu_{s}" for s in SUBJECTS)]
    for results in found.values():
        assert_accuracies(results, tasks)
        assert all(results["n-shot"][name] == 0 for name in tasks if name != "mmlu")
    assert found["alibi"]["config"]["posenc"] == {"encoding": "alibi", "params": {"scaling": None}}
    assert found["plain"]["config"]["posenc"]["encoding"] == "t5"
    assert found["plain"]["config"]["posenc"]["params"]["num_buckets"] == 16
    header = next(line for line in out.splitlines() if line.startswith("| task"))
    assert "alibi (alibi)" in header and "plain (t5)" in header
    for name in ("hellaswag", "mmlu", "arc_easy", "arc_challenge"):
        assert any(line.startswith(f"| {name} ") and " acc " in line for line in out.splitlines()), name
    assert (output / "comparison.md").read_text().startswith("| task")


@pytest.mark.slow  # multi-second; CI runs it
def test_leaderboard_preset_runs_each_task_with_its_own_shots(checkpoints, tmp_path, capsys):
    """The leaderboard preset gives HellaSwag 10, ARC 25 and MMLU 5 shots, drawn from the train
    (dev for MMLU) files of the shipped fixtures, which hold enough rows for them (offline)."""
    output = tmp_path / "out"
    code, out, err = lm_eval_cli(
        capsys, "--preset", "leaderboard", "--pretrained", checkpoints["alibi"], "--data-dir", FIXTURES,
        "--mmlu-subjects", "philosophy", "--limit", 1, "--output", output,
    )  # fmt: skip
    assert code == 0, err
    results = results_files(output)["alibi"]
    assert_accuracies(results, ["hellaswag", "arc_easy", "arc_challenge", "mmlu_philosophy"])
    shots = {name: results["n-shot"][name] for name in ("hellaswag", "arc_easy", "arc_challenge")}
    assert shots == {"hellaswag": 10, "arc_easy": 25, "arc_challenge": 25}
    assert results["n-shot"]["mmlu_philosophy"] == 5
    assert "| value" in out and "| ± stderr" in out and "| n " in out  # one model: value, stderr, count
    comparison = (output / "comparison.md").read_text()
    assert "standard error" in comparison and "versions: " in comparison and "command: " in comparison


@pytest.mark.slow  # multi-second (process launches, waits, full runs): CI runs it
def test_passthrough_runs_lm_eval_own_cli_with_the_registered_model(checkpoints, tmp_path, capsys):
    """Without recipe options the arguments go to lm-eval's CLI unchanged; ``--model hf-posenc``
    resolves, and ``encoding=alibi`` patches the plain checkpoint."""
    tasks = tmp_path / "tasks"
    write_task_configs(plan_tasks({"arc_easy": 0}, FIXTURES), tasks)
    code, out, err = lm_eval_cli(
        capsys, "--model", "hf-posenc", "--model_args", f"pretrained={checkpoints['plain']},encoding=alibi",
        "--tasks", "arc_easy", "--include_path", tasks, "--limit", 2, "--output_path", tmp_path / "out",
    )  # fmt: skip
    assert code == 0, err
    assert "arc_easy" in out and "acc" in out  # lm-eval's own table
    results = results_files(tmp_path / "out")["plain"]
    assert results["config"]["model"] == "hf-posenc"
    assert results["config"]["posenc"] == {"encoding": "alibi", "params": {"scaling": None}}
    assert_accuracies(results, ["arc_easy"])


def test_passthrough_defaults_the_model_to_hf_posenc():
    """A passthrough evaluation that names no model gets ``--model hf-posenc`` (lm-eval's default
    ``hf`` would drop the encoding); an explicit model, a config file, help and ``ls`` stay as given."""
    from hf_posenc.recipes.cli.lm_eval import _with_default_model

    assert _with_default_model(["--tasks", "x"]) == ["--model", "hf-posenc", "--tasks", "x"]
    assert _with_default_model(["run", "--tasks", "x"]) == ["run", "--model", "hf-posenc", "--tasks", "x"]
    for argv in (
        ["--model", "hf", "--tasks", "x"],
        ["--config", "c.yaml"],
        ["ls", "tasks"],
        ["run"],
        ["run", "-h"],
    ):
        assert _with_default_model(argv) == argv


def test_presets_expand_to_per_task_shots():
    """Presets expand to the documented shot counts, restricted to --tasks when given; without a
    preset every task gets --num_fewshot."""
    assert select_tasks(None, "paper") == dict.fromkeys(("hellaswag", "mmlu", "arc_easy", "arc_challenge"), 0)
    assert select_tasks(["arc_challenge"], "leaderboard") == {"arc_challenge": 25}
    assert PRESETS["leaderboard"] == {"hellaswag": 10, "mmlu": 5, "arc_easy": 25, "arc_challenge": 25}
    assert select_tasks(["hellaswag"], None, 3) == {"hellaswag": 3}


def test_hub_task_configs_keep_the_packaged_datasets(tmp_path):
    """Without --data-dir each generated config is the packaged one plus num_fewshot, and MMLU
    keeps lm-eval's group hierarchy (mmlu -> categories -> subjects)."""
    runs = plan_tasks({"hellaswag": 10, "mmlu": 5}, None, ["anatomy", "philosophy"])
    names = write_task_configs(runs, tmp_path)
    assert names == ["hellaswag", "mmlu"]
    hellaswag = read_task_yaml(tmp_path / "hellaswag.yaml")
    assert hellaswag["dataset_path"] == "Rowan/hellaswag" and hellaswag["num_fewshot"] == 10
    anatomy = read_task_yaml(tmp_path / "mmlu_anatomy.yaml")
    assert (anatomy["dataset_path"], anatomy["dataset_name"], anatomy["num_fewshot"]) == (
        "cais/mmlu",
        "anatomy",
        5,
    )
    assert read_task_yaml(tmp_path / "_mmlu.yaml")["task"] == ["mmlu_stem", "mmlu_humanities"]


@pytest.mark.slow  # multi-second; CI runs it
def test_model_args_override_a_patched_checkpoints_scaling(checkpoints, tmp_path, capsys):
    """``scaling.type=linear,scaling.factor=2`` on a saved ALiBi checkpoint evaluates it with
    interpolated distances (Al-Khateeb et al. 2023): the recipe runs, labels the row as an
    evaluation-time change and records the scaling lm-eval saw."""
    output = tmp_path / "out"
    code, out, err = lm_eval_cli(
        capsys, "--tasks", "arc_easy", "--pretrained", checkpoints["alibi"], "--data-dir", FIXTURES,
        "--model_args", "scaling.type=linear,scaling.factor=2", "--limit", 2, "--output", output,
    )  # fmt: skip
    assert code == 0, err
    assert "[1/1] alibi (alibi, x0.5 at eval):" in out
    results = results_files(output)["alibi"]
    assert results["config"]["posenc"] == {
        "encoding": "alibi",
        "params": {"scaling": {"type": "linear", "factor": 2.0}},
    }
    assert_accuracies(results, ["arc_easy"])


def test_lm_eval_model_with_scaling_keys_equals_the_model_patched_at_that_scaling(checkpoints):
    """The hf-posenc lm-eval model built from a saved ALiBi checkpoint plus dotted scaling keys
    (reconfigured after loading) gives the logits of the plain checkpoint patched with ALiBi at
    that scaling from the start, and not those of the unscaled checkpoint."""
    from hf_posenc.recipes.integrations.lm_eval_model import PosencLM

    scaling = {"scaling.type": "linear", "scaling.factor": 2}
    lm = PosencLM(pretrained=str(checkpoints["alibi"]), device="cpu", **scaling)
    assert hf_posenc.patch_info(lm.model)["params"]["scaling"] == {"type": "linear", "factor": 2.0}
    patched_at_factor = hf_posenc.load_model(
        str(checkpoints["plain"]), "alibi", {"scaling": {"type": "linear", "factor": 2.0}}
    ).eval()
    unscaled = hf_posenc.load_model(str(checkpoints["alibi"])).eval()
    ids = torch.tensor([[5, 17, 42, 3, 99, 7, 64, 12, 8, 30]])
    with torch.no_grad():
        logits = lm.model(ids).logits
        assert torch.equal(logits, patched_at_factor(ids).logits)
        assert not torch.allclose(logits, unscaled(ids).logits, atol=1e-4)


@pytest.fixture
def no_evaluation(monkeypatch):
    """Fail the test if lm-eval starts evaluating: bad input must be rejected before that."""
    import lm_eval

    def refuse(*args, **kwargs):
        raise AssertionError("lm-eval ran although the input was bad")

    monkeypatch.setattr(lm_eval, "simple_evaluate", refuse)


def _without_arc_easy_test(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(FIXTURES, data)
    (data / "arc_easy" / "test.jsonl").unlink()
    return data


def _short_hellaswag_train(tmp_path: Path) -> Path:
    """The fixtures with 10 HellaSwag train rows: one short of what 10 shots need."""
    data = tmp_path / "short"
    shutil.copytree(FIXTURES, data)
    train = data / "hellaswag" / "train.jsonl"
    train.write_text("\n".join(train.read_text().splitlines()[:10]) + "\n")
    return data


BAD_INPUTS = {
    "unknown task": (["--tasks", "hellaswagg"], "unknown task 'hellaswagg'. Did you mean 'hellaswag'?"),
    "unknown preset": (
        ["--preset", "papers"],
        "unknown preset 'papers'. Did you mean 'paper'? Allowed: paper",
    ),
    "unknown MMLU subject": (["--preset", "paper", "--mmlu-subjects", "anatomyy"], "unknown MMLU subject"),
    "missing data dir": (["--preset", "paper", "--data-dir", "{tmp}/nowhere"], "is not a directory"),
    "missing fixture file": (["--tasks", "arc_easy", "--data-dir", "{no_arc_test}"], "arc_easy/test.jsonl"),
    "too few few-shot rows": (
        ["--preset", "leaderboard", "--data-dir", "{short_hellaswag}"],
        "10-shot needs at least 11 rows",
    ),
    "missing checkpoint": (["--tasks", "arc_easy", "--pretrained", "{tmp}/no-such-ckpt"], "does not exist"),
    "unwritable output": (["--tasks", "arc_easy", "--output", "{tmp}/a-file/out"], "cannot be created"),
    "unknown encoding parameter": (
        [
            "--tasks",
            "arc_easy",
            "--data-dir",
            "{fixtures}",
            "--model_args",
            "pretrained={plain},encoding=t5,num_bucket=16",
        ],
        "encoding 't5' has no parameter 'num_bucket'; allowed parameters",
    ),
    "parameters without an encoding": (
        [
            "--tasks",
            "arc_easy",
            "--data-dir",
            "{fixtures}",
            "--model_args",
            "pretrained={plain},num_buckets=16",
        ],
        "add encoding=NAME",
    ),
    "re-encoding a patched checkpoint": (
        [
            "--tasks",
            "arc_easy",
            "--data-dir",
            "{fixtures}",
            "--model_args",
            "pretrained={alibi},encoding=rope",
        ],
        "was saved with encoding 'alibi'",
    ),
    "bad override of a patched checkpoint": (
        [
            "--tasks",
            "arc_easy",
            "--data-dir",
            "{fixtures}",
            "--model_args",
            "pretrained={alibi},scaling.type=linear,scaling.factor=-1",
        ],
        "overriding the saved encoding parameters: alibi: parameter scaling['factor']=-1 is not allowed",
    ),
    "a pattern longer than the checkpoint's depth": (
        [
            "--tasks",
            "arc_easy",
            "--data-dir",
            "{fixtures}",
            "--model_args",
            "pretrained={plain},encoding=rope*9+nope",
        ],
        "encoding pattern 'rope*9+nope' has 10 entries but the model has",
    ),
    "a scaling past float32 on a patched checkpoint": (
        [
            "--tasks",
            "arc_easy",
            "--data-dir",
            "{fixtures}",
            "--model_args",
            "pretrained={alibi},scaling.type=linear,scaling.factor=1e-50",
        ],
        "alibi: parameter scaling={'type': 'linear', 'factor': 1e-50} is not allowed",
    ),
    "unsupported option with a recipe": (
        ["--preset", "paper", "--gen_kwargs", "x=1"],
        "unsupported with a recipe",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_rejected_before_evaluation(case, checkpoints, tmp_path, capsys, no_evaluation):
    """Each bad input ends with exit code 2 and a message naming the problem (and what is allowed),
    without running lm-eval and without a traceback."""
    args, message = BAD_INPUTS[case]
    (tmp_path / "a-file").write_text("")
    values = dict(tmp=tmp_path, fixtures=FIXTURES, plain=checkpoints["plain"], alibi=checkpoints["alibi"])
    if "{no_arc_test}" in args:
        values["no_arc_test"] = _without_arc_easy_test(tmp_path)
    if "{short_hellaswag}" in args:
        values["short_hellaswag"] = _short_hellaswag_train(tmp_path)
    args = [a.format(**values) for a in args]
    if not any(a in args for a in ("--pretrained", "--model_args")):
        args += ["--pretrained", str(checkpoints["alibi"])]
    code, _, err = lm_eval_cli(capsys, *args)
    assert code == 2
    assert message in err and "Traceback" not in err
