"""IR -> straight-line PyTorch code: the generic family's op body.

`BodyEmitter` follows `ncd.reference._Evaluator` node by node (the float64 reference every op is checked
against), but writes code instead of evaluating: each value is a Python expression whose dimensions are the
wire's axes in a known order. Axes are matched by name at emit time, so the code only permutes, unsqueezes,
flattens split axes and gathers factor indices, as the reference does on its tensors. Spec text reaches the code
only as checked identifiers (tensor and axis names), integers, and numbers printed with `repr(float)`.
Every line carries the `# spec.ncd:LINE` origin of the node it computes."""

from __future__ import annotations

import string
from dataclasses import dataclass, field, fields, is_dataclass

import sympy

from ... import ir, stable_exp, streaming
from ...errors import InvalidStatement
from ...index_expr import emit_gather, is_gather
from ...source import NO_SPAN, Span
from ...symbolic import TorchPrinter, to_sympy, torch_expr

# The reference's element-wise tables (ncd.reference._UNARY / _BINARY), as the torch calls that compute them.
UNARY = {"neg": "torch.neg", "abs": "torch.abs", "sign": "torch.sign", "exp": "torch.exp", "log": "torch.log",
         "sqrt": "torch.sqrt", "tanh": "torch.tanh", "sigmoid": "torch.sigmoid", "sin": "torch.sin",
         "cos": "torch.cos", "acos": "torch.acos", "not": "torch.logical_not"}
