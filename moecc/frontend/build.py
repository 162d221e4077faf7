"""The frontend's entry point, `build_graph`: read the checkpoint and its config
(checkpoint.py, config.py), build the model on the meta device, trace every decoder layer
with torch.fx (tracer.py) and lower the traces into moecc's graph (lowering.py).

Needs: a checkpoint directory (config.json; weights optional).
Does: one fx trace per decoder layer with role leaves (see roles.py); glue ops become
`add`/`mul`/`sigmoid`/`linear` nodes, shape-only ops (view, reshape, shape reads) vanish
because the runtime keeps hidden states flat as [T, H].
Guarantees: a graph with property "traced"; every node tagged with role, shape, FLOPs per
token and weight refs by checkpoint tensor name (quantized ones in their stored format);
no weight is materialised. A quantized checkpoint's graph is its unquantized model's.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch

from moecc.frontend.checkpoint import Checkpoint, read_checkpoint
from moecc.frontend.config import load_config, model_info, quantization
from moecc.frontend.dtype_choice import choose_dtype
from moecc.frontend.lowering import lower_head, lower_layer, lower_stem
from moecc.frontend.tracer import trace_layer
from moecc.frontend.weights import WeightResolver
from moecc.ir.graph import Graph


def build_graph(model_dir: str | os.PathLike, dtype: str = "auto", hardware: str | None = None
                ) -> tuple[Graph, Checkpoint]:
    """Read the checkpoint, build the model on meta, trace each layer, return the graph.
    `dtype`: the compute dtype (--dtype; auto: transformers' dtype="auto"), in info.dtype
    with why in info.extra["dtype"]; `hardware`: the profile --dtype fastest reads; weight refs
    keep their stored dtypes."""
    ckpt = read_checkpoint(model_dir)
    config = load_config(ckpt)
    info = model_info(ckpt, config)
    stored = info.dtype  # config-only refs: the release's dtype
    info.dtype, why = choose_dtype(ckpt, config, dtype, hardware)
    info.extra["dtype"] = {"compute": info.dtype, "auto": stored, "why": why}
    model = build_model(config)
    resolver = WeightResolver(ckpt, config.model_type, stored, quantization(ckpt))
    g = Graph(info)
    lower_stem(g, model, config, resolver)
    h = "embed"
    for idx, layer in enumerate(model.model.layers):
        h = lower_layer(g, idx, trace_layer(idx, layer, info), f"model.layers.{idx}", h, resolver, info)
    lower_head(g, model, config, resolver, h, info)
    g.properties.add("traced")
    return g, ckpt


def build_model(config: Any) -> torch.nn.Module:
    """needs: a config load_config returned. guarantees: transformers' model of it on the
    meta device, with the module tree of the unquantized model: a quantization_config is
    taken off a copy first, so no quantizer can swap nn.Linear for its own modules
    (transformers 5's from_config applies none; from_pretrained would). The weights'
    stored formats are the WeightResolver's business, not the graph's."""
    from transformers import AutoModelForCausalLM

    if getattr(config, "quantization_config", None) is not None:
        config = copy.deepcopy(config)
        del config.quantization_config
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config)
