"""The benchmark suite: each encoding against the unpatched native model, in one run.

For every length T it measures, on one tiny-but-real model (default: Llama, hidden 256,
4 layers, 8 heads), forward time, forward+backward time and peak extra memory, and the
per-token decode latency after a prompt; it reports medians and their ratios to the native
model measured in the same run (machines are noisy; ratios within one run are what count).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from ...core.patch import patch_info, patch_model
from ..atomic import replacing, write_text
from ..provenance import provenance
from ..tiny import tiny_model
from .config import BenchConfig
from .measure import PeakMemory, allocator_for_timing, paired_times, return_freed_memory_to_os

NATIVE = "native"
MODES = ("forward", "train", "decode")
#: peak-memory readings per row, native and encoding alternating; each row reports the medians. The
#: first reading after the timed calls is off (the allocator's switch from the timing setting to
#: the memory one: comrope's forward at T=4096 read 0.96x then 1.09x, 1.07x, 1.08x, 1.08x of
#: native; tape's 1.82x then 1.09x-1.16x; idle, five pairs in one process, 2026-11-26)
MEMORY_READINGS = 3


@dataclasses.dataclass
class Measurement:
    encoding: str
    mode: str
    length: int
    seconds: float  # median; decode: per generated token
    peak_bytes: int  # peak extra memory of one call, median of MEMORY_READINGS (0 for decode: not measured)
    #: median of the native model's calls alternating with this encoding's (None on native rows)
    native_seconds: float | None = None
    #: the native model's peak extra memory read alternating with this row's readings (their
    #: median), under the same allocator state (None on native rows and for decode)
    native_peak_bytes: int | None = None
    error: str | None = None  # e.g. out of memory: the call could not run
    #: what served each kind of attention call so far (``patch_info(model)["kernels"]``: the
    #: FlexAttention kernel options' rung, or the fallback and why); None where no fused kernel ran
    kernels: dict[str, str] | None = None

    @property
    def time_ratio(self) -> float | None:
        if self.error or not self.native_seconds:
            return None
        return self.seconds / self.native_seconds


def _model(config: BenchConfig, max_positions: int) -> torch.nn.Module:
    model: nn.Module = tiny_model(
        config.family,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_heads,
        max_positions=max_positions,
    )
    return model.to(device=config.device, dtype=getattr(torch, config.dtype))


def _forward(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _train_step(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, use_cache=False).loss.backward()


def _decode(model, prompt, tokens: int) -> float:
    """Seconds per generated token after ``prompt`` (greedy, KV cache)."""

    from transformers import DynamicCache

    from ...compat import cache_keyword, output_cache

    with torch.no_grad():
        out = model(prompt, **{cache_keyword(model): DynamicCache(config=model.config)}, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(tokens):
            out = model(token, **{cache_keyword(model): output_cache(out)}, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / tokens


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


class _Bench:
    """One run: the native model, and each encoding patched onto a copy of it."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.native = _model(config, config.longest)
        self.native_memory: dict[tuple[str, int], int] = {}
        self.native_times: dict[tuple[str, int], list[float]] = {}

    def ids(self, length: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(length)
        shape = (self.config.batch_size, length)
        return torch.randint(0, self.config.vocab_size, shape, generator=generator).to(self.device)

    def peak(self, model, mode: str, ids: torch.Tensor) -> int:
        if mode == "decode":
            return 0
        step = _forward if mode == "forward" else _train_step
        if self.device.type == "cpu":
            return_freed_memory_to_os()  # the resident set follows the live tensors (measure.py)
        with PeakMemory(self.device) as memory:
            step(model, ids)
        model.zero_grad(set_to_none=True)
        return memory.extra

    def times(self, model, mode: str, ids: torch.Tensor) -> tuple[list[float], list[float]]:
        """(native seconds, model seconds), alternating; decode: seconds per token."""
        config, native = self.config, self.native
        if self.device.type == "cpu":
            allocator_for_timing()  # glibc as a training process has it, not the memory readings' setting
        if mode == "decode":
            pairs = [
                (_decode(native, ids, config.decode_tokens), _decode(model, ids, config.decode_tokens))
                for _ in range(max(1, config.repeats // 2))
            ]
            return [p[0] for p in pairs], [p[1] for p in pairs]
        step = _forward if mode == "forward" else _train_step
        return paired_times(
            lambda: step(native, ids), lambda: step(model, ids), self.device, config.repeats, config.warmup
        )

    def measure(self, name: str, model, mode: str, length: int) -> Measurement:
        key = (mode, length)
        ids = self.ids(length)
        for m in (self.native, model):
            m.train(mode == "train")
        if mode == "decode":
            _decode(self.native, ids, 2)  # warm-up
            _decode(model, ids, 2)
        if key not in self.native_memory:
            self.native_memory[key] = self.peak(self.native, mode, ids)
        try:
            native_seconds, seconds = self.times(model, mode, ids)
            # native read again beside the model, not only before the first row: after the timed
            # calls (glibc's defaults) the heap holds freed blocks that the memory setting's trim
            # hands back, so both readings must start from the same state (measure.py)
            readings = [
                (self.peak(self.native, mode, ids), self.peak(model, mode, ids))
                for _ in range(MEMORY_READINGS)
            ]
            native_peak = int(statistics.median(native for native, _ in readings))
            peak = int(statistics.median(reading for _, reading in readings))
        except (RuntimeError, MemoryError) as error:
            if not _is_out_of_memory(error) and not isinstance(error, MemoryError):
                raise
            model.zero_grad(set_to_none=True)
            return Measurement(name, mode, length, math.nan, 0, error="out of memory")
        self.native_times.setdefault(key, []).extend(native_seconds)
        return Measurement(
            name,
            mode,
            length,
            statistics.median(seconds),
            peak,
            native_seconds=statistics.median(native_seconds),
            native_peak_bytes=native_peak if mode != "decode" else None,
        )

    def native_rows(self) -> list[Measurement]:
        rows = []
        for (mode, length), seconds in self.native_times.items():
            rows.append(
                Measurement(
                    NATIVE, mode, length, statistics.median(seconds), self.native_memory[(mode, length)]
                )
            )
        return rows


def _lengths(config: BenchConfig, mode: str) -> list[int]:
    if mode == "decode":
        return [config.decode_prompt]
    if mode == "train" and config.train_lengths:
        return config.train_lengths
    return config.lengths


def run_suite(config: BenchConfig, progress: bool = True) -> list[Measurement]:
    """Every (encoding, mode, length) of ``config``, timed alternately with the native model."""
    bench = _Bench(config)
    results: list[Measurement] = []
    for name in config.encodings or [NATIVE]:
        model = (
            bench.native
            if name == NATIVE
            else patch_model(copy.deepcopy(bench.native), name, backend=config.backend)
        )
        if name != NATIVE and config.freeze_encoding:
            model.posenc.requires_grad_(False)
        for mode in config.modes:
            for length in _lengths(config, mode):
                m = bench.measure(name, model, mode, length)
                if name != NATIVE:
                    m.kernels = (patch_info(model) or {}).get("kernels")
                    results.append(m)
                if progress:
                    ratio = f"{m.time_ratio:.2f}x native" if m.time_ratio else (m.error or "")
                    print(
                        f"[bench] {name:<11} {mode:<8} T={length:<6} {m.seconds * 1000:9.2f} ms  "
                        f"+{m.peak_bytes / 2**20:8.1f} MiB  {ratio}"
                        + (f"  kernels {m.kernels}" if m.kernels else ""),
                        flush=True,
                    )
        del model
    return bench.native_rows() + results


def ratio_table(results: list[Measurement]) -> str:
    """Markdown: per encoding, mode and length, time and memory as ratios to native.

    The time ratio divides by the native calls that alternated with this encoding's calls;
    the memory ratio by the native model's peak extra memory read alternating with the row's
    readings (medians of :data:`MEMORY_READINGS` each; the same mode and length; on native rows,
    its first reading).
    """
    native = {(m.mode, m.length): m for m in results if m.encoding == NATIVE}
    lines = [
        "| encoding | mode | T | time (ms) | time / native | peak extra (MiB) | memory / native |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in results:
        base = native.get((m.mode, m.length))
        if m.error:
            lines.append(f"| {m.encoding} | {m.mode} | {m.length} | {m.error} | - | - | - |")
            continue
        time_ratio = f"{m.time_ratio:.2f}x" if m.time_ratio else "-"
        if m.encoding == NATIVE:
            time_ratio = "1.00x"
        native_peak = m.native_peak_bytes or (base.peak_bytes if base else 0)
        memory_ratio = f"{m.peak_bytes / native_peak:.2f}x" if native_peak else "-"
        lines.append(
            f"| {m.encoding} | {m.mode} | {m.length} | {m.seconds * 1000:.2f} | {time_ratio} | "
            f"{m.peak_bytes / 2**20:.1f} | {memory_ratio} |"
        )
    return "\n".join(lines)


def _json_row(m: Measurement) -> dict:
    row = dataclasses.asdict(m)
    row["seconds"] = None if math.isnan(m.seconds) else m.seconds  # NaN is not JSON
    row["time_ratio"] = m.time_ratio
    return row


def write_results(results: list[Measurement], config: BenchConfig, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"table": out_dir / "bench.md", "json": out_dir / "bench.json", "png": out_dir / "bench.png"}
    write_text(paths["table"], ratio_table(results) + "\n")
    write_text(
        paths["json"],
        json.dumps(
            {
                "config": dataclasses.asdict(config),
                "provenance": provenance(),
                "results": [_json_row(m) for m in results],
            },
            indent=2,
        ),
    )
    _plot(results, paths["png"], config)
    return paths


def _panels(results: list[Measurement]) -> list[tuple[str, str]]:
    """(mode, field) of each panel, for the modes that ran: time per mode, and memory of forward/train."""
    modes = [mode for mode in MODES if any(m.mode == mode and not m.error for m in results)]
    panels = [(mode, "seconds") for mode in modes]
    panels += [(mode, "peak_bytes") for mode in modes if mode != "decode"]
    return panels


def _plot(results: list[Measurement], path: Path, config: BenchConfig | None = None) -> None:
    """One panel per measured (mode, quantity): lines over T for forward/train, bars for decode."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    from ..evaluation.report import line_styles

    panels = _panels(results) or [("forward", "seconds")]
    names = list(dict.fromkeys(m.encoding for m in results))
    styles = dict(zip(names, line_styles(len(names)), strict=True))
    figure = Figure(figsize=(4.2 * len(panels) + 2.5, 4.5), dpi=110)
    FigureCanvasAgg(figure)
    axes_list = figure.subplots(1, len(panels), squeeze=False)[0]
    for axis, (mode, field) in zip(axes_list, panels, strict=True):
        scale = 1000 if field == "seconds" else 1 / 2**20
        unit = ("ms per token" if mode == "decode" else "ms") if field == "seconds" else "peak extra MiB"
        rows = [m for m in results if m.mode == mode and not m.error]
        if mode == "decode":
            values = [(m.encoding, getattr(m, field) * scale) for m in rows]
            axis.bar(
                range(len(values)), [v for _, v in values], color=[styles[n]["color"] for n, _ in values]
            )
            axis.set_xticks(range(len(values)), [n for n, _ in values], rotation=60, ha="right", fontsize=7)
            prompt = rows[0].length if rows else "?"
            axis.set_title(f"decode: per-token latency after {prompt} tokens", fontsize=9)
        else:
            lengths = sorted({m.length for m in rows})
            for name in names:
                points = sorted((m.length, getattr(m, field) * scale) for m in rows if m.encoding == name)
                if points:
                    axis.plot([p[0] for p in points], [p[1] for p in points], label=name, **styles[name])
            axis.set_xscale("log", base=2)
            axis.xaxis.set_major_locator(FixedLocator(lengths))
            axis.xaxis.set_minor_locator(NullLocator())
            axis.set_xticklabels([str(n) for n in lengths])
            axis.set_xlabel("T (tokens)")
            kind = "time" if field == "seconds" else "memory"
            axis.set_title(f"{'forward+backward' if mode == 'train' else mode} {kind}", fontsize=9)
        formatter = ScalarFormatter(useOffset=False)
        formatter.set_scientific(False)
        axis.yaxis.set_major_formatter(formatter)
        axis.set_ylabel(unit)
        axis.grid(alpha=0.3)
    if config is not None:
        figure.suptitle(
            f"hf-posenc bench: {config.family}, hidden {config.hidden_size}, {config.num_layers} layers, "
            f"batch {config.batch_size}, {config.device}, {config.dtype}, backend {config.backend}"
        )
    handles, labels = [], []
    for axis in axes_list:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        figure.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
    figure.tight_layout(rect=(0, 0, 1 - 2.2 / (4.2 * len(panels) + 2.5), 0.95))
    with replacing(path) as partial:
        figure.savefig(partial, format="png")
