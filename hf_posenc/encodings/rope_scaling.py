"""RoPE frequency schedules: the base one and five context-extension scalings.

Each returns ``(inv_freq, attention_factor)``: ``inv_freq`` (dim/2,) fp32 are the rotation
frequencies omega_i, ``attention_factor`` multiplies cos and sin (so q.k by its square).

- ``linear``  position interpolation (Chen et al. 2023, arXiv:2306.15595): omega_i / factor.
- ``ntk``     NTK-aware base change (bloc97, 2023): theta' = theta * factor^(dim/(dim-2)).
- ``dynamic`` dynamic NTK (Rozière et al. / HF): for a sequence of length L > L0,
              theta' = theta * (factor*L/L0 - (factor-1))^(dim/(dim-2)); unchanged for L <= L0.
- ``yarn``    YaRN (Peng et al. 2023, arXiv:2309.00071): per-frequency blend of interpolated
              and original omega by a linear ramp over wavelengths between ``beta_fast`` and
              ``beta_slow`` rotations in L0, and attention factor 0.1*ln(factor) + 1.
- ``llama3``  Llama 3.1 (Dubey et al. 2024): long wavelengths divided by ``factor``, short ones
              kept, a smooth blend between L0/low_freq_factor and L0/high_freq_factor.
- ``longrope`` LongRoPE (Ding et al. 2024, arXiv:2402.13753; Phi-3's 128k checkpoints): per-frequency
              rescale factors found by search, omega_i = theta^(-2i/dim) / lambda_i, with
              lambda = ``short_factor`` for a sequence of length L <= L0 and ``long_factor`` past
              it; attention factor sqrt(1 + ln(factor) / ln(L0)) (1 when factor <= 1), ``factor``
              defaulting to max_position_embeddings / L0, as transformers'
              ``_compute_longrope_parameters``. transformers picks the set from the whole input's
              length; the rope encoding picks it per query (see :mod:`.rope`).

L0 is ``original_max_position_embeddings`` (default: the model's max_position_embeddings).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch

from ..core.config import check_bool, check_choice, check_keys, check_number, fail

SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "truncate",
    ),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "longrope": (
        "short_factor",
        "long_factor",
        "original_max_position_embeddings",
        "factor",
        "attention_factor",
    ),
}
#: scalings whose frequencies depend on the sequence length (the rope encoding applies them per query)
LENGTH_DEPENDENT = ("dynamic", "longrope")
SCALING_DEFAULTS: dict[str, dict[str, Any]] = {
    "yarn": {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "truncate": True},
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0},
}


def validate_scaling(encoding: str, scaling: Any) -> None:
    """Check a ``scaling`` dict: its ``type``, its keys and the range of each value."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise fail(encoding, "scaling", scaling, "None or a dict such as {'type': 'linear', 'factor': 4.0}")
    kind = scaling.get("type")
    check_choice(encoding, "scaling['type']", kind, SCALING_KEYS)
    allowed = SCALING_KEYS[cast(str, kind)]  # check_choice accepted it: one of the keys
    check_keys(encoding, f"scaling (type {kind!r})", scaling, ("type", *allowed))
    if kind == "longrope":
        _validate_longrope(encoding, scaling)
    elif "factor" not in scaling:
        raise fail(encoding, "scaling['factor']", None, "a number (required)")
    else:
        low, inclusive = (0.0, False) if kind == "linear" else (1.0, True)
        check_number(encoding, "scaling['factor']", scaling["factor"], low=low, low_inclusive=inclusive)
    if scaling.get("original_max_position_embeddings") is not None:
        check_number(
            encoding,
            "scaling['original_max_position_embeddings']",
            scaling["original_max_position_embeddings"],
            low=1,
            integer=True,
        )
    for key in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
        if key in scaling:
            check_number(encoding, f"scaling[{key!r}]", scaling[key], low=0.0, low_inclusive=False)
    if scaling.get("attention_factor") is not None:
        check_number(
            encoding, "scaling['attention_factor']", scaling["attention_factor"], low=0.0, low_inclusive=False
        )
    if "truncate" in scaling:
        check_bool(encoding, "scaling['truncate']", scaling["truncate"])
    low_ff, high_ff = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
    if kind == "llama3" and low_ff is not None and high_ff is not None and high_ff <= low_ff:
        raise fail(
            encoding,
            "scaling['high_freq_factor']",
            scaling["high_freq_factor"],
            f"a number greater than low_freq_factor={scaling['low_freq_factor']}",
        )


