"""The group-rational kernel family: element-wise activations of one input with learned per-group coefficients.

A spec belongs to this family when its one output is an element-wise function of ONE input tensor
`x[row chan]` and of parameters read at the group factor of the split axis `chan = group * width` (or at no
wire at all: coefficients shared by every group) and at finite-sum indices. KAT's group rational activation
(`specs/kat_rational.ncd`) and the paper form (`specs/group_rational.ncd`) are two such specs, at any degrees
and group counts.

The pass inlines the spec's intermediates into one scalar sympy formula F(x; c_0, ..., c_{K-1}) by unrolling
every finite sum (each parameter entry becomes one coefficient symbol), derives dF/dx and every dF/dc_k with
sympy, and prints them through `ncd.symbolic.triton_expr`: the forward by common subexpressions (`_cse_lines`),
the backward by `_Lowering`, which writes few instructions per element (hoisted coefficient factors, shared
power chains, one reciprocal, shared product prefixes). Nothing is typed in by hand. `abs` is
differentiated with ncd's convention d|u|/du = sign+(u), sign+(0) = +1 (the KAT reference kernels' choice).

Coefficient gradients are reductions over rows x within-group width: dc_k[g] = sum_{r, w} dy * dF/dc_k at
x[r, g*width + w] (and also over groups for shared coefficients). The kernels accumulate them in registers
(fp32) over each program's tiles and issue one atomic add per coefficient per program (FlashKAT Algorithm 2),
or write per-program partials that a second kernel reduces in a fixed order (deterministic mode). The backward
grid is one wave of persistent programs under a register cap (`ncd.families.rational.config.backward_registers`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import sympy

from ncd import ir
from ncd.errors import NcdError
from ncd.families.rational.config import RationalConfig
from ncd.family import Decline
from ncd.pipeline import FrontEnd
from ncd.source import Span, origin_name
from ncd.symbolic import SYMPY_FUNCTIONS, AbsPlus, SignPlus, to_sympy, triton_expr


class UnsupportedRational(NcdError):
    code = "unsupported"
    template = "{detail}"


class _NotOurs(Exception):
    """The spec is not an element-wise function of one input: another family's (or none)."""


X = sympy.Symbol("x", real=True)

# Axis sizes the plan is estimated at unless bound: the FlashKAT benchmark, X = [1024 * 197, 768], G = 8.
DEFAULT_BINDINGS = {"row": 1024 * 197, "chan": 768}
REFERENCE_SMS = 132  # H100 / H200, for the plan's atomics count


@dataclass(frozen=True)
class Coefficient:
    """One scalar coefficient: entry `index` (over the parameter's non-group axes) of parameter `param`."""

    param: str
    index: tuple[int, ...]
    per_group: bool
    symbol: sympy.Symbol

    @property
    def label(self) -> str:
        inner = ", ".join(str(i) for i in self.index)
        if self.per_group:
            return f"{self.param}[group{', ' if inner else ''}{inner}]"
        return f"{self.param}[{inner}]" if inner else self.param


@dataclass(frozen=True)
class ParamLayout:
    """How a parameter's entries map to coefficients: its axes, where the group axis is, the rest's sizes."""

    name: str
    axes: tuple[str, ...]
    group_pos: int | None  # position of the group axis, None when shared by every group
    rest_sizes: tuple[int, ...]  # sizes of the other axes, in order
    first: int  # index of its first coefficient in the kernel's order
    span: Span

    @property
    def count(self) -> int:
        n = 1
        for s in self.rest_sizes:
            n *= s
        return n


@dataclass(frozen=True)
class RationalRoles:
    x: str
    output: str
    row: str
    chan: str
    group: str
    width: str
    x_axes: tuple[str, ...]
    out_axes: tuple[str, ...]


@dataclass(frozen=True)
class Derivation:
    """The formula and its derivatives, as sympy and as Triton source (with common subexpressions)."""

    formula: sympy.Expr
    dx: sympy.Expr
    dcoef: tuple[sympy.Expr, ...]
    # Triton statements: (name, expression) pairs; prologue ones depend on coefficients only
    fwd_prologue: tuple[tuple[str, str], ...]
    fwd_body: tuple[tuple[str, str], ...]
    fwd_out: str
    bwd_prologue: tuple[tuple[str, str], ...]
    bwd_body: tuple[tuple[str, str], ...]
    bwd_dx: str
    bwd_dcoef: tuple[str | None, ...]  # None: identically zero
    # every dF/dc is finite at x = 0 (the value masked-off lanes load) for any coefficients: there dy = 0 already
    # zeroes the contribution and the accumulators need no select
    finite_at_zero: bool = False
    # per coefficient: a factor independent of x applied once after the accumulation (None: 1)
    bwd_factor: tuple[str | None, ...] = ()


