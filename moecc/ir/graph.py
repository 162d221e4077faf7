"""moecc's module-level graph IR.

The frontend turns each traced decoder layer into `Node`s whose `op` is one of a small
vocabulary (`OPS`) that the runtime implements; passes rewrite the graph (split modules,
insert host buffers and transfers, choose batch sizes) and codegen lowers it to a plan.

Shapes are symbolic tuples: `T` = tokens in flight, `B` = sequences, `k` = experts per
token; integers are concrete sizes from the config. Example: ("T", 4096) is [T, H].
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moecc_runtime.contract.dtypes import FLOAT_DTYPES, ITEMSIZE  # noqa: F401 (FLOAT_DTYPES re-exported)
from moecc_runtime.contract.model_info import ModelInfo  # noqa: F401 (re-exported: the plan's model.info)
from moecc_runtime.plan_schema import TRANSFER_OPS  # re-exported: the plan schema's transfer ops

# op -> what it computes (the runtime implements every compute op here)
OPS: dict[str, str] = {
    "input": "graph input (token ids or positions)",
    "embed": "token embedding lookup",
    "rope": "rotary cos/sin for each token's position",
    "rmsnorm": "RMS normalisation over the last dim",
    "attention": "self-attention with a KV cache (q/k/v/o projections inside)",
    "router": "top-k expert routing: (weights [T,k], index [T,k])",
    "experts": "routed experts, each over the tokens routed to it",
    "mlp": "dense gated MLP (dense layer or shared expert)",
    "linear": "a bare linear projection (e.g. a shared-expert gate)",
    "add": "elementwise add (residual)",
    "mul": "elementwise multiply (broadcasting)",
    "sigmoid": "elementwise sigmoid",
    "lm_head": "final projection to vocabulary logits",
    "output": "graph output",
    # inserted by passes
    "host_buffer": "hidden states of the whole batch gathered in host memory",
    "fetch_weights": "host->device copy of a module's dense weights",
    "fetch_experts": "host->device copy of the experts some token chose",
    "kv_load": "host->device copy of a micro-batch's KV cache",
    "kv_store": "device->host copy of the new K/V of a micro-batch",
}



@dataclass(frozen=True)
class WeightRef:
    """A weight the runtime reads from the checkpoint (a value: immutable, shared by copies).

    `tensor` is the checkpoint tensor name; `index` selects a slice along dim 0 (one expert
    of a fused 3-D tensor), `rows` a row range of that slice (gate or up half of gate_up).
    `shape` is the shape of the referenced piece, after slicing: the shape ops see.

    A weight in a stored format other than "dense" (runtime/formats/: fp8_block, mxfp4,
    int8_channel, int4_group) is its stored tensors, `parts` ("data" first, then scales),
    each a dense WeightRef of the bytes as stored, and the format's `attrs` (block sizes,
    the first row's offset into its scale block); `tensor`/`dtype` are then the data part's.
    """

    tensor: str
    shape: tuple[int, ...]
    dtype: str
    index: int | None = None
    rows: tuple[int, int] | None = None
    format: str = "dense"
    parts: tuple[tuple[str, "WeightRef"], ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()

    @property
    def nbytes(self) -> int:
        """Stored bytes (what host memory holds and a copy moves)."""
        if self.format != "dense":
            return sum(p.nbytes for _, p in self.parts)
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPE_BYTES[self.dtype]

    @property
    def numel(self) -> int:
        """Elements of the weight as ops see it."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def stored(self) -> dict[str, "WeightRef"]:
        """The stored tensors: {"data": self} for a dense weight, else its parts."""
        return {"data": self} if self.format == "dense" else dict(self.parts)

    def describe(self) -> str:
        sel = ""
        if self.index is not None:
            sel += f"[{self.index}]"
        if self.rows is not None:
            sel += f"[{self.rows[0]}:{self.rows[1]}]"
        fmt = "" if self.format == "dense" else f" ({self.format})"
        return f"{self.tensor}{sel}{fmt}"


#: bytes per element of every dtype a checkpoint may hold (the contract's table: contract/dtypes.py)
DTYPE_BYTES: dict[str, int] = ITEMSIZE


@dataclass
class Node:
    """One module-level operation.

    role: what the node is for (embedding, norm, attention, router, experts, shared_expert,
    dense_mlp, gate, residual, glue, lm_head, buffer, transfer, io).
    weights: local name -> WeightRef (experts: "e{i}.gate" / "e{i}.up" / "e{i}.down").
    module: set by split_modules ("L3.attn", "L3.moe", "L3.mlp", "head", "stem").
    """

    name: str
    op: str
    inputs: list[str] = field(default_factory=list)
    role: str = "glue"
    layer: int | None = None
    module: str | None = None
    shape: tuple[Any, ...] = ()
    weights: dict[str, WeightRef] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    flops_per_token: int = 0
    source: str = ""  # provenance: the HF module path or fx node it came from

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())


class Graph:
    """An ordered (topologically sorted) list of nodes plus model facts and properties.

    `properties` records what passes have established ("traced", "modules_split", ...);
    `attrs` holds whole-graph results (batch sizes, the emitted plan).
    """

    def __init__(self, info: ModelInfo, nodes: list[Node] | None = None):
        self.info = info
        self.nodes: list[Node] = list(nodes or [])
        self.properties: set[str] = set()
        self.attrs: dict[str, Any] = {}

    # -- construction -----------------------------------------------------------------
    def add(self, node: Node) -> Node:
        self.nodes.append(node)
        return node

    def copy(self) -> "Graph":
        """An independent graph: nodes, their lists and dicts are new; WeightRefs (immutable)
        are shared. (A deep copy took 8 of the 34 s of compiling DeepSeek-V3's 671B config.)"""
        nodes = [dataclasses.replace(n, inputs=list(n.inputs), weights=dict(n.weights), attrs=copy.deepcopy(n.attrs))
                 for n in self.nodes]
        g = Graph(copy.deepcopy(self.info), nodes)
        g.properties = set(self.properties)
        g.attrs = copy.deepcopy(self.attrs)
        return g

    # -- queries -----------------------------------------------------------------------
    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def modules(self) -> list[str]:
        """Module names in execution order (after split_modules)."""
        seen: dict[str, None] = {}
        for n in self.nodes:
            if n.module is not None:
                seen.setdefault(n.module, None)
        return list(seen)

    @property
    def weight_bytes(self) -> int:
        return sum(n.weight_bytes for n in self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)
