"""Code generation for the polynomial-KAN family: `templates/polykan.py.jinja` (kernels and launchers) followed by
`templates/polykan_op.py.jinja` (the PyTorch custom op, autograd and nn.Module). Only checked identifiers,
numbers and sympy-printed expressions (checked to use nothing but their own variables, `tl` and `math`) reach
the text; the lookup table travels as base64 of its fp32 bytes."""

from __future__ import annotations

import ast
import base64
import dataclasses
import lzma
import textwrap
from typing import TYPE_CHECKING, Any

import numpy as np
import sympy

from ncd import ir
from ncd.codegen.pytext import fit
from ncd.codegen.shared import environment
from ncd.families.polykan.basis_lut import N, U
from ncd.families.polykan.plan import MATMUL
from ncd.source import origin_name
from ncd.symbolic import triton_expr

if TYPE_CHECKING:
    from ncd.families.polykan.config import PolyKANConfig
    from ncd.families.polykan.plan import PolyKANPlan

_ALLOWED = {"tl", "math"}


class PolyKANCodegenError(ValueError):
    """An expression that may not be spliced into generated code (a compiler bug, never a user mistake)."""


def _check(text: str, variables: set[str]) -> str:
    if "\n" in text or "\r" in text:
        raise PolyKANCodegenError(f"expression must be one line: {text!r}")
    tree = ast.parse(text, mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in _ALLOWED | variables:
            raise PolyKANCodegenError(f"unknown name {node.id!r} in {text!r}")
        if isinstance(node, ast.Lambda | ast.NamedExpr | ast.Await | ast.Yield | ast.YieldFrom):
            raise PolyKANCodegenError(f"unsupported construct in {text!r}")
    return text


def _perm(perm: tuple[int, ...]) -> str:
    return "" if perm == tuple(range(len(perm))) else f".permute{perm}"


def _poly_text(expr: sympy.Expr, gens: list[sympy.Symbol], n: sympy.Symbol) -> str:
    """`expr` (polynomial in `gens`, coefficients in the step variable n) printed as a sum of
    (scalar coefficient in n) * monomial, so that the kernels compute the n-dependent coefficients once per
    degree as scalars and the per-element work is multiply-adds. Falls back to the plain expression."""
    try:
        poly = sympy.Poly(sympy.expand(expr), *gens)
    except sympy.PolynomialError:
        return triton_expr(expr)
    if any(c.free_symbols - {n} for c in poly.coeffs()):
        return triton_expr(expr)
    parts = []
    for monom, coeff in poly.terms():
        factors = [str(g) for g, e in zip(gens, monom, strict=True) for _ in range(e)]
        coeff = sympy.factor(coeff)
        text = triton_expr(coeff)
        if not factors:
            parts.append(f"({text})")
        elif coeff == 1:
            parts.append(" * ".join(factors))
        else:
            parts.append(f"({text}) * " + " * ".join(factors))
    return " + ".join(parts) if parts else "0.0"


def _recurrence_context(plan: PolyKANPlan) -> dict[str, Any]:
    """Text of the recurrence as the kernels evaluate it, in a runtime loop over degrees d: P_d from the
    carried P_{d-1}, P_{d-2}, ... (q0, q1, ...) with the step variable n = d - 1; the first terms directly."""
    rec = plan.recurrence
    if len(rec.initial) < rec.depth:
        raise PolyKANCodegenError("the recurrence needs at least as many initial terms as it reads back")
    n = sympy.Symbol("n", real=True)
    u = sympy.Symbol("u", real=True)
    qs = [sympy.Symbol(f"q{j}", real=True) for j in range(rec.depth)]
    dqs = [sympy.Symbol(f"dq{j}", real=True) for j in range(rec.depth)]
    subs: dict[sympy.Basic, sympy.Basic] = {U: u, N: n}
    for j in range(rec.depth):
        subs[sympy.Symbol(f"P{j}", real=True)] = qs[j]
        subs[sympy.Symbol(f"dP{j}", real=True)] = dqs[j]
    names = {"u", "n", *map(str, qs), *map(str, dqs)}
    step = _check(_poly_text(rec.step.subs(subs), [u, *qs], n), names)
    dstep = _check(_poly_text(rec.dstep.subs(subs), [u, *qs, *dqs], n), names)
    initial = [_check(triton_expr(sympy.sympify(p).subs(U, u)), {"u"}) for p in rec.initial]
    dinitial = [_check(triton_expr(sympy.sympify(p).subs(U, u)), {"u"}) for p in rec.dinitial]
    step_names = _names(step) | {n for text in initial for n in _names(text)}
    dstep_names = _names(dstep) | {n for text in dinitial for n in _names(text)}

    def unpack(carried: list[sympy.Symbol], source: str, used: set[str]) -> str:
        names = [str(q) if str(q) in used else "_" for q in carried]
        return f"    ({', '.join(names)},) = {source}" if len(names) == 1 else f"    {', '.join(names)} = {source}"

    return {"q_names": [str(q) for q in qs], "dq_names": [str(q) for q in dqs], "step_statement": fit("p = ", step),
            "unpack_next": unpack(qs, "q", step_names),
            "unpack_dnext": unpack(qs, "q", dstep_names) + "\n" + unpack(dqs, "dq", dstep_names),
            "dstep_statement": fit("p = ", dstep), "step_uses_n": "n" in _names(step),
            "dstep_uses_n": "n" in _names(dstep), "initial_texts": initial, "dinitial_texts": dinitial}


def _names(text: str) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(text, mode="eval")) if isinstance(node, ast.Name)}


