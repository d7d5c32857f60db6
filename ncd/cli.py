"""The `ncd` command line: `ncd compile`, `ncd check`, `ncd draw`, `ncd tune`, `ncd --version`.

Exit codes: 0 success, 1 the spec has errors, 2 usage errors (bad flags, unreadable file), 3 internal errors.
No spec, however malformed, produces a Python traceback (set NCD_DEBUG=1 to see one for internal errors).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ncd import __version__
from ncd.cache import CacheError
from ncd.errors import NcdError, SpecSyntaxError
from ncd.limits import MAX_AXIS_SIZE
from ncd.pipeline import STAGES, FrontEnd, front_end

if TYPE_CHECKING:
    from ncd.compiler import Compiled
from ncd.printer import format_ast, format_ir
from ncd.settings import settings
from ncd.source import LINE_END, Span

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
        before = LINE_END.split(data[:err.start].decode("utf-8", "replace"))  # the grammar's line ends
        line, col = len(before), len(before[-1]) + 1
        raise SpecSyntaxError(Span(str(p), line, col, line, col + 1),
                              detail=f"the file is not UTF-8 text (byte 0x{data[err.start]:02x})",
                              hint="save the spec as UTF-8") from None


def _front_end(path: str) -> FrontEnd:
    text, filename = _read_spec(path)
    result = front_end(text, filename)
    for warning in result.warnings:
        print(warning.render(), file=sys.stderr)
    return result


def _bindings(pairs: Sequence[str]) -> dict[str, int]:
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if not name.isidentifier() or not value.isdigit() or len(value) > 10 or not 1 <= int(value) <= MAX_AXIS_SIZE:
            raise UsageError(f"--bind takes AXIS=SIZE with an integer size from 1 to {MAX_AXIS_SIZE}, got {pair!r}")
        out[name] = int(value)
    return out


def _stage_text(compiled: Compiled, stage: str) -> str:
    """What `--emit STAGE` prints; the plan and the code come from `compiled`, each derived once."""
    if stage == "ast":
        return format_ast(compiled.ast)
    if stage == "ir":
        return format_ir(compiled.ir)
    if stage == "plan":
        return "\n".join(compiled.selection.describe())
    return compiled.code


_SUFFIX = {"ast": "ast.txt", "ir": "ir.txt", "plan": "plan.txt", "triton": "py"}


def cmd_compile(args: argparse.Namespace) -> int:
    from ncd.compiler import compile_front  # the back end pulls in sympy-heavy passes only when asked for

    result = _front_end(args.spec)
    compiled = compile_front(result, _bindings(args.bind or []), until="verify")
    stages = args.emit or ["triton"]
    texts = [(stage, _stage_text(compiled, stage)) for stage in stages]
    if args.output is None:
        for _, text in texts:
            print(text)
        return EXIT_OK
    out_dir = Path(args.output)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for stage, text in texts:
            target = out_dir / f"{result.program.name}.{_SUFFIX[stage]}"
            target.write_text(text + "\n", encoding="utf-8")
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
BACK_END_CHECKS = (
    ("plan", "a kernel family claims the spec and derives its plan (`--emit plan` shows the certificate)"),
    ("codegen", "the generated module parses and imports"),
)


def _device() -> str:
    """The GPU if there is one; otherwise Triton's CPU interpreter (set before Triton is imported)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if torch.cuda.is_available():
            return "cuda"
        os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def cmd_check(args: argparse.Namespace) -> int:
    from ncd.compiler import advance, compile_front

    device = _device()  # before planning imports any kernel: @triton.jit reads TRITON_INTERPRET at decoration
    result = _front_end(args.spec)
    p = result.program
    print(f"{result.source.filename}: spec {p.name}: "
          f"{len(p.axes)} axes, {len(p.inputs)} inputs, {len(p.params)} parameters, "
          f"{len(p.definitions)} definitions, {len(p.outputs)} outputs")
    for name, what in CHECKS:
        print(f"  ok   {name:<10} {what}")
    try:
        compiled = compile_front(result, until="plan")
    except NcdError:
        print("  --   numerics   not run: no kernel family compiles this spec", flush=True)
        raise
    import torch

    from ncd.ops import Op
    from ncd.validate import check_op, format_rows

    op = Op(advance(compiled))
    for name, what in BACK_END_CHECKS:
        print(f"  ok   {name:<10} {what}" + (f" ({compiled.family})" if name == "plan" else ""))
    where = "GPU" if device == "cuda" else "CPU, Triton interpreter"
    # bf16 runs on the interpreter too (Triton 3.9 here; the kernels upcast its dot operands there)
    print(f"  ..   numerics   output and gradients against the float64 reference of the spec's IR ({where}; "
          "every form the op dispatches to, fp32 and bf16, draws at several scales, odd sizes, NaN-poisoned "
          "outputs; errors over the whole tensor and per row):", flush=True)

    def show(case, report) -> None:
        bad = [r for r in report if not r.ok]
        worst = max(report, key=lambda r: r.margin)
        size = "small sizes" if case.small else "full sizes"
        print(f"       {'ok  ' if not bad else 'FAIL'} {case.label:<28} {case.dtype_name:<9} {size:<11} worst "
              f"{worst.quantity}: {worst.error:.1e} / {worst.tolerance:.0e}, row {worst.row_error:.1e} / "
              f"{worst.row_tolerance:.0e}", flush=True)

    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"       (inputs drawn from seed {seed}: `ncd check --seed {seed}` repeats them)")
    results = check_op(op, (torch.float32, torch.bfloat16), device, seed, on_case=show)
    failed = [(case, report) for case, report in results if not all(r.ok for r in report)]
    first_case, first = results[0]
    print(f"     {first_case.label}, {first_case.dtype_name}:")
    print("\n".join("     " + line for line in format_rows(first)))
    for case, report in failed:
        if case is not first_case:
            print(f"     {case.label}, {case.dtype_name}:")
            print("\n".join("     " + line for line in format_rows(report)))
    notes = [note for _, report in results for note in report.notes]
    print("".join(f"       note: {note}\n" for note in notes), end="")
    print(f"  {'ok  ' if not failed else 'FAIL'} numerics   {len(results) - len(failed)} of {len(results)} cases "
          "passed" + (": " + ", ".join(f"{c.label} ({c.dtype_name})" for c, _ in failed) + " failed"
                      if failed else ""))
    if args.draw is not None:
        fmt = "png" if args.draw.endswith(".png") else "svg"
        print(f"  diagram    {_draw(result, args.draw or None, 'plan', fmt)}")
    return EXIT_OK if not failed else EXIT_SPEC


