"""Code generation for the group-rational family: kernels (templates/rational.py.jinja) followed by the PyTorch
op (templates/rational_op.py.jinja). Only checked identifiers, numbers and sympy-printed expressions reach the
text; every spliced expression is parsed and may name only `x`, the coefficients `cK`, temporaries `tK` and `tl`."""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any

from ncd import ir
from ncd.codegen.pytext import comment_lines as _comment
from ncd.codegen.pytext import fit as _fit
from ncd.codegen.pytext import wrap as _wrap
from ncd.codegen.shared import CodegenError, environment
from ncd.families.rational.config import RationalConfig
from ncd.families.rational.plan import RationalPlan
from ncd.source import origin_name

_ALLOWED = re.compile(r"^(x|dy|tl|_rcp|c\d+|t\d+|r\d+)$")


def _check(text: str) -> str:
    if "\n" in text or "\r" in text:
        raise CodegenError(f"expression must be one line: {text!r}")
    tree = ast.parse(text, mode="eval")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not _ALLOWED.match(node.id):
            raise CodegenError(f"unexpected name {node.id!r} in {text!r}")
        if isinstance(node, ast.Lambda | ast.NamedExpr | ast.Await | ast.Yield | ast.YieldFrom):
            raise CodegenError(f"unsupported construct in {text!r}")
    return text


def _statements(pairs: tuple[tuple[str, str], ...]) -> list[dict[str, str]]:
    out = []
    for name, text in pairs:
        if not _ALLOWED.match(name):
            raise CodegenError(f"bad temporary name {name!r}")
        out.append({"name": name, "expr": _check(text)})
    return out


def _origins(program: ir.Program, plan: RationalPlan) -> str:
    """The spec lines the formula comes from: the output's definition and every intermediate it reads."""
    lets = {d.tensor: d for d in program.definitions}
    seen: list[str] = []
    todo = [plan.output]
    while todo:
        name = todo.pop()
        if name in seen or name not in lets:
            continue
        seen.append(name)
        todo += [n.tensor for n in ir.walk(lets[name].value) if isinstance(n, ir.Load)]
    lines = sorted({lets[n].span.line for n in seen})
    file = origin_name(program.source.filename)
    return ", ".join(f"{file}:{line}" for line in lines)


def _statement_block(statements: list[dict[str, str]], indent: str = "    ") -> list[str]:
    return [_fit(f"{s['name']} = ", s["expr"], indent=indent) for s in statements]


def _used(lines: list[str]) -> set[str]:
    """The names the rendered statements read."""
    tree = ast.parse("\n".join(line.strip() for line in "\n".join(lines).splitlines()
                               if not line.strip().startswith("#")) or "pass")
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _unpack(names: list[str], lines: list[str]) -> str:
    """`a, _, c = k`: the per-program values, the unused ones as `_`."""
    used = _used(lines)
    return _wrap("", [n if n in used else "_" for n in names], " = k")


def _returned(statements: list[dict[str, str]], coefficients: list[str]) -> list[str]:
    """The per-program values a hook hands on: every coefficient and every prologue temporary."""
    return coefficients + [s["name"] for s in statements]


