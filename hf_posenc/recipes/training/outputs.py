"""The final model folder: weights, tokenizer, losses, provenance and a model card, written
atomically (``final.tmp`` renamed to ``final``) by the main process only."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..provenance import provenance
from .config import TrainConfig
from .space import saving
from .world import data_fingerprint

RUN_FILE = "training_run.json"


def model_card(config: TrainConfig, losses: list[tuple[int, float]], record: dict[str, Any]) -> str:
    """README.md of a final model: what it is (base, encoding, data, steps, losses) and how to load it."""
    params = json.dumps(config.encoding_params, sort_keys=True) if config.encoding_params else "defaults"
    encoding = f"`{config.encoding}` ({params})" if config.encoding else "the base model's own (unchanged)"
    first, last = (losses[0][1], losses[-1][1]) if losses else (float("nan"), float("nan"))
    tokens = config.max_steps * config.grad_accum * record["global_batch"] * config.seq_len
    summary = (
        f"Continued pretraining of `{config.model}` after switching its positional encoding to {encoding}"
        if config.encoding
        else f"Continued pretraining of `{config.model}` with its own positional encoding"
    )
    versions = ", ".join(f"{k} {v}" for k, v in record["provenance"]["versions"].items())
    lora = f"r={config.lora_r} (merged)" if config.lora else "no"
    if config.lora and config.lora_trainable:
        lora += f"; {', '.join(config.lora_trainable)} trained fully"
    s2 = "full"
    if config.s2_attn:
        size = config.s2_group_size
        group = f"{size:g} of the length" if isinstance(size, float) else f"{size} tokens"
        s2 = (
            f"LongLoRA's S2-Attn, groups of {group}{' (rolled)' if config.s2_wrap else ''}; full at inference"
        )
    return f"""---
library_name: transformers
tags: [hf-posenc, positional-encoding, continued-pretraining]
base_model: {config.model}
---

# {config.model} with the {config.encoding or "native"} positional encoding

{summary}, made with `hf-posenc train` (hf_posenc).

| | |
|---|---|
| base model | `{config.model}` |
| encoding | {encoding} |
| data | {", ".join(f"`{d}`" for d in config.data)} (split `{config.split}`, field `{config.text_field}`) |
| sequence length | {config.seq_len} |
| steps | {config.max_steps} optimizer steps, global batch {record["global_batch"] * config.grad_accum} sequences ({tokens:,} tokens) |
| learning rate | {config.lr} (warm-up {config.warmup_ratio:.0%}, cosine to {config.end_lr_ratio}x) |
| LoRA | {lora} |
| attention while training | {s2} |
| loss | {first:.4f} at step 1, {last:.4f} at step {config.max_steps} |
| dtype / mixed precision | {config.dtype} / {config.mixed_precision} |
| processes | {record["num_processes"]} |
| made | {record["provenance"]["date"]}, git {record["provenance"]["git_commit"] or "n/a"} |
| versions | {versions} |

## Load it

```python
import hf_posenc
from transformers import AutoTokenizer

model = hf_posenc.from_pretrained("path/to/this/folder")   # re-applies the encoding
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
```

A plain `AutoModelForCausalLM.from_pretrained` would load it without its encoding (and
report the `posenc.*` weights as unexpected). Per-step losses are in `losses.json`, the full
settings and the command in `{RUN_FILE}`.

Command:

```bash
{record["provenance"]["command"]}
```
"""


def write_final(
    model,
    tokenizer,
    output_dir: Path,
    config: TrainConfig,
    losses: list,
    blocks,
    num_processes: int = 1,
    state_dict: dict | None = None,
) -> Path:
    """Save ``model`` and ``tokenizer`` with losses, provenance and a model card as ``output_dir/final``."""
    final_dir = output_dir / "final"
    partial = output_dir / "final.tmp"
    if partial.exists():
        shutil.rmtree(partial)
    with saving(partial, "the final model"):
        _write_partial(model, tokenizer, partial, config, losses, blocks, num_processes, state_dict)
    old = output_dir / "final.old"
    if final_dir.exists():
        os.replace(final_dir, old)
    os.replace(partial, final_dir)
    if old.exists():
        shutil.rmtree(old)
    return final_dir


def _write_partial(
    model, tokenizer, partial: Path, config, losses, blocks, num_processes, state_dict
) -> None:
    """Every file of the final model, into ``partial``."""
    model.save_pretrained(partial, state_dict=state_dict)
    tokenizer.save_pretrained(partial)
    record = {
        "config": dataclasses.asdict(config),
        "steps": config.max_steps,
        "final_loss": losses[-1][1] if losses else None,
        "num_processes": num_processes,
        "global_batch": config.batch_size * num_processes,
        "training_blocks": len(blocks),
        "training_tokens_available": getattr(blocks, "total_tokens", None),
        "training_data": data_fingerprint(blocks),  # token/document counts, SHA-256
        "provenance": provenance(),
    }
    (partial / "losses.json").write_text(json.dumps(losses))
    (partial / RUN_FILE).write_text(json.dumps(record, indent=2))
    (partial / "README.md").write_text(model_card(config, losses, record), encoding="utf-8")
