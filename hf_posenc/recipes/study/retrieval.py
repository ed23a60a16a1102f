"""The study's retrieval experiment ("train short, test long", issue 20.4), on by default in the
setting tuned for the embedded default (:class:`~hf_posenc.recipes.study.spec.StudyConfig`:
25000 documents, keys 1-99, no instruction line); off with ``retrieval_documents=0``.

A tiny model pretrained on Python sources never retrieves a pass key, so retrieval is made
learnable: ``retrieval_documents`` passkey documents (Landmark's prompt followed by the key,
:mod:`hf_posenc.recipes.longeval.training_data`), each exactly one training block (``train_length``
tokens with its end-of-text token), are written to ``OUTPUT/retrieval/train.jsonl`` once the
tokenizer exists and listed *first* among the data sources of the base pretraining and of every
continued pretraining, so each is one whole block of the token stream (blocks are shuffled).
After training, every trained row (and the base) is scored on the passkey at 1x-16x the training
length (prompt and answer within that length: the prompt is ``ANSWER_ROOM`` tokens shorter;
``retrieval_samples`` per length and depth, depths 0, 0.5, 1; values from the evaluation seed
stream, never trained on): a table beside the loss table, ``retrieval.json`` and
``retrieval_heatmaps.png`` (one depth x length panel per row).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..atomic import write_text

TASK = "passkey"
#: tokens kept free for the generated answer: a prompt at k x the training length has this many fewer
ANSWER_ROOM = 16
DEPTHS = (0.0, 0.5, 1.0)
FILE = Path("retrieval") / "train.jsonl"


def training_source(config: Any) -> list[str]:
    """The data source to list before the corpus (``[]`` when the experiment is off)."""
    if not getattr(config, "retrieval_documents", 0):
        return []
    return [str(Path(config.output_dir) / FILE)]


def study_task(config: Any) -> Any:
    """The study's passkey: Landmark's protocol (:class:`~hf_posenc.recipes.longeval.passkey.Passkey`),
    with keys in ``[1, retrieval_max_key]`` and, unless ``retrieval_instruction``, without its
    instruction line (see the module docstring of :mod:`hf_posenc.recipes.longeval.passkey`)."""
    from ..longeval.passkey import Passkey

    return Passkey(config.retrieval_max_key, config.retrieval_instruction)


def evaluation_samples(task: Any, tokenizer: Any, length: int, samples: int, seed: int) -> tuple[int, list]:
    """The samples scored at ``length`` (every depth): prompts of ``length - ANSWER_ROOM`` tokens, or
    a few tokens fewer when some draw has no prompt of exactly that many (a tokenizer where one
    character more adds two tokens); returns ``(prompt tokens, samples)``."""
    from ..longeval.fit import PromptLengthError
    from ..longeval.tasks import task_samples

    target = length - ANSWER_ROOM
    failure: PromptLengthError | None = None
    for tokens in range(target, target - ANSWER_ROOM // 2, -1):
        try:
            return tokens, list(task_samples(task, tokenizer, tokens, DEPTHS, samples, seed))
        except PromptLengthError as error:
            failure = error
    assert failure is not None
    raise failure


#: tokens a training document keeps beyond the shortest passkey prompt (room for its answer)
ANSWER_MARGIN = 8


def check_training_length(config: Any, tokenizer: Any) -> int:
    """Refuse a ``train_length`` whose blocks cannot hold one passkey prompt and its answer for
    ``tokenizer``; return the length (in the tokenizer's own counting) the documents aim at."""
    from ...errors import InvalidParameterError
    from ..longeval.tasks import minimum_length

    # the training pipeline adds only the end-of-text token; the length fitting counts what the
    # tokenizer adds by default (a BOS), so aim at one block of text tokens plus those
    added = len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])
    length = config.train_length - (1 if tokenizer.eos_token_id is not None else 0) + added
    shortest = minimum_length(study_task(config), tokenizer, length, 1, config.seed) + ANSWER_MARGIN
    if length < shortest:
        raise InvalidParameterError(
            f"study: retrieval documents need a training length of at least {shortest} tokens for this tokenizer "
            f"(the passkey prompt and its answer); --train-length is {config.train_length}; "
            "--retrieval-documents 0 leaves the retrieval experiment out"
        )
    return length


