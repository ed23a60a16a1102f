"""Encoding parameters fit the distributed wrappers, and old checkpoints still load.

FSDP2's ``fully_shard`` refuses 0-dimensional parameters (pytorch PR #132934) and DeepSpeed's
model broadcast views every parameter as bytes (``p.data.view(torch.uint8)``, which fails on
0-dim tensors), so no encoding may register one. FIRE's ``c`` and ``L_multiplier`` were 0-dim
before they became (1,): a checkpoint holding the 0-dim tensors must load and give the logits
of the model it came from.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FAMILIES, ROTARY_FAMILIES, make_model, no_grad_logits, patch, token_ids
from encoding_cases import ALL_CASES, case_id, serves
from safetensors.torch import load_file, save_file

import hf_posenc

#: FIRE's learned scalars, stored 0-dim by checkpoints written before they became (1,)
OLD_SCALARS = (".c", ".L_multiplier")


def _first_family(case) -> str:
    return next(f for f in FAMILIES if serves(f in ROTARY_FAMILIES, case))


@pytest.mark.parametrize("case", ALL_CASES, ids=case_id)
def test_no_encoding_registers_a_zero_dimensional_parameter(case):
    """Every parameter of every registered encoding case has at least one dimension (what
    ``fully_shard`` requires), read from torch's ``named_parameters()``, and views as bytes, the
    view DeepSpeed's parameter broadcast takes (``p.data.view(torch.uint8)``)."""
    name, params = case
    model = patch(make_model(_first_family(case)), name, params, randomize=False)
    scalars = [n for n, p in model.posenc.named_parameters() if p.dim() == 0]
    assert scalars == [], f"{case_id(case)}: 0-dim parameters {scalars}"
    for n, p in model.posenc.named_parameters():
        assert p.data.view(torch.uint8).numel() == p.numel() * p.element_size(), n


def _old_form(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """``state`` as a checkpoint from before the change holds it: FIRE's scalars 0-dim."""
    old = {}
    for key, value in state.items():
        if key.startswith(prefix) and key.endswith(OLD_SCALARS):
            assert value.numel() == 1, key
            value = value.reshape(())
        old[key] = value
    return old


@pytest.mark.parametrize("shared", [False, True])
def test_checkpoint_with_zero_dim_fire_scalars_loads_with_the_same_logits(shared, tmp_path):
    """A saved FIRE model whose safetensors file holds ``posenc.*.c`` / ``posenc.*.L_multiplier``
    as 0-dim tensors (the file rewritten by hand) loads through ``hf_posenc.from_pretrained``
    and gives the logits of the model it was saved from; the values land unchanged."""
    model = patch(make_model("llama"), "fire", {"shared_across_layers": shared})
    ids = token_ids(2, 12)
    before = no_grad_logits(model, ids)
    model.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    old = _old_form(load_file(str(file)), prefix="posenc.")
    rewritten = [
        k for k, v in old.items() if k.startswith("posenc.") and v.dim() == 0 and k.endswith(OLD_SCALARS)
    ]
    assert len(rewritten) == 2 * (1 if shared else model.config.num_hidden_layers)
    save_file(old, str(file), metadata={"format": "pt"})
    reloaded = hf_posenc.from_pretrained(str(tmp_path)).eval()
    for key in rewritten:
        stored = reloaded.posenc.state_dict()[key.removeprefix("posenc.")]
        assert stored.shape == (1,) and stored.item() == old[key].item(), key
    assert torch.equal(no_grad_logits(reloaded, ids), before)


def test_load_state_dict_takes_zero_dim_fire_scalars():
    """``load_state_dict`` of the whole patched model (what a Trainer resume runs) takes a state
    dict built by hand with FIRE's scalars 0-dim, and the logits equal the source model's."""
    source = patch(make_model("llama"), "fire", {})
    target = patch(make_model("llama", seed=3), "fire", {}, randomize=False)
    ids = token_ids(1, 10)
    old = _old_form(source.state_dict(), prefix="posenc.")
    assert any(v.dim() == 0 for k, v in old.items() if k.endswith(OLD_SCALARS))
    target.load_state_dict(old, strict=True)
    assert torch.equal(no_grad_logits(target, ids), no_grad_logits(source, ids))


def test_other_shape_mismatches_still_raise():
    """Only one-value tensors are reshaped: a stored tensor of another shape still fails loudly."""
    model = patch(make_model("llama"), "fire", {})
    state = model.posenc.state_dict()
    state["functions.0.c"] = torch.ones(2)
    with pytest.raises(RuntimeError, match="functions.0.c"):
        model.posenc.load_state_dict(state)


@pytest.mark.slow
def test_fire_model_can_be_fully_sharded_by_fsdp2():
    """FSDP2's ``fully_shard`` (one gloo process on CPU) accepts a FIRE-patched model, and the
    sharded model's forward gives the unsharded model's logits."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = patch(make_model("llama"), "fire", {})
    reference = copy.deepcopy(model)
    ids = token_ids(1, 10)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(model)
        sharded = no_grad_logits(model, ids)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(sharded, no_grad_logits(reference, ids), atol=1e-6, rtol=0)
