"""What one step of the module schedule costs, read off the graph: per layer, the FLOPs and
weight bytes of its attention, router, experts and dense MLP; per context token, the KV
bytes attention reads and the FLOPs it spends. Pure data; no hardware in here.

Needs a graph with the `transfers` property (fetch and KV nodes carry their byte counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moecc.ir import DTYPE_BYTES, Graph


@dataclass
class LayerCost:
    layer: int
    attn_bytes: int = 0  # weights of the attention module (norm, q/k/v/o)
    attn_flops: int = 0  # per token, projections and norms (not the context part)
    attn_ctx_flops: int = 0  # per token per context position (scores and weighted values)
    kv_bytes_per_ctx: int = 0  # KV bytes read per context position (this layer)
    router_bytes: int = 0
    router_flops: int = 0  # per token
    expert_bytes: int = 0  # one expert's weights
    expert_flops: int = 0  # per (token, chosen expert)
    expert_inter: int = 0  # an expert's intermediate size (its MLP shape is [H, expert_inter])
    num_experts: int = 0
    top_k: int = 0
    dense_bytes: int = 0  # dense MLP / shared expert weights and the MoE module's norms
    dense_flops: int = 0  # per token

    @property
    def moe(self) -> bool:
        return self.num_experts > 0


@dataclass
class ModelCost:
    dtype: str
    itemsize: int
    hidden: int
    layers: list[LayerCost]
    stem_bytes: int  # embedding
    head_bytes: int  # final norm + lm_head
    head_flops: int  # per token reaching the head
    kv_bytes_per_token: int  # all layers
    act_bytes_per_token: int  # largest activation row an expert chunk holds at once
    buffer_bytes_per_token: int  # host buffers alive in one step, per row
    weight_bytes: int
    head_dim: int = 0
    max_context: int = 0  # the model's context (a device KV buffer holds one such sequence)
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def max_expert_bytes(self) -> int:
        return max((lc.expert_bytes for lc in self.layers), default=0)

    @property
    def max_dense_module_bytes(self) -> int:
        return max([lc.attn_bytes for lc in self.layers] + [lc.dense_bytes + lc.router_bytes for lc in self.layers]
                   + [self.head_bytes], default=0)


def model_cost(graph: Graph) -> ModelCost:
    info = graph.info
    layers = {i: LayerCost(i) for i in range(info.num_layers)}
    stem = head = head_flops = 0
    inter = 0
    buffers = 0
    for n in graph.nodes:
        if n.op == "host_buffer":
            buffers += int(n.attrs.get("bytes_per_token", 0))
            continue
        if n.module == "stem":
            stem += n.weight_bytes
            continue
        if n.module == "head":
            head += n.weight_bytes
            head_flops += n.flops_per_token
            continue
        if n.layer is None:
            continue
        lc = layers[n.layer]
        if n.op == "kv_load":
            lc.kv_bytes_per_ctx += int(n.attrs["bytes_per_ctx_token"])
        elif n.op == "attention":
            lc.attn_bytes += n.weight_bytes
            lc.attn_flops += n.flops_per_token
            lc.attn_ctx_flops += int(n.attrs.get("flops_per_ctx_token", 0))
        elif n.op == "router":
            lc.router_bytes += n.weight_bytes
            lc.router_flops += n.flops_per_token
        elif n.op == "experts":
            E, k = int(n.attrs["num_experts"]), int(n.attrs["top_k"])
            lc.num_experts, lc.top_k = E, k
            lc.expert_bytes = n.weight_bytes // E
            lc.expert_flops = n.flops_per_token // k
            lc.expert_inter = int(n.attrs["intermediate_size"])
            inter = max(inter, int(n.attrs["intermediate_size"]))
        elif n.op in ("mlp",):
            lc.dense_bytes += n.weight_bytes
            lc.dense_flops += n.flops_per_token
            inter = max(inter, int(n.attrs["intermediate_size"]))
        elif n.module is not None and n.module.endswith(".attn"):
            lc.attn_bytes += n.weight_bytes
            lc.attn_flops += n.flops_per_token
        elif n.weights or n.flops_per_token:
            lc.dense_bytes += n.weight_bytes
            lc.dense_flops += n.flops_per_token
    H = info.hidden_size
    return ModelCost(
        dtype=info.dtype, itemsize=DTYPE_BYTES[info.dtype], hidden=H, layers=[layers[i] for i in sorted(layers)],
        stem_bytes=stem, head_bytes=head, head_flops=head_flops, kv_bytes_per_token=info.kv_bytes_per_token,
        act_bytes_per_token=(2 * H + 3 * inter) * 4, buffer_bytes_per_token=buffers,
        weight_bytes=graph.weight_bytes, head_dim=info.head_dim, max_context=info.max_position_embeddings,
    )
