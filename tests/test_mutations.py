"""Mutation fuzzing of every shipped spec through the CLI: whatever the mutant and whatever its file is called,
`ncd` answers with exit code 0 (still a valid spec), 1 (a located spec error) or 2 (a usage error such as a file
name that looks like an option), never 3 (an internal error), never a Python traceback, never a hang, and a
hostile file name never runs its payload.

Mutations: line operations, bytes, token operations, literals, deep nesting, huge numbers, other line ends; each
mutant is saved under the spec's name or one of HOSTILE_NAMES. Mutants are drawn from seeded `random.Random`s, so
every run checks the same mutants in the same order; CI runs them for FUZZ_SECONDS in total (round robin over the
specs), and `NCD_FUZZ_SECONDS=600` runs a longer fuzz (`NCD_FUZZ_REPORT=FILE` writes its counts as JSON).
`check` is stopped after the front end (no kernel family matches), so the test stays about the front end; a
quarter of the mutants also go through planning and code generation, and a few generated modules of
hostile-named specs are imported.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

import ncd
import ncd.backend
import ncd.families
import ncd.limits
from ncd.cli import main
from ncd.limits import time_budget

REAL_FAMILIES = ncd.families.REGISTRY

SPECS = sorted((Path(__file__).resolve().parent.parent / "specs").glob("*.ncd"))
SEED = int(os.environ.get("NCD_FUZZ_SEED", "20240611"))  # another seed draws other mutants
FUZZ_SECONDS = float(os.environ.get("NCD_FUZZ_SECONDS", "25"))
RUN_SECONDS = 120.0  # one CLI run longer than this is a hang
FUZZ_SYMBOLIC_SECONDS = 3.0  # ncd.limits.SYMBOLIC_SECONDS while fuzzing: mutants that exhaust it cost little
LOADS = 2 + int(FUZZ_SECONDS // 60)  # generated modules of hostile-named specs imported

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


_TOKEN_VOCABULARY = [b"spec", b"axis", b"const", b"in", b"param", b"out", b"basis", b"over", b"for", b"in", b"..",
                     b"normalize", b"scan", b"prev", b"sum", b"max", b"min", b"where", b"size", b"chebyshev_solve",
                     b"a1(x) =", b"b(z) =", b"(", b")", b"[", b"]", b"{", b"}", b"=", b"==", b"<=", b".", b",", b":",
                     b";", b"^", b"*", b"/", b"+", b"-", b"f32", b"bf16", b"x", b"T[n+1]", b"0", b"1", b"-1",
                     b"0.5", b"#", b"and", b"or", b"not", b"mask =", b"key", b"query"]


def delete_token(data: bytes, rng: random.Random) -> bytes:
    toks = _tokens(data)
    return _replace_spans(data, {rng.choice(toks).span(): b""}) if toks else data


def duplicate_token(data: bytes, rng: random.Random) -> bytes:
    toks = _tokens(data)
    if not toks:
        return data
    tok = rng.choice(toks)
    return _replace_spans(data, {tok.span(): tok.group() + b" " + tok.group()})


def insert_token(data: bytes, rng: random.Random) -> bytes:
    toks = _tokens(data)
    if not toks:
        return data
    start, _ = rng.choice(toks).span()
    return data[:start] + rng.choice(_TOKEN_VOCABULARY) + b" " + data[start:]


_WRAPPERS = [(b"(", b")"), (b"-", b""), (b"tanh(", b")"), (b"abs(", b")"), (b"", b" ^ 1"), (b"", b" + 0"),
             (b"(1 + ", b")"), (b"exp(", b")"), (b"max(0, ", b")")]


def deep_nesting(data: bytes, rng: random.Random) -> bytes:
    """A name or number wrapped in parentheses, signs, calls or operator chains, from a few to thousands deep."""
    found = [m for m in _NAME.finditer(data) if data.rfind(b"=", 0, m.start()) > data.rfind(b"\n", 0, m.start())]
    found = found or list(_NAME.finditer(data))
    if not found:
        return data
    target = rng.choice(found)
    before, after = rng.choice(_WRAPPERS)
    depth = rng.choice((3, 12, 40, 99, 101, 400, 5000))
    return _replace_spans(data, {target.span(): before * depth + target.group() + after * depth})


_HUGE_NUMBERS = [b"1" + b"0" * 300, b"1e308", b"1e309", b"9" * 999, b"9" * 1001, b"2147483647", b"2147483648",
                 b"4294967296", b"1000000000", b"2^1024", b"(10^300)^1024", b"10^300", b"1e-320", b"0.0"]


def huge_number(data: bytes, rng: random.Random) -> bytes:
    found = list(_NUMBER.finditer(data))
    if not found:
        return data
    return _replace_spans(data, {rng.choice(found).span(): rng.choice(_HUGE_NUMBERS)})


_LINE_ENDS = [b"\r", b"\r\n", "\u2028".encode(), "\u2029".encode(), "\x85".encode(), b"\f", b"\v", b"\x1c",
              b"\n\r", b"\r\r\n"]


def line_endings(data: bytes, rng: random.Random) -> bytes:
    """Every line end (or one of them) replaced by another line-end-like character."""
    end = rng.choice(_LINE_ENDS)
    if rng.random() < 0.5:
        return data.replace(b"\n", end)
    positions = [i for i, byte in enumerate(data) if byte == ord("\n")]
    if not positions:
        return data
    i = rng.choice(positions)
    return data[:i] + end + data[i + 1:]


MUTATIONS: list[Mutation] = [delete_line, duplicate_line, swap_lines, truncate, insert_bytes, swap_tokens,
                             replace_token, replace_literal, delete_token, duplicate_token, insert_token,
                             deep_nesting, huge_number, line_endings]


def mutants(data: bytes, seed: int, count: int) -> list[tuple[str, bytes]]:
    """`count` mutants, each of one to three stacked mutations, every mutation kind equally often."""
    return [mutant(data, random.Random(seed * 1_000_003 + n), n) for n in range(count)]


def mutant(data: bytes, rng: random.Random, n: int) -> tuple[str, bytes]:
    """The n-th mutant: mutation kind n (cycling through them all), then up to two random ones."""
    kinds = [MUTATIONS[n % len(MUTATIONS)]]
    kinds += [rng.choice(MUTATIONS) for _ in range(rng.choice((0, 0, 0, 1, 2)))]
    out = data
    for kind in kinds:
        out = kind(out, rng) if out.strip() else out
    return "+".join(k.__name__ for k in kinds), out


# Basenames a spec may be saved under that must never reach generated code or a shell: Python string and comment
# terminators with a payload that would create MARKER in the working directory, line breaks, shell syntax, an
# option-like name (argparse: exit 2), undecodable bytes, a very long name.
MARKER = "NCD_FUZZ_MARKER"
HOSTILE_NAMES = [
    f'x""";open("{MARKER}","w");"""y.ncd',
    "x" + "'" * 3 + f";open('{MARKER}','w');" + "'" * 3 + "y.ncd",
    f'x";open("{MARKER}","w");"y.ncd',
    f"x\nopen('{MARKER}','w')\n#.ncd",
    f"x\r__import__('os').system('touch {MARKER}')\r.ncd",
    f"$(touch {MARKER}).ncd",
    f"x`touch {MARKER}`.ncd",
    "x}}{{{{__import__('os')}}.ncd",
    "-x.ncd",
    "x\udcff\udcfe.ncd",
    "x\u202e\u2028\x1b[31m.ncd",
    "a" * 200 + ".ncd",
    "spec.ncd",
]


@pytest.fixture
def front_end_only_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `ncd check` stop after the front end (no kernel family matches), as for non-attention specs."""
    monkeypatch.setattr(ncd.families, "REGISTRY", ())


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_spec_passes_check(spec: Path, front_end_only_check, capsys) -> None:
    # with no kernel family, the front end's checks pass and `ncd check` says nothing was validated (exit 1)
    code, out, err = _run(["check", str(spec)], capsys)
    assert code == 1 and "error[no-kernel-family]" in err, err
    assert f"spec {spec.stem}" in out and "ok   syntax" in out


