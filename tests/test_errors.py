"""Every user mistake gets its own error class, an exact location, and a rendered message with the
offending line and a caret under it; the CLI turns spec errors into exit code 1 and usage errors into 2."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from ncd.cli import main
from ncd.errors import (
    ArityError,
    AxisMismatch,
    BadArgument,
    ContractionAxisMissing,
    CyclicDefinition,
    DuplicateName,
    IndexOutOfRange,
    InvalidIdentifier,
    InvalidStatement,
    NcdError,
    RankMismatch,
    SizeMismatch,
    SpecSyntaxError,
    TypeMismatch,
    UnknownAxis,
    UnknownDtype,
    UnknownFunction,
    UnknownName,
    UnusedInput,
)
from ncd.limits import QUOTE_WIDTH
from ncd.pipeline import front_end

FILENAME = "t.ncd"

# A valid spec touching most of the language: every case below changes exactly one of its lines.
BASE = """\
spec base
axis batch, head, query, key
axis dim = 4
axis vdim = 8
axis dcol = dim
axis group = 2
axis width
axis chan = group * width
axis deg = 6
const ridge = 0.5
in  Q[batch head query dim] : f32
in  K[batch head key dim] : f32
in  V[batch head key vdim] : f32
in  x[batch chan] : f32
in  g[batch head query] : f32
param A[deg] : f32
param B[group deg] : f32
in  scale : f32 = 1
S[batch head query key] = scale * (Q . K over dim)
W[batch head query key] = normalize(S, over key, a1(t) = exp(t), a2(t) = exp(t), b(z) = z)
out O[batch head query vdim] = W . V over key
P[batch chan] = sum(A[i] * x^i for i in 0..5) + B[group, 0] * ridge
out y[batch chan] = P / (1 + abs(x))
H[batch head query dcol] = scan(exp(g) * prev + Q[batch head query dcol], over query)
out h[batch head query] = sqrt(sum(H^2, over dcol))
"""
BASE_LINES = BASE.splitlines()

L_DIM, L_DCOL, L_CHAN, L_DEG = "axis dim = 4", "axis dcol = dim", "axis chan = group * width", "axis deg = 6"
L_RIDGE = "const ridge = 0.5"
L_X = "in  x[batch chan] : f32"
L_G = "in  g[batch head query] : f32"
L_A = "param A[deg] : f32"
L_S = "S[batch head query key] = scale * (Q . K over dim)"
L_W = "W[batch head query key] = normalize(S, over key, a1(t) = exp(t), a2(t) = exp(t), b(z) = z)"
L_O = "out O[batch head query vdim] = W . V over key"
L_P = "P[batch chan] = sum(A[i] * x^i for i in 0..5) + B[group, 0] * ridge"
L_Y = "out y[batch chan] = P / (1 + abs(x))"
L_H = "H[batch head query dcol] = scan(exp(g) * prev + Q[batch head query dcol], over query)"
L_OUT_H = "out h[batch head query] = sqrt(sum(H^2, over dcol))"

EOL = object()  # the expected column is just past the end of the (last) replaced line


@dataclass(frozen=True)
class Case:
    id: str
    old: str  # a whole line of BASE
    new: str  # what replaces it (may be several lines)
    error: type[NcdError]
    at: str | object  # the expected caret: the first occurrence of this text in `new`, or EOL
    nth: int = 0  # ... or its nth occurrence

    def text(self) -> str:
        assert BASE_LINES.count(self.old) == 1, f"{self.old!r} is not exactly one line of BASE"
        return "\n".join(self.new if line == self.old else line for line in BASE_LINES) + "\n"

    def location(self) -> tuple[int, int]:
        first = BASE_LINES.index(self.old) + 1
        if self.at is EOL:
            last = self.new.splitlines()[-1]
            return first + self.new.count("\n"), len(last) + 1
        assert isinstance(self.at, str)
        pos = -1
        for _ in range(self.nth + 1):
            pos = self.new.index(self.at, pos + 1)
        line = first + self.new.count("\n", 0, pos)
        col = pos - (self.new.rfind("\n", 0, pos) + 1) + 1
        return line, col


CASES = [
    # --- syntax -------------------------------------------------------------------------------
    Case("syntax-unexpected-token", L_Y, "out y[batch chan] = P / * x", SpecSyntaxError, "*"),
    Case("syntax-double-role", L_X, "in in x[batch chan] : f32", SpecSyntaxError, "x"),
    Case("syntax-dollar", L_Y, "out y[batch chan] = P $ x", SpecSyntaxError, "$"),
    Case("syntax-at-sign", L_DIM, "axis d@m = 4", SpecSyntaxError, "@"),
    Case("syntax-unclosed-paren-at-eof", L_OUT_H, "out h[batch head query] = sqrt(sum(H^2, over dcol)",
         SpecSyntaxError, EOL),
    Case("syntax-unclosed-bracket-at-eof", L_OUT_H,
         "out h[batch head query] = sqrt(sum(H[batch head query dcol", SpecSyntaxError, EOL),
    Case("syntax-unclosed-shape", L_OUT_H, "out h[batch head query = sqrt(sum(H^2, over dcol))",
         SpecSyntaxError, "="),
    Case("syntax-missing-equals-out", L_Y, "out y[batch chan] P / (1 + abs(x))", SpecSyntaxError, "P"),
    Case("syntax-missing-equals-define", L_P, "P[batch chan] sum(A[i] * x^i for i in 0..5)",
         SpecSyntaxError, "sum"),
    Case("syntax-axis-float-size", L_DIM, "axis dim = 4.5", SpecSyntaxError, "."),
    Case("syntax-axis-without-name", L_DIM, "axis = 4", SpecSyntaxError, "="),
    Case("syntax-axis-sum-of-factors", L_CHAN, "axis chan = group + width", SpecSyntaxError, "+"),
    Case("syntax-stray-dot-at-end", L_Y, "out y[batch chan] = P / (1 + abs(x)) .", SpecSyntaxError, EOL),
    Case("syntax-stray-dot-in-name", L_DIM, "axis dim. = 4", SpecSyntaxError, "."),
    Case("syntax-float-overflow", L_RIDGE, "const ridge = 1e400", SpecSyntaxError, "1e400"),
    Case("syntax-int-literal-too-long", L_DEG, "axis deg = " + "9" * 1200, SpecSyntaxError, "9"),
    Case("syntax-int-index-too-long", L_P, "P[batch chan] = A[" + "7" * 5000 + "] * x", SpecSyntaxError, "7"),
    Case("syntax-int-beyond-float", L_Y, "out y[batch chan] = P * " + "9" * 400, SpecSyntaxError, "9"),
    # --- names ----------------------------------------------------------------------------------
    Case("unknown-axis-in-declaration", L_X, "in  x[batch chans] : f32", UnknownAxis, "chans"),
    Case("unknown-axis-in-contraction-over", L_S, "S[batch head query key] = scale * (Q . K over dims)",
         UnknownAxis, "dims"),
    Case("unknown-axis-in-sum-over", L_OUT_H, "out h[batch head query] = sqrt(sum(H^2, over dcl))",
         UnknownAxis, "dcl"),
    Case("unknown-axis-split-factor", L_CHAN, "axis chan = group * wdth", UnknownAxis, "wdth"),
    Case("unknown-name", L_Y, "out y[batch chan] = P / (1 + abs(xx))", UnknownName, "xx"),
    Case("unknown-tensor-indexed", L_Y, "out y[batch chan] = P / (1 + abs(X[batch chan]))", UnknownName, "X"),
    Case("unknown-function", L_Y, "out y[batch chan] = P / (1 + absolute(x))", UnknownFunction, "absolute"),
    Case("unknown-dtype", L_X, "in  x[batch chan] : f8", UnknownDtype, "f8"),
    Case("duplicate-axis-vs-tensor", L_A, "param deg[deg] : f32", DuplicateName, "deg"),
    Case("duplicate-tensor-vs-tensor", L_G, "in  Q[batch head query] : f32", DuplicateName, "Q"),
    Case("duplicate-const-vs-axis", L_RIDGE, "const dim = 0.5", DuplicateName, "dim"),
    Case("duplicate-spec-line", "spec base", "spec base\nspec other", InvalidStatement, "spec other"),
    Case("invalid-name-keyword", L_X, "in  lambda[batch chan] : f32", InvalidIdentifier, "lambda"),
    Case("invalid-name-builtin", L_X, "in  print[batch chan] : f32", InvalidIdentifier, "print"),
    Case("invalid-name-double-underscore", L_X, "in  x__y[batch chan] : f32", InvalidIdentifier, "x__y"),
    Case("invalid-name-torch", L_X, "in  torch[batch chan] : f32", InvalidIdentifier, "torch"),
    Case("invalid-name-axis-keyword", L_DEG, "axis class = 6", InvalidIdentifier, "class"),
    Case("invalid-name-sum-index", L_P, "P[batch chan] = sum(A[id] * x^id for id in 0..5)",
         InvalidIdentifier, "id in"),
    # --- calls ----------------------------------------------------------------------------------
    Case("arity-exp-two-args", L_Y, "out y[batch chan] = P / (1 + exp(x, x))", ArityError, "exp"),
    Case("arity-where-two-args", L_Y, "out y[batch chan] = P / (1 + where(x < 1, x))", ArityError, "where"),
    Case("normalize-missing-b", L_W,
         "W[batch head query key] = normalize(S, over key, a1(t) = exp(t), a2(t) = exp(t))",
         BadArgument, "normalize"),
    Case("normalize-two-over-axes", L_W,
         "W[batch head query key] = normalize(S, over key query, a1(t) = exp(t), a2(t) = exp(t), b(z) = z)",
         BadArgument, "normalize"),
    # --- axes and sizes -------------------------------------------------------------------------
    Case("contraction-axis-missing-left", L_S, "S[batch head query key] = scale * (Q . K over key)",
         ContractionAxisMissing, "key", 1),
    Case("contraction-axis-missing-right", L_O, "out O[batch head query vdim] = W . V over query",
         ContractionAxisMissing, "query", 1),
    Case("relabel-size-mismatch", L_O, "out O[batch head query dim] = W . V[batch head key dim] over key",
         SizeMismatch, "dim", 1),
    Case("fixed-axis-size-zero", L_DEG, "axis deg = 0", SizeMismatch, "deg"),
    Case("finite-sum-index-out-of-range", L_P, "P[batch chan] = sum(A[i] * x^i for i in 0..6)",
         IndexOutOfRange, "i", 0),
    Case("integer-index-out-of-range", L_P, "P[batch chan] = B[group, 6] * x", IndexOutOfRange, "6"),
    Case("rank-mismatch", L_Y, "out y[batch chan] = P / (1 + abs(x[batch]))", RankMismatch, "x["),
    Case("declared-axes-lack-one", L_Y, "out y[batch] = P / (1 + abs(x))", AxisMismatch, "P"),
    Case("declared-axes-extra-one", L_Y, "out y[batch chan head] = P / (1 + abs(x))", AxisMismatch, "P"),
    Case("reduce-over-absent-axis", L_OUT_H, "out h[batch head query] = sqrt(sum(H^2, over key))",
         AxisMismatch, "key"),
    # --- structure ------------------------------------------------------------------------------
    Case("cycle-two-definitions", L_P, "P[batch chan] = y * 2", CyclicDefinition, "P"),
    Case("cycle-self-reference", L_P, "P[batch chan] = P + x", CyclicDefinition, "P"),
    Case("cycle-axis-aliases", L_DCOL, "axis dcol = dc2\naxis dc2 = dcol", CyclicDefinition, "dcol"),
    Case("cycle-axis-self-alias", L_DCOL, "axis dcol = dcol", CyclicDefinition, "dcol"),
    Case("cycle-constant", L_RIDGE, "const ridge = 2 * ridge", CyclicDefinition, "ridge"),
    Case("cycle-constant-via-range-bound", L_RIDGE, "const ridge = sum(i for i in 0..ridge)",
         CyclicDefinition, "ridge"),
    Case("constant-sum-with-later-bound", L_RIDGE, "const ridge = sum(i for i in 0..later)\nconst later = 3",
         TypeMismatch, "sum"),
    Case("prev-outside-scan", L_Y, "out y[batch chan] = P / (1 + abs(prev))", InvalidStatement, "prev"),
    Case("scan-without-axis-list", L_H, "H = scan(exp(g) * prev + Q[batch head query dcol], over query)",
         InvalidStatement, "H"),
    Case("output-without-definition", L_Y, "out y[batch chan] : f32", InvalidStatement, "out"),
    Case("input-without-dtype", L_G, "in  g[batch head query]", InvalidStatement, "g"),
    # --- types ----------------------------------------------------------------------------------
    Case("comparison-as-number", L_Y, "out y[batch chan] = P / (1 + (x < 1))", TypeMismatch, "x <"),
    Case("comparison-as-definition", L_Y, "out y[batch chan] = P < x", TypeMismatch, "P"),
    Case("power-non-integer", L_Y, "out y[batch chan] = P / (1 + abs(x)^0.5)", TypeMismatch, "0.5"),
    Case("power-of-function-parameter", L_W,
         "W[batch head query key] = normalize(S, over key, a1(t) = exp(t), a2(t) = t^t, b(z) = z)",
         TypeMismatch, "t, b(z)"),
    Case("power-exponent-too-large", L_Y, "out y[batch chan] = P / (1 + abs(x)^2000)", TypeMismatch, "2000"),
    Case("power-of-number-too-large", L_RIDGE, "const ridge = (10^300)^1024", TypeMismatch, "("),
    Case("constant-overflows", L_RIDGE, "const ridge = 10^400", TypeMismatch, "10"),
    Case("constant-not-a-number", L_RIDGE, "const ridge = log(0)", TypeMismatch, "log"),
]

# Specs whose mistake is not one changed line of BASE: (id, text, error, line, col).
WHOLE = [
    ("no-output", "spec s\naxis a\nin x[a] : f32\nY[a] = x\n", InvalidStatement, 1, 1),
    ("no-output-no-spec-line", "axis a\nin x[a] : f32\n", InvalidStatement, 1, 1),
    ("empty-file", "", InvalidStatement, 1, 1),
    ("unexpected-eof-after-operator", "axis a\nin x[a] : f32\nout y[a] = (x +\n\n", SpecSyntaxError, 3, 16),
    ("nul-byte", "axis a\nin x[a] : f32\nout y[a] = x\x00\n", SpecSyntaxError, 3, 13),
]


def _check_render(err: NcdError, text: str, line: int, col: int) -> None:
    rendered = err.render()
    assert "Traceback" not in rendered
    assert f"{FILENAME}:{line}:{col}: error[{err.code}]" in rendered
    lines = rendered.split("\n")
    # the grammar's line breaks: \n, \r\n and \r (str.splitlines also splits at \f, \v, U+2028, ...)
    source_lines = re.split(r"\r\n|\r|\n", text)
    source_line = "".join(c if c.isprintable() or c == "\t" else "\ufffd" for c in source_lines[line - 1])
    carets = [ln for ln in lines if re.fullmatch(r"[ \t]*\^+", ln)]
    assert len(carets) == 1, rendered
    quoted, caret = lines[lines.index(carets[0]) - 1], carets[0].index("^")
    if len(source_line) <= QUOTE_WIDTH:
        assert quoted == f"    {source_line}", rendered
        assert caret == 4 + col - 1, rendered
    else:  # a window of the line around the column
        assert len(quoted) <= QUOTE_WIDTH + 12 and quoted[caret] == source_line[col - 1], rendered


def _front_end_error(text: str) -> NcdError:
    with pytest.raises(NcdError) as info:
        front_end(text, FILENAME)
    return info.value


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_error_class_and_location(case: Case) -> None:
    text = case.text()
    err = _front_end_error(text)
    line, col = case.location()
    assert type(err) is case.error, err.render()
    assert err.span is not None
    assert (err.span.filename, err.span.line, err.span.col) == (FILENAME, line, col), err.render()
    _check_render(err, text, line, col)


@pytest.mark.parametrize(("text", "error", "line", "col"), [w[1:] for w in WHOLE], ids=[w[0] for w in WHOLE])
def test_whole_spec_errors(text: str, error: type[NcdError], line: int, col: int) -> None:
    err = _front_end_error(text)
    assert type(err) is error, err.render()
    assert err.span is not None and (err.span.line, err.span.col) == (line, col), err.render()
    _check_render(err, text, line, col)


def test_base_spec_is_valid() -> None:
    result = front_end(BASE, FILENAME)
    assert result.warnings == ()
    assert {t.name for t in result.program.outputs} == {"O", "y", "h"}


def test_cases_are_distinct_and_many() -> None:
    assert len(CASES) + len(WHOLE) >= 40
    assert len({c.id for c in CASES}) == len(CASES)
    assert len({c.text() for c in CASES}) == len(CASES)


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out and "Traceback" not in err
    return code, out, err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_exits_1_on_spec_errors(case: Case, tmp_path, capsys) -> None:
    path = tmp_path / FILENAME
    path.write_text(case.text(), encoding="utf-8")
    code, _, err = _run_cli(["check", str(path)], capsys)
    line, col = case.location()
    assert code == 1
    assert f"{path}:{line}:{col}: error[{case.error.code}]" in err
    assert "internal error" not in err


@pytest.mark.parametrize(("text", "error", "line", "col"), [w[1:] for w in WHOLE], ids=[w[0] for w in WHOLE])
def test_cli_exits_1_on_whole_spec_errors(text, error, line, col, tmp_path, capsys) -> None:
    path = tmp_path / FILENAME
    path.write_text(text, encoding="utf-8")
    code, _, err = _run_cli(["compile", "--emit", "ir", str(path)], capsys)
    assert code == 1
    assert f"{path}:{line}:{col}: error[{error.code}]" in err


UNUSED = "spec u\naxis row\nin x[row] : f32\nin z[row] : f32\nparam w[row] : f32\nout y[row] = 2 * x\n"


def test_unused_input_is_a_warning() -> None:
    result = front_end(UNUSED, FILENAME)
    assert [type(w) for w in result.warnings] == [UnusedInput, UnusedInput]
    z, w = result.warnings
    assert z.span is not None and w.span is not None
    assert (z.span.line, z.span.col, w.span.line, w.span.col) == (4, 1, 5, 1)
    assert z.severity == "warning" and "input 'z'" in z.message and "parameter 'w'" in w.message
    rendered = z.render()
    assert rendered.startswith(f"{FILENAME}:4:1: warning[unused]")
    assert "    in z[row] : f32" in rendered.splitlines()


def test_cli_prints_unused_input_warning_and_exits_0(tmp_path, capsys) -> None:
    path = tmp_path / FILENAME
    path.write_text(UNUSED, encoding="utf-8")
    code, out, err = _run_cli(["compile", "--emit", "ir", str(path)], capsys)  # `check` also needs a family
    assert code == 0
    assert "spec u" in out
    assert f"{path}:4:1: warning[unused]: input 'z' is declared but never used" in err
    assert f"{path}:5:1: warning[unused]: parameter 'w'" in err
    assert "error" not in err


def test_cli_missing_file_is_a_usage_error(tmp_path, capsys) -> None:
    code, _, err = _run_cli(["check", str(tmp_path / "absent.ncd")], capsys)
    assert code == 2
    assert "cannot read spec" in err


def test_cli_directory_is_a_usage_error(tmp_path, capsys) -> None:
    code, _, err = _run_cli(["check", str(tmp_path)], capsys)
    assert code == 2
    assert "cannot read spec" in err


@pytest.mark.parametrize("argv", [["check", "--bogus", "x.ncd"], ["frobnicate", "x.ncd"], [], ["check"],
                                  ["compile", "--emit", "nonsense", "x.ncd"]],
                         ids=["bad-flag", "bad-command", "no-command", "no-spec", "bad-emit-choice"])
def test_cli_bad_usage_exits_2(argv, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    _, err = capsys.readouterr()
    assert "usage:" in err and "Traceback" not in err


def test_cli_non_utf8_file_is_a_spec_error(tmp_path, capsys) -> None:
    path = tmp_path / FILENAME
    path.write_bytes(b"axis a\nin x[a] : f32\nout y[a] = x \xff\n")
    code, _, err = _run_cli(["check", str(path)], capsys)
    assert code == 1
    assert f"{path}:3:14: error[syntax]: the file is not UTF-8 text (byte 0xff)" in err
