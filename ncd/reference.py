"""A naive evaluator of the IR in PyTorch: the float64 reference every generated kernel is checked against.

It follows the spec's meaning literally (materialising every wire), so it is slow and simple. Values are
tensors whose dimensions are named by the wire's axes; broadcasting is by name, split axes are views of
their factors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import sympy
import torch

from . import ir
from .index_expr import gather, is_gather


@dataclass(frozen=True)
class Named:
    data: torch.Tensor
    axes: tuple[str, ...]


class ReferenceError(ValueError):
    pass


def bind_sizes(program: ir.Program, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Sizes of every axis from the tensors given (checked against fixed sizes and split products)."""
    sizes: dict[str, int] = {}
    symbols: dict[sympy.Symbol, int] = {}
    for t in (*program.inputs, *program.params):
        if t.name not in tensors:
            continue
        value = tensors[t.name]
        if value.dim() != len(t.axes):
            raise ReferenceError(f"{t.name}: expected {len(t.axes)} dims [{' '.join(t.axes)}], got {value.dim()}")
        for axis_name, n in zip(t.axes, value.shape, strict=True):
            axis = program.axis(axis_name)
            if axis.size.is_Symbol:
                symbols.setdefault(axis.size, int(n))
            sizes.setdefault(axis_name, int(n))
            if sizes[axis_name] != n:
                raise ReferenceError(f"{t.name}: axis {axis_name} is {n}, elsewhere {sizes[axis_name]}")
    for axis in program.axes:  # derive split factors, fixed sizes and aliases
        if axis.name in sizes and axis.factors:
            known = [f for f in axis.factors if program.axis(f).size in symbols or program.axis(f).fixed]
            if len(known) == len(axis.factors) - 1:
                rest = next(f for f in axis.factors if f not in known)
                prod = math.prod(int(program.axis(f).size.subs(symbols)) for f in known)
                symbols[program.axis(rest).size] = sizes[axis.name] // prod
    for axis in program.axes:
        value = axis.size.subs(symbols)
        if not value.is_Integer:
            raise ReferenceError(f"axis {axis.name} has no size: pass a tensor that carries it")
        if axis.name in sizes and sizes[axis.name] != int(value):
            raise ReferenceError(f"axis {axis.name} is {sizes[axis.name]}, expected {int(value)}")
        sizes[axis.name] = int(value)
    return sizes


def evaluate(program: ir.Program, tensors: Mapping[str, torch.Tensor | float],
             dtype: torch.dtype = torch.float64, unrolled_solves: bool = False,
             normalisers: list[Named] | None = None, scores: list[torch.Tensor] | None = None
             ) -> dict[str, torch.Tensor]:
    """Every output of the program, in `dtype`, from named inputs and parameters. A chebyshev_solve is
    differentiated implicitly, as the solve it approximates (docs/language.md, section 17), unless
    `unrolled_solves`: then autograd follows its iterations. Each normalize's b(z) is appended to
    `normalisers` where one is given (validation looks at how close rows come to b's zero), and the scores it
    normalises that a row sees (its mask and weight) to `scores`, flattened (validation aims its large draws)."""
    env: dict[str, Named] = {}
    given: dict[str, torch.Tensor] = {}
    for t in (*program.inputs, *program.params):
        supplied = tensors.get(t.name)
        if supplied is None:
            if t.default is None:
                raise ReferenceError(f"missing input {t.name}")
            continue
        given[t.name] = torch.as_tensor(supplied).to(dtype)
    sizes = bind_sizes(program, given)
    ev = _Evaluator(program, sizes, dtype, env, unrolled_solves, keep_scores=scores is not None)
    for t in (*program.inputs, *program.params):
        if t.name in given:
            env[t.name] = Named(given[t.name], t.axes)
        else:
            assert t.default is not None
            env[t.name] = ev.eval(t.default, {})  # a scalar input left at its default
    for d in program.definitions:
        env[d.tensor] = ev.to_axes(ev.eval(d.value, {}), program.tensor(d.tensor).axes)
    if normalisers is not None:
        normalisers += ev.normalisers
    if scores is not None:
        scores += ev.scores
    return {t.name: env[t.name].data for t in program.outputs}


