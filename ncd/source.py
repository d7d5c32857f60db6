"""Source text and spans: every AST and IR node points back at the spec text it came from."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

LINE_END = re.compile(r"\r\n|\r|\n")

_UNSAFE_IN_ORIGIN = re.compile(r"[^A-Za-z0-9._-]")
ORIGIN_NAME_MAX = 64


def origin_name(filename: str) -> str:
    """The only form of a spec's file name that may reach generated code (origin comments, docstrings, op ids):
    its basename with every character outside [A-Za-z0-9._-] replaced by '_', at most 64 characters (the middle
    elided). Nothing in it can end a comment or a string literal. '<string>' becomes '_string_'."""
    base = filename.rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1]
    safe = _UNSAFE_IN_ORIGIN.sub("_", base) or "_"
    if len(safe) > ORIGIN_NAME_MAX:
        safe = f"{safe[:40]}...{safe[-(ORIGIN_NAME_MAX - 43):]}"  # keeps the extension
    return safe


def display_name(filename: str) -> str:
    """A file name as messages print it (every span carries it): line breaks, control and format characters and
    undecodable bytes (surrogate escapes) written as Python escapes, so a name can neither fail to print nor
    forge lines or colours on a terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in filename)


@dataclass(frozen=True)
class Source:
    """A spec's text and the name it is reported under (a path, or '<string>')."""

    text: str
    filename: str = "<string>"

    def __post_init__(self) -> None:
        object.__setattr__(self, "filename", display_name(self.filename))

    def lines(self) -> list[str]:
        """The text's lines as the grammar sees them: ended by \\n, \\r\\n or \\r (the parser reads the latter two as
        \\n) and nothing else; `str.splitlines` would also split at \\f, \\v, U+2028 and others."""
        return LINE_END.split(self.text)

    def line(self, number: int) -> str:
        lines = self.lines()
        return lines[number - 1] if 0 < number <= len(lines) else ""


@dataclass(frozen=True)
class Span:
    """A 1-based line/column range; `end_col` is exclusive and on `end_line`."""

    filename: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{display_name(self.filename)}:{self.line}:{self.col}"

    @property
    def origin(self) -> str:
        """The `spec.ncd:LINE` tag generated code carries (the file name sanitised by `origin_name`)."""
        return f"{origin_name(self.filename)}:{self.line}"

    def to(self, other: Span) -> Span:
        return Span(self.filename, self.line, self.col, other.end_line, other.end_col)


NO_SPAN = Span("<builtin>", 0, 0, 0, 0)