def check_training_length_early(config: Any) -> None:
    """Before any tokenizer is trained: refuse a ``train_length`` no byte-level BPE tokenizer can fit
    the passkey prompt into. Such a tokenizer never merges across the pieces its pre-tokenizer
    (GPT-2's split on words, numbers, punctuation and spaces) cuts the text into, so the prompt
    has at least as many tokens as pieces; a document also keeps its end-of-text token and
    :data:`ANSWER_MARGIN` tokens. Passing here does not promise the exact check after training
    (:func:`check_training_length`) passes: the trained tokenizer may need more."""
    from tokenizers import pre_tokenizers

    from ...errors import InvalidParameterError
    from ..longeval.words import sample_rng

    task = study_task(config)
    prompt = task.instance(sample_rng(config.seed, task.name, 0), config.train_length, 0.5).render(0, 0)
    pieces = len(pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(prompt))
    shortest = pieces + ANSWER_MARGIN + 1
    if config.train_length < shortest:
        raise InvalidParameterError(
            f"study: --train-length {config.train_length} is too short for the retrieval documents; allowed: at "
            f"least {shortest} tokens (the passkey prompt is {pieces} words and symbols, each at least one "
            "token, plus its answer and the end-of-text token; the tokenizer trained may need more); "
            "--retrieval-documents 0 leaves the retrieval experiment out"
        )


