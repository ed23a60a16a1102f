"""FIRE: functional interpolation for relative positions (Li et al., 2023, "Functional
Interpolation for Relative Positions Improves Long Context Transformers", arXiv:2310.04418).

    <q_i, k_j> = q_i^T k_j + f_theta( psi(i - j) / psi(max(L, i)) )_h

    psi(x) = log(|c| x + 1),     L = |L_multiplier| * init_L,
    f_theta(x) = W2 relu(W1 x + b1) + b2      (1 -> mlp_width -> H, one output per query head)

``i`` is the query's absolute 0-based position (``ScoreCall.positions``, padding-aware)
and ``i - j`` the distance in tokens, exactly as the paper's reference code and its ports
(mcleish7/arithmetic, VITA-Group/TAPE: ``positions = arange(T)``,
``normalizer = max(positions, threshold)``). Since i - j <= i, the argument of f lies in
[0, 1]; while i <= L the bias depends on i - j only, past L it is interpolated by the
query's position (not Toeplitz). As in the reference, the denominator gets eps = 1e-6,
c and L are learned ((1,) parameters) and enter through |.| (so L stays positive), and L is learned as a
multiplier of ``init_L`` so that one learning rate suits both c and L. Future keys (masked
anyway) are treated as distance 0.

Init: c = ``init_c`` (0.1), L = ``init_L`` (512), W1/b1 PyTorch's default; W2 and b2 start at
zero, so the patched model starts with a zero bias (as NoPE) and f is learned from there.
Each layer has its own f, c and L (as in the ports) unless ``shared_across_layers=True``.

Position interpolation, ``scaling={'type': 'linear', 'factor': s}``: positions and distances
divided by s before FIRE sees them, f_theta( psi((i - j) / s) / psi(max(L, i / s)) ).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import EncodingConfig, check_bool, check_number
from ..core.interpolation import PositionInterpolation, ScaledRange, interpolate, positional_range
from ..core.registry import register_encoding
from .base import Encoding, module_cache
from .call import ScoreCall
from .kept_values import KeptValues
from .piecewise_bias import PiecewiseDistanceBias

EPS = 1e-6  # the reference's guard on the normaliser


@dataclasses.dataclass
class FIREConfig(PositionInterpolation, EncodingConfig):
    encoding = "fire"
    mlp_width: int = 32
    init_c: float = 0.1
    init_L: float = 512.0  # noqa: N815 - the paper's name
    shared_across_layers: bool = False
    scaling: dict | None = None

    def validate(self) -> None:
        check_number(self.encoding, "mlp_width", self.mlp_width, low=1, integer=True)
        check_number(self.encoding, "init_c", self.init_c, low=0.0, low_inclusive=False)
        check_number(self.encoding, "init_L", self.init_L, low=0.0, low_inclusive=False)
        check_bool(self.encoding, "shared_across_layers", self.shared_across_layers)


class FIREFunction(nn.Module):
    """One f_theta with its c and L: (distances, query positions) -> bias per head."""

    def __init__(self, heads: int, width: int, init_c: float, init_L: float) -> None:  # noqa: N803
        super().__init__()
        self.init_L = init_L
        self.hidden = nn.Linear(1, width)
        self.out = nn.Linear(width, heads)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)
        # shape (1,), not 0-dim: FSDP2's fully_shard refuses scalar parameters and DeepSpeed's
        # broadcast views each parameter as bytes (checkpoints with the older 0-dim tensors still
        # load: Encoding's load hook, hf_posenc.encodings.base)
        self.c = nn.Parameter(torch.tensor([float(init_c)]))  # (1,)
        self.L_multiplier = nn.Parameter(torch.tensor([1.0]))  # (1,)

    def scale(self) -> torch.Tensor:
        """|c|, a 0-dim fp32 tensor."""
        return self.c.float().abs()[0]

    def threshold(self) -> torch.Tensor:
        """L = |L_multiplier| * init_L, a 0-dim fp32 tensor."""
        return (self.L_multiplier.float()[0] * self.init_L).abs()

    def _kept(self) -> KeptValues:
        """What this function derives from its parameters without gradients (kept_values.py)."""
        return module_cache(self).setdefault("kept", KeptValues())  # not module state

    def scalars(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(|c|, L, L as the module holds it (fp32), psi(L) + eps), 0-dim, fp64 but the third;
        without gradients kept while c and L keep their values (a decoding step's layer otherwise
        spent a dozen operations on them: kept_values.py)."""
        if torch.is_grad_enabled():
            return self._scalars()
        return self._kept().get("scalars", (self.c, self.L_multiplier), lambda *_: self._scalars())

    def _scalars(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.c.double().abs()[0]  # ()
        threshold = (self.L_multiplier.double()[0] * self.init_L).abs()
        return c, threshold, self.threshold(), torch.log1p(c * threshold) + EPS

    def normalized_distance(self, distance: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """distance i - j (Tq, Tk), positions i (B, Tq), int or (interpolated) float -> psi(i-j) / psi(max(L, i)),
        (B, Tq, Tk) fp32."""
        c = self.scale()  # ()
        numerator = torch.log1p(c * distance.clamp(min=0).float())  # (Tq, Tk)
        normalizer = torch.log1p(c * torch.maximum(positions.float(), self.threshold())) + EPS  # (B, Tq)
        return numerator[None] / normalizer[:, :, None]  # (B, Tq, Tk)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """f_theta: x (..., 1) fp32 -> (..., Hq) fp32."""
        h = F.relu(F.linear(x, self.hidden.weight.float(), self.hidden.bias.float()))  # (..., width)
        return F.linear(h, self.out.weight.float(), self.out.bias.float())

    def linear_pieces(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """f_theta as the piecewise-linear function it is (a one-input ReLU MLP):

        (breakpoints (K,) sorted, slopes A (Hq, K+1), intercepts B (Hq, K+1)) such that
        f(x) = A[:, s] x + B[:, s] with s = the number of breakpoints <= x. Unit k switches at
        -b1_k / w1_k; on each segment its ReLU is either off or linear, so
        A[:, s] = sum_{k on} W2[:, k] w1_k and B[:, s] = b2 + sum_{k on} W2[:, k] b1_k.
        Gradients reach every MLP parameter through A and B (which units are on is a constant
        of the segment, as the ReLU's derivative is).
        """
        if not torch.is_grad_enabled():
            # decoding: the pieces kept while the MLP keeps its values (kept_values.py)
            params = (*self.hidden.parameters(), *self.out.parameters())
            return self._kept().get("pieces", params, lambda *_: self._linear_pieces())
        return self._linear_pieces()

    def _linear_pieces(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w1 = self.hidden.weight.float()[:, 0]  # (K,)
        b1 = self.hidden.bias.float()  # (K,)
        w2 = self.out.weight.float()  # (Hq, K)
        with torch.no_grad():
            # inputs x lie in [0, 1]: breakpoints outside [-1, 2] (or none, w1 = 0) only matter by side
            raw = torch.where(w1 == 0, torch.full_like(w1, 2.0), -b1 / torch.where(w1 == 0, 1.0, w1))
            points = raw.clamp(-1.0, 2.0).sort().values  # (K,)
            edges = torch.cat((points[:1] - 1.0, points, points[-1:] + 1.0))  # (K+2,)
            middles = (edges[:-1] + edges[1:]) / 2  # (K+1,) one x inside each segment
            on = (middles[:, None] * w1[None] + b1[None] > 0).float()  # (K+1, K) unit k is on in segment s
        slopes = w2 @ (on * w1[None]).t()  # (Hq, K+1)
        intercepts = w2 @ (on * b1[None]).t() + self.out.bias.float()[:, None]  # (Hq, K+1)
        return points, slopes, intercepts

    def bias(
        self, positions: torch.Tensor, q_len: int, k_len: int, factor: float = 1.0
    ) -> PiecewiseDistanceBias:
        """The bias of queries at ``positions`` (B|1, Tq; already divided by ``factor``), the last
        Tq of ``k_len`` keys, as its pieces: x = psi((i - j) / factor) / (psi(max(L, i)) + eps)
        from a (Tk,) fp64 table of psi and an fp64 normaliser per query, f as :meth:`linear_pieces`. Queries
        with i <= L share the normaliser psi(L) + eps (below the threshold the bias is a table
        over distances)."""
        # psi and the normalisers in fp64 (O(T) values): x itself is fp32, but the gradient of c
        # (and of L) sums the scores' dx times dx/dc, whose two terms (through psi(d) and through
        # the normaliser) nearly cancel for small c L; from fp32 sums of each it lost ~1e-4 of its
        # value (c = 0.05), from fp64 it is as accurate as dx
        c, threshold, held_threshold, floor = self.scalars()  # (), (), () fp32, () psi(L) + eps
        device = positions.device
        distances = interpolate(torch.arange(k_len, device=device), factor).double()  # (Tk,) d / factor
        feature = torch.log1p(c * distances)  # (Tk,) psi(d / factor)
        queries = positions.double()  # (B|1, Tq)
        below = positions.float() <= held_threshold  # which side of L as the module holds it (fp32)
        normalizer = torch.where(below, floor, torch.log1p(c * torch.maximum(queries, threshold)) + EPS)
        points, slopes, intercepts = self.linear_pieces()  # (K,), (Hq, K+1), (Hq, K+1)
        return PiecewiseDistanceBias(
            q_len,
            k_len,
            feature,
            normalizer,
            points,
            slopes,
            intercepts,
            below,
            floor,
            unit_weight=self.hidden.weight.float()[:, 0],
            unit_bias=self.hidden.bias.float(),
            out_weight=self.out.weight.float(),
            out_bias=self.out.bias.float(),
        )

    def forward(self, distance: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """-> (B, Hq, Tq, Tk) fp32 bias."""
        x = self.normalized_distance(distance, positions)[..., None]  # (B, Tq, Tk, 1)
        return self.mlp(x).permute(0, 3, 1, 2)  # (B, Hq, Tq, Tk)


@register_encoding
class FIRE(Encoding[FIREConfig]):
    name = "fire"
    config_class = FIREConfig
    paper = "Li et al. 2023, arXiv:2310.04418"
    summary = (
        "learned MLP of log-distance normalised by log of the query position (progressive interpolation)"
    )

    def __init__(self, config: FIREConfig, geometry) -> None:
        super().__init__(config, geometry)
        count = 1 if config.shared_across_layers else geometry.num_layers
        self.functions = nn.ModuleList(
            FIREFunction(geometry.num_heads, config.mlp_width, config.init_c, config.init_L)
            for _ in range(count)
        )

    def function(self, layer_idx: int) -> FIREFunction:
        # __init__ fills self.functions with FIREFunction modules only
        return cast(FIREFunction, self.functions[0 if self.config.shared_across_layers else layer_idx])

    def scaled_range(self) -> ScaledRange | None:
        """psi(x) = log(c x + 1) of distances x = (i - j) / f in float32: x and c x must stay
        finite (inf / inf in the normalisation is NaN), for the largest |c| of the layers (``init_c``
        for a c on the meta device: built inside ``torch.device("meta")``, as transformers'
        ``from_pretrained`` builds models, it holds no value yet and gets ``init_c`` at init)."""
        if self.config.factor == 1.0:
            return None  # unscaled: nothing to bound, and c need not be read
        with torch.no_grad():
            largest_c = max(
                self.config.init_c if f.c.is_meta else float(f.scale().detach())
                for f in (self.function(i) for i in range(len(self.functions)))
            )
        return positional_range(
            self.config.factor,
            self.geometry.max_position_embeddings,
            "distances (i - j) / f and c (i - j) / f",
            max(1.0, largest_c),
        )

    def score_bias(self, call: ScoreCall) -> PiecewiseDistanceBias:
        q_len, k_len, device = call.q_len, call.k_len, call.device
        factor = self.config.factor
        positions = call.memo.get(
            ("fire_positions", q_len, k_len, device),
            lambda: interpolate(_distinct_rows(call.positions), factor),
        )  # (B|1, Tq) i / factor
        return self.function(call.layer_idx).bias(positions, q_len, k_len, factor)


def _distinct_rows(positions: torch.Tensor) -> torch.Tensor:
    """(B, Tq) positions -> (1, Tq) when every row is the same (no padding), else unchanged.
    Under torch.compile the rows stay as they are (asking is a data-dependent branch; per-row
    positions give the same bias)."""
    compiling = torch.compiler.is_compiling()
    if (
        not compiling
        and positions.shape[0] > 1
        and torch.equal(positions, positions[:1].expand_as(positions))
    ):
        return positions[:1]
    return positions