def config_literal(config: PolyKANConfig) -> str:
    """The plan's config as a Python literal for the generated module (one field a line)."""
    fields = ",\n".join(f"    {f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config))
    return f"PolyKANConfig(\n{fields},\n)"


def render_polykan_op(program: ir.Program, plan: PolyKANPlan, op_id: str) -> str:
    r = plan.roles
    D = plan.degrees
    xv = sympy.Symbol("xv", real=True)
    u = sympy.Symbol("u", real=True)
    ctx: dict[str, Any] = {
        "spec_name": program.name, "origin_file": origin_name(program.source.filename), "op_id": op_id,
        "D": D, "basis_name": r.basis, "basis_origin": r.basis_origin, "arg_origin": r.arg_origin,
        "out_origin": r.out_origin, "recurrence_lines": plan.recurrence.describe(),
        "arg_text": sympy.sstr(plan.arg.subs(xv, sympy.Symbol(r.x))),
        "arg_return": fit("return ", _check(triton_expr(plan.arg), {"xv"})),
        "darg_return": fit("return ", _check(triton_expr(plan.darg), {"xv"})),
        "layout": plan.layout, "c_axes": r.c_axes, "mode": plan.basis_eval, "split": MATMUL[plan.matmul],
        "config": config_literal(plan.config),
        **_recurrence_context(plan),
    }
    table = plan.table
    ctx["lut"] = table is not None
    if table is not None:
        inv_h = 1.0 / table.h
        # fp32 bytes, xz-compressed (lossless; about a third of the size for these smooth tables), as base85 text
        data = base64.b85encode(lzma.compress(
            np.stack([table.values, table.derivs]).astype("<f4").tobytes(), preset=9)).decode("ascii")
        ctx.update(
            t_name=table.param.name, entries=table.entries, t_lo=repr(float(table.param.lo)), inv_h=repr(inv_h),
            u_lo=repr(float(plan.domain[0] if plan.domain else -1.0)),
            u_hi=repr(float(plan.domain[1] if plan.domain else 1.0)),
            t_statement=fit("t = ", _check(triton_expr(table.param.forward.subs(U, u)), {"u"})),
            table_text=[data[i:i + 112] for i in range(0, len(data), 112)],
            lut_error=table.error, lut_derror=table.derror, lut_const=plan.config.lut_const,
            mode_text=f"lookup table in t = {table.param.name}, {table.entries} entries, linear interpolation "
                      f"(measured max relative error {table.error:.3g}, derivatives {table.derror:.3g})",
        )
    else:
        ctx.update(mode_text="the recurrence, in fp32, carried through a loop over degrees (values and "
                             "derivatives)")
    ctx["mode_lines"] = [("#   basis evaluation: " if i == 0 else "#     ") + line
                         for i, line in enumerate(textwrap.wrap(ctx["mode_text"], 96))]
    x_axes, c_axes = program.tensor(r.x).axes, r.c_axes
    out_axes = program.tensor(r.output).axes
    inverse = tuple(plan.perm.index(k) for k in range(3))
    ctx.update(
        x_name=r.x, c_name=r.coeffs, output=r.output, out_axes=out_axes, batch=r.batch, inp=r.inp, outp=r.outp,
        x_axes=repr(x_axes), c_axes_repr=repr(c_axes), x_origin=program.tensor(r.x).span.origin,
        c_origin=program.tensor(r.coeffs).span.origin,
        x_perm=_perm(tuple(x_axes.index(a) for a in (r.batch, r.inp))),
        x_direct=tuple(x_axes) == (r.batch, r.inp),
        c_perm=_perm(plan.perm), c_perm_tuple=repr(plan.perm), c_inverse=repr(inverse),
        c_identity=plan.perm == (0, 1, 2), o_axis=c_axes.index(r.outp),
        out_perm=_perm(tuple((r.batch, r.outp).index(a) for a in out_axes)),
        out_perm_tuple=repr(tuple((r.batch, r.outp).index(a) for a in out_axes)),
        axes_table=repr({a.name: (a.fixed, a.factors) for a in program.axes}),
    )
    env = environment()
    text = env.get_template("polykan.py.jinja").render(**ctx)
    text += env.get_template("polykan_op.py.jinja").render(**{**ctx, "c_axes": repr(c_axes)})
    ast.parse(text)
    return text
