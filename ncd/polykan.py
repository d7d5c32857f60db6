"""The polynomial-KAN kernel family: `y[batch outp] = sum_{inp, deg} P_deg(g(x[batch inp])) C[inp outp deg]`,
a basis given by its recurrence in the spec (`basis P(u) { ... }`), evaluated on an element-wise map g of one
input, contracted with a coefficient tensor (PolyKAN, papers/polykan.txt).

Recognition: an output defined as a contraction over `inp deg` whose one side is `P[deg](g(x))` and whose other
side is a plain read of a tensor carrying `inp outp deg`. Anything else with that shape is rejected with a
located `unsupported` error; specs without a basis contraction are not this family's (None).

The plan: the recurrence and its derivative recurrence (ncd/basis_lut.py, sympy), g and g' (sympy, printed for
Triton), the basis evaluation (a lookup table sized from an error budget in the measured-best variable, or the
exact recurrence with the family option `basis_eval=recurrence`), the coefficient layout (a layout pass), the
tiling and split-K decisions, and the generated module (codegen/polykan.py).

Also here: `PolyKANLayer` and `ChebyKANLayer`, nn.Modules over the shipped specs (ChebyKAN-compatible).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import sympy
import torch
from torch import nn

from . import ir
from .basis_lut import ERROR_BUDGET, Choice, Recurrence, Table, choose_table
from .errors import NcdError
from .pipeline import FrontEnd
from .symbolic import SYMPY_FUNCTIONS, to_sympy, triton_expr

X = sympy.Symbol("xv", real=True)  # the input element inside the kernels
BASIS_EVAL = ("lut", "recurrence")
OPTIONS = ("basis_eval", "lut_budget")


class UnsupportedPolyKAN(NcdError):
    code = "unsupported"
    template = "{detail}"


@dataclass(frozen=True)
class PolyKANRoles:
    x: str  # the input read by the basis argument
    coeffs: str  # the coefficient tensor
    output: str
    batch: str
    inp: str
    outp: str
    deg: str
    basis: str
    x_axes: tuple[str, ...]  # as declared
    c_axes: tuple[str, ...]
    out_axes: tuple[str, ...]
    arg_origin: str  # spec.ncd:LINE of the basis evaluation
    basis_origin: str
    out_origin: str


def _plain_load(program: ir.Program, node: ir.Node) -> ir.Load | None:
    node = ir.inline(program, node)
    if isinstance(node, ir.Load) and program.tensor(node.tensor).role in ("in", "param") \
            and tuple(i.axis for i in node.index) == program.tensor(node.tensor).axes:
        return node
    return None


def _find(program: ir.Program) -> tuple[ir.Definition, ir.Contract, ir.BasisEval, ir.Node] | None:
    """The output definition that contracts a basis evaluation, or None (not this family's spec)."""
    for t in program.outputs:
        d = program.definition(t.name)
        value = ir.inline(program, d.value)
        if not isinstance(value, ir.Contract):
            continue
        lhs, rhs = ir.inline(program, value.lhs), ir.inline(program, value.rhs)
        if isinstance(lhs, ir.BasisEval):
            return d, value, lhs, value.rhs
        if isinstance(rhs, ir.BasisEval):
            return d, value, rhs, value.lhs
    return None


def _arg_sympy(program: ir.Program, node: ir.Node, loads: list[ir.Load]) -> sympy.Expr:
    """The basis argument as sympy in X, collecting the tensor reads it makes."""
    node = ir.inline(program, node)
    if isinstance(node, ir.Load):
        loads.append(node)
        return X
    if isinstance(node, ir.Unary):
        arg = _arg_sympy(program, node.arg, loads)
        return -arg if node.fn == "neg" else SYMPY_FUNCTIONS[node.fn](arg)
    if isinstance(node, ir.Binary) and not node.boolean:
        lhs, rhs = _arg_sympy(program, node.lhs, loads), _arg_sympy(program, node.rhs, loads)
        return {"+": lhs + rhs, "-": lhs - rhs, "*": lhs * rhs, "/": lhs / rhs,
                "max": sympy.Max(lhs, rhs), "min": sympy.Min(lhs, rhs)}[node.op]
    if isinstance(node, ir.Pow):
        return _arg_sympy(program, node.base, loads) ** node.exponent
    if isinstance(node, ir.Const):
        return to_sympy(node)
    if isinstance(node, ir.SizeOf) and program.axis(node.axis).fixed is not None:
        return sympy.Integer(program.axis(node.axis).fixed or 0)
    raise UnsupportedPolyKAN(node.span, detail="the basis argument must be an element-wise expression of one "
                             "input, numbers and fixed sizes", hint="e.g. T[deg](tanh(x))")


def _recognise(program: ir.Program) -> tuple[PolyKANRoles, Recurrence, sympy.Expr] | None:
    found = _find(program)
    if found is None:
        return None
    definition, contract, basis_eval, other = found
    if len(program.outputs) != 1:
        raise UnsupportedPolyKAN(definition.span, detail="the polynomial-KAN kernels compute one output; this spec "
                                 f"declares {len(program.outputs)}")
    if not isinstance(basis_eval.index, str):
        raise UnsupportedPolyKAN(basis_eval.span, detail="the basis must grow a degree axis (P[deg](...)) to be "
                                 "contracted", hint="declare `axis deg = DEGREE + 1` and write P[deg](ARG)")
    deg = basis_eval.index
    arg = basis_eval.arg
    if len(arg.axes) != 2:
        raise UnsupportedPolyKAN(arg.span, detail=f"the basis argument must carry two axes [batch inp]; it carries "
                                 f"[{' '.join(arg.axes)}]")
    over = set(contract.over)
    inp_axes = [a for a in arg.axes if a in over]
    if over != {deg, *inp_axes} or len(inp_axes) != 1:
        raise UnsupportedPolyKAN(contract.span, detail=f"the contraction must be over the input axis and '{deg}' "
                                 f"(over {' '.join(contract.over)})")
    inp = inp_axes[0]
    batch = next(a for a in arg.axes if a != inp)
    loads: list[ir.Load] = []
    g = _arg_sympy(program, arg, loads)
    if len({ld.tensor for ld in loads}) != 1 or any(
            tuple(i.axis for i in ld.index) != program.tensor(ld.tensor).axes for ld in loads) \
            or program.tensor(loads[0].tensor).role != "in":
        raise UnsupportedPolyKAN(arg.span, detail="the basis argument must read exactly one `in` tensor, whole "
                                 "(not relabelled or indexed)")
    x = loads[0].tensor
    coeff = _plain_load(program, other)
    if coeff is None:
        raise UnsupportedPolyKAN(other.span, detail="the coefficients must be a plain read of an `in` or `param` "
                                 "tensor")
    c_axes = program.tensor(coeff.tensor).axes
    outs = [a for a in c_axes if a not in (inp, deg)]
    if len(c_axes) != 3 or len(outs) != 1 or set(c_axes) != {inp, deg, outs[0]}:
        raise UnsupportedPolyKAN(coeff.span, detail=f"the coefficients must carry [{inp} OUT {deg}] in some order; "
                                 f"'{coeff.tensor}' carries [{' '.join(c_axes)}]")
    outp = outs[0]
    out = program.tensor(definition.tensor)
    if set(out.axes) != {batch, outp}:
        raise UnsupportedPolyKAN(out.span, detail=f"the output must be [{batch} {outp}] in some order")
    for a in (batch, inp, outp, deg):
        if program.axis(a).factors or program.axis(a).alias_of:
            raise UnsupportedPolyKAN(program.axis(a).span, detail=f"axis '{a}' is split or an alias; the "
                                     "polynomial-KAN kernels take plain axes")
    basis = next(b for b in program.bases if b.name == basis_eval.basis)
    for node in (*basis.initial, basis.step):
        for sub in ir.walk(node):
            if isinstance(sub, ir.Unary | ir.Where) or (isinstance(sub, ir.Binary) and sub.op in ("max", "min")):
                raise UnsupportedPolyKAN(sub.span, detail="the basis rules must be polynomial in the argument "
                                         "(+ - * / and integer powers)")
    rec = Recurrence.from_ir(basis)
    roles = PolyKANRoles(x, coeff.tensor, out.name, batch, inp, outp, deg, basis.name, program.tensor(x).axes,
                         c_axes, out.axes, basis_eval.span.origin, basis.span.origin, out.span.origin)
    return roles, rec, g


def _domain(g: sympy.Expr) -> tuple[float, float] | None:
    """The closure of g's range over the reals (sympy), or None when unbounded or unknown."""
    from sympy.calculus.util import function_range

    try:
        r = function_range(g, X, sympy.S.Reals)
    except Exception:
        return None
    if not isinstance(r, sympy.Interval) or not (r.inf.is_finite and r.sup.is_finite):
        return None
    return float(r.inf), float(r.sup)


# --- coefficient layout -----------------------------------------------------------------------------------


def coefficient_layout(roles: PolyKANRoles) -> tuple[tuple[str, str, str], tuple[int, int, int]]:
    """The layout pass. Every kernel reads the coefficients one degree at a time as a dense [inp, outp] matrix
    with outp unit-stride: the forward's B operand (output-aligned tiles: [BI, BN] rows along outp), dX's
    transposed operand (the same tile, transposed in registers) and dC's output tile ([BI, BO], stored
    row-major). So deg is outermost, then inp, then outp. Returns the kernel layout and the permutation
    taking the spec layout to it (identity: no reorder)."""
    layout = (roles.deg, roles.inp, roles.outp)
    perm = tuple(roles.c_axes.index(a) for a in layout)
    return layout, (perm[0], perm[1], perm[2])


# --- tiling --------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Launch:
    """One kernel's launch: grid, blocks (fwd: BM BN BI; dX: BM BI BO; dC: BI BO BM), split of the reduced axis."""

    grid: tuple[int, int, int]
    blocks: tuple[int, int, int]
    split: int
    per_split: int  # elements of the reduced axis per split
    warps: int
    stages: int

    def describe(self, reduced: str) -> str:
        tail = f"split-{reduced} {self.split} (partial + combine)" if self.split > 1 else "no split"
        return (f"grid {self.grid[0]}x{self.grid[1]}x{self.grid[2]} = {math.prod(self.grid)} programs, blocks "
                f"{self.blocks}, {tail}, {self.warps} warps, {self.stages} stages")


@dataclass(frozen=True)
class Tiling:
    fwd: Launch
    dx: Launch
    dc: Launch

    def launches(self) -> tuple[int, int]:
        return 1 + (self.fwd.split > 1), 2 + (self.dx.split > 1) + (self.dc.split > 1)


def _split(tiles: int, blocks: int, target: int) -> tuple[int, int]:
    """Split `blocks` reduction blocks so that tiles * split reaches `target` programs: (split, blocks each)."""
    want = max(1, min(blocks, _cdiv(target, max(tiles, 1))))
    per = _cdiv(blocks, want)
    return _cdiv(blocks, per), per


def tiling(batch: int, inp: int, outp: int, degrees: int, sms: int, interpret: bool = False) -> Tiling:
    """Output-aligned 2D tiles; the reduced axis (inp for the forward, outp for dX, batch for dC) is split so
    that small problems still give about two programs per SM; one config under the CPU interpreter."""
    target = 2 * sms
    if interpret:
        bm, bn, bi, bo, warps, stages = 16, 16, 16, 16, 1, 1
        fb, xb, cb = (bm, bn, bi), (bm, bi, bo), (bi, bo, bm)
        fw = xw = cw = warps
    else:
        bm = 16 if batch <= 16 else 32 if batch <= 32 else 64 if batch <= 64 else (
            128 if batch * outp >= 128 * 128 * sms // 2 else 64)
        fb = (bm, 128 if bm == 128 else 64, 32)
        xb = (bm, 64 if bm == 128 else 32, 64)
        big = batch * degrees >= 4096
        cb = (128, 128, 32) if big and inp >= 128 and outp >= 128 else (32, 64, 32)
        fw = 8 if fb[0] * fb[1] >= 128 * 128 else 4
        xw = 8 if xb[0] * xb[1] >= 128 * 64 else 4
        cw = 8 if cb[0] * cb[1] >= 128 * 128 else 4
        stages = 3
    tiles = _cdiv(batch, fb[0]) * _cdiv(outp, fb[1])
    s, per = _split(tiles, _cdiv(inp, fb[2]), target)
    fwd = Launch((_cdiv(batch, fb[0]), _cdiv(outp, fb[1]), s), fb, s, per * fb[2], fw, stages)
    tiles = _cdiv(batch, xb[0]) * _cdiv(inp, xb[1])
    s, per = _split(tiles, _cdiv(outp, xb[2]), target)
    dx = Launch((_cdiv(batch, xb[0]), _cdiv(inp, xb[1]), s), xb, s, per * xb[2], xw, stages)
    tiles = _cdiv(inp, cb[0]) * degrees * _cdiv(outp, cb[1])
    s, per = _split(tiles, _cdiv(batch, cb[2]), target)
    dc = Launch((_cdiv(inp, cb[0]) * degrees, _cdiv(outp, cb[1]), s), cb, s, per * cb[2], cw, stages)
    return Tiling(fwd, dx, dc)


# --- the plan ------------------------------------------------------------------------------------------------

DEFAULT_BINDINGS = {"batch": 128, "inp": 40, "outp": 256}  # the first paper config
GPU_SMS = 132  # H100 / H200, for the plan's tiling table


@dataclass(frozen=True)
class PolyKANPlan:
    family = "polykan"
    roles: PolyKANRoles
    recurrence: Recurrence
    degrees: int
    arg: sympy.Expr  # g(x) in X
    darg: sympy.Expr
    domain: tuple[float, float] | None
    basis_eval: str  # lut | recurrence (what the kernels do)
    requested: str  # what the option asked for
    budget: float
    choice: Choice | None
    layout: tuple[str, str, str]
    perm: tuple[int, int, int]
    bindings: dict[str, int]
    note: str = ""

    @property
    def output(self) -> str:
        return self.roles.output

    @property
    def table(self) -> Table | None:
        return self.choice.table if self.choice is not None and self.basis_eval == "lut" else None

    def describe(self) -> list[str]:
        r = self.roles
        lines = [
            "kernel family: polynomial KAN (basis expansion fused with the contraction)",
            f"  {r.output}[{r.batch} {r.outp}] = sum over {r.inp} {r.deg} of {r.basis}[{r.deg}](u) * "
            f"{r.coeffs}[{' '.join(r.c_axes)}],  u = {sympy.sstr(self.arg.subs(X, sympy.Symbol(r.x)))}  "
            f"({r.arg_origin})",
            f"  degrees: {self.degrees} ({r.deg} = {self.degrees}: P_0 .. P_{self.degrees - 1})",
            f"  basis {r.basis} ({r.basis_origin}), recurrence and its derivative recurrence (sympy):",
            *("    " + line for line in self.recurrence.describe()),
            f"  du/d{r.x} = {sympy.sstr(self.darg.subs(X, sympy.Symbol(r.x)))}",
            "  range of u (sympy): " + (f"[{self.domain[0]:g}, {self.domain[1]:g}]" if self.domain else "unbounded"),
        ]
        if self.choice is not None:
            lines.append(f"  lookup-table candidates at basis max relative error <= {self.budget:g} (fp32, values "
                         "and derivatives, measured):")
            for name, n in self.choice.needed:
                lines.append(f"    t = {name}: " + (f"{n} entries" if n is not None else "over the size cap"))
        t = self.table
        if t is not None:
            lines += [
                f"  basis evaluation: lookup table in t = {t.param.name} on [{t.param.lo:.6g}, {t.param.hi:.6g}], "
                f"{t.entries} entries x {t.degrees} degrees, values + derivatives = {t.nbytes / 1024:.1f} KiB fp32, "
                "linear interpolation",
                f"    measured basis max relative error: values {t.error:.3g}, derivatives {t.derror:.3g} "
                f"(budget {t.budget:g})",
                "    dX uses the derivative table (P' from the derivative recurrence, sampled in float64): no "
                "derivative through t(u)",
            ]
        else:
            lines.append("  basis evaluation: the recurrence, unrolled in fp32 (values and derivatives)"
                         + (f" — {self.note}" if self.note else ""))
        lines += [
            f"  coefficient layout (layout pass): spec [{' '.join(r.c_axes)}] -> kernel [{' '.join(self.layout)}] "
            f"(permute{self.perm}); one dense [{r.inp} {r.outp}] matrix per degree, {r.outp} unit-stride; a "
            "tensor whose strides already give this layout is read without a copy",
            "  matrix products: tl.dot, input_precision tf32x3 on the GPU (three TF32 products, fp32 accuracy), "
            "ieee in the CPU interpreter; fp32 accumulation",
        ]
        b = {a: self.bindings.get(a, 1) for a in (r.batch, r.inp, r.outp)}
        til = tiling(b[r.batch], b[r.inp], b[r.outp], self.degrees, GPU_SMS)
        fwd_n, bwd_n = til.launches()
        lines += [
            f"tiling at {' '.join(f'{k}={v}' for k, v in b.items())} ({GPU_SMS} SMs):",
            f"  forward  (x, C -> {r.output}): " + til.fwd.describe(r.inp),
            f"  backward dX (dy, C -> d{r.x}):  " + til.dx.describe(r.outp),
            f"  backward dC (x, dy -> d{r.coeffs}): " + til.dc.describe(r.batch),
            f"  launches: forward {fwd_n}, backward {bwd_n}; no atomics (two-stage reduction: partials, then "
            "one combine kernel)",
        ]
        return lines

    def render(self, program: ir.Program, op_id: str) -> str:
        from .codegen.polykan import render_polykan_op

        return render_polykan_op(program, self, op_id)

    def constant_inputs(self) -> frozenset[str]:
        return frozenset()

    def validation_sizes(self, program: ir.Program) -> dict[str, int]:
        """Odd sizes, none a multiple of a block; large enough that every split-K path runs."""
        r = self.roles
        sizes = {r.batch: 21, r.inp: 41, r.outp: 19}
        for axis in program.axes:
            if axis.fixed is not None:
                sizes[axis.name] = axis.fixed
        return sizes


def plan_polykan(front: FrontEnd, bindings: dict[str, int]) -> PolyKANPlan | None:
    """The polynomial-KAN family claims specs whose output contracts a basis evaluation with coefficients."""
    program = front.program
    found = _recognise(program)
    if found is None:
        return None
    roles, rec, g = found
    unknown = [k for k, _ in front.options if k not in OPTIONS]
    if unknown:
        raise UnsupportedPolyKAN(None, detail=f"unknown polykan option(s) {unknown}; known: {list(OPTIONS)}")
    requested = front.option("basis_eval", "lut")
    if requested not in BASIS_EVAL:
        raise UnsupportedPolyKAN(None, detail=f"basis_eval must be one of {BASIS_EVAL}, got {requested!r}")
    try:
        budget = float(front.option("lut_budget", str(ERROR_BUDGET)))
    except ValueError:
        raise UnsupportedPolyKAN(None, detail="lut_budget must be a number") from None
    if not (1e-7 <= budget <= 1e-1):
        raise UnsupportedPolyKAN(None, detail=f"lut_budget must lie in [1e-7, 0.1], got {budget:g}")
    degrees = program.axis(roles.deg).fixed or 1
    darg = sympy.diff(g, X)
    try:
        triton_expr(g)
        triton_expr(darg)
    except ValueError as err:
        raise UnsupportedPolyKAN(None, detail=f"the basis argument cannot be lowered to Triton: {err}") from None
    domain = _domain(g)
    choice, mode, note = None, requested, ""
    if requested == "lut":
        if domain is None:
            mode, note = "recurrence", "the argument's range is unbounded (or unknown to sympy), so no table covers it"
        else:
            choice = choose_table(rec, degrees, domain[0], domain[1], budget)
            if choice.table is None:
                mode, note = "recurrence", "no table within the size cap meets the error budget"
    layout, perm = coefficient_layout(roles)
    bound = {a: bindings.get(a, DEFAULT_BINDINGS.get(role, 64)) for a, role in
             ((roles.batch, "batch"), (roles.inp, "inp"), (roles.outp, "outp"))}
    for a in bound:
        if program.axis(a).fixed is not None:
            bound[a] = program.axis(a).fixed or 1
    return PolyKANPlan(roles, rec, degrees, g, darg, domain, mode, requested, budget, choice, layout, perm, bound,
                       note)


# --- nn.Modules ----------------------------------------------------------------------------------------------

SPEC_FILES = {"chebyshev": "cheby_kan.ncd", "legendre": "legendre_kan.ncd", "hermite": "hermite_kan.ncd"}


def spec_path(basis: str) -> Path:
    """The shipped spec of `basis` (installed as package data `ncd.specs`)."""
    return Path(str(resources.files("ncd.specs").joinpath(SPEC_FILES[basis])))


SPECS = {basis: spec_path(basis).read_text(encoding="utf-8") for basis in SPEC_FILES}
_OPS: dict[tuple[str, int, str, str], Any] = {}


def basis_op(basis: str, degree: int, basis_eval: str = "lut", cache_dir: str | Path | None = None) -> Any:
    """The compiled op of the shipped `basis` spec at `degree` (its `deg` axis overridden to degree + 1)."""
    from .ops import load

    if basis not in SPECS:
        raise ValueError(f"basis must be one of {tuple(SPECS)}, got {basis!r}")
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 0:
        raise ValueError(f"degree must be a non-negative integer, got {degree!r}")
    key = (basis, degree, basis_eval, str(cache_dir))
    if key not in _OPS:
        _OPS[key] = load(spec_path(basis), cache_dir, sizes={"deg": degree + 1}, options={"basis_eval": basis_eval})
    return _OPS[key]


class PolyKANLayer(nn.Module):
    """y[b, o] = sum_i sum_d C[i, o, d] P_d(tanh x[b, i]) for P in {chebyshev, legendre, hermite}, compiled from
    the shipped spec. The coefficients have the public shape [input_dim, output_dim, degree + 1].

    layout="kernel" (default) stores them in the kernel's layout [degree + 1, input_dim, output_dim] and exposes
    the parameter as a permuted view with the public shape: state_dict, load_state_dict, optimizers and
    `.to()` see the ChebyKAN shape, and the op reads the storage with no copy. layout="spec" stores them
    contiguous [in, out, degree + 1]; the op then reorders them on every call (one copy forward, one for the
    gradient) — the cost is measured in bench/polykan.py."""

    _coeffs_name = "coeffs"

    def __init__(self, input_dim: int, output_dim: int, degree: int, basis: str = "chebyshev", *,
                 basis_eval: str = "lut", layout: str = "kernel", cache_dir: str | Path | None = None) -> None:
        super().__init__()
        if layout not in ("kernel", "spec"):
            raise ValueError(f"layout must be 'kernel' or 'spec', got {layout!r}")
        self.inputdim = input_dim
        self.outdim = output_dim
        self.degree = degree
        self.basis = basis
        self.layout = layout
        self._op = basis_op(basis, degree, basis_eval, cache_dir)
        if layout == "kernel":
            storage = torch.empty(degree + 1, input_dim, output_dim)
            coeffs = nn.Parameter(storage.permute(1, 2, 0))
        else:
            coeffs = nn.Parameter(torch.empty(input_dim, output_dim, degree + 1))
        nn.init.normal_(coeffs, mean=0.0, std=1 / (input_dim * (degree + 1)))
        self.register_parameter(self._coeffs_name, coeffs)

    @property
    def coefficients(self) -> torch.Tensor:
        return getattr(self, self._coeffs_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.reshape(x, (-1, self.inputdim))
        y = self._op(x, self.coefficients)
        return y.view(-1, self.outdim)

    def extra_repr(self) -> str:
        return (f"input_dim={self.inputdim}, output_dim={self.outdim}, degree={self.degree}, basis={self.basis!r}, "
                f"layout={self.layout!r}")


class ChebyKANLayer(PolyKANLayer):
    """A drop-in for ChebyKAN's ChebyKANLayer: `cheby_coeffs [in, out, degree+1]`, init N(0, 1/(in (degree+1))),
    the `arange` buffer, state_dict keys and shapes unchanged."""

    _coeffs_name = "cheby_coeffs"

    def __init__(self, input_dim: int, output_dim: int, degree: int, **kwargs: Any) -> None:
        super().__init__(input_dim, output_dim, degree, "chebyshev", **kwargs)
        self.register_buffer("arange", torch.arange(0, degree + 1, 1))
