"""moecc's runtime (import name `moecc_runtime`): runs a compiled plan over a JSONL file of
prompts. Imports torch, safetensors, the tokenizer loading of tokenizers/transformers and
the standard library only: never moecc's compiler, OR-Tools, networkx or onnx."""