def test_every_mutation_kind_is_drawn() -> None:
    assert len(SPECS) >= 7
    data = SPECS[0].read_bytes()
    kinds = Counter(mutant(data, random.Random(n), n)[0].split("+")[0] for n in range(3 * len(MUTATIONS)))
    assert set(kinds) == {m.__name__ for m in MUTATIONS} and min(kinds.values()) == 3
    assert deep_nesting(b"out y = x\n", random.Random(1)) != b"out y = x\n"
    assert line_endings(b"a\nb\n", random.Random(2)).count(b"\n") < 2


class Hang(Exception):
    pass


def _classify(argv: list[str], code: int, out: str, err: str) -> str | None:
    if code not in (0, 1, 2):
        return f"exit {code}"
    if "Traceback" in out or "Traceback" in err:
        return "traceback"
    if code == 1 and not re.search(r"error\[[a-z-]+\]", err):
        return "exit 1 without an error message"
    if code == 2 and "error" not in err:
        return "exit 2 without a usage message"
    if code == 0 and argv[0] == "check" and "ok   syntax" not in out:
        return "exit 0 without the check report"
    return None


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """One in-process `ncd` run; longer than RUN_SECONDS is a hang (interrupted by ncd's own time budget)."""
    with time_budget(RUN_SECONDS, Hang):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse: a file name that looks like an option
            code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_mutants_never_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, front_end_only_check,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """Mutants of every shipped spec, round robin, for FUZZ_SECONDS (NCD_FUZZ_SECONDS for a longer run): exit 0, 1
    or 2 only, with a message; no traceback, no hang, and no hostile file name ever runs its payload."""
    monkeypatch.chdir(tmp_path)  # the payloads of HOSTILE_NAMES would create MARKER here; names are passed relative
    monkeypatch.setattr(ncd.limits, "SYMBOLIC_SECONDS", FUZZ_SYMBOLIC_SECONDS)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    originals = [(spec, spec.read_bytes()) for spec in SPECS]
    codes: Counter[int] = Counter()
    kinds: Counter[str] = Counter()
    failures: list[str] = []
    loads = n = 0
    start = time.monotonic()
    while n < 2 * len(SPECS) or time.monotonic() - start < FUZZ_SECONDS:
        spec, original = originals[n % len(SPECS)]
        rng = random.Random(SEED * 7919 + n)
        kind, text = mutant(original, rng, n // len(SPECS))
        kinds[kind.split("+")[0]] += 1
        name = rng.choice(HOSTILE_NAMES) if rng.random() < 0.3 else spec.name
        try:
            (tmp_path / name).write_bytes(text)
        except OSError:  # a name this file system refuses
            name = spec.name
            (tmp_path / name).write_bytes(text)
        runs = [(["check", name], False), (["compile", "--emit", "ir", name], False)]
        if n % 4 == 0:  # a quarter of the mutants also go through planning and code generation
            runs.append((["compile", "--emit", "plan", "--emit", "triton", name], True))
        for argv, back_end in runs:
            try:
                with pytest.MonkeyPatch.context() as patch:
                    if back_end:
                        patch.setattr(ncd.families, "REGISTRY", REAL_FAMILIES)
                    code, out, err = _cli(argv, capsys)
            except Hang:
                code, out, err = -1, "", "hang"
            codes[code] += 1
            problem = _classify(argv, code, out, err)
            if problem:
                failures.append(f"#{n} {kind} {argv[:-1]} {name!r}: {problem}\n{err.strip()[:3000]}\n"
                                f"--- mutant ---\n{text[:3000]!r}")
            if back_end and code == 0 and name != spec.name and loads < LOADS:
                loads += 1  # import the generated module of a hostile-named spec: its name must not run
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(ncd.families, "REGISTRY", REAL_FAMILIES)
                    ncd.load(tmp_path / name, cache_dir=cache)
        (tmp_path / name).unlink()
        n += 1
    elapsed = time.monotonic() - start
    assert not (tmp_path / MARKER).exists(), "a hostile file name ran its payload"
    assert not failures, f"{len(failures)} bad runs of {n} mutants; first:\n" + failures[0]
    summary = {"mutants": n, "runs": sum(codes.values()), "exit codes": dict(sorted(codes.items())),
               "modules imported": loads, "seconds": round(elapsed, 1), "first mutation": dict(sorted(kinds.items()))}
    with capsys.disabled():
        print(f"\nfuzz: {summary}")
    if os.environ.get("NCD_FUZZ_REPORT"):
        Path(os.environ["NCD_FUZZ_REPORT"]).write_text(json.dumps(summary, indent=1) + "\n")
    # The mutations are strong enough to break most mutants and mild enough to leave some valid.
    assert codes[1] > codes[0] > 0
