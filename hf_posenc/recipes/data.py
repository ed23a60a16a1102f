"""Text sources, tokenisation and sequence packing for training and evaluation.

A *source* is one of:

- ``builtin:stdlib`` — the Python standard library's own source files, present on every
  machine with Python: real, long documents, the offline default corpus. Its ``train``
  split holds 9 of every 10 files (sorted by path), ``validation`` (alias ``test``) the
  10th, ``all`` every file;
- ``hf:NAME`` or ``hf:NAME:CONFIG`` — a hub dataset, read with ``datasets`` (needs a network);
- a local ``.txt``/``.md``/``.py`` file (one document), a ``.jsonl``/``.json`` file (one
  document per row, from ``text_field``), a directory (its such files, recursively), or a glob.

Documents come out in a fixed order, so data order depends only on the seed that shuffles them.
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidParameterError, PosencError

if TYPE_CHECKING:
    import torch

BUILTIN_STDLIB = "builtin:stdlib"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
JSON_SUFFIXES = (".jsonl", ".json")


STDLIB_SPLITS = ("train", "validation", "test", "all")


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    """The standard library's ``.py`` files (tests, IDLE, site-packages left out), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in skip]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return tuple(sorted(files))


def stdlib_documents(split: str = "all", min_chars: int = 4000) -> Iterator[str]:
    """The standard library's ``.py`` files of at least ``min_chars`` characters, sorted by path.

    ``split``: ``train`` (files 1-9 of every 10), ``validation``/``test`` (every 10th), ``all``.
    """
    if split not in STDLIB_SPLITS:
        raise ValueError(
            f"split {split!r} of {BUILTIN_STDLIB} is not allowed; allowed: {', '.join(STDLIB_SPLITS)}"
        )
    index = 0
    for path in _stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < min_chars:
            continue
        held_out = index % 10 == 9
        index += 1
        if split == "all" or (split == "train") != held_out:
            yield text


def _local_files(source: str) -> list[Path]:
    path = Path(source)
    if path.is_dir():
        files = [
            p for p in sorted(path.rglob("*")) if p.suffix in TEXT_SUFFIXES + JSON_SUFFIXES and p.is_file()
        ]
        if not files:
            raise FileNotFoundError(
                f"data directory {source!r} has no {', '.join(TEXT_SUFFIXES + JSON_SUFFIXES)} files"
            )
        return files
    if path.is_file():
        return [path]
    matches = sorted(Path(p) for p in glob.glob(source, recursive=True) if os.path.isfile(p))
    if not matches:
        raise FileNotFoundError(
            f"data source {source!r} is not a file, directory or glob that matches anything; allowed: a local "
            f"path, '{BUILTIN_STDLIB}', or 'hf:NAME[:CONFIG]'"
        )
    return matches


class DataError(PosencError, ValueError):
    """A data file that cannot be read as documents; the message names the file and line."""


def _undecodable(path: Path, raw: bytes, error: UnicodeDecodeError, first_line: int = 1) -> DataError:
    line = first_line + raw[: error.start].count(b"\n")
    bad = raw[error.start : error.start + 4]
    return DataError(
        f"{path}:{line}: bytes {bad!r} are not UTF-8; allowed: UTF-8 text (convert the file, e.g. with iconv)"
    )


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _undecodable(path, raw, error) from None


def _row_text(path: Path, where: str, row: object, text_field: str) -> str:
    """The ``text_field`` of one JSON row, or a :class:`DataError` naming the file and line/row."""
    if not isinstance(row, dict):
        raise DataError(
            f"{path}:{where}: the row is a JSON {type(row).__name__} ({json.dumps(row)[:60]}); allowed: an "
            f"object with a string field {text_field!r}"
        )
    if text_field not in row:
        raise DataError(
            f"{path}:{where}: the row has no field {text_field!r} (fields: {', '.join(sorted(row)) or 'none'}); "
            "choose the field with --text-field"
        )
    text = row[text_field]
    if not isinstance(text, str):
        raise DataError(
            f"{path}:{where}: field {text_field!r} is a JSON {type(text).__name__} "
            f"({json.dumps(text)[:60]}); allowed: a string"
        )
    return text


def _first_character(path: Path) -> str:
    with path.open("rb") as handle:
        while chunk := handle.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1].decode("latin-1")
    return ""


