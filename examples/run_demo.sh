#!/usr/bin/env bash
# The main job on the embedded default: install, build the demo MoE checkpoint (a small
# random-init Mixtral written deterministically by moecc.testing.checkpoints), compile it
# for a 24GB device, and run the example prompts, printing the results.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e .
MODEL=examples/demo-model
OUT=examples/out
mkdir -p "$OUT"
[ -f "$MODEL/model.safetensors" ] || python -m moecc.testing.checkpoints "$MODEL" --preset demo
moecc compile "$MODEL" --gpu-mem 24GB --dump-dir "$OUT/dumps" --dump-format txt,onnx,svg -o "$OUT/plan.pt"
moecc exec "$OUT/plan.pt" examples/prompts.jsonl -o "$OUT/results.jsonl" --overwrite
cat "$OUT/results.jsonl"
