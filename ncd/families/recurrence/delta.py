"""The delta rule and the gated delta rule in the recurrence family (DeltaNet, Gated DeltaNet).

Recognition (a located `unsupported` error where a spec departs from it):
    S[.. time .. vdim kdim] = scan(exp(g) * (prev - beta * (prev . k over kdim) * k) + beta * v * k, over time)
    out o[.. time .. vdim] = scale * (S . q over kdim)                   (constant factors allowed)
or any body with the same algebra (without exp(g): the delta rule). The recogniser finds the roles by where the
inputs sit (keys on the contracted axis, values on the other, the gate inside exp, beta the other per-token
scalar); derive_delta_form then proves in sympy that the spec's own body is the delta rule and that the kernels'
chunked UT / WY form (kernel_delta.py) reproduces the unrolled recurrence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import sympy

from ncd import ir
from ncd.families.recurrence.config import LinearScanConfig
from ncd.families.recurrence.linear import group_sizes

if TYPE_CHECKING:
    from ncd.families.recurrence.plan import _Recognizer


@dataclass(frozen=True)
class DeltaRoles:
    q: str
    k: str
    v: str
    g: str | None  # None: the delta rule without a gate
    beta: str
    scale: str | None
    output: str
    batch: str
    time: str
    head: str
    kdim: str
    vdim: str
    S: str
    head_first: bool = False
    grouped: bool = False  # k, v on kvhead (`axis head = kvhead * group`): repeated per query head by the op
    alpha: None = None  # the shared validation forms ask every recurrence for it


_GROUPED = ("; keys and values shared by groups of query heads (GQA: repeated per query head, whose gates and "
            "writing strengths are its own)")


@dataclass(frozen=True)
class DeltaRulePlan:
    roles: DeltaRoles
    origins: dict[str, str] = field(compare=False)
    derivation: str = ""
    config: LinearScanConfig = field(default_factory=LinearScanConfig)
    family = "recurrence"

    @property
    def output(self) -> str:
        return self.roles.output

    def describe(self) -> list[str]:
        r = self.roles
        gate = f"exp({r.g}_t) " if r.g else ""
        return [
            f"kernel family: {'gated ' if r.g else ''}delta rule (a delta-rule state read by the queries)",
            f"  roles: queries {r.q}, keys {r.k}, values {r.v}, "
            f"{f'log gate {r.g}, ' if r.g else 'no gate, '}writing strength {r.beta}, scale {r.scale or '1'}"
            f"{f' times {self.config.output_factor:g}' if self.config.output_factor != 1 else ''}; scan over "
            f"'{r.time}', per ({r.batch}, {r.head})"
            f"{'; head-first inputs, run as batch x head sequences of one head' if r.head_first else ''}"
            f"{_GROUPED if r.grouped else ''}",
            f"  state: {r.S}_t = {gate}{r.S}_(t-1) (I - b_t k_t k_t^T) + b_t v_t k_t^T  ({self.origins['S']}); "
            f"o_t = scale S_t q_t  ({self.origins['output']})",
            self.derivation,
            "chunked form (chunk C; G = cumulative log gate inside a chunk, Gc its total; D[t, s] = exp(G_t - G_s) "
            "for s <= t; S_c = the state a chunk starts from, [key, value]):",
            "  UT transform (parallel over chunks): A = strict_lower(diag(b) (k k^T) o D), T = (I + A)^-1 by "
            "forward substitution; W = T diag(b exp(G)) k, U = T diag(b) v",
            "  states (sequential over chunks): u = U - W S_c;  S_(c+1) = exp(Gc) S_c + (k o exp(Gc - G))^T u",
            "  output (parallel over chunks): o = scale ((q o exp(G)) S_c + ((q k^T) o D) u)",
            "backward: du = P^T do + (k o exp(Gc - G)) dS_c, dS_(c-1) = exp(Gc) dS_c + scale (q o exp(G))^T do - "
            "W^T du (reverse scan); per chunk dW = -du S_c^T, dT = du (b v)^T + dW (b exp(G) k)^T, dA = -T^T dT T^T, "
            "then dq, dk, dv, db and dg (the reverse sum inside the chunk of every exponent's derivative)",
            "kernels: forward 4 launches (T; W and U; state scan; output), backward 5 (T; W and U; state scan; "
            "reverse scan; gradients); decoding (`recurrent`) 1; static in ncd/families/recurrence/kernel_delta.py",
            "config:",
            f"  chunk {self.config.chunk} (16, 32 or 64: one, two or four 16-row blocks of T), output factor "
            f"{self.config.output_factor:g}; products: the inputs' 16-bit type, fp32 inputs "
            f"{self.config.dot_precision or 'tf32x3'}; backward for 16-bit inputs {self.config.grad_precision}; "
            f"value columns per state-scan program {self.config.scan_tiles[1]} (the other launch shapes: "
            "kernel_delta.py)",
        ]

    def render(self, program: ir.Program, op_id: str) -> str:
        from ncd.families.recurrence.render import render_delta_module

        return render_delta_module(program, self, op_id)

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
        """The layers' domain: unit q and k (the update I - b k k^T then contracts for 0 < b < 2), beta in (0, 1),
        log gates <= 0."""
        import torch

        r = self.roles
        out = dict(inputs)
        for name in (r.q, r.k):
            out[name] = torch.nn.functional.normalize(inputs[name].float(), dim=-1).to(inputs[name].dtype)
        out[r.beta] = torch.sigmoid(inputs[r.beta].float()).to(inputs[r.beta].dtype)
        if r.g is not None:
            out[r.g] = torch.nn.functional.logsigmoid(inputs[r.g].float() + 3.0).to(inputs[r.g].dtype)
        return out

    output_tolerance: ClassVar[dict[str, float]] = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
    gradient_tolerance: ClassVar[dict[str, float]] = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


class _Symbols:
    """Per-token symbols of the sympy check: k, v entries, the gate's exp as a positive symbol, beta."""

    def __init__(self, roles: dict[str, str]) -> None:
        self.roles = roles

    def __call__(self, name: str, t: int, *index: int) -> sympy.Symbol:
        return sympy.Symbol(f"{name}{t}" + "".join(f"_{i}" for i in index), real=True)


