"""Spec text -> `ncd.ast.Module`. Lark's exceptions become `SpecSyntaxError`s with a location and
what was expected there."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import lark
from lark import Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from . import ast
from .errors import NcdError, NestingTooDeep, SpecSyntaxError
from .grammar import grammar_text
from .limits import MAX_INTEGER_DIGITS, MAX_NESTING, shorten
from .source import Source, Span


class _Newlines:
    """Post-lexer: newlines inside () and [] continue the line; runs of newlines collapse to one;
    a final newline is always present so the last statement needs none."""

    always_accept = ("_NL",)

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        # Tokens go out as they come: the contextual lexer lexes each token in the parser state the
        # previous one left, so nothing may be held back.
        depth = 0
        last: Token | None = None
        for tok in stream:
            if tok.type == "_NL" and (depth > 0 or last is None or last.type == "_NL"):
                continue
            if tok.type in ("LPAR", "LSQB"):
                depth += 1
            elif tok.type in ("RPAR", "RSQB"):
                depth = max(0, depth - 1)
            last = tok
            yield tok
        if last is not None and last.type != "_NL":  # placed just after the last token: the end of the text
            yield Token("_NL", "\n", last.end_pos, last.end_line, last.end_column, last.end_line,
                        last.end_column, last.end_pos)


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(
        grammar_text(), parser="lalr", lexer="contextual", postlex=_Newlines(), propagate_positions=True
    )


_FRIENDLY = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "_NL": "end of line",
    "$END": "end of file",
    "FUNC_HEAD": "an inline function such as `a1(x) =`",
    "COMPARE": "a comparison",
    "_OVER": "'over'",
    "_FOR": "'for'",
    "_AND": "'and'",
    "_OR": "'or'",
    "_NOT": "'not'",
}


def _describe_expected(expected: set[str]) -> str:
    parser = _parser()
    words = set()
    for name in expected:
        if name in _FRIENDLY:
            words.add(_FRIENDLY[name])
            continue
        try:
            pattern = parser.get_terminal(name).pattern
        except KeyError:
            words.add(name.lower())
            continue
        words.add(f"'{pattern.value}'" if isinstance(pattern, lark.lexer.PatternStr) else name.lower())
    ordered = sorted(words, key=lambda w: (not w.startswith("'"), w))
    if len(ordered) > 10:
        ordered = [*ordered[:10], "..."]
    return ", ".join(ordered)


def _token_text(tok: Token, source: Source) -> str:
    if tok.type == "$END" or (tok.type == "_NL" and (tok.start_pos or 0) >= len(source.text.rstrip())):
        return "end of file"
    if tok.type == "_NL":
        return "end of line"
    return f"'{shorten(str(tok.value), 40)}'"


def _syntax_error(err: UnexpectedInput, source: Source) -> SpecSyntaxError:
    line = getattr(err, "line", None) or 1
    col = getattr(err, "column", None) or 1
    if isinstance(err, UnexpectedToken):
        tok = err.token
        if tok.type == "$END" or tok.line is None:
            line, col = _end_of(source)
        else:
            line, col = tok.line, tok.column
        width = max(1, len(str(tok.value))) if tok.type not in ("_NL", "$END") else 1
        detail = f"unexpected {_token_text(tok, source)}; expected {_describe_expected(set(err.expected))}"
    elif isinstance(err, UnexpectedCharacters):
        pos = err.pos_in_stream or 0
        char = source.text[pos] if pos < len(source.text) else "?"
        width = 1
        detail = f"unexpected character {char!r}"
        if err.allowed:
            detail += f"; expected {_describe_expected(set(err.allowed))}"
    elif isinstance(err, UnexpectedEOF):
        (line, col), width = _end_of(source), 1
        detail = f"unexpected end of file; expected {_describe_expected(set(err.expected))}"
    else:  # pragma: no cover - lark has no other UnexpectedInput subclasses
        width, detail = 1, str(err)
    span = Span(source.filename, line, col, line, col + width)
    return SpecSyntaxError(span, detail=detail, hint="see docs/language.md for the statement forms")


def _end_of(source: Source) -> tuple[int, int]:
    """Line and column just after the text's last line (where 'end of file' is reported)."""
    lines = source.lines()
    if len(lines) > 1 and not lines[-1]:  # the text's final line end opens no line of its own
        lines.pop()
    return len(lines), len(lines[-1]) + 1


