"""The lowering table: fx nodes of a traced layer -> moecc graph nodes (`lower_layer`),
plus the stem (embedding, rotary table) and the head (final norm, lm_head).

Needs: a layer's fx trace (tracer.py), the model's facts and a WeightResolver.
Does: role modules become their op (rmsnorm, attention or MLA, router, experts, mlp,
linear) with weights by checkpoint tensor name (Linear layers' marked `linear`: the only
weights a quantized checkpoint stores quantized) and FLOPs per token; glue becomes
add/mul/sigmoid; shape-only ops vanish (rows stay flat as [T, H]).
Guarantees: nodes appended in execution order; anything else fails with a FrontendError
or UnsupportedModelError naming the layer and the op.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from moecc.errors import FrontendError, UnsupportedModelError
from moecc.frontend.families import family
from moecc.frontend.roles import classify, norm_eps
from moecc.frontend.weights import WeightResolver
from moecc.ir.graph import Graph, ModelInfo, Node


def lower_stem(g: Graph, model: nn.Module, config, r: WeightResolver) -> None:
    """Token ids and positions in; the embedding and the rotary table (real, tiny tensors)."""
    info = g.info
    H, V = info.hidden_size, info.vocab_size
    g.add(Node("input_ids", "input", role="io", shape=("T",)))
    g.add(Node("positions", "input", role="io", shape=("T",)))
    g.add(Node("embed", "embed", ["input_ids"], role="embedding", shape=("T", H),
               weights={"weight": r.tensor("model.embed_tokens.weight", (V, H))},
               source="model.embed_tokens"))
    rotary = type(model.model.rotary_emb)(config=config)  # real (tiny) tensors, not meta
    inv_freq = rotary.inv_freq.float().tolist()
    g.add(Node("rope", "rope", ["positions"], role="rotary", shape=("T", info.head_dim),
               attrs={"inv_freq": inv_freq, "attention_scaling": float(rotary.attention_scaling),
                      "rope_type": rotary.rope_type},
               source="model.rotary_emb"))


def lower_head(g: Graph, model: nn.Module, config, r: WeightResolver, h: str, info: ModelInfo) -> None:
    """The final norm over hidden state `h`, the lm_head (tied or its own) and the output."""
    H, V = info.hidden_size, info.vocab_size
    g.add(Node("final_norm", "rmsnorm", [h], role="norm", shape=("T", H),
               weights={"weight": r.tensor("model.norm.weight", (H,))},
               attrs={"eps": norm_eps(model.model.norm)}, flops_per_token=4 * H, source="model.norm"))
    tied = info.extra["tie_word_embeddings"]
    lm = r.tensor("model.embed_tokens.weight", (V, H)) if tied else r.tensor(
        "lm_head.weight", (V, H), fallback="model.embed_tokens.weight")
    g.add(Node("lm_head", "lm_head", ["final_norm"], role="lm_head", shape=("T", V),
               weights={"weight": lm}, flops_per_token=2 * H * V, source="lm_head"))
    g.add(Node("logits", "output", ["lm_head"], role="io"))


@dataclass
class _Ref:
    """What an fx value stands for while lowering."""

    kind: str  # "node" | "tuple" | "field" | "meta" | "none"
    name: str | None = None  # IR node name (node/tuple/field)
    field: int | None = None  # which element of a tuple-valued node ("field")


def lower_layer(g: Graph, idx: int, gm: torch.fx.GraphModule, prefix: str, h_in: str,
                r: WeightResolver, info: ModelInfo) -> str:
    """Append decoder layer `idx`'s nodes (from its fx trace `gm`) reading hidden state
    `h_in`; return the name of the layer's output."""
    modules = dict(gm.named_modules())
    env: dict[torch.fx.Node, _Ref] = {}
    out_name: str | None = None
    H = info.hidden_size
    pre = f"l{idx}."

    def ref(x: Any, fx_node: torch.fx.Node) -> _Ref:
        if isinstance(x, torch.fx.Node):
            return env[x]
        if x is None:
            return _Ref("none")
        raise FrontendError(idx, fx_node.name, f"unexpected constant argument {x!r}")

    def tensor_input(x: Any, fx_node: torch.fx.Node) -> str:
        rf = ref(x, fx_node)
        if rf.kind != "node":
            raise FrontendError(idx, fx_node.name, f"expected a tensor input, got {rf.kind} ({x})")
        return rf.name  # type: ignore[return-value]

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = _Ref("node", h_in) if n.target == "h" else _Ref("node", "rope")
        elif n.op == "output":
            out_name = tensor_input(n.args[0], n)
        elif n.op == "call_module":
            path = str(n.target).removeprefix("layer.")
            mod = modules[str(n.target)]
            env[n] = _lower_module(g, idx, pre + path.replace(".", "_"), f"{prefix}.{path}", mod,
                                   n, tensor_input, env, r, info)
        elif n.op in ("call_function", "call_method"):
            env[n] = _lower_glue(g, idx, pre, n, env, tensor_input, H)
        elif n.op == "get_attr":
            raise FrontendError(idx, n.name, f"reads parameter {n.target} outside a role module; "
                                f"moecc cannot place it (supported roles: experts, attention, mlp, router, norm)")
    assert out_name is not None
    return out_name



