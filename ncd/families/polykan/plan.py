"""The polynomial-KAN kernel family: `y[batch outp] = sum_{inp, deg} P_deg(g(x[batch inp])) C[inp outp deg]`,
a basis given by its recurrence in the spec (`basis P(u) { ... }`), evaluated on an element-wise map g of one
input, contracted with a coefficient tensor (PolyKAN, papers/polykan.txt).

Recognition: an output defined as a contraction over `inp deg` whose one side is `P[deg](g(x))` and whose other
side is a plain read of a tensor carrying `inp outp deg`. Anything else with that shape is rejected with a
located `unsupported` error; specs without a basis contraction are not this family's (None).

The plan: the recurrence and its derivative recurrence (basis_lut.py, sympy), g and g' (sympy, printed for
Triton), the basis evaluation (a lookup table sized from an error budget in the measured-best variable, or the
exact recurrence with the family option `basis_eval=recurrence`), the coefficient layout (a layout pass), the
tiling and split-K decisions, and the generated module (render.py).

Also here: `PolyKANLayer` and `ChebyKANLayer`, nn.Modules over the shipped specs (ChebyKAN-compatible).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import sympy
import torch
from torch import nn

from ncd import ir
from ncd.errors import CallError, NcdError
from ncd.families.polykan.basis_lut import ERROR_BUDGET, Choice, Recurrence, Table, U, choose_table
from ncd.families.polykan.config import MATMUL, PolyKANConfig, tiling
from ncd.family import Decline
from ncd.pipeline import FrontEnd
from ncd.symbolic import to_sympy, triton_expr

X = sympy.Symbol("xv", real=True)  # the input element inside the kernels
BASIS_EVAL = ("lut", "recurrence")
OPTIONS = ("basis_eval", "lut_budget", "matmul")


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
    axes = {a.name: a for a in program.axes}

    def leaf(n: ir.Node) -> sympy.Expr | None:
        inlined = ir.inline(program, n)
        if inlined is not n:  # an intermediate: its definition
            return _arg_sympy(program, inlined, loads)
        if isinstance(n, ir.Load):
            loads.append(n)
            return X
        if isinstance(n, ir.Const) or (isinstance(n, ir.SizeOf) and program.axis(n.axis).fixed is not None):
            return None  # the number
        raise UnsupportedPolyKAN(n.span, detail="the basis argument must be an element-wise expression of one "
                                 "input, numbers and fixed sizes", hint="e.g. T[deg](tanh(x))")

    return to_sympy(node, axes, leaf=leaf)


def _recognise(program: ir.Program) -> tuple[PolyKANRoles, Recurrence, sympy.Expr] | Decline:
    found = _find(program)
    if found is None:
        return Decline("no output contracts a basis evaluation (P[deg](x)) with coefficients")
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
    rec = Recurrence.from_ir(basis, {a.name: a for a in program.axes})
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


def constant_prefix(recurrence: Recurrence) -> int:
    """How many leading basis terms are constants (free of u): the LUT reads them exactly, so that P_0 = 1 at a
    NaN argument as in recurrence mode (NaN in -> NaN out only where the value depends on the input)."""
    count = 0
    for p in recurrence.initial:
        if U in sympy.sympify(p).free_symbols:
            break
        count += 1
    return count


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
    matmul: str = "tf32x3"  # the GEMM regime's split products (MATMUL)
    # what the kernels are told (degrees, basis evaluation, layout, operand split, table size); None: derived
    # from the fields above (`default_config`)
    config: PolyKANConfig = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.config is None:
            object.__setattr__(self, "config", self.default_config())

    def default_config(self) -> PolyKANConfig:
        table = self.table
        return PolyKANConfig(self.degrees, self.basis_eval, self.matmul, MATMUL[self.matmul], self.layout, self.perm,
                             None if table is None else table.entries, constant_prefix(self.recurrence))

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
            lines.append("  basis evaluation: the recurrence in fp32, carried through the loop over degrees "
                         "(values and derivatives)"
                         + (f" — {self.note}" if self.note else ""))
        lines += [
            f"  coefficient layout (layout pass): spec [{' '.join(r.c_axes)}] -> kernel [{' '.join(self.layout)}] "
            f"(permute{self.perm}); one dense [{r.inp} {r.outp}] matrix per degree, {r.outp} unit-stride; a "
            "tensor whose strides already give this layout is read without a copy",
            "  matrix products (fp32 in, fp32 accumulation): launch-bound sizes use tl.dot with input_precision "
            "tf32x3 (three TF32 products, fp32 accuracy); large sizes split each operand once per element into "
            f"{MATMUL[self.matmul]} parts (hi + lo) and issue the three products hi.lo + lo.hi + hi.hi as plain "
            f"tensor-core dots (option matmul={self.matmul}); ieee in the CPU interpreter",
        ]
        b = {a: self.bindings.get(a, 1) for a in (r.batch, r.inp, r.outp)}
        til = tiling(b[r.batch], b[r.inp], b[r.outp], self.degrees, GPU_SMS, split=MATMUL[self.matmul])
        fwd_n, bwd_n = til.launches(self.basis_eval)
        lines += [
            f"tiling at {' '.join(f'{k}={v}' for k, v in b.items())} ({GPU_SMS} SMs): regime {til.regime}",
            *til.describe(r, self.basis_eval),
            f"  launches per training step (eager): forward {fwd_n}, backward {bwd_n}; the eager path calls the "
            "kernels from a torch.autograd.Function (torch.compile sees a torch.library custom op)",
            *self.config.describe(),
        ]
        return lines

    def render(self, program: ir.Program, op_id: str) -> str:
        from ncd.families.polykan.render import render_polykan_op

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


def plan_polykan(front: FrontEnd, bindings: dict[str, int]) -> PolyKANPlan | Decline:
    """The polynomial-KAN family claims specs whose output contracts a basis evaluation with coefficients."""
    program = front.program
    found = _recognise(program)
    if isinstance(found, Decline):
        return found
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
    matmul = front.option("matmul", "tf32x3")
    if matmul not in MATMUL:
        raise UnsupportedPolyKAN(None, detail=f"matmul must be one of {tuple(MATMUL)}, got {matmul!r}")
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
                       note, matmul)


# --- nn.Modules ----------------------------------------------------------------------------------------------

SPEC_FILES = {"chebyshev": "cheby_kan.ncd", "legendre": "legendre_kan.ncd", "hermite": "hermite_kan.ncd"}


def spec_path(basis: str) -> Path:
    """The shipped spec of `basis` (installed as package data `ncd.specs`)."""
    return Path(str(resources.files("ncd.specs").joinpath(SPEC_FILES[basis])))


SPECS = {basis: spec_path(basis).read_text(encoding="utf-8") for basis in SPEC_FILES}
_OPS: dict[tuple[str, int, str, str], Any] = {}


def basis_op(basis: str, degree: int, basis_eval: str = "lut", cache_dir: str | Path | None = None) -> Any:
    """The compiled op of the shipped `basis` spec at `degree` (its `deg` axis overridden to degree + 1)."""
    from ncd.ops import load

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

    layout="spec" (default) stores them contiguous [in, out, degree + 1], as ChebyKAN does: every parameter is
    contiguous (torch.nn.utils.parameters_to_vector, flat optimizers and flat checkpoints work); the op reorders
    them to its kernel layout on every call (one copy forward, one for the gradient; measured in
    bench/polykan.py). layout="kernel" stores them in the kernel's layout [degree + 1, input_dim, output_dim]
    and exposes the parameter as a permuted view with the public shape, which the op reads with no copy; that
    parameter is not contiguous, so code that views parameters flat (parameters_to_vector) fails on it.

    Inputs: [..., input_dim]; leading dims are flattened into the batch. A last dim other than input_dim is a
    CallError (ChebyKAN's reshape(-1, input_dim) would silently regroup the elements into other rows).

    Picklable (copy.deepcopy, pickle, torch.save of a whole model): the compiled op is not part of the pickled
    state; unpickling loads it again from the shipped spec (served from the cache)."""

    _coeffs_name = "coeffs"

    def __init__(self, input_dim: int, output_dim: int, degree: int, basis: str = "chebyshev", *,
                 basis_eval: str = "lut", layout: str = "spec", cache_dir: str | Path | None = None) -> None:
        super().__init__()
        if layout not in ("kernel", "spec"):
            raise ValueError(f"layout must be 'kernel' or 'spec', got {layout!r}")
        self.inputdim = input_dim
        self.outdim = output_dim
        self.degree = degree
        self.basis = basis
        self.layout = layout
        self.basis_eval = basis_eval
        self._cache_dir = None if cache_dir is None else str(cache_dir)
        self._attach_op()
        if layout == "kernel":
            storage = torch.empty(degree + 1, input_dim, output_dim)
            coeffs = nn.Parameter(storage.permute(1, 2, 0))
        else:
            coeffs = nn.Parameter(torch.empty(input_dim, output_dim, degree + 1))
        nn.init.normal_(coeffs, mean=0.0, std=1 / (input_dim * (degree + 1)))
        self.register_parameter(self._coeffs_name, coeffs)

    def _attach_op(self) -> None:
        self._op = basis_op(self.basis, self.degree, self.basis_eval, self._cache_dir)
        # the generated module's op object's call, bound: no Op.__call__ hop, nor the module function's, per step
        op = getattr(self._op.module, "_OP", None)
        self._fn = op.__call__ if op is not None else self._op.fn
        program = self._op.front.program
        self._x_name = program.inputs[0].name
        self._inp_axis = program.inputs[0].axes[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_op", "_fn"):  # the generated module and its function: not picklable, rebuilt on load
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._attach_op()

    @property
    def coefficients(self) -> torch.Tensor:
        return getattr(self, self._coeffs_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            if x.dim() == 0 or x.shape[-1] != self.inputdim:
                raise self._width_error(x)
            x = torch.reshape(x, (-1, self.inputdim))  # leading dims flattened into the batch
        elif x.shape[1] != self.inputdim:
            raise self._width_error(x)
        return self._fn(x, self._parameters[self._coeffs_name])  # [batch, output_dim] already

    def _width_error(self, x: torch.Tensor) -> CallError:
        last = f"has size {x.shape[-1]}" if x.dim() else "is missing (a 0-dim tensor)"
        return CallError(None, detail=f"{type(self).__name__}: {self._x_name}: axis '{self._inp_axis}' (the last "
                         f"dim of shape {list(x.shape)}) {last}, but this layer has input_dim {self.inputdim}; "
                         "inputs are [..., input_dim] (leading dims are flattened into the batch)")

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
