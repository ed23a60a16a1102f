"""The benchmark suite: each encoding against the unpatched native model, in one run.

For every length T it measures, on one tiny-but-real model (default: Llama, hidden 256,
4 layers, 8 heads), forward time, forward+backward time and peak extra memory, and the
per-token decode latency after a prompt; it reports medians and their ratios to the native
model measured in the same run (machines are noisy; ratios within one run are what count).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from ..patch import patch_model, unpatch_model
from ..tiny import tiny_model
from .measure import PeakMemory, median_time

NATIVE = "native"
MODES = ("forward", "train", "decode")


@dataclasses.dataclass
class BenchConfig:
    encodings: list[str]
    lengths: list[int] = dataclasses.field(default_factory=lambda: [512, 2048, 4096, 8192])
    modes: list[str] = dataclasses.field(default_factory=lambda: ["forward", "train", "decode"])
    family: str = "llama"
    vocab_size: int = 32000  # a real tokenizer's size: the logits are part of the memory baseline
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    batch_size: int = 1
    repeats: int = 5
    warmup: int = 1
    decode_prompt: int = 2048
    decode_tokens: int = 256
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "sdpa"


@dataclasses.dataclass
class Measurement:
    encoding: str
    mode: str
    length: int
    seconds: float
    peak_bytes: int


def _model(config: BenchConfig, max_positions: int) -> torch.nn.Module:
    model = tiny_model(
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

    with torch.no_grad():
        out = model(prompt, past_key_values=DynamicCache(config=model.config), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(tokens):
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / tokens


def _measure(
    model, mode: str, ids: torch.Tensor, config: BenchConfig, device: torch.device
) -> tuple[float, int]:
    """(median seconds, peak extra bytes) of one mode at one length; decode: seconds per token."""
    if mode == "decode":
        model.eval()
        _decode(model, ids, 4)  # warm-up
        return min(_decode(model, ids, config.decode_tokens) for _ in range(max(1, config.repeats // 2))), 0
    step = _forward if mode == "forward" else _train_step
    model.train(mode == "train")
    seconds = median_time(lambda: step(model, ids), device, config.repeats, config.warmup)
    with PeakMemory(device) as memory:
        step(model, ids)
    return seconds, memory.extra


def run_suite(config: BenchConfig, progress: bool = True) -> list[Measurement]:
    device = torch.device(config.device)
    longest = max([*config.lengths, config.decode_prompt + config.decode_tokens])
    model = _model(config, longest)
    results: list[Measurement] = []
    generator = torch.Generator().manual_seed(0)
    for name in [NATIVE, *config.encodings]:
        if name != NATIVE:
            patch_model(model, name, backend=config.backend)
        for mode in config.modes:
            lengths = [config.decode_prompt] if mode == "decode" else config.lengths
            for length in lengths:
                ids = torch.randint(
                    0, config.vocab_size, (config.batch_size, length), generator=generator
                ).to(device)
                seconds, peak = _measure(model, mode, ids, config, device)
                results.append(Measurement(name, mode, length, seconds, peak))
                if progress:
                    print(
                        f"[bench] {name:<11} {mode:<8} T={length:<6} {seconds * 1000:9.2f} ms  "
                        f"+{peak / 2**20:8.1f} MiB",
                        flush=True,
                    )
        if name != NATIVE:
            unpatch_model(model)
        model.zero_grad(set_to_none=True)
    return results


def ratio_table(results: list[Measurement]) -> str:
    """Markdown: per encoding, mode and length, time and memory as ratios to native."""
    native = {(m.mode, m.length): m for m in results if m.encoding == NATIVE}
    lines = [
        "| encoding | mode | T | time (ms) | time / native | peak extra (MiB) | memory / native |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in results:
        base = native.get((m.mode, m.length))
        time_ratio = f"{m.seconds / base.seconds:.2f}x" if base and base.seconds else "-"
        memory_ratio = f"{m.peak_bytes / base.peak_bytes:.2f}x" if base and base.peak_bytes else "-"
        lines.append(
            f"| {m.encoding} | {m.mode} | {m.length} | {m.seconds * 1000:.2f} | {time_ratio} | "
            f"{m.peak_bytes / 2**20:.1f} | {memory_ratio} |"
        )
    return "\n".join(lines)


def write_results(results: list[Measurement], config: BenchConfig, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"table": out_dir / "bench.md", "json": out_dir / "bench.json", "png": out_dir / "bench.png"}
    paths["table"].write_text(ratio_table(results) + "\n")
    paths["json"].write_text(
        json.dumps(
            {"config": dataclasses.asdict(config), "results": [dataclasses.asdict(m) for m in results]},
            indent=2,
        )
    )
    _plot(results, paths["png"])
    return paths


def _plot(results: list[Measurement], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4))
    FigureCanvasAgg(figure)
    panels = [("forward", "seconds"), ("forward", "peak_bytes"), ("train", "seconds")]
    for index, (mode, field) in enumerate(panels):
        axis = figure.add_subplot(1, len(panels), index + 1)
        for name in dict.fromkeys(m.encoding for m in results):
            points = sorted(
                (m.length, getattr(m, field)) for m in results if m.encoding == name and m.mode == mode
            )
            if points:
                scale = 1000 if field == "seconds" else 1 / 2**20
                axis.plot([p[0] for p in points], [p[1] * scale for p in points], marker="o", label=name)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("T (tokens)")
        axis.set_ylabel("ms" if field == "seconds" else "peak extra MiB")
        axis.set_title(f"{mode} {'time' if field == 'seconds' else 'memory'}")
        axis.grid(alpha=0.3)
    figure.axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, format="png")