def config_literal(config: RationalConfig) -> str:
    """The plan's config as a Python literal for the generated module (one field a line)."""
    fields = ",\n".join(f"    {f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config))
    return f"RationalConfig(\n{fields},\n)"


def render_rational_op(program: ir.Program, plan: RationalPlan, op_id: str) -> str:
    r = plan.roles
    d = plan.derivation
    params = [program.tensor(p.name) for p in plan.params]
    declared = [t.name for t in program.params]  # the op's positional order: inputs, then params as declared
    layouts = {p.name: p for p in plan.params}
    kg, ks = plan.k_group, plan.k_shared
    param_args: list[dict[str, Any]] = []
    for i, name in enumerate(declared):
        layout = layouts[name]
        strides = [f"s{i}_{j}" for j in range(len(layout.axes))]
        param_args.append({"name": name, "ptr": f"P{i}", "strides": strides, "layout": layout,
                           "origin": layout.span.origin, "index": i})
    by_name = {a["name"]: a for a in param_args}
    coef_loads = []
    for k, c in enumerate(plan.coefficients):
        a = by_name[c.param]
        layout = a["layout"]
        terms = [f"P[{a['index']}]"]
        rest = iter(c.index)
        for j in range(len(layout.axes)):
            if j == layout.group_pos:
                terms.append(f"g * S[{a['index']}][{j}]")
            else:
                i = next(rest)
                if i:
                    terms.append(f"{i} * S[{a['index']}][{j}]")
        coef_loads.append({"name": f"c{k}", "addr": " + ".join(terms), "label": c.label, "origin": a["origin"]})
    acc: list[dict[str, Any]] = []
    live: list[dict[str, Any]] = []
    for c, text, factor in zip(plan.coefficients, d.bwd_dcoef, d.bwd_factor, strict=True):
        entry = {"expr": None if text is None else _check(text), "label": c.label,
                 "live": None if text is None else len(live), "factor": f" * ({_check(factor)})" if factor else ""}
        acc.append(entry)
        if text is not None:
            live.append(entry)
    grads: list[dict[str, Any]] = []
    for a in param_args:
        layout = a["layout"]
        if layout.group_pos is not None:
            grads.append({"kind": "group", "lo": layout.first, "hi": layout.first + layout.count,
                          "rest": list(layout.rest_sizes), "group_pos": layout.group_pos})
            a["grad"] = grads[-1]
        else:
            lo = layout.first - kg
            grads.append({"kind": "shared", "lo": lo, "hi": lo + layout.count, "rest": list(layout.rest_sizes),
                          "group_pos": None})
        a["grad"] = grads[-1]
    prologue = {"fwd": _statements(d.fwd_prologue), "bwd": _statements(d.bwd_prologue)}
    coefficient_names = [c["name"] for c in coef_loads]
    values = {side: _returned(statements, coefficient_names) for side, statements in prologue.items()}
    ctx: dict[str, Any] = {
        "spec_name": program.name, "origin_file": origin_name(program.source.filename), "op_id": op_id,
        "roles": r, "k_total": len(plan.coefficients), "kg": kg, "ks": ks,
        "coef_loads": coef_loads, "params": param_args,
        "prologue": {side: _statement_block(st) for side, st in prologue.items()},
        "fwd_body": _statement_block(_statements(d.fwd_body)), "fwd_out": _fit("return ", _check(d.fwd_out)),
        "bwd_body": _statement_block(_statements(d.bwd_body)), "bwd_dx": _fit("dx = ", _check(d.bwd_dx)),
        "accumulate": [_fit(f"acc[{a['live']}] + ", a["expr"] if d.finite_at_zero else
                            f"tl.where(m_out, {a['expr']}, 0.0)", ",", " " * 8, f"d{a['label']}") for a in live],
        "totals": [_fit("total = ", f"tl.sum(tl.sum(acc[{a['live']}], axis=1), axis=0){a['factor']}", "", " " * 8,
                        f"d{a['label']}") if a["live"] is not None
                   else f"        total = 0.0  # d{a['label']} is identically zero" for a in acc],
        "acc": acc, "live": live,
        "formula_origin": _origins(program, plan), "formula_lines": _comment("#   F(x) = ", str(d.formula)),
        "grads": grads, "finite_at_zero": d.finite_at_zero, "x_origin": program.tensor(r.x).span.origin,
        "out_origin": program.tensor(r.output).span.origin, "config": config_literal(plan.config),
        "returns": {side: _wrap("return ", names, "") for side, names in values.items()},
    }
    ctx["unpack"] = {
        "fwd": _unpack(values["fwd"], [*ctx["fwd_body"], ctx["fwd_out"]]),
        "bwd": _unpack(values["bwd"], [*ctx["bwd_body"], ctx["bwd_dx"], *ctx["accumulate"]]),
        "totals": _unpack(values["bwd"], ctx["totals"]),
    }
    x_axes = program.tensor(r.x).axes
    out_axes = program.tensor(r.output).axes
    ctx["x_perm"] = tuple(x_axes.index(a) for a in (r.row, r.chan))
    ctx["out_perm"] = tuple((r.row, r.chan).index(a) for a in out_axes)
    ctx["x_transposed"] = ctx["x_perm"] != (0, 1)
    ctx["out_transposed"] = ctx["out_perm"] != (0, 1)
    axes_table = {a.name: (a.fixed, a.factors) for a in program.axes}
    ctx["axes_table"] = repr(axes_table)
    ctx["tensor_args"] = [{"name": r.x, "axes": repr(x_axes), "origin": ctx["x_origin"]}] + [
        {"name": t.name, "axes": repr(t.axes), "origin": t.span.origin} for t in
        (program.tensor(n) for n in declared)]
    names = {t.name for t in program.tensors}
    ctx["kw"] = "accumulate" if "accumulate" not in names else "ncd_accumulate"
    del params
    env = environment()
    text = env.get_template("rational.py.jinja").render(**ctx) + env.get_template("rational_op.py.jinja").render(**ctx)
    ast.parse(text)
    return text