class _Evaluator:
    def __init__(self, program: ir.Program, sizes: dict[str, int], dtype: torch.dtype, env: dict[str, Named],
                 unrolled_solves: bool = False, keep_scores: bool = False):
        self.p, self.sizes, self.dtype, self.env = program, sizes, dtype, env
        self.unrolled_solves = unrolled_solves
        self.bases = {b.name: b for b in program.bases}
        self.normalisers: list[Named] = []
        self.scores: list[torch.Tensor] = []
        self.keep_scores = keep_scores

    def const(self, value: float) -> Named:
        return Named(torch.tensor(value, dtype=self.dtype), ())

    def to_axes(self, value: Named, axes: tuple[str, ...]) -> Named:
        """Broadcast and permute `value` to exactly `axes`, expanding factors into split axes."""
        data, have = value.data, list(value.axes)
        for axis in axes:  # a split axis built from factors present: flatten them (outer first)
            factors = self.p.axis(axis).factors
            if axis not in have and factors and all(f in have for f in factors):
                order = [have.index(f) for f in factors]
                rest = [i for i in range(len(have)) if i not in order]
                data = data.permute([*rest, *order]).reshape(*[data.shape[i] for i in rest], -1)
                have = [have[i] for i in rest] + [axis]
        for i, axis in enumerate(list(have)):  # a factor meeting its split axis: index by c // width etc.
            owner = next((a for a in axes if axis in self.p.axis(a).factors), None)
            if owner is None:
                continue
            data, have = self._expand_factor(data, have, i, owner)
        for axis in axes:
            if axis not in have:
                data = data.unsqueeze(-1).expand(*data.shape, self.sizes[axis])
                have.append(axis)
        if sorted(have) != sorted(axes):
            raise ReferenceError(f"cannot bring [{' '.join(have)}] to [{' '.join(axes)}]")
        return Named(data.permute([have.index(a) for a in axes]), axes)

    def _expand_factor(self, data, have, i, owner):
        factors = self.p.axis(owner).factors
        k = factors.index(have[i])
        inner = math.prod(self.sizes[f] for f in factors[k + 1:])
        outer = self.sizes[have[i]]
        index = (torch.arange(self.sizes[owner]) // inner) % outer
        data = data.index_select(i, index)
        have = list(have)
        have[i] = owner
        if have.count(owner) > 1:  # two factors of one split axis: keep the diagonal
            j = have.index(owner)
            data = torch.diagonal(data, dim1=j, dim2=i)
            del have[i]
            have.remove(owner)
            have.append(owner)
        return data, have

    def merge(self, *values: Named, axes: tuple[str, ...]) -> list[torch.Tensor]:
        return [self.to_axes(v, axes).data for v in values]

    def eval(self, node: ir.Node, scope: dict[str, object]) -> Named:
        if isinstance(node, ir.Const):
            return self.const(node.value)
        if isinstance(node, ir.SizeOf):
            return self.const(float(self.sizes[node.axis]))
        if isinstance(node, ir.Var):
            value = scope[node.name]
            return value if isinstance(value, Named) else self.const(float(value))  # type: ignore[arg-type]
        if isinstance(node, ir.AxisIndex):
            return Named(torch.arange(self.sizes[node.axis], dtype=self.dtype), (node.axis,))
        if isinstance(node, ir.Load):
            return self.load(node, scope)
        if isinstance(node, ir.Unary):
            return Named(_UNARY[node.fn](self.eval(node.arg, scope).data), node.arg.axes)
        if isinstance(node, ir.Binary):
            lhs, rhs = self.merge(self.eval(node.lhs, scope), self.eval(node.rhs, scope), axes=node.axes)
            return Named(_BINARY[node.op](lhs, rhs), node.axes)
        if isinstance(node, ir.Pow):
            base = self.eval(node.base, scope)
            return Named(base.data ** _int(node.exponent, scope), base.axes)
        if isinstance(node, ir.Where):
            cond, then, other = self.merge(*(self.eval(n, scope) for n in (node.cond, node.then, node.otherwise)),
                                           axes=node.axes)
            return Named(torch.where(cond.bool(), then, other), node.axes)
        if isinstance(node, ir.FiniteSum):
            total = torch.zeros((), dtype=self.dtype)
            for i in range(node.lo, node.hi + 1):
                total = total + self.to_axes(self.eval(node.body, {**scope, node.var: i}), node.axes).data
            return Named(self.to_axes(Named(total, node.axes if total.dim() else ()), node.axes).data, node.axes)
        if isinstance(node, ir.Reduce):
            arg = self.eval(node.arg, scope)
            dims = [arg.axes.index(a) for a in node.over]
            data = arg.data.sum(dims) if node.op == "sum" else arg.data.amax(dims)
            return Named(data, node.axes)
        if isinstance(node, ir.Contract):
            full = tuple(dict.fromkeys((*node.axes, *node.over)))
            left, right = self.merge(self.eval(node.lhs, scope), self.eval(node.rhs, scope), axes=full)
            return Named((left * right).sum([full.index(o) for o in node.over]), node.axes)
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
        raise ReferenceError(f"the reference cannot evaluate {type(node).__name__} here")

    def load(self, node: ir.Load, scope: dict[str, object]) -> Named:
        value = self.env[node.tensor]
        data = value.data
        if is_gather(self.p, node):  # read at index expressions of positions (ncd/index_expr.py)
            scalars = {t.name: self.env[t.name].data for t in self.p.inputs if not t.axes}
            return Named(gather(self.p, node, data, self.sizes, scope, scalars), node.axes)
        kept: list[str] = []
        for dim, index in reversed(list(enumerate(node.index))):
            if index.axis is None:
                assert index.index is not None
                data = data.select(dim, _int(index.index, scope))
            else:
                kept.insert(0, index.axis)
        return Named(data, tuple(kept))

    def scalar(self, node: ir.Node, scope: dict[str, object]) -> torch.Tensor:
        """A scalar function body (inline function, basis term) applied element-wise to same-shape tensors."""
        if isinstance(node, ir.Var):
            value = scope[node.name]
            return value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=self.dtype)  # type: ignore[arg-type]
        if isinstance(node, ir.BasisTerm):
            terms = scope["__terms__"]
            return terms[-1 - node.back]  # type: ignore[index]
        if isinstance(node, ir.Unary):
            return _UNARY[node.fn](self.scalar(node.arg, scope))
        if isinstance(node, ir.Binary):
            return _BINARY[node.op](self.scalar(node.lhs, scope), self.scalar(node.rhs, scope))
        if isinstance(node, ir.Pow):
            return self.scalar(node.base, scope) ** _int(node.exponent, scope)
        if isinstance(node, ir.Where):
            cond, a, b = (self.scalar(n, scope) for n in (node.cond, node.then, node.otherwise))
            return torch.where(cond.bool(), a, b)
        if isinstance(node, ir.Const | ir.SizeOf):
            return self.eval(node, scope).data
        raise ReferenceError(f"{type(node).__name__} inside a scalar function")

    def lam(self, fn: ir.Lambda, x: torch.Tensor) -> torch.Tensor:
        return self.scalar(fn.body, {fn.param: x}).expand_as(x)

    def normalize(self, node: ir.Normalize, scope: dict[str, object]) -> Named:
        s = self.eval(node.arg, scope)
        data = s.data
        keep = torch.ones_like(data)
        if node.mask is not None:
            keep = self.to_axes(self.eval(node.mask, scope), s.axes).data.to(self.dtype)
        if node.weight is not None:
            keep = keep * self.to_axes(self.eval(node.weight, scope), s.axes).data
        dim = s.axes.index(node.over)
        if self.keep_scores:
            seen, weight = torch.broadcast_tensors(data, keep)
            self.scores.append(seen[weight != 0].detach())
        z = (keep * torch.where(keep != 0, self.lam(node.a2, data), 0)).sum(dim)
        if node.sink is not None:  # one more entry with no value (docs/language.md, normalize's sink)
            rest = tuple(a for a in s.axes if a != node.over)
            z = z + self.lam(node.a2, self.to_axes(self.eval(node.sink, scope), rest).data.expand_as(z))
        masked = z == 0  # a row with no visible key of nonzero weight: output 0, no gradient (docs/language.md)
        b = self.lam(node.b, torch.where(masked, 1, z))
        self.normalisers.append(Named(b, tuple(a for a in s.axes if a != node.over)))
        out = keep * torch.where(keep != 0, self.lam(node.a1, data), 0) / b.unsqueeze(dim)
        return Named(torch.where(masked.unsqueeze(dim), 0, out), s.axes)

    def basis(self, node: ir.BasisEval, scope: dict[str, object]) -> Named:
        basis = self.bases[node.basis]
        u = self.eval(node.arg, scope)
        count = self.sizes[node.index] if isinstance(node.index, str) else _int(node.index, scope) + 1
        terms = [self.scalar(t, {basis.param: u.data}).expand_as(u.data) for t in basis.initial]
        while len(terms) < count:
            local = {basis.param: u.data, basis.step_var: len(terms) - 1, "__terms__": terms}
            terms.append(self.scalar(basis.step, local).expand_as(u.data))
        if isinstance(node.index, str):
            return Named(torch.stack(terms[:count], dim=-1), (*u.axes, node.index))
        return Named(terms[count - 1], u.axes)

    def scan(self, node: ir.Scan, scope: dict[str, object]) -> Named:
        """Step by step: the body is evaluated for every position and the current one kept (slow, plain)."""
        time = node.over
        state_axes = tuple(a for a in node.axes if a != time)
        state = torch.zeros([self.sizes[a] for a in state_axes], dtype=self.dtype)
        if node.init is not None:
            state = self.to_axes(self.eval(node.init, scope), state_axes).data
        steps = []
        for t in range(self.sizes[time]):
            value = self.eval(node.body, {**scope, "__prev__": Named(state, state_axes)})
            state = self.to_axes(value, node.axes).data.select(node.axes.index(time), t)
            steps.append(state)
        return Named(torch.stack(steps, dim=node.axes.index(time)), node.axes)

    def solve(self, node: ir.ChebyshevSolve, scope: dict[str, object]) -> Named:
        a = self.eval(node.matrix, scope)
        b = self.eval(node.rhs, scope)
        batch = tuple(x for x in node.axes if x != node.over)
        amat = self.to_axes(a, (*batch, node.row, node.over)).data
        rhs = self.to_axes(b, (*tuple(x if x != node.over else node.row for x in node.axes),)).data
        rhs = self.to_axes(Named(rhs, tuple(x if x != node.over else node.row for x in node.axes)),
                           (*batch, node.row)).data
        mu = self.to_axes(self.eval(node.mu, scope), batch).data[..., None]
        lip = self.to_axes(self.eval(node.lipschitz, scope), batch).data[..., None]
        if self.unrolled_solves:
            x = chebyshev_iteration(amat, rhs, mu, lip, node.iterations)
        else:
            x = _ImplicitSolve.apply(amat, rhs, mu, lip, node.iterations)
        return Named(x, (*batch, node.over))


