"""``hf-posenc train``'s long-context options: packing (and, beside it, what trains long sequences)."""

from __future__ import annotations

import argparse


def add_long_context_arguments(parser: argparse.ArgumentParser) -> None:
    """Packing, the loss's memory and position sampling."""
    group = parser.add_argument_group("long context")
    group.add_argument(
        "--packing",
        action="store_true",
        help="pack documents into each block with positions restarting per document and attention "
        "that never crosses a document boundary (default: one token stream, positions across documents)",
    )
    group.add_argument(
        "--loss",
        default="full",
        choices=["full", "chunked"],
        help="chunked: cross-entropy without the (tokens x vocabulary) logits (a fused CUDA kernel when "
        "cut-cross-entropy or liger-kernel is installed), memory linear in length (default: %(default)s)",
    )
    group.add_argument(
        "--position-sampling",
        default="none",
        choices=["none", "pose", "randomized"],
        help="train with the position ids of --target-length: pose (PoSE, Zhu et al. 2024: a skip between "
        "two chunks) or randomized (Ruoss et al. 2023: sorted random ids) (default: %(default)s)",
    )
    group.add_argument(
        "--target-length",
        type=int,
        default=None,
        metavar="N",
        help="the length sampled position ids reach (>= --seq-len); needs --position-sampling",
    )
