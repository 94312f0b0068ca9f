"""The toy model's world: one or two flat shapes on a white, black or transparent 256x256 canvas, their captions,
and edit pairs (recolour, move, remove the background). Drawn with PIL from a seeded `random.Random`, so the
same seed gives the same pictures and words on any machine.

The vocabulary is the whole language the trained toy (demo/train_toy.py) understands; `Scene.caption` and the
edit instructions are its only phrasings besides the variants in `CAPTION_FORMS`.
"""

import random
from dataclasses import dataclass, replace

from PIL import Image, ImageDraw

SIZE = 256  # the smallest reference the VLM takes (65,536 pixels), and the toy's target size
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 205, 40)}
#: position -> (centre x, centre y) in pixels, and how a caption says it
POSITIONS = {"left": (64, 128), "right": (192, 128), "top": (128, 64), "bottom": (128, 192), "center": (128, 128)}
WHERE = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom",
         "center": "in the center"}
SIZES = {"small": 26, "large": 50}  # half-extent in pixels
BACKGROUNDS = {"white": (255, 255, 255, 255), "black": (0, 0, 0, 255), "transparent": (0, 0, 0, 0)}
#: How a single-shape scene may be captioned ({where} is `WHERE[position]`).
CAPTION_FORMS = (
    "a {size} {colour} {shape} {where}, {background} background",
    "{size} {colour} {shape} {where} on a {background} background",
    "a {colour} {shape}, {size}, {where}, {background} background",
)
SUPERSAMPLE = 4  # drawn 4x larger, then downsampled: soft, antialiased edges like a real picture's


@dataclass(frozen=True)
class Item:
    shape: str
    colour: str
    position: str
    size: str
    dx: int = 0  # jitter of the centre, pixels
    dy: int = 0

    @property
    def centre(self) -> tuple[int, int]:
        x, y = POSITIONS[self.position]
        return x + self.dx, y + self.dy


@dataclass(frozen=True)
class Scene:
    items: tuple[Item, ...]
    background: str

    def caption(self, form: int = 0) -> str:
        """The scene in words: `CAPTION_FORMS[form]` for one shape, "a red circle on the left and a blue square on
        the right, white background" for two."""
        if len(self.items) == 1:
            item = self.items[0]
            return CAPTION_FORMS[form].format(size=item.size, colour=item.colour, shape=item.shape,
                                              where=WHERE[item.position], background=self.background)
        parts = [f"a {i.colour} {i.shape} {WHERE[i.position]}" for i in self.items]
        return f"{' and '.join(parts)}, {self.background} background"

    def render(self) -> Image.Image:
        """The scene as a `SIZE x SIZE` RGBA image."""
        big = SIZE * SUPERSAMPLE
        canvas = Image.new("RGBA", (big, big), BACKGROUNDS[self.background])
        draw = ImageDraw.Draw(canvas)
        for item in self.items:
            cx, cy = (c * SUPERSAMPLE for c in item.centre)
            r = SIZES[item.size] * SUPERSAMPLE
            fill = COLOURS[item.colour] + (255,)
            if item.shape == "circle":
                draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
            elif item.shape == "square":
                s = int(r * 0.88)  # a square of the circle's area looks the same size
                draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
            else:
                draw.polygon(((cx, cy - r), (cx - r, cy + int(r * 0.8)), (cx + r, cy + int(r * 0.8))), fill=fill)
        return canvas.resize((SIZE, SIZE), Image.Resampling.LANCZOS)


@dataclass(frozen=True)
class Edit:
    source: Scene
    instruction: str
    target: Scene
    kind: str  # "recolour", "move" or "background"


def random_item(rng: random.Random, position: str | None = None, size: str | None = None) -> Item:
    return Item(shape=rng.choice(SHAPES), colour=rng.choice(list(COLOURS)), position=position or rng.choice(
        list(POSITIONS)), size=size or rng.choice(list(SIZES)), dx=rng.randint(-8, 8), dy=rng.randint(-8, 8))


def random_scene(rng: random.Random, two_shapes: bool = False) -> Scene:
    background = rng.choice(list(BACKGROUNDS))
    if not two_shapes:
        return Scene((random_item(rng),), background)
    first, second = rng.choice((("left", "right"), ("top", "bottom")))
    a = random_item(rng, first, "small")
    b = random_item(rng, second, "small")
    while b.colour == a.colour:
        b = replace(b, colour=rng.choice(list(COLOURS)))
    return Scene((a, b), background)


def random_edit(rng: random.Random, kind: str | None = None) -> Edit:
    """A one-shape source scene, an instruction and the scene it asks for."""
    kind = kind or rng.choice(("recolour", "move", "background"))
    if kind == "background":
        source = Scene((random_item(rng),), rng.choice(("white", "black")))
        return Edit(source, "remove the background", replace(source, background="transparent"), kind)
    source = random_scene(rng)
    item = source.items[0]
    if kind == "recolour":
        colour = rng.choice([c for c in COLOURS if c != item.colour])
        return Edit(source, f"make the {item.shape} {colour}", replace(source, items=(replace(item, colour=colour),)),
                    kind)
    position = rng.choice([p for p in POSITIONS if p != item.position])
    where = "the center" if position == "center" else f"the {position}"
    return Edit(source, f"move it to {where}", replace(source, items=(replace(item, position=position),)), kind)