# |u| differentiates to SignPlus(u): +1 at u = 0, the KAT reference kernels' convention
_FUNCTIONS = {**SYMPY_FUNCTIONS, "abs": AbsPlus}


class _Inliner:
    """Builds the scalar sympy formula of the output by inlining intermediates and unrolling finite sums."""

    def __init__(self, program: ir.Program, roles: RationalRoles, params: dict[str, ParamLayout],
                 coefficients: list[Coefficient]):
        self.p = program
        self.roles = roles
        self.params = params
        self.coef = {(c.param, c.index): c.symbol for c in coefficients}
        self.lets = {d.tensor: d for d in program.definitions}
        self.cache: dict[tuple[str, tuple[tuple[str, int], ...]], sympy.Expr] = {}

    def tensor(self, name: str, bound: dict[str, int]) -> sympy.Expr:
        key = (name, tuple(sorted(bound.items())))
        if key not in self.cache:
            self.cache[key] = self.expr(self.lets[name].value, {}, bound)
        return self.cache[key]

    def expr(self, node: ir.Node, scope: dict[str, int], bound: dict[str, int]) -> sympy.Expr:
        return to_sympy(node, leaf=lambda n: self.leaf(n, scope, bound), functions=_FUNCTIONS,
                        exponent=lambda e: _integer(e, scope))

    def leaf(self, node: ir.Node, scope: dict[str, int], bound: dict[str, int]) -> sympy.Expr | None:
        if isinstance(node, ir.Const):
            return None  # the number
        if isinstance(node, ir.SizeOf):
            axis = self.p.axis(node.axis)
            if axis.fixed is None:
                raise UnsupportedRational(node.span, detail=f"size({node.axis}) is bound at call time; the rational "
                                          "kernels take numbers known when the spec compiles",
                                          hint=f"give '{node.axis}' a fixed size or write the number")
            return sympy.Integer(axis.fixed)
        if isinstance(node, ir.Var):
            if node.name not in scope:
                raise _NotOurs
            return sympy.Integer(scope[node.name])
        if isinstance(node, ir.Load):
            return self.load(node, scope, bound)
        if isinstance(node, ir.FiniteSum):
            return sympy.Add(*(self.expr(node.body, {**scope, node.var: i}, bound)
                               for i in range(node.lo, node.hi + 1)))
        if isinstance(node, ir.Where):
            raise UnsupportedRational(node.span, detail="where(...) is not supported by the rational kernels yet",
                                      hint="write the activation with arithmetic, abs, max/min and the "
                                      "element-wise functions")
        raise _NotOurs  # comparisons, reductions, contractions, normalize, scans, bases, positions: not element-wise

    def load(self, node: ir.Load, scope: dict[str, int], bound: dict[str, int]) -> sympy.Expr:
        t = self.p.tensor(node.tensor)
        r = self.roles
        if t.role == "in":
            if any(i.axis is None or i.axis in bound for i in node.index) or \
                    tuple(i.axis for i in node.index) != t.axes:
                raise UnsupportedRational(node.span, detail=f"the rational kernels read '{t.name}' on its own "
                                          f"wires [{' '.join(t.axes)}]", hint="drop the index or relabelling")
            return X
        if t.role == "let":
            inner: dict[str, int] = {}
            for axis, index in zip(t.axes, node.index, strict=True):
                if index.axis is None:
                    assert index.index is not None
                    inner[axis] = _integer(index.index, scope)
                elif index.axis in bound:
                    inner[axis] = bound[index.axis]
                elif index.axis != axis:
                    raise UnsupportedRational(node.span, detail=f"relabelling '{t.name}' is not supported by the "
                                              "rational kernels", hint=f"read '{t.name}' on its own wires")
            return self.tensor(t.name, inner)
        if t.role != "param":
            raise _NotOurs
        layout = self.params[t.name]
        entry: list[int] = []
        for pos, (axis, index) in enumerate(zip(t.axes, node.index, strict=True)):
            if pos == layout.group_pos:
                if index.axis != r.group:
                    raise UnsupportedRational(node.span, detail=f"'{t.name}' must be read at the group wire "
                                              f"'{r.group}' on its axis '{axis}'")
                continue
            if index.axis is None:
                assert index.index is not None
                entry.append(_integer(index.index, scope))
            elif index.axis in bound:
                entry.append(bound[index.axis])
            else:
                raise UnsupportedRational(node.span, detail=f"'{t.name}' is read along the wire '{index.axis}'; the "
                                          f"rational kernels take coefficients per group ('{r.group}', the outer "
                                          f"factor of '{r.chan}') and at finite-sum indices",
                                          hint="index the coefficient with a finite-sum variable or a number")
        return self.coef[(t.name, tuple(entry))]


