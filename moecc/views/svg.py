"""A few SVG building blocks shared by the graph picture and the timeline: escaped text,
shapes, a document wrapper. Plain strings, no dependencies; every document is well-formed XML.
"""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"


def attr(**kw: object) -> str:
    """key=value attributes (underscores in keys become dashes, a trailing one is dropped:
    class_ -> class), values XML-quoted."""
    return " ".join(f"{k.rstrip('_').replace('_', '-')}={quoteattr(str(v))}" for k, v in kw.items() if v is not None)


def text(x: float, y: float, s: str, size: float = 11, anchor: str = "start", **kw: object) -> str:
    return f"<text {attr(x=f'{x:.1f}', y=f'{y:.1f}', font_size=size, text_anchor=anchor, **kw)}>{escape(s)}</text>"


def title(s: str) -> str:
    """A hover tooltip (and the element's name for tests and tools)."""
    return f"<title>{escape(s)}</title>"


def rect(x: float, y: float, w: float, h: float, fill: str, stroke: str = "#333", rx: float = 0,
         **kw: object) -> str:
    return (f"<rect {attr(x=f'{x:.2f}', y=f'{y:.2f}', width=f'{max(w, 0.0):.2f}', height=f'{h:.2f}', rx=rx, fill=fill, stroke=stroke, **kw)}/>")


def polygon(points: list[tuple[float, float]], fill: str, stroke: str = "#333", **kw: object) -> str:
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return f"<polygon {attr(points=pts, fill=fill, stroke=stroke, **kw)}/>"


def ellipse(cx: float, cy: float, rx: float, ry: float, fill: str, stroke: str = "#333", **kw: object) -> str:
    return f"<ellipse {attr(cx=f'{cx:.1f}', cy=f'{cy:.1f}', rx=f'{rx:.1f}', ry=f'{ry:.1f}', fill=fill, stroke=stroke, **kw)}/>"


def line(x1: float, y1: float, x2: float, y2: float, stroke: str = "#999", **kw: object) -> str:
    return f"<line {attr(x1=f'{x1:.1f}', y1=f'{y1:.1f}', x2=f'{x2:.1f}', y2=f'{y2:.1f}', stroke=stroke, **kw)}/>"


def document(width: float, height: float, body: list[str], heading: str = "") -> str:
    """A standalone SVG document (white background, an arrow marker `#arrow` for edges)."""
    head = (f"<?xml version='1.0' encoding='UTF-8'?>\n"
            f"<svg xmlns='http://www.w3.org/2000/svg' width='{width:.0f}' height='{height:.0f}' "
            f"viewBox='0 0 {width:.0f} {height:.0f}' {FONT}>\n")
    defs = ("<defs><marker id='arrow' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='6' markerHeight='6' "
            "orient='auto-start-reverse'><path d='M 0 0 L 10 5 L 0 10 z' fill='#888'/></marker></defs>\n")
    parts = [head, defs, rect(0, 0, width, height, "white", stroke="none")]
    if heading:
        parts.append(text(12, 20, heading, size=14, font_weight="bold"))
    return "\n".join(parts + body) + "\n</svg>\n"