def normalise_line_ends(text: str) -> str:
    """\\r\\n and a lone \\r end a line as \\n does (a file saved with old Mac line ends is not one long comment)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _tree_depth_first(tree: lark.Tree, limit: int) -> lark.Tree | None:
    """The first node (in source order) nested deeper than `limit`, found without recursion."""
    stack: list[tuple[lark.Tree, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return node
        stack.extend((child, depth + 1) for child in reversed(node.children) if isinstance(child, lark.Tree))
    return None


def _deepest(tree: lark.Tree) -> lark.Tree:
    deepest, best = tree, -1
    stack: list[tuple[lark.Tree, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > best and getattr(node.meta, "line", None) is not None:
            deepest, best = node, depth
        stack.extend((child, depth + 1) for child in node.children if isinstance(child, lark.Tree))
    return deepest


def _node_span(node: lark.Tree, filename: str) -> Span:
    meta = node.meta
    line, col = getattr(meta, "line", 1), getattr(meta, "column", 1)
    end_line, end_col = getattr(meta, "end_line", line), getattr(meta, "end_column", col + 1)
    return Span(filename, line, col, end_line, end_col)


def deepest_span(source: Source) -> Span | None:
    """The most deeply nested construct of a spec that parses (where a later stage's RecursionError or time-out
    is reported), found without recursion; None when the text does not parse."""
    try:
        tree = _parser().parse(normalise_line_ends(source.text))
    except (UnexpectedInput, RecursionError):
        return None
    return _node_span(_deepest(tree), source.filename)


def parse(text: str, filename: str = "<string>") -> ast.Module:
    """Parse spec text into an AST, raising `SpecSyntaxError` with a location on malformed input."""
    source = Source(normalise_line_ends(text), filename)
    try:
        tree = _parser().parse(source.text)
    except UnexpectedInput as err:
        raise _syntax_error(err, source).with_source(source) from None
    too_deep = _tree_depth_first(tree, MAX_NESTING)
    if too_deep is not None:
        raise NestingTooDeep(_node_span(too_deep, source.filename), detail=f"this expression nests more than "
                             f"{MAX_NESTING} levels deep (the compiler's limit)").with_source(source)
    try:
        statements = flatten_statements(_ToAst(source).transform(tree))
    except VisitError as err:
        if isinstance(err.orig_exc, NcdError):
            raise err.orig_exc.with_source(source) from None
        raise
    return ast.Module(tuple(statements), source)


_FUNC_HEAD = re.compile(r"([A-Za-z_][A-Za-z_0-9]*)[ \t]*\([ \t]*([A-Za-z_][A-Za-z_0-9]*)")


@v_args(meta=True)
class _ToAst(Transformer[Any, Any]):
    def __init__(self, source: Source) -> None:
        super().__init__()
        self.file = source.filename

    def _span(self, meta: Any) -> Span:
        return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)

    def _tok(self, tok: Token) -> Span:
        return Span(self.file, tok.line or 0, tok.column or 0, tok.end_line or 0, tok.end_column or 0)

    def _ident(self, tok: Token) -> ast.Ident:
        return ast.Ident(str(tok), self._tok(tok))

    def _int(self, tok: Token) -> int:
        # Python refuses to convert integers of more than a few thousand digits; no spec needs one.
        digits = len(str(tok))
        if digits > MAX_INTEGER_DIGITS:
            raise SpecSyntaxError(self._tok(tok), detail=f"an integer literal of {digits} digits is too long",
                                  hint=f"integer literals have at most {MAX_INTEGER_DIGITS} digits")
        return int(tok)

    # statements
    def start(self, meta, items):
        return list(items)

    def spec_stmt(self, meta, items):
        return ast.SpecName(self._ident(items[0]), self._span(meta))

    def axis_stmt(self, meta, items):
        return list(items)

    def axis_bound(self, meta, items):
        return ast.AxisDecl(self._ident(items[0]), "bound", None, (), self._span(meta))

    def axis_fixed(self, meta, items):
        return ast.AxisDecl(self._ident(items[0]), "fixed", self._int(items[1]), (), self._span(meta))

    def axis_product(self, meta, items):
        factors = tuple(self._ident(t) for t in items[1:])
        return ast.AxisDecl(self._ident(items[0]), "product", None, factors, self._span(meta))

    def const_stmt(self, meta, items):
        return ast.ConstDecl(self._ident(items[0]), items[1], self._span(meta))

    def role(self, meta, items):
        return str(items[0])

    def dtype(self, meta, items):
        return ("dtype", self._ident(items[0]))

    def shape(self, meta, items):
        return ("shape", tuple(self._ident(t) for t in items))

    def tensor_stmt(self, meta, items):
        role, name, rest = items[0], items[1], items[2:]
        axes = dtype = value = None
        for item in rest:
            if isinstance(item, tuple) and item[0] == "shape":
                axes = item[1]
            elif isinstance(item, tuple) and item[0] == "dtype":
                dtype = item[1]
            else:
                value = item
        return ast.TensorDecl(role, self._ident(name), axes, dtype, value, self._span(meta))

    def define_stmt(self, meta, items):
        axes = items[1][1] if len(items) == 3 else None
        return ast.Define(self._ident(items[0]), axes, items[-1], self._span(meta))

    def basis_stmt(self, meta, items):
        name, param, *rules = items
        return ast.BasisDecl(self._ident(name), self._ident(param), tuple(rules), self._span(meta))

    def basis_rule(self, meta, items):
        if isinstance(items[1], ast.IndexExpr):
            raise SpecSyntaxError(items[1].span, detail="a basis rule defines T[0], T[1], ... or T[n+1]",
                                  hint="for example: T[0] = 1, T[1] = u, T[n+1] = 2*u*T[n] - T[n-1]")
        return ast.BasisRule(self._ident(items[0]), items[1], items[2], self._span(meta))

    # expressions
    def contract(self, meta, items):
        return ast.Contract(items[0], items[1], items[2], self._span(meta))

    def axis_names(self, meta, items):
        return tuple(self._ident(t) for t in items)

    def compare(self, meta, items):
        return ast.Binary(str(items[1]), items[0], items[2], self._span(meta))

    def or_op(self, meta, items):
        return self._binary("or", meta, items)

    def and_op(self, meta, items):
        return self._binary("and", meta, items)

    def not_op(self, meta, items):
        return ast.Not(items[0], self._span(meta))

    def _binary(self, op: str, meta: Any, items: list[Any]) -> ast.Binary:
        return ast.Binary(op, items[0], items[1], self._span(meta))

    def add(self, meta, items):
        return self._binary("+", meta, items)

    def sub(self, meta, items):
        return self._binary("-", meta, items)

    def mul(self, meta, items):
        return self._binary("*", meta, items)

    def div(self, meta, items):
        return self._binary("/", meta, items)

    def pow(self, meta, items):
        return self._binary("^", meta, items)

    def neg(self, meta, items):
        return ast.Neg(items[0], self._span(meta))

    def number(self, meta, items):
        text = str(items[0])
        value: int | float = self._int(items[0]) if items[0].type == "INT" else float(text)
        try:
            finite = math.isfinite(float(value))
        except OverflowError:  # an integer beyond the float range
            finite = False
        if not finite:
            raise SpecSyntaxError(self._span(meta), detail=f"number {text} is too large for a float",
                                  hint="numbers must be finite 64-bit floats (at most about 1.8e308)")
        return ast.Number(value, self._span(meta))

    def name(self, meta, items):
        return ast.NameRef(str(items[0]), self._span(meta))

    def index_items(self, meta, items):
        return tuple(items)

    def index_item(self, meta, items):
        """An index entry: the simple forms (a name, an integer, NAME+INT, NAME-INT) as their own nodes, which
        relabelling, finite sums and basis recurrences read; any other expression as an IndexExpr."""
        expr, span = items[0], self._span(meta)
        if isinstance(expr, ast.NameRef):
            return ast.IndexName(ast.Ident(expr.name, expr.span))
        if isinstance(expr, ast.Number) and isinstance(expr.value, int):
            return ast.IndexInt(expr.value, span)
        if (isinstance(expr, ast.Binary) and expr.op in ("+", "-") and isinstance(expr.lhs, ast.NameRef)
                and isinstance(expr.rhs, ast.Number) and isinstance(expr.rhs.value, int)):
            offset = expr.rhs.value if expr.op == "+" else -expr.rhs.value
            return ast.IndexOffset(ast.Ident(expr.lhs.name, expr.lhs.span), offset, span)
        return ast.IndexExpr(expr, span)

    def indexed(self, meta, items):
        return ast.Indexed(self._ident(items[0]), items[1], self._span(meta))

    def basis_eval(self, meta, items):
        return ast.BasisEval(self._ident(items[0]), items[1], items[2], self._span(meta))

    def call(self, meta, items):
        args = tuple(a for a in items[1:] if a is not None)
        return ast.Call(self._ident(items[0]), args, self._span(meta))

    def over_arg(self, meta, items):
        return ast.OverArg(items[0], self._span(meta))

    def keyword_arg(self, meta, items):
        return ast.KeywordArg(self._ident(items[0]), items[1], self._span(meta))

    def function_arg(self, meta, items):
        head: Token = items[0]
        match = _FUNC_HEAD.match(str(head))
        assert match is not None  # the terminal's regex guarantees the shape
        line, col = head.line or 0, head.column or 0
        name = ast.Ident(match.group(1), Span(self.file, line, col, line, col + len(match.group(1))))
        pcol = col + match.start(2)
        param = ast.Ident(match.group(2), Span(self.file, line, pcol, line, pcol + len(match.group(2))))
        return ast.FunctionArg(name, param, items[1], self._span(meta))

    def comprehension_arg(self, meta, items):
        return ast.Comprehension(items[0], self._ident(items[1]), items[2], self._span(meta))

    def int_range(self, meta, items):
        return ast.IntRange(items[0], items[1], self._span(meta))

    def axis_range(self, meta, items):
        return ast.AxisRange(self._ident(items[0]), self._span(meta))

    def bound_int(self, meta, items):
        return self._int(items[0])

    def bound_neg(self, meta, items):
        return -self._int(items[0])

    def bound_name(self, meta, items):
        return self._ident(items[0])


def flatten_statements(items: list[Any]) -> list[ast.Statement]:
    out: list[ast.Statement] = []
    for item in items:
        out.extend(item if isinstance(item, list) else [item])
    return out
