"""Streamability: prove that a contraction over a normalised axis can be computed block by block.

Lemma 1 of papers/spherical-attention-ncd.txt: a normalized contraction
    O = sum_j a1(x_j) y_j / b(sum_j a2(x_j))
streams over j with the accumulator (o, z) -> (o + a1(x_j) y_j, z + a2(x_j)), initial (0, 0) and tail o / b(z).
Fusion: an element-wise map g applied to x before normalising composes into a1 and a2 (a1 o g, a2 o g), so
streamability survives it; broadcasting over axes other than the streamed one leaves the accumulator per row.

When a1 = C1 exp(c1 x) and a2 = C2 exp(c2 x) and b is homogeneous of degree c1 / c2, the accumulators may be
kept relative to a running maximum m: the pass derives this (softmax) instead of being told. More generally, maps
a1 = C1 exp(c1 h(x)), a2 = C2 exp(c2 h(x)) (softcapping: h = cap tanh(x / cap); softmin: h = -x) stream with h as
an element-wise pre-map of the score (the fusion above): the kernels compute t = h(s), keep the running max of t
and apply the chain rule h'(s) in the backward. Any other map that holds an exponential and is not bounded is
rejected with the reason: an unbounded exponential never streams without a stabiliser.

The normaliser can be written with `normalize(...)` or spelled out (`exp(S) / sum(exp(S), over key)`); the
spelled-out form is separated symbolically into a1(s) / b(r) or rejected with the reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import sympy

from . import ir
from .errors import NotStreamable
from .index_expr import is_gather
from .source import Span
from .symbolic import lambda_to_sympy, to_sympy

X = sympy.Symbol("x", real=True)
Z = sympy.Symbol("z", positive=True)
_T = sympy.Symbol("t", positive=True)
_M = sympy.Symbol("m", real=True)


@dataclass(frozen=True)
class Rescale:
    """Online max: a1 and a2 are exponentials with rates c1, c2; b has degree c1 / c2."""

    c1: sympy.Expr
    c2: sympy.Expr


@dataclass(frozen=True)
class Certificate:
    """Why and how `output` streams over `axis`: accumulators, their update and the tail."""

    output: str
    axis: str
    a1: sympy.Expr  # in X: the per-element weight, composed with any pre-map
    a2: sympy.Expr  # in X: the aggregated summand
    b: sympy.Expr  # in Z: the normaliser of the aggregate
    rescale: Rescale | None
    scale: sympy.Expr  # s = scale * (the contraction): a number or a scalar input's symbol
    span: Span
    pre: sympy.Expr = X  # in X: element-wise pre-map h of the scaled score; a1, a2 are maps of t = h(s)
    # score modifier s' = modifier(x, ...) of the scaled score x that reads positions, tensors or call-time
    # values (ALiBi, a bias, a learned temperature); a1, a2 (and pre) are maps of s'. `leaves` names the IR node
    # behind each of its symbols other than X (modifier_symbol).
    modifier: sympy.Expr | None = None
    leaves: tuple[tuple[str, ir.Node], ...] = ()
    # a sink: one more entry of the row's sum with no value (kernel_sink.py): the logit node of normalize's `sink`
    # (a map of it by `pre` in the maps' domain), or the constant t0 of b(z) = c z + beta (b is then c z)
    sink_node: ir.Node | None = None
    sink: sympy.Expr | None = None

    @property
    def state(self) -> tuple[str, ...]:
        return ("m", "o", "z") if self.rescale else ("o", "z")

    def derivatives(self) -> dict[str, sympy.Expr]:
        """The backward's symbolic pieces (shared anchors): a1', a2' and b'/b."""
        return {
            "da1": sympy.diff(self.a1, X),
            "da2": sympy.diff(self.a2, X),
            "db_over_b": sympy.cancel(sympy.diff(self.b, Z) / self.b),
            "dpre": sympy.diff(self.pre, X),
        }

    def describe(self) -> list[str]:
        d = self.derivatives()
        lines = [f"stream {self.output} over '{self.axis}' (normalized-contraction lemma)",
                 f"  x = {self.scale} * (the score contraction)",
                 *([f"  score modifier: s' = {self.modifier}; a1, a2 below are maps of s'"]
                   if self.modifier is not None else []),
                 *([f"  pre-map (stabiliser): t = h(x) = {self.pre}; a1, a2 below are maps of t"]
                   if self.pre != X else []),
                 f"  a1(x) = {self.a1}    a2(x) = {self.a2}    b(z) = {self.b}",
                 *([f"  sink: one more entry of the sum with no value, at t = {self.sink} (b's constant term)"]
                   if self.sink is not None else []),
                 *(["  sink: one more entry of the sum with no value, at the logit of normalize's sink"]
                   if self.sink_node is not None else [])]
        if self.rescale is None:
            lines += ["  state: o (per row, value width), z (per row)",
                      "  init: o = 0, z = 0",
                      "  update: o += a1(x) v;  z += a2(x)",
                      "  finalize: O = o / b(z)"]
        else:
            c1, c2 = self.rescale.c1, self.rescale.c2
            lines += ["  online max: a1, a2 exponential (rates "
                      f"{c1}, {c2}); b homogeneous of degree {sympy.simplify(c1 / c2)}",
                      "  state: m (running row max), o, z",
                      "  init: m = -inf, o = 0, z = 0",
                      "  update: m' = max(m, max_j x); o = o * a1(m - m') + a1(x - m') v;"
                      " z = z * a2(m - m') + a2(x - m')",
                      "  finalize: O = o / b(z)  (the common factor cancels)"]
        d = {k: sympy.simplify(v) for k, v in d.items()}
        lines += [f"  backward: a1'(x) = {d['da1']};  a2'(x) = {d['da2']};  b'(z)/b(z) = {d['db_over_b']}"
                  + (f";  h'(x) = {d['dpre']}" if self.pre != X else ""),
                  "  saved per row: " + ("m, z" if self.rescale else "z")]
        return lines


def derive_rescale(a1: sympy.Expr, a2: sympy.Expr, b: sympy.Expr) -> Rescale | str | None:
    """Rescale if a1, a2 are exponentials and b is homogeneous of the matching degree; None if neither is
    exponential; otherwise the reason streaming would overflow."""
    rates = []
    for f in (a1, a2):
        rate = sympy.simplify(sympy.diff(f, X) / f)
        rates.append(rate if X not in rate.free_symbols and rate.is_positive else None)
    if rates == [None, None]:
        return None
    if None in rates:
        which = "a1" if rates[0] is not None else "a2"
        return f"{which} grows exponentially but the other does not, so no common rescale keeps it finite"
    c1, c2 = rates[0], rates[1]
    assert c1 is not None and c2 is not None
    degree = sympy.simplify(c1 / c2)
    if sympy.simplify(b.subs(Z, _T * Z) - _T**degree * b) != 0:
        return (f"a1, a2 are exponentials, so a running-max rescale is needed, but b(z) = {b} is not "
                f"homogeneous of degree {degree}")
    return Rescale(c1, c2)


def _has_exponential(f: sympy.Expr) -> bool:
    """Whether f holds an exponential of x (exp, sinh, cosh, or a power with x in the exponent)."""
    return bool(f.atoms(sympy.exp, sympy.sinh, sympy.cosh)) or any(
        X in p.exp.free_symbols for p in f.atoms(sympy.Pow))


def _exponent_form(f: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr] | None:
    """(log C, g) with f = C exp(g(x)), g(0) = 0 and g free of logarithms of x; None if f has no such form."""
    log_f = sympy.expand_log(sympy.log(f), force=True)
    if any(X in term.free_symbols for term in log_f.atoms(sympy.log)):
        return None
    const = log_f.subs(X, 0)
    if not (const.is_real and const.is_finite):
        return None
    return const, sympy.simplify(log_f - const)


def _continuous(f: sympy.Expr) -> bool:
    from sympy.calculus.util import continuous_domain

    try:
        return bool(continuous_domain(f, X, sympy.S.Reals) == sympy.S.Reals)
    except (NotImplementedError, ValueError, TypeError):  # sympy cannot decide: not proven, so rejected
        return False


# A map holding an exponential streams without a stabiliser only if its values stay below this on the reals
# (sigmoid: 1); fp32 overflows at 3.4e38, and z sums up to 2^31 of them.
BOUNDED = 1e20


def _bounded(f: sympy.Expr) -> bool:
    """Whether |f| stays below BOUNDED: finite limits at both ends and no large value on a grid in between."""
    import mpmath

    if not _continuous(f):
        return False
    try:
        ends = [sympy.limit(f, X, end) for end in (sympy.oo, -sympy.oo)]
        if not all(e.is_finite and abs(float(e)) < BOUNDED for e in ends):
            return False
        fn = sympy.lambdify(X, f, "mpmath")
        return all(abs(fn(mpmath.mpf(v) / 8)) < BOUNDED for v in range(-8000, 8001, 7))
    except (TypeError, ValueError, NotImplementedError, ZeroDivisionError, AttributeError):  # undecided: rejected
        return False


@dataclass(frozen=True)
class Stabilised:
    """How a1, a2 stream: as maps of t = pre(x), with the running-max rescale where they are exponentials."""

    rescale: Rescale | None
    pre: sympy.Expr
    a1: sympy.Expr
    a2: sympy.Expr
    # b(z) = c z + beta (softmax-plus-one): b = c z with a sink entry of logit `sink` in t (a2(sink) = beta / c),
    # merged into the running-max state like any key (kernel_sink.py), so exp(-m) never forms
    b: sympy.Expr | None = None
    sink: sympy.Expr | None = None


def _offset_sink(a2_t: sympy.Expr, b: sympy.Expr, rescale: Rescale | str | None) -> tuple[sympy.Expr,
                                                                                           sympy.Expr] | None:
    """(c z, t0) where b(z) = c z + beta with constants c, beta > 0 and a1, a2 exponentials of one rate: the
    offset is a2(t0) = beta / c, one more entry of the sum with no value. None otherwise."""
    if not isinstance(rescale, str) or "not homogeneous" not in rescale or b.free_symbols - {Z}:
        return None
    beta = sympy.simplify(b.subs(Z, 0))
    c = sympy.simplify(b - beta) / Z
    c = sympy.simplify(c)
    if c.free_symbols or not (c.is_positive and beta.is_positive and beta.is_finite):
        return None
    form = _exponent_form(a2_t)
    if form is None or sympy.simplify(form[1] - sympy.diff(form[1], X) * X) != 0:
        return None
    log_c2, g = form
    rate = sympy.diff(g, X)
    t0 = sympy.simplify((sympy.log(beta / c) - log_c2) / rate)
    return c * Z, t0


def stabilise(a1: sympy.Expr, a2: sympy.Expr, b: sympy.Expr) -> Stabilised | str:
    """The stabiliser for exponential maps (running max of x, or of h(x) as a pre-map); plain sums for the rest;
    otherwise the reason the maps cannot stream without overflow."""
    rescale = derive_rescale(a1, a2, b)
    offset = _offset_sink(a2, b, rescale)
    if offset is not None:
        rescale = derive_rescale(a1, a2, offset[0])
        if isinstance(rescale, Rescale):
            return Stabilised(rescale, X, a1, a2, *offset)
    if isinstance(rescale, str):
        return rescale
    if rescale is not None:
        return Stabilised(rescale, X, a1, a2)
    exponential = [_has_exponential(f) for f in (a1, a2)]
    if not any(exponential):
        return Stabilised(None, X, a1, a2)
    form1, form2 = _exponent_form(a1), _exponent_form(a2)
    if all(exponential) and form1 is not None and form2 is not None:
        (log_c1, g1), (log_c2, g2) = form1, form2
        ratio = sympy.simplify(g1 / g2) if g2 != 0 else sympy.nan
        if X in ratio.free_symbols or not ratio.is_positive:
            return (f"a1(x) = {a1} and a2(x) = {a2} are exponentials of {g1} and {g2}, which are not positive "
                    "multiples of one h(x), so no common running max keeps both finite")
        h = g2
        if not (_continuous(h) and _continuous(sympy.diff(h, X))):
            return (f"a1(x) = {a1}, a2(x) = {a2} are exp(c h(x)) with h(x) = {h}, but h or h' is not finite on "
                    "every real x, so the running max of h cannot stabilise them")
        a1_t, a2_t = sympy.exp(log_c1) * sympy.exp(ratio * X), sympy.exp(log_c2) * sympy.exp(X)
        rescale = derive_rescale(a1_t, a2_t, b)
        offset = _offset_sink(a2_t, b, rescale)
        if offset is not None and isinstance(derive_rescale(a1_t, a2_t, offset[0]), Rescale):
            return Stabilised(derive_rescale(a1_t, a2_t, offset[0]), h, a1_t, a2_t, *offset)  # type: ignore[arg-type]
        if not isinstance(rescale, Rescale):
            return f"as maps of t = {h}: {rescale}"
        return Stabilised(rescale, h, a1_t, a2_t)
    unbounded = [name for name, f, e in (("a1", a1, exponential[0]), ("a2", a2, exponential[1]))
                 if e and not _bounded(f)]
    if not unbounded:
        return Stabilised(None, X, a1, a2)
    which = unbounded[0]
    f = a1 if which == "a1" else a2
    return (f"{which}(x) = {f} holds an exponential that can overflow, and it is not of the form C exp(c h(x)) "
            "shared by a1 and a2 (with b homogeneous), so no running max stabilises it")


def certify(program: ir.Program) -> list[Certificate]:
    """Certificates for every output that is a normalized contraction; rejects what cannot stream."""
    return [c for d in program.definitions if (c := _certify_definition(program, d)) is not None]


def _certify_definition(program: ir.Program, d: ir.Definition) -> Certificate | None:
    value = ir.inline(program, d.value)
    if not isinstance(value, ir.Contract) or len(value.over) != 1:
        return None
    axis = value.over[0]
    for weights in (ir.inline(program, value.lhs), ir.inline(program, value.rhs)):
        if isinstance(weights, ir.Normalize) and weights.over == axis:
            return _from_normalize(program, d, collapse_chain(program, weights))
        aggregates = [n for n in ir.walk(weights) if isinstance(n, ir.Reduce) and axis in n.over]
        # (an aggregate of inputs alone normalises no scores: QK-norm's q / |q| contracted with k is a score, whose
        # normalised operand the attention prologue computes, families/attention/prologue.py)
        if aggregates and any(isinstance(n, ir.Contract) for n in ir.walk_inlined(program, weights)):
            return _from_expression(program, d, weights, axis, aggregates)
    return None


def _score(program: ir.Program, node: ir.Node, axis: str, blame: ir.Node) -> tuple[ir.Contract, sympy.Expr]:
    """The contraction that produces the scores and the element-wise map applied to them."""
    wires = [n for n in ir.walk_inlined(program, node) if isinstance(n, ir.Contract | ir.Load) and axis in n.axes]
    contractions = list(dict.fromkeys(c for c in wires if isinstance(c, ir.Contract))) or wires
    if len(contractions) != 1 or not isinstance(contractions[0], ir.Contract):
        raise NotStreamable(blame.span, detail=f"the normalised scores must come from one contraction that "
                            f"carries '{axis}'; found {len(contractions)} wires over '{axis}'")
    score = contractions[0]
    pre = _map_of(program, node, score, axis, blame)
    return score, pre


def _map_of(program: ir.Program, node: ir.Node, score: ir.Node, axis: str, blame: ir.Node,
            aggregate: tuple[ir.Reduce, sympy.Symbol] | None = None) -> sympy.Expr:
    """`node` as sympy in X standing for `score` (and the symbol r standing for `aggregate`, where given); scalar
    inputs (scale) stay symbols, an axis size is a number or a symbol bound at call time."""

    def leaf(n: ir.Node) -> sympy.Expr | None:
        if aggregate is not None and n == aggregate[0]:
            return aggregate[1]
        inlined = ir.inline(program, n)
        if aggregate is not None and inlined == aggregate[0]:
            return aggregate[1]
        if inlined == score:
            return X
        if inlined is not n:  # an intermediate: its definition
            return _map_of(program, inlined, score, axis, blame, aggregate)
        if isinstance(n, ir.Load) and not n.axes:
            return sympy.Symbol(n.tensor, positive=True)
        if isinstance(n, ir.Const | ir.SizeOf):
            return None  # the number, or the size
        if isinstance(n, ir.AxisIndex) or (isinstance(n, ir.Load) and n.axes
                                           and all(i.axis is not None for i in n.index)):
            return modifier_symbol(program, n)  # a score modifier: positions, tensors read next to the scores
        if isinstance(n, ir.Load) and is_gather(program, n):  # (ncd/index_expr.py): a table read at an expression
            return modifier_symbol(program, n)  # of positions (T5's relative bias); modifiers.py prints it
        raise NotStreamable(n.span, detail=f"{type(n).__name__.lower()} inside the normalised scores is not an "
                            f"element-wise map of one score, so the fusion theorem does not apply")

    return to_sympy(node, {a.name: a for a in program.axes}, leaf=leaf)


FLOAT_DTYPES = ir.FLOAT_DTYPES


def modifier_symbol(program: ir.Program, node: ir.Node) -> sympy.Symbol:
    """The symbol a score modifier or mask uses for a position (`key`) or an element of a tensor that the
    kernels read next to the scores (`slope[head]`, `bias[head query key]`): its name says which, so that equal
    loads share one symbol; integer-valued where the value is."""
    if isinstance(node, ir.AxisIndex):  # (nonnegative: prefix-LM's queries per key are then one interval)
        return sympy.Symbol(f"pos_{node.axis}", integer=True, nonnegative=True)
    assert isinstance(node, ir.Load)
    # (an index expression by a digest of its text: two reads of one table at different expressions differ)
    name = "_".join(["t", node.tensor, *(i.axis or "e" + hashlib.sha1(sympy.srepr(i.index).encode()).hexdigest()[:8]
                                         for i in node.index)])
    if program.tensor(node.tensor).dtype in FLOAT_DTYPES:
        return sympy.Symbol(name, real=True)
    return sympy.Symbol(name, integer=True)


def modifier_leaves(expr: sympy.Basic, program: ir.Program, node: ir.Node) -> tuple[tuple[str, ir.Node], ...]:
    """(symbol name, IR node) for every position or tensor symbol of `expr`, found in the IR under `node`."""
    found: dict[str, ir.Node] = {}
    for n in ir.walk_inlined(program, node):
        if isinstance(n, ir.AxisIndex | ir.Load) and (isinstance(n, ir.AxisIndex) or n.axes):
            found.setdefault(modifier_symbol(program, n).name, n)
    names = {s.name for s in expr.free_symbols}
    return tuple(sorted((k, v) for k, v in found.items() if k in names))


def is_modifier_symbol(symbol: sympy.Basic) -> bool:
    return isinstance(symbol, sympy.Symbol) and symbol.name.startswith(("pos_", "t_"))


def _split_scale(pre: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """(c, g): pre = g(c x) with c a positive factor kernels apply to the score (`scale`), g the rest."""
    c = sympy.simplify(pre / X)
    if X not in c.free_symbols and c.is_positive:
        return c, X
    return sympy.Integer(1), pre


def collapse_chain(program: ir.Program, norm: ir.Normalize) -> ir.Normalize:
    """normalize(normalize(S, over a, f), over a, g) as one normalize, where it reduces to one: g's maps homogeneous,
    g.a1(c x) = c^p g.a1(x), g.a2(c x) = c^q g.a2(x), and g.b(c^q z) = c^p g.b(z). The inner row's 1 / f.b(z) is then
    a common factor c of every entry, which cancels: a1 = g.a1 o f.a1, a2 = g.a2 o f.a1, b = g.b, the masks joined
    (a masked entry is 0 inside, and g's maps are 0 at 0). A normalize of anything else is returned as it is; a chain
    that does not reduce is an error with its place."""
    inner = ir.inline(program, norm.arg)
    if not isinstance(inner, ir.Normalize) or inner.over != norm.over:
        return norm
    if any(n is not None for n in (inner.weight, norm.weight, inner.sink, norm.sink)):
        raise NotStreamable(norm.span, detail="chained normalisers with a weight or a sink are not reduced to one",
                            hint="write the one normalize they compute")
    axes = {a.name: a for a in program.axes}
    g1, g2 = lambda_to_sympy(norm.a1, X, axes), lambda_to_sympy(norm.a2, X, axes)
    gb = lambda_to_sympy(norm.b, Z, axes)
    degrees = [sympy.simplify(X * sympy.diff(f, X) / f) for f in (g1, g2)]
    homogeneous = all(not p.free_symbols and p.is_positive for p in degrees) and sympy.simplify(
        gb.subs(Z, _T ** degrees[1] * Z) - _T ** degrees[0] * gb) == 0
    if not homogeneous:
        raise NotStreamable(norm.span, detail=f"this normalize of a normalize over '{norm.over}' does not reduce to "
                            f"one: the outer maps a1(x) = {g1}, a2(x) = {g2}, b(z) = {gb} are not homogeneous of "
                            "matching degrees, so the inner row's normaliser does not cancel",
                            hint="outer maps such as a1(x) = x, a2(x) = x, b(z) = z (a renormalisation) reduce")
    a1 = ir.Lambda(inner.a1.param, ir.substitute(norm.a1.body, norm.a1.param, inner.a1.body), norm.a1.span)
    a2 = ir.Lambda(inner.a1.param, ir.substitute(norm.a2.body, norm.a2.param, inner.a1.body), norm.a2.span)
    masks = [m for m in (inner.mask, norm.mask) if m is not None]
    mask = masks[0] if len(masks) == 1 else ir.Binary("and", masks[0], masks[1], norm.axes, norm.span) \
        if masks else None
    return ir.Normalize(inner.arg, norm.over, a1, a2, norm.b, mask, None, norm.axes, norm.span)


def _from_normalize(program: ir.Program, d: ir.Definition, norm: ir.Normalize) -> Certificate:
    _, pre = _score(program, norm.arg, norm.over, norm)
    if any(is_modifier_symbol(s) for s in pre.free_symbols):
        return _with_modifier(program, d, norm, pre)
    scale, rest = _split_scale(pre)
    axes = {a.name: a for a in program.axes}  # size(...) in a map is the axis size (a number or a size symbol)
    a1 = lambda_to_sympy(norm.a1, X, axes).subs(X, rest)
    a2 = lambda_to_sympy(norm.a2, X, axes).subs(X, rest)
    b = lambda_to_sympy(norm.b, Z, axes)
    folded = _fold_into_scale(a1, a2)
    if (folded[0].free_symbols | folded[1].free_symbols) - {X}:  # a scalar input or call-time size the scale
        return _with_modifier(program, d, norm, pre)            # cannot take (`s - log(size(key))`): a modifier
    return _certificate(program, d, norm.over, a1, a2, b, scale, norm.span, norm)


def _with_modifier(program: ir.Program, d: ir.Definition, norm: ir.Normalize, pre: sympy.Expr) -> Certificate:
    """A score that reads positions or tensors: s' = modifier(x) with x = scale * (the contraction), where scale is
    the score's slope at 0 when that is a positive factor free of positions and tensors (the kernels' scale), and
    a1, a2, b the normaliser's own maps of s'."""
    slope = sympy.simplify(sympy.diff(pre, X).subs(X, 0))
    scale = sympy.Integer(1)
    if slope.is_positive and slope.is_finite and not any(is_modifier_symbol(s) for s in slope.free_symbols):
        scale = slope
    modifier = sympy.simplify(pre.subs(X, X / scale))
    if _has_exponential(modifier):
        raise NotStreamable(norm.arg.span, detail=f"the score modifier {modifier} holds an exponential, which can "
                            "overflow before the normaliser's stabiliser sees it",
                            hint="move the exponential into a1/a2 of normalize(...)")
    axes = {a.name: a for a in program.axes}
    a1 = lambda_to_sympy(norm.a1, X, axes)
    a2 = lambda_to_sympy(norm.a2, X, axes)
    b = lambda_to_sympy(norm.b, Z, axes)
    cert = _certificate(program, d, norm.over, a1, a2, b, scale, norm.span, norm, fold=False)
    return replace(cert, modifier=modifier, leaves=modifier_leaves(modifier, program, norm.arg))


def _fold_into_scale(a1: sympy.Expr, a2: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
    """(a1, a2, c) with the maps written as functions of c x, where a positive factor c of x that reads sizes (or
    scalar inputs) moves out of the maps into the score's scale: exp(x / sqrt(size(dim))). c = 1 when none does."""
    if not (a1.free_symbols | a2.free_symbols) - {X}:
        return a1, a2, sympy.Integer(1)
    for term in sorted(a1.atoms(sympy.Mul), key=sympy.default_sort_key):
        coeff, rest = term.as_independent(X, as_Add=False)
        if rest == X and coeff.free_symbols and coeff.is_positive:
            f1, f2 = (sympy.simplify(f.subs(X, X / coeff)) for f in (a1, a2))
            if not (f1.free_symbols | f2.free_symbols) - {X}:
                return f1, f2, coeff
    return a1, a2, sympy.Integer(1)


