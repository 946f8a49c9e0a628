#!/usr/bin/env bash
# The GPU checks of a session lent one GPU, as one script with a time limit per stage (the lent machine's time is
# short: a stage that overruns is cut, and the next one still runs). Every log and result goes to $OUT (the device
# tool's folder, which sends back at most 8 files: a call of up to three stages writes at most 8, with `| tee
# $OUT/session.log`), else results/gpu-session/. Run from the checkout's root on the GPU machine, with .gpu-wheels
# carried (`make gpu-wheelhouse` here):
#     bash benchmarks/gpu_session.sh [STAGE ...]      # stages: fusions shape rollout bench whole tier bench15
#                                                     # (default: all)
# A session's 15 minutes of device time hold about 10 of stages: two calls, e.g. `fusions shape`, then `bench rollout`.
# fusions: tests/gpu/test_gpu_compiled_fusions.py, two Qwen3-0.6B-shaped layers with SwiGLU and RoPE compiled by
#          torch.compile against megatron-core's unfused ones (`policy.speed.compiled_fusions`, on by default on a GPU
#          without Transformer Engine): equal within bf16 rounding, the compile's seconds, the speed-up. It runs
#          first: every later stage compiles the same kernels (where it fails, the later stages of the call run
#          with TORCH_COMPILE_DISABLE=1: the same code paths, run as written)
# shape  : tests/gpu/test_gpu_grpo_shape.py, 3 GRPO steps of a Qwen3-0.6B-shaped policy through Ray (random weights,
#          ~1K-token responses, Megatron engine colocated): generation, refit, train and logprob speed, and the
#          policy's peak memory per phase against `mrl plan`'s
# rollout: benchmarks/megatron_rollout.py at 28 layers of hidden 1024 in bf16, 64 rows of 256 tokens: the Megatron
#          engine's decode speed, its static loop against its dynamic engine and the dynamic engine bare, with
#          each one's host synchronisations per decode step
# bench  : benchmarks/gpu_policy_throughput.py at Qwen3-0.6B's shape, every path and mrl without the compiled fusions,
#          logprob passes in micro-batches of 32K tokens (training's 16K), with the profile
# whole  : tests/gpu/test_gpu_whole_run.py, the demo's staged run through Ray with the Megatron engine on the GPU
#          (Ray's logs come back as ray-logs.tgz when it fails)
# tier   : the GPU tier's attention test (the variable-length kernel against SDPA per sequence and the masked product)
#          and Megatron's dynamic inference engine on CUDA against the static loop (tests/gpu/test_gpu_dynamic_engine.py)
# bench15: benchmarks/gpu_policy_throughput.py at Qwen2.5-1.5B's shape
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MRL_GPU_REPORT="$OUT/gpu-tier.json"
stages=${*:-fusions shape rollout bench whole tier bench15}

SITE=/tmp/mrl-gpu-site
python3 - "$SITE" <<'EOF'
import sys
from pathlib import Path
from mrl.testing.gpu_tier import WHEELS, cuda_state, install, missing, read_pins
print(cuda_state()[1])
install(missing(read_pins()), WHEELS, Path(sys.argv[1]))
EOF
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

stage() {  # stage NAME SECONDS COMMAND...: run it under a limit, its output in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s"
    tail -n 40 "$OUT/$name.log"
}

for s in $stages; do
    case $s in
    fusions) MRL_GPU_REPORT="$OUT/gpu-tier-fusions.json" stage fusions 120 \
        python3 -m pytest tests/gpu/test_gpu_compiled_fusions.py -q -s -p no:cacheprovider
        if ! grep -q " passed" "$OUT/fusions.log"; then  # the later stages run the same paths as written
            export TORCH_COMPILE_DISABLE=1
            echo "== fusions failed: the later stages run with TORCH_COMPILE_DISABLE=1"
        fi ;;
    tier) MRL_GPU_REPORT="$OUT/gpu-tier-speed.json" stage tier 150 \
        python3 -m pytest tests/gpu/test_gpu_speed.py tests/gpu/test_gpu_dynamic_engine.py -k "attention or dynamic" \
        -q -s -p no:cacheprovider ;;
    shape) MRL_GPU_REPORT="$OUT/gpu-tier-shape.json" stage shape 330 \
        python3 -m pytest tests/gpu/test_gpu_grpo_shape.py -q -s -p no:cacheprovider
        pkill -9 -f "mrl.cli grpo|raylet|gcs_server|ray::|default_worker.py" 2>/dev/null ;;  # a cut run's processes
    whole) MRL_GPU_REPORT="$OUT/gpu-tier-whole.json" stage whole 270 \
        python3 -m pytest tests/gpu/test_gpu_whole_run.py -q -s -p no:cacheprovider
        grep -q "passed" "$OUT/whole.log" || tar czf "$OUT/ray-logs.tgz" -C /tmp/ray session_latest/logs 2>/dev/null
        pkill -9 -f "mrl.cli run|raylet|gcs_server|ray::|default_worker.py" 2>/dev/null ;;  # a cut run's processes
    rollout) stage rollout 180 python3 benchmarks/megatron_rollout.py --prompts 16 --n 4 --tokens 256 --reps 1 \
        --hidden 1024 --layers 28 --dtype bfloat16 --block 256 --profile ;;
    bench) stage bench 240 python3 benchmarks/gpu_policy_throughput.py --shapes qwen3-0.6b --reps 2 --profile \
        --paths mrl mrl_unfused hf bare --logprob-micro-tokens 32768 \
        --progress "$OUT/bench-progress.jsonl" ;;
    bench15) stage bench15 160 python3 benchmarks/gpu_policy_throughput.py --shapes qwen2.5-1.5b --reps 2 \
        --progress "$OUT/bench-progress.jsonl" ;;
    *) echo "unknown stage $s (fusions shape rollout bench whole tier bench15)" ;;
    esac
done