def _validate_longrope(encoding: str, scaling: dict) -> None:
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if (
            not isinstance(factors, (list, tuple))
            or not factors
            or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)
        ):
            raise fail(
                encoding,
                f"scaling[{key!r}]",
                factors,
                "a list of positive numbers, one per frequency (required)",
            )
    if len(scaling["short_factor"]) != len(scaling["long_factor"]):
        raise fail(
            encoding,
            "scaling['long_factor']",
            f"{len(scaling['long_factor'])} numbers",
            f"as many numbers as short_factor ({len(scaling['short_factor'])})",
        )
    if scaling.get("factor") is not None:
        check_number(encoding, "scaling['factor']", scaling["factor"], low=0.0, low_inclusive=False)


def check_frequency_count(encoding: str, scaling: dict | None, dim: int) -> None:
    """Refuse per-frequency factors (longrope) whose count is not ``dim / 2``."""
    if scaling is not None and scaling["type"] == "longrope" and len(scaling["short_factor"]) != dim // 2:
        raise fail(
            encoding,
            "scaling['short_factor']",
            f"{len(scaling['short_factor'])} numbers",
            f"one number per rotary frequency: {dim // 2} (rotary dimension {dim} / 2)",
        )


def resolve_scaling(scaling: dict | None, max_positions: int) -> dict | None:
    """Fill the defaults of a validated scaling dict."""
    if scaling is None:
        return None
    kind = scaling["type"]
    out = {"type": kind, **SCALING_DEFAULTS.get(kind, {}), **scaling}
    if (
        "original_max_position_embeddings" in SCALING_KEYS[kind]
        and out.get("original_max_position_embeddings") is None
    ):
        out["original_max_position_embeddings"] = max_positions
    if kind == "longrope":
        if out.get("factor") is None:  # transformers: the ratio of the extended to the original length
            out["factor"] = max_positions / out["original_max_position_embeddings"]
        out["short_factor"] = [float(f) for f in out["short_factor"]]
        out["long_factor"] = [float(f) for f in out["long_factor"]]
        out.setdefault("attention_factor", None)
    out["factor"] = float(out["factor"])
    return out


def base_inv_freq(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """omega_i = theta^(-2i/dim), i = 0..dim/2-1 (fp32, as transformers computes it)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def inverse_frequencies(
    dim: int,
    theta: float,
    scaling: dict | None,
    seq_len: int | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq (dim/2,), attention_factor) for a resolved ``scaling`` (``seq_len`` for dynamic)."""
    if scaling is None:
        return base_inv_freq(dim, theta, device), 1.0
    kind, factor = scaling["type"], scaling["factor"]
    if kind == "linear":
        return base_inv_freq(dim, theta, device) / factor, 1.0
    if kind == "ntk":
        return base_inv_freq(dim, theta * factor ** (dim / (dim - 2)), device), 1.0
    if kind == "dynamic":
        original = scaling["original_max_position_embeddings"]
        if seq_len is None or seq_len <= original:
            return base_inv_freq(dim, theta, device), 1.0
        stretched = theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
        return base_inv_freq(dim, stretched, device), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, device)
    if kind == "longrope":
        return _longrope(dim, theta, scaling, seq_len, device)
    return _llama3(dim, theta, scaling, device), 1.0


def _yarn(dim: int, theta: float, scaling: dict, device) -> tuple[torch.Tensor, float]:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def dim_for_rotations(rotations: float) -> float:
        # the dimension index whose wavelength fits ``rotations`` times in ``original`` tokens
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_for_rotations(scaling["beta_fast"]), dim_for_rotations(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp  # 1 for high frequencies (extrapolate), 0 for low ones (interpolate)
    extrapolated = base_inv_freq(dim, theta, device)
    interpolated = extrapolated / factor
    return interpolated * (1 - keep_original) + extrapolated * keep_original, float(attention_factor)


def _llama3(dim: int, theta: float, scaling: dict, device) -> torch.Tensor:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low_ff, high_ff = scaling["low_freq_factor"], scaling["high_freq_factor"]
    inv_freq = base_inv_freq(dim, theta, device)
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength, high_freq_wavelength = original / low_ff, original / high_ff
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, blended, scaled)


def _longrope(
    dim: int, theta: float, scaling: dict, seq_len: int | None, device
) -> tuple[torch.Tensor, float]:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    long = seq_len is not None and seq_len > original
    rescale = torch.tensor(
        scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device
    )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim  # (dim/2,)
    return 1.0 / (rescale * theta**exponents), float(attention_factor)