def _lower_module(g: Graph, idx: int, name: str, path: str, mod: nn.Module, n: torch.fx.Node,
                  tensor_input, env, r: WeightResolver, info: ModelInfo) -> _Ref:
    role = classify(mod)
    H = info.hidden_size
    args = list(n.args) + [v for k, v in n.kwargs.items() if k in ("hidden_states", "x", "input")]
    if role == "norm":
        dim = mod.weight.shape[0]
        g.add(Node(name, "rmsnorm", [tensor_input(args[0], n)], role="norm", layer=idx, shape=("T", dim),
                   weights={"weight": r.tensor(f"{path}.weight", (dim,))}, attrs={"eps": norm_eps(mod)},
                   flops_per_token=4 * dim, source=path))
        return _Ref("node", name)
    if role == "attention":
        return _lower_attention(g, idx, name, path, mod, n, tensor_input, r, info)
    if role == "router":
        E, k = mod.weight.shape[0], int(mod.top_k)
        norm = bool(getattr(mod, "norm_topk_prob", True))
        weights = {"weight": r.tensor(f"{path}.weight", (E, H))}
        # DeepSeek's routers (below) compute in fp32 from their weights as stored, which
        # transformers keeps in fp32 (_keep_in_fp32_modules_strict): `fp32_weights` tells the
        # runtime not to cast them to the compute dtype first
        attrs: dict[str, Any] = {"num_experts": E, "top_k": k, "scoring": "softmax", "norm_topk_prob": norm,
                                 "weights_in_model_dtype": _router_casts_weights(mod, H)}
        if isinstance(getattr(mod, "bias", None), nn.Parameter):  # gpt-oss: biased logits, softmax over the top k
            weights["bias"] = r.tensor(f"{path}.bias", (E,))
            attrs.update(scoring="topk_softmax", norm_topk_prob=True)
        elif hasattr(mod, "e_score_correction_bias"):  # DeepSeek-V3: sigmoid scores, group-limited top-k
            weights["bias"] = r.tensor(f"{path}.e_score_correction_bias", (E,))
            attrs.update(scoring="sigmoid", num_groups=int(mod.num_group), topk_groups=int(mod.topk_group),
                         routed_scaling_factor=float(mod.routed_scaling_factor), fp32_weights=True)
        elif hasattr(mod, "topk_method"):  # DeepSeek-V2: softmax, greedy or group-limited, scaled, not renormalised
            if mod.topk_method not in ("greedy", "group_limited_greedy"):
                raise UnsupportedModelError(f"{path}: router topk_method {mod.topk_method!r} is not supported "
                                            f"(supported: greedy, group_limited_greedy)")
            attrs.update(topk_method=mod.topk_method, num_groups=int(mod.num_group or 1),
                         topk_groups=int(mod.topk_group or 1), routed_scaling_factor=float(mod.routed_scaling_factor),
                         norm_topk_prob=False, weights_in_model_dtype=False, fp32_weights=True)
        g.add(Node(name, "router", [tensor_input(args[0], n)], role="router", layer=idx, shape=("T", k),
                   weights=weights, attrs=attrs, flops_per_token=2 * H * E, source=path))
        return _Ref("tuple", name)
    if role == "experts":
        router_name = _router_of(n, env)
        if router_name is None:
            raise FrontendError(idx, n.name, "experts must be called as experts(hidden, top_k_index, "
                                "top_k_weights) with both coming from the layer's router")
        if hasattr(mod, "gate_up_proj_bias"):  # gpt-oss: [E, H, 2I] interleaved gate/up, biases, clamped SwiGLU
            E, _, I2 = mod.gate_up_proj.shape
            inter = I2 // 2
            weights = r.experts_with_bias(path, E, H, inter)
            attrs = {"num_experts": E, "intermediate_size": inter, "top_k": info.top_k, "act": "clamped_swiglu",
                     "swiglu_alpha": float(mod.alpha), "swiglu_limit": float(mod.limit),
                     "parts": ["gate_up", "gate_up_bias", "down", "down_bias"]}
        else:
            E, I2, _ = mod.gate_up_proj.shape
            inter = I2 // 2
            weights = r.experts(path, E, H, inter)
            attrs = {"num_experts": E, "intermediate_size": inter, "top_k": info.top_k,
                     "act": info.extra["hidden_act"]}
        g.add(Node(name, "experts", [tensor_input(n.args[0], n), router_name], role="experts", layer=idx,
                   shape=("T", H), weights=weights, attrs=attrs,
                   flops_per_token=info.top_k * 6 * H * inter, source=path))
        return _Ref("node", name)
    if role == "mlp":
        inter = mod.gate_proj.out_features
        g.add(Node(name, "mlp", [tensor_input(args[0], n)], role="mlp", layer=idx, shape=("T", H),
                   weights={"gate": r.tensor(f"{path}.gate_proj.weight", (inter, H), linear=True),
                            "up": r.tensor(f"{path}.up_proj.weight", (inter, H), linear=True),
                            "down": r.tensor(f"{path}.down_proj.weight", (H, inter), linear=True)},
                   attrs={"intermediate_size": inter, "act": info.extra["hidden_act"]},
                   flops_per_token=6 * H * inter, source=path))
        return _Ref("node", name)
    if isinstance(mod, nn.Linear):
        w = {"weight": r.tensor(f"{path}.weight", (mod.out_features, mod.in_features), linear=True)}
        if mod.bias is not None:
            w["bias"] = r.tensor(f"{path}.bias", (mod.out_features,))
        g.add(Node(name, "linear", [tensor_input(args[0], n)], role="gate", layer=idx,
                   shape=("T", mod.out_features), weights=w,
                   flops_per_token=2 * mod.in_features * mod.out_features, source=path))
        return _Ref("node", name)
    raise FrontendError(idx, n.name, f"module {path} ({type(mod).__name__}) has no moecc role")


