"""Code generation for the polynomial-KAN family: `templates/polykan.py.jinja` (kernels and launchers) followed by
`templates/polykan_op.py.jinja` (the PyTorch custom op, autograd and nn.Module). Only checked identifiers,
numbers and sympy-printed expressions (checked to use nothing but their own variables, `tl` and `math`) reach
the text; the lookup table travels as base64 of its fp32 bytes."""

from __future__ import annotations

import ast
import base64
from typing import TYPE_CHECKING, Any

import numpy as np
import sympy

from ncd import ir
from ncd.basis_lut import U
from ncd.symbolic import triton_expr

from .attention import _environment

if TYPE_CHECKING:
    from ncd.polykan import PolyKANPlan

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


def render_polykan_op(program: ir.Program, plan: PolyKANPlan, op_id: str) -> str:
    r = plan.roles
    D = plan.degrees
    xv = sympy.Symbol("xv", real=True)
    u = sympy.Symbol("u", real=True)
    ctx: dict[str, Any] = {
        "spec_name": program.name, "origin_file": program.source.filename.rsplit("/", 1)[-1], "op_id": op_id,
        "D": D, "basis_name": r.basis, "basis_origin": r.basis_origin, "arg_origin": r.arg_origin,
        "out_origin": r.out_origin, "recurrence_lines": plan.recurrence.describe(),
        "arg_text": sympy.sstr(plan.arg.subs(xv, sympy.Symbol(r.x))),
        "arg_expr": _check(triton_expr(plan.arg), {"xv"}), "darg_expr": _check(triton_expr(plan.darg), {"xv"}),
        "layout": plan.layout, "c_axes": r.c_axes, "mode": plan.basis_eval,
    }
    # degrees whose derivative is identically zero (sympy): dX skips them
    ctx["dzero"] = {k for k, dp in enumerate(plan.recurrence.dinitial) if k < D and sympy.simplify(dp) == 0}
    ctx["dstart"] = next(k for k in range(D + 1) if k not in ctx["dzero"])
    table = plan.table
    ctx["lut"] = table is not None
    if table is not None:
        inv_h = 1.0 / table.h
        data = base64.b64encode(
            np.stack([table.values, table.derivs]).astype("<f4").tobytes()).decode("ascii")
        ctx.update(
            t_name=table.param.name, entries=table.entries, t_lo=repr(float(table.param.lo)), inv_h=repr(inv_h),
            u_lo=repr(float(plan.domain[0] if plan.domain else -1.0)),
            u_hi=repr(float(plan.domain[1] if plan.domain else 1.0)),
            t_expr=_check(triton_expr(table.param.forward.subs(U, u)), {"u"}),
            table_b64=[data[i:i + 100] for i in range(0, len(data), 100)],
            lut_error=table.error, lut_derror=table.derror,
            mode_text=f"lookup table in t = {table.param.name}, {table.entries} entries, linear interpolation "
                      f"(measured max relative error {table.error:.3g}, derivatives {table.derror:.3g})",
        )
        ctx.update(rec_values=[], rec_derivs=[])
    else:
        values, derivs = [], []
        names = {"u"} | {f"p{k}" for k in range(D)} | {f"dp{k}" for k in range(D)}
        for k, (p, dp) in enumerate(plan.recurrence.terms(D)):
            p_text = _check(triton_expr(p.subs(U, u)), names)
            dp_text = _check(triton_expr(dp.subs(U, u)), names)
            values.append(f"p{k} = tl.zeros_like(u) + ({p_text})  # P_{k}, {r.basis_origin}")
            derivs.append(f"dp{k} = tl.zeros_like(u) + ({dp_text})  # P'_{k} (derivative recurrence)")
        ctx.update(rec_values=values, rec_derivs=derivs,
                   mode_text="the recurrence, unrolled in fp32 (values and derivatives)")
    x_axes, c_axes = program.tensor(r.x).axes, r.c_axes
    out_axes = program.tensor(r.output).axes
    ctx.update(
        x_name=r.x, c_name=r.coeffs, output=r.output, out_axes=out_axes, batch=r.batch, inp=r.inp, outp=r.outp,
        x_axes=repr(x_axes), c_axes_repr=repr(c_axes), x_origin=program.tensor(r.x).span.origin,
        c_origin=program.tensor(r.coeffs).span.origin,
        x_perm=_perm(tuple(x_axes.index(a) for a in (r.batch, r.inp))),
        c_perm=_perm(plan.perm),
        out_perm=_perm(tuple((r.batch, r.outp).index(a) for a in out_axes)),
        axes_table=repr({a.name: (a.fixed, a.factors) for a in program.axes}),
    )
    env = _environment()
    text = env.get_template("polykan.py.jinja").render(**ctx)
    text += env.get_template("polykan_op.py.jinja").render(**{**ctx, "c_axes": repr(c_axes)})
    ast.parse(text)
    return text
