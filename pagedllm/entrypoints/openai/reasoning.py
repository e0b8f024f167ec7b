"""``--reasoning-parser``: the ``<think>...</think>`` part of a reasoning model's output becomes
``reasoning_content``, the rest ``content`` (whole responses and streamed deltas)."""
from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def split_reasoning(text: str, finished: bool = True) -> tuple[str | None, str, bool]:
    """(reasoning, content, decided) of the output so far. Reasoning is the text up to
    ``</think>`` when the output starts with ``<think>`` or contains ``</think>``; an output
    that is still a prefix of ``<think>`` is undecided (nothing may be sent yet)."""
    if END in text:
        reasoning, _, content = text.partition(END)
        return reasoning.removeprefix(START), content.lstrip("\n") if content.strip() else content, True
    if text.startswith(START):
        reasoning = text[len(START):]
        if not finished:  # hold back what may be the start of </think>
            for i in range(max(0, len(reasoning) - len(END) + 1), len(reasoning)):
                if END.startswith(reasoning[i:]):
                    return reasoning[:i], "", True
        return reasoning, "", True
    if not finished and START.startswith(text):
        return None, "", False
    return None, text, True
