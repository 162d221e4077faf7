#!/usr/bin/env bash
# GPU check: moecc against transformers + accelerate offloading on a random-weight bf16
# checkpoint of Qwen3-30B-A3B's published shape (qwen3_moe, 128 experts, top-8), usable device
# memory capped at 24 GB, in one command that ends within 8 minutes (budget 450 s; a phase
# that cannot fit is skipped or stopped with a printed reason). Needs no network.
#
#   bash bench/gpu_check.sh [--plan PLAN.pt] [--ckpt DIR] [--layers N] [--budget S] ...
#   bash bench/gpu_check.sh --tiny        # (= --dry-run-cpu) 2 layers, 8 experts, hidden 256,
#                                         # --device cpu, 16 prompts: a smoke test, < 1 min
#   python bench/gpu_check.py --help      # every option
#
# --layers: default 24 (31.2 GB on disk; the published 48 layers are 61 GB, more than the
# device machine's 64 GB disk); everything else is the published config (see
# bench/make_random_checkpoint.py). Results: a table on stdout, JSON in $OUT/gpu_check.json when
# $OUT is set (plus moecc's stats/results and the logs), else bench/results/gpu-check-DATE.json.
#
# The device machine has no OR-Tools, so compile the plan beforehand on a machine that has it
# (the checkpoint is header-deterministic: a sparse headers-only build here has the same
# config.json, header bytes and file sizes as the full build made on the device machine, which
# is what the plan's fingerprint and offsets depend on):
#
#   (a) here, ~1 GB of RAM, 2 MB of disk:
#         bash bench/gpu_check.sh --compile-only
#       = python bench/make_random_checkpoint.py --headers-only bench/out/gpu_check/qwen3-30b-a3b-24L
#         + moecc compile bench/out/gpu_check/qwen3-30b-a3b-24L --gpu-mem 24GB --hardware h200 \
#             --prompt-tokens 48 --output-tokens 32 --max-batch 256 -o bench/out/gpu_check/plan-24L.pt
#   (b) on the device machine (carry bench/out/gpu_check/plan-24L.pt; bench/out/ is git-ignored):
#         bash bench/gpu_check.sh --plan bench/out/gpu_check/plan-24L.pt
#       It writes the full checkpoint (random numbers drawn on the GPU), checks the plan's
#       fingerprint against it, runs `moecc exec` then transformers, and prints the table.
#
# With OR-Tools importable and no --plan, the script compiles the plan itself. Pass the same
# --layers (and workload options) to both steps; a mismatched plan is refused before running.
#
# --offload (first argument): run bench/gpu_offload_check.py instead (the same plan with
# attention on the host and on the device: tok/s, peak device memory, copy/compute overlap
# from the engine and from torch.profiler, pinned/pageable copies), e.g.
#         bash bench/gpu_check.sh --compile-only --layers 4                   (here)
#         bash bench/gpu_check.sh --offload --plan bench/out/gpu_check/plan-4L.pt --layers 4   (device)
#         bash bench/gpu_check.sh --offload --dry-run-cpu                     (a CPU smoke test)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "${1:-}" = "--offload" ]; then
  shift
  exec "${PYTHON:-python}" bench/gpu_offload_check.py "$@"
fi
exec "${PYTHON:-python}" bench/gpu_check.py "$@"
