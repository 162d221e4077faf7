#!/usr/bin/env bash
# The main job on the embedded default model: install moecc (and torch's CPU build where no
# torch is installed yet), compile the trained demo model (examples/demo-model, a small
# Mixtral-shaped MoE trained by examples/train_demo_model.py) for a 24GB device with every
# dump, run examples/prompts.jsonl, and print the plan, the measured speed and the results.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e .
MODEL=examples/demo-model
OUT=examples/out
mkdir -p "$OUT"
moecc compile "$MODEL" --gpu-mem 24GB --dump-dir "$OUT/dumps" --dump-format txt,onnx,svg \
    -o "$OUT/plan.pt" > "$OUT/compile.log" 2>&1
moecc exec "$OUT/plan.pt" examples/prompts.jsonl -o "$OUT/results.jsonl" --stats "$OUT/stats.json" \
    --overwrite --quiet 2> "$OUT/exec.log"
python examples/demo_summary.py "$OUT/plan.pt" "$OUT/stats.json" "$OUT/results.jsonl" "$OUT/dumps" \
    examples/prompts.jsonl