def chebyshev_iteration(a: torch.Tensor, b: torch.Tensor, mu: torch.Tensor, lip: torch.Tensor,
                        iterations: int) -> torch.Tensor:
    """Chebyshev iteration for SPD `a` with spectrum in [mu, lip]: x_0 = 2 b / (L + mu), omega_0 = 2, then
    `iterations` steps (papers/gated-kalmanet.txt, Algorithm 1; the official kernels loop num_iter times)."""
    def matvec(x):
        return (a @ x.unsqueeze(-1)).squeeze(-1)

    kappa_ratio = (lip - mu) / (lip + mu)
    x_prev = torch.zeros_like(b)
    x = 2 * b / (lip + mu)
    omega = torch.full_like(mu, 2.0)
    for _ in range(iterations):
        omega = 1 / (1 - omega * kappa_ratio**2 / 4)
        r = b - matvec(x)
        x, x_prev = omega * (x - x_prev + 2 / (lip + mu) * r) + x_prev, x
    return x


class _ImplicitSolve(torch.autograd.Function):
    """x = chebyshev_iteration(A, b), differentiated as the exact solve of A x = b, as the generated backward does
    (papers/gated-kalmanet.txt, eq. 7-10): db = z with A^T z = dx solved by the same iteration, dA = -z x^T; mu and
    L only steer the iteration and get no gradient. Equal to autograd through the iterations once they converge."""

    @staticmethod
    def forward(ctx, a, b, mu, lip, iterations):  # type: ignore[override]
        x = chebyshev_iteration(a, b, mu, lip, iterations)
        ctx.save_for_backward(a, x, mu, lip)
        ctx.iterations = iterations
        return x

    @staticmethod
    def backward(ctx, dx):  # type: ignore[override]
        a, x, mu, lip = ctx.saved_tensors
        z = chebyshev_iteration(a.transpose(-1, -2), dx, mu, lip, ctx.iterations)
        return -z.unsqueeze(-1) * x.unsqueeze(-2), z, None, None, None


def _int(expr: sympy.Expr, scope: Mapping[str, object]) -> int:
    """An integer index expression at the current finite-sum / recurrence variables."""
    return int(expr.subs({sympy.Symbol(k, integer=True): v for k, v in scope.items() if isinstance(v, int)}))


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg": torch.neg, "abs": torch.abs, "sign": torch.sign, "exp": torch.exp, "log": torch.log,
    "sqrt": torch.sqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos,
    "acos": torch.acos, "not": torch.logical_not,
}
_BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.div, "max": torch.maximum, "min": torch.minimum,
    "<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge, "==": torch.eq, "!=": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or,
}
