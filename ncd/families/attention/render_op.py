"""Render the complete generated module for an attention spec: kernels (attention.py.jinja) followed by the
PyTorch op (attention_op.py.jinja: a description of the op for runtime.py and the function
named after the spec). Only checked identifiers and numbers from the IR reach the text."""

from __future__ import annotations

import ast

from ncd import ir
from ncd.codegen.shared import default_code, environment
from ncd.families.attention.config import AttentionConfig
from ncd.families.attention.factorize import Factorization
from ncd.families.attention.modifiers import NONE as NO_MODIFIERS
from ncd.families.attention.modifiers import Modifiers
from ncd.families.attention.plan import AttentionRoles, KernelMaps
from ncd.families.attention.prologue import render as render_prologue
from ncd.families.attention.render import AttentionKernelSpec, _uses_name, render_attention_module
from ncd.families.attention.sinks import SinkPlan
from ncd.source import origin_name
from ncd.streaming import Certificate


def kernel_spec(name: str, cert: Certificate, roles: AttentionRoles, maps: KernelMaps,
                program: ir.Program, forward_configs: tuple[tuple[int, ...], ...] = (),
                factorized: bool = False) -> AttentionKernelSpec:
    norm_line = cert.span.origin
    out_line = program.tensor(roles.output).span.origin
    origin = [("a1", norm_line), ("a2", norm_line), ("da1", norm_line), ("da2", norm_line), ("b", norm_line),
              ("db_over_b", norm_line), ("online_max", norm_line), ("output", out_line)]
    if maps.pre:
        origin += [("pre", norm_line), ("dpre", norm_line)]
    if roles.causal:
        origin.append(("causal", norm_line))
    if factorized:
        origin.append(("factorized", norm_line))
    if roles.weight:
        origin.append(("weight", program.tensor(roles.weight).span.origin))
    for scalar in roles.scale_inputs:
        origin.append(("scale", program.tensor(scalar).span.origin))
    return AttentionKernelSpec(
        name=name, a1=maps.a1, a2=maps.a2, da1=maps.da1, da2=maps.da2, b=maps.b, db_over_b=maps.db_over_b,
        online_max=cert.rescale is not None, causal=roles.causal, has_weight=roles.weight is not None,
        origin=tuple(origin), forward_configs=forward_configs, pre=maps.pre, dpre=maps.dpre,
    )


def _scale_grad_inputs(roles: AttentionRoles) -> list[str]:
    """The scalar inputs whose gradient the op routes through q: those the scale reads, where the scale is
    arithmetic that tensors follow (a `math.` function would turn a tensor into a float and drop its gradient; such
    inputs stay constants, and a call that needs their gradient is an error)."""
    if not isinstance(roles.scale, str) or "math." in roles.scale:
        return []
    return list(roles.scale_inputs)


def render_attention_op(program: ir.Program, cert: Certificate, roles: AttentionRoles, maps: KernelMaps,
                        op_id: str, forward_configs: tuple[tuple[int, ...], ...] = (),
                        factorization: Factorization | None = None, config: AttentionConfig | None = None,
                        modifiers: Modifiers | None = None, sink: SinkPlan | None = None) -> str:
    spec = kernel_spec(op_id, cert, roles, maps, program, forward_configs, factorization is not None)
    kernels = render_attention_module(spec, factorization, config, modifiers)
    kernels += _sink_hooks(sink, "import triton.language as tl" not in kernels)
    modifiers = modifiers or NO_MODIFIERS
    inputs = program.inputs
    params: list[str] = []
    tensor_inputs, scalar_inputs = [], []
    modifier_tensors = [{"name": t.name, "dims": len(t.roles), "grad": t.float and t.in_score, "mask": t.in_mask}
                        for t in modifiers.tensors]
    # positional: the inputs, then the parameters (backend._check_signature put the inputs with defaults last; they
    # stay last, after the parameters)
    ordered = [*(t for t in inputs if t.default is None), *program.params,
               *(t for t in inputs if t.default is not None)]
    for t in ordered:
        if t.axes:
            tensor_inputs.append({"name": t.name, "axes": repr(t.axes), "origin": t.span.origin})
        if t.default is not None:
            scalar_inputs.append({"name": t.name, "default": default_code(program, t), "origin": t.span.origin})
            params.append(f"{t.name}=None")
        else:
            params.append(t.name)
    spec_axes = {t.name: t.axes for t in program.tensors}
    o_axes = spec_axes[roles.output]
    perms = {
        "q": tuple(spec_axes[roles.query].index(a) for a in roles.q_axes),
        "k": tuple(spec_axes[roles.key].index(a) for a in roles.k_axes),
        "v": tuple(spec_axes[roles.value].index(a) for a in roles.v_axes),
        "o_inverse": tuple(roles.o_axes.index(a) for a in o_axes),
    }
    weight_layout = ""  # the weight as [batch key]: the batch axis's name (a [key] weight is shared) or a permutation
    if roles.weight is not None:
        assert roles.weight_axes is not None
        batch, key = roles.weight_axes
        w_axes = spec_axes[roles.weight]
        weight_layout = repr(batch) if w_axes == (key,) else repr(tuple(w_axes.index(a) for a in (batch, key)))
    axes_table = {a.name: (a.fixed, a.factors) for a in program.axes}
    direct = [n for n in (roles.value, roles.key, roles.query) if program.tensor(n).role == "in"]
    prologue_source, prologue_call = render_prologue(program, roles.prologue, direct) if roles.prologue else ("", [])
    scale_expr = roles.scale if isinstance(roles.scale, str) else repr(roles.scale)
    wrapper = environment().get_template("attention_op.py.jinja").render(
        spec_name=program.name, origin_file=origin_name(program.source.filename), op_id=op_id,
        params=params, signature=", ".join(params), axes_table=repr(axes_table), tensor_inputs=tensor_inputs,
        scalar_inputs=scalar_inputs, scalar_names=[t.name for t in inputs if not t.axes], roles=roles,
        scale_grad_inputs=_scale_grad_inputs(roles), perms=perms, weight_layout=weight_layout, scale_expr=scale_expr,
        output=roles.output, output_axes=o_axes, factorization=factorization, norm_origin=cert.span.origin,
        modifier_tensors=modifier_tensors, modifier_scalars=list(modifiers.scalars),
        modifier_sizes=list(modifiers.sizes), modifier_layout=list(modifiers.layout), sink=sink,
        tables=modifiers.tables, stat_rate=float(cert.rescale.c2) if cert.rescale is not None else 0.0,
        lse_axes=[a for a in o_axes if a != roles.o_axes[3]],
        prologue_source=prologue_source, prologue_call=prologue_call,
        origins={"output": program.tensor(roles.output).span.origin, "weight": dict(spec.origin).get("weight", "")},
    )
    text = kernels + wrapper
    ast.parse(text)
    return text


def _sink_hooks(sink: SinkPlan | None, import_tl: bool) -> str:
    """The sink logit's map u(sigma) and u'(sigma) (sinks.py) as device functions; nothing for a constant sink."""
    if sink is None or sink.tensor is None:
        return ""
    lines = ["", "import triton.language as tl  # noqa: E402"] if import_tl else []
    for name, text, doc in (("_sink_map", sink.map, "u(x): the sink's place in the maps' domain"),
                            ("_dsink_map", sink.dmap, "u'(x)")):
        body = text if _uses_name(text, "x") else f"tl.full(x.shape, {text}, tl.float32)"
        lines += ["", "", "@triton.jit", f"def {name}(x):", f"    # {doc}; {sink.origin}", f"    return {body}"]
    return "\n".join(lines) + "\n"
