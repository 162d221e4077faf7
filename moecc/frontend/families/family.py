"""What one MoE family is to moecc's frontend: a `Family` record, plain data, no code.

Needs: nothing (no transformers, no torch: the registry is imported by config checks,
weights, quantization and test-checkpoint code alike).
Does: names the family's config.json (model_type, architecture), the fields moecc reads
from it, the tensor-name aliases its published checkpoints use, the quantization methods
only its releases use, the defaults lowering needs where the config is silent, and the
tiny test checkpoint moecc.testing.checkpoints writes for it.
Guarantees: frozen; one instance per family file (moecc/frontend/families/<model_type>.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    """One MoE family (transformers' `model_type`).

    config.json: `architecture` is the causal-LM class config.json names (and that
    transformers builds); `experts` counts the routed experts; `required` integers must be
    present (transformers' defaults count) and never null; `optional` ones may be null;
    `minima` gives the least value of integer fields config_checks' common table lacks;
    `mla`: latent attention (no head_dim of its own); `groups`: when n_group/topk_group
    limit routing ("always", a topk_method, or "").
    Weights: `path_aliases` are (transformers 5 module path fragment, the fragment in
    published checkpoints) pairs tried when a tensor is not found by its own name.
    Quantization: `quant_methods` are the quantization_config methods read for this family
    only (gpt-oss's mxfp4); methods every family reads are not listed.
    Lowering: `rope_interleave` is the rotary pairing of MLA when config has no
    rope_interleave (DeepSeek-V2 rotates complex pairs).
    Tests: `tiny` is the tiny config the test checkpoint is written with (transformers
    config fields; vocabulary and special ids come from the test tokenizer), `layouts` the
    expert layouts its checkpoints are tested in (equivalence, replay), `published` the
    configs under examples/configs/ checked against their model cards' total parameters.
    """

    model_type: str
    architecture: str
    experts: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ("num_key_value_heads", "head_dim")
    minima: Mapping[str, int] = field(default_factory=dict)
    mla: bool = False
    groups: str = ""
    path_aliases: tuple[tuple[str, str], ...] = ()
    quant_methods: tuple[str, ...] = ()
    rope_interleave: bool = False
    tiny: Mapping[str, Any] = field(default_factory=dict)
    layouts: tuple[str, ...] = ("per_expert", "fused")
    published: Mapping[str, float] = field(default_factory=dict)
