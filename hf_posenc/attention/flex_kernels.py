"""FlexAttention kernel options that build on the GPU at hand: a ladder of tiles, tried in order.

Compiled FlexAttention picks its tiles (query block, key block, pipeline stages, warps) from a
table per GPU; some choices ask for more shared memory than the card has (on an H100 in bf16 at
head_dim 64: "out of resource: shared memory, Required: 245760, Hardware limit: 232448").
The maintainers' fix is smaller tiles and fewer stages through ``kernel_options``
(pytorch/pytorch#133254, attention-gym#14). :data:`KERNEL_LADDER` lists the rungs: torch's own
choice first, then smaller tiles; the first rung that builds is kept per
:class:`KernelClass` (device, dtype, head widths, with or without backward), for the process.
Only when every rung fails does that class, and only that class, go to the chunked backend,
with one warning naming what was tried.

A class that needs a backward is probed once with the call's own shapes (forward and backward on
detached copies) before it is used: the backward kernel is built only when the loss's backward
runs, too late to choose another rung, and the probe's compiled graph is the one the real call
reuses (same shapes and guards), so the probe costs one extra forward and backward, once.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from collections.abc import Callable

import torch

#: (name, kernel_options): forward options prefixed ``fwd_``, backward ``bwd_`` (torch strips
#: the prefix for its kernel); every tile divides FlexAttention's 128-token mask block
KERNEL_LADDER: tuple[tuple[str, dict[str, object]], ...] = (
    ("default", {}),
    (
        "tiles-64",
        {
            "fwd_BLOCK_M": 64,
            "fwd_BLOCK_N": 64,
            "fwd_num_stages": 2,
            "fwd_num_warps": 4,
            "bwd_BLOCK_M1": 32,
            "bwd_BLOCK_N1": 64,
            "bwd_BLOCK_M2": 64,
            "bwd_BLOCK_N2": 32,
            "bwd_num_stages": 2,
            "bwd_num_warps": 4,
        },
    ),
    (
        "tiles-32",
        {
            "fwd_BLOCK_M": 32,
            "fwd_BLOCK_N": 32,
            "fwd_num_stages": 1,
            "fwd_num_warps": 4,
            "bwd_BLOCK_M1": 16,
            "bwd_BLOCK_N1": 32,
            "bwd_BLOCK_M2": 32,
            "bwd_BLOCK_N2": 16,
            "bwd_num_stages": 1,
            "bwd_num_warps": 4,
        },
    ),
)


#: FlashAttention-4 as FlexAttention's backend (torch's CuTe DSL template): first for calls that
#: need no backward (inference, frozen tables) where the ``flash_attn.cute`` package is installed
FLASH_RUNG: tuple[str, dict[str, object]] = ("flash", {"BACKEND": "FLASH"})


@functools.cache  # asked on every compiled call: a file-system lookup, once per process
def flash4_available() -> bool:
    """Whether FlexAttention's FLASH backend can be asked for (the FlashAttention-4 CuTe package)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no flash_attn at all
        return False


@dataclasses.dataclass(frozen=True)
class KernelClass:
    """What decides whether a FlexAttention kernel builds: the device, dtype, head widths, the
    bias form (its score_mod's loads and registers: on an H200 in bf16 at d64 torch's own tiles
    built for ALiBi's arithmetic bias and not for T5's table) and whether a backward kernel is
    needed. The sequence length does not (tiles are fixed)."""

    device: str
    dtype: str
    qk_head_dim: int
    v_head_dim: int
    form: str
    backward: bool

    def label(self) -> str:
        widths = f"d{self.qk_head_dim}"
        if self.v_head_dim != self.qk_head_dim:
            widths += f"/v{self.v_head_dim}"
        mode = "forward+backward" if self.backward else "forward"
        return f"{self.device}/{self.dtype}/{widths}/{self.form}/{mode}"


def kernel_class(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, form: str = "bias") -> KernelClass:
    """The class of a call with q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) and a bias
    of the named ``form``."""
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    device = str(q.device) if q.device.index is not None or q.device.type == "cpu" else f"{q.device.type}:0"
    dtype = str(q.dtype).removeprefix("torch.")
    return KernelClass(device, dtype, q.shape[-1], v.shape[-1], form, backward)


