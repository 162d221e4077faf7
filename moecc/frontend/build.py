"""The frontend's entry point, `build_graph`: read the checkpoint and its config
(checkpoint.py, config.py), build the model on the meta device, trace every decoder layer
with torch.fx (tracer.py) and lower the traces into moecc's graph (lowering.py).

Needs: a checkpoint directory (config.json; weights optional).
Does: one fx trace per decoder layer with role leaves (see roles.py); glue ops become
`add`/`mul`/`sigmoid`/`linear` nodes, shape-only ops (view, reshape, shape reads) vanish
because the runtime keeps hidden states flat as [T, H].
Guarantees: a graph with property "traced"; every node tagged with role, shape, FLOPs per
token and weight refs by checkpoint tensor name; no weight is materialised.
"""

from __future__ import annotations

import os
import warnings

import torch

from moecc.frontend.checkpoint import Checkpoint, read_checkpoint
from moecc.frontend.config import load_config, model_info
from moecc.frontend.lowering import lower_head, lower_layer, lower_stem
from moecc.frontend.tracer import trace_layer
from moecc.frontend.weights import WeightResolver
from moecc.ir.graph import Graph


def build_graph(model_dir: str | os.PathLike) -> tuple[Graph, Checkpoint]:
    """Read the checkpoint, build the model on meta, trace each layer, return the graph."""
    ckpt = read_checkpoint(model_dir)
    config = load_config(ckpt)
    info = model_info(ckpt, config)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    resolver = WeightResolver(ckpt, config.model_type, info.dtype)
    g = Graph(info)
    lower_stem(g, model, config, resolver)
    h = "embed"
    for idx, layer in enumerate(model.model.layers):
        h = lower_layer(g, idx, trace_layer(idx, layer, info), f"model.layers.{idx}", h, resolver, info)
    lower_head(g, model, config, resolver, h, info)
    g.properties.add("traced")
    return g, ckpt

