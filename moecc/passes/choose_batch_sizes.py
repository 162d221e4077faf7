"""choose_batch_sizes: pick B, b_a and b_e for prefill and decode by a simple rule.

Requires: transfers.
Does (the rule; the OR-Tools planner replaces it in a later issue):
  device budget D = 0.9 x gpu_mem (unbounded when gpu_mem is not given)
  fixed       = 2 x largest dense module weights (double-buffered slots)
              + 2 x one expert's weights (two expert slots: compute one, fetch the next)
  left        = D - fixed: at most half for attention KV, the rest for expert activations
  host budget = 0.8 x host_mem - model weight bytes
  B (decode)  = min(max_batch, host budget / (KV bytes per token x (prompt + output tokens)))
  b_a         = max(1, min(B, (left / 2) / (2 x one layer's KV of a full-length sequence)))
  b_e         = largest power of two <= 4096 with b_e x act_bytes_per_token <= left - b_a's KV
  prefill uses the same B, b_a and b_e, and runs at most
  tokens_per_step = min(4096, B x prompt tokens) prompt tokens per step.
  KV is paged in blocks of 8 positions; the pool holds the host budget's worth of blocks
  (unbounded host: B x (ceil(seq_len / 8) + 1) blocks).
A budget below the minimum working set (fixed + one token's activations) fails with the
minimum that would fit.
Guarantees: batch_sizes (graph.attrs["batch"] and graph.attrs["memory"]).
Options: gpu_mem, host_mem (bytes), prompt_tokens, output_tokens, max_batch.
"""

from __future__ import annotations

from moecc.errors import BudgetError
from moecc.ir import DTYPE_BYTES, Graph
from moecc.pass_infra import Pass, PassContext, PassResult
from moecc.sizes import format_bytes, format_size_at_least

DEVICE_DERATE = 0.9
HOST_DERATE = 0.8
MAX_EXPERT_CHUNK = 4096
KV_BLOCK_SIZE = 8
MAX_PREFILL_TOKENS_PER_STEP = 4096


def _pow2_floor(x: float, cap: int) -> int:
    n = 1
    while n * 2 <= min(x, cap):
        n *= 2
    return n


class ChooseBatchSizes(Pass):
    name = "choose_batch_sizes"
    requires = frozenset({"transfers"})
    ensures = frozenset({"batch_sizes"})

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        g = graph.copy()
        info = g.info
        itemsize = DTYPE_BYTES[info.dtype]
        H = info.hidden_size
        gpu_mem = ctx.option("gpu_mem")
        host_mem = ctx.option("host_mem")
        prompt = int(ctx.option("prompt_tokens", 512))
        output = int(ctx.option("output_tokens", 256))
        max_batch = int(ctx.option("max_batch", 1024))
        seq = min(prompt + output, info.max_position_embeddings)

        dense_by_module: dict[str, int] = {}
        expert_bytes = 0
        inter = 0
        for n in g.nodes:
            if n.op == "experts":
                expert_bytes = max(expert_bytes, n.weight_bytes // n.attrs["num_experts"])
                inter = max(inter, n.attrs["intermediate_size"])
            elif n.weights and n.module:
                dense_by_module[n.module] = dense_by_module.get(n.module, 0) + n.weight_bytes
            if n.op == "mlp":
                inter = max(inter, n.attrs["intermediate_size"])
        dense_max = max(dense_by_module.values(), default=0)
        fixed = 2 * dense_max + 2 * expert_bytes
        # per token in an expert chunk: input row, gate and up rows, activation, output row (fp32)
        act_per_token = (2 * H + 3 * inter) * 4
        kv_layer_seq = 2 * info.num_kv_heads * info.head_dim * itemsize * seq
        logits_row = info.vocab_size * 4

        minimum = fixed + act_per_token + kv_layer_seq * 2 + logits_row
        if gpu_mem is None:
            device_budget = None
            left = float("inf")
        else:
            device_budget = int(gpu_mem * DEVICE_DERATE)
            if device_budget < minimum:
                raise BudgetError(
                    f"--gpu-mem {format_bytes(gpu_mem)} cannot hold the minimum working set of "
                    f"{info.architecture}: {format_bytes(minimum)} (two slots of the largest dense module "
                    f"{format_bytes(dense_max)}, two expert slots of {format_bytes(expert_bytes)}, one "
                    f"sequence's KV for one layer and one token's activations) at a {DEVICE_DERATE:.0%} "
                    f"derate; use --gpu-mem {format_size_at_least(minimum / DEVICE_DERATE)} or more"
                )
            left = device_budget - fixed

        weights = g.weight_bytes
        block_bytes = info.kv_bytes_per_token * KV_BLOCK_SIZE
        blocks_per_seq = -(-seq // KV_BLOCK_SIZE)
        kv_per_seq = blocks_per_seq * block_bytes  # paged: whole blocks
        if host_mem is None:
            B = max_batch
            host_budget = None
        else:
            host_budget = int(host_mem * HOST_DERATE) - weights
            if host_budget < kv_per_seq:
                raise BudgetError(
                    f"--host-mem {format_bytes(host_mem)} cannot hold the model ({format_bytes(weights)}) "
                    f"plus one sequence's KV cache ({format_bytes(kv_per_seq)}) at a {HOST_DERATE:.0%} "
                    f"derate; use --host-mem {format_size_at_least((weights + kv_per_seq) / HOST_DERATE)} or more"
                )
            B = max(1, min(max_batch, host_budget // kv_per_seq))
        if left == float("inf"):
            b_a, b_e = int(B), MAX_EXPERT_CHUNK
        else:
            b_a = int(max(1, min(B, (left / 2) // (2 * kv_layer_seq))))
            b_e = _pow2_floor((left - 2 * b_a * kv_layer_seq) / act_per_token, MAX_EXPERT_CHUNK)
        decode = {"B": int(B), "b_a": b_a, "b_e": b_e}
        prefill = {"B": int(B), "b_a": b_a, "b_e": b_e,
                   "tokens_per_step": int(min(MAX_PREFILL_TOKENS_PER_STEP, B * prompt))}
        num_blocks = int(B) * (blocks_per_seq + 1) if host_budget is None else host_budget // block_bytes
        g.attrs["batch"] = {"prefill": prefill, "decode": decode,
                            "kv": {"block_size": KV_BLOCK_SIZE, "num_blocks": int(num_blocks),
                                   "bytes_per_block": int(block_bytes)},
                            "workload": {"prompt_tokens": prompt, "output_tokens": output, "seq_len": seq},
                            "rule": "choose_batch_sizes (simple rule, see the pass docstring)"}
        g.attrs["memory"] = {
            "device": {
                "budget": device_budget,
                "dense_slots": 2 * dense_max,
                "expert_slots": 2 * expert_bytes,
                "expert_activations": b_e * act_per_token,
                "attention_kv": 2 * b_a * kv_layer_seq,
                "minimum": minimum,
            },
            "host": {
                "budget": host_budget,
                "weights": weights,
                "kv_cache": int(num_blocks) * block_bytes,
            },
        }
        return PassResult(g, modified=True)
