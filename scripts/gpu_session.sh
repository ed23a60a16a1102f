#!/usr/bin/env bash
# One GPU session's measurements, in one call (a lent GPU's time is short): the CUDA tests,
# `hf-posenc bench --device cuda --dtype bfloat16` against native SDPA in the same run, profiles.
# Run from the repository root on a CUDA machine:
#   OUT=/some/dir STAGES="tests bias frozen other lengths buckets sweep dropin s2 cpu_lanes profile" bash scripts/gpu_session.sh
# Narrower stages: TESTS_K (a pytest -k expression within the CUDA tests), BIAS_ENCODINGS,
# OTHER_ENCODINGS, OTHER_MODES, BUCKETS_ARGS (gpu_flex_buckets.py arguments), PROFILES.
# Wheels in .whl/ (transformers, flash-linear-attention, fla-core) are installed first when present.
# Each stage has its own time limit (STAGE_<NAME>=seconds) and the script goes on after a stage
# fails; everything lands in $OUT (log.txt, results.tar.gz).
set -u
OUT=${OUT:-gpu-session}
STAGES=${STAGES:-tests bias frozen other lengths profile}
mkdir -p "$OUT/work"
export PYTHONUNBUFFERED=1
log="$OUT/log.txt"
stage() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
wants() { [[ " $STAGES " == *" $1 "* ]]; }
{
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  stage environment
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 - <<'PY'
import importlib.metadata as m, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for p in ("triton", "transformers", "fla-core", "flash-attn"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, "not installed")
PY
  B="python3 -m hf_posenc bench --device cuda --dtype bfloat16 --hidden-size 1024 --num-heads 16 --num-layers 4 --vocab-size 32000 --repeats 5 --warmup 2"
  if wants tests; then
    stage "CUDA tests (auto == eager: logits, gradients, cached decoding)"
    timeout ${STAGE_TESTS:-150} python3 -m pytest -v -p no:cacheprovider -n 8 tests/attention -k "cuda and (${TESTS_K:-cuda})" -m "slow or not slow" 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | cut -c1-300
  fi
  if wants bias; then
    stage "bench: score-bias encodings and rope/expe/nope, T=8192, forward and forward+backward (head_dim 64)"
    timeout ${STAGE_BIAS:-240} $B --encodings ${BIAS_ENCODINGS:-alibi t5 kerple sandwich fire fox rope expe nope} --modes forward train --lengths 8192 --output-dir "$OUT/work/bench-8k"
  fi
  if wants frozen; then
    stage "bench: learned tables frozen (what learning them costs), T=8192 forward+backward"
    timeout ${STAGE_FROZEN:-90} $B --encodings t5 kerple fire --modes train --lengths 8192 --freeze-encoding --output-dir "$OUT/work/bench-8k-frozen"
  fi
  if wants other; then
    stage "bench: the other encodings at T=8192 forward, and decoding after a 2048-token prompt"
    timeout ${STAGE_OTHER:-100} $B --encodings ${OTHER_ENCODINGS:-cope cape sba tape comrope liere xpos t5 alibi} --modes ${OTHER_MODES:-forward decode} --lengths 8192 --decode-tokens 64 --output-dir "$OUT/work/bench-other"
  fi
  if wants lengths; then
    stage "bench: T=2048 and 32768 forward+backward for alibi, t5, fire, fox"
    timeout ${STAGE_LENGTHS:-120} $B --encodings alibi t5 fire fox --modes forward train --lengths 2048 32768 --output-dir "$OUT/work/bench-2k-32k"
  fi
  if wants buckets; then
    stage "FlexAttention length buckets: compilations per length, first-call time, bucketed == exact shape (scripts/gpu_flex_buckets.py)"
    timeout ${STAGE_BUCKETS:-300} python3 scripts/gpu_flex_buckets.py ${BUCKETS_ARGS:-} 2>&1 | grep -v Warning
  fi
  if wants sweep; then
    stage "FlexAttention alone: tile rungs and learned-table gradients (scripts/gpu_flex_sweep.py)"
    timeout ${STAGE_SWEEP:-240} python3 scripts/gpu_flex_sweep.py --budget $(( ${STAGE_SWEEP:-240} - 40 )) 2>&1 | grep -v Warning
  fi
  if wants dropin; then
    stage "drop-in: offloaded and compiled static-cache generation equal the default (CUDA)"
    timeout ${STAGE_DROPIN:-90} python3 -m pytest -q -p no:cacheprovider tests/core/test_dropin_attention.py -k cuda_offloaded -m "slow or not slow" 2>&1 | tail -15 | cut -c1-300
  fi
  if wants s2; then
    stage "S2-Attn (LongLoRA shifted groups) vs full attention, training step"
    timeout ${STAGE_S2:-150} python3 -m hf_posenc.recipes.benchmark.s2_attn --lengths 2048 8192 16384 --group-size 0.25 --hidden-size 1024 --num-layers 8 --num-heads 16 --vocab-size 32000 --rounds 5 --device cuda --dtype bfloat16 --json "$OUT/work/s2.json" 2>&1 | tail -20
  fi
  if wants cpu_lanes; then
    stage "TAPE's CPU attention on the host's cores: two lanes of half the threads vs every operation on all (thread_split)"
    timeout ${STAGE_CPU_LANES:-120} python3 scripts/tape_value_width_cost.py --rounds 5 2>&1 | tail -9
    OMP_NUM_THREADS=2 timeout ${STAGE_CPU_LANES:-120} python3 scripts/tape_value_width_cost.py --rounds 5 2>&1 | tail -9
  fi
  if wants profile; then
    stage "profiles"
    IFS=';' read -ra specs <<< "${PROFILES:-t5 decode --length 2048;t5 train;fire train}"
    for spec in "${specs[@]}"; do
      timeout ${STAGE_PROFILE:-60} python3 scripts/gpu_profile.py $spec 2>&1 | grep -v "^-" | cut -c1-200 | head -40
    done
  fi
  stage done
} 2>&1 | tee "$log"
tar czf "$OUT/results.tar.gz" -C "$OUT/work" . 2>/dev/null
for f in "$OUT"/work/*/bench.md; do echo "== $f"; cat "$f"; done
