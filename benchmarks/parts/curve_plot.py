"""The speed / PSNR picture of benchmarks/step_cache_peers.py, drawn with PIL (matplotlib is not installed here):
two panels, speed-up from the measured time (left) and from the share of block runs done (right, a noise-free
measure; diffusers' peers have none), PSNR mean against the exact picture up; each setting a numbered marker,
ours blue, peers' rules run as ours orange, the peers themselves red; the numbers are listed below the panels."""

import math
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"ours": (31, 100, 200), "rule": (230, 130, 20), "peer": (200, 30, 30)}
PANEL_W, PANEL_H, MARGIN = 470, 360, 50
PSNR_RANGE = (20.0, 70.0)  # an exact-equal picture (inf) is drawn at the top


def _panel(draw, left, top, points, title, x_range):
    x0, x1 = x_range
    y0, y1 = PSNR_RANGE
    box = (left + MARGIN, top + 36, left + PANEL_W - 10, top + PANEL_H - 30)
    draw.rectangle(box, outline=(0, 0, 0))
    draw.text((box[0], top + 2), title, fill=(0, 0, 0))

    def at(x, y):
        px = box[0] + (min(max(x, x0), x1) - x0) / (x1 - x0) * (box[2] - box[0])
        py = box[3] - (min(max(y, y0), y1) - y0) / (y1 - y0) * (box[3] - box[1])
        return px, py

    for value in range(int(y0), int(y1) + 1, 10):
        _, py = at(x0, value)
        draw.line((box[0] - 4, py, box[0], py), fill=(0, 0, 0))
        draw.text((box[0] - 30, py - 6), f"{value}", fill=(0, 0, 0))
        if value in (35, 40):
            draw.line((box[0], py, box[2], py), fill=(200, 200, 200))
    for level in (35, 40):
        _, py = at(x0, level)
        draw.line((box[0], py, box[2], py), fill=(190, 190, 190))
    tick, step = x0, 0.5 if x1 - x0 <= 5 else 1.0
    while tick <= x1 + 1e-9:
        px, _ = at(tick, y0)
        draw.line((px, box[3], px, box[3] + 4), fill=(0, 0, 0))
        draw.text((px - 10, box[3] + 6), f"{tick:g}x", fill=(0, 0, 0))
        tick += step
    draw.text((left + 4, top + 18), "PSNR dB vs exact (mean)", fill=(0, 0, 0))
    for number, x, y, kind in points:
        px, py = at(x, y if math.isfinite(y) else y1)
        colour = COLOURS.get(kind, (0, 0, 0))
        draw.ellipse((px - 4, py - 4, px + 4, py + 4), fill=colour)
        draw.text((px + 5, py - 12), str(number), fill=colour)


def draw_curve(summary: list[dict], path: Path, title: str = "") -> None:
    """`summary`: the benchmark's rows of task "all" (setting, kind, psnr_mean, time_ratio, blocks_run); `title`
    goes before each panel's (e.g. the cfg)."""
    timed = [(n + 1, 1 / s["time_ratio"], s["psnr_mean"], s["kind"]) for n, s in enumerate(summary)]
    worked = [(n + 1, 1 / s["blocks_run"], s["psnr_mean"], s["kind"]) for n, s in enumerate(summary)
              if s["blocks_run"]]
    def x_range(points):
        return 0.5, max(3.0, math.ceil(max(x for _, x, _, _ in points) * 2) / 2) if points else 3.0

    legend_h = 14 * math.ceil(len(summary) / 2) + 40
    image = Image.new("RGB", (2 * PANEL_W, PANEL_H + legend_h), "white")
    draw = ImageDraw.Draw(image)
    prefix = f"{title}: " if title else ""
    _panel(draw, 0, 0, timed, prefix + "speed-up, measured time (whole prompt, median)", x_range(timed))
    _panel(draw, PANEL_W, 0, worked, prefix + "speed-up of block work (1 / share of block runs)", x_range(worked))
    y = PANEL_H + 4
    draw.text((10, y), "blue: ours   orange: a peer's rule run as ours   red: the peer itself (diffusers, vs its "
                       "own loop without a cache)   lines: 35 and 40 dB", fill=(0, 0, 0))
    for n, s in enumerate(summary):
        column, line = divmod(n, math.ceil(len(summary) / 2))
        draw.text((10 + column * PANEL_W, y + 18 + 14 * line), f"{n + 1}. {s['setting'][:70]}",
                  fill=COLOURS.get(s["kind"], (0, 0, 0)))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