def derive_delta_form(scan: ir.Scan, names: dict[str, str | None], kdim: str, vdim: str, steps: int = 3,
                      K: int = 2, V: int = 1) -> str:
    """Evaluates the spec's scan body on a symbolic [V, K] state (K = 2, V = 1; the value columns evolve apart
    in every body this family accepts, which step 1 checks with V = 2) and checks (1) one step equals the delta
    rule's update exactly, for a general previous state; (2) the body unrolled over `steps` tokens equals the
    chunked UT form (the kernels' algebra) in the end state and every output. names: role (q k v g beta) ->
    input name. Returns what it verified; raises ValueError where the algebra differs."""
    sym = _Symbols({})
    gate = names["g"]

    def step(t: int, prev: sympy.Matrix, kv: tuple[int, int]) -> sympy.Matrix:
        def element(i: int, j: int) -> sympy.Expr:
            def evaluate(node: ir.Node, env: dict[str, int]) -> sympy.Expr:
                from ncd.symbolic import to_sympy

                def leaf(n: ir.Node) -> sympy.Expr | None:
                    if isinstance(n, ir.Prev):
                        return prev[env[vdim], env[kdim]]
                    if isinstance(n, ir.Contract):
                        if tuple(n.over) != (kdim,):
                            raise ValueError(f"a contraction over {', '.join(n.over)} in the update; the delta "
                                             f"rule contracts the state with the keys over '{kdim}'")
                        return sum((evaluate(n.lhs, {**env, kdim: m}) * evaluate(n.rhs, {**env, kdim: m})
                                    for m in range(kv[1])), sympy.Integer(0))
                    if isinstance(n, ir.Load):
                        role = next((r for r, given in names.items() if given == n.tensor), None)
                        if role == "k":
                            return sym("k", t, env[kdim])
                        if role == "v":
                            return sym("v", t, env[vdim])
                        if role in ("g", "beta"):
                            return sym(role, t)
                        raise ValueError(f"{n.tensor} has no role in the delta rule")
                    return None

                return to_sympy(node, leaf=leaf)

            return evaluate(scan.body, {vdim: i, kdim: j})

        return sympy.Matrix(kv[0], kv[1], lambda i, j: element(i, j))

    def exp_gates(expr: sympy.Expr) -> sympy.Expr:  # exp(g_t) as a positive symbol a_t: rational algebra
        return expr.subs({sympy.exp(sym("g", t)): sympy.Symbol(f"a{t}", positive=True) for t in range(steps)})

    def decay(t: int) -> sympy.Expr:
        return sympy.Symbol(f"a{t}", positive=True) if gate else sympy.Integer(1)

    def zero(m: sympy.Matrix) -> bool:
        return all(sympy.expand(sympy.together(e)) == 0 for e in m)

    # (1) one step on a general state, two value columns
    prev = sympy.Matrix(2, K, lambda i, j: sympy.Symbol(f"P_{i}_{j}", real=True))
    k0 = sympy.Matrix(K, 1, lambda j, _: sym("k", 0, j))
    v0 = sympy.Matrix(2, 1, lambda i, _: sym("v", 0, i))
    b0 = sym("beta", 0)
    canonical = decay(0) * (prev - b0 * prev * k0 * k0.T) + b0 * v0 * k0.T
    if not zero(exp_gates(step(0, prev, (2, K))) - canonical):
        raise ValueError("the scan's update is not the delta rule exp(g) S (I - b k k^T) + b v k^T (S [value, key])")
    # (2) the unrolled body against the chunked UT form
    s0 = sympy.Matrix(V, K, lambda i, j: sympy.Symbol(f"S_{i}_{j}", real=True))
    qs = [sympy.Matrix(K, 1, lambda j, _, t=t: sym("q", t, j)) for t in range(steps)]
    ks = [sympy.Matrix(K, 1, lambda j, _, t=t: sym("k", t, j)) for t in range(steps)]
    vs = [sympy.Matrix(V, 1, lambda i, _, t=t: sym("v", t, i)) for t in range(steps)]
    bs = [sym("beta", t) for t in range(steps)]
    state, outputs = s0, []
    for t in range(steps):
        state = exp_gates(step(t, state, (V, K)))
        outputs.append(state * qs[t])
    cum = [sympy.Mul(*[decay(s) for s in range(t + 1)]) for t in range(steps)]  # exp(G_t)
    a = sympy.Matrix(steps, steps, lambda i, j: bs[i] * (ks[i].T * ks[j])[0] * cum[i] / cum[j] if j < i else 0)
    inv = (sympy.eye(steps) + a).inv()
    kmat = sympy.Matrix.hstack(*ks).T  # [steps, K]
    vmat = sympy.Matrix.hstack(*vs).T  # [steps, V]
    w = inv * sympy.diag(*[bs[t] * cum[t] for t in range(steps)]) * kmat
    u = inv * sympy.diag(*bs) * vmat - w * s0.T  # the state [key, value] is s0^T
    end = (cum[-1] * s0.T + sympy.Matrix.hstack(*[ks[t] * cum[-1] / cum[t] for t in range(steps)]) * u).T
    chunked = [(cum[t] * qs[t].T * s0.T + sum(((qs[t].T * ks[s])[0] * cum[t] / cum[s] * u[s, :] for s in
                                               range(t + 1)), sympy.zeros(1, V))).T for t in range(steps)]
    if not zero(state - end) or not all(zero(o - c) for o, c in zip(outputs, chunked, strict=True)):
        raise ValueError("the scan's unrolled recurrence differs from the chunked UT form")
    return (f"derived (sympy: the spec's scan body on a symbolic state): one step is the {'gated ' if gate else ''}"
            f"delta rule's update; unrolled over {steps} tokens it equals the chunked UT form below in the end state "
            "and every output")