def _from_expression(program: ir.Program, d: ir.Definition, weights: ir.Node, axis: str,
                     aggregates: list[ir.Reduce]) -> Certificate:
    distinct = list(dict.fromkeys(aggregates))
    if len(distinct) > 1:
        raise NotStreamable(distinct[1].span, detail=f"the normaliser combines {len(distinct)} aggregates over "
                            f"'{axis}'; Lemma 1 streams one sum per row",
                            hint="normalise with a single sum(..., over AXIS)")
    aggregate = distinct[0]
    if aggregate.op != "sum":
        raise NotStreamable(aggregate.span, detail=f"the normaliser is a {aggregate.op} over '{axis}', not a "
                            "function of a sum, so Lemma 1 does not apply",
                            hint="write the normaliser as b(sum(a2(S), over AXIS))")
    score, pre = _score(program, aggregate.arg, axis, aggregate)
    if any(is_modifier_symbol(s) for s in pre.free_symbols):
        raise NotStreamable(aggregate.span, detail="this normaliser is spelled out, and its score reads positions "
                            "or tensors besides the contraction (a score modifier)",
                            hint="write it with normalize(S, over AXIS, a1(x) = ..., a2(x) = ..., b(z) = ...), "
                            "which takes score modifiers")
    scale, _ = _split_scale(pre)
    r = sympy.Symbol("r", positive=True)
    a2 = _map_of(program, aggregate.arg, score, axis, aggregate).subs(X, X / scale)
    f = _map_of(program, weights, score, axis, aggregate, (aggregate, r)).subs(X, X / scale)
    parts = sympy.separatevars(sympy.factor(f), symbols=[X, r], dict=True, force=True)
    if not parts or (X not in parts and r not in parts):
        raise NotStreamable(weights.span if hasattr(weights, "span") else d.span,
                            detail=f"a1 depends on the aggregate: {sympy.sstr(f.subs(r, sympy.Symbol('sum')))} "
                            "does not factor as a1(s) / b(sum), so each element needs the finished sum",
                            hint="only a factor that depends on the sum alone may be applied after streaming")
    a1 = parts.get("coeff", 1) * parts.get(X, 1)
    b = sympy.simplify(1 / parts.get(r, 1)).subs(r, Z)
    return _certificate(program, d, axis, sympy.simplify(a1), sympy.simplify(a2), b, scale, aggregate.span,
                        weights)


