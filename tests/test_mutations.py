"""Mutation fuzzing of every shipped spec through the CLI: whatever the mutant, `ncd` answers with exit code 0
(still a valid spec) or 1 (a located spec error), never 3 (an internal error) and never a Python traceback.

Mutations are drawn from a seeded `random.Random`, so every run checks the same mutants. `check` runs the back
end (Triton code generation and numerical validation, seconds per spec) on specs it can certify; here it is
stopped after the front end by reporting that no kernel family matches, so the test stays fast and about the
front end. `compile --emit ir` additionally runs the IR printer on every mutant.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

import ncd.backend
from ncd.cli import main

REAL_FAMILIES = ncd.backend._families

SPECS = sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.ncd"))
MUTANTS_PER_SPEC = 320
SEED = 20240611

Mutation = Callable[[bytes, random.Random], bytes]


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def delete_line(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    del lines[rng.randrange(len(lines))]
    return b"\n".join(lines)


def duplicate_line(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    i = rng.randrange(len(lines))
    lines.insert(rng.randrange(len(lines) + 1), lines[i])
    return b"\n".join(lines)


def swap_lines(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return b"\n".join(lines)


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data) + 1)]


_INSERTS = [b"\x00", b"\xff", b"\xc3", b"\xe2\x82", b"\x80\x80", "é".encode(), "λ".encode(),
            "\u2028".encode(), "\ufeff".encode(), "ℯ".encode(), "а".encode(), b"\r", b"\t", b"\\\n", b"$",
            b"@", b"`", b"'", b'"',
            b"(", b")", b"[", b"]", b"{", b"}", b".", b"..", b";", b",", b":", b"=", b"^", b"*", b"/", b"-",
            b"#", b" over ", b" for ", b"0", b"1e400", b"9" * 400, b"__", b"\n"]


def insert_bytes(data: bytes, rng: random.Random) -> bytes:
    random_bytes = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    chunk = rng.choice(_INSERTS) if rng.random() < 0.5 else random_bytes
    pos = rng.randrange(len(data) + 1)
    return data[:pos] + chunk + data[pos:]


_TOKEN = re.compile(rb"\S+")


def _tokens(data: bytes) -> list[re.Match[bytes]]:
    return list(_TOKEN.finditer(data))


def _replace_spans(data: bytes, replacements: dict[tuple[int, int], bytes]) -> bytes:
    out, last = [], 0
    for (start, end), new in sorted(replacements.items()):
        out += [data[last:start], new]
        last = end
    return b"".join([*out, data[last:]])


def swap_tokens(data: bytes, rng: random.Random) -> bytes:
    toks = _tokens(data)
    if len(toks) < 2:
        return data
    a, b = rng.sample(toks, 2)
    return _replace_spans(data, {a.span(): b.group(), b.span(): a.group()})


def replace_token(data: bytes, rng: random.Random) -> bytes:
    toks = _tokens(data)
    if not toks:
        return data
    target, source = rng.choice(toks), rng.choice(toks)
    return _replace_spans(data, {target.span(): source.group()})


_NUMBER, _NAME = re.compile(rb"[0-9]+(\.[0-9]+)?"), re.compile(rb"[A-Za-z_][A-Za-z_0-9]*")
_EXOTIC_NUMBERS = [b"0", b"1", b"-1", b"0.5", b"1e400", b"1e-400", b"9" * 400, b"9" * 5000, b"2^2000",
                   b"(10^300)^1024"]
_EXOTIC_NAMES = [b"prev", b"scan", b"over", b"sum", b"size", b"normalize", b"where", b"lambda", b"print",
                 b"torch",
                 b"__import__", b"x__y", b"n", b"i", b"u", b"T", b"_x", b"a" * 100]


def replace_literal(data: bytes, rng: random.Random) -> bytes:
    """A number or name replaced by an edge case of its kind: huge, zero, negative, reserved, ..."""
    pattern, choices = rng.choice(((_NUMBER, _EXOTIC_NUMBERS), (_NAME, _EXOTIC_NAMES)))
    found = list(pattern.finditer(data))
    if not found:
        return data
    return _replace_spans(data, {rng.choice(found).span(): rng.choice(choices)})


MUTATIONS: list[Mutation] = [delete_line, duplicate_line, swap_lines, truncate, insert_bytes, swap_tokens,
                             replace_token, replace_literal]


def mutants(data: bytes, seed: int, count: int) -> list[tuple[str, bytes]]:
    """`count` mutants, each of one to three stacked mutations, every mutation kind equally often."""
    rng = random.Random(seed)
    out = []
    for n in range(count):
        kinds = [MUTATIONS[n % len(MUTATIONS)]]
        kinds += [rng.choice(MUTATIONS) for _ in range(rng.choice((0, 0, 0, 1, 2)))]
        mutant = data
        for kind in kinds:
            mutant = kind(mutant, rng) if mutant.strip() else mutant
        out.append(("+".join(k.__name__ for k in kinds), mutant))
    return out


@pytest.fixture
def front_end_only_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `ncd check` stop after the front end (no kernel family matches), as for non-attention specs."""
    monkeypatch.setattr(ncd.backend, "_families", lambda: [])


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_spec_passes_check(spec: Path, front_end_only_check, capsys) -> None:
    code, out, err = _run(["check", str(spec)], capsys)
    assert code == 0, err
    assert f"spec {spec.stem}" in out


def test_every_spec_is_fuzzed() -> None:
    assert len(SPECS) >= 7
    kinds = Counter(kind.split("+")[0] for kind, _ in mutants(SPECS[0].read_bytes(), SEED, MUTANTS_PER_SPEC))
    assert set(kinds) == {m.__name__ for m in MUTATIONS}
    assert min(kinds.values()) >= MUTANTS_PER_SPEC // len(MUTATIONS)


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_mutants_never_crash(spec: Path, tmp_path: Path, front_end_only_check, capsys) -> None:
    original = spec.read_bytes()
    path = tmp_path / spec.name
    codes: Counter[int] = Counter()
    failures = []
    for index, (kind, mutant) in enumerate(mutants(original, SEED + sum(original), MUTANTS_PER_SPEC)):
        path.write_bytes(mutant)
        runs = [(["check", str(path)], False), (["compile", "--emit", "ir", str(path)], False)]
        if index % 4 == 0:  # a quarter of the mutants also go through planning and code generation
            runs.append((["compile", "--emit", "plan", "--emit", "triton", str(path)], True))
        for argv, back_end in runs:
            if back_end:
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(ncd.backend, "_families", REAL_FAMILIES)
                    code, out, err = _run(argv, capsys)
            else:
                code, out, err = _run(argv, capsys)
            codes[code] += 1
            problem = None
            if code not in (0, 1):
                problem = f"exit {code}"
            elif "Traceback" in out or "Traceback" in err:
                problem = "traceback"
            elif code == 1 and not re.search(r"error\[[a-z-]+\]", err):
                problem = "exit 1 without an error message"
            elif code == 0 and argv[0] == "check" and "ok   syntax" not in out:
                problem = "exit 0 without the check report"
            if problem:
                failures.append(f"#{index} {kind} {argv[0]}: {problem}\n{err.strip()}\n"
                                f"--- mutant ---\n{mutant!r}")
    assert not failures, f"{len(failures)} bad mutants of {spec.name}; first:\n" + failures[0]
    # The mutations are strong enough to break most mutants and mild enough to leave some valid.
    assert codes[1] > codes[0] > 0
