"""The diagram graph (diagram.py) laid out left to right and written as SVG (drawsvg), PNG from the SVG (resvg).

Layout (layered, Sugiyama style): each box's column is its longest path from the inputs in networkx's topological
order (outputs in the last column, a constant or position just before its reader); within a column the boxes are
ordered by the mean row of what feeds them, in insertion order among equals, so the picture is the same in every
process. Wires are cubic curves from a box's right side to a port on the target's left side, labelled with their
axes."""

from __future__ import annotations

import networkx as nx

from ncd.drawing.diagram import TENSOR_KINDS

FONT = "DejaVu Sans, Arial, Helvetica, sans-serif"
FONT_SIZE = 12
CHAR = 7.2  # px per character at FONT_SIZE (DejaVu Sans averages 0.6 em)
LINE = 15
COLUMN_GAP, ROW_GAP, MARGIN, HEADER = 120, 34, 24, 58

# (fill, stroke, corner radius) per kind of box
STYLE = {
    "in": ("#dbeafe", "#1d4ed8", 6), "param": ("#ffedd5", "#c2410c", 0), "scalar": ("#f3f4f6", "#6b7280", 6),
    "out": ("#dcfce7", "#15803d", 6), "let": ("#ffffff", "#374151", 6), "op": ("#ffffff", "#6b7280", 12),
    "contract": ("#ffffff", "#111827", 0), "normalize": ("#fef9c3", "#a16207", 4), "reduce": ("#ede9fe", "#6d28d9", 4),
    "basis": ("#e0f2fe", "#0369a1", 4), "scan": ("#f3e8ff", "#7e22ce", 4), "solve": ("#fce7f3", "#be185d", 4),
    "leaf": ("#ffffff", "#d1d5db", 3),
}
STREAMED = "#dc2626"


def _box_size(data: dict) -> tuple[float, float]:
    width = max(len(line) for line in data["lines"]) * CHAR + 18
    if data["kind"] == "contract":
        width += 18  # the cup's bowl
    return width, len(data["lines"]) * LINE + 12


def layout(graph: nx.DiGraph) -> dict[str, tuple[float, float, float, float]]:
    """(center x, center y, width, height) of every box."""
    column: dict[str, int] = {}
    for node in nx.topological_sort(graph):
        column[node] = max((column[p] + 1 for p in graph.predecessors(node)), default=0)
    for node, data in graph.nodes(data=True):  # a constant or a position sits just before what reads it
        if data["kind"] == "leaf" and graph.out_degree(node):
            column[node] = max(0, min(column[s] for s in graph.successors(node)) - 1)
    last = max(column.values(), default=0)
    for node, data in graph.nodes(data=True):
        if data["kind"] == "out" and not graph.out_degree(node):
            column[node] = last
    columns: list[list[str]] = [[] for _ in range(last + 1)]
    for node in graph.nodes:  # (insertion order: tensors first, then each definition's boxes)
        columns[column[node]].append(node)
    rank: dict[str, float] = {}
    for members in columns:  # one barycentre sweep: a box near the boxes that feed it
        members.sort(key=lambda n: sum(rank[p] for p in graph.predecessors(n)) / max(graph.in_degree(n), 1)
                     if graph.in_degree(n) else -1.0)
        rank.update({n: float(i) for i, n in enumerate(members)})
    sizes = {n: _box_size(graph.nodes[n]) for n in graph.nodes}
    pitch = max(h for _, h in sizes.values()) + ROW_GAP
    tallest = max(len(m) for m in columns)
    boxes: dict[str, tuple[float, float, float, float]] = {}
    x = float(MARGIN)
    for members in columns:
        width = max(sizes[n][0] for n in members)
        top = HEADER + MARGIN + (tallest - len(members)) * pitch / 2
        for i, n in enumerate(members):
            boxes[n] = (x + width / 2, top + i * pitch + pitch / 2, *sizes[n])
        x += width + COLUMN_GAP
    return boxes


def to_svg(graph: nx.DiGraph, title: str) -> str:
    """The diagram as SVG text."""
    import drawsvg as draw

    boxes = layout(graph)
    width = max(x + w / 2 for x, _, w, _ in boxes.values()) + MARGIN
    height = max(y + h / 2 for _, y, _, h in boxes.values()) + MARGIN + LINE
    picture = draw.Drawing(round(width), round(height), font_family=FONT, font_size=FONT_SIZE)
    picture.append(draw.Rectangle(0, 0, round(width), round(height), fill="#ffffff"))
    picture.append(draw.Text(title, 15, MARGIN, MARGIN + 4, font_weight="bold"))
    axes = ", ".join(f"{name} = {size}" if size is not None else name for name, size in graph.graph["axes"])
    family = graph.graph.get("family")
    header = f"axes: {axes}" + (f"    compiled by the {family} family" if family else "")
    picture.append(draw.Text(header, FONT_SIZE, MARGIN, MARGIN + 24, fill="#374151"))
    _kernels(picture, graph, boxes)
    _wires(picture, graph, boxes)
    for node, data in graph.nodes(data=True):
        _box(picture, data, boxes[node])
    return picture.as_svg()


