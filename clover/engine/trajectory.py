"""Pictures of the order in which tokens were filled: HTML (the text, each token coloured by the
step of its block at which it was filled) or PNG (one row per block, one cell per token: its text
over the step at which it was filled, coloured by that step)."""

from __future__ import annotations

import colorsys
import html
from pathlib import Path

FORMATS = (".html", ".png")


def _rgb(step: int, steps: int) -> tuple[int, int, int]:
    """Early steps blue, late steps red."""
    frac = step / max(steps - 1, 1)
    r, g, b = colorsys.hsv_to_rgb(0.66 * (1 - frac), 0.55, 0.95)
    return int(r * 255), int(g * 255), int(b * 255)


def _steps_per_block(trajectory) -> dict[int, int]:
    steps: dict[int, int] = {}
    for block, step in trajectory:
        steps[block] = max(steps.get(block, 0), step + 1)
    return steps


def filled_in_order(trajectory) -> list[bool]:
    """Per token: True when no earlier position of its block was still masked as it was filled (the
    same step counts as in order). `ar` decoding is all True; a low share means the policy filled blocks
    out of order, in states (later tokens known, earlier ones masked) left-to-right decoding never meets."""
    out, block, latest = [], None, -1
    for b, step in trajectory:
        if b != block:
            block, latest = b, -1
        out.append(latest <= step)
        latest = max(latest, step)
    return out


def write_trajectory(path: str | Path, pieces: list[str], trajectory: list[tuple[int, int]], title: str = "") -> None:
    """`pieces[i]` is the text of generated token i, `trajectory[i]` its (block, step)."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"{path}: trajectory pictures are {' or '.join(FORMATS)}")
    steps = _steps_per_block(trajectory)
    if path.suffix.lower() == ".html":
        spans = []
        for text, (block, step) in zip(pieces, trajectory):
            r, g, b = _rgb(step, steps[block])
            spans.append(f'<span title="block {block}, step {step}" style="background:rgb({r},{g},{b})">'
                         f"{html.escape(text)}</span>")
        path.write_text(f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title>"
                        f"<h3>{html.escape(title)}</h3><p>colour = step within the block (blue first, red last); "
                        f"hover a token for its block and step</p>"
                        f"<pre style='white-space:pre-wrap;font-size:15px'>{''.join(spans)}</pre>\n")
        return
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    shown = [text.replace("\n", "\\n") or " " for text in pieces]
    widths = [max(18, int(measure.textlength(text, font=font)) + 6) for text in shown]
    rows = sorted(steps)
    row_width: dict[int, int] = {}
    for (block, _), w in zip(trajectory, widths):
        row_width[block] = row_width.get(block, 0) + w
    height = 30
    image = Image.new("RGB", (max(row_width.values(), default=18) + 1, height * max(len(rows), 1) + 1), "white")
    draw = ImageDraw.Draw(image)
    x_of: dict[int, int] = {}
    for text, (block, step), w in zip(shown, trajectory, widths):
        x, y = x_of.get(block, 0), rows.index(block) * height
        x_of[block] = x + w
        draw.rectangle([x, y, x + w, y + height], fill=_rgb(step, steps[block]), outline="white")
        draw.text((x + 3, y + 3), text, fill="black", font=font)
        draw.text((x + 3, y + 16), str(step), fill=(60, 60, 60), font=font)
    image.save(path)