def write_training_documents(config: Any, tokenizer: Any) -> Path | None:
    """Write the passkey training documents for ``tokenizer`` (if the experiment is on and they are
    not there yet); each is ``train_length - 1`` tokens, one block with its end-of-text token."""
    if not getattr(config, "retrieval_documents", 0):
        return None
    from ..longeval.training_data import training_documents

    path = Path(config.output_dir) / FILE
    if path.is_file():
        verify_documents(path, _settings(config))
        return path
    task = study_task(config)
    length = check_training_length(config, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    with partial.open("w", encoding="utf-8") as handle:
        for text in training_documents(task, tokenizer, length, config.retrieval_documents, config.seed):
            handle.write(json.dumps({"text": text}) + "\n")
    partial.replace(path)
    record_documents(path, _settings(config))
    return path


#: the record beside the documents: their size, SHA-256 and the settings they were written for
RECORD = FILE.with_suffix(".sha256.json")


def _settings(config: Any) -> dict[str, int]:
    """The study settings the documents are made from (with the tokenizer, which the base run fixes);
    the key range and the instruction line only where they differ from the protocol's, so records
    written before they could be set stay valid."""
    from ..longeval.passkey import MAX_KEY

    settings = {
        "retrieval_documents": int(config.retrieval_documents),
        "train_length": int(config.train_length),
        "seed": int(config.seed),
    }
    if config.retrieval_max_key != MAX_KEY:
        settings["retrieval_max_key"] = int(config.retrieval_max_key)
    if not config.retrieval_instruction:
        settings["retrieval_instruction"] = 0
    return settings


def record_documents(path: Path, settings: dict[str, int]) -> None:
    """Write the record of ``path`` (size, SHA-256, settings) beside it, atomically."""
    from ..training.checkpoints import file_digest

    record = {"bytes": path.stat().st_size, "sha256": file_digest(path), "settings": settings}
    target = path.with_name(RECORD.name)
    partial = target.with_name(target.name + ".tmp")
    partial.write_text(json.dumps(record, indent=2), encoding="utf-8")
    partial.replace(target)


def verify_documents(path: Path, settings: dict[str, int]) -> None:
    """Check the passkey documents a study reuses against their record: a damaged, truncated or
    edited file (every later pretraining would train on it, re-tokenised without a word, since the
    token cache follows the file's size and mtime) or one written for other settings stops the
    study with one line naming the file and the fix. A file from before records existed is
    recorded as it is."""
    from ..data import DataError
    from ..training.checkpoints import file_digest

    record_path = path.with_name(RECORD.name)
    fix = (
        f"delete it and its record (rm {path} {record_path}) and run the same command again: it is rewritten"
    )
    if not record_path.is_file():
        record_documents(path, settings)
        return
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        size, digest, written_for = int(record["bytes"]), str(record["sha256"]), dict(record["settings"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"{record_path}: the passkey documents' record is unreadable ({error}); {fix}"
        ) from None
    actual = path.stat().st_size
    if actual != size:
        raise DataError(f"{path}: the passkey documents have {actual} bytes where {size} were written; {fix}")
    if file_digest(path) != digest:
        raise DataError(
            f"{path}: the passkey documents do not match the SHA-256 recorded when they were written "
            f"(damaged or edited); {fix}"
        )
    if written_for != settings:
        raise DataError(
            f"{path}: the passkey documents were written for {written_for}, this study asks for {settings}; {fix}"
        )


def evaluate_retrieval(config: Any, runs: dict[str, Path], tokenizer: Any) -> dict[str, list]:
    """Passkey accuracy of each row at every evaluation length (and depth); ``{label: cells}``."""
    from ...core.loading import load_model
    from ..longeval.runner import evaluate_samples, summarize
    from ..longeval.tasks import minimum_length
    from ..threads import use_threads

    task = study_task(config)
    # the prompt and the generated answer together fit each evaluation length (and the model's positions)
    shortest = minimum_length(task, tokenizer, config.train_length, config.retrieval_samples, config.seed)
    lengths: dict[int, int] = {}  # prompt tokens -> the evaluation length (its column)
    samples = []
    for length in (config.train_length * m for m in config.multiples):
        if length - ANSWER_ROOM >= shortest:
            tokens, built = evaluation_samples(task, tokenizer, length, config.retrieval_samples, config.seed)
            lengths[tokens] = length
            samples += built
    results = {}
    for label, directory in runs.items():
        model = load_model(str(directory)).eval()
        use_threads(config.threads, model)
        cells = summarize(evaluate_samples(model, tokenizer, samples, batch_size=len(DEPTHS)))
        results[label] = [
            dataclasses.replace(c, length=lengths[c.length]) for c in cells
        ]  # columns: 1x, 2x, ...
        del model
    return results


def write_retrieval_report(
    config: Any, results: dict[str, list], metadata: dict[str, Any]
) -> dict[str, Path]:
    """retrieval.json, retrieval.md and retrieval_heatmaps.png in the study's folder; prints the table."""
    from ..longeval import report

    out = Path(config.output_dir)
    settings = {
        "task": TASK,
        "depths": list(DEPTHS),
        "samples": config.retrieval_samples,
        "max_key": config.retrieval_max_key,
        "instruction": config.retrieval_instruction,
        "seed": config.seed,
    }
    settings["training_documents"] = config.retrieval_documents
    paths = {
        "retrieval json": report.write_json(
            out / "retrieval.json", results, settings=settings, metadata=metadata
        )
    }
    variant = "" if config.retrieval_instruction else ", no instruction line"
    title = (
        f"Passkey retrieval (trained at {config.train_length} tokens with {config.retrieval_documents} passkey "
        f"documents, keys 1-{config.retrieval_max_key}{variant})"
    )
    paths["retrieval png"] = report.plot_heatmap_grid(
        out / "retrieval_heatmaps.png", results, TASK, config.train_length, title
    )
    table = report.markdown_table(results)
    paths["retrieval md"] = out / "retrieval.md"
    write_text(
        paths["retrieval md"],
        f"# {title}\n\nAccuracy in % over depths {list(DEPTHS)}.\n\n{table}\n\n"
        "![retrieval heatmaps](retrieval_heatmaps.png)\n",
    )
    print(f"\n{title}: accuracy in % over depths {', '.join(map(str, DEPTHS))}")
    print(report.format_table(results))
    return paths
