"""Spec text never executes and never reaches generated code except as checked identifiers and numbers:
injection attempts, quotes, backslashes, look-alike letters and reserved Python names are spec errors."""

from __future__ import annotations

import builtins
import keyword
import os
import re
import subprocess
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from ncd import ir
from ncd.cli import main
from ncd.errors import InvalidIdentifier, NcdError, SpecSyntaxError
from ncd.identifiers import identifier_problem
from ncd.pipeline import front_end, load_spec

SPECS = sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.ncd"))
SAFE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

BASE = """\
spec safe
axis row, key
axis dim = 4
const c = 2
in x[row dim] : f32
in s[row key] : f32
A[row key] = normalize(s, over key, a1(t) = exp(t), a2(t) = exp(t), b(z) = z)
out y[row dim] = c * x + sum(A, over key)
"""

# {cmd} is replaced by a shell command that creates the marker file: it must never run.
PAYLOAD = "__import__('os').system('{cmd}')"

# (id, line of BASE to replace, replacement): every case is one hostile change of a valid spec.
L_A = "A[row key] = normalize(s, over key, a1(t) = exp(t), a2(t) = exp(t), b(z) = z)"
HOSTILE = [
    ("payload-as-input-name", "in x[row dim] : f32", "in " + PAYLOAD + "[row dim] : f32"),
    ("payload-as-spec-name", "spec safe", "spec " + PAYLOAD),
    ("payload-as-axis-name", "axis dim = 4", "axis " + PAYLOAD + " = 4"),
    ("payload-as-const-value", "const c = 2", "const c = " + PAYLOAD),
    ("payload-in-expression", "out y[row dim] = c * x + sum(A, over key)", "out y[row dim] = c * " + PAYLOAD),
    ("payload-as-dtype", "in x[row dim] : f32", "in x[row dim] : " + PAYLOAD),
    ("payload-as-over-axis", "out y[row dim] = c * x + sum(A, over key)",
     "out y[row dim] = c * x + sum(A, over " + PAYLOAD + ")"),
    ("payload-in-inline-function", L_A,
     "A[row key] = normalize(s, over key, a1(t) = " + PAYLOAD + ", a2(t) = exp(t), b(z) = z)"),
    ("payload-as-keyword-argument", L_A,
     "A[row key] = normalize(s, over key, a1(t) = exp(t), a2(t) = exp(t), b(z) = z, mask = " + PAYLOAD + ")"),
    ("exec-call-string", "const c = 2", "const c = exec(\"open('{marker}', 'w')\")"),
    ("eval-call-string", "const c = 2", "const c = eval(\"__import__('os').system('{cmd}')\")"),
    ("dunder-import-call", "const c = 2", "const c = __import__(os)"),
    ("dunder-attribute", "out y[row dim] = c * x + sum(A, over key)", "out y[row dim] = x.__class__"),
    ("dunder-name", "in x[row dim] : f32", "in __builtins__[row dim] : f32"),
    ("inner-double-underscore", "in x[row dim] : f32", "in x__globals[row dim] : f32"),
    ("leading-underscore", "in x[row dim] : f32", "in _x[row dim] : f32"),
    ("exec-as-name", "in x[row dim] : f32", "in exec[row dim] : f32"),
    ("eval-as-name", "const c = 2", "const eval = 2"),
    ("os-as-name", "axis dim = 4", "axis os = 4"),
    ("os-as-spec-name", "spec safe", "spec os"),
    ("sys-as-name", "in x[row dim] : f32", "in sys[row dim] : f32"),
    ("exec-as-function", "out y[row dim] = c * x + sum(A, over key)", "out y[row dim] = exec(x)"),
    ("eval-as-function", "out y[row dim] = c * x + sum(A, over key)", "out y[row dim] = eval(x)"),
    ("os-as-function", "out y[row dim] = c * x + sum(A, over key)", "out y[row dim] = os(x)"),
    ("generated-global-as-spec-name", "spec safe", "spec forward"),
    ("single-quotes-in-name", "in x[row dim] : f32", "in x'[row dim] : f32"),
    ("double-quotes-in-name", "in x[row dim] : f32", 'in x"y"[row dim] : f32'),
    ("string-literal", "const c = 2", "const c = 'two'"),
    ("triple-quoted-string", "const c = 2", 'const c = """2"""'),
    ("backslash-in-name", "in x[row dim] : f32", "in x\\y[row dim] : f32"),
    ("backslash-escape-in-expression", "const c = 2", "const c = \\x32"),
    ("continuation-splits-a-name", "in x[row dim] : f32", "in x\\\ny[row dim] : f32"),
    ("continuation-splits-payload", "const c = 2", "const c = __imp\\\nort__('os')"),
    ("cyrillic-a-in-name", "in x[row dim] : f32", "in x\u0430[row dim] : f32"),
    ("greek-omicron-in-name", "axis dim = 4", "axis d\u03bfm = 4"),
    ("fullwidth-exec", "in x[row dim] : f32", "in \uff45\uff58\uff45\uff43[row dim] : f32"),
    ("script-e-exp", L_A,
     "A[row key] = normalize(s, over key, a1(t) = \u212fxp(t), a2(t) = exp(t), b(z) = z)"),
    ("ligature-fi", "in x[row dim] : f32", "in \ufb01ne[row dim] : f32"),
    ("mathematical-bold-x", "in x[row dim] : f32", "in \U0001d431[row dim] : f32"),
    ("zero-width-space-in-name", "in x[row dim] : f32", "in x\u200by[row dim] : f32"),
    ("right-to-left-override", "const c = 2", "const c = 2 \u202e"),
    ("semicolon-statement-injection", "const c = 2", "const c = 2; import os"),
    ("name-too-long", "in x[row dim] : f32", "in " + "x" * 65 + "[row dim] : f32"),
    ("python-keyword-name", "in x[row dim] : f32", "in import[row dim] : f32"),
    ("soft-keyword-name", "axis dim = 4", "axis match = 4"),
]