_ROUTER_CASTS: dict[tuple[type, int], bool] = {}


def _router_casts_weights(mod: nn.Module, hidden: int) -> bool:
    """Whether the router returns its top-k weights in the model dtype (Qwen) or in fp32
    (Mixtral): run a CPU copy of it (an [E, H] weight, always small) on a bf16 row.
    Probed once per router class and width, not once per layer."""
    key = (type(mod), hidden)
    if key not in _ROUTER_CASTS:
        _ROUTER_CASTS[key] = _probe_router(mod, hidden)
    return _ROUTER_CASTS[key]


def _probe_router(mod: nn.Module, hidden: int) -> bool:
    import copy

    probe = copy.deepcopy(mod).to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in probe.parameters():
            p.zero_()
        out = probe(torch.zeros(1, hidden, dtype=torch.bfloat16))
    return out[1].dtype == torch.bfloat16


def _router_of(n: torch.fx.Node, env) -> str | None:
    """The router node feeding experts(hidden, index, weights), if both come from one router."""
    fields = []
    for a in n.args[1:3]:
        rf = env.get(a) if isinstance(a, torch.fx.Node) else None
        if rf is None or rf.kind != "field":
            return None
        fields.append((rf.name, rf.field))
    (r1, f1), (r2, f2) = fields
    return r1 if r1 == r2 and (f1, f2) == (2, 1) else None


