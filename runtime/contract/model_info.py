"""The config facts every compiler pass and the runtime need, carried by a plan as
`model.info`: one dataclass, which the plan schema validates `model.info` against
(moecc_runtime/plan_schema.py) and the compiler builds (moecc/frontend/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moecc_runtime.contract.dtypes import ITEMSIZE
from moecc_runtime.contract.kv_geometry import kv_geometry


@dataclass
class ModelInfo:
    """A model's shape, dtype and special tokens; `extra`: family-specific facts (mla, hidden_act, ...).
    Not frozen: the frontend settles `dtype` after building it (moecc/frontend/build.py); the
    runtime's copy (PlanView.info) is read only."""

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    dtype: str
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_record(cls, info: dict[str, Any]) -> "ModelInfo":
        """The ModelInfo of a plan's `model.info` record (validated by the schema)."""
        return cls(**info)

    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """(heads, key_dim, value_dim) cached per layer and token (kv_geometry's rule)."""
        return kv_geometry(self.num_kv_heads, self.head_dim, self.extra.get("mla"))

    @property
    def kv_row_bytes(self) -> int:
        """What one layer caches per token: K and V heads, or with multi-head latent attention
        (extra["mla"]) only the compressed latent and the shared rope key."""
        heads, key_dim, value_dim = self.kv_geometry
        return heads * (key_dim + value_dim) * ITEMSIZE[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """The KV cache of one token across all layers, in the model dtype."""
        return self.num_layers * self.kv_row_bytes
