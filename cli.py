"""The `ncd` command line: `ncd compile`, `ncd check`, `ncd --version`.

Exit codes: 0 success, 1 the spec has errors, 2 usage errors (bad flags, unreadable file), 3 internal errors.
No spec, however malformed, produces a Python traceback (set NCD_DEBUG=1 to see one for internal errors).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ncd import __version__
from ncd.errors import NcdError, SpecSyntaxError
from ncd.pipeline import STAGES, FrontEnd, front_end
from ncd.printer import format_ast, format_ir
from ncd.settings import settings
from ncd.source import Span

EXIT_OK, EXIT_SPEC, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class UsageError(Exception):
    pass


def _read_spec(path: str) -> tuple[str, str]:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as err:
        raise UsageError(f"cannot read spec {path}: {err.strerror or err}") from None
    try:
        return data.decode("utf-8"), str(p)
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        col = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise SpecSyntaxError(Span(str(p), line, col, line, col + 1),
                              detail=f"the file is not UTF-8 text (byte 0x{data[err.start]:02x})",
                              hint="save the spec as UTF-8") from None


def _front_end(path: str) -> FrontEnd:
    text, filename = _read_spec(path)
    result = front_end(text, filename)
    for warning in result.warnings:
        print(warning.render(), file=sys.stderr)
    return result


def _stage_text(result: FrontEnd, stage: str) -> str:
    return format_ast(result.module) if stage == "ast" else format_ir(result.program)


def cmd_compile(args: argparse.Namespace) -> int:
    result = _front_end(args.spec)
    stages = args.emit or [STAGES[-1]]
    if args.output is None:
        for stage in stages:
            print(_stage_text(result, stage))
        return EXIT_OK
    out_dir = Path(args.output)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for stage in stages:
            target = out_dir / f"{result.program.name}.{stage}.txt"
            target.write_text(_stage_text(result, stage) + "\n", encoding="utf-8")
            print(f"wrote {target}")
    except OSError as err:
        raise UsageError(f"cannot write to {out_dir}: {err.strerror or err}") from None
    return EXIT_OK


CHECKS = (
    ("syntax", "the text parses with the ncd grammar"),
    ("names", "every name is declared once, is a safe identifier, and is used (warnings for unused inputs)"),
    ("axes", "every wire has declared axes with a fixed or call-time size; contractions, reductions, "
             "broadcasts, relabels and indices agree in axis and size"),
    ("structure", "definitions form an acyclic graph; normalize/scan/chebyshev_solve/basis are well formed"),
    ("ir", "the IR verifier's invariants hold"),
)
NOT_YET = "streamability, tiling, code generation and numerical validation are not implemented yet"


def cmd_check(args: argparse.Namespace) -> int:
    result = _front_end(args.spec)
    p = result.program
    print(f"{result.source.filename}: spec {p.name}: "
          f"{len(p.axes)} axes, {len(p.inputs)} inputs, {len(p.params)} parameters, "
          f"{len(p.definitions)} definitions, {len(p.outputs)} outputs")
    for name, what in CHECKS:
        print(f"  ok   {name:<10} {what}")
    print(f"  --   not checked: {NOT_YET}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ncd", description="Compile neural circuit diagram specs.")
    parser.add_argument("--version", action="version", version=f"ncd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile a spec and print (or write) a stage")
    comp.add_argument("spec", help="path to a .ncd spec")
    comp.add_argument("-o", "--output", metavar="DIR", help="write stages to DIR instead of stdout")
    comp.add_argument("--emit", action="append", choices=STAGES,
                      help=f"stage to emit (repeatable; default: {STAGES[-1]})")
    comp.set_defaults(run=cmd_compile)
    check = sub.add_parser("check", help="check a spec and say what was checked")
    check.add_argument("spec", help="path to a .ncd spec")
    check.set_defaults(run=cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except NcdError as err:
        print(err.render(), file=sys.stderr)
        return EXIT_SPEC
    except UsageError as err:
        print(f"ncd: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except RecursionError:
        print(f"{args.spec}: error[nesting]: the spec nests expressions too deeply to compile", file=sys.stderr)
        return EXIT_SPEC
    except Exception as err:  # an ncd bug: say so briefly instead of dumping a traceback on the user
        if settings().debug:
            raise
        print(f"ncd: internal error: {type(err).__name__}: {err}\n"
              "  this is a bug in ncd; rerun with NCD_DEBUG=1 for the traceback", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
