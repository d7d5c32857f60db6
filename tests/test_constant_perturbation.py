"""Every constant of every shipped spec matters (issue 30, item 6): a family that claims a spec computes every
node of it or rejects it, so changing any numeric constant in the text (maps, scalings, ridge, exponents, const
declarations, basis recurrences, scale defaults) must either be rejected with a located error or change the
compiled op's output at a fixed small input. Axis sizes and dtype names are not perturbed.

Each constant is tried as x -> 1.37 x + 0.11 (ints stay ints: rounded, or x + 1); a constant whose first change
leaves the output alone (the spherical maps cancel any positive scale) gets a second try, -(1.37 x + 0.11) - 0.5
(ints: x + 2). Fixed head dims are compiled small and the forward runs once at tiny sizes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ncd.backend import plan
from ncd.compiler import compile_front
from ncd.errors import NcdError
from ncd.ops import Op
from ncd.pipeline import front_end
from ncd.validate import random_inputs

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.ncd"))
# a number token: not part of a name (f32, T_0) nor the tail of a decimal; `0..5` gives 0 and 5
NUMBER = re.compile(r"(?<!\w)(?<!\d\.)\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w]|\.\d)")
SMALL_FIXED = {"dim": 16, "kdim": 16, "vdim": 12}  # fixed head dims compiled small (the same generated code)
TINY = 5  # free axes larger than this are cut to it, the others (batch, heads) to 1
# specs whose constants show only at larger sizes: T5's log buckets start at distance 8 and stop at 128
LONG = {"t5_log_bucket_softmax": {"query": 140, "key": 133}}


def constants(text: str) -> list[tuple[int, int, str]]:
    """(start, end, token) of each numeric constant outside comments and axis declarations."""
    found = []
    offset = 0
    for line in text.splitlines(keepends=True):
        code = line.split("#", 1)[0]
        if not code.lstrip().startswith("axis"):
            found += [(offset + m.start(), offset + m.end(), m.group()) for m in NUMBER.finditer(code)]
        offset += len(line)
    return found


def perturbations(token: str) -> list[str]:
    if re.fullmatch(r"\d+", token):
        value = int(token)
        first = round(value * 1.37 + 0.11)
        return [str(first if first != value else value + 1), str(value + 2)]
    value = float(token)
    return [repr(value * 1.37 + 0.11), f"({-(value * 1.37 + 0.11) - 0.5!r})"]


def _sizes(text: str) -> dict[str, int]:
    declared = set(re.findall(r"^axis\s+(\w+)\s*=\s*\d+", text, flags=re.M))
    return {k: v for k, v in SMALL_FIXED.items() if k in declared}


def _compile(text: str, name: str, cache: Path) -> Op:
    return Op(compile_front(front_end(text, name, _sizes(text)), cache_dir=cache))


def _inputs(op: Op, stem: str) -> dict[str, torch.Tensor]:
    kernel_plan = plan(op.front)
    program = op.front.program
    split = {f for a in program.axes for f in a.factors} | {a.name for a in program.axes if a.factors}
    sizes = {a: (n if program.axis(a).fixed or a in split else (TINY if n > TINY else 1))
             for a, n in kernel_plan.validation_sizes(program).items()}
    sizes.update(LONG.get(stem, {}))
    generator = torch.Generator().manual_seed(30)
    inputs = random_inputs(op, kernel_plan, sizes, torch.float32, "cpu", generator)
    condition = getattr(kernel_plan, "condition_inputs", None)
    return condition(op.front.program, inputs, generator) if condition is not None else inputs


def _output(op: Op, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return op(*[inputs[t.name] for t in op.signature if t.axes]).float()


def _changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape != b.shape or not torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))


def _gka_constant_scalings(text: str) -> str:
    """The issue's GKA spec: constant key and value scalings and no beta input (the recognizer once dropped
    both constants and returned the unscaled result)."""
    for old, new in (("* (beta + 1e-6)\n", "* 0.5\n"), ("* (beta + 1e-6)\n", "* 2\n")):
        assert old in text
        text = text.replace(old, new, 1)
    return re.sub(r"^in  beta\[.*\n", "", text, flags=re.M).replace("spec gka", "spec gka_constant_scalings")


# shipped specs (every constant; a spec that spells none, such as a SwiGLU block or a channel softmax, has nothing
# to perturb), and variants of them that spell a constant where the shipped spec has an input (the constants of the
# lines that differ; the others are the shipped spec's)
# A mask's window default (256) shows only past 256 positions, far beyond the tiny sizes here: the shipped specs'
# other constants are perturbed as they are, and the window line in a variant whose default is 2 (`_small_window`).
WINDOW = re.compile(r"^in\s+window\b.*$", flags=re.M)


def _all_lines_but_the_window(text: str) -> tuple[str, ...] | None:
    if not WINDOW.search(text):
        return None
    return tuple({line.strip().split("#")[0][:12] for line in text.splitlines()
                  if line.strip() and not WINDOW.match(line.strip()) and not line.lstrip().startswith(("#", "axis"))})


def _small_window(stem: str, text: str) -> tuple[str, str, tuple[str, ...]]:
    return (f"{stem}_window_2", WINDOW.sub(lambda m: m.group(0).replace("256", "2"), text), ("in  window",))


CASES = [(p.stem, p.read_text(encoding="utf-8"), _all_lines_but_the_window(p.read_text(encoding="utf-8")))
         for p in SPECS if constants(p.read_text(encoding="utf-8"))]
assert len(CASES) >= 0.8 * len(SPECS), "most shipped specs spell constants: is `constants` finding them?"
CASES += [_small_window(stem, text) for stem, text, lines in CASES if lines is not None]
CASES.append(("gka_constant_scalings", _gka_constant_scalings(SPECS[[p.stem for p in SPECS].index("gka")]
                                                               .read_text(encoding="utf-8")), ("kb[", "vb[")))


@pytest.mark.parametrize(("stem", "text", "lines"), CASES, ids=[stem for stem, _, _ in CASES])
def test_every_constant_matters(stem: str, text: str, lines: tuple[str, ...] | None, tmp_path: Path) -> None:
    spec = Path(f"{stem}.ncd")
    found = [c for c in constants(text)
             if lines is None or text[text.rfind("\n", 0, c[0]) + 1:].startswith(lines)]
    assert found, f"{spec.name}: no constants found"
    base = _compile(text, spec.name, tmp_path)
    inputs = _inputs(base, stem)
    expected = _output(base, inputs)
    assert not _changed(expected, _output(base, inputs)), "the forward is not deterministic"
    ignored = []
    for start, end, token in found:
        line = text.count("\n", 0, start) + 1
        for new in perturbations(token):
            mutated = text[:start] + new + text[end:]
            try:
                op = _compile(mutated, spec.name, tmp_path)
                out = _output(op, inputs)
            except NcdError as err:  # rejected: it must say where
                assert err.span is not None and err.span.line > 0, f"{spec.name}:{line} {token} -> {new}: {err}"
                break
            if _changed(out, expected):
                break
        else:
            ignored.append(f"{spec.name}:{line}: {token!r} (line: {text.splitlines()[line - 1].strip()!r})")
    assert not ignored, "constants the compiled op ignores:\n" + "\n".join(ignored)


def test_constants_are_found_where_the_grammar_puts_them() -> None:
    text = ("spec t\naxis deg = 9   # 128 in a comment\nin x[a] : f32\nconst ridge = 0.02\n"
            "P[r] = sum(A[i] * x^i for i in 0..5) + 1e-6 * T_0 + f(2.5)\n")
    assert [t for _, _, t in constants(text)] == ["0.02", "0", "5", "1e-6", "2.5"]
    assert perturbations("0") == ["1", "2"] and perturbations("2") == ["3", "4"]
    assert perturbations("0.5")[0] == repr(0.5 * 1.37 + 0.11)