def _integer(expr: sympy.Expr, scope: dict[str, int]) -> int:
    value = sympy.sympify(expr).subs({sympy.Symbol(k, integer=True): v for k, v in scope.items()})
    if not value.is_Integer:
        raise _NotOurs
    return int(value)


def _recognise(program: ir.Program) -> tuple[RationalRoles, dict[str, ParamLayout], list[Coefficient]] | Decline:
    out_span = program.outputs[-1].span if program.outputs else None
    if len(program.outputs) != 1 or not program.params:
        return Decline("a grouped activation has one output and coefficient parameters", out_span)
    inputs = program.inputs
    if len(inputs) != 1 or len(inputs[0].axes) != 2:
        return Decline("a grouped activation reads one input of two axes [row channel]",
                       inputs[-1].span if inputs else out_span)
    x, out = inputs[0], program.outputs[0]
    if set(out.axes) != set(x.axes) or len(out.axes) != 2:
        return Decline(f"the output's axes differ from the input '{x.name}''s (not element-wise)", out.span)
    splits = [a for a in x.axes if program.axis(a).factors]
    if len(splits) != 1:
        return Decline(f"no axis of '{x.name}' is split into groups (axis chan = group * width)", x.span)
    chan = splits[0]
    row = next(a for a in x.axes if a != chan)
    factors = program.axis(chan).factors
    if len(factors) != 2:
        return Decline(f"axis '{chan}' must split into two factors (group * width)", program.axis(chan).span)
    group, width = factors
    roles = RationalRoles(x.name, out.name, row, chan, group, width, x.axes, out.axes)
    # parameters: the group wire (or none), and fixed-size axes enumerated as coefficients
    layouts: dict[str, ParamLayout] = {}
    grouped: list[tuple[ir.Tensor, tuple[int, ...]]] = []
    shared: list[tuple[ir.Tensor, tuple[int, ...]]] = []
    for t in program.params:
        if any(program.axis(a).factors for a in t.axes) or row in t.axes or width in t.axes:
            return Decline(f"parameter '{t.name}' is per channel or per row, not per group", t.span)
        rest = [a for a in t.axes if a != group]
        sizes = []
        for a in rest:
            fixed = program.axis(a).fixed
            if fixed is None:
                raise UnsupportedRational(t.span, detail=f"coefficient axis '{a}' of '{t.name}' needs a fixed size",
                                          hint=f"declare `axis {a} = N`")
            sizes.append(fixed)
        (grouped if group in t.axes else shared).append((t, tuple(sizes)))
    coefficients: list[Coefficient] = []
    for t, rest_sizes in [*grouped, *shared]:
        group_pos = t.axes.index(group) if group in t.axes else None
        layouts[t.name] = ParamLayout(t.name, t.axes, group_pos, rest_sizes, len(coefficients), t.span)
        for index in itertools.product(*(range(s) for s in rest_sizes)):
            coefficients.append(Coefficient(t.name, index, group_pos is not None,
                                            sympy.Symbol(f"c{len(coefficients)}", real=True)))
    return roles, layouts, coefficients


