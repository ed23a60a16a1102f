"""The AdamW groups of a training run: weight decay on the model's matrices only, none on its vectors
(norms, biases), the encoding's own parameters at ``encoding_lr`` without decay — also when DeepSpeed
ZeRO-3 has partitioned the parameters (each process then holds an empty placeholder and the real
shape as ``ds_shape``; grouping by the placeholder's shape put every matrix in the no-decay group, so
ZeRO-3 runs trained without weight decay)."""

from __future__ import annotations

import pytest
import torch

from hf_posenc.recipes.training.config import TrainConfig
from hf_posenc.recipes.training.model_setup import build_optimizer
from tests.conftest import make_model, patch


def _expected_groups(model: torch.nn.Module) -> dict[str, set[str]]:
    """Independent of build_optimizer: by module type and name, as the recipe documents it."""
    groups: dict[str, set[str]] = {"decay": set(), "no_decay": set(), "own": set()}
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if full.startswith("posenc.") or ".posenc." in full:
                groups["own"].add(full)
            elif isinstance(module, torch.nn.Linear | torch.nn.Embedding) and name == "weight":
                groups["decay"].add(full)
            else:
                groups["no_decay"].add(full)
    return groups


def _partition_like_zero3(model: torch.nn.Module) -> None:
    """What ZeRO-3 leaves on a process: each parameter an empty (0,) tensor, its shape in ds_shape."""
    for parameter in model.parameters():
        parameter.ds_shape = parameter.shape
        parameter.data = torch.empty(0, dtype=parameter.dtype)


@pytest.mark.parametrize("partitioned", [False, True], ids=["whole", "zero3-partitioned"])
def test_decay_goes_to_matrices_and_the_encoding_has_its_own_rate(partitioned):
    model = make_model("llama")
    patch(model, "t5")
    expected = _expected_groups(model)
    assert expected["decay"] and expected["no_decay"] and expected["own"]
    if partitioned:
        _partition_like_zero3(model)
    config = TrainConfig(model="m", output_dir="o", weight_decay=0.1, lr=1e-3, encoding_lr=5e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    got = {
        (group["weight_decay"], group["lr"]): {names[id(p)] for p in group["params"]}
        for group in build_optimizer(model, config).param_groups
    }
    assert got == {
        (0.1, 1e-3): expected["decay"],
        (0.0, 1e-3): expected["no_decay"],
        (0.0, 5e-3): expected["own"],
    }


def test_an_encoding_rate_of_zero_freezes_the_encoding():
    """encoding_lr=0 is a rate (the encoding's parameters stay where they are), not "not given":
    the group took the model's rate before (`encoding_lr or lr`)."""
    model = make_model("llama")
    patch(model, "t5")
    config = TrainConfig(model="m", output_dir="o", lr=1e-3, encoding_lr=0.0)
    own = {id(p) for n, p in model.named_parameters() if ".posenc." in n or n.startswith("posenc.")}
    rates = {
        group["lr"] for group in build_optimizer(model, config).param_groups if id(group["params"][0]) in own
    }
    assert rates == {0.0}


def test_an_encoding_rate_for_an_encoding_without_parameters_is_refused():
    from hf_posenc import InvalidParameterError

    model = make_model("llama")
    patch(model, "alibi")
    assert not [n for n, _ in model.named_parameters() if ".posenc." in n or n.startswith("posenc.")]
    with pytest.raises(InvalidParameterError, match="encoding_lr=0.01 would be ignored"):
        build_optimizer(model, TrainConfig(model="m", output_dir="o", lr=1e-3, encoding_lr=0.01))
    build_optimizer(model, TrainConfig(model="m", output_dir="o", lr=1e-3))  # not given: fine
