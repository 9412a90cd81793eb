"""Text from runs, written into report.md literally: names are not markdown.

A run goes by its directory's name, its arm or its swept values, and any of those may hold
characters that markdown reads as structure: ``|`` splits a table row into more cells, ``*``
and ``_`` open emphasis, a trailing ``#`` closes a heading, ``[`` starts a link. Each is
escaped with a backslash (CommonMark: any ASCII punctuation may be); ``_`` only where it could
open or close emphasis (not between two letters or digits, where CommonMark never does),
so ``fp32_reduction`` reads as it is in the raw file too. Line breaks become spaces: a
table row or a heading is one line.
"""

from __future__ import annotations

import re
from typing import Any

# always escaped: \ first of all (an escape must not be undone by a name's own backslash)
SPECIAL = frozenset("\\`*[]<>|~#&$")


def text(value: Any) -> str:
    """``value`` as markdown that renders as exactly its characters (on one line)."""
    s = " ".join(str(value).splitlines())
    out = []
    for i, ch in enumerate(s):
        intraword = 0 < i < len(s) - 1 and s[i - 1].isalnum() and s[i + 1].isalnum()
        out.append("\\" + ch if ch in SPECIAL or (ch == "_" and not intraword) else ch)
    return "".join(out)


def code(value: Any) -> str:
    """``value`` as a code span: a fence longer than any run of backticks inside it, padded
    with a space where the value starts or ends with one (CommonMark strips one each side)."""
    s = " ".join(str(value).splitlines())
    fence = "`" * (max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s[:1] == "`" or s[-1:] == "`" else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def table(rows: list[list[Any]]) -> str:
    """A GitHub-flavoured table: the first row is the header; every cell is plain text."""
    cells = [[text(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
    lines += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    return "\n".join(lines)
