"""The reasoning block of an assistant turn: `<think>\\n...\\n</think>\\n\\n` before the answer (Qwen3's
convention). A turn written without reasoning carries the empty block, `EMPTY_THINK`, exactly what the
non-thinking generation prompt writes."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EMPTY_THINK = THINK_OPEN + "\n\n" + THINK_CLOSE + "\n\n"


def split_thinking(text: str) -> tuple[str | None, str]:
    """A finished reply -> (reasoning, answer), both stripped: '<think>r</think>a' -> ('r', 'a');
    text without a closed think block -> (None, text) unchanged."""
    head, sep, answer = text.partition(THINK_CLOSE)
    if not sep:
        return None, text
    return head.replace(THINK_OPEN, "").strip(), answer.strip()


def split_partial(text: str) -> tuple[str, str, bool]:
    """A reply that is still growing -> (reasoning so far, answer so far, block closed). The opening
    tag is dropped and the reasoning left-stripped (right-stripped too once closed: trailing white
    space of an open block may be its end); before `</think>` the answer is empty."""
    head, sep, tail = text.partition(THINK_CLOSE)
    reasoning = head.replace(THINK_OPEN, "", 1).lstrip()
    return (reasoning.rstrip(), tail.lstrip(), True) if sep else (reasoning, "", False)


def after_thinking(text: str) -> str:
    """The answer after the last `</think>` (all of `text` when there is none), stripped."""
    return text.rpartition(THINK_CLOSE)[2].strip()
