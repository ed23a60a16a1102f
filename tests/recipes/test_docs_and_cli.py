"""The README's API example runs as written, and the hf-posenc command works offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import hf_posenc
from hf_posenc.recipes.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_api_example_runs(tmp_path, monkeypatch):
    """The example runs as written and writes only into the temporary folder it names, nothing into
    the directory it is run from."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if "save_pretrained" in b)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert (Path(namespace["folder"]) / "config.json").exists()
    assert list(tmp_path.iterdir()) == []


def test_readme_test_command_is_what_ci_runs():
    command = re.search(r"(python -m pytest[^\n`]*)", README.read_text()).group(1).split("#")[0].strip()
    assert command in (README.parent / ".ci" / "run").read_text()


def test_cli_list_json_names_every_encoding_and_family(capsys):
    assert main(["list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    names = {row["name"] for row in listing["encodings"]}
    assert names >= {"nope", "sinusoidal", "learned", "t5", "alibi", "rope", "expe", "exqpe"}
    assert listing["families"] == hf_posenc.supported_families()  # every registered family's model types
    assert set(listing["families"]) >= {"gpt2", "llama", "mistral"}


def test_cli_check_passes_and_reports_each_encoding(capsys):
    assert main(["check", "--families", "gpt2", "--encodings", "alibi", "rotary"]) == 0
    out = capsys.readouterr().out
    assert "gpt2     alibi" in out and "gpt2     rope" in out and "all checks passed" in out


def test_cli_check_reports_a_family_an_encoding_refuses_and_still_passes(capsys):
    """SelfExtend extends a checkpoint's own RoPE: GPT-2 (a learned table) is refused by design,
    shown as such in its row, not counted as a failure; the RoPE family is checked as usual."""
    assert main(["check", "--families", "gpt2", "llama", "--encodings", "selfextend"]) == 0
    out = capsys.readouterr().out
    assert (
        "gpt2     selfextend  refused" in out and "llama    selfextend" in out and "all checks passed" in out
    )


def test_cli_check_rejects_an_unknown_encoding(capsys):
    """A bad name ends the command with exit code 2 and the did-you-mean message, no traceback."""
    assert main(["check", "--encodings", "alibbi"]) == 2
    err = capsys.readouterr().err
    assert "unknown encoding 'alibbi'" in err and "Did you mean 'alibi'" in err


def test_readme_encoding_table_matches_the_catalogue():
    """README's table under "## Encodings" names every encoding `hf-posenc list` knows, with the same
    aliases, and nothing else."""
    text = README.read_text()
    section = text[text.index("## Encodings") :]
    section = section[: section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"`[a-z0-9_]+`", cells[0]):
            rows[cells[0].strip("`")] = sorted(re.findall(r"`([^`]+)`", cells[1]))
    listed = {info.name: sorted(info.aliases) for info in hf_posenc.list_encodings()}
    assert rows == listed
