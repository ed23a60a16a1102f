"""A full disk while a command writes its output: one line naming where and what to do, the
files written before intact, nothing half-written (issue 19 finding 7's "disk full", beyond
``train``'s checkpoints: results, plots, exports).

Result files are written to a hidden partial and renamed over the target when complete
(``hf_posenc.recipes.atomic``); a write that fails leaves the previous file and no partial.
The full disk is simulated by a write that raises ``OSError(ENOSPC)`` part-way, as the kernel
does (the real thing, a 300 KiB tmpfs, was checked by hand: same line, same files).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from training_runs import base_workspace, error_lines, perplexity_argv

import hf_posenc
from hf_posenc.recipes import atomic
from hf_posenc.recipes.cli import main
from hf_posenc.recipes.tiny import tiny_model


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_partial(tmp_path):
    target = tmp_path / "results.json"
    atomic.write_text(target, '{"first": 1}\n')
    with pytest.raises(OSError), atomic.replacing(target) as partial:
        partial.write_text('{"sec')  # part of the new content, then the disk is full
        disk_full()
    assert target.read_text() == '{"first": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return base_workspace(tmp_path_factory.mktemp("full-disk"))


def test_perplexity_on_a_full_disk_says_where_and_keeps_what_it_wrote(
    workspace, tmp_path, capsys, monkeypatch
):
    from matplotlib.figure import Figure

    def half_a_picture(self, path, **kwargs):  # writes part of the PNG, then the disk is full
        Path(path).write_bytes(b"\x89PNG")
        disk_full()

    monkeypatch.setattr(Figure, "savefig", half_a_picture)
    out = tmp_path / "report"
    assert main(perplexity_argv(workspace, "base", out, "--encoding", "alibi")) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and f"no space left on {out}" in errors[0] and "Traceback" not in errors[0], (
        errors
    )
    assert json.loads((out / "results.json").read_text())["results"]  # whole, readable
    assert not (out / "loss_vs_length.png").exists()
    assert not [p.name for p in out.iterdir() if ".partial" in p.name]


def test_export_on_a_full_disk_says_where_and_leaves_no_folder(tmp_path, capsys, monkeypatch):
    from transformers import PreTrainedModel

    model = hf_posenc.patch_model(tiny_model("llama"), "rope", scaling={"type": "linear", "factor": 2.0})
    model.save_pretrained(tmp_path / "ckpt")
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", disk_full)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and f"no space left on {tmp_path / 'out'}" in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no OUT, no staging folder
