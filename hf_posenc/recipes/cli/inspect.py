"""``hf-posenc list`` (the encodings) and ``hf-posenc check`` (verify them on a tiny model).

``hf-posenc check`` is the offline self-test a user runs after installing: it builds a
small random model of each family from a config (no download), patches it with every
encoding and verifies the core guarantees (KV-cache decoding equals a full forward,
save/reload is identical, unpatch restores the exact original), printing one row each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from ...models import canonical_family, family_names


def _format_parameters(parameters: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in parameters.items()) or "-"


def command_list(args: argparse.Namespace) -> int:
    from ..catalogue import catalogue

    listing = catalogue()  # cached metadata: no torch import once the catalogue is built
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    for info in listing["encodings"]:
        print(f"{info['name']:<11} {info['summary']}")
        print(
            f"{'':<11} aliases: {', '.join(info['aliases']) or '-'}; stages: {', '.join(info['stages']) or '-'}"
        )
        print(f"{'':<11} parameters: {_format_parameters(info['parameters'])}")
        print(f"{'':<11} paper: {info['paper']}")
    fixed = [info["name"] for info in listing["encodings"] if not info.get("per_layer", True)]
    print(
        "per-layer hybrids: a pattern repeated over the layers, e.g. --encoding 'rope*3+nope' "
        "(NoPE every 4th layer, as SmolLM3) or patch_model(model, ['rope', 'rope', 'rope', 'nope']); "
        f"not allowed in a pattern (embedding or cross-layer encodings): {', '.join(fixed) or '-'}"
    )
    print(f"model families: {', '.join(listing['families'])}")
    return 0


def _check_one(family: str, name: str, seed: int) -> dict:
    import torch
    from transformers import DynamicCache

    from ...compat import cache_keyword, output_cache
    from ...core.loading import from_pretrained
    from ...core.patch import patch_model, unpatch_model
    from ...errors import PosencError
    from ..tiny import tiny_model

    model = tiny_model(family, seed=seed)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        native = model(ids).logits
        try:
            patch_model(model, name)
        except (
            PosencError
        ) as refusal:  # the encoding refuses this family by design (e.g. SelfExtend off RoPE)
            if not torch.equal(model(ids).logits, native):
                raise AssertionError(f"{name} on {family}: a refused patch changed the model") from refusal
            return {"refused": str(refusal)}
        full = model(ids).logits
        out = model(ids[:, :12], **{cache_keyword(model): DynamicCache(config=model.config)}, use_cache=True)
        worst = (out.logits - full[:, :12]).abs().max().item()
        for t in range(12, 24):
            out = model(ids[:, t : t + 1], **{cache_keyword(model): output_cache(out)}, use_cache=True)
            worst = max(worst, (out.logits[:, -1] - full[:, t]).abs().max().item())
        with tempfile.TemporaryDirectory() as directory:
            model.save_pretrained(directory)
            reload_equal = torch.equal(from_pretrained(directory).eval()(ids).logits, full)
        unpatch_model(model)
        restored = torch.equal(model(ids).logits, native)
    return {"cache_max_abs_diff": worst, "reload_identical": reload_equal, "unpatch_exact": restored}


def _check_all(families: list[str], names: list[str], seed: int) -> int:
    """Check every family x encoding, one printed row each; the number of failures."""
    failures = 0
    print(f"{'family':<8} {'encoding':<11} {'cache==full':>12} {'reload':>7} {'unpatch':>8} {'time':>7}")
    for family in families:
        for name in names:
            start = time.perf_counter()
            result = _check_one(family, name, seed)
            if "refused" in result:  # one line naming why; not a failure, and the model was left alone
                print(f"{family:<8} {name:<11} {'refused (the encoding does not serve this family)':>38}")
                continue
            ok = (
                result["cache_max_abs_diff"] < 1e-4 and result["reload_identical"] and result["unpatch_exact"]
            )
            failures += not ok
            print(
                f"{family:<8} {name:<11} {result['cache_max_abs_diff']:>12.1e} "
                f"{'same' if result['reload_identical'] else 'DIFF':>7} "
                f"{'exact' if result['unpatch_exact'] else 'DIFF':>8} {time.perf_counter() - start:>6.2f}s"
            )
    return failures


def command_check(args: argparse.Namespace) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    from ...core.registry import canonical_name, list_encodings

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    names = (
        [canonical_name(n) for n in args.encodings] if args.encodings else [i.name for i in list_encodings()]
    )
    # the models are tiny: intra-op threads only cost, and on a loaded machine their
    # spin-waiting multiplied the check's CPU and wall time several times over
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        failures = _check_all(args.families, names, args.seed)
    finally:
        torch.set_num_threads(threads)
    print("all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0


def register(commands: argparse._SubParsersAction) -> None:
    listing = commands.add_parser("list", help="list encodings, aliases, parameters and model families")
    listing.add_argument("--json", action="store_true", help="print JSON instead of text")
    listing.set_defaults(run=command_list)

    check = commands.add_parser("check", help="patch a tiny random model with each encoding and verify it")
    check.add_argument(
        "--families",
        nargs="+",
        default=family_names(),
        choices=family_names(),
        type=canonical_family,
        help="families to check",
    )
    check.add_argument("--encodings", nargs="+", default=None, metavar="NAME", help="default: every encoding")
    check.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    check.set_defaults(run=command_check)