def _kernels(picture, graph: nx.DiGraph, boxes: dict) -> None:
    import drawsvg as draw

    for k, label in enumerate(graph.graph.get("kernels", [])):
        members = [boxes[n] for n, d in graph.nodes(data=True) if d.get("kernel") == k]
        if not members:
            continue
        left = min(x - w / 2 for x, _, w, _ in members) - 14
        right = max(x + w / 2 for x, _, w, _ in members) + 14
        top = min(y - h / 2 for _, y, _, h in members) - 26
        bottom = max(y + h / 2 for _, y, _, h in members) + 12
        picture.append(draw.Rectangle(left, top, right - left, bottom - top, rx=10, fill="#f9fafb",
                                      stroke="#9ca3af", stroke_dasharray="6,4"))
        picture.append(draw.Text(f"kernel: {label}", 11, left + 8, top + 14, fill="#4b5563"))


def _wires(picture, graph: nx.DiGraph, boxes: dict) -> None:
    import drawsvg as draw

    for target in graph.nodes:
        incoming = sorted(graph.in_edges(target, data=True), key=lambda e: boxes[e[0]][1])
        tx, ty, tw, th = boxes[target]
        for k, (source, _, data) in enumerate(incoming):
            sx, sy, sw, _ = boxes[source]
            port = ty + (k + 1) * th / (len(incoming) + 1) - th / 2
            x0, x1 = sx + sw / 2, tx - tw / 2
            bend = max((x1 - x0) / 2, 30)
            picture.append(draw.Path(stroke="#4b5563", stroke_width=1.3, fill="none")
                           .M(x0, sy).C(x0 + bend, sy, x1 - bend, port, x1, port))
            text = (f"{data['role']} " if data["role"] else "") + data["label"]
            mid_x, mid_y = (x0 + x1) / 2, (sy + port) / 2 - 4
            picture.append(draw.Text(text, 10, mid_x, mid_y, text_anchor="middle", fill="#1f2937",
                                     stroke="#ffffff", stroke_width=3, paint_order="stroke"))
            if data["broadcast"]:
                picture.append(draw.Text(f"broadcast over {' '.join(data['broadcast'])}", 10, mid_x, mid_y + 12,
                                         text_anchor="middle", fill="#7c3aed", stroke="#ffffff", stroke_width=3,
                                         paint_order="stroke"))


def _box(picture, data: dict, box: tuple[float, float, float, float]) -> None:
    import drawsvg as draw

    x, y, w, h = box
    fill, stroke, radius = STYLE[data["kind"]]
    width = 2.5 if data.get("streamed") else 1.4
    stroke = STREAMED if data.get("streamed") else stroke
    if data["kind"] == "contract":  # a cup: the two wires it joins enter on the left, the bowl closes to the right
        picture.append(draw.Path(stroke=stroke, stroke_width=2, fill="#ffffff")
                       .M(x - w / 2, y - h / 2).L(x + w / 2 - h / 2, y - h / 2)
                       .A(h / 2, h / 2, 0, False, True, x + w / 2 - h / 2, y + h / 2).L(x - w / 2, y + h / 2))
    else:
        dash = "4,3" if data["kind"] == "param" else None
        picture.append(draw.Rectangle(x - w / 2, y - h / 2, w, h, rx=radius, fill=fill, stroke=stroke,
                                      stroke_width=width, stroke_dasharray=dash))
        if data["kind"] == "param":  # a parameter: a second, inner border
            picture.append(draw.Rectangle(x - w / 2 + 3, y - h / 2 + 3, w - 6, h - 6, rx=radius, fill="none",
                                          stroke=stroke, stroke_width=0.8))
    bold = data["kind"] in TENSOR_KINDS
    first = y - h / 2 + 6 + LINE * 0.8
    for i, line in enumerate(data["lines"]):
        picture.append(draw.Text(line, FONT_SIZE, x - (9 if data["kind"] == "contract" else 0), first + i * LINE,
                                 text_anchor="middle", font_weight="bold" if bold and i == 0 else "normal",
                                 fill=STREAMED if data.get("streamed") and i >= len(data["lines"]) - 2 else "#111827"))


def to_png(svg: str, fonts: bool = True) -> bytes:
    """The SVG rasterised (resvg), on white. fonts=False skips the system's fonts: the text is not drawn, so that
    the picture is the same on every machine (the golden test)."""
    import resvg_py

    return bytes(resvg_py.svg_to_bytes(svg_string=svg, background="white", skip_system_fonts=not fonts))
