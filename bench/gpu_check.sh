#!/usr/bin/env bash
# GPU check: one command that, on a fresh CUDA machine, says whether moecc's CUDA path is right
# and how fast it streams, within 8 minutes (budget 420 s; a phase that cannot fit is skipped
# with a printed reason). Needs no network and no OR-Tools on the device: prepare here first.
#
#   bash bench/gpu_check.sh --prepare       # here, with OR-Tools: writes bench/out/gpu_check/
#                                           # (tiny checkpoint + plans, the 4-layer Mixtral-shaped
#                                           # model's config, tokenizer, shard headers and plans;
#                                           # ~2 MB, git-ignored)
#   bash bench/gpu_check.sh [--budget S]    # on the device; carry bench/out/gpu_check
#                                           # (run tool: carry=["bench/out/gpu_check"])
#   bash bench/gpu_check.sh --dry-run-cpu   # the same logic on a CPU, tiny shapes, < ~60 s
#                                           # (compiles what it needs; tests/e2e/test_gpu_check_dry_run.py)
#   python bench/first_contact.py --help    # every option
#
# On the device it builds the native host-attention kernel in place when a C compiler exists,
# writes the 4-layer model's random bf16 weights (12.1 GB, matching the prepared headers) under
# bench/out/gpu_check-device/, and runs: (a) the tiny fp32 model on CUDA against the CPU, host /
# device / split attention, keep_on_device on and off (tokens identical, logits within 1e-4);
# (b) the same under MOECC_RACE_AMPLIFY=1 and in a CUDA_LAUNCH_BLOCKING=1 child (bit-equal
# logits); (c) the 4-layer model at --gpu-mem 4GB, 64 prompts, per placement: tok/s, true device
# peak vs the budget, streamed host->device GB/s vs a timed 1 GiB pinned copy, overlap
# efficiency, host syncs per step by call site, weight path, native kernel. Results: a table of
# every figure against its target, JSON in $OUT/gpu_check.json (else bench/results/DATE-gpu-check.json).
#
# The older checks stay reachable:
#   bash bench/gpu_check.sh --vs-transformers [ARGS]   # bench/gpu_check.py: moecc vs transformers +
#                                                      # accelerate on a Qwen3-30B-A3B-shaped model
#                                                      # (its --compile-only / --plan / --tiny ...)
#   bash bench/gpu_check.sh --offload [ARGS]           # bench/gpu_offload_check.py
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "${1:-}" in
  --vs-transformers) shift; exec "${PYTHON:-python}" bench/gpu_check.py "$@" ;;
  --offload) shift; exec "${PYTHON:-python}" bench/gpu_offload_check.py "$@" ;;
esac
exec "${PYTHON:-python}" bench/first_contact.py "$@"
