"""The recurrence family: gated outer-product state recurrences read through a per-token ridge solve (Gated
KalmaNet, papers/gated-kalmanet.txt), compiled to chunked Triton kernels. A scanned state read by the queries
directly (gated linear attention) is recognised by linear.py instead.

Recognition (every step a located `unsupported` error when a spec has scans but departs from it):
    H[.. time .. a b] = scan(exp(gk) * prev + kb * kb[.. b], over time)       a key covariance (gk: g, another
                                                                             input, or no gate: `prev + ...`)
    U[.. time .. c a] = scan(exp(g) * prev + vb * kb, over time)              a value-key memory (or ungated)
    kb = k * fk(beta), vb = v * fv(beta)                                     per-token scalings (sympy)
    normH = sqrt(sum(H^2, over a b)),  lam = ridge * normH + offset          constants ridge, offset >= 0 (sympy)
    x = chebyshev_solve(H + lam * where(a == b, 1, 0), q, iterations = r, mu = lam, L = normH + lam)
    qa = q + alpha * (x - q)    (or qa = x)
    out o = scale * (U . qa over a)
k and v may sit on `kvhead` where the spec splits `head = kvhead * group` (GQA, fla's layout).

Derivations (sympy, shown by `--emit plan`): the chunked form of each scan (chunk-start states, intra-chunk decay
masks exp(G_t - G_s) from each state's cumulative gates), the Gram-matrix form of ||H_t||_F, the Chebyshev
contraction rate rho = (L - mu) / (L + mu) (a function of the ridge alone without an offset, so one omega
schedule serves every token; per token with one), the scalings' derivatives for dbeta, and the backward by
implicit differentiation with the ridge term.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from ncd import ir
from ncd.errors import NcdError
from ncd.families.recurrence.config import RecurrenceConfig
from ncd.families.recurrence.delta import DeltaRulePlan
from ncd.families.recurrence.linear import LinearScanPlan, group_sizes, kv_token_axes, recognize_linear
from ncd.family import Decline
from ncd.pipeline import FrontEnd
from ncd.source import origin_name
from ncd.symbolic import ARITHMETIC, to_sympy


class UnsupportedRecurrence(NcdError):
    code = "unsupported"
    template = "{detail}"


VALIDATION_TIME = 37  # tokens per sequence of the check's draws
BETA = sympy.Symbol("bt", real=True)  # the per-token scaling input inside the kernels
RIDGE = sympy.Symbol("a", positive=True)
OFFSET = sympy.Symbol("b", positive=True)  # the ridge's constant term: lam = a ||H|| + b
NORM = sympy.Symbol("n", positive=True)


@dataclass(frozen=True)
class RecurrenceRoles:
    q: str
    k: str
    v: str
    g: str | None  # the gate of U (None: U ungated)
    beta: str | None
    alpha: str | None
    scale: str | None
    output: str
    batch: str
    time: str
    head: str
    kdim: str
    kcol: str
    vdim: str
    H: str
    U: str
    head_first: bool = False  # inputs declared [batch head time dim]
    gk: str | None = None  # the gate of H: g's name where the two states share one gate; None: H ungated

    @property
    def h_gate(self) -> str | None:
        """The op's role of H's gate: "g" (shared with U), "gk" (an input of its own) or None (ungated)."""
        if self.gk is None:
            return None
        return "g" if self.gk == self.g else "gk"


@dataclass(frozen=True)
class RecurrencePlan:
    roles: RecurrenceRoles
    ridge: float
    iterations: int
    key_scale: sympy.Expr  # in BETA
    value_scale: sympy.Expr
    rho: sympy.Expr  # in RIDGE (and NORM, OFFSET with a ridge offset)
    origins: dict[str, str] = field(compare=False)
    output_factor: float = 1.0  # constant factors of the output beside the scale input (the op multiplies them in)
    ridge_offset: float = 0.0  # lam = ridge ||H||_F + ridge_offset
    # What the plan decides for the kernels (config.py); the generated module embeds it, precisions left None (by
    # input dtype) for NCD_GKA_DOT_PRECISION / NCD_GKA_GRAD_PRECISION at import. None: from the fields above.
    config: RecurrenceConfig = field(default=None)  # type: ignore[assignment]
    family = "recurrence"

    def __post_init__(self) -> None:
        if self.config is None:
            object.__setattr__(self, "config", RecurrenceConfig(
                iterations=self.iterations, ridge=self.ridge, output_factor=float(self.output_factor),
                scaling_input=self.roles.beta is not None, ridge_offset=self.ridge_offset))

    @property
    def output(self) -> str:
        return self.roles.output

    def _gates(self) -> tuple[str, str, str]:
        """The roles' text for the gates, and each state's decay in the chunked form."""
        r = self.roles
        if r.h_gate == "g":
            return f"log gate {r.g}", "exp(G_t - G_s)", "exp(G_t - G_s)"
        roles = f"log gates {r.g or '- (U ungated)'} of {r.U}, {r.gk or '- (H ungated)'} of {r.H}"
        return roles, "exp(Gk_t - Gk_s)" if r.gk else "1", "exp(G_t - G_s)" if r.g else "1"

    def _ridge_lines(self) -> list[str]:
        lam = " + ".join(t for t in (f"{self.ridge:g} ||H_t||" if self.ridge else "", f"{self.ridge_offset:g}"
                                     if self.ridge_offset else "") if t)
        if not self.ridge_offset:
            return [f"    lambda_t = {lam},  rho = (L - mu)/(L + mu) = {self.rho} = "
                    f"{float(self.rho.subs(RIDGE, self.ridge)):.6f} for every token: one omega schedule"]
        rate = self.rho.subs({RIDGE: self.ridge, OFFSET: self.ridge_offset})
        return [f"    lambda_t = {lam},  rho_t = (L - mu)/(L + mu) = {self.rho} = {rate} (n = ||H_t||): an omega "
                "schedule per token"]

    def describe(self) -> list[str]:
        r = self.roles
        gates, h_decay, u_decay = self._gates()
        return [
            "kernel family: gated outer-product recurrence with a ridge solve (Gated KalmaNet)",
            f"  roles: queries {r.q}, keys {r.k}, values {r.v}, {gates}, scaling {r.beta or '-'}, "
            f"alpha {r.alpha or '-'}, scale {r.scale or '1'}"
            f"{f' times {self.output_factor:g}' if self.output_factor != 1.0 else ''}; scan over '{r.time}', "
            f"per ({r.batch}, {r.head})"
            f"{'; head-first inputs, run as batch x head sequences of one head' if r.head_first else ''}",
            f"  states: {r.H}[{r.kdim} {r.kcol}] = sum_s {h_decay} kb_s kb_s^T  ({self.origins['H']}),  "
            f"{r.U}[{r.vdim} {r.kdim}] = sum_s {u_decay} vb_s kb_s^T  ({self.origins['U']})",
            f"  scalings: kb = {r.k} * ({self.key_scale}),  vb = {r.v} * ({self.value_scale})  [bt = {r.beta}]",
            "chunked form (chunk C; G = cumulative log gate inside a chunk; D[t, s] = exp(G_t - G_s) for s <= t):",
            "  pass 1 (sequential over chunks, both states in one launch): chunk-start states H_0 [K, K], S_0 = U_0^T"
            " [K, V] (fp16 tiles over power-of-two scales for the fp16 products, else fp32); the H scan also"
            " emits kb^T H_0 kb and ||H_0||^2 for the norm",
            "  pass 2 (parallel over chunks): H_t x = exp(G_t) H_0 x + ((x Kb^T) o D) Kb   (H_t never formed)",
            "    ||H_t||^2 = exp(2 G_t) ||H_0||^2 + 2 exp(G_t) rowsum(D diag(kb^T H_0 kb)) + rowsum(D o (D (G o G))),"
            " G = Kb Kb^T  (Gram form)",
            *(["  two gates: each kernel takes H's cumulative gates where it reads H and U's where it reads U; the "
               "gate gradients are summed per state (r_H, r_U)"] if r.h_gate != "g" else []),
            *self._ridge_lines(),
            f"    {self.iterations} Chebyshev steps on all C tokens at once, 3 matrix products each; "
            "o = scale (exp(G_t) qa S_0 + ((qa Kb^T) o D) Vb)",
            "backward (implicit differentiation, papers/gated-kalmanet.txt eq. 6-10, 23):",
            "  dqa = scale S_t do;  dx = alpha dqa;  z = CH(H_t + lambda_t I, dx);  dq = (1 - alpha) dqa + z",
            "  dH_t = -z_t x_t^T - c_t H_t,  c_t = a (x_t . z_t) / ||H_t||;  dS_t = scale qa_t do_t^T",
            "  reverse scan over chunks of the accumulated dH, dS; per chunk dkb = (L + L^T) kb + P vb, dvb = P^T kb",
            "  with the ridge term unrolled: -2 (beta_j H_0 kb_j + ((M diag(c) M^T) o G) Kb)",
            f"  dg = reverse cumsum of <dH_t, H_t> - kb^T L kb + <dS_t, S_t> - kb^T P vb;  d{r.beta or 'beta'} via "
            f"d/dbt: ({sympy.diff(self.key_scale, BETA)}), ({sympy.diff(self.value_scale, BETA)})",
            "kernels: forward 3 launches (both state scans; the norm; the solve, with the output in its epilogue); "
            "backward 8 (state recompute; right-hand side; solve; ridge terms; both reverse scans; 3 gradient "
            "kernels), static in ncd/families/recurrence/kernel.py; the spec's scalings enter as constexpr device "
            "functions",
            "decoding (`recurrent`): 2 launches, the recurrence token by token from a state with the same scalings "
            "and Chebyshev steps (kernel_recurrent.py): H's update and the solve, one program per (sequence, head); "
            "S's update and the read-out, one per (sequence, head, 64 value columns); no backward",
            *self.config.describe(),
        ]

    def render(self, program: ir.Program, op_id: str) -> str:
        from ncd.families.recurrence.render import render_recurrence_module

        return render_recurrence_module(program, self, op_id)

    def validation_sizes(self, program: ir.Program) -> dict[str, int]:
        r = self.roles
        sizes = {r.batch: 2, r.time: VALIDATION_TIME, r.head: 2, **group_sizes(program, r.head, 2)}
        for axis in (r.kdim, r.kcol, r.vdim):
            sizes[axis] = program.axis(axis).fixed or 24
        return sizes

    def constant_inputs(self) -> frozenset[str]:
        return frozenset()

    def condition_inputs(self, program: ir.Program, inputs: dict, generator=None) -> dict:
        """Draws in the layer's domain: unit q and k, log gates <= 0, beta and alpha in (0, 1)."""
        import torch

        r = self.roles
        out = dict(inputs)
        for name in (r.q, r.k):
            out[name] = torch.nn.functional.normalize(inputs[name].float(), dim=-1).to(inputs[name].dtype)
        for gate in {r.g, r.gk} - {None}:
            out[gate] = torch.nn.functional.logsigmoid(inputs[gate].float() + 3.0).to(inputs[gate].dtype)
        for optional in (r.beta, r.alpha):
            if optional is not None:
                out[optional] = torch.sigmoid(inputs[optional].float()).to(inputs[optional].dtype)
        return out

    # One 10-bit-mantissa product per operand pair (NCD_GKA_DOT_PRECISION fp16, bf16 or tf32; fp32 inputs with
    # those too) leaves the solve a sensitivity of about 2^-11 / ridge to that rounding (kappa <= 1 + 1 / ridge),
    # reached where H_t keeps few keys. Split products (the default: fp16x3 for 16-bit inputs, ieee for fp32) have
    # fp32's rounding, 2^-24 / ridge, with a margin (measured per token on the interpreter: o 2e-5, gradients up to
    # 2.3e-4 for dg, whose reverse sum cancels); at 16 bits the inputs' and outputs' own rounding then rules
    # (bf16, fast-forgetting gates: o 2.7e-3, gradients up to 2.1e-2 for dg at the worst token).
    # With a ridge offset b, lam_t >= a ||H_t|| + b and ||H_t|| <= t at the check's draws (unit keys, beta <= 1):
    # the bounds take a + b / T at its T.
    def _ridge_floor(self) -> float:
        return self.ridge + self.ridge_offset / VALIDATION_TIME

    def bounds(self, split: bool) -> tuple[dict[str, float], dict[str, float]]:
        """(output, gradient) error bounds per dtype for split (fp32-class) or single 10-bit products. The
        gradients combine two solves' rounding (x and the adjoint z), hence twice the output's bound (`ncd check`'s
        reference differentiates the solve implicitly too, so the iteration's convergence is not in it)."""
        bound = 2.0 ** -11 / self._ridge_floor()
        if split:
            return ({"float32": 2.0 ** -20 / self._ridge_floor(), "bfloat16": 1e-2, "float16": 5e-3},
                    {"float32": 1e-3, "bfloat16": 3e-2, "float16": 3e-2})
        return ({"float32": bound, "bfloat16": max(1e-2, bound), "float16": max(5e-3, bound)},
                {"float32": max(2e-2, 2 * bound), "bfloat16": max(3e-2, 2 * bound), "float16": max(3e-2, 2 * bound)})


