"""Python source text for generated modules: statements and comments kept within ruff's 120 columns, and the
doubled parentheses sympy's printer leaves (ruff's UP034) removed. Shared by the families' code generators."""

from __future__ import annotations


def wrap(head: str, names: list[str], tail: str, indent: str = "    ") -> str:
    """`head + ", ".join(names) + tail` as one statement, broken inside parentheses to stay within 120 columns."""
    one = f"{indent}{head}{', '.join(names)}{tail}"
    if len(one) <= 118:
        return one
    lines, line = [], ""
    for name in names:
        if line and len(indent) + 4 + len(line) + len(name) + 2 > 118:
            lines.append(line.rstrip())
            line = ""
        line += f"{name}, "
    lines.append(line.rstrip())
    body = "\n".join(f"{indent}    {part}" for part in lines)
    return f"{indent}{head}(\n{body}\n{indent}){tail}"


def drop_double_parens(expr: str) -> str:
    """`((e))` -> `(e)` where the outer pair is no call's (sympy's printer doubles some; ruff's UP034)."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for i, ch in enumerate(expr):
        if ch == "(":
            stack.append(i)
        elif ch == ")":
            pairs[stack.pop()] = i
    drop: set[int] = set()
    for open_, close in pairs.items():
        call = open_ > 0 and (expr[open_ - 1].isalnum() or expr[open_ - 1] in "_]")
        if not call and pairs.get(open_ + 1) == close - 1:
            drop |= {open_, close}
    return "".join(ch for i, ch in enumerate(expr) if i not in drop)


def _wrapped(expr: str) -> bool:
    """Whether `expr` is one parenthesised expression, `( ... )` as a whole."""
    depth = 0
    for i, ch in enumerate(expr):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and i < len(expr) - 1:
            return False
    return expr.startswith("(") and depth == 0


def fit(head: str, expr: str, tail: str = "", indent: str = "    ", comment: str = "") -> str:
    """One statement `head + expr + tail` (then `comment`), the expression broken between tokens inside
    parentheses when the line would pass 120 columns (sympy's expressions are long); the comment then goes above."""
    expr = drop_double_parens(expr)
    one = f"{indent}{head}{expr}{tail}"
    if len(one) + (len(comment) + 4 if comment else 0) <= 120:
        return f"{one}  # {comment}" if comment else one
    if comment:
        return f"{indent}# {comment}\n" + fit(head, expr, tail, indent)
    if len(one) <= 120:
        return one
    if _wrapped(expr):
        expr = expr[1:-1]
    width = 116 - len(indent)
    lines, line = [], ""
    for word in expr.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    body = "\n".join(f"{indent}    {part}" for part in lines)
    return f"{indent}{head}(\n{body}\n{indent}){tail}"


def comment_lines(prefix: str, text: str) -> list[str]:
    """A long comment line split into `prefix`-led pieces of at most 118 columns (formulas are long)."""
    width = 118 - len(prefix)
    return [prefix + text[i:i + width] for i in range(0, len(text), width)] or [prefix]
