"""User-facing diagnostics.

Each user mistake has its own class with a message template and a hint saying what to do. Errors print as
`file:line:col: error[code]: message`, then the source line with a caret under the offending text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from .limits import QUOTE_WIDTH, shorten
from .source import Source, Span


def _printable(text: str) -> str:
    """Control and other unprintable characters shown as U+FFFD (one column each, so the caret stays aligned):
    a spec's bytes never reach the terminal as escape sequences."""
    return "".join(c if c.isprintable() or c == "\t" else "\ufffd" for c in text)


def _quote(text: str, span: Span) -> list[str]:
    """The source line and a caret under the span; a line longer than QUOTE_WIDTH is quoted as a window of that
    many characters around the column, '...' marking what is left out."""
    col = max(1, span.col)
    width = span.end_col - span.col if span.end_line == span.line else 1
    start = 0
    if len(text) > QUOTE_WIDTH:
        start = max(0, min(col - 1 - QUOTE_WIDTH // 3, len(text) - QUOTE_WIDTH))
    window = text[start:start + QUOTE_WIDTH]
    before = "... " if start > 0 else ""
    after = " ..." if start + QUOTE_WIDTH < len(text) else ""
    offset = col - 1 - start
    width = max(1, min(width, len(window) - offset))
    # a tab before the column is echoed under it, so the caret lines up in a terminal
    pad = " " * len(before) + "".join(c if c == "\t" else " " for c in window[:offset])
    return [f"    {before}{_printable(window)}{after}", "    " + pad + "^" * width]


class NcdError(Exception):
    """Base of every error ncd reports about a spec (never an internal failure)."""

    code: ClassVar[str] = "error"
    template: ClassVar[str] = "{detail}"
    hint_template: ClassVar[str] = ""
    severity: ClassVar[str] = "error"

    def __init__(self, span: Span | None = None, *, hint: str | None = None, **fields: object) -> None:
        self.span = span
        self.fields = fields
        self.message = self.template.format(**fields)
        self.hint = hint if hint is not None else self.hint_template.format(**fields)
        self.source: Source | None = None
        # args set directly, not through Exception.__init__: torch.compile(fullgraph=True) can then trace a
        # call-time check that raises, and names this error in its report instead of failing on the super() call
        self.args = (self.message,)

    def with_source(self, source: Source) -> NcdError:
        self.source = source
        return self

    def render(self) -> str:
        head = f"{self.span}: " if self.span else ""
        out = [f"{head}{self.severity}[{self.code}]: {shorten(self.message)}"]
        if self.span and self.source is not None and self.span.line > 0:
            out += _quote(self.source.line(self.span.line), self.span)
        if self.hint:
            out.append(f"  = help: {shorten(self.hint)}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()


def _choices(names: Iterable[str]) -> str:
    names = sorted(set(names))
    return ", ".join(names) if names else "(none declared)"


class SpecSyntaxError(NcdError):
    code = "syntax"
    template = "{detail}"


class InvalidIdentifier(NcdError):
    code = "invalid-name"
    template = "'{name}' cannot be used as a name: {reason}"
    hint_template = (
        "names are ASCII letters, digits and '_', start with a letter, and are not Python keywords or builtins"
    )


class DuplicateName(NcdError):
    code = "duplicate-name"
    template = "'{name}' is already declared (as {kind} at line {line})"
    hint_template = "axes, tensors, constants and bases share one namespace; rename one of them"


class UnknownAxis(NcdError):
    code = "unknown-axis"
    template = "unknown axis '{name}'"
    hint_template = "declared axes: {choices}"

    def __init__(self, span: Span | None, *, name: str, choices: Iterable[str]) -> None:
        super().__init__(span, name=name, choices=_choices(choices))


class UnknownName(NcdError):
    code = "unknown-name"
    template = "unknown name '{name}'"
    hint_template = "tensors, constants and axes in scope here: {choices}"

    def __init__(self, span: Span | None, *, name: str, choices: Iterable[str]) -> None:
        super().__init__(span, name=name, choices=_choices(choices))


class UnknownFunction(NcdError):
    code = "unknown-function"
    template = "unknown function '{name}'"
    hint_template = "available: {choices}"

    def __init__(self, span: Span | None, *, name: str, choices: Iterable[str]) -> None:
        super().__init__(span, name=name, choices=_choices(choices))


class UnknownDtype(NcdError):
    code = "unknown-dtype"
    template = "unknown dtype '{name}'"
    hint_template = "use one of: {choices}"

    def __init__(self, span: Span | None, *, name: str, choices: Iterable[str]) -> None:
        super().__init__(span, name=name, choices=_choices(choices))


class ArityError(NcdError):
    code = "arity"
    template = "{name}() takes {expected}, got {got}"


class BadArgument(NcdError):
    code = "bad-argument"
    template = "{name}(): {detail}"


class ContractionAxisMissing(NcdError):
    code = "contraction-axis"
    template = "cannot contract over '{axis}': the {side} operand has axes [{axes}]"
    hint_template = (
        "both sides of `L . R over AXES` must carry every contracted axis; "
        "to sum one side alone use sum(x, over {axis})"
    )


class AxisMismatch(NcdError):
    code = "axis-mismatch"
    template = "{detail}"


class SizeMismatch(NcdError):
    code = "size-mismatch"
    template = "{detail}"


class RankMismatch(NcdError):
    code = "rank-mismatch"
    template = "'{name}' has {expected} axes [{axes}] but is indexed with {got}"


class IndexOutOfRange(NcdError):
    code = "index-range"
    template = "index {index} of '{name}' can reach {value}, outside axis '{axis}' of size {size}"


class TypeMismatch(NcdError):
    code = "type"
    template = "{detail}"


class CyclicDefinition(NcdError):
    code = "cycle"
    template = "'{name}' depends on itself: {cycle}"
    hint_template = (
        "definitions must form a directed acyclic graph; "
        "a state carried along an axis is written with scan(..., over AXIS) and `prev`"
    )


class InvalidStatement(NcdError):
    code = "invalid"
    template = "{detail}"


class NoKernelFamily(NcdError):
    code = "no-kernel-family"
    template = "no kernel family claims spec '{name}', so nothing was compiled or validated"
    hint_template = ("the front-end checks passed; families asked: {families}. `ncd compile --emit ir` prints the "
                     "verified IR of any spec")


class NotStreamable(NcdError):
    code = "not-streamable"
    template = "{detail}"


class CallError(NcdError):
    """Wrong shapes, dtypes or devices at call time: names the tensor and the axis."""

    code = "call"
    template = "{detail}"


class LimitExceeded(NcdError):
    """A spec beyond one of the compiler's limits (ncd/limits.py, docs/language.md "Limits")."""

    code = "limit"
    template = "{detail}"


class NestingTooDeep(NcdError):
    code = "nesting"
    template = "{detail}"
    hint_template = "split the expression into named definitions (docs/language.md, \"Limits\")"


class Warning_(NcdError):
    severity = "warning"


class UnusedInput(Warning_):
    code = "unused"
    template = "{kind} '{name}' is declared but never used"
    hint_template = "remove it, or use it in a definition"