# --- recognition --------------------------------------------------------------------------------------------


def plan_recurrence(front: FrontEnd,
                    bindings: dict[str, int]) -> RecurrencePlan | LinearScanPlan | DeltaRulePlan | Decline:
    program = front.program
    if not any(isinstance(n, ir.Scan) for d in program.definitions for n in ir.walk(d.value)):
        return Decline("the spec has no scan (a gated recurrence over time)")
    try:
        return _Recognizer(program).run()
    except NcdError as err:
        raise err.with_source(front.source) from None


def _fail(node_or_span: object, detail: str, hint: str | None = None) -> UnsupportedRecurrence:
    span = getattr(node_or_span, "span", node_or_span)
    return UnsupportedRecurrence(span, detail=detail, hint=hint)  # type: ignore[arg-type]


class _Recognizer:
    def __init__(self, program: ir.Program) -> None:
        self.program = program
        self.lets = {d.tensor: d for d in program.definitions}
        self.file = origin_name(program.source.filename)
        self.claimed: list[str] = []  # the definitions the plan computes (every load in them is checked)

    def origin(self, name: str) -> str:
        return f"{self.file}:{self.lets[name].span.line}"

    def let_of(self, node: ir.Node, what: str, at: object) -> tuple[str, ir.Node]:
        if not (isinstance(node, ir.Load) and node.tensor in self.lets):
            raise _fail(at, f"expected {what} to be a tensor defined in the spec")
        return node.tensor, self.lets[node.tensor].value

    def input_of(self, node: ir.Node, what: str) -> str:
        if not (isinstance(node, ir.Load) and self.program.tensor(node.tensor).role == "in"):
            raise _fail(node, f"expected {what} to be a declared input")
        return node.tensor

    def run(self) -> RecurrencePlan | LinearScanPlan | DeltaRulePlan:
        outputs = self.program.outputs
        if len(outputs) != 1:
            raise _fail(outputs[-1].span if outputs else None, "the recurrence family compiles one output")
        out = outputs[0].name
        value, scale, output_factor = self.output_factors(self.lets[out].value)
        if not (isinstance(value, ir.Contract) and len(value.over) == 1):
            raise _fail(value, "expected the output to be `scale * (U . qa over kdim)`: a state read by a vector")
        sides = [value.lhs, value.rhs]
        states = [s for s in sides if isinstance(s, ir.Load) and isinstance(self.lets.get(s.tensor, None) and
                                                                              self.lets[s.tensor].value, ir.Scan)]
        if len(states) != 1:
            raise _fail(value, "expected one side of the output contraction to be a scanned state (`scan(...)`)")
        u_name = states[0].tensor
        reader = sides[1] if sides[0] is states[0] else sides[0]
        if isinstance(reader, ir.Load) and reader.tensor not in self.lets:  # gated linear attention
            return recognize_linear(self, out, value, scale, output_factor, states[0], reader)
        qa_name, qa_value = self.let_of(reader, "the query side", value)
        kdim = value.over[0]

        x_name, q_name, alpha = self.alpha_connection(qa_name, qa_value)
        solve = self.lets[x_name].value
        assert isinstance(solve, ir.ChebyshevSolve)
        h_name, ridge_lets, ridge, ridge_offset = self.ridge_system(solve)
        # the contraction rate (L - mu) / (L + mu) with the ridge's constants as symbols: free of the norm (one
        # schedule for every token) exactly when the offset is 0
        lam = RIDGE * NORM + (OFFSET if ridge_offset else 0)
        rho = sympy.simplify(((NORM + lam) - lam) / ((NORM + lam) + lam))
        h_scan, u_scan = self.lets[h_name].value, self.lets[u_name].value
        assert isinstance(h_scan, ir.Scan) and isinstance(u_scan, ir.Scan)
        g_h, kb1, kb2 = self.gated_outer(h_scan, h_name)
        g_u, vb, kb3 = self.gated_outer(u_scan, u_name)
        if not (kb1.tensor == kb2.tensor == kb3.tensor):
            raise _fail(h_scan, f"expected {h_name} = scan(exp(g) * prev + kb * kb[...]) and {u_name} = "
                        "scan(exp(g) * prev + vb * kb) with the same kb")
        self.claimed = [n for n in (qa_name, x_name, h_name, u_name, *ridge_lets, kb1.tensor, vb.tensor)
                        if n in self.lets]
        k_name, beta1, key_scale = self.scaled_input(kb1.tensor)
        v_name, beta2, value_scale = self.scaled_input(vb.tensor)
        beta: str | None = beta1 or beta2
        if beta1 and beta2 and beta1 != beta2:
            raise _fail(self.lets[vb.tensor], f"keys and values must be scaled by one input; got {beta1}, {beta2}")

        q_decl = self.program.tensor(q_name)
        q_axes = q_decl.axes
        if len(q_axes) != 4 or q_axes[3] != kdim:
            raise _fail(q_decl.span, f"declare {q_name} as [batch time head {kdim}] (fla's layout)")
        if h_scan.over != u_scan.over:
            raise _fail(u_scan, f"the two scans must run over one axis; {h_name} scans '{h_scan.over}', "
                        f"{u_name} scans '{u_scan.over}'")
        scan_axis = h_scan.over
        if scan_axis not in q_axes[:3]:
            raise _fail(h_scan, f"the scans run over '{scan_axis}', which {q_name} does not carry: expected "
                        f"{q_name}[batch {scan_axis} head {kdim}]")
        head_first = q_axes[2] == scan_axis  # [batch head time dim]: run as batch x head sequences of one head
        if q_axes[1] != scan_axis and not head_first:
            raise _fail(q_decl.span, f"{q_name} is declared [{' '.join(q_axes)}], but the recurrence family takes "
                        f"fla's layout [batch time head dim] or the head-first [batch head time dim]: the scanned "
                        f"axis '{scan_axis}' second or third")
        token = q_axes[:3]  # as declared
        batch, time, head = (token[0], token[2], token[1]) if head_first else token
        kcol = solve.over
        vdim = next((a for a in self.program.tensor(u_name).axes if a not in (batch, time, head, kdim)), None)
        if vdim is None:
            raise _fail(self.lets[u_name], f"expected {u_name}[{batch} {time} {head} vdim {kdim}]: the values' "
                        "axis is missing")
        kv = kv_token_axes(self.program, token, head, self.program.tensor(k_name).axes[:3])  # GQA: kvhead
        if kv != token and head_first:
            raise _fail(self.program.tensor(k_name).span, "keys and values shared by groups of query heads (GQA) "
                        "are compiled in fla's layout only: declare the inputs [batch time head dim], k and v "
                        "[batch time kvhead dim]")
        for name, axes in ((k_name, (*kv, kdim)), (v_name, (*kv, vdim)), (g_u, token), (g_h, token),
                           (beta, token), (alpha, token)):
            if name is not None and self.program.tensor(name).axes != axes:
                raise _fail(self.program.tensor(name).span, f"declare {name} as [{' '.join(axes)}] (the layout of "
                            f"{q_name})")
        roles_by_name: dict[str, str] = {}
        gate_roles = [("log gate", g_u)] if g_h == g_u else [(f"log gate of {u_name}", g_u),
                                                             (f"log gate of {h_name}", g_h)]
        for role, name in (("queries", q_name), ("keys", k_name), ("values", v_name), *gate_roles,
                           ("scaling", beta), ("alpha", alpha), ("scale", scale)):
            if name is not None and roles_by_name.setdefault(name, role) != role:
                raise _fail(self.program.tensor(name).span, f"{name} serves as both the {roles_by_name[name]} "
                            f"and the {role} of the recurrence; each role needs an input of its own")
        for t in self.program.inputs:
            if t.name not in roles_by_name:
                raise _fail(t.span, f"{t.name} has no role in the recurrence (queries, keys, values, log gates, "
                            "scaling, alpha, scale): the family would ignore it")
        if self.program.params:
            param = self.program.params[0]
            raise _fail(param.span, f"the recurrence family takes no parameters; {param.name} would be ignored")
        key_row = kv if kb1.tensor == k_name else token  # the keys' own rows, or their per-head scaling's
        value_row = kv if vb.tensor == v_name else token
        self.check_addressing(out, token, {h_name: {(*key_row, kdim), (*key_row, kcol)},
                                           u_name: {(*value_row, vdim), (*key_row, kdim)}},
                              {k_name: kv, v_name: kv})
        self.check_state_axes(h_name, h_scan, token, {kdim, kcol})
        self.check_state_axes(u_name, u_scan, token, {vdim, kdim})
        roles = RecurrenceRoles(q=q_name, k=k_name, v=v_name, g=g_u, beta=beta, alpha=alpha, scale=scale,
                                output=out, batch=batch, time=time, head=head, kdim=kdim, kcol=kcol, vdim=vdim,
                                H=h_name, U=u_name, head_first=head_first, gk=g_h)
        ridge_origin = self.origin(ridge_lets[0]) if ridge_lets else self.origin(x_name)
        origins = {"H": self.origin(h_name), "U": self.origin(u_name), "lam": ridge_origin,
                   "solve": self.origin(x_name), "qa": self.origin(qa_name),
                   "output": self.origin(out),
                   "key_scale": self.origin(kb1.tensor) if kb1.tensor in self.lets else self.origin(h_name),
                   "value_scale": self.origin(vb.tensor) if vb.tensor in self.lets else self.origin(u_name),
                   "scale": (f"{self.file}:{self.program.tensor(scale).span.line}" if scale else self.origin(out))}
        return RecurrencePlan(roles=roles, ridge=ridge, iterations=solve.iterations, key_scale=key_scale,
                              value_scale=value_scale, rho=rho, origins=origins, output_factor=output_factor,
                              ridge_offset=ridge_offset)

    # -- pieces --

    def output_factors(self, value: ir.Node) -> tuple[ir.Node, str | None, float]:
        """The output as a product: the state read (a contraction), at most one scalar input (the scale) and
        constant factors, whose product is returned (honoured by the op, never dropped)."""
        factors = _product_factors(value)
        contracts = [f for f in factors if isinstance(f, ir.Contract)]
        if len(contracts) != 1:
            raise _fail(value, "expected the output to be `scale * (U . qa over kdim)`: a state read by a vector")
        scale: str | None = None
        constant = 1.0
        for factor in factors:
            if factor is contracts[0]:
                continue
            number = _number(factor)
            if number is not None:
                constant *= number
                continue
            name = self.input_of(factor, "the output's scale factor")
            axes = self.program.tensor(name).axes
            if axes or scale is not None:
                raise _fail(factor, f"expected one scalar scale input beside the state read; {name} "
                            + (f"carries axes [{' '.join(axes)}]" if axes else "is a second one"))
            scale = name
        if constant == 0.0 or constant != constant:
            raise _fail(value, f"the output's constant factor is {constant:g}")
        return contracts[0], scale, constant

    def check_addressing(self, out: str, token_axes: tuple[str, str, str],
                         update_axes: dict[str, set[tuple[str, ...]]],
                         per_tensor: dict[str, tuple[str, ...]] | None = None) -> None:
        """Every load in the claimed definitions reads one token's row as declared: no index expressions, no
        relabelled batch, time or head; the two factors of each state update span the state's two axes."""
        claimed = [out, *self.claimed]
        for name in claimed:
            for node in ir.walk(self.lets[name].value):
                if not isinstance(node, ir.Load):
                    continue
                declared = self.program.tensor(node.tensor).axes
                addressed = tuple(i.axis for i in node.index)
                row = (per_tensor or {}).get(node.tensor, token_axes)
                if any(i.index is not None for i in node.index) or (
                        declared and addressed[:3] != row):
                    raise _fail(node, f"expected {node.tensor} read per token as [{' '.join(row)} ...]; "
                                f"it is read as [{' '.join(str(a) for a in addressed)}]")
        for name, expected in update_axes.items():
            scan = self.lets[name].value
            assert isinstance(scan, ir.Scan)
            body = scan.body
            assert isinstance(body, ir.Binary)
            update = body.rhs if any(isinstance(n, ir.Prev) for n in ir.walk(body.lhs)) else body.lhs
            assert isinstance(update, ir.Binary)
            got = {tuple(update.lhs.axes), tuple(update.rhs.axes)}
            if got != expected or len(got) != 2:
                raise _fail(update, f"expected {name}'s update to be an outer product over "
                            f"{' and '.join(sorted(a[-1] for a in expected))}; its factors carry "
                            + " and ".join(f"[{' '.join(a)}]" for a in sorted(got)))

    def check_state_axes(self, name: str, scan: ir.Scan, token_axes: tuple[str, str, str],
                         state_axes: set[str]) -> None:
        axes = self.program.tensor(name).axes
        if len(axes) != 5 or axes[:3] != token_axes or set(axes[3:]) != state_axes:
            raise _fail(self.lets[name], f"declare {name} as [{' '.join(token_axes)} "
                        f"{' '.join(sorted(state_axes))}] (in either order of the last two)")

    def alpha_connection(self, qa_name: str, value: ir.Node) -> tuple[str, str, str | None]:
        """qa = q + alpha (x - q) or qa = x, with x a Chebyshev solve whose right-hand side is q."""
        loads = {n.tensor: n for n in ir.walk(value) if isinstance(n, ir.Load)}
        solves = [t for t in loads if t in self.lets and isinstance(self.lets[t].value, ir.ChebyshevSolve)]
        if len(solves) != 1:
            raise _fail(self.lets[qa_name], f"expected {qa_name} to read one `chebyshev_solve` result")
        x_name = solves[0]
        solve = self.lets[x_name].value
        assert isinstance(solve, ir.ChebyshevSolve)
        q_name = self.input_of(solve.rhs, "the solve's right-hand side")
        if value == loads[x_name] and len(loads) == 1:
            return x_name, q_name, None
        others = [t for t in loads if t not in (x_name, q_name)]
        if len(others) != 1 or self.program.tensor(others[0]).role != "in":
            raise _fail(self.lets[qa_name], f"expected {qa_name} = {q_name} + alpha * ({x_name} - {q_name})")
        alpha = others[0]
        expr = _elementwise_sympy(value)
        sx, sq, sa = (sympy.Symbol(n) for n in (x_name, q_name, alpha))
        if sympy.simplify(expr - (sq + sa * (sx - sq))) != 0:
            raise _fail(self.lets[qa_name], f"expected {qa_name} = {q_name} + {alpha} * ({x_name} - {q_name}) "
                        "(the alpha-connection)")
        return x_name, q_name, alpha

    def ridge_system(self, solve: ir.ChebyshevSolve) -> tuple[str, list[str], float, float]:
        """matrix = H + lam * where(a == b, 1, 0) with lam = ridge ||H||_F + offset (constants ridge, offset >= 0,
        not both 0; lam a definition or an expression), ||H||_F = sqrt(sum(H^2, over both state axes)); mu = lam and
        L = ||H||_F + lam, as sympy sees them. Returns H's name, the definitions read, ridge and offset."""
        m = solve.matrix
        if not (isinstance(m, ir.Binary) and m.op == "+"):
            raise _fail(m, "expected the solve's matrix to be `H + lam * where(kdim == kcol, 1, 0)`")
        h_side, ridge_side = (m.lhs, m.rhs) if isinstance(m.lhs, ir.Load) else (m.rhs, m.lhs)
        h_name, h_value = self.let_of(h_side, "the solve's matrix H", m)
        if not isinstance(h_value, ir.Scan):
            raise _fail(h_side, f"expected {h_name} to be a scanned state")
        if not (isinstance(ridge_side, ir.Binary) and ridge_side.op == "*"):
            raise _fail(ridge_side, "expected `lam * where(kdim == kcol, 1, 0)` (a ridge on the diagonal)")
        lam_side, eye = (ridge_side.lhs, ridge_side.rhs) if isinstance(ridge_side.rhs, ir.Where) else \
            (ridge_side.rhs, ridge_side.lhs)
        state_axes = set(self.program.tensor(h_name).axes[-2:])
        if not (isinstance(eye, ir.Where) and isinstance(eye.cond, ir.Binary) and eye.cond.op == "==" and
                _number(eye.then) == 1 and _number(eye.otherwise) == 0):
            raise _fail(ridge_side, "expected the identity as `where(kdim == kcol, 1, 0)`")
        compared = {getattr(side, "axis", None) for side in (eye.cond.lhs, eye.cond.rhs)
                    if isinstance(side, ir.AxisIndex)}
        if compared != state_axes or len(compared) != 2:
            raise _fail(eye.cond, f"expected the identity over {h_name}'s two state axes: "
                        f"`where({' == '.join(sorted(state_axes))}, 1, 0)`")
        read: list[str] = []
        lam = sympy.expand(self.norm_expression(lam_side, h_name, state_axes, read))
        poly = sympy.Poly(lam, NORM) if lam.is_polynomial(NORM) else None
        coeffs = [c for c in (poly.all_coeffs() if poly is not None else []) if c.is_number]
        if poly is None or poly.degree() > 1 or len(coeffs) != poly.degree() + 1:
            raise _fail(lam_side, f"the ridge is {lam} in the norm n = ||{h_name}||_F; the family takes "
                        "lam = ridge * n + offset with constants ridge, offset >= 0",
                        hint="a ridge from another norm (the trace, a maximum) is not compiled by this family yet")
        ridge, offset = (float(coeffs[0]), float(coeffs[1])) if poly.degree() == 1 else (0.0, float(coeffs[0]))
        if ridge < 0 or offset < 0 or ridge + offset <= 0:
            raise _fail(lam_side, f"the ridge lam = {lam} (n = ||{h_name}||_F) must be positive: ridge * n + offset "
                        "with ridge, offset >= 0, not both 0 (the solve's lower spectrum bound mu)")
        mu = self.norm_expression(solve.mu, h_name, state_axes, read)
        if sympy.simplify(mu - lam) != 0:
            raise _fail(solve, f"expected mu = lam, the ridge ({lam}); got mu = {mu}")
        lip = self.norm_expression(solve.lipschitz, h_name, state_axes, read)
        if sympy.simplify(lip - (NORM + lam)) != 0:
            raise _fail(solve, f"expected L = ||{h_name}||_F + lam (the spectrum bound of H + lam I), {NORM + lam}; "
                        f"got L = {lip}")
        return h_name, list(dict.fromkeys(read)), ridge, offset

    def norm_expression(self, node: ir.Node, h_name: str, state_axes: set[str], read: list[str]) -> sympy.Expr:
        """A per-token expression of constants and ||H||_F (the symbol NORM), through the definitions it reads
        (their names added to `read`)."""

        def leaf(n: ir.Node) -> sympy.Expr | None:
            if isinstance(n, ir.Const):
                return None
            if (isinstance(n, ir.Reduce) and n.op == "sum" and set(n.over) == state_axes and len(n.over) == 2
                    and isinstance(n.arg, ir.Pow) and n.arg.exponent == 2 and isinstance(n.arg.base, ir.Load)
                    and n.arg.base.tensor == h_name):
                return NORM ** 2
            if isinstance(n, ir.Load) and n.tensor in self.lets and not isinstance(self.lets[n.tensor].value, ir.Scan):
                read.append(n.tensor)
                return to_sympy(self.lets[n.tensor].value, leaf=leaf, arithmetic=_PER_TOKEN_ARITHMETIC)
            raise _fail(n, f"the ridge, mu and L are built from constants and ||{h_name}||_F = "
                        f"sqrt(sum({h_name}^2, over {' '.join(sorted(state_axes))})); this is not one of them")

        return to_sympy(node, leaf=leaf, arithmetic=_PER_TOKEN_ARITHMETIC)

    def gated_outer(self, scan: ir.Scan, name: str) -> tuple[str | None, ir.Load, ir.Load]:
        """exp(g) * prev + a * b (or prev + a * b: no gate, None) with g an input per token and a, b per-token
        vectors on different axes."""
        if scan.init is not None:
            raise _fail(scan, "initial states come from the op's `initial_state` argument, not the spec")
        body = scan.body
        if not (isinstance(body, ir.Binary) and body.op == "+"):
            raise _fail(body, f"expected {name} = scan(exp(g) * prev + a * b, over time)")
        decay, update = (body.lhs, body.rhs) if any(isinstance(n, ir.Prev) for n in ir.walk(body.lhs)) else \
            (body.rhs, body.lhs)
        if sum(isinstance(n, ir.Prev) for n in ir.walk(body)) != 1 or any(
                isinstance(n, ir.Prev) for n in ir.walk(update)):
            raise _fail(body, f"expected {name} = scan(exp(g) * prev + a * b, over time): `prev` once, in the decay")
        g_name = None
        if not isinstance(decay, ir.Prev):
            if not (isinstance(decay, ir.Binary) and decay.op == "*" and
                    (isinstance(decay.lhs, ir.Prev) or isinstance(decay.rhs, ir.Prev))):
                raise _fail(decay, "expected the decay `exp(g) * prev` (or `prev`: no gate)")
            gate = decay.lhs if isinstance(decay.rhs, ir.Prev) else decay.rhs
            if not (isinstance(gate, ir.Unary) and gate.fn == "exp"):
                raise _fail(gate, "expected a gate exp(g) with g a natural-log gate input (fla convention)")
            g_name = self.input_of(gate.arg, "the log gate")
        if not (isinstance(update, ir.Binary) and update.op == "*" and isinstance(update.lhs, ir.Load)
                and isinstance(update.rhs, ir.Load)):
            raise _fail(update, "expected the update to be an outer product `a * b[...]` of two per-token vectors")
        return g_name, update.lhs, update.rhs

    def scaled_input(self, name: str) -> tuple[str, str | None, sympy.Expr]:
        """name = x * f(s): an input vector times a function of a per-token scalar input (or a constant)."""
        if self.program.tensor(name).role == "in":
            return name, None, sympy.Integer(1)
        value = self.lets[name].value
        loads = {n.tensor for n in ir.walk(value) if isinstance(n, ir.Load)}
        vectors = [t for t in loads if len(self.program.tensor(t).axes) == 4]
        scalars = [t for t in loads if t not in vectors]
        if len(vectors) != 1 or len(scalars) > 1 or any(self.program.tensor(t).role != "in" for t in loads):
            raise _fail(self.lets[name], f"expected {name} = x * f(s) with x a [batch time head dim] input and s a "
                        "per-token input")
        expr = _elementwise_sympy(value)
        x = sympy.Symbol(vectors[0])
        factor = sympy.simplify(expr / x)
        if factor.has(x):
            raise _fail(self.lets[name], f"expected {name} to be linear in {vectors[0]}")
        if scalars:
            factor = factor.subs(sympy.Symbol(scalars[0]), BETA)
        return vectors[0], (scalars[0] if scalars else None), factor


