"""The IR core: the graph (`graph.py`), the pass infrastructure (`pass_infra.py`), the
well-formedness verifier (`verify.py`) and the text printer (`printer.py`).

Re-exports the public names of `graph.py`, so `from moecc.ir import Graph, Node` works."""

from moecc.ir.graph import DTYPE_BYTES, FLOAT_DTYPES, OPS, TRANSFER_OPS, Graph, ModelInfo, Node, WeightRef

__all__ = ["DTYPE_BYTES", "FLOAT_DTYPES", "OPS", "TRANSFER_OPS", "Graph", "ModelInfo", "Node", "WeightRef"]
