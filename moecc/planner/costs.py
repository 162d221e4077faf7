"""What one step of the module schedule costs, read off the graph: per layer, the FLOPs and
weight bytes of its attention, router, experts and dense MLP; per context token, the KV
bytes attention reads and the FLOPs it spends. Pure data; no hardware in here.

Needs a graph with the `transfers` property (fetch and KV nodes carry their byte counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moecc.ir import DTYPE_BYTES, FLOAT_DTYPES, Graph
from moecc_runtime.contract.placement import dense_placed_bytes, placed_bytes as stored_placed_bytes


#: Bytes a dequantize touches per weight element, as runtime/formats/ do it: the stored value
#: and its scale widened to fp32 (4 + 4), their product (4) and the compute-dtype result
#: (itemsize, counted at 4): priced at the profile's measured elementwise rate.
DEQUANT_BYTES_PER_ELEM = 16

#: Device bytes a dequantize holds at once per element of the tensor being materialised, as
#: runtime/formats/ compute it: the stored value widened to fp32, the per-element fp32 scale
#: and their fp32 product (4 + 4 + 4); the compute-dtype result is counted apart, as kept.
DEQUANT_TEMP_BYTES_PER_ELEM = 12
#: Attention workspace, per (query row, head, context position): PyTorch's math fallback of
#: scaled_dot_product_attention (a boolean mask rules out the fused kernels) keeps fp32
#: scores, the masked scores and the softmax (4 + 4 + 4), and widens K and V to fp32 (4 per
#: value: expanded to every query head for a prompt chunk, enable_gqa).
ATTN_SCORE_BYTES = 12
ATTN_UPCAST_BYTES = 4
#: The step's logits: the head's [rows, V] in the compute dtype and the worker's fp32 copy
#: (StepOutput); the sampler's temporaries: at most SAMPLER_FP32_COPIES fp32 [rows, V] more
#: (masked logits, one reshaped row set), for the step's sampled rows.
LOGITS_FP32_BYTES = 4
SAMPLER_FP32_COPIES = 2


def dequant_bytes(node) -> int:
    """Bytes the dequantize of `node`'s quantized weights touches (0: all dense)."""
    return sum(w.numel * DEQUANT_BYTES_PER_ELEM for w in node.weights.values() if w.format != "dense")


def _quantized(weights) -> tuple[int, int]:
    """(elements, largest tensor's elements) of the quantized weights among `weights`."""
    q = [w.numel for w in weights if w.format != "dense"]
    return sum(q), max(q, default=0)


def dequant_device_bytes(kept: tuple[int, int], per_use: tuple[int, int], itemsize: int) -> int:
    """Device bytes a module's dequantize holds at its peak: its dense-path quantized weights
    materialised in the compute dtype (kept for the module's run), one expert's (materialised
    per use), and the fp32 temporaries of the largest tensor being materialised. `kept` and
    `per_use` are (elements, largest tensor's elements) as _quantized gives them."""
    if not kept[0] and not per_use[0]:
        return 0
    return (kept[0] + per_use[0]) * itemsize + DEQUANT_TEMP_BYTES_PER_ELEM * max(kept[1], per_use[1])


def slot_bytes_per_token(graph) -> int:
    """Host buffer bytes per row when buffers sharing a slot share storage (the `slot` that
    insert_host_buffers gives each): per slot its largest row; a buffer without one (an
    older graph) counts alone."""
    per: dict[object, int] = {}
    for n in graph.nodes:
        if n.op == "host_buffer":
            key = n.attrs.get("slot", ("own", n.name))
            per[key] = max(per.get(key, 0), int(n.attrs.get("bytes_per_token", 0)))
    return sum(per.values())


def placed_bytes(w, itemsize: int) -> int:
    """Arena bytes weight `w` takes in a slot, as runtime/memory/streaming.py places it (the
    contract's rule: moecc_runtime/contract/placement.py): a dense tensor in the wider of its
    file dtype and the compute dtype, a quantized one's parts as stored (dequantized on the
    device, next to the GEMM)."""
    if w.format != "dense":
        return stored_placed_bytes(p.nbytes for p in w.stored().values())
    return dense_placed_bytes(w.numel, DTYPE_BYTES[w.dtype], itemsize)