def _cse_lines(exprs: list[sympy.Expr], coefficient_names: set[str]) -> tuple[
        list[tuple[str, str]], list[tuple[str, str]], list[str]]:
    """Common subexpressions as Triton statements, split into coefficient-only (prologue) and per-element (the
    forward's statements: it is bound by memory, and this form measured 86% of copy bandwidth on an H200).

    Negative powers u**-k become r**k with one reciprocal r = 1 / u per base: one division per element, not
    one per quotient (the denominators of F, dF/dx and every dF/dc are powers of the same Q)."""
    recips: dict[sympy.Expr, sympy.Symbol] = {}

    def negative_power(e: sympy.Expr) -> bool:
        return bool(e.is_Pow and e.exp.is_Integer and e.exp < 0)

    def swap(e: sympy.Expr) -> sympy.Expr:
        if e.base not in recips:
            recips[e.base] = sympy.Symbol(f"r{len(recips)}", real=True)
        return recips[e.base] ** (-e.exp)

    rewritten = [e.replace(negative_power, swap) for e in exprs]
    bases = list(recips)
    temps, reduced = sympy.cse([*bases, *rewritten], symbols=sympy.numbered_symbols("t"), order="none")
    statements: dict[str, sympy.Expr] = {sym.name: value for sym, value in temps}
    for base, reduced_base in zip(bases, reduced[: len(bases)], strict=True):
        statements[recips[base].name] = 1 / reduced_base  # printed as (1.0 / (...))
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name in ordered:
            return
        for dep in sorted(s.name for s in statements[name].free_symbols if s.name in statements):
            visit(dep)
        ordered.append(name)

    for name in statements:
        visit(name)
    prologue: list[tuple[str, str]] = []
    body: list[tuple[str, str]] = []
    per_element = {"x", "dy"}
    for name in ordered:
        value = statements[name]
        names = {s.name for s in value.free_symbols}
        text = triton_expr(value)
        if names & per_element:
            per_element.add(name)
            body.append((name, text))
        else:
            assert names <= coefficient_names | {n for n, _ in prologue}
            prologue.append((name, text))
    return prologue, body, [triton_expr(e) for e in reduced[len(bases):]]


def _canonical(e: sympy.Expr) -> sympy.Expr:
    """Exact identities of ncd's abs and sign+, applied bottom-up: |u|^2 = u^2, sign+(u)^2 = 1,
    sign+(u) |u| = u. They turn products such as |x|^3 sign+(x) into x^3 (so powers of x are shared)."""
    if not e.args:
        return e
    e = e.func(*(_canonical(a) for a in e.args))
    if not (e.is_Mul or e.is_Pow):
        return e
    powers: dict[sympy.Expr, sympy.Expr] = {}
    for factor in sympy.Mul.make_args(e):
        base, exp = factor.as_base_exp()
        powers[base] = powers.get(base, sympy.Integer(0)) + exp
    changed = False
    for base in list(powers):
        exp = powers.get(base)
        if exp is None or not exp.is_Integer:
            continue
        if isinstance(base, SignPlus) and (exp >= 2 or exp < 0):
            powers[base] = exp % 2
            changed = True
        elif isinstance(base, AbsPlus) and exp >= 2:
            u = base.args[0]
            powers[base] = exp % 2
            powers[u] = powers.get(u, sympy.Integer(0)) + exp - exp % 2
            changed = True
    for base in list(powers):
        if isinstance(base, AbsPlus) and powers[base] == 1:
            sign = SignPlus(base.args[0])
            if powers.get(sign) == 1:
                u = base.args[0]
                powers[base] = powers[sign] = sympy.Integer(0)
                powers[u] = powers.get(u, sympy.Integer(0)) + 1
                changed = True
    if not changed:
        return e
    return sympy.Mul(*(b ** p for b, p in powers.items()))


