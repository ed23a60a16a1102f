#!/usr/bin/env bash
# One GPU session's measurements, in one call (a lent GPU's time is short): the CUDA tests,
# then `hf-posenc bench --device cuda --dtype bfloat16` against native SDPA in the same run.
# Run from the repository root on a CUDA machine:  OUT=/some/dir bash scripts/gpu_session.sh
# Wheels in .whl/ (transformers, flash-linear-attention, fla-core) are installed first when present.
# Each stage has its own time limit and the script goes on after a stage fails; everything it
# writes lands in $OUT (log.txt and results.tar.gz).
set -u
OUT=${OUT:-gpu-session}
mkdir -p "$OUT/work"
export PYTHONUNBUFFERED=1
log="$OUT/log.txt"
stage() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
{
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  stage environment
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  python3 - <<'PY'
import importlib.metadata as m, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for p in ("triton", "transformers", "fla-core", "flash-linear-attention", "flash-attn", "accelerate"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, "not installed")
props = torch.cuda.get_device_properties(0)
print("shared memory per block (opt-in):", getattr(props, "shared_memory_per_block_optin", "?"))
PY
  B="python3 -m hf_posenc bench --device cuda --dtype bfloat16 --hidden-size 1024 --num-heads 16 --num-layers 4 --vocab-size 32000 --repeats 5 --warmup 2"
  stage "bench A: score-bias encodings and rope/expe/nope, T=8192, forward and forward+backward (head_dim 64)"
  timeout ${STAGE_A:-240} $B --encodings alibi t5 kerple sandwich fire fox rope expe nope --modes forward train --lengths 8192 --output-dir "$OUT/work/bench-8k"
  stage "CUDA tests (auto == eager: logits, gradients, cached decoding)"
  timeout ${STAGE_T:-120} python3 -m pytest -q -rA -p no:cacheprovider tests/attention -k cuda -m "slow or not slow" 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -60
  stage "bench B: the other encodings at T=8192 forward, and decoding after a 2048-token prompt"
  timeout ${STAGE_B:-100} $B --encodings cope cape sba tape comrope liere xpos t5 alibi --modes forward decode --lengths 8192 --decode-tokens 64 --output-dir "$OUT/work/bench-other"
  stage "bench C: T=2048 and 32768 forward+backward for alibi, t5, fire, fox"
  timeout ${STAGE_C:-120} $B --encodings alibi t5 fire fox --modes forward train --lengths 2048 32768 --output-dir "$OUT/work/bench-2k-32k"
  stage done
} 2>&1 | tee "$log"
tar czf "$OUT/results.tar.gz" -C "$OUT/work" . 2>/dev/null
for f in "$OUT"/work/*/bench.md; do echo "== $f"; cat "$f"; done