def _lower_mla(g: Graph, idx: int, name: str, path: str, mod: nn.Module, n: torch.fx.Node,
               tensor_input, r: WeightResolver, info: ModelInfo) -> _Ref:
    """Multi-head latent attention: the cache holds, per token and layer, the normed latent
    (kv_lora_rank) and the shared rope key (qk_rope_head_dim); decode absorbs kv_b_proj into
    the query and the output, so attention reads only the latent (FLOPs counted that way)."""
    H = info.hidden_size
    hidden = n.kwargs.get("hidden_states", n.args[0] if n.args else None)
    m = info.extra["mla"]
    nh, ql, kl = info.num_heads, m["q_lora_rank"], m["kv_lora_rank"]
    nope, rope, vd = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
    qk = nope + rope
    w = {}
    lin = {"kv_a": ("kv_a_proj_with_mqa", (kl + rope, H)), "kv_b": ("kv_b_proj", (nh * (nope + vd), kl)),
           "o": ("o_proj", (H, nh * vd))}
    if ql:
        lin.update(q_a=("q_a_proj", (ql, H)), q_b=("q_b_proj", (nh * qk, ql)))
        w["q_a_norm"] = r.tensor(f"{path}.q_a_layernorm.weight", (ql,))
    else:
        lin["q"] = ("q_proj", (nh * qk, H))
    for key, (attr, shape) in lin.items():
        w[key] = r.tensor(f"{path}.{attr}.weight", shape, linear=True)
        if getattr(mod, attr).bias is not None:
            w[f"{key}_bias"] = r.tensor(f"{path}.{attr}.bias", (shape[0],))
    w["kv_a_norm"] = r.tensor(f"{path}.kv_a_layernorm.weight", (kl,))
    attrs: dict[str, Any] = {"variant": "mla", "num_heads": nh, "q_lora_rank": ql, "kv_lora_rank": kl,
                             "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": vd,
                             "head_dim": rope, "num_kv_heads": 1, "scaling": float(mod.scaling),
                             # V2 rotates complex pairs (x0, x1), (x2, x3)...: V3's rope_interleave
                             "layer_index": idx, "rope_interleave": _rope_interleave(mod, info),
                             "norm_eps": norm_eps(mod.kv_a_layernorm),
                             # absorbed decode: scores over latent + rope key, values in the latent
                             "flops_per_ctx_token": 2 * nh * (kl + rope) + 2 * nh * kl}
    q_flops = 2 * (H * ql + ql * nh * qk) if ql else 2 * H * nh * qk
    flops = q_flops + 2 * H * (kl + rope) + 2 * nh * nope * kl + 2 * nh * kl * vd + 2 * nh * vd * H
    g.add(Node(name, "attention", [tensor_input(hidden, n), "rope"], role="attention", layer=idx,
               shape=("T", H), weights=w, attrs=attrs, flops_per_token=flops, source=path))
    return _Ref("tuple", name)


def _rope_interleave(mod: nn.Module, info: ModelInfo) -> bool:
    """MLA's rotary pairing: config's rope_interleave, else the family's default
    (moecc/frontend/families/: DeepSeek-V2 rotates complex pairs)."""
    fam = family(info.model_type)
    return bool(getattr(mod.config, "rope_interleave", fam is not None and fam.rope_interleave))


