"""The extrapolation study: one base checkpoint, several encodings, one report.

For a base checkpoint and a list of encodings: patch each, continue pretraining it for the
same number of steps on the same data, then measure the loss at 1x, 2x, 4x, 8x and 16x the
training length on held-out text — the shape of the ExPE paper's Table 1 — as a table,
CSV/JSON and a plot.

With no base checkpoint, the embedded default runs offline: the Python standard library's
sources as the corpus, a byte-level BPE tokenizer trained on them, and a tiny Llama first
pretrained with RoPE to play the pretrained checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from .data import BUILTIN_STDLIB, check_sources, read_documents, tokenize_documents
from .errors import InvalidParameterError
from .registry import canonical_name

DEFAULT_ENCODINGS = ("rope", "alibi", "t5", "nope", "sinusoidal", "expe", "exqpe")


@dataclasses.dataclass
class StudyConfig:
    output_dir: str = "posenc-study"
    base_model: str | None = None  # None: pretrain the embedded tiny Llama with RoPE
    encodings: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_ENCODINGS))
    data: list[str] = dataclasses.field(default_factory=lambda: [BUILTIN_STDLIB])
    eval_data: list[str] | None = None  # default: the validation split of ``data``
    train_split: str = "train"
    eval_split: str = "validation"
    text_field: str = "text"
    max_documents: int | None = None  # cap on training documents (default: all)
    train_length: int = 128
    multiples: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4, 8, 16])
    steps: int = 300  # continued pretraining per encoding
    pretrain_steps: int = 1000  # embedded default only
    batch_size: int = 16
    lr: float = 1e-3
    eval_tokens: int = 32768
    vocab_size: int = 2048  # embedded default only
    hidden_size: int = 128  # embedded default only
    num_layers: int = 4  # embedded default only
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.encodings:
            raise InvalidParameterError(
                "study: no encodings given; allowed: one or more names from `hf-posenc list`"
            )
        for spec in self.encodings:
            parse_encoding_spec(spec)  # raises for unknown names or bad JSON


def parse_encoding_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"alibi"`` or ``'expe{"scaling": {"type": "linear", "factor": 2}}'`` -> (name, params)."""
    name, brace, rest = spec.partition("{")
    params: dict[str, Any] = {}
    if brace:
        try:
            params = json.loads(brace + rest)
        except json.JSONDecodeError as error:
            raise InvalidParameterError(
                f"study: encoding {spec!r} has parameters that are not JSON: {error}"
            ) from error
    return canonical_name(name.strip()), params


def _pretrain_base(config: StudyConfig, out: Path) -> Path:
    """Train the tokenizer and pretrain the embedded tiny Llama with RoPE; return its directory."""
    from .tiny import tiny_model
    from .tokenizer import train_bpe_tokenizer
    from .training import TrainConfig, train

    final = out / "base" / "final"
    if (final / "config.json").is_file():
        print(f"[study] reusing the pretrained base model in {final}")
        return final
    print("[study] training a byte-level BPE tokenizer on the corpus")
    documents = list(
        read_documents(
            config.data, text_field=config.text_field, split=config.train_split, limit=config.max_documents
        )
    )
    tokenizer = train_bpe_tokenizer(documents, vocab_size=config.vocab_size)
    model = tiny_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=4,
        num_kv_heads=4,
        max_positions=config.train_length * max(config.multiples),
        seed=config.seed,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    print(f"[study] pretraining the base model with RoPE for {config.pretrain_steps} steps")
    settings = TrainConfig(
        model="builtin:tiny-llama",
        output_dir=str(out / "base"),
        data=config.data,
        split=config.train_split,
        text_field=config.text_field,
        seq_len=config.train_length,
        batch_size=config.batch_size,
        max_steps=config.pretrain_steps,
        lr=config.lr,
        log_every=max(1, config.pretrain_steps // 10),
        seed=config.seed,
    )
    return train(settings, model=model, tokenizer=tokenizer).final_dir


def _continue_pretraining(config: StudyConfig, base: Path, spec: str, out: Path) -> Path:
    from .training import TrainConfig, train

    name, params = parse_encoding_spec(spec)
    run = out / "runs" / spec_slug(spec)
    if (run / "final" / "config.json").is_file():
        print(f"[study] reusing {spec} in {run / 'final'}")
        return run / "final"
    print(f"[study] {spec}: continued pretraining for {config.steps} steps")
    settings = TrainConfig(
        model=str(base),
        output_dir=str(run),
        data=config.data,
        split=config.train_split,
        text_field=config.text_field,
        encoding=name,
        encoding_params=params,
        seq_len=config.train_length,
        batch_size=config.batch_size,
        max_steps=config.steps,
        lr=config.lr,
        warmup_ratio=0.1,
        log_every=max(1, config.steps // 5),
        seed=config.seed,
    )
    return train(settings).final_dir


def spec_slug(spec: str) -> str:
    """A directory name for an encoding spec: ``expe{"l": 8}`` -> ``expe_l_8``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", spec).strip("_")


def run_study(config: StudyConfig) -> dict[str, Path]:
    """Run the whole study; returns the report files (table, csv, json, png)."""
    from transformers import AutoTokenizer

    from .evaluation import check_model_length, check_output_dir, evaluate_lengths, format_table, write_report
    from .loading import load_model

    out = check_output_dir(config.output_dir)
    check_sources(config.data)
    eval_sources = config.eval_data or config.data
    check_sources(eval_sources)
    (out / "study_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))

    base = Path(config.base_model) if config.base_model else _pretrain_base(config, out)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    documents = read_documents(eval_sources, text_field=config.text_field, split=config.eval_split)
    longest = config.train_length * max(config.multiples)
    tokens = tokenize_documents(documents, tokenizer, max_tokens=max(config.eval_tokens, longest))
    runs = {"rope (base, no further training)": base} if not config.base_model else {"base": base}
    for spec in config.encodings:
        runs[spec] = _continue_pretraining(config, base, spec, out)

    results = {}
    for label, directory in runs.items():
        model = load_model(str(directory)).eval()
        check_model_length(model, config.train_length * max(config.multiples))
        print(f"[study] evaluating {label}")
        results[label] = evaluate_lengths(
            model, tokens, config.train_length, config.multiples, max_tokens=config.eval_tokens, batch_size=8
        )
        del model
    title = f"Loss vs evaluation length (trained at {config.train_length} tokens, {config.steps} steps each)"
    paths = write_report(
        results, out, config.train_length, title, metadata={"study": dataclasses.asdict(config)}
    )
    print(format_table(results))
    print(f"[study] report: {', '.join(str(p) for p in paths.values())}")
    return paths
