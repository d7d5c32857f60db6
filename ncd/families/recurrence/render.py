"""Code generation for the recurrence family. Gated linear attention: render_linear_module, the config and op on
kernel_linear.py's static kernels (templates/linear_scan.py.jinja). Gated KalmaNet: the spec's hooks and config for
the static kernels of kernel.py (templates/recurrence.py.jinja), then the PyTorch op (templates/recurrence_op.py.jinja).
Spec-derived pieces are the per-token scalings and their derivatives (sympy, printed as Triton device functions),
the contraction rate, the plan's config (ridge, iteration count, output factor, precisions, tiles) and the scale
default."""

from __future__ import annotations

import ast
from dataclasses import fields

import sympy

from ncd import ir
from ncd.codegen.shared import CodegenError, default_code, environment
from ncd.families.recurrence.delta import DeltaRulePlan
from ncd.families.recurrence.linear import LinearScanPlan
from ncd.families.recurrence.plan import BETA, OFFSET, RIDGE, RecurrencePlan
from ncd.source import origin_name
from ncd.symbolic import triton_expr


def _device_expr(expr: sympy.Expr) -> str:
    """A scaling as Triton source in `bt`, broadcast to bt's shape when it is constant."""
    text = triton_expr(expr)
    tree = ast.parse(text, mode="eval")
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    if not names <= {"bt", "tl"}:
        raise CodegenError(f"unexpected names {names - {'bt', 'tl'}} in {text!r}")
    return text if "bt" in names else f"tl.full(bt.shape, {text}, tl.float32)"


def render_recurrence_module(program: ir.Program, plan: RecurrencePlan, op_id: str) -> str:
    r = plan.roles
    env = environment()
    ks, vs = plan.key_scale, plan.value_scale
    # the rate without an offset: the hook serves a call with ridge_offset 0 (with one, the kernels take each token's)
    rho_python = sympy.pycode(sympy.simplify(plan.rho.subs(OFFSET, 0)).subs(RIDGE, sympy.Symbol("a")))
    config = plan.config
    kernels = env.get_template("recurrence.py.jinja").render(
        spec_name=program.name, origin_file=origin_name(program.source.filename), roles=r,
        origins=plan.origins, config_repr={f.name: repr(getattr(config, f.name)) for f in fields(config)},
        key_scale=_device_expr(ks), key_scale_grad=_device_expr(sympy.diff(ks, BETA)),
        value_scale=_device_expr(vs), value_scale_grad=_device_expr(sympy.diff(vs, BETA)),
        key_scale_text=f"({ks})".replace("bt", r.beta or "1"), value_scale_text=f"({vs})".replace("bt", r.beta or "1"),
        rho_text=str(plan.rho), rho_python=rho_python,
        h_decay=f"exp({r.gk}_t) " if r.gk else "", s_decay=f"exp({r.g}_t) " if r.g else "",
    )
    inputs = [t for t in program.inputs]
    params = [t.name if t.default is None else f"{t.name}=None" for t in inputs]
    required = [f"({t.name!r}, {t.name})" for t in inputs if t.default is None]
    h_gate = r.h_gate
    gk = r.gk if h_gate == "gk" else None  # an input of its own
    present = {"beta": r.beta is not None, "alpha": r.alpha is not None, "scale": r.scale is not None,
               "g": r.g is not None, "gk": gk is not None}
    by_role: dict[str | None, str] = {r.q: "q", r.k: "k", r.v: "v", r.beta: "beta", r.alpha: "alpha", r.scale: "scale",
                                      gk: "gk", r.g: "g"}
    call_args = ", ".join(f"{by_role[t.name]}={t.name}" for t in inputs)
    scale_input = program.tensor(r.scale) if r.scale else None
    scale_default = "1.0" if scale_input is None else (
        default_code(program, scale_input) if scale_input.default is not None else "None")
    token = (r.batch, r.head, r.time) if r.head_first else (r.batch, r.time, r.head)
    axes = {role: tuple(program.tensor(name).axes) if name else token for role, name in
            (("q", r.q), ("k", r.k), ("v", r.v), ("g", r.g), ("gk", gk), ("o", r.output))}
    axes["beta"] = tuple(program.tensor(r.beta).axes) if r.beta else token
    axes["alpha"] = tuple(program.tensor(r.alpha).axes) if r.alpha else token
    op = env.get_template("recurrence_op.py.jinja").render(
        spec_name=program.name, op_id=op_id, origin_file=origin_name(program.source.filename), roles=_Roles(r),
        origins=plan.origins, params=params, call_args=call_args, scale_default=scale_default, required=required,
        present=present, h_gate=h_gate,
        axes_table=repr({a.name: (a.fixed, a.factors) for a in program.axes}), axes=axes,
    )
    text = kernels + op
    ast.parse(text)  # the templates must always produce valid Python
    return text


class _Roles:
    """Role names for the op template; absent optional inputs print as their op argument names."""

    def __init__(self, roles: object) -> None:
        self._roles = roles

    def __getattr__(self, name: str) -> str:
        value = getattr(self._roles, name)
        return value if value is not None else name


def render_linear_module(program: ir.Program, plan: LinearScanPlan, op_id: str) -> str:
    """The gated linear attention's module: its config and the op on kernel_linear.py's static kernels."""
    r = plan.roles
    return _render_scan_module("linear_scan.py.jinja", program, plan, op_id, {r.q: "q", r.k: "k", r.v: "v", r.g: "g"},
                               gate_per_head=r.gate_per_head, gate_per_key=r.gate_per_key)


def render_delta_module(program: ir.Program, plan: DeltaRulePlan, op_id: str) -> str:
    """The (gated) delta rule's module: its config and the op on kernel_delta.py's static kernels."""
    r = plan.roles
    gate = ["g"] if r.g else []
    return _render_scan_module("delta_rule.py.jinja", program, plan, op_id,
                               {r.q: "q", r.k: "k", r.v: "v", r.beta: "beta", **({r.g: "g"} if r.g else {})},
                               gated=r.g is not None, chunk_args=", ".join(["q", "k", "v", *gate, "beta", "scale"]))


def _render_scan_module(template: str, program: ir.Program, plan: LinearScanPlan | DeltaRulePlan, op_id: str,
                        by_role: dict[str, str], **extra: object) -> str:
    r = plan.roles
    inputs = list(program.inputs)
    by_role = {**by_role, **({r.scale: "scale"} if r.scale else {})}
    scale_input = program.tensor(r.scale) if r.scale else None
    scale_default = "1.0" if scale_input is None else (
        default_code(program, scale_input) if scale_input.default is not None else "None")
    axes = {role: tuple(program.tensor(name).axes) for name, role in by_role.items() if role != "scale"}
    axes["o"] = tuple(program.tensor(r.output).axes)
    text = environment().get_template(template).render(
        spec_name=program.name, op_id=op_id, origin_file=origin_name(program.source.filename), roles=_Roles(r),
        origins=plan.origins, config_repr={f.name: repr(getattr(plan.config, f.name)) for f in fields(plan.config)},
        params=[t.name if t.default is None else f"{t.name}=None" for t in inputs],
        required=[f"({t.name!r}, {t.name})" for t in inputs if t.default is None],
        call_args=", ".join(f"{by_role[t.name]}={t.name}" for t in inputs), scale_default=scale_default,
        scale_present=r.scale is not None, head_first=r.head_first,
        axes_table=repr({a.name: (a.fixed, a.factors) for a in program.axes}), axes=axes, **extra)
    ast.parse(text)  # the template must always produce valid Python
    return text
