"""Gated linear attention in the recurrence family: a gated outer-product scan read by the queries directly.

Recognition (a located `unsupported` error where a spec departs from it):
    S[.. time .. vdim kdim] = scan(exp(g) * prev + v * k, over time)     (either order of the factors and axes)
    out o[.. time .. vdim] = scale * (S . q over kdim)                   (constant factors allowed)
with q, k, v, g declared inputs in fla's layout ([batch time head dim], g [batch time head]) or head-first
([batch head time dim], g [batch head time]); k and v may sit on `kvhead` where the spec splits `axis head =
kvhead * group` (GQA). That is simple GLA,
RetNet (a constant gate per head, passed per token) and the recurrence of Mamba-2's SSD form. The chunked form is
derived in kernel_linear.py's docstring and printed by `--emit plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import sympy

from ncd import ir
from ncd.families.recurrence.config import LinearScanConfig

if TYPE_CHECKING:
    from ncd.families.recurrence.delta import DeltaRulePlan
    from ncd.families.recurrence.plan import _Recognizer


@dataclass(frozen=True)
class LinearRoles:
    q: str
    k: str
    v: str
    g: str
    scale: str | None
    output: str
    batch: str
    time: str
    head: str
    kdim: str
    vdim: str
    S: str
    head_first: bool = False  # inputs declared [batch head time dim]
    gate_per_head: bool = False  # g[head] (RetNet): broadcast over batch and time by the op
    gate_per_key: bool = False  # g[batch time head kdim] (GLA): each key row of the state decays by its own gate
    beta: None = None  # the shared validation forms ask every recurrence for these
    alpha: None = None


# What `--emit plan` prints of the chunked form: kernel_linear.py's and kernel_gla.py's docstrings derive them
_SCALAR_FORM = (
    "chunked form (chunk C; G = cumulative log gate inside a chunk, Gc its total; D[t, s] = exp(G_t - G_s) "
    "for s <= t; S_c = the state a chunk starts from, [key, value]):",
    "  states (sequential over chunks): S_(c+1) = exp(Gc) S_c + (k o exp(Gc - G))^T v",
    "  output (parallel over chunks): o = scale ((q o exp(G)) S_c + ((q k^T) o D) v)",
    "backward (dS_c: gradient of the state after chunk c):",
    "  dS_(c-1) = exp(Gc) dS_c + scale (q o exp(G))^T do   (the state scan, reversed)",
    "  dq = scale (exp(G) o do S_c^T + ((do v^T) o D) k);  dk = exp(Gc - G) o v dS_c^T + scale ((do v^T) o "
    "D)^T q;  dv = scale ((q k^T) o D)^T do + exp(Gc - G) o k dS_c",
    "  dg = reverse cumsum over the sequence of (q . dq - k . dk), plus <S_T, dS_T> (final state)",
    "kernels: forward 2 launches (state scan; output), backward 3 (state scan; reverse scan; gradients) and "
    "the gate's reverse cumsum; decoding (`recurrent`) 1; static in ncd/families/recurrence/kernel_linear.py",
)
_PER_KEY_FORM = (
    "chunked form (chunk C; G [C, K] = cumulative log gates inside a chunk, per key; Gc its total; sub-chunks of 16):",
    "  states (sequential over chunks): S_(c+1) = diag(exp(Gc)) S_c + (k o exp(Gc - G))^T v",
    "  scores: A[t, s] = sum_d q_td k_sd exp(G_td - G_sd) for s <= t; sub-chunks i > j as one product through r, "
    "the first token of i: (q_i o exp(G_i - G_r)) (k_j o exp(G_r - G_j))^T; diagonal sub-chunks one key row at a "
    "time (every exponent a sum of gates in order: never positive for gates <= 0)",
    "  output (parallel over chunks): o = scale ((q o exp(G)) S_c + A v)",
    "backward: dS_(c-1) = diag(exp(Gc)) dS_c + scale (q o exp(G))^T do;  dA = scale (do v^T) o [s <= t];",
    "  dq = scale exp(G) o (do S_c^T) + dA through the sub-chunks;  dk = exp(Gc - G) o (v dS_c^T) + dA^T through "
    "them;  dv = (k o exp(Gc - G)) dS_c + scale A^T do",
    "  dg[:, d] = reverse cumsum over the sequence of (q o dq - k o dk)[:, d], plus sum_v S_T[d, v] dS_T[d, v]",
    "kernels: forward 4 launches (cumulative gates; state scan; scores; output), backward 6 (cumulative gates; "
    "state scan; reverse scan; scores; state-path gradients; sub-chunk gradients) and the gate's reverse cumsum; "
    "decoding (`recurrent`) 1; static in ncd/families/recurrence/kernel_gla.py and kernel_linear.py",
)


@dataclass(frozen=True)
class LinearScanPlan:
    roles: LinearRoles
    origins: dict[str, str] = field(compare=False)
    derivation: str = ""  # what derive_chunked_form verified
    config: LinearScanConfig = field(default_factory=LinearScanConfig)
    family = "recurrence"

    @property
    def output(self) -> str:
        return self.roles.output

    def describe(self) -> list[str]:
        r = self.roles
        gate = ("one per head, every token" if r.gate_per_head else
                f"one per token, head and key dimension '{r.kdim}'" if r.gate_per_key else "one per token and head")
        return [
            "kernel family: gated linear attention (a gated outer-product scan read by the queries)",
            f"  roles: queries {r.q}, keys {r.k}, values {r.v}, log gate {r.g} ({gate}), scale "
            f"{r.scale or '1'}{f' times {self.config.output_factor:g}' if self.config.output_factor != 1 else ''}; "
            f"scan over '{r.time}', per ({r.batch}, {r.head})"
            f"{'; head-first inputs, run as batch x head sequences of one head' if r.head_first else ''}",
            f"  state: {r.S}[{r.vdim} {r.kdim}] = sum_s exp(G_t - G_s) v_s k_s^T  ({self.origins['S']}); "
            f"o_t = scale S_t q_t  ({self.origins['output']})",
            self.derivation,
            *(_PER_KEY_FORM if r.gate_per_key else _SCALAR_FORM),
            *self.config.describe(),
        ]

    def render(self, program: ir.Program, op_id: str) -> str:
        from ncd.families.recurrence.render import render_linear_module

        return render_linear_module(program, self, op_id)

    def validation_sizes(self, program: ir.Program) -> dict[str, int]:
        r = self.roles
        sizes = {r.batch: 2, r.time: 37, r.head: 2}
        sizes.update(group_sizes(program, r.head, 2))
        for axis in (r.kdim, r.vdim):
            sizes[axis] = program.axis(axis).fixed or 24
        return sizes

    def constant_inputs(self) -> frozenset[str]:
        return frozenset()

    def condition_inputs(self, program: ir.Program, inputs: dict, generator: object = None) -> dict:
        """Log gates <= 0 (the layers' logsigmoid); q, k, v as drawn."""
        import torch

        g = self.roles.g
        return {**inputs, g: torch.nn.functional.logsigmoid(inputs[g].float() + 3.0).to(inputs[g].dtype)}

    # 16-bit inputs: the products round the weighted operands and the chunk states to the inputs' type
    output_tolerance: ClassVar[dict[str, float]] = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
    gradient_tolerance: ClassVar[dict[str, float]] = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


def derive_chunked_form(scan: ir.Scan, g: str, k: str, v: str, q: str, steps: int = 3) -> str:
    """The spec's own scan body unrolled over `steps` tokens in sympy (one key and one value dimension) and checked
    against the kernels' chunked form: the chunk's end state and every output, and the gate-gradient identity
    dL/dg_u = sum over t >= u of (q_t dL/dq_t - k_t dL/dk_t), plus <S_T, dL/dS_T>. Returns what it verified;
    raises ValueError where the algebra differs (the recogniser's match would then be wrong)."""
    from ncd.symbolic import to_sympy

    def token(name: str, t: int) -> sympy.Symbol:
        return sympy.Symbol(f"{name}{t}", real=True)

    def step(t: int, prev: sympy.Expr) -> sympy.Expr:
        def leaf(n: ir.Node) -> sympy.Expr | None:
            if isinstance(n, ir.Prev):
                return prev
            return token(n.tensor, t) if isinstance(n, ir.Load) else None

        return to_sympy(scan.body, leaf=leaf)

    gates = [token(g, t) for t in range(steps)]
    s0, w_end = sympy.Symbol("S0", real=True), sympy.Symbol("W", real=True)
    states, state = [], s0
    for t in range(steps):
        state = step(t, state)
        states.append(state)
    cum = [sum(gates[: t + 1]) for t in range(steps)]
    outputs = [token(q, t) * states[t] for t in range(steps)]
    chunked = [sympy.exp(cum[t]) * token(q, t) * s0 + sum(
        sympy.exp(cum[t] - cum[s]) * token(q, t) * token(k, s) * token(v, s) for s in range(t + 1))
        for t in range(steps)]
    end = sympy.exp(cum[-1]) * s0 + sum(sympy.exp(cum[-1] - cum[s]) * token(k, s) * token(v, s) for s in range(steps))

    def zero(expr: sympy.Expr) -> bool:
        return sympy.expand(expr, power_exp=True) == 0

    if not zero(states[-1] - end) or not all(zero(a - b) for a, b in zip(outputs, chunked, strict=True)):
        raise ValueError("the scan's unrolled recurrence differs from the chunked form")
    loss = sum(token("w", t) * outputs[t] for t in range(steps)) + w_end * states[-1]
    for u in range(steps):
        rhs = sum(token(q, t) * sympy.diff(loss, token(q, t)) - token(k, t) * sympy.diff(loss, token(k, t))
                  for t in range(u, steps)) + w_end * states[-1]
        if not zero(sympy.diff(loss, gates[u]) - rhs):
            raise ValueError("the gate gradient identity does not hold for the scan")
    return (f"derived (sympy: the spec's scan body unrolled over {steps} tokens, one key and value dimension): the "
            "chunk's end state and every output equal the chunked form below, and dL/dg_u = sum_(t >= u) "
            "(q_t dL/dq_t - k_t dL/dk_t) + <S_T, dL/dS_T>")


def group_sizes(program: ir.Program, head: str, heads: int) -> dict[str, int]:
    """Validation sizes of a GQA split `head = kvhead * group` with `heads` query heads: kvhead = heads // 2 (at
    least 1), group = heads // kvhead; {} where the spec does not split its head axis."""
    factors = program.axis(head).factors
    if len(factors) != 2:
        return {}
    kv = max(1, heads // 2)
    return {factors[0]: kv, factors[1]: heads // kv, head: heads}


def kv_token_axes(program: ir.Program, token_axes: tuple[str, ...], head: str,
                   declared: tuple[str, ...]) -> tuple[str, ...]:
    """The keys' and values' token axes: the queries' (one key/value head per query head), or, for GQA, theirs
    with the head axis replaced by its outer factor where the spec splits it, `axis head = kvhead * group`."""
    factors = program.axis(head).factors
    grouped = tuple(factors[0] if a == head else a for a in token_axes) if len(factors) == 2 else None
    return grouped if declared == grouped else token_axes


def token_layout(rec: _Recognizer, q_name: str, kdim: str, scan: ir.Scan) -> tuple[tuple[str, str, str], bool]:
    """The queries' token axes as declared and whether they are head-first ([batch head time dim]); a located
    error for any other layout."""
    from ncd.families.recurrence.plan import _fail

    decl = rec.program.tensor(q_name)
    q_axes = decl.axes
    if len(q_axes) != 4 or q_axes[3] != kdim:
        raise _fail(decl.span, f"declare {q_name} as [batch time head {kdim}] (fla's layout)")
    if scan.over not in q_axes[:3]:
        raise _fail(scan, f"the scan runs over '{scan.over}', which {q_name} does not carry")
    head_first = q_axes[2] == scan.over  # [batch head time dim]: run as batch x head sequences of one head
    if q_axes[1] != scan.over and not head_first:
        raise _fail(decl.span, f"{q_name} is declared [{' '.join(q_axes)}], but the recurrence family takes fla's "
                    f"layout [batch time head dim] or the head-first [batch head time dim]: the scanned axis "
                    f"'{scan.over}' second or third")
    return (q_axes[0], q_axes[1], q_axes[2]), head_first


def check_roles(rec: _Recognizer, named: list[tuple[str, str | None]], what: str) -> None:
    """Each input serves one role, every input has one, and the spec has no parameters: located errors."""
    from ncd.families.recurrence.plan import _fail

    program = rec.program
    roles_by_name: dict[str, str] = {}
    for role, given in named:
        if given is not None and roles_by_name.setdefault(given, role) != role:
            raise _fail(program.tensor(given).span, f"{given} serves as both the {roles_by_name[given]} and the "
                        f"{role} of the recurrence; each role needs an input of its own")
    for t in program.inputs:
        if t.name not in roles_by_name:
            raise _fail(t.span, f"{t.name} has no role in {what} ({', '.join(r for r, _ in named)}): the family "
                        "would ignore it")
    if program.params:
        raise _fail(program.params[0].span, f"the recurrence family takes no parameters; {program.params[0].name} "
                    "would be ignored")


def recognize_linear(rec: _Recognizer, out: str, value: ir.Contract, scale: str | None, output_factor: float,
                     state: ir.Load, reader: ir.Load) -> LinearScanPlan | DeltaRulePlan:
    from ncd.families.recurrence.plan import _fail

    program = rec.program
    s_name = state.tensor
    scan = rec.lets[s_name].value
    assert isinstance(scan, ir.Scan)
    q_name = rec.input_of(reader, "the state's reader (the queries)")
    kdim = value.over[0]
    if sum(isinstance(n, ir.Prev) for n in ir.walk(scan.body)) > 1:  # the state read in its own update
        from ncd.families.recurrence.delta import recognize_delta

        return recognize_delta(rec, out, value, scale, output_factor, state, reader)
    gate, left, right = rec.gated_outer(scan, s_name)
    if gate is None:
        raise _fail(scan.body, "expected the decay `exp(g) * prev`: ungated linear attention is not compiled by this "
                    "family")
    g_name: str = gate
    g_axes = program.tensor(g_name).axes
    token_axes, head_first = token_layout(rec, q_name, kdim, scan)
    keys = [f for f in (left, right) if f.axes and f.axes[-1] == kdim]
    if len(keys) != 1:
        raise _fail(scan.body, f"expected {s_name}'s update to be an outer product of the values and the keys "
                    f"over '{kdim}' (the axis {q_name} contracts)")
    key = keys[0]
    val = right if key is left else left
    k_name = rec.input_of(key, "the keys")
    v_name = rec.input_of(val, "the values")
    batch, time, head = (token_axes[0], token_axes[2], token_axes[1]) if head_first else token_axes
    vdim = program.tensor(v_name).axes[-1]
    kv_axes = kv_token_axes(program, token_axes, head, program.tensor(k_name).axes[:3])
    if head_first and kv_axes != token_axes:
        raise _fail(program.tensor(k_name).span, "keys and values shared by groups of query heads (GQA) are "
                    "compiled in fla's layout only: declare the inputs [batch time head dim], k and v [batch time "
                    "kvhead dim]")
    gate_per_head = g_axes == (head,)  # RetNet: one decay per head, the same at every token
    gate_per_key = g_axes == (*token_axes, kdim)  # GLA: a decay per key dimension
    g_expected = (head,) if gate_per_head else (*token_axes, kdim) if gate_per_key else token_axes
    for name, axes in ((k_name, (*kv_axes, kdim)), (v_name, (*kv_axes, vdim)), (g_name, g_expected),
                       (out, (*token_axes, vdim))):
        if program.tensor(name).axes != axes:
            if name == g_name:
                raise _fail(program.tensor(name).span, f"declare {name} as [{' '.join(token_axes)}] (a gate per "
                            f"token and head), [{' '.join(token_axes)} {kdim}] (a gate per key dimension: GLA) or "
                            f"[{head}] (one per head: RetNet)")
            raise _fail(program.tensor(name).span, f"declare {name} as [{' '.join(axes)}] (the layout of "
                        f"{q_name})")
    check_roles(rec, [("queries", q_name), ("keys", k_name), ("values", v_name), ("log gate", g_name),
                      ("scale", scale)], "the gated linear attention")
    rec.claimed = [s_name]
    rec.check_addressing(out, token_axes, {s_name: {(*kv_axes, vdim), (*kv_axes, kdim)}},
                         {k_name: kv_axes, v_name: kv_axes, **({g_name: (head,)} if gate_per_head else {})})
    rec.check_state_axes(s_name, scan, token_axes, {vdim, kdim})
    if gate_per_key:  # each key row of the state decays by its own gate: g read along the keys' axis
        read = next(n for n in ir.walk(scan.body) if isinstance(n, ir.Load) and n.tensor == g_name)
        if tuple(i.axis for i in read.index)[3:] != (kdim,):
            raise _fail(read, f"{g_name} gates the state's key axis '{kdim}' (GLA); read it as "
                        f"{g_name}[{' '.join(g_expected)}]")
    try:
        derivation = derive_chunked_form(scan, g_name, k_name, v_name, q_name)
    except ValueError as err:
        raise _fail(scan, str(err)) from None
    roles = LinearRoles(q=q_name, k=k_name, v=v_name, g=g_name, scale=scale, output=out, batch=batch, time=time,
                        head=head, kdim=kdim, vdim=vdim, S=s_name, head_first=head_first,
                        gate_per_head=gate_per_head, gate_per_key=gate_per_key)
    origins = {"S": rec.origin(s_name), "output": rec.origin(out),
               "scale": f"{rec.file}:{program.tensor(scale).span.line}" if scale else rec.origin(out)}
    return LinearScanPlan(roles=roles, origins=origins, derivation=derivation,
                          config=LinearScanConfig(output_factor=output_factor))
