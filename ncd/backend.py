"""The back half of the pipeline: streamability certificate -> kernel family -> tiling plan -> generated
module. Each stage is a small pure function of the previous one's output."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

from . import __version__
from .attention import AttentionRoles, KernelMaps, kernel_maps, roles
from .cost import AttentionShape, Estimate, format_estimate, rank_configs
from .errors import InvalidStatement
from .pipeline import FrontEnd
from .streaming import Certificate, certify

# Axis sizes the plan is estimated at unless the caller binds them: the benchmark's attention setting.
DEFAULT_BINDINGS = {"batch": 8, "head": 16, "query": 4096, "key": 4096}
DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}


@dataclass(frozen=True)
class AttentionPlan:
    certificate: Certificate
    roles: AttentionRoles
    maps: KernelMaps
    bindings: dict[str, int]
    estimates: tuple[Estimate, ...]

    def describe(self) -> list[str]:
        r = self.roles
        lines = [*self.certificate.describe(), "kernel family: normalized-contraction attention",
                 f"  Q = {r.query}[{' '.join(r.q_axes)}]  K = {r.key}[{' '.join(r.k_axes)}]  "
                 f"V = {r.value}[{' '.join(r.v_axes)}]  -> {r.output}[{' '.join(r.o_axes)}]",
                 f"  scale: {r.scale}   causal: {r.causal}   per-key weight: {r.weight or 'none'}",
                 f"  triton: a1 = {self.maps.a1};  a2 = {self.maps.a2};  b = {self.maps.b}",
                 f"          a1' = {self.maps.da1};  a2' = {self.maps.da2};  b'/b = {self.maps.db_over_b}",
                 "  accumulators: o in registers (fp32), z (and m) per row in registers; no atomics "
                 "(one program owns each query tile; the backward's dK/dV programs own key tiles)",
                 "cost (per tile config, forward) at "
                 + " ".join(f"{k}={v}" for k, v in self.bindings.items()) + ":"]
        for e in self.estimates:
            lines += ["  " + line for line in format_estimate(e)]
        lines.append(f"autotune set: {len(self.estimates)} configs above (pruned from the candidates by "
                     "SMEM and register capacity, ranked by the roofline estimate)")
        return lines


def plan(front: FrontEnd, bindings: dict[str, int] | None = None) -> AttentionPlan:
    program = front.program
    certificates = certify(program)
    if not certificates:
        raise InvalidStatement(None, detail=f"spec '{program.name}' has no streamable normalized contraction, "
                               "and code generation exists only for that family so far",
                               hint="attention specs reach Triton; other families stop at verified IR")
    cert = certificates[0]
    r = roles(program, cert)
    maps = kernel_maps(cert)
    sizes = {**DEFAULT_BINDINGS, **(bindings or {})}
    bound = {}
    for axis in program.axes:
        bound[axis.name] = axis.fixed or sizes.get(axis.name) or sizes.get(_role_name(r, axis.name), 1024)
    q_tensor = program.tensor(r.query)
    heads = bound[r.q_axes[1]]
    shape = AttentionShape(
        batch_heads=bound[r.q_axes[0]] * heads,
        kv_heads_ratio=heads // max(1, bound[r.k_axes[1]]),
        n_query=bound[r.q_axes[2]], n_key=bound[r.k_axes[2]], head_dim=bound[r.q_axes[3]],
        value_dim=bound[r.v_axes[3]], elem_bytes=DTYPE_BYTES.get(q_tensor.dtype or "bf16", 2), causal=r.causal,
    )
    shown = {a: bound[a] for a in dict.fromkeys((*r.q_axes, *r.k_axes))}
    return AttentionPlan(cert, r, maps, shown, tuple(rank_configs(shape)))


def _role_name(r: AttentionRoles, axis: str) -> str:
    names = dict(zip(r.q_axes, ("batch", "head", "query", "dim"), strict=True))
    names.update(zip(r.k_axes, ("batch", "head", "key", "dim"), strict=True))
    return names.get(axis, axis)


def _template_digest() -> str:
    digest = hashlib.sha256()
    for name in ("attention.py.jinja", "attention_op.py.jinja"):
        digest.update(resources.files("ncd.templates").joinpath(name).read_bytes())
    return digest.hexdigest()


def op_id(front: FrontEnd) -> str:
    """A name unique to this spec text, this ncd and these templates (custom ops are global per process)."""
    digest = hashlib.sha256(f"{__version__}\0{_template_digest()}\0{front.source.text}".encode()).hexdigest()
    return f"{front.program.name}_{digest[:12]}"


def generate(front: FrontEnd, attention_plan: AttentionPlan | None = None) -> str:
    from .codegen.attention_op import render_attention_op

    p = attention_plan or plan(front)
    return render_attention_op(front.program, p.certificate, p.roles, p.maps, op_id(front))