def _file_documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one local file: the whole file, or one per JSON row (JSON lines or an array)."""
    if path.suffix not in JSON_SUFFIXES:
        yield _read_text(path)
        return
    if path.suffix == ".json" and _first_character(path) == "[":
        text = _read_text(path)
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{path}:{error.lineno}: not valid JSON ({error.msg}, column {error.colno})"
            ) from None
        for number, row in enumerate(rows, 1):
            yield _row_text(path, f"row {number}", row, text_field)
        return
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise _undecodable(path, raw, error, number) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{path}:{number}: not a JSON value ({error.msg}, column {error.colno}); allowed: one JSON "
                    "object per line"
                ) from None
            yield _row_text(path, str(number), row, text_field)


def _hub_documents(source: str, text_field: str, split: str) -> Iterator[str]:
    from datasets import load_dataset

    name, _, config = source[len("hf:") :].partition(":")
    for number, row in enumerate(load_dataset(name, config or None, split=split, streaming=True), 1):
        yield _row_text(Path(source), f"row {number}", row, text_field)


def is_local(source: str) -> bool:
    """Whether ``source`` is local files (a file, directory or glob), read whole: no split, and
    fields only in JSON files; ``builtin:stdlib`` and ``hf:`` datasets have splits."""
    return source != BUILTIN_STDLIB and not source.startswith("hf:")


def check_sources(sources: Sequence[str]) -> None:
    """Fail fast (before any long work) on a local source that does not exist."""
    if not sources:
        raise FileNotFoundError("no data source given")
    for source in sources:
        if is_local(source):
            _local_files(source)
            if Path(source).is_file():
                check_not_blank(Path(source))


def check_source_options(
    sources: Sequence[str], *, split_flag: str | None = None, text_field_flag: str | None = None
) -> None:
    """One line for a split or text field given on the command line (pass its flag, e.g.
    ``split_flag="--split"``) that no source of ``sources`` reads: only hub datasets and
    ``builtin:stdlib`` have splits (a local file is read whole, whatever the split), only hub
    datasets and local JSON files have fields (a text file is one document)."""
    if split_flag and all(is_local(s) for s in sources):
        raise InvalidParameterError(
            f"{split_flag} would be ignored: the data sources {list(sources)} are local files, read whole; allowed: "
            f"an hf:NAME or {BUILTIN_STDLIB} source, or drop {split_flag}"
        )
    local = [s for s in sources if is_local(s)]
    json_files = (path.suffix in JSON_SUFFIXES for source in local for path in _local_files(source))
    if text_field_flag and not any(s.startswith("hf:") for s in sources) and not any(json_files):
        raise InvalidParameterError(
            f"{text_field_flag} would be ignored: the data sources {list(sources)} hold no JSON file (a text "
            f"file is one document, {BUILTIN_STDLIB} one per source file); allowed: .jsonl/.json files or an "
            f"hf:NAME source, or drop {text_field_flag}"
        )


#: files up to this size are read by the early checks to see whether they hold only blank space
BLANK_CHECK_BYTES = 1 << 16


def check_not_blank(path: Path) -> None:
    """Refuse a data file given by name that holds no document (empty, or blank space only)."""
    size = path.stat().st_size
    if size == 0 or (size <= BLANK_CHECK_BYTES and not path.read_bytes().strip()):
        what = "is empty (0 bytes)" if size == 0 else "holds only blank space"
        raise DataError(
            f"{path}: the data file {what}, so it holds no document; allowed: a file with at least one "
            "non-empty document (remove it from --data, or fill it)"
        )


def read_documents(
    sources: Sequence[str], *, text_field: str = "text", split: str = "train", limit: int | None = None
) -> Iterator[str]:
    """Documents from every source in order; at most ``limit`` of them."""
    check_sources(sources)
    count = 0
    for source in sources:
        if source == BUILTIN_STDLIB:
            documents: Iterable[str] = stdlib_documents(split)
        elif source.startswith("hf:"):
            documents = _hub_documents(source, text_field, split)
        else:
            documents = (doc for path in _local_files(source) for doc in _file_documents(path, text_field))
        for document in documents:
            if limit is not None and count >= limit:
                return
            if document and document.strip():
                count += 1
                yield document


def tokenize_documents(
    documents: Iterable[str],
    tokenizer,
    *,
    separator: bool = True,
    max_tokens: int | None = None,
    chunk: int = 32,
) -> torch.Tensor:
    """One 1-D int64 stream of the documents' tokens, each followed by the eos token.

    Documents are encoded ``chunk`` at a time (the fast tokenizer runs a batch in parallel);
    reading stops once ``max_tokens`` tokens are collected.
    """
    import torch

    eos = tokenizer.eos_token_id
    pieces: list[torch.Tensor] = []
    total = 0
    iterator = iter(documents)
    while max_tokens is None or total < max_tokens:
        batch = list(itertools.islice(iterator, chunk))
        if not batch:
            break
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            if separator and eos is not None:
                ids = [*ids, eos]
            pieces.append(torch.tensor(ids, dtype=torch.long))
            total += len(ids)
    if not pieces:
        raise ValueError("the data sources yielded no documents")
    stream = torch.cat(pieces)
    return stream if max_tokens is None else stream[:max_tokens]


def pack_blocks(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """(N,) token stream -> (N // length, length) blocks; the remainder is dropped."""
    if length < 2:
        raise ValueError(f"sequence length {length} is too short; allowed: >= 2")
    count = tokens.numel() // length
    if count == 0:
        raise ValueError(f"only {tokens.numel()} tokens: not enough for one block of {length}")
    return tokens[: count * length].view(count, length)


def source_stamps(sources: Sequence[str]) -> list[Any]:
    """What identifies the current content of ``sources``: each local file's path, size and mtime.

    Cached tokenisations are keyed by it, so an edited file is tokenised again."""
    stamps: list[Any] = []
    for source in sources:
        if source == BUILTIN_STDLIB:
            stamps.append([source, sysconfig.get_paths()["stdlib"], len(_stdlib_files())])
        elif source.startswith("hf:"):
            stamps.append([source])
        else:
            for path in _local_files(source):
                info = path.stat()
                stamps.append([str(path.resolve()), info.st_size, info.st_mtime_ns])
    return stamps


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's full definition (vocabulary, merges, normaliser, special tokens)."""
    import hashlib

    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([type(tokenizer).__name__, tokenizer.eos_token_id, tokenizer.bos_token_id])
    return hashlib.sha256(f"{extra}\n{text}".encode()).hexdigest()[:20]