class _Lowering:
    """Per-element Triton statements for expressions in the per-element symbols (x, dy), written so that the
    arithmetic per element is small, for any spec of the family (nothing here knows the activation):

    - every factor or coefficient of a term that depends only on coefficients is hoisted into the prologue
      (once per program), so a sum `k0 + k1 m1 + k2 m2 + ...` of per-element monomials m is one fused
      multiply-add per term;
    - powers of a per-element value are one shared chain of products (x^2, x^3, ... each one multiply);
    - a negative power u^-n is n factors of one reciprocal r = 1/u (one per base, through `_rcp`);
    - products of per-element factors are built as shared prefixes in a fixed order (dy first, then
      reciprocals, then the factors used by the most terms, then monomials of x), so that e.g. dy r and
      dy r^2 P are computed once and every coefficient-gradient term is one multiply-add into its accumulator.
    """

    def __init__(self, coefficient_names: set[str], elementwise: tuple[sympy.Symbol, ...],
                 exprs: list[sympy.Expr]):
        self.coefficients = coefficient_names
        self.elementwise = set(elementwise)
        self.prologue: list[tuple[str, str]] = []
        self.body: list[tuple[str, str]] = []
        self.constants: dict[sympy.Expr, str] = {}
        self.values: dict[sympy.Expr, str] = {s: s.name for s in elementwise}
        self.order: dict[str, tuple[int, int, int]] = {  # dy first in products, x (a monomial) last
            s.name: (3 if s.name == "x" else 0, 0, i) for i, s in enumerate(elementwise)}
        self.products: dict[tuple[str, ...], str] = {}
        self.powers: dict[tuple[str, int], str] = {}
        self.recips: dict[sympy.Expr, str] = {}
        self.count = 0
        self.uses: dict[sympy.Expr, int] = {}
        for e in exprs:  # how many products use each per-element factor: shared ones go first in a product
            for node in sympy.preorder_traversal(e):
                if node.is_Mul:
                    for f in node.args:
                        base = f.as_base_exp()[0]
                        self.uses[base] = self.uses.get(base, 0) + 1

    def _name(self, prefix: str = "t") -> str:
        self.count += 1
        return f"{prefix}{self.count - 1}"

    def _elementwise(self, e: sympy.Expr) -> bool:
        return bool(e.free_symbols & self.elementwise)

    def _monomial(self, e: sympy.Expr) -> bool:
        """A function of x alone built from powers, abs and sign+: last in products (one multiply-add)."""
        if e.is_Symbol:
            return e in self.elementwise and e.name == "x"
        if e.is_Pow:
            return bool(e.exp.is_Integer and e.exp > 0) and self._monomial(e.base)
        if isinstance(e, AbsPlus | SignPlus):
            return self._monomial(e.args[0])
        return False

    def constant(self, e: sympy.Expr) -> str:
        """A coefficient-only value: a literal, a coefficient name or a prologue temporary."""
        e = sympy.sympify(e)
        if e.is_Number:
            text = triton_expr(e)
            return f"({text})" if text.startswith("-") else text
        if e.is_Symbol:
            return e.name
        if e not in self.constants:
            name = self._name()
            self.prologue.append((name, triton_expr(e)))
            self.constants[e] = name
        return self.constants[e]

    def _emit(self, text: str, key: sympy.Expr | None, rank: tuple[int, int], prefix: str = "t") -> str:
        name = self._name(prefix)
        self.body.append((name, text))
        self.order[name] = (*rank, self.count)
        if key is not None:
            self.values[key] = name
        return name

    def _rank(self, e: sympy.Expr) -> tuple[int, int]:
        if self._monomial(e):
            return (3, 0)
        return (2, -self.uses.get(e, 0))

    def value(self, e: sympy.Expr) -> str:
        """The name of a per-element value (emitting the statements it needs)."""
        if e in self.values:
            return self.values[e]
        if e.is_Add:
            return self._emit(self.sum_text(e), e, self._rank(e))
        if e.is_Mul:
            k, rest = e.as_independent(*self.elementwise, as_Add=False)
            prod = self.product(self.factors(rest))
            if k == 1:
                self.values[e] = prod
                return prod
            return self._emit(f"{self.constant(k)} * {prod}", e, self._rank(e))
        if e.is_Pow and e.exp.is_Integer and e.exp != 0:
            n = int(e.exp)
            base = self.value(e.base) if n > 0 else self.reciprocal(e.base)
            name = self.power(base, abs(n))
            self.values[e] = name
            return name
        # any other function or power: its per-element arguments become temporaries, then sympy prints it
        args = [sympy.Symbol(self.value(a), real=True) if self._elementwise(a) else a for a in e.args]
        return self._emit(triton_expr(e.func(*args)), e, self._rank(e))

    def reciprocal(self, base: sympy.Expr) -> str:
        if base not in self.recips:
            self.recips[base] = self._emit(f"_rcp({self.value(base)})", None, (1, 0), prefix="r")
        return self.recips[base]

    def power(self, base: str, n: int) -> str:
        if n == 1:
            return base
        if (base, n) not in self.powers:
            below = self.power(base, n - 1)
            self.powers[(base, n)] = self._emit(f"{below} * {base}", None, self.order[base][:2])
        return self.powers[(base, n)]

    def factors(self, e: sympy.Expr) -> list[str]:
        """The per-element factors of a product, as names; reciprocal powers as repeated reciprocals."""
        names: list[str] = []
        for f in sympy.Mul.make_args(e):
            base, exp = f.as_base_exp()
            if exp.is_Integer and exp < 0:
                names += [self.reciprocal(base)] * int(-exp)
            else:
                names.append(self.value(f))
        return sorted(names, key=lambda n: self.order[n])

    def product(self, names: list[str]) -> str:
        """The product of the factors as one name: prefix products are shared between terms."""
        if len(names) == 1:
            return names[0]
        key = tuple(names)
        if key not in self.products:
            head = self.product(names[:-1])
            self.products[key] = self._emit(f"{head} * {names[-1]}", None, (2, 0))
        return self.products[key]

    def term(self, e: sympy.Expr) -> tuple[sympy.Expr, str]:
        """A per-element product as (coefficient-only factor, text of the rest with its last multiply inline)."""
        k, rest = e.as_independent(*self.elementwise, as_Add=False)
        names = self.factors(rest)
        if k not in (1, -1) or len(names) == 1:
            return k, self.product(names)
        if tuple(names) in self.products:
            return k, self.products[tuple(names)]
        return k, f"{self.product(names[:-1])} * {names[-1]}"

    def sum_text(self, e: sympy.Expr) -> str:
        """k0 + k1 m1 + k2 m2 + ...: one fused multiply-add per per-element term, constants hoisted."""
        const: list[sympy.Expr] = []
        terms: dict[sympy.Expr, sympy.Expr] = {}
        for t in sympy.Add.make_args(e):
            if not self._elementwise(t):
                const.append(t)
                continue
            k, rest = t.as_independent(*self.elementwise, as_Add=False)
            terms[rest] = terms.get(rest, sympy.Integer(0)) + k
        text = ""
        if const:
            text = self.constant(sympy.Add(*const))
        for rest, k in terms.items():
            if k == 0:
                continue
            if k in (1, -1):
                _, inner = self.term(rest)
            else:
                inner = f"{self.constant(k)} * {self.value(rest)}"
            sign = "-" if k == -1 else "+"
            text = f"{text} {sign} {inner}" if text else (f"-({inner})" if k == -1 else inner)
        return text or "0.0"

    def accumulation(self, e: sympy.Expr) -> str:
        """The text added to an accumulator: its last multiply fuses with the add."""
        if e.is_Add:
            return self.value(e)
        k, inner = self.term(e)
        if k == 1:
            return inner
        if k == -1:
            return f"-({inner})"
        _, rest = e.as_independent(*self.elementwise, as_Add=False)
        return f"{self.constant(k)} * {self.value(rest)}"