def _certificate(program: ir.Program, d: ir.Definition, axis: str, a1: sympy.Expr, a2: sympy.Expr,
                 b: sympy.Expr, scale: sympy.Expr, span: Span, blame: ir.Node, fold: bool = True) -> Certificate:
    if fold:
        a1, a2, factor = _fold_into_scale(a1, a2)
        scale = scale * factor
    for name, f in (("a1", a1), ("a2", a2)):
        if f.free_symbols - {X}:
            raise NotStreamable(blame.span, detail=f"{name}(x) = {f} reads {sorted(map(str, f.free_symbols - {X}))}"
                                " besides the score", hint="a scalar input may only scale the score")
    stable = stabilise(a1, a2, b)
    if isinstance(stable, str):
        raise NotStreamable(blame.span, detail=f"'{d.tensor}' cannot stream over '{axis}': {stable}",
                            hint="write the maps as exp(c * h(x)) with one h, or as bounded functions")
    sink_node = blame.sink if isinstance(blame, ir.Normalize) else None
    if sink_node is not None and stable.sink is not None:
        raise NotStreamable(sink_node.span, detail=f"b(z) = {b} already adds a constant to the sum (a sink of its "
                            "own), and normalize's sink adds another", hint="give the sink once: b(z) = z with sink")
    return Certificate(d.tensor, axis, stable.a1, stable.a2, stable.b if stable.b is not None else b,
                       stable.rescale, scale, span, stable.pre, sink_node=sink_node, sink=stable.sink)