def _draw(front: FrontEnd, output: str | None, stage: str, fmt: str) -> Path:
    """The diagram written to `output` (default: the spec's name with the format's suffix, here); nothing is
    written unless the drawing succeeded."""
    from ncd.drawing import draw_spec

    data = draw_spec(front, stage, fmt)
    path = Path(output) if output else Path(f"{Path(front.source.filename).stem}.{fmt}")
    try:
        path.write_bytes(data)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror or err}") from None
    return path


def cmd_draw(args: argparse.Namespace) -> int:
    fmt = args.format or (Path(args.output).suffix.lstrip(".") if args.output else "svg")
    if fmt not in ("svg", "png"):
        raise UsageError(f"--format is svg or png (from the output's suffix: {args.output!r}); pass --format")
    path = _draw(_front_end(args.spec), args.output, args.stage, fmt)
    print(path)
    return EXIT_OK


def cmd_tune(args: argparse.Namespace) -> int:
    from ncd.tuning import TuneError, parse_shapes, require_gpu, tune_spec

    try:
        parse_shapes(args.shape or [])
        require_gpu()  # before compiling: say at once when there is nothing to tune on
        tune_spec(args.spec, args.shape or [], args.dtype, args.backward)
    except TuneError as err:
        raise UsageError(str(err)) from None
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ncd", description="Compile neural circuit diagram specs.")
    parser.add_argument("--version", action="version", version=f"ncd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile a spec and print (or write) a stage")
    comp.add_argument("spec", help="path to a .ncd spec")
    comp.add_argument("-o", "--output", metavar="DIR", help="write stages to DIR instead of stdout")
    comp.add_argument("--emit", action="append", choices=STAGES,
                      help="stage to emit (repeatable; default: triton where a kernel family matches, else ir)")
    comp.add_argument("--bind", action="append", metavar="AXIS=SIZE",
                      help="axis sizes the plan's cost estimate uses (repeatable)")
    comp.set_defaults(run=cmd_compile)
    check = sub.add_parser("check", help="check a spec, validate its generated op, and say what was checked")
    check.add_argument("spec", help="path to a .ncd spec")
    check.add_argument("--seed", type=int, metavar="N", help="draw the validation inputs from seed N (default: "
                       "fresh random inputs; the seed used is printed)")
    check.add_argument("--draw", nargs="?", const="", metavar="FILE", help="also draw the spec's diagram (plan "
                       "stage) to FILE (.svg or .png; default: SPEC_NAME.svg here) and print its path")
    check.set_defaults(run=cmd_check)
    draw = sub.add_parser("draw", help="draw a spec as its neural circuit diagram (SVG or PNG)")
    draw.add_argument("spec", help="path to a .ncd spec")
    draw.add_argument("-o", "--output", metavar="FILE", help="where to write (default: SPEC_NAME.FORMAT here)")
    draw.add_argument("--format", choices=("svg", "png"), help="default: from -o's suffix, else svg")
    draw.add_argument("--stage", choices=("ir", "plan"), default="plan", help="ir: the verified IR; plan (default): "
                      "also the family, its streamed axis and state, and the kernel boundaries")
    draw.set_defaults(run=cmd_draw)
    tune = sub.add_parser("tune", help="autotune a spec's kernels at given sizes on this GPU and keep the results")
    tune.add_argument("spec", help="path to a .ncd spec")
    tune.add_argument("--shape", action="append", metavar="AXIS=N", help="an axis size to tune at (repeatable; "
                      "axes not given take the spec's validation sizes)")
    tune.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="input dtype (default bf16)")
    tune.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                      help="also run the backward, tuning its kernels (default: on)")
    tune.set_defaults(run=cmd_tune)
    return parser


