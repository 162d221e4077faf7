"""Each op kind's `attrs` in a plan's schedule, as its own record: what the compiler writes
(moecc/frontend/lowering.py, moecc/passes/) and the runtime reads (worker/, memory/).
`OP_ATTRS[op]` is the record plan_schema.validate checks an op's attrs against: a missing,
unknown or mistyped attr is refused with its path (`plan.schedule[3].ops[1].attrs.eps: missing`).
"""

# no `from __future__ import annotations`: TypedDict reads NotRequired from live annotations
from typing import Any, Literal, NotRequired, TypedDict, Union


class NoAttrs(TypedDict):
    """embed, lm_head, linear, add, mul, sigmoid: nothing beyond inputs and weights."""


class RopeAttrs(TypedDict):
    attention_scaling: float
    rope_type: str  # transformers' rope type (default, yarn, llama3, ...); the table is plan.rope


class RmsnormAttrs(TypedDict):
    eps: float


class GQAAttentionAttrs(TypedDict):
    """Grouped-query (or multi-head) attention with K and V per KV head."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float  # softmax scale
    layer_index: int
    flops_per_ctx_token: int
    qk_norm: NotRequired[Literal["head", "full"]]  # RMS q/k norms per head (Qwen3) or over the projection (OLMoE)
    qk_norm_eps: NotRequired[float]
    clip_qkv: NotRequired[float]  # OLMoE: q, k, v clamped to [-clip, clip]
    sliding_window: NotRequired[int]  # a local-attention layer's window (gpt-oss, Qwen2-MoE)


class MLAAttentionAttrs(TypedDict):
    """Multi-head latent attention (DeepSeek-V2/V3): a compressed latent and a rope key cached."""

    variant: Literal["mla"]
    num_heads: int
    num_kv_heads: int  # 1: the latent
    head_dim: int  # the rope part's
    q_lora_rank: int | None  # None: q projected directly
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scaling: float
    layer_index: int
    rope_interleave: bool  # rotate complex pairs (x0, x1), (x2, x3)... (V2)
    norm_eps: float
    flops_per_ctx_token: int
    sliding_window: NotRequired[int]


class RouterAttrs(TypedDict):
    num_experts: int
    top_k: int
    scoring: Literal["softmax", "topk_softmax", "sigmoid"]
    norm_topk_prob: bool
    weights_in_model_dtype: bool
    fp32_weights: NotRequired[bool]  # DeepSeek: computed in fp32 from the weights as stored
    num_groups: NotRequired[int]
    topk_groups: NotRequired[int]
    topk_method: NotRequired[Literal["greedy", "group_limited_greedy"]]
    routed_scaling_factor: NotRequired[float]


class ExpertsAttrs(TypedDict):
    num_experts: int
    intermediate_size: int
    top_k: int
    act: str  # an activation of the kernels, or "clamped_swiglu" (gpt-oss)
    swiglu_alpha: NotRequired[float]  # clamped_swiglu only
    swiglu_limit: NotRequired[float]
    parts: NotRequired[list[str]]  # the weights of each expert, when not gate/up/down


class MlpAttrs(TypedDict):
    intermediate_size: int
    act: str


class HostBufferAttrs(TypedDict):
    bytes_per_token: int
    slot: NotRequired[int]  # buffers of one slot share storage


class KVLoadAttrs(TypedDict):
    direction: Literal["h2d"]
    bytes_per_ctx_token: int


class KVStoreAttrs(TypedDict):
    direction: Literal["d2h"]
    bytes_per_token: int


# "for" (the op a fetch serves) is a Python keyword: these two records take it by the functional form
FetchWeightsAttrs = TypedDict("FetchWeightsAttrs", {"direction": Literal["h2d"], "bytes": int, "for": str})
FetchExpertsAttrs = TypedDict("FetchExpertsAttrs", {"direction": Literal["h2d"], "bytes_per_expert": int,
                                                    "num_experts": int, "for": str})

#: op -> the record its attrs follow
OP_ATTRS: dict[str, Any] = {
    "embed": NoAttrs, "lm_head": NoAttrs, "linear": NoAttrs, "add": NoAttrs, "mul": NoAttrs, "sigmoid": NoAttrs,
    "rope": RopeAttrs, "rmsnorm": RmsnormAttrs, "attention": Union[GQAAttentionAttrs, MLAAttentionAttrs],
    "router": RouterAttrs, "experts": ExpertsAttrs, "mlp": MlpAttrs, "host_buffer": HostBufferAttrs,
    "fetch_weights": FetchWeightsAttrs, "fetch_experts": FetchExpertsAttrs,
    "kv_load": KVLoadAttrs, "kv_store": KVStoreAttrs,
}