DY = sympy.Symbol("dy", real=True)


def derive(formula: sympy.Expr, coefficients: list[Coefficient], span: Span) -> Derivation:
    """F, dF/dx and dF/dc by sympy, then lowered to per-element Triton statements (`_Lowering`). The backward
    multiplies dF/dx and each dF/dc by the upstream gradient `dy` (dy distributed over the terms of dF/dx, so
    products such as dy / Q are shared with the coefficient gradients), and each dF/dc's factor that does not
    depend on x (e.g. -sign+(b_j)) is pulled out of the accumulation and applied once per program."""
    def clean(e: sympy.Expr) -> sympy.Expr:
        return sympy.sympify(e).replace(sympy.DiracDelta, lambda *_: sympy.Integer(0))

    formula = clean(formula)
    dx = clean(sympy.diff(formula, X))
    dcoef = tuple(clean(sympy.diff(formula, c.symbol)) for c in coefficients)
    names = {c.symbol.name for c in coefficients}
    split = [d.as_independent(X, as_Add=False) if d != 0 else (sympy.Integer(0), sympy.Integer(0)) for d in dcoef]
    try:
        fp, fb, (fout,) = _cse_lines([formula], names)
        dy_dx = sympy.Add(*(DY * t for t in sympy.Add.make_args(_canonical(dx))))
        rests = [_canonical(DY * rest) for (_, rest), d in zip(split, dcoef, strict=True) if d != 0]
        backward = _Lowering(names, (DY, X), [dy_dx, *rests])
        bdx = backward.value(dy_dx)
        printed = [backward.accumulation(r) for r in rests]
        factors = tuple(None if d == 0 or factor == 1 else triton_expr(factor)
                        for (factor, _), d in zip(split, dcoef, strict=True))
    except ValueError as err:
        raise UnsupportedRational(span, detail=f"cannot lower the activation to Triton: {err}") from None
    it = iter(printed)
    bwd_dcoef = tuple(None if d == 0 else next(it) for d in dcoef)
    bad = (sympy.zoo, sympy.oo, -sympy.oo, sympy.nan)
    finite = all(not sympy.sympify(d).subs(X, 0).has(*bad) for d in dcoef)
    return Derivation(formula, dx, dcoef, tuple(fp), tuple(fb), fout,
                      tuple(backward.prologue), tuple(backward.body), bdx, bwd_dcoef, finite, factors)