def recognize_delta(rec: _Recognizer, out: str, value: ir.Contract, scale: str | None, output_factor: float,
                    state: ir.Load, reader: ir.Load) -> DeltaRulePlan:
    from ncd.families.recurrence.linear import check_roles, kv_token_axes, token_layout
    from ncd.families.recurrence.plan import _fail

    program = rec.program
    s_name = state.tensor
    scan = rec.lets[s_name].value
    assert isinstance(scan, ir.Scan)
    if scan.init is not None:
        raise _fail(scan, "initial states come from the op's `initial_state` argument, not the spec")
    q_name = rec.input_of(reader, "the state's reader (the queries)")
    kdim = value.over[0]
    token_axes, head_first = token_layout(rec, q_name, kdim, scan)
    batch, time, head = (token_axes[0], token_axes[2], token_axes[1]) if head_first else token_axes
    loads = list(dict.fromkeys(n.tensor for n in ir.walk(scan.body) if isinstance(n, ir.Load)))
    for name in loads:
        if program.tensor(name).role != "in":
            raise _fail(scan.body, f"expected {s_name}'s update to read declared inputs only; {name} is defined "
                        "in the spec")
    vectors = [n for n in loads if len(program.tensor(n).axes) == 4]
    kv_axes = kv_token_axes(program, token_axes, head, next(
        (program.tensor(n).axes[:3] for n in vectors if program.tensor(n).axes[3] == kdim), token_axes))
    for name in vectors:
        axes = program.tensor(name).axes
        if axes[:3] != kv_axes:
            raise _fail(program.tensor(name).span, f"{name} is declared [{' '.join(axes)}]: the delta rule reads "
                        f"the keys and values per token as [{' '.join(kv_axes)} dim]")
    if head_first and kv_axes != token_axes:
        raise _fail(program.tensor(vectors[0]).span, "keys and values shared by groups of query heads (GQA) are "
                    "compiled in fla's layout only: declare the inputs [batch time head dim], k and v [batch time "
                    "kvhead dim]")
    keys = [n for n in vectors if program.tensor(n).axes == (*kv_axes, kdim)]
    values = [n for n in vectors if n not in keys]
    scalars = [n for n in loads if program.tensor(n).axes == token_axes]
    gated = {n.arg.tensor for n in ir.walk(scan.body)
             if isinstance(n, ir.Unary) and n.fn == "exp" and isinstance(n.arg, ir.Load)}
    gates = [n for n in scalars if n in gated]
    betas = [n for n in scalars if n not in gated]
    others = [n for n in loads if n not in (*keys, *values, *scalars)]
    if others:
        other = program.tensor(others[0])
        raise _fail(other.span, f"{other.name} is declared [{' '.join(other.axes)}]; the delta rule reads "
                    f"per-token vectors [{' '.join(token_axes)} dim] and scalars [{' '.join(token_axes)}]")
    if len(keys) != 1 or len(values) != 1 or len(gates) > 1 or len(betas) != 1:
        raise _fail(scan.body, f"expected {s_name}'s update to read one key vector (on '{kdim}'), one value vector, "
                    "one writing strength beta and at most one log gate inside exp(...) (the delta rule "
                    "exp(g) * (prev - beta * (prev . k over kdim) * k) + beta * v * k)")
    k_name, v_name, beta, g_name = keys[0], values[0], betas[0], (gates[0] if gates else None)
    vdim = program.tensor(v_name).axes[-1]
    if program.tensor(out).axes != (*token_axes, vdim):
        raise _fail(program.tensor(out).span, f"declare {out} as [{' '.join((*token_axes, vdim))}] (the layout of "
                    f"{q_name})")
    check_roles(rec, [("queries", q_name), ("keys", k_name), ("values", v_name), ("log gate", g_name),
                      ("writing strength", beta), ("scale", scale)], "the delta rule")
    rec.claimed = [s_name]
    rec.check_addressing(out, token_axes, {}, {k_name: kv_axes, v_name: kv_axes})
    rec.check_state_axes(s_name, scan, token_axes, {vdim, kdim})
    try:
        derivation = derive_delta_form(scan, {"q": q_name, "k": k_name, "v": v_name, "g": g_name, "beta": beta},
                                       kdim, vdim)
    except ValueError as err:
        raise _fail(scan, str(err)) from None
    roles = DeltaRoles(q=q_name, k=k_name, v=v_name, g=g_name, beta=beta, scale=scale, output=out, batch=batch,
                       time=time, head=head, kdim=kdim, vdim=vdim, S=s_name, head_first=head_first,
                       grouped=kv_axes != token_axes)
    origins = {"S": rec.origin(s_name), "output": rec.origin(out),
               "scale": f"{rec.file}:{program.tensor(scale).span.line}" if scale else rec.origin(out)}
    return DeltaRulePlan(roles=roles, origins=origins, derivation=derivation,
                         config=LinearScanConfig(output_factor=output_factor))