#: the rung that built, per class (this process)
_CHOSEN: dict[KernelClass, int] = {}
#: classes on which every rung failed -> what was tried, the last error
_EXHAUSTED: dict[KernelClass, str] = {}


def kernel_choices() -> dict[str, str]:
    """``{class label: rung name, or "chunked (...)" where every rung failed}`` for this process."""
    choices = {cls.label(): ladder(cls)[index][0] for cls, index in _CHOSEN.items()}
    choices.update({cls.label(): f"chunked ({why})" for cls, why in _EXHAUSTED.items()})
    return dict(sorted(choices.items()))


def forget_kernel_choices() -> None:
    """Clear the process's choices (tests; a process that changes GPUs)."""
    _CHOSEN.clear()
    _EXHAUSTED.clear()


def _probe_backward(attempt: Callable[..., torch.Tensor], q, k, v, options: dict[str, object]) -> None:
    """Forward and backward of ``attempt`` on detached copies of q, k, v (the call's own shapes):
    builds the backward kernel now. ``autograd.grad`` asks only for the copies' gradients, so no
    parameter's ``.grad`` is touched."""
    copies = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
    # the probe's graph keeps what it saves as it is, whatever saved-tensor hooks the caller runs
    # under: inside a recomputed step's forward (core/recompute.py) the hooks refuse every unpack
    # (that graph is never run backward), which would fail every rung's probe for a reason that
    # has nothing to do with the kernel and send the whole kind of call to the chunked backend
    with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
        out = attempt(*copies, options)
        wanted = [t for t in copies if t.requires_grad]
        torch.autograd.grad(out.float().sum(), wanted, allow_unused=True)


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """A saved tensor as it is (the probe's pack and unpack hook)."""
    return tensor


def ladder(cls: KernelClass) -> tuple[tuple[str, dict[str, object]], ...]:
    """The rungs tried for ``cls``: FlashAttention-4 first where it may serve (no backward: its
    FlexAttention template computes no captured-tensor gradients), then :data:`KERNEL_LADDER`."""
    if not cls.backward and cls.device.startswith("cuda") and flash4_available():
        return (FLASH_RUNG, *KERNEL_LADDER)
    return KERNEL_LADDER


def _first_line(error: BaseException | None) -> str:
    """``Type: first line of the message`` (at most 300 characters), for records and warnings."""
    if error is None:
        return ""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def attend_with_ladder(
    attempt: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    used: dict[str, str] | None = None,
    form: str = "bias",
) -> torch.Tensor | None:
    """``attempt(q, k, v, kernel_options)`` with the first rung of :data:`KERNEL_LADDER` that builds
    for this call's class; None (the caller falls back to the chunked backend) when none does.

    ``used``: the model's record of what served each class (``patch_info(model)["kernels"]``),
    with the rungs that failed before and why; ``form``: the bias form's name."""
    cls = kernel_class(q, k, v, form)
    if cls in _EXHAUSTED:
        return None
    tried: list[str] = []
    last_error: BaseException | None = None
    rungs = ladder(cls)
    for index in range(_CHOSEN.get(cls, 0), len(rungs)):
        name, options = rungs[index]
        try:
            if cls.backward and _CHOSEN.get(cls) != index and not torch.compiler.is_compiling():
                _probe_backward(attempt, q, k, v, options)
            out = attempt(q, k, v, options)
        except Exception as error:  # noqa: BLE001 - any build failure: the next rung, then chunked
            tried.append(name)
            last_error = error
            continue
        _CHOSEN[cls] = index
        if used is not None and (tried or cls.label() not in used):
            failed = f"; {', '.join(tried)} failed: {_first_line(last_error)}" if tried else ""
            used[cls.label()] = f"flex ({name}{failed})"
        return out
    why = f"tried {', '.join(tried)}; last error {_first_line(last_error)}"
    _EXHAUSTED[cls] = why
    if used is not None:
        used[cls.label()] = f"chunked ({why})"
    warnings.warn(
        f"hf_posenc: FlexAttention could not build a kernel for {cls.label()} ({why}); "
        "calls of this kind use the chunked backend from now on (other kinds keep FlexAttention)",
        RuntimeWarning,
        stacklevel=3,
    )
    return None
