"""Where a workflow's nodes go on the canvas: columns on a 10-pixel grid, no node over another, groups around the
nodes they name.

The builders place each node at a hint, (column, order in it): nodes with the same hinted x form one column,
stacked top to bottom in hinted-y order, each at least `ROW_GAP` below the previous one; a column moves right until
it clears every node of the columns left of it that it would meet. Sizes are at least what ComfyUI's front end draws:
the front end grows a node to its computed size when a workflow loads, so a saved size below it would overlap the
next node (the official_image_edit counterpart once showed *Generate Text* over *Prompt used* that way).
"""

from dataclasses import dataclass

GRID = 10
TITLE = 30        # LiteGraph draws a node's title bar above its pos
COLUMN_GAP = 40
ROW_GAP = 40
GROUP_PAD = 10    # around a group's nodes
GROUP_HEADER = 50  # above them: the group's title bar and some air, as core's templates leave it
GROUP_COLOR = "#3f789e"  # core's templates' group colour

# Heights of what the front end draws, measured in ComfyUI's front end 1.49 (node.computeSize() after loading each
# shipped workflow): 20 per socket row (inputs and outputs side by side), 24 per widget, a multiline text box
# 54 (60 here), and 14 of margins.
SLOT_HEIGHT, WIDGET_HEIGHT, MULTILINE_HEIGHT, MARGIN = 20, 24, 60, 14
#: What the front end adds beyond the schema's widgets: our extension's preset, estimate and report box on the
#: samplers (web/qi21.js, 110 measured), LoadImage's image preview (224), PreviewAny's text box (88).
FRONT_END_EXTRA = {"QI21Sampler": 130, "QI21TurboSampler": 130, "LoadImage": 240, "PreviewAny": 100}


@dataclass
class Group:
    title: str
    nodes: list
    bounding: tuple = ()  # x, y, width, height; set by lay_out


def min_height(spec) -> int:
    """A height at least what the front end computes for a node of this type (notes keep the size they are given:
    the front end scrolls their text)."""
    if not spec.widget_sockets:
        return 0
    widgets = sum(MULTILINE_HEIGHT if w.multiline else WIDGET_HEIGHT for w in spec.widgets)
    widgets += WIDGET_HEIGHT * sum(w.control_after_generate for w in spec.widgets)
    rows = max(len(spec.sockets), len(spec.outputs))
    return MARGIN + SLOT_HEIGHT * rows + widgets + FRONT_END_EXTRA.get(spec.node_type, 0)


def _up(value: float) -> int:
    return int(-(-value // GRID) * GRID)


def rect(pos, size) -> tuple[int, int, int, int]:
    """left, top (title bar included), right, bottom of a node on the canvas."""
    return pos[0], pos[1] - TITLE, pos[0] + size[0], pos[1] + size[1]


def _meet(a, b) -> bool:
    """Whether two rectangles share any area."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def lay_out(nodes: list, groups: list[Group]) -> None:
    """Set every node's pos and size, and every group's bounding (see the module's docstring)."""
    group_of = {id(node): group for group in groups for node in group.nodes}
    for node in nodes:
        node.size = (_up(node.size[0]), _up(max(node.size[1], min_height(node.spec))))
    columns: dict[int, list] = {}
    for node in sorted(nodes, key=lambda n: (n.pos[0], n.pos[1], n.id)):
        columns.setdefault(node.pos[0], []).append(node)
    placed = []
    for x, column in columns.items():
        bottom, previous = None, None
        for node in column:
            top = node.pos[1] - TITLE
            if bottom is not None:
                gap = ROW_GAP
                if group_of.get(id(node)) is not group_of.get(id(previous)):  # leaving one group, entering another
                    gap += GROUP_PAD * (id(previous) in group_of) + GROUP_HEADER * (id(node) in group_of)
                top = max(top, bottom + gap)
            node.pos = (x, _up(top) + TITLE)
            bottom, previous = node.pos[1] + node.size[1], node
        spans = [(n.pos[1] - TITLE - GROUP_HEADER, n.pos[1] + n.size[1] + ROW_GAP) for n in column]
        for other in placed:
            _, top, right, bottom = rect(other.pos, other.size)
            if any(top < high and low < bottom for low, high in spans):
                x = max(x, right + COLUMN_GAP)
        for node in column:
            node.pos = (_up(x), node.pos[1])
        placed += column
    for group in groups:
        rects = [rect(n.pos, n.size) for n in group.nodes]
        left, top = min(r[0] for r in rects) - GROUP_PAD, min(r[1] for r in rects) - GROUP_HEADER
        right, bottom = max(r[2] for r in rects) + GROUP_PAD, max(r[3] for r in rects) + GROUP_PAD
        group.bounding = (left, top, right - left, bottom - top)


def overlaps(nodes: list, groups: list[Group]) -> list[str]:
    """Every pair of nodes that share canvas area, every node inside a group it is not in, every two groups that
    cross: what a layout must not have. Nodes are (name, pos, size) triples; groups (title, bounding, member names)."""
    problems = []
    for i, (name, pos, size) in enumerate(nodes):
        problems += [f"{name} overlaps {other}" for other, p, s in nodes[i + 1:] if _meet(rect(pos, size), rect(p, s))]
    boxes = [(title, (x, y, x + w, y + h), members) for title, (x, y, w, h), members in groups]
    for i, (title, box, members) in enumerate(boxes):
        problems += [f"group {title!r} covers {name}" for name, pos, size in nodes
                     if name not in members and _meet(box, rect(pos, size))]
        problems += [f"group {title!r} crosses group {other!r}" for other, b, _ in boxes[i + 1:] if _meet(box, b)]
    return problems