@dataclass(frozen=True)
class RationalPlan:
    family = "rational"
    roles: RationalRoles
    params: tuple[ParamLayout, ...]
    coefficients: tuple[Coefficient, ...]
    derivation: Derivation
    bindings: dict[str, int]
    out_span: Span
    origin_file: str = field(default="")
    # what the kernels are told (counts, live gradients, tiles, warps, registers, default accumulation); None: the
    # defaults for these coefficients (`default_config`)
    config: RationalConfig = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.config is None:
            object.__setattr__(self, "config", self.default_config())

    def default_config(self) -> RationalConfig:
        live = tuple(text is not None for text in self.derivation.bwd_dcoef)
        return RationalConfig.for_coefficients(self.k_group, self.k_shared, live)

    @property
    def output(self) -> str:
        return self.roles.output

    @property
    def k_group(self) -> int:
        return sum(1 for c in self.coefficients if c.per_group)

    @property
    def k_shared(self) -> int:
        return sum(1 for c in self.coefficients if not c.per_group)

    def describe(self) -> list[str]:
        r, d = self.roles, self.derivation
        k = len(self.coefficients)
        grouped = [c.label for c in self.coefficients if c.per_group]
        shared = [c.label for c in self.coefficients if not c.per_group]
        lines = [
            "kernel family: group-wise rational activation (element-wise in one input, coefficients per group)",
            f"  x = {r.x}[{' '.join(r.x_axes)}], {r.chan} = {r.group} * {r.width} (group of channel c = "
            f"c // size({r.width})) -> {r.output}[{' '.join(r.out_axes)}]",
            f"  coefficients: K = {k}; per group ({len(grouped)}): {', '.join(grouped) or '-'}; "
            f"shared by all groups ({len(shared)}): {', '.join(shared) or '-'}",
            "  symbols: " + ", ".join(f"{c.symbol} = {c.label}" for c in self.coefficients),
            f"  F(x) = {sympy.sstr(d.formula)}",
            "  convention: d|u|/du = sign+(u) with sign+(0) = +1 (KAT reference kernels; docs/language.md §22)",
            f"  dF/dx = {sympy.sstr(d.dx)}",
        ]
        for c, dc in zip(self.coefficients, d.dcoef, strict=True):
            lines.append(f"  dF/d{c.symbol} = {sympy.sstr(dc)}")
        lines.append("  triton forward (one pass over x; coefficients loaded once per program, per group):")
        lines += [f"    {n} = {e}" for n, e in d.fwd_prologue]
        lines += [f"    {n} = {e}" for n, e in d.fwd_body]
        lines.append(f"    y = {d.fwd_out}")
        lines.append("  triton backward (x recomputed; y is not saved):")
        lines += [f"    {n} = {e}" for n, e in (*d.bwd_prologue, *d.bwd_body)]
        lines.append(f"    dx = {d.bwd_dx}")
        for c, e, f in zip(self.coefficients, d.bwd_dcoef, d.bwd_factor, strict=True):
            if e is None:
                lines.append(f"    d{c.symbol}: identically 0")
            else:
                lines.append(f"    d{c.symbol} = {f + ' * ' if f else ''}sum({e})")
        rows = self.bindings[r.row]
        width = self.bindings[r.width]
        groups = self.bindings[r.group]
        row_programs = min(-(-rows // 16), max(1, self.config.resident_per_sm * REFERENCE_SMS // groups))
        programs = row_programs * groups
        atomics = programs * (self.k_group + self.k_shared)
        naive = rows * width * groups * k
        lines += [
            "accumulator pass: the coefficient gradients are reductions over "
            f"{r.row} x {r.width} (per group; shared coefficients also over {r.group}):",
            f"  d{{c}}[g] = sum over {r.row}, {r.width} of dy * dF/dc at x[{r.row}, g * size({r.width}) + {r.width}]",
            "  grid: (row programs, groups); each program loops over its row blocks x the group's width in "
            "[BLOCK_R, BLOCK_W] tiles, accumulating every dF/dc in fp32 registers",
            "  mode 'atomic' (default): one tl.atomic_add per coefficient per program (FlashKAT Algorithm 2); "
            "no per-element atomics",
            "  mode 'deterministic': per-program partials [programs, groups, K] (fp32), then a reduce kernel in a "
            "fixed order: bitwise reproducible",
            "  chosen per call: op(..., accumulate='atomic' | 'deterministic')",
            f"at {' '.join(f'{a}={v}' for a, v in self.bindings.items())} ({REFERENCE_SMS} SMs): "
            f"{row_programs} row programs x {groups} groups = {programs} programs",
            f"  atomics: {programs} programs x {k} coefficients = {atomics} "
            f"(per-element atomics, KAT Algorithm 1: {naive:,})",
            f"  deterministic partials: {programs * k * 4 / 1e6:.2f} MB; compulsory bytes forward "
            f"{rows * width * groups * 8 / 1e9:.2f} GB (fp32 x read, y written), backward "
            f"{rows * width * groups * 12 / 1e9:.2f} GB (x, dy read, dx written)",
            *self.config.describe(),
        ]
        return lines

    def render(self, program: ir.Program, op_id: str) -> str:
        from ncd.families.rational.render import render_rational_op

        return render_rational_op(program, self, op_id)

    def constant_inputs(self) -> frozenset[str]:
        return frozenset()

    def validation_sizes(self, program: ir.Program) -> dict[str, int]:
        """Odd sizes: 111 rows, width 5 (40 channels at 8 groups), 3 groups where the count is free."""
        r = self.roles
        sizes = {r.row: 111}
        group = program.axis(r.group).fixed or 3
        width = program.axis(r.width).fixed or 5
        sizes.update({r.group: group, r.width: width, r.chan: group * width})
        for axis in program.axes:
            if axis.fixed is not None:
                sizes[axis.name] = axis.fixed
            sizes.setdefault(axis.name, 7)
        return sizes


def plan_rational(front: FrontEnd, bindings: dict[str, int]) -> RationalPlan | Decline:
    """The rational family claims specs whose one output is element-wise in one input with grouped coefficients."""
    program = front.program
    found = _recognise(program)
    if isinstance(found, Decline):
        return found
    roles, layouts, coefficients = found
    out_def = next(d for d in program.definitions if d.tensor == roles.output)
    try:
        formula = _Inliner(program, roles, layouts, coefficients).tensor(roles.output, {})
    except _NotOurs:
        return Decline("the output is not an element-wise formula of the input and the coefficients", out_def.span)
    if X not in formula.free_symbols:
        return Decline(f"the output does not depend on the input '{roles.x}'", out_def.span)
    derivation = derive(formula, coefficients, out_def.span)
    sizes: dict[str, int] = {}
    for axis in program.axes:
        if axis.fixed is not None:
            sizes[axis.name] = axis.fixed
    given = {**{roles.row: DEFAULT_BINDINGS["row"]}, **bindings}
    sizes.update({k: v for k, v in given.items() if k in {a.name for a in program.axes}})
    chan = sizes.get(roles.chan) or bindings.get(roles.chan) or DEFAULT_BINDINGS["chan"]
    if roles.group not in sizes:
        sizes[roles.group] = max(1, chan // sizes[roles.width]) if roles.width in sizes else 8
    if roles.width not in sizes:
        sizes[roles.width] = max(1, chan // sizes[roles.group])
    shown = {roles.row: sizes[roles.row], roles.group: sizes[roles.group], roles.width: sizes[roles.width]}
    return RationalPlan(roles, tuple(layouts.values()), tuple(coefficients), derivation, shown,
                        out_def.span, origin_name(program.source.filename))