def _product_factors(node: ir.Node) -> list[ir.Node]:
    """The factors of a product tree `a * (b * c)`; a negation contributes the factor -1."""
    if isinstance(node, ir.Binary) and node.op == "*":
        return _product_factors(node.lhs) + _product_factors(node.rhs)
    if isinstance(node, ir.Unary) and node.fn == "neg" and _number(node) is None:
        return [ir.Const(-1.0, node.span), *_product_factors(node.arg)]
    return [node]


def _number(node: ir.Node) -> float | None:
    if isinstance(node, ir.Const):
        return node.value
    if isinstance(node, ir.Unary) and node.fn == "neg":
        inner = _number(node.arg)
        return None if inner is None else -inner
    return None


_PER_TOKEN_ARITHMETIC = {op: ARITHMETIC[op] for op in "+-*/"}


def _elementwise_sympy(node: ir.Node) -> sympy.Expr:
    """An element-wise expression with every load as a symbol named after its tensor."""

    def leaf(n: ir.Node) -> sympy.Expr | None:
        if isinstance(n, ir.Load):
            return sympy.Symbol(n.tensor)
        if isinstance(n, ir.Const):
            return None  # the number
        raise _fail(n, f"{type(n).__name__} is not supported in a per-token expression of the recurrence family")

    return to_sympy(node, leaf=leaf, arithmetic=_PER_TOKEN_ARITHMETIC)
