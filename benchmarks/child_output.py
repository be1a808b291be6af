"""What a failed benchmark child process said, kept short but with its cause.

A child that dies on a CUDA device-side assertion prints the same assertion once per GPU thread
(hundreds of lines, differing only in block and thread numbers) *after* its Python traceback, and a
summary made of the output's last lines then holds only those copies: the frame that failed is lost.
:func:`failure_summary` collapses such repeats into one line with a count and keeps the last
traceback whole, so a record of a crash says where it happened; :func:`save_child_output` keeps
the whole output in a file beside the benchmark's ``--out`` for what the summary leaves out.
"""

from __future__ import annotations

import os
import re

#: Numbers that differ between copies of one message (GPU block / thread indices, timestamps).
_NUMBERS = re.compile(r"\d+")


def collapse_repeats(lines: list[str]) -> list[str]:
    """``lines`` with every line that repeats an earlier one up to its numbers dropped, the first of
    each kept with `` [x N]`` appended when it came ``N > 1`` times. Order of first appearance."""
    first: dict[str, str] = {}  # by the line with its numbers masked: its first copy (dicts keep order)
    counts: dict[str, int] = {}
    for line in lines:
        key = _NUMBERS.sub("#", line.strip())
        first.setdefault(key, line)
        counts[key] = counts.get(key, 0) + 1
    return [line + (f" [x {counts[key]}]" if counts[key] > 1 else "") for key, line in first.items()]


def failure_summary(text: str, limit: int = 1500) -> str:
    """One line (`` | ``-joined) of at most ``limit`` characters saying why a child failed: a device-side
    assertion first when there was one (its first copy, counted), then the last Python traceback from
    ``Traceback (most recent call last):`` to the exception and the lines after it, else the output's
    last lines; repeats collapsed (:func:`collapse_repeats`). When that is too long the traceback's
    outer frames go first: the assertion, the traceback's first line, the innermost frames and the exception
    stay."""
    # blank lines and the caret lines under a frame's code (``^^^^``, ``~~~``) say nothing here
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip().strip("^~")]
    asserts = [ln[:300] for ln in collapse_repeats([ln for ln in lines if "Assertion `" in ln])[:2]]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if starts:
        body = lines[starts[-1]:]
        end = next((i for i, ln in enumerate(body) if i > 0 and not ln.startswith((" ", "\t"))), len(body) - 1)
        after = [ln[:300] for ln in collapse_repeats(body[end + 1:]) if "Assertion `" not in ln][:4]
        body = body[:end + 1] + after
    else:
        body = [ln[:300] for ln in collapse_repeats(lines)[-25:] if "Assertion `" not in ln]
    head = " | ".join(asserts)
    joined = " | ".join(body)
    room = limit - len(head) - (3 if head else 0)
    if len(joined) > room:
        cut = "Traceback (most recent call last): | ... " if starts else "... "
        joined = cut + joined[-max(0, room - len(cut)):]
    return f"{head} | {joined}" if head else joined


def save_child_output(out: str | None, mode: str, text: str) -> str | None:
    """Append a child's whole output to ``<out without its extension>.<mode>.log`` (None when the
    benchmark writes no ``--out``); returns that path."""
    if not out or not text:
        return None
    path = f"{os.path.splitext(out)[0]}.{mode}.log"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    return path
