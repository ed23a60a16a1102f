"""``hf-posenc train``'s long-context options: packing (and, beside it, what trains long sequences)."""

from __future__ import annotations

import argparse


def add_long_context_arguments(parser: argparse.ArgumentParser) -> None:
    """Packing (documents with their own positions and attention) and the loss's memory."""
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
