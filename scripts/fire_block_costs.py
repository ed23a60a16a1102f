"""What one FIRE layer's blocks past L cost on CPU, part by part, on the bench's model (``hf-posenc
bench``'s defaults: 8 heads of 32, FIRE's initial network, one batch row) at one length:

- the zones of each block (how many units switch inside it, and over how many distances);
- building every block past L (as many queries as the chunked backend takes, ``built_block_rows``)
  without gradients, in bands of distances (``network_bands``) and from the network's products
  (``network_block``), per block and per written value;
- the fused attention kernel over those blocks with the built bias as its mask, against the same
  calls without a mask, and against one causal call over the whole layer (native's).

    python scripts/fire_block_costs.py --length 4096 --rounds 5

Medians of alternating rounds (this machine is noisy: compare within one run). It imports the
hf_posenc of the checkout it sits in.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from unittest import mock

# the checkout this script is in, not whichever hf_posenc is installed
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hf_posenc.attention.chunked import built_block_rows  # noqa: E402
from hf_posenc.encodings import network_bands  # noqa: E402
from hf_posenc.encodings.fire import FIREFunction  # noqa: E402

HEADS, HEAD_DIM = 8, 32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    length = args.length
    torch.manual_seed(0)
    function = FIREFunction(HEADS, 32, init_c=0.1, init_L=512.0)  # FIRE's defaults and initial weights
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM) for _ in range(3))
    k_reversed, v_reversed = k.flip(2), v.flip(2)
    block = built_block_rows(HEADS, length)  # the rows per block the chunked backend takes
    with torch.no_grad():
        bias = function.bias(torch.arange(length)[None], length, length)
        first_block = -(-bias.table_rows // block) * block
        spans = [(start, min(length, start + block)) for start in range(first_block, length, block)]
        banded = [
            (start, stop)
            for start, stop in spans
            if network_bands.serves(1 - (stop - start), stop - start, stop)
        ]
        widths = []
        for start, stop in banded:
            near, inverse = network_bands.line_and_inverse(
                bias.feature[:stop], bias.normalizer[0, start:stop]
            )
            plan = network_bands.plan_bands(near, inverse, bias.network)
            widths.append([hi - lo for lo, hi in plan.zones if hi > lo])
        values = sum(HEADS * (stop - start) * stop for start, stop in banded)
        scratch = torch.empty(HEADS * block * length)
        masks = [bias.folded_reversed(start, stop, stop, torch.float32) for start, stop in banded]

        def build(bands: bool) -> None:
            with mock.patch.object(network_bands, "BANDS", bands):
                for start, stop in banded:
                    bias.folded_reversed(start, stop, stop, torch.float32, scratch)

        def attend(masked: bool) -> None:
            for (start, stop), mask in zip(banded, masks, strict=True):
                keys, values_ = k_reversed[:, :, length - stop :], v_reversed[:, :, length - stop :]
                F.scaled_dot_product_attention(
                    q[:, :, start:stop], keys, values_, attn_mask=mask if masked else None
                )

        cases = {
            "build: bands": lambda: build(True),
            "build: network products": lambda: build(False),
            "attention: masked blocks": lambda: attend(True),
            "attention: the same blocks unmasked": lambda: attend(False),
            "attention: one causal call (native)": lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for run in cases.values():
            run()
        for _ in range(args.rounds):
            for name, run in cases.items():
                start_time = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start_time)
    counts = [len(w) for w in widths]
    every = [width for block in widths for width in block]
    print(f"T={length}: {len(banded)} blocks of {block} queries in bands, {values / 1e6:.1f} M values")
    # the zones' distances summed over the blocks against the blocks' keys (zones may overlap)
    share = sum(every) / sum(stop for _, stop in banded)
    print(
        f"zones per block: {min(counts)}-{max(counts)}; distances per zone: {min(every)}-{max(every)} "
        f"(median {statistics.median(every)}); the zones' distances {share:.0%} of the blocks' keys"
    )
    for name, seconds in times.items():
        median = statistics.median(seconds)
        line = f"{name:40s} {median * 1e3:8.1f} ms"
        if name.startswith("build"):
            line += (
                f"  {median / len(banded) * 1e3:.2f} ms per block, {median / values * 1e9:.2f} ns per value"
            )
        print(line)


if __name__ == "__main__":
    main()
