"""Well-formedness checks run after every pass (always in tests).

Base rules hold for every graph; the rest are checked once the property that promises
them is in `graph.properties`. Returns a list of problems (empty = well-formed), each
naming the offending node.
"""

from __future__ import annotations

from moecc.ir.graph import OPS, TRANSFER_OPS, Graph

COMPUTE_WITH_WEIGHTS = frozenset({"embed", "rmsnorm", "attention", "router", "experts", "mlp", "linear", "lm_head"})


def verify_graph(g: Graph) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    nodes = g.by_name()
    for n in g.nodes:
        if n.name in seen:
            problems.append(f"%{n.name}: duplicate node name")
        if n.op not in OPS:
            problems.append(f"%{n.name}: unknown op {n.op!r}")
        for i in n.inputs:
            if i not in seen:
                problems.append(f"%{n.name}: input %{i} is not defined before it")
        if n.op not in ("input", "output") and not n.shape:
            problems.append(f"%{n.name}: no shape")
        if n.op == "experts":
            if len(n.inputs) < 2 or nodes.get(n.inputs[1]) is None or nodes[n.inputs[1]].op != "router":
                problems.append(f"%{n.name}: experts must take (hidden, router) as first inputs")
            parts = n.attrs.get("parts", ("gate", "up", "down"))
            want = {f"e{e}.{p}" for e in range(g.info.num_experts) for p in parts}
            if set(n.weights) != want:
                problems.append(f"%{n.name}: expected {len(want)} expert weights (e0..e{g.info.num_experts - 1} x "
                                f"{', '.join(parts)}), has {len(n.weights)}")
        if n.op == "attention" and n.attrs.get("variant") != "mla" and not {"q", "k", "v", "o"} <= set(n.weights):
            problems.append(f"%{n.name}: attention without q/k/v/o weights")
        if n.op == "attention" and n.attrs.get("variant") == "mla" and not (
                {"kv_a", "kv_b", "o"} <= set(n.weights) and ("q" in n.weights or {"q_a", "q_b"} <= set(n.weights))):
            problems.append(f"%{n.name}: latent attention without q (or q_a, q_b), kv_a, kv_b and o weights")
        seen.add(n.name)
    if g.nodes and g.nodes[-1].op != "output":
        problems.append("graph does not end in an output node")

    if "modules_split" in g.properties:
        problems += _check_modules(g)
    if "host_buffers" in g.properties:
        problems += _check_host_buffers(g)
    if "transfers" in g.properties:
        problems += _check_transfers(g)
    if "batch_sizes" in g.properties:
        problems += _check_batch(g)
    if "plan" in g.properties and "plan" not in g.attrs:
        problems.append("property 'plan' set but graph.attrs has no plan")
    return problems


def _check_modules(g: Graph) -> list[str]:
    out = []
    closed: set[str] = set()
    current = None
    for n in g.nodes:
        if n.op in ("input", "output"):
            continue
        if n.module is None:
            out.append(f"%{n.name}: no module assigned")
            continue
        if n.module != current:
            if n.module in closed:
                out.append(f"%{n.name}: module {n.module} is not contiguous")
            if current is not None:
                closed.add(current)
            current = n.module
    return out


def _check_host_buffers(g: Graph) -> list[str]:
    out = []
    nodes = g.by_name()
    for n in g.nodes:
        if n.op in ("output", "host_buffer") or n.op in TRANSFER_OPS or n.module is None:
            continue
        for i in n.inputs:
            src = nodes[i]
            if src.op in TRANSFER_OPS or src.op in ("input", "host_buffer") or src.module is None:
                continue
            if src.module != n.module:
                out.append(f"%{n.name} ({n.module}) reads %{i} ({src.module}) without a host buffer")
    return out


def _check_transfers(g: Graph) -> list[str]:
    out = []
    nodes = g.by_name()
    for n in g.nodes:
        if n.op in COMPUTE_WITH_WEIGHTS and n.weights:
            fetch = "fetch_experts" if n.op == "experts" else "fetch_weights"
            if not any(nodes[i].op == fetch for i in n.inputs):
                out.append(f"%{n.name}: reads weights but has no {fetch} input")
        if n.op == "attention" and not any(nodes[i].op == "kv_load" for i in n.inputs):
            out.append(f"%{n.name}: attention without a kv_load input")
    return out


def _check_batch(g: Graph) -> list[str]:
    out = []
    batch = g.attrs.get("batch")
    if not isinstance(batch, dict):
        return ["property 'batch_sizes' set but graph.attrs['batch'] is missing"]
    for phase in ("prefill", "decode"):
        sizes = batch.get(phase, {})
        for key in ("B", "b_a", "b_e"):
            v = sizes.get(key)
            if not isinstance(v, int) or v < 1:
                out.append(f"batch[{phase}][{key}] must be a positive int, got {v!r}")
    return out