def slot_bytes(node, itemsize: int) -> int:
    """Arena bytes `node`'s weights take in a slot (see placed_bytes)."""
    return sum(placed_bytes(w, itemsize) for w in node.weights.values())


def _expert_slot_bytes(node, itemsize: int) -> int:
    """One expert's slot: the largest expert's weights (gate, up, down, biases) as placed."""
    per: dict[int, int] = {}
    for local, w in node.weights.items():
        e = int(local.split(".")[0][1:])
        per[e] = per.get(e, 0) + placed_bytes(w, itemsize)
    return max(per.values(), default=0)


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
    attn_elem_bytes: int = 0  # per token: activation bytes the attention module's non-GEMM ops touch
    ffn_elem_bytes: int = 0  # per token: the same for the MoE / MLP module
    attn_slot_bytes: int = 0  # the attention module's weights as a slot holds them (see slot_bytes)
    ffn_slot_bytes: int = 0  # the MoE / MLP module's weights but its experts, as a slot holds them
    expert_slot_bytes: int = 0  # one expert's weights as an expert slot holds them
    attn_dequant_bytes: int = 0  # bytes the dequantize of the attention module's quantized weights touches
    ffn_dequant_bytes: int = 0  # the same for the MoE / MLP module's weights but its experts
    expert_dequant_bytes: int = 0  # the same for one expert (each expert in use, every step)
    attn_q_width: int = 0  # per token: query values of all heads (what crosses to host attention)
    attn_out_width: int = 0  # per token: attention output values of all heads, before o_proj (what comes back)
    attn_heads: int = 0  # query heads (attention scores per query row and context position)
    attn_kv_expanded: int = 0  # K and V values per context position widened to every query head
    attn_dequant_device: int = 0  # device bytes the attention module's dequantize holds (dequant_device_bytes)
    ffn_dequant_device: int = 0  # the same for the MoE / MLP module (its dense weights and one expert)

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
    head_elem_bytes: int  # per token reaching the head: its norm's activation traffic
    kv_bytes_per_token: int  # all layers
    act_bytes_per_token: int  # largest activation row an expert chunk holds at once
    buffer_bytes_per_token: int  # host buffers alive in one step, per row
    weight_bytes: int
    head_dim: int = 0
    max_context: int = 0  # the model's context (a device KV buffer holds one such sequence)
    head_slot_bytes: int = 0  # the head module's weights as a slot holds them
    cast_bytes: int = 0  # host copies of weights stored in another dtype than the compute dtype
    vocab: int = 0  # logits per row reaching the head
    head_dequant_device: int = 0  # device bytes the head's dequantize holds (dequant_device_bytes)
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def dequant_device_bytes(self) -> int:
        """Device bytes the largest module's dequantize holds (modules run one at a time)."""
        return max([self.head_dequant_device] + [max(lc.attn_dequant_device, lc.ffn_dequant_device)
                                                 for lc in self.layers], default=0)

    def logits_bytes(self, rows: int) -> int:
        """The head's logits of `rows` rows and their fp32 copy."""
        return rows * self.vocab * (self.itemsize + LOGITS_FP32_BYTES)

    def sampler_bytes(self, rows: int) -> int:
        """The sampler's fp32 temporaries over `rows` sampled rows."""
        return rows * self.vocab * LOGITS_FP32_BYTES * SAMPLER_FP32_COPIES

    def attention_workspace(self, seqs: int, rows_per_seq: int, context: int, prompt_chunk: bool) -> int:
        """Device bytes attention keeps beside its inputs for one call: decode, `seqs`
        sequences of one row at `context` positions (scores per head, K and V widened in place);
        a prompt chunk (one sequence at a time), `rows_per_seq` rows over `context` positions
        with K and V expanded to every query head. The largest layer's."""
        out = 0
        for lc in self.layers:
            scores = seqs * rows_per_seq * lc.attn_heads * context * ATTN_SCORE_BYTES
            kv_values = lc.attn_kv_expanded if prompt_chunk else lc.kv_bytes_per_ctx // max(1, self.itemsize)
            out = max(out, scores + seqs * context * kv_values * ATTN_UPCAST_BYTES)
        return out

    @property
    def max_expert_bytes(self) -> int:
        return max((lc.expert_bytes for lc in self.layers), default=0)

    @property
    def max_dense_module_bytes(self) -> int:
        return max([lc.attn_bytes for lc in self.layers] + [lc.dense_bytes + lc.router_bytes for lc in self.layers]
                   + [self.head_bytes], default=0)

    @property
    def dense_slot_bytes(self) -> int:
        """One dense slot: the largest streamed module's weights as the runtime places them."""
        return max([lc.attn_slot_bytes for lc in self.layers] + [lc.ffn_slot_bytes for lc in self.layers]
                   + [self.head_slot_bytes], default=0)

    @property
    def expert_slot_bytes(self) -> int:
        """One expert slot: the largest expert as the runtime places it."""
        return max((lc.expert_slot_bytes for lc in self.layers), default=0)


