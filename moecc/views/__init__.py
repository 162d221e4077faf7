"""What draws or explains, reading graphs and plans and changing neither: `explain.py`
(a plan's choices in words), `graph_svg.py` and `timeline_svg.py` (pictures, on `svg.py`),
`onnx_export.py` (the graph as ONNX for Netron)."""