INFIX = {"+": "+", "-": "-", "*": "*", "/": "/", "<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "==", "!=": "!="}
# both operands must be tensors; and/or take conditions (bool tensors: a comparison always gives a tensor)
CALLS = {"max": "torch.maximum", "min": "torch.minimum", "and": "torch.logical_and", "or": "torch.logical_or"}
EINSUM_LETTERS = string.ascii_letters


@dataclass(frozen=True)
class Value:
    """A Python expression for a wire: a tensor whose dimensions are `axes` in that order (exactly the reference's
    `Named`), or, where `tensor` is False, a Python number (a literal or a size) that broadcasts everywhere."""

    code: str
    axes: tuple[str, ...] = ()
    tensor: bool = True


@dataclass(frozen=True)
class Stabilised:
    """A normalisation with exponential maps evaluated relative to its row's maximum (`how` says which): the
    common factor cancels in the ratio, so nothing changes mathematically and nothing overflows."""

    span: Span
    how: str


def unsupported(span: Span, what: str, hint: str) -> InvalidStatement:
    return InvalidStatement(span, detail=f"the generic family cannot compile {what}", hint=hint)


@dataclass
class BodyEmitter:
    program: ir.Program
    size_code: dict[str, str]  # call-time axis -> the expression that gives its size inside the body
    lines: list[str] = field(default_factory=list)
    env: dict[str, Value] = field(default_factory=dict)
    stabilised: list[Stabilised] = field(default_factory=list)
    computed: dict[tuple[str, tuple[str, ...]], Value] = field(default_factory=dict)
    sliced: dict[str, str] = field(default_factory=dict)  # a scan's axis -> its loop variable, inside the loop
    solves: bool = False  # the body calls _ImplicitSolve (the module then defines it)
    counter: int = 0
    origin: Span = NO_SPAN  # the definition being emitted (for nodes without a span of their own)

    # --- helpers -------------------------------------------------------------------------------------------

    def size(self, axis: str) -> str:
        """The size of `axis` as the code's tensors have it: 1 for a scan's axis inside its loop."""
        return "1" if axis in self.sliced else self.full_size(axis)

    def full_size(self, axis: str) -> str:
        fixed = self.program.axis(axis).fixed
        if fixed is not None:
            return str(fixed)
        if axis not in self.size_code:
            raise unsupported(self.program.axis(axis).span, f"a use of axis '{axis}': no input or parameter carries "
                              "it, so its size is unknown when the op is called", "add it to an input's axes, or give "
                              "it a fixed size")
        return self.size_code[axis]

    def emit(self, code: str, axes: tuple[str, ...], span: Span, tensor: bool = True) -> Value:
        """A new local holding `code`; the same code twice is computed once (every line is a pure function)."""
        if code.isidentifier():  # a local already
            return Value(code, axes, tensor)
        if (code, axes) in self.computed:
            return self.computed[code, axes]
        name = f"_t{self.counter}"
        self.counter += 1
        where = span if span.line > 0 else self.origin
        self.lines.append(f"{name} = {code}  # {where.origin}")
        self.computed[code, axes] = Value(name, axes, tensor)
        return self.computed[code, axes]

    def bind(self, name: str, value: Value, span: Span) -> None:
        """`name = value` for a spec tensor: the last line renamed where it computed the value."""
        last = f"{value.code} = "
        if value.code.startswith("_t") and self.lines and self.lines[-1].startswith(last):
            code = self.lines[-1][len(last):].rsplit("  # ", 1)[0]
            self.lines[-1] = f"{name} = {self.lines[-1][len(last):]}"
            self.computed[code, value.axes] = Value(name, value.axes)
        else:
            self.lines.append(f"{name} = {value.code}  # {span.origin}")

    def as_tensor(self, value: Value, span: Span) -> Value:
        """A number as a 0-dim fp32 tensor on the op's device (torch.maximum, torch.where, unary functions)."""
        return value if value.tensor else self.emit(f"_one * {value.code}", (), span)

    # --- broadcasting by name (the reference's to_axes) ------------------------------------------------------

    def to_axes(self, value: Value, axes: tuple[str, ...], mode: str, span: Span) -> tuple[Value, set[str]]:
        """`value` brought to `axes`: split axes flattened from their factors, factors read at the split index.
        mode "exact": every axis at full size (the reference's to_axes); "broadcast": axes the value lacks get size
        1 (torch broadcasting does the rest); "real": axes the value lacks are left out, the others in the value's
        own order (einsum takes any).
        Returns the value and the axes it really carries."""
        if not value.tensor:
            return value, set()
        code, have = value.code, list(value.axes)
        for axis in axes:  # a split axis built from factors present: flatten them (outer first)
            factors = self.program.axis(axis).factors
            if axis not in have and factors and all(f in have for f in factors):
                order = [have.index(f) for f in factors]
                rest = [i for i in range(len(have)) if i not in order]
                code = _permuted(code, rest + order)
                code = f"{code}.flatten({len(rest)})" if len(order) > 1 else code
                have = [have[i] for i in rest] + [axis]
        for i, axis in enumerate(list(have)):  # a factor meeting its split axis: read it at c // inner % outer
            owner = next((a for a in axes if axis in self.program.axis(a).factors), None)
            if owner is not None:
                code, have = self._expand_factor(code, have, i, owner)
        real = set(have)
        if not real <= set(axes):
            raise AssertionError(f"cannot bring [{' '.join(have)}] to [{' '.join(axes)}]")  # a verifier bug
        if mode == "broadcast" and not have:  # a 0-dim tensor broadcasts as it is
            return value, real
        if mode == "real":  # einsum takes its operands' dimensions in any order
            return (value if code == value.code else self.emit(code, tuple(have), span)), real
        kept = [a for a in axes if a in real]
        code = _permuted(code, [have.index(a) for a in kept])
        for i, axis in enumerate(axes):  # missing axes inserted where they go, size 1
            if axis not in real:
                code += f".unsqueeze({i})"
        if mode == "exact" and len(real) < len(axes):
            code += f".expand({', '.join('-1' if a in real else self.size(a) for a in axes)})"
        return (value if code == value.code else self.emit(code, axes, span)), real

    def _expand_factor(self, code: str, have: list[str], i: int, owner: str) -> tuple[str, list[str]]:
        factors = self.program.axis(owner).factors
        k = factors.index(have[i])
        inner = [self.size(f) for f in factors[k + 1:]] or ["1"]
        divisor = f"({' * '.join(inner)})" if len(inner) > 1 else inner[0]
        index = f"torch.arange({self.size(owner)}, device=_device) // {divisor} % {self.size(have[i])}"
        code = f"{code}.index_select({i}, {index})"
        have = list(have)
        have[i] = owner
        if have.count(owner) > 1:  # two factors of one split axis: keep the diagonal
            j = have.index(owner)
            code = f"torch.diagonal({code}, dim1={j}, dim2={i})"
            del have[i]
            have.remove(owner)
            have.append(owner)
        return code, have

    def merge(self, values: list[Value], axes: tuple[str, ...], span: Span) -> tuple[list[Value], set[str]]:
        """Operands of an element-wise node in broadcast form, and the axes some operand really carries."""
        out, real = [], set()
        for v in values:
            converted, carried = self.to_axes(v, axes, "broadcast", span)
            out.append(converted)
            real |= carried
        return out, real

    def full(self, value: Value, real: set[str], axes: tuple[str, ...], span: Span) -> Value:
        """A broadcast result (a tensor on `axes`) expanded along the axes no operand carried: the reference
        materialises them."""
        missing = [a for a in axes if a not in real]
        if not missing:
            return value
        sizes = [self.size(a) if a in missing else "-1" for a in axes]
        return self.emit(f"{value.code}.expand({', '.join(sizes)})", axes, span)

    # --- nodes -----------------------------------------------------------------------------------------------

    def eval(self, node: ir.Node, scope: dict[str, object]) -> Value:
        if isinstance(node, ir.Const):
            return Value(repr(float(node.value)), (), False)
        if isinstance(node, ir.SizeOf):
            return Value(self.full_size(node.axis), (), False)
        if isinstance(node, ir.Var):
            bound = scope[node.name]
            return bound if isinstance(bound, Value) else Value(repr(float(bound)), (), False)  # type: ignore[arg-type]
        if isinstance(node, ir.AxisIndex):
            step = self.sliced.get(node.axis)
            positions = f"{step}, {step} + 1" if step is not None else self.size(node.axis)
            return self.emit(f"torch.arange({positions}, dtype=torch.float32, device=_device)", (node.axis,),
                             node.span)
        if isinstance(node, ir.Load):
            return self.load(node, scope)
        if isinstance(node, ir.Binary) and node.op == "/":
            softmax = self.spelled_out_softmax(node, scope)
            if softmax is not None:
                return softmax
            self.reject_overflowing_sum(node.rhs, node)
        if isinstance(node, ir.Unary) and node.fn == "log":
            self.reject_overflowing_sum(node.arg, node)
        if isinstance(node, ir.Unary | ir.Binary | ir.Pow) and (stable := self.stable_elementwise(node, scope)):
            return stable
        if isinstance(node, ir.Unary):
            arg = self.eval(node.arg, scope)
            return self.unary(node.fn, arg, arg.axes if arg.tensor else (), node.span)
        if isinstance(node, ir.Binary):
            (lhs, rhs), real = self.merge([self.eval(node.lhs, scope), self.eval(node.rhs, scope)], node.axes,
                                          node.span)
            return self.full(self.binary(node.op, lhs, rhs, node.axes, node.span), real, node.axes, node.span)
        if isinstance(node, ir.Pow):
            base = self.eval(node.base, scope)
            return self.emit(f"{self.as_tensor(base, node.span).code} ** {_int(node.exponent, scope)}", base.axes,
                             node.span)
        if isinstance(node, ir.Where):
            parts, real = self.merge([self.eval(n, scope) for n in (node.cond, node.then, node.otherwise)],
                                     node.axes, node.span)
            cond, then, other = (self.as_tensor(p, node.span) for p in parts)
            value = self.emit(f"torch.where({cond.code}, {then.code}, {other.code})", node.axes, node.span)
            return self.full(value, real, node.axes, node.span)
        if isinstance(node, ir.FiniteSum):
            return self.finite_sum(node, scope)
        if isinstance(node, ir.Reduce):
            arg = self.eval(node.arg, scope)
            dims = tuple(arg.axes.index(a) for a in node.over)
            return self.emit(f"{arg.code}.{'sum' if node.op == 'sum' else 'amax'}({dims})", node.axes, node.span)
        if isinstance(node, ir.Contract):
            return self.contract(node, scope)
        if isinstance(node, ir.Normalize):
            return self.normalize(node, scope)
        if isinstance(node, ir.BasisEval):
            return self.basis(node, scope)
        if isinstance(node, ir.Scan):
            return self.scan(node, scope)
        if isinstance(node, ir.Prev):
            return scope["__prev__"]  # type: ignore[return-value]
        if isinstance(node, ir.ChebyshevSolve):
            return self.solve(node, scope)
        raise unsupported(node.span, f"a {type(node).__name__} node here", "report this spec as an ncd bug")

    def scan(self, node: ir.Scan, scope: dict[str, object]) -> Value:
        """The reference's scan, step by step: a Python loop over the scan axis, the body evaluated at one step
        (every value keeps that axis at size 1), the states concatenated. torch.compile unrolls the loop (one graph
        per length), so long scans compile slowly; the specialised recurrence family is the fast path."""
        time, span = node.over, node.span
        time_axis = self.program.axis(time)
        if self.sliced or time_axis.factors or any(time in a.factors for a in self.program.axes):
            raise unsupported(span, "this scan: its axis is split, a factor, or inside another scan",
                              f"scan over a plain axis ('{time}' is split or a factor of another axis)")
        for n in ir.walk(node.body):
            over = (n.over,) if isinstance(n, ir.Normalize) else getattr(n, "over", ())
            if isinstance(n, ir.Reduce | ir.Contract | ir.Normalize | ir.Scan) and time in over:
                raise unsupported(n.span, f"a reduction over '{time}' inside the scan over '{time}'",
                                  "compute it in a definition of its own, outside the scan")
        k = self.counter
        self.counter += 1
        state, steps, step = f"_state{k}", f"_steps{k}", f"_step{k}"
        dim = node.axes.index(time)
        state_axes = tuple(a for a in node.axes if a != time)
        if node.init is not None:
            init = self.to_axes(self.eval(node.init, scope), state_axes, "exact", span)[0]
            self.lines.append(f"{state} = {init.code}.unsqueeze({dim})  # {span.origin}")
        else:
            shape = ", ".join("1" if a == time else self.size(a) for a in node.axes)
            self.lines.append(f"{state} = torch.zeros({shape}, dtype=torch.float32, device=_device)  # {span.origin}")
        self.lines.append(f"{steps} = []  # {span.origin}")
        self.lines.append(f"for {step} in range({self.size(time)}):  # {span.origin}")
        mark, known = len(self.lines), dict(self.computed)
        self.sliced[time] = step
        value = self.eval(node.body, {**scope, "__prev__": Value(state, node.axes)})
        value = self.as_tensor(self.to_axes(value, node.axes, "exact", span)[0], span)
        del self.sliced[time]
        self.lines.append(f"{state} = {value.code}  # {span.origin}")
        self.lines.append(f"{steps}.append({state})  # {span.origin}")
        self.lines[mark:] = [f"    {line}" for line in self.lines[mark:]]
        self.computed = known  # what the loop computes exists only there
        # the empty slice keeps torch.cat defined for a scan of length 0
        return self.emit(f"torch.cat([*{steps}, {state}.narrow({dim}, 0, 0)], dim={dim})", node.axes, span)

    def solve(self, node: ir.ChebyshevSolve, scope: dict[str, object]) -> Value:
        """The reference's chebyshev_solve: the module's _ImplicitSolve (the iterations forward, the exact solve's
        gradient backward, none for mu and L; docs/language.md, section 17) on [*systems, row, over] matrices."""
        span = node.span
        batch = tuple(a for a in node.axes if a != node.over)
        matrix = self.to_axes(self.eval(node.matrix, scope), (*batch, node.row, node.over), "exact", span)[0]
        rhs_axes = tuple(node.row if a == node.over else a for a in node.axes)
        rhs = self.to_axes(self.eval(node.rhs, scope), rhs_axes, "exact", span)[0]
        rhs = self.to_axes(Value(rhs.code, rhs_axes), (*batch, node.row), "exact", span)[0]
        mu, lip = (self.to_axes(self.as_tensor(self.eval(n, scope), span), batch, "exact", span)[0]
                   for n in (node.mu, node.lipschitz))
        self.solves = True
        return self.emit(f"_ImplicitSolve.apply({matrix.code}, {rhs.code}, {mu.code}.unsqueeze(-1), "
                         f"{lip.code}.unsqueeze(-1), {int(node.iterations)})", (*batch, node.over), span)

    def unary(self, fn: str, arg: Value, axes: tuple[str, ...], span: Span) -> Value:
        if fn not in UNARY:
            raise unsupported(span, f"function '{fn}': it has no PyTorch form in the generic family",
                              "add it to ncd/families/generic/emit.py UNARY, mirroring ncd.reference._UNARY")
        return self.emit(f"{UNARY[fn]}({self.as_tensor(arg, span).code})", axes, span)

    def binary(self, op: str, lhs: Value, rhs: Value, axes: tuple[str, ...], span: Span) -> Value:
        if op in CALLS:
            lhs, rhs = self.as_tensor(lhs, span), self.as_tensor(rhs, span)
            return self.emit(f"{CALLS[op]}({lhs.code}, {rhs.code})", axes, span)
        if not lhs.tensor and not rhs.tensor:  # two numbers: computed as tensors, as the reference does
            lhs = self.as_tensor(lhs, span)
        return self.emit(f"{lhs.code} {INFIX[op]} {_operand(rhs.code)}", axes, span)

    def load(self, node: ir.Load, scope: dict[str, object]) -> Value:
        if is_gather(self.program, node):  # read at index expressions of positions (ncd/index_expr.py)
            return emit_gather(self, node, scope)
        code = self.env[node.tensor].code
        kept: list[str] = []
        for dim, index in reversed(list(enumerate(node.index))):
            if index.axis is None:
                assert index.index is not None
                code = f"{code}.select({dim}, {_int(index.index, scope)})"
            else:
                if index.axis in self.sliced:  # inside a scan's loop: this step only
                    code = f"{code}.narrow({dim}, {self.sliced[index.axis]}, 1)"
                kept.insert(0, index.axis)
        if code == self.env[node.tensor].code:
            return Value(code, tuple(kept))
        return self.emit(code, tuple(kept), node.span)

    def finite_sum(self, node: ir.FiniteSum, scope: dict[str, object]) -> Value:
        total: Value | None = None
        real: set[str] = set()
        for i in range(node.lo, node.hi + 1):
            term, carried = self.to_axes(self.eval(node.body, {**scope, node.var: i}), node.axes, "broadcast",
                                         node.span)
            real |= carried
            if total is None:
                total = self.as_tensor(term, node.span)
            else:
                total = self.emit(f"{total.code} + {_operand(term.code)}", node.axes, node.span)
        if total is None:  # an empty range sums to 0
            total = self.emit("_one * 0.0", (), node.span)
        if not total.axes and node.axes:
            return self.to_axes(Value(total.code, ()), node.axes, "exact", node.span)[0]
        return self.full(Value(total.code, node.axes), real, node.axes, node.span)

    def contract(self, node: ir.Contract, scope: dict[str, object]) -> Value:
        full = tuple(dict.fromkeys((*node.axes, *node.over)))
        if len(full) > len(EINSUM_LETTERS):
            raise unsupported(node.span, f"a contraction over {len(full)} axes (einsum takes at most 52)",
                              "split it into named steps")
        letter = {a: EINSUM_LETTERS[i] for i, a in enumerate(full)}
        left, left_axes = self.to_axes(self.eval(node.lhs, scope), full, "real", node.span)
        right, right_axes = self.to_axes(self.eval(node.rhs, scope), full, "real", node.span)
        out = [a for a in node.axes if a in left_axes | right_axes]
        equation = (f"{''.join(letter[a] for a in left.axes)},{''.join(letter[a] for a in right.axes)}"
                    f"->{''.join(letter[a] for a in out)}")
        value = self.emit(f'torch.einsum("{equation}", {left.code}, {right.code})', tuple(out), node.span)
        return self.to_axes(value, node.axes, "exact", node.span)[0] if tuple(out) != node.axes else value

    def normalize(self, node: ir.Normalize, scope: dict[str, object]) -> Value:
        """The reference's normalize, line by line: entries outside the mask or of zero weight are left out, a row
        whose sum z is 0 gives 0 with no gradient. Exponential maps are evaluated relative to the row's maximum
        (`stabiliser`), which cancels in a1 / b(z) and keeps them finite."""
        span = node.span
        s = self.eval(node.arg, scope)
        dim = s.axes.index(node.over)
        keep: Value | None = None
        if node.mask is not None:
            mask = self.to_axes(self.eval(node.mask, scope), s.axes, "exact", span)[0]
            keep = self.emit(f"{mask.code}.to(torch.float32)", s.axes, span)
        if node.weight is not None:
            weight = self.to_axes(self.eval(node.weight, scope), s.axes, "exact", span)[0]
            keep = weight if keep is None else self.emit(f"{keep.code} * {weight.code}", s.axes, span)
        form = self.stabiliser(node)
        rest = tuple(a for a in s.axes if a != node.over)
        sigma = None if node.sink is None else self.to_axes(self.eval(node.sink, scope), rest, "exact", span)[0]
        sink = None  # the sink's entry of the sum (docs/language.md: normalize's sink; b(z) = c z + beta)
        if form is None:
            a2, a1 = self.lam(node.a2, s, s.axes, span), self.lam(node.a1, s, s.axes, span)
            if sigma is not None:
                sink = self.lam(node.a2, sigma, rest, span)
        else:
            t = s if form.pre == streaming.X else self.printed(form.pre, s, span)
            visible = t if keep is None else self.emit(f"{t.code}.masked_fill({keep.code} == 0, -torch.inf)",
                                                       s.axes, span)
            largest = f"{visible.code}.amax({dim}, keepdim=True).detach()"
            if self.program.axis(node.over).fixed is None:  # amax has no value over an empty axis; 0 serves
                largest = f"{largest} if {self.size(node.over)} else {t.code}.sum({dim}, keepdim=True).detach()"
            top = self.emit(largest, s.axes, span)
            top = self.emit(f"torch.where(torch.isfinite({top.code}), {top.code}, 0.0)", s.axes, span)
            t_sink = None
            if sigma is not None and form.sink is not None:
                raise unsupported(span, "a sink here: b has a constant term (a sink of its own) besides normalize's "
                                  "sink", "give the sink once: b(z) = z with sink = ...")
            if sigma is not None:
                t_sink = sigma if form.pre == streaming.X else self.printed(form.pre, sigma, span)
            elif form.sink is not None:
                t_sink = self.emit(f"torch.full_like({top.code}.squeeze({dim}), {float(form.sink)!r})", rest, span)
            if t_sink is not None:  # the sink takes part in the row maximum, as a key would
                top = self.emit(f"torch.maximum({top.code}, {t_sink.code}.unsqueeze({dim}).detach())", s.axes,
                                span)
                lifted = self.emit(f"{t_sink.code} - {top.code}.squeeze({dim})", rest, span)
                sink = (self.lam(node.a2, lifted, rest, span) if form.pre == streaming.X and form.b is None
                        else self.printed(form.a2, lifted, span))
            shifted = self.emit(f"{t.code} - {top.code}", s.axes, span)
            if keep is not None:  # a masked score above the visible max would overflow exp, and its zero
                # gradient times inf is NaN: masked entries enter the maps at 0 (they are zeroed below anyway)
                shifted = self.emit(f"torch.where({keep.code} != 0, {shifted.code}, 0.0)", s.axes, span)
            if form.pre == streaming.X:  # the spec's own maps at x - max(x)
                a2, a1 = self.lam(node.a2, shifted, s.axes, span), self.lam(node.a1, shifted, s.axes, span)
            else:  # a1, a2 as maps of t = h(x) (streaming.stabilise), at t - max(t)
                a2, a1 = self.printed(form.a2, shifted, span), self.printed(form.a1, shifted, span)
            at = "x - max(x)" if form.pre == streaming.X else f"t - max(t), t = {form.pre}"
            self.stabilised.append(Stabilised(span, f"normalize evaluated at {at} over its axis"))
        if keep is not None:
            a2 = self.emit(f"{keep.code} * torch.where({keep.code} != 0, {a2.code}, 0.0)", s.axes, span)
            a1 = self.emit(f"{keep.code} * torch.where({keep.code} != 0, {a1.code}, 0.0)", s.axes, span)
        z = self.emit(f"{a2.code}.sum({dim})", rest, span)
        if sink is not None:
            z = self.emit(f"{z.code} + {sink.code}", rest, span)
        empty = self.emit(f"{z.code} == 0", rest, span)
        safe = self.emit(f"torch.where({empty.code}, 1.0, {z.code})", rest, span)
        if form is not None and form.b is not None:  # b(z) = c z + beta: its constant is the sink above
            b = self.printed(form.b.subs(streaming.Z, streaming.X), safe, span)
        else:
            b = self.lam(node.b, safe, rest, span)
        out = self.emit(f"{a1.code} / {b.code}.unsqueeze({dim})", s.axes, span)
        return self.emit(f"torch.where({empty.code}.unsqueeze({dim}), 0.0, {out.code})", s.axes, span)

    def stabiliser(self, node: ir.Normalize) -> streaming.Stabilised | None:
        """How a normalize's exponentials stay finite (ncd.streaming.stabilise, the attention family's analysis:
        a1 = C1 exp(c1 h(x)), a2 = C2 exp(c2 h(x)), b homogeneous of degree c1 / c2); None where its maps need
        no stabiliser (no exponential, or a bounded one such as sigmoid). Any other exponential is rejected."""
        fns = (node.a1, node.a2, node.b)
        if not any(isinstance(n, ir.Unary) and n.fn == "exp" for f in fns for n in ir.walk(f.body)):
            return None
        axes = {a.name: a for a in self.program.axes}
        try:
            a1, a2 = (to_sympy(f.body, axes, {f.param: streaming.X}) for f in fns[:2])
            b = to_sympy(node.b.body, axes, {node.b.param: streaming.Z})
            form = streaming.stabilise(a1, a2, b)
        except (TypeError, KeyError, ValueError, NotImplementedError) as err:
            form = f"its maps are not formulas ncd can analyse ({err})"
        if isinstance(form, str):
            raise unsupported(node.span, "this normalize safely: its exponentials can overflow where its value is "
                              "finite", f"{form}; softmax is a1(x) = exp(x), a2(x) = exp(x), b(z) = z")
        return None if form.rescale is None else form

    def printed(self, expr: sympy.Expr, x: Value, span: Span) -> Value:
        """A map in streaming.X, derived by sympy, applied to `x` (numbers only besides x: torch_expr checks)."""
        variable = sympy.Symbol(x.code, real=True)
        try:
            code = torch_expr(expr.subs(streaming.X, variable).evalf(), variable)
        except ValueError as err:
            raise unsupported(span, f"the stabilised form of this normalize ({err})",
                              "write a1 = a2 = exp(x) and b(z) = z") from None
        return self.emit(code, x.axes, span)

    # --- exponentials that overflow where their value is finite (ncd.stable_exp) ---------------------------------

    def stable_elementwise(self, node: ir.Node, scope: dict[str, object]) -> Value | None:
        """An element-wise subtree holding exp whose only wire is one load (`x / (1 + exp(-x))`), in
        ncd.stable_exp's overflow-free form where printing it as written could form inf/inf, inf - inf or 0 * inf
        (in the value or in autograd's derivative); None where it is safe as written or not such a subtree."""
        if not any(isinstance(n, ir.Unary) and n.fn == "exp" for n in ir.walk(node)):
            return None
        found = _single_wire_map(node)
        return None if found is None else self.stable_map(found[0], self.load(found[1], scope), node.span)

    def spelled_out_softmax(self, node: ir.Binary, scope: dict[str, object]) -> Value | None:
        """exp(S) / sum(exp(S), over A) (through intermediates) as exp(S - m) / sum(exp(S - m), over A) with m the
        maximum of S along A: the factor exp(m) cancels, and nothing overflows. None for any other division."""
        num, den = ir.inline(self.program, node.lhs), ir.inline(self.program, node.rhs)
        if not (isinstance(den, ir.Reduce) and den.op == "sum"):
            return None
        summand = ir.inline(self.program, den.arg)
        if not all(isinstance(n, ir.Unary) and n.fn == "exp" for n in (num, summand)):
            return None
        assert isinstance(num, ir.Unary) and isinstance(summand, ir.Unary)
        if _skeleton(num.arg) != _skeleton(summand.arg):
            return None
        span = node.span
        s = self.eval(num.arg, scope)
        if not s.tensor or not set(den.over) <= set(s.axes):
            return None
        dims = tuple(s.axes.index(a) for a in den.over)
        largest = f"{s.code}.amax({dims}, keepdim=True).detach()"
        sizes = [self.size(a) for a in den.over if self.program.axis(a).fixed is None]
        if sizes:  # amax has no value over an empty axis; 0 serves
            largest = f"{largest} if {' * '.join(sizes)} else {s.code}.sum({dims}, keepdim=True).detach()"
        top = self.emit(largest, s.axes, span)
        top = self.emit(f"torch.where(torch.isfinite({top.code}), {top.code}, 0.0)", s.axes, span)
        e = self.emit(f"torch.exp({s.code} - {top.code})", s.axes, span)
        z = self.emit(f"{e.code}.sum({dims})", tuple(a for a in s.axes if a not in den.over), span)
        over = " ".join(den.over)
        self.stabilised.append(Stabilised(span, f"exp(S) / sum(exp(S), over {over}) evaluated at S - max(S)"))
        (lhs, rhs), real = self.merge([e, z], node.axes, span)
        return self.full(self.binary("/", lhs, rhs, node.axes, span), real, node.axes, span)

    def reject_overflowing_sum(self, node: ir.Node, around: ir.Node) -> None:
        """`around` divides by (or takes the log of) `node`: a located error where `node` holds a sum over an axis
        of an unbounded exponential along it, the spelled-out softmax exp(x) / sum(exp(x), over c): its terms
        overflow fp32 above ~88 while the ratio stays finite, and no rescale can be derived here."""
        for total in self._inlined(node):
            if not isinstance(total, ir.Contract | ir.Reduce) or getattr(total, "op", "sum") != "sum":
                continue
            for e in self._inlined(total):
                if (isinstance(e, ir.Unary) and e.fn == "exp" and set(total.over) & set(e.arg.axes)
                        and not self._bounded(e)):
                    over = " ".join(total.over)
                    raise unsupported(around.span, f"a {'log' if isinstance(around, ir.Unary) else 'division'} "
                                      f"by a sum over '{over}' of exp(...) (line {e.span.line}): its terms overflow "
                                      "fp32 above ~88 where the result is finite",
                                      f"write normalize(S, over {over}, a1(v) = exp(v), a2(v) = exp(v), b(z) = z), "
                                      "which is evaluated at S - max(S), or bound the exponent")

    def _inlined(self, node: ir.Node):  # type: ignore[no-untyped-def]
        """Every node below `node`, through loads of intermediates; not into normalize (stabilised on its own)."""
        node = ir.inline(self.program, node)
        yield node
        if not isinstance(node, ir.Normalize):
            for child in ir.children(node):
                yield from self._inlined(child)

    def _bounded(self, exp: ir.Unary) -> bool:
        """Whether exp(...) of one wire stays below streaming.BOUNDED on every real value (exp(-x^2))."""
        expr = _single_wire_map(exp)
        return expr is not None and streaming._bounded(expr[0])

    def stable_map(self, expr: sympy.Expr, x: Value, span: Span) -> Value | None:
        """`expr` (a map of streaming.X) applied to `x` in stable_exp's form where(g <= 0, N(u)/D(u), N~(u)/D~(u)),
        u = exp(-|g|) <= 1; None where the map is safe as written, or where no rewrite exists (then the literal form
        runs, and `ncd check`'s large draws show any overflow)."""
        try:
            rewrite = stable_exp.stabilise(expr, streaming.X)
        except (stable_exp.UnsafeExponential, ValueError, TypeError, NotImplementedError, sympy.PolynomialError):
            return None  # no rewrite: the literal form runs
        if rewrite is None:
            return None
        g, low, high, u_symbol = rewrite
        var = sympy.Symbol("_x", real=True)
        try:
            g_value = self.emit(_print(g.subs(streaming.X, var), {var: x.code}), x.axes, span)
            # u = exp(-|g|) per branch, each finite everywhere (the unselected lanes get a zero gradient, which
            # must not meet an inf) and with the one-sided derivative at g = 0, where |g| has a kink
            u_low = self.emit(f"torch.exp({g_value.code}.clamp(max=0.0))", x.axes, span)
            u_high = self.emit(f"torch.exp(-{g_value.code}.clamp(min=0.0))", x.axes, span)
            low_value = self.emit(_print(low.subs(streaming.X, var), {var: x.code, u_symbol: u_low.code}), x.axes,
                                  span)
            high_value = self.emit(_print(high.subs(streaming.X, var), {var: x.code, u_symbol: u_high.code}),
                                   x.axes, span)
        except ValueError:
            return None
        return self.emit(f"torch.where({g_value.code} <= 0, {low_value.code}, {high_value.code})", x.axes, span)

    def lam(self, fn: ir.Lambda, x: Value, axes: tuple[str, ...], span: Span) -> Value:
        """An inline function applied element-wise to `x` (the reference's `lam`: expanded to x's shape); one that
        holds an exponential in stable_exp's overflow-free form where it needs one."""
        if any(isinstance(n, ir.Unary) and n.fn == "exp" for n in ir.walk(fn.body)):
            try:
                expr = to_sympy(fn.body, {a.name: a for a in self.program.axes}, {fn.param: streaming.X})
            except (TypeError, KeyError):
                expr = None
            stable = self.stable_map(expr, x, span) if expr is not None else None
            if stable is not None:
                return stable
        value = self.scalar(fn.body, {fn.param: x}, axes)
        if not value.tensor:
            return self.emit(f"torch.full_like({x.code}, {value.code})", axes, span)
        return value if value.axes == axes else self.emit(f"{value.code}.expand_as({x.code})", axes, span)

    def scalar(self, node: ir.Node, scope: dict[str, object], axes: tuple[str, ...]) -> Value:
        """A scalar function body (inline function, basis step) on tensors of one shape (`axes`)."""
        if isinstance(node, ir.Var):
            bound = scope[node.name]
            return bound if isinstance(bound, Value) else Value(repr(float(bound)), (), False)  # type: ignore[arg-type]
        if isinstance(node, ir.BasisTerm):
            terms: list[Value] = scope["__terms__"]  # type: ignore[assignment]
            return terms[-1 - node.back]
        if isinstance(node, ir.Unary):
            arg = self.scalar(node.arg, scope, axes)
            return self.unary(node.fn, arg, axes if arg.tensor and arg.axes else (), node.span)
        if isinstance(node, ir.Binary):
            lhs, rhs = self.scalar(node.lhs, scope, axes), self.scalar(node.rhs, scope, axes)
            shaped = axes if (lhs.tensor and lhs.axes) or (rhs.tensor and rhs.axes) else ()
            return self.binary(node.op, lhs, rhs, shaped, node.span)
        if isinstance(node, ir.Pow):
            base = self.scalar(node.base, scope, axes)
            return self.emit(f"{self.as_tensor(base, node.span).code} ** {_int(node.exponent, scope)}", base.axes,
                             node.span)
        if isinstance(node, ir.Where):
            parts = [self.as_tensor(self.scalar(n, scope, axes), node.span)
                     for n in (node.cond, node.then, node.otherwise)]
            shaped = axes if any(p.axes for p in parts) else ()
            return self.emit(f"torch.where({', '.join(p.code for p in parts)})", shaped, node.span)
        if isinstance(node, ir.Const | ir.SizeOf):
            return self.eval(node, scope)
        raise unsupported(node.span, f"a {type(node).__name__} inside a scalar function", "report this as an ncd bug")

    def basis(self, node: ir.BasisEval, scope: dict[str, object]) -> Value:
        basis = next(b for b in self.program.bases if b.name == node.basis)
        u = self.eval(node.arg, scope)
        if not u.tensor:
            u = self.as_tensor(u, node.span)
        if isinstance(node.index, str):
            count = self.program.axis(node.index).fixed
            if count is None:
                raise unsupported(node.span, f"a basis along '{node.index}', whose size is bound at call time",
                                  f"give axis '{node.index}' a fixed size")
        else:
            count = _int(node.index, scope) + 1
        terms = [self._term(self.scalar(t, {basis.param: u}, u.axes), u, node.span) for t in basis.initial]
        while len(terms) < count:
            local = {basis.param: u, basis.step_var: len(terms) - 1, "__terms__": terms}
            terms.append(self._term(self.scalar(basis.step, local, u.axes), u, node.span))
        if isinstance(node.index, str):
            stacked = ", ".join(t.code for t in terms[:count])
            return self.emit(f"torch.stack([{stacked}], dim=-1)", (*u.axes, node.index), node.span)
        return terms[count - 1]

    def _term(self, value: Value, u: Value, span: Span) -> Value:
        if not value.tensor:
            return self.emit(f"torch.full_like({u.code}, {value.code})", u.axes, span)
        if value.axes != u.axes:
            return self.emit(f"{value.code}.expand_as({u.code})", u.axes, span)
        return value


def _skeleton(node: object) -> object:
    """A node as nested tuples without its spans: equal for the same expression written in two places."""
    if isinstance(node, tuple | list):
        return tuple(_skeleton(n) for n in node)
    if is_dataclass(node) and not isinstance(node, type):
        return (type(node).__name__, *(_skeleton(getattr(node, f.name)) for f in fields(node) if f.name != "span"))
    return node


def _single_wire_map(node: ir.Node) -> tuple[sympy.Expr, ir.Load] | None:
    """(node as a sympy map of streaming.X, the load X stands for) where node is arithmetic and functions of
    numbers and one load (one tensor read one way); None otherwise."""
    leaves = [n for n in ir.walk(node) if not isinstance(n, ir.Unary | ir.Binary | ir.Pow | ir.Const)]
    loads = [n for n in leaves if isinstance(n, ir.Load)]
    if not loads or len(loads) < len(leaves) or any((n.tensor, n.index) != (loads[0].tensor, loads[0].index)
                                                     for n in loads):
        return None
    try:
        return to_sympy(node, leaf=lambda n: streaming.X if isinstance(n, ir.Load) else None), loads[0]
    except (TypeError, KeyError):
        return None


class _Printer(TorchPrinter):
    """torch code for a sympy map whose symbols are locals of the op body."""

    def __init__(self, names: dict[sympy.Symbol, str]) -> None:
        super().__init__(streaming.X)
        self.names = names

    def _print_Symbol(self, expr: sympy.Symbol) -> str:
        if expr not in self.names:
            raise ValueError(f"unexpected symbol {expr}")
        return self.names[expr]


def _print(expr: sympy.Expr, names: dict[sympy.Symbol, str]) -> str:
    return _Printer(names).doprint(expr.evalf())


def _permuted(code: str, order: list[int]) -> str:
    return code if order == sorted(order) else f"{code}.permute({', '.join(map(str, order))})"


def _operand(code: str) -> str:
    """A right operand that is a negative literal, parenthesised (`x - (-1.0)`, never `x - -1.0`)."""
    return f"({code})" if code.startswith("-") else code


def _int(expr: sympy.Expr, scope: dict[str, object]) -> int:
    """An integer index expression at the current finite-sum / recurrence variables (the reference's `_int`)."""
    value = sympy.sympify(expr).subs({sympy.Symbol(k, integer=True): v for k, v in scope.items()
                                      if isinstance(v, int)})
    if not value.is_Integer:
        raise AssertionError(f"index {expr} is not an integer here")  # the front end checks index ranges
    return int(value)