#: Passes over a row that each non-GEMM op makes, in elements of the row's width (reads
#: plus writes, as the runtime's kernels do them: rmsnorm = square, mean, scale, weight;
#: attention = rope on q and k (negate, concatenate, two products, sum: 12 passes), the
#: K/V store to the host and scatter into the device buffer, and its output; experts = gathering each chosen row, weighting and adding it back).
#: Priced at the profile's measured elementwise rate (`moecc profile` times the runtime's
#: rmsnorm + residual add with the same counting), so the constants cancel to first order.
ELEMENTWISE_PASSES: dict[str, int] = {"rmsnorm": 6, "add": 3, "mul": 3, "sigmoid": 2, "router": 4,
                                      "attention_q": 14, "attention_kv": 12, "experts": 8, "mlp": 4,
                                      "host_buffer": 4}


def attention_widths(attrs: dict) -> tuple[int, int]:
    """(query, output) values per token of an attention node, all heads: MLA's absorbed
    queries span the latent and the rope key, its outputs the latent."""
    heads = int(attrs.get("num_heads", 0))
    if attrs.get("variant") == "mla":
        latent = int(attrs["kv_lora_rank"])
        return heads * (latent + int(attrs["qk_rope_head_dim"])), heads * latent
    return heads * int(attrs.get("head_dim", 0)), heads * int(attrs.get("head_dim", 0))


def elementwise_bytes(n, itemsize: int, hidden: int) -> int:
    """Activation bytes per token that node `n`'s non-GEMM work reads and writes (see
    ELEMENTWISE_PASSES; the attention's K/V part is added per layer from its KV width)."""
    width = n.shape[-1] if n.shape and isinstance(n.shape[-1], int) else hidden
    a, p = n.attrs, ELEMENTWISE_PASSES
    if n.op in ("rmsnorm", "add", "mul", "sigmoid"):
        return p[n.op] * width * itemsize
    if n.op == "host_buffer":
        return p["host_buffer"] * int(a.get("bytes_per_token", 0))
    if n.op == "attention":
        return p["attention_q"] * attention_widths(a)[0] * itemsize
    if n.op == "router":
        return p["router"] * int(a.get("num_experts", 0)) * itemsize
    if n.op == "experts":
        return p["experts"] * int(a["top_k"]) * hidden * itemsize
    if n.op == "mlp":
        return p["mlp"] * int(a["intermediate_size"]) * itemsize
    return 0


