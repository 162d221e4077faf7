"""moecc's runtime (import name `moecc_runtime`): runs a compiled plan over a JSONL file of
prompts. Imports torch, safetensors, the tokenizer loading of tokenizers/transformers and
the standard library only: never moecc's compiler, OR-Tools, networkx or onnx.

  job/        requests in, results out, progress, the `moecc exec` driver, Ray
  engine.py   Engine (worker + KV block allocator) and generate(), the step loop
  scheduler/  admission, KV block ownership and preemption; emits one step plan per step
  worker/     runs a step plan module by module: batch, attention backend, kernels, stats
  memory/     device arena, copy engine, weights, the KV pool, streaming into the arena
  sampling.py next tokens for a step's logits
  plan.py     the plan file; tokenizer.py, perplexity.py
"""