def _lower_attention(g: Graph, idx: int, name: str, path: str, mod: nn.Module, n: torch.fx.Node,
                     tensor_input, r: WeightResolver, info: ModelInfo) -> _Ref:
    if hasattr(mod, "kv_b_proj"):
        return _lower_mla(g, idx, name, path, mod, n, tensor_input, r, info)
    H = info.hidden_size
    hidden = n.kwargs.get("hidden_states", n.args[0] if n.args else None)
    nq, nkv, hd = info.num_heads, info.num_kv_heads, mod.head_dim
    w = {}
    for key, out_dim, in_dim in (("q", nq * hd, H), ("k", nkv * hd, H), ("v", nkv * hd, H), ("o", H, nq * hd)):
        lin = getattr(mod, f"{key}_proj")
        w[key] = r.tensor(f"{path}.{key}_proj.weight", (out_dim, in_dim), linear=True)
        if lin.bias is not None:
            w[f"{key}_bias"] = r.tensor(f"{path}.{key}_proj.bias", (out_dim,))
    attrs: dict[str, Any] = {"num_heads": nq, "num_kv_heads": nkv, "head_dim": hd,
                             "scaling": float(mod.scaling), "layer_index": idx,
                             "flops_per_ctx_token": 4 * nq * hd}
    for qk, heads in (("q_norm", nq), ("k_norm", nkv)):
        sub = getattr(mod, qk, None)
        if sub is not None:  # per head (Qwen3) or over the whole projection (OLMoE)
            width = sub.weight.shape[0] if classify(sub) == "norm" else None
            if width not in (hd, heads * hd):
                raise UnsupportedModelError(f"{path}.{qk}: only RMS q/k norms per head ({hd}) or over the whole "
                                            f"projection ({heads * hd}) are supported, not {type(sub).__name__}")
            w[qk] = r.tensor(f"{path}.{qk}.weight", (width,))
            attrs["qk_norm_eps"] = norm_eps(sub)
            # one mode for both: "full" when either norm spans more than one head (OLMoE with
            # one KV head has a k norm of one head's width, yet over the whole projection)
            full = width != hd or attrs.get("qk_norm") == "full"
            attrs["qk_norm"] = "full" if full else "head"
    clip = getattr(mod.config, "clip_qkv", None)
    if clip is not None:
        attrs["clip_qkv"] = float(clip)
    if hasattr(mod, "sliding_window"):  # per layer (gpt-oss, Qwen2-MoE: None on full-attention layers)
        window = mod.sliding_window
    else:
        window = getattr(mod.config, "sliding_window", None)
    sinks = getattr(mod, "sinks", None)
    if isinstance(sinks, nn.Parameter):  # gpt-oss: one extra softmax logit per query head
        w["sinks"] = r.tensor(f"{path}.sinks", (nq,))
    if window:
        attrs["sliding_window"] = int(window)
    flops = 2 * H * (nq + 2 * nkv) * hd + 2 * nq * hd * H
    g.add(Node(name, "attention", [tensor_input(hidden, n), "rope"], role="attention", layer=idx,
               shape=("T", H), weights=w, attrs=attrs, flops_per_token=flops, source=path))
    return _Ref("tuple", name)


_SHAPE_ONLY_METHODS = {"view", "reshape", "contiguous", "to", "float", "flatten"}
_ADD = {operator.add, torch.add, operator.iadd}
_MUL = {operator.mul, torch.mul, operator.imul}
_SIGMOID = {torch.sigmoid, torch.nn.functional.sigmoid}


def _lower_glue(g: Graph, idx: int, pre: str, n: torch.fx.Node, env, tensor_input, H: int) -> _Ref:
    t = n.target
    if n.op == "call_function" and t is getattr:
        return _Ref("meta")
    if n.op == "call_function" and t is operator.getitem:
        base = env[n.args[0]]
        if base.kind == "meta":
            return _Ref("meta")
        if base.kind == "tuple" and isinstance(n.args[1], int):
            src = g.node(base.name)
            if src.op == "attention":
                return _Ref("node", base.name) if n.args[1] == 0 else _Ref("none")
            return _Ref("field", base.name, field=n.args[1])
        raise FrontendError(idx, n.name, f"unsupported indexing of {base.kind} value")
    if n.op == "call_method" and t in _SHAPE_ONLY_METHODS:
        return env[n.args[0]]
    name = pre + n.name
    if t in _ADD or (n.op == "call_method" and t == "add"):
        a, b = (tensor_input(x, n) for x in n.args[:2])
        g.add(Node(name, "add", [a, b], role="residual", layer=idx, shape=("T", H), flops_per_token=H))
        return _Ref("node", name)
    if t in _MUL or (n.op == "call_method" and t == "mul"):
        a, b = (tensor_input(x, n) for x in n.args[:2])
        g.add(Node(name, "mul", [a, b], role="glue", layer=idx, shape=("T", H), flops_per_token=H))
        return _Ref("node", name)
    if t in _SIGMOID or (n.op == "call_method" and t == "sigmoid"):
        a = tensor_input(n.args[0], n)
        g.add(Node(name, "sigmoid", [a], role="glue", layer=idx, shape=g.node(a).shape, flops_per_token=4))
        return _Ref("node", name)
    what = getattr(t, "__name__", str(t))
    raise FrontendError(idx, n.name, f"unsupported operation {n.op} {what}; moecc lowers add, mul, "
                        f"sigmoid and shape-only ops (view, reshape, contiguous) between role modules")

