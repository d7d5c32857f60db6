"""Source text and spans: every AST and IR node points back at the spec text it came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """A spec's text and the name it is reported under (a path, or '<string>')."""

    text: str
    filename: str = "<string>"

    def line(self, number: int) -> str:
        lines = self.text.splitlines()
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
        return f"{self.filename}:{self.line}:{self.col}"

    @property
    def origin(self) -> str:
        """The `spec.ncd:LINE` tag generated code carries."""
        return f"{self.filename.rsplit('/', 1)[-1]}:{self.line}"

    def to(self, other: Span) -> Span:
        return Span(self.filename, self.line, self.col, other.end_line, other.end_col)


NO_SPAN = Span("<builtin>", 0, 0, 0, 0)