def _nesting_error(path: str) -> str:
    """error[nesting] at the spec's most deeply nested construct (at least the file where it does not parse)."""
    from ncd.errors import NestingTooDeep
    from ncd.parser import deepest_span
    from ncd.source import Source

    detail = "the spec nests expressions too deeply to compile"
    try:
        source = Source(_read_spec(path)[0], path)
    except (UsageError, NcdError):
        return NestingTooDeep(Span(path, 1, 1, 1, 2), detail=detail).render()
    span = deepest_span(source) or Span(path, 1, 1, 1, 2)
    return NestingTooDeep(span, detail=f"{detail} (its most deeply nested expression is here)"
                          ).with_source(source).render()


def _run_noting_fallbacks(args: argparse.Namespace) -> int:
    """Run the command; a specialised family that recognised the spec but left it to the generic family is said
    on stderr as a note with its location (other warnings pass through unchanged)."""
    from ncd.backend import FallbackWarning

    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always", FallbackWarning)
            caught = recorded
            return int(args.run(args))
    finally:  # outside the recording context: there showwarning would append to `caught` while it is read
        for w in caught:
            if issubclass(w.category, FallbackWarning):
                print(f"ncd: note: {w.message}", file=sys.stderr)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run_noting_fallbacks(args)
    except NcdError as err:
        print(err.render(), file=sys.stderr)
        return EXIT_SPEC
    except (UsageError, CacheError) as err:
        print(f"ncd: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `ncd compile ... | head`: the reader left; stay quiet, as cat and grep do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SPEC
    except RecursionError:  # the stages report their own (ncd.limits.symbolic_budget); this is the last resort
        print(_nesting_error(args.spec), file=sys.stderr)
        return EXIT_SPEC
    except Exception as err:  # an ncd bug: say so briefly instead of dumping a traceback on the user
        if settings().debug:
            raise
        print(f"ncd: internal error: {type(err).__name__}: {err}\n"
              "  this is a bug in ncd; rerun with NCD_DEBUG=1 for the traceback", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
