"""moecc's runtime (import name `moecc_runtime`): runs a compiled plan over a JSONL file of
prompts. Imports torch, safetensors, the tokenizer loading of tokenizers/transformers and
the standard library only: never moecc's compiler, OR-Tools, networkx or onnx.

  contract/   the rules compiler and runtime both compute (block math, the prefix walk,
              placement bytes, dtypes, activations, KV geometry, ModelInfo, the typed PlanView)
  plan_schema.py, plan_ops.py, plan.py   the plan's schema (v5), its op attrs, the plan file
  job/        requests in (reader), results out (writer), progress, the `moecc exec` driver, Ray
  engine.py   Engine (worker + KV block allocator) and generate(), the step loop
  scheduler/  admission, KV block ownership and preemption; emits one step plan per step
  worker/     runs a step plan module by module: batch, attention backends, kernels, stats
  memory/     device arena, copy engine, weights, the KV pool, streaming into the arena
  formats/    one file per stored weight format (dequantize); native/ the C kernels
  sampling/   SamplingParams, the batched sampler, penalties, logprobs
  structured.py  structured outputs (the one grammar compiler); tokenizer.py, perplexity.py, syncs.py
"""
