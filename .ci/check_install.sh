#!/usr/bin/env bash
# Prove that a plain install works, as a user gets it from a wheel: build a wheel from a copy
# of the repository's files, delete the copy, install the wheel (not editable) into a fresh
# virtual environment, and from a directory outside any source tree compile the demo model
# with --gpu-mem and every dump format, then exec prompts on it. A package left out of the
# wheel or a dependency left out of pyproject.toml fails here.
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
say() { echo "check_install: $*"; }

mkdir "$work/src" "$work/dist" "$work/job"
(cd "$src" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$work/src"
cp -r "$src/examples/demo-model" "$work/job/model"
cp "$src/examples/prompts.jsonl" "$work/job/prompts.jsonl"
say "building the wheel"
python -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
rm -rf "$work/src"
wheel="$(ls "$work"/dist/moecc-*.whl)"
say "built $(basename "$wheel"); installing it into a fresh virtual environment"
python -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q "$wheel"
"$py" -m pip check

cd "$work/job"
"$py" - <<'PY'
import sys, moecc, moecc_runtime, moecc.planner
for m in (moecc, moecc_runtime, moecc.planner):
    assert m.__file__.startswith(sys.prefix), f"{m.__name__} imported from {m.__file__}, not the venv"
print("check_install: imports from", sys.prefix)
import moecc_runtime.native as native
assert native.available(), "the wheel carries no host attention kernel (moecc_runtime.native._paged_attention)"
assert native.sampling_available(), "the wheel carries no sampler host pass (moecc_runtime.native._sample_rows)"
assert native.dequant_rows() is not None, "the wheel carries no host dequantize (moecc_runtime.native._dequant)"
from moecc_runtime.native import expert_amx, expert_rows, rmsnorm, rope, extension
assert expert_rows._module() is not None, "the wheel carries no expert passes (moecc_runtime.native._expert_rows)"
assert extension("_expert_amx", "moecc_expert_amx") is not None, "the wheel carries no AMX expert (moecc_runtime.native._expert_amx)"
print("check_install: the AMX expert kernel", "runs on this CPU" if expert_amx._module() is not None else "is built (this CPU has no AMX)")
from moecc_runtime.native import linear_amx
assert extension("_linear_amx", "moecc_linear_amx") is not None, "the wheel carries no AMX projection (moecc_runtime.native._linear_amx)"
print("check_install: the AMX projection kernel", "runs on this CPU" if linear_amx._module() is not None else "is built (this CPU has no AMX)")
from moecc_runtime.native import expert_fp32
assert extension("_expert_fp32", "moecc_expert_fp32_ready") is not None, "the wheel carries no fp32 expert layer (moecc_runtime.native._expert_fp32)"
print("check_install: the fp32 expert layer", "runs on this CPU" if expert_fp32._module() is not None else "is built (this CPU has no AVX-512)")
from moecc_runtime.native import prompt_amx
assert extension("_prompt_amx", "moecc_prompt_amx") is not None, "the wheel carries no AMX prompt attention (moecc_runtime.native._prompt_amx)"
print("check_install: the AMX prompt attention", "runs on this CPU" if prompt_amx.available() else "is built (this CPU has no AMX)")
from moecc_runtime.native import prompt_fp32
assert extension("_prompt_fp32", "moecc_prompt_fp32") is not None, "the wheel carries no fp32 prompt attention (moecc_runtime.native._prompt_fp32)"
print("check_install: the fp32 prompt attention", "runs on this CPU" if prompt_fp32.available() else "is built (this CPU has no AVX-512)")
assert rope._module() is not None, "the wheel carries no host rope (moecc_runtime.native._rope)"
assert rmsnorm.sum_lanes() is not None, "the wheel's host rmsnorm is missing or disagrees with torch's (moecc_runtime.native._rmsnorm)"
from moecc_runtime.native import kv_write
assert kv_write._module() is not None, "the wheel carries no host KV scatter (moecc_runtime.native._kv_write)"
print("check_install: host attention kernel, sampler pass, dequantize, expert passes, the AMX expert and projection, the fp32 expert layer, the AMX and fp32 prompt attention, rope, rmsnorm and the KV scatter built into the wheel")
PY
moecc="$work/venv/bin/moecc"
"$moecc" compile model --gpu-mem 24GB --dump-dir dumps --dump-format txt,onnx,svg -o plan.pt
for ext in txt onnx svg; do
    ls dumps/*_emit_plan."$ext" >/dev/null || { say "no $ext dump after emit_plan"; exit 1; }
done
"$moecc" exec plan.pt prompts.jsonl -o results.jsonl --quiet
want="$(grep -c . prompts.jsonl)"
got="$(grep -c '"finish_reason"' results.jsonl)"
[ "$got" = "$want" ] || { say "$got results for $want prompts"; exit 1; }
say "ok: wheel installed outside the source tree; compile (txt, onnx, svg dumps) and exec of $want prompts"
