#!/usr/bin/env bash
# The GPU check: run on the device machine from the repo root, after
# `python benchmarks/gpu_bundle.py --drafter=DIR` here. Two calls, because one carries at
# most 64 MiB and the SmolLM2 GGUF is 98 MB; the second must come while the machine is
# still warm (files outside the repo stay there until it is given back):
#   1. carry ["gpu_bundle/part1"]:  bash benchmarks/gpu_check.sh stage
#   2. carry ["gpu_bundle/part2"]:  bash benchmarks/gpu_check.sh run [rollout.py flags]
# `run` writes under $OUT: gpu_tests.log, tree_attention_gpu.json, rollout_gpu.json and
# rollout_gpu.log (each finished setting is a JSON line there, so a run cut short still
# reports). Extra flags go to benchmarks/rollout.py after the defaults below (later wins).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for results}"
export PYTHONUNBUFFERED=1

case "${1:-}" in
  stage)
    cp gpu_bundle/part1/smollm2.gguf.part /tmp/smollm2.gguf.part1
    echo "staged $(du -h /tmp/smollm2.gguf.part1 | cut -f1) of the GGUF in /tmp"
    ;;
  run)
    shift
    bundle=gpu_bundle/part2
    cat /tmp/smollm2.gguf.part1 "$bundle/smollm2.gguf.part" > /tmp/smollm2.gguf
    sha256sum -c "$bundle/smollm2.gguf.sha256"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      "$bundle"/wheels/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
    (nvidia-smi -L || true; python3 -c 'import jax; print("jax", jax.__version__, jax.devices())') \
      | tee "$OUT/gpu_tests.log"
    # The kernels against their references (compiled, not interpreted) and the drafter's
    # training step through each kernel, then their timing. A failure still lets the
    # benchmarks run (their figures come back), and fails the check at the end.
    failed=()
    python3 -m pytest -q -rs tests/test_tree_attention.py \
      "tests/test_drafter_training.py::test_train_step_with_every_attention_impl" \
      -p no:cacheprovider 2>&1 | tee -a "$OUT/gpu_tests.log" || failed+=("kernel tests")
    python3 benchmarks/tree_attention.py --output "$OUT/tree_attention_gpu.json" \
      || failed+=("benchmarks/tree_attention.py")
    # Sized for one 10-minute call: SD pays up to larger batches on a GPU, so the tail
    # threshold is 16 (the CPU runs use 2).
    python3 benchmarks/rollout.py --model=/tmp/smollm2.gguf --drafter="$bundle/drafter" \
      --questions_json="$bundle/questions.json" --batches=1,4,16 --temperatures=0,1 \
      --strategies=4_1_5,8_4_16 --repeats=2 --max_new_tokens=128 --batch1_prompts=4 \
      --tail_rows=64 --tail_cap=512 --tail_strategy=4_1_5 --tail_threshold=16 \
      --tail_repeats=2 --accept_prompts=12 --accept_strategies=8_4_16,8_8_32 \
      --output="$OUT/rollout_gpu.json" "$@" 2>&1 | tee "$OUT/rollout_gpu.log" \
      || failed+=("benchmarks/rollout.py")
    if ((${#failed[@]})); then
      echo "gpu_check: FAILED: ${failed[*]} (see $OUT/gpu_tests.log)" >&2
      exit 1
    fi
    ;;
  *)
    echo "usage: bash benchmarks/gpu_check.sh stage|run [rollout.py flags]" >&2
    exit 2
    ;;
esac
