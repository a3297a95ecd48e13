"""Error messages as one readable line, for logs, reports and events.

Imports nothing heavy (no torch): the node agent, which never imports torch,
uses it for its workers' exit messages too.
"""

from __future__ import annotations

import re

#: What torch puts before an error that went through a future's ``then`` callback
#: (DDP's hooks chain one or two): said once in a log line is enough.
_CALLBACK_WRAPPER = "Got the following error when running the callback: "


def one_line(e: BaseException | str, limit: int = 200) -> str:
    """The first line of an error's message (its type name when it has none), in whole words.

    A line longer than ``limit`` characters keeps its whole sentences that
    fit (when they are at least half of it), else the words that fit and an
    ellipsis: it never ends in the middle of a word.  ``e`` may also be text
    already taken from an error (a worker's last line, an error file).  For
    display only; nothing is decided from the words.
    """
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else ("" if isinstance(e, str) else type(e).__name__)
    while text.startswith(_CALLBACK_WRAPPER):
        text = text.removeprefix(_CALLBACK_WRAPPER).removeprefix("RuntimeError: ")
    if len(text) <= limit:
        return text
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", text[: limit + 1])]
    if ends and ends[-1] >= limit // 2:
        return text[: ends[-1]]
    cut = text[: limit - 1]
    words = cut.rsplit(" ", 1)[0] if " " in cut else cut
    return words.rstrip(" ,;:") + "…"