def model_cost(graph: Graph) -> ModelCost:
    info = graph.info
    itemsize, H = DTYPE_BYTES[info.dtype], info.hidden_size
    layers = {i: LayerCost(i) for i in range(info.num_layers)}
    stem = head = head_flops = head_elem = head_slot = 0
    inter = 0
    quant: dict[tuple[str, int | None], tuple[int, int]] = {}  # (kind, layer) -> quantized (elements, largest)
    expert_q: dict[int, tuple[int, int]] = {}  # layer -> one expert's quantized (elements, largest)
    cast = sum(w.numel * itemsize for n in graph.nodes for w in n.weights.values()
               if w.format == "dense" and w.dtype != info.dtype and w.dtype in FLOAT_DTYPES)
    for n in graph.nodes:
        if n.module == "stem":
            stem += n.weight_bytes
            continue
        if n.module == "head":
            head += n.weight_bytes
            head_slot += slot_bytes(n, itemsize)
            head_flops += n.flops_per_token
            head_elem += elementwise_bytes(n, itemsize, H)
            _add_quantized(quant, ("head", None), n.weights.values())
            continue
        if n.layer is None:
            continue
        lc = layers[n.layer]
        if n.module is not None and n.module.endswith(".attn"):
            lc.attn_elem_bytes += elementwise_bytes(n, itemsize, H)
            lc.attn_slot_bytes += slot_bytes(n, itemsize)
            lc.attn_dequant_bytes += dequant_bytes(n)
            _add_quantized(quant, ("attn", n.layer), n.weights.values())
        else:
            lc.ffn_elem_bytes += elementwise_bytes(n, itemsize, H)
            if n.op == "experts":
                lc.expert_slot_bytes = _expert_slot_bytes(n, itemsize)
                lc.expert_dequant_bytes = dequant_bytes(n) // max(1, int(n.attrs["num_experts"]))
                expert_q[n.layer] = _largest_expert_quantized(n)
            else:
                lc.ffn_slot_bytes += slot_bytes(n, itemsize)
                lc.ffn_dequant_bytes += dequant_bytes(n)
                _add_quantized(quant, ("ffn", n.layer), n.weights.values())
        if n.op == "host_buffer":
            continue
        if n.op == "kv_load":
            lc.kv_bytes_per_ctx += int(n.attrs["bytes_per_ctx_token"])
        elif n.op == "attention":
            lc.attn_q_width, lc.attn_out_width = attention_widths(n.attrs)
            lc.attn_heads, lc.attn_kv_expanded = int(n.attrs.get("num_heads", 0)), expanded_kv_width(n.attrs)
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
    for lc in layers.values():
        lc.attn_elem_bytes += ELEMENTWISE_PASSES["attention_kv"] * lc.kv_bytes_per_ctx
        lc.attn_dequant_device = dequant_device_bytes(quant.get(("attn", lc.layer), (0, 0)), (0, 0), itemsize)
        lc.ffn_dequant_device = dequant_device_bytes(quant.get(("ffn", lc.layer), (0, 0)),
                                                     expert_q.get(lc.layer, (0, 0)), itemsize)
    return ModelCost(
        dtype=info.dtype, itemsize=itemsize, hidden=H, layers=[layers[i] for i in sorted(layers)],
        stem_bytes=stem, head_bytes=head, head_flops=head_flops, head_elem_bytes=head_elem,
        kv_bytes_per_token=info.kv_bytes_per_token,
        act_bytes_per_token=(2 * H + 3 * inter) * 4, buffer_bytes_per_token=slot_bytes_per_token(graph),
        weight_bytes=graph.weight_bytes, head_dim=info.head_dim, max_context=info.max_position_embeddings,
        head_slot_bytes=head_slot, cast_bytes=cast, vocab=int(info.vocab_size),
        head_dequant_device=dequant_device_bytes(quant.get(("head", None), (0, 0)), (0, 0), itemsize),
    )


def _add_quantized(acc: dict[tuple[str, int | None], tuple[int, int]], key: tuple[str, int | None], weights) -> None:
    """Add the quantized (elements, largest tensor) of `weights` to acc[key]."""
    n, big = _quantized(weights)
    a, b = acc.get(key, (0, 0))
    acc[key] = (a + n, max(b, big))


def _largest_expert_quantized(node) -> tuple[int, int]:
    """(elements, largest tensor) of the quantized weights of the experts node's largest expert."""
    per: dict[int, list] = {}
    for local, w in node.weights.items():
        per.setdefault(int(local.split(".")[0][1:]), []).append(w)
    return max((_quantized(ws) for ws in per.values()), default=(0, 0))


def expanded_kv_width(attrs: dict) -> int:
    """K and V values per context position once widened to every query head (what the math
    attention of a prompt chunk holds): heads x (key + value head dims); latent attention's
    keys span the latent and the rope key, its values the latent."""
    heads = int(attrs.get("num_heads", 0))
    if attrs.get("variant") == "mla":
        latent = int(attrs["kv_lora_rank"])
        return heads * (2 * latent + int(attrs["qk_rope_head_dim"]))
    return heads * 2 * int(attrs.get("head_dim", 0))