def _hostile_text(old: str, new: str, tmp_path: Path) -> str:
    marker = tmp_path / "pwned"
    lines = BASE.splitlines()
    assert lines.count(old) == 1
    new = new.replace("{cmd}", f"touch {marker}").replace("{marker}", str(marker))
    return "\n".join(new if line == old else line for line in lines) + "\n"


@pytest.fixture
def no_shell(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record (and refuse) any attempt to start a process while a spec is compiled."""
    calls: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise AssertionError(f"a spec started a process: {args!r}")

    monkeypatch.setattr(os, "system", refuse)
    monkeypatch.setattr(os, "popen", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    return calls


def test_base_is_valid() -> None:
    result = front_end(BASE, "safe.ncd")
    assert result.program.name == "safe" and result.warnings == ()


@pytest.mark.parametrize(("old", "new"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_spec_is_a_spec_error(old: str, new: str, tmp_path: Path, no_shell, capsys) -> None:
    text = _hostile_text(old, new, tmp_path)
    with pytest.raises(NcdError) as info:
        front_end(text, "hostile.ncd")
    err = info.value
    first = BASE.splitlines().index(old) + 1
    assert err.span is not None and err.span.line in (first, first + new.count("\n"))
    rendered = err.render()
    assert rendered.startswith(f"hostile.ncd:{err.span.line}:{err.span.col}: error[")
    assert "Traceback" not in rendered

    path = tmp_path / "hostile.ncd"
    path.write_text(text, encoding="utf-8")
    for argv in (["check", str(path)], ["compile", str(path)], ["compile", "--emit", "triton", str(path)]):
        assert main(argv) == 1
        out, errors = capsys.readouterr()
        assert f"{path}:" in errors and "Traceback" not in out + errors and "internal error" not in errors
    assert not (tmp_path / "pwned").exists()
    assert no_shell == []


@pytest.mark.parametrize("name", ["__import__", "exec", "eval", "os", "sys", "print", "open", "lambda",
                                  "import",
                                  "match", "torch", "tl", "triton", "math", "forward", "Module", "a__b", "_x",
                                  "x" * 65, "x'", "x y", "x\\y", "x\ny", "\u0430", "1x", ""])
def test_identifier_problem_rejects(name: str) -> None:
    assert identifier_problem(name) is not None


@pytest.mark.parametrize("name", ["x", "Q", "kdim", "a1", "beta", "x_y", "T", "H2", "x" * 64])
def test_identifier_problem_accepts(name: str) -> None:
    assert identifier_problem(name) is None


def test_payload_in_a_comment_is_inert(tmp_path: Path, no_shell, capsys) -> None:
    marker = tmp_path / "pwned"
    text = BASE.replace("const c = 2", f"const c = 2  # __import__('os').system('touch {marker}')")
    result = front_end(text, "commented.ncd")
    assert [name for name, _ in result.program.constants] == ["c"]
    path = tmp_path / "commented.ncd"
    path.write_text(text, encoding="utf-8")
    assert main(["compile", "--emit", "ir", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert "__import__" not in out and "system" not in out
    assert not marker.exists() and no_shell == []


@pytest.mark.parametrize("stem", ["x'); __import__('os').system('touch pwned'); ('", "os", "__init__", "eval",
                                  "1spec", "my spec", "forward"])
def test_spec_named_after_a_hostile_file_is_rejected(stem: str, tmp_path: Path, monkeypatch, no_shell,
                                                     capsys) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / f"{stem}.ncd"
    path.write_text(BASE.replace("spec safe\n", ""), encoding="utf-8")  # no `spec` line: named after the file
    with pytest.raises(InvalidIdentifier) as info:
        load_spec(path)
    assert (info.value.span.line, info.value.span.col) == (1, 1)
    assert main(["compile", "--emit", "triton", str(path)]) == 1
    _, err = capsys.readouterr()
    assert "error[invalid-name]" in err and "Traceback" not in err
    assert not (tmp_path / "pwned").exists() and no_shell == []


def test_spec_named_after_a_plain_file_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "my-spec.ncd"
    path.write_text(BASE.replace("spec safe\n", ""), encoding="utf-8")
    assert load_spec(path).program.name == "my_spec"


# --- identifiers that reach the IR ------------------------------------------------------------------

_IDENT_FIELDS = {"name", "tensor", "axis", "axes", "over", "var", "param", "step_var", "basis", "row",
                 "factors",
                 "alias_of"}


def _identifiers(obj: object, field: str | None = None) -> set[str]:
    """Every identifier in an IR object: strings held in name-like fields, recursively."""
    out: set[str] = set()
    if isinstance(obj, str):
        if field in _IDENT_FIELDS:
            out.add(obj)
    elif isinstance(obj, tuple | list):
        for item in obj:
            out |= _identifiers(item, field)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            if f.name not in ("source", "span"):
                out |= _identifiers(getattr(obj, f.name), f.name)
    return out


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_ir_identifiers_are_safe(spec: Path) -> None:
    program = load_spec(spec).program
    names = _identifiers(program) | {name for name, _ in program.constants}
    declared = {a.name for a in program.axes} | {t.name for t in program.tensors} | {program.name}
    assert declared <= names  # the walk really sees the declarations
    text = spec.read_text(encoding="utf-8")
    for name in names:
        assert SAFE.fullmatch(name), name
        assert not keyword.iskeyword(name) and not keyword.issoftkeyword(name), name
        assert name not in dir(builtins), name
        assert "__" not in name, name
        assert identifier_problem(name) is None, name
        assert re.search(rf"\b{re.escape(name)}\b", text), f"{name} does not come from the spec text"


def test_ir_walk_finds_loop_and_function_variables() -> None:
    names = _identifiers(front_end(BASE, "safe.ncd").program)
    assert {"t", "z", "row", "key", "dim", "x", "s", "A", "y"} <= names
    for node in ir.walk(front_end(BASE, "safe.ncd").program.definitions[0].value):
        assert all(SAFE.fullmatch(a) for a in node.axes)


@pytest.mark.parametrize("stem", ["spherical_attention", "softmax_attention", "gka", "kat_rational", "cheby_kan"])
def test_a_spec_cannot_be_named_after_a_global_of_its_generated_module(stem: str, tmp_path: Path) -> None:
    """The spec's name becomes a function of the generated op module: it must not be able to replace any global
    there (an import, a kernel, a helper, a setting). Every family's module is checked, each of its globals tried
    as the spec's name: rejected with the `spec` line's location, by the identifier rules or at generation."""
    from ncd import backend

    spec = next(p for p in SPECS if p.stem == stem)
    front = load_spec(spec)
    code = backend.generate(front, backend.plan(front, {}))
    public = {n for n in backend.module_globals(code) if not n.startswith("_")}
    public = {n for n in public if not n.startswith(f"{front.program.name}_")} - {front.program.name}
    assert {"Module", "forward"} <= public or {"Module", "forward_impl"} <= public, sorted(public)
    late = sorted(n for n in public if identifier_problem(n) is None)  # the family's own globals
    assert late, "every global is already a reserved identifier: nothing to check at generation"
    text = spec.read_text()
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith(f"spec {front.program.name}"))
    for name in late:
        path = tmp_path / f"{stem}_{name}.ncd"
        path.write_text(text.replace(f"spec {front.program.name}", f"spec {name}", 1))
        renamed = load_spec(path)
        with pytest.raises(InvalidIdentifier, match=f"'{name}' cannot be used as a name") as info:
            backend.generate(renamed, backend.plan(renamed, {}))
        assert info.value.span is not None and (info.value.span.line, info.value.span.col) == (line, 6)
        assert f"    spec {name}\n         {'^' * len(name)}" in str(info.value)  # the source line and a caret


def test_syntax_error_for_non_ascii_reports_the_character(tmp_path: Path) -> None:
    with pytest.raises(SpecSyntaxError) as info:
        front_end(BASE.replace("in x[", "in x\u0430["), "u.ncd")
    assert "'\u0430'" in info.value.message
    assert (info.value.span.line, info.value.span.col) == (5, 5)
