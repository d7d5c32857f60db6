"""The recurrence family: gated outer-product state recurrences read through a per-token ridge solve (Gated
KalmaNet, papers/gated-kalmanet.txt), compiled to chunked Triton kernels.

Recognition (every step a located `unsupported` error when a spec has scans but departs from it):
    H[.. time .. a b] = scan(exp(g) * prev + kb * kb[.. b], over time)        a gated key covariance
    U[.. time .. c a] = scan(exp(g) * prev + vb * kb, over time)              a gated value-key memory
    kb = k * fk(beta), vb = v * fv(beta)                                     per-token scalings (sympy)
    normH = sqrt(sum(H^2, over a b)),  lam = ridge * normH
    x = chebyshev_solve(H + lam * where(a == b, 1, 0), q, iterations = r, mu = lam, L = normH + lam)
    qa = q + alpha * (x - q)    (or qa = x)
    out o = scale * (U . qa over a)

Derivations (sympy, shown by `--emit plan`): the chunked form of each scan (chunk-start states, intra-chunk decay
masks exp(G_t - G_s) from cumulative gates), the Gram-matrix form of ||H_t||_F, the Chebyshev contraction rate
rho = (L - mu) / (L + mu) as a function of the ridge alone (so one omega schedule serves every token), the
scalings' derivatives for dbeta, and the backward by implicit differentiation with the ridge term.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from . import ir
from .errors import NcdError
from .pipeline import FrontEnd
from .symbolic import SYMPY_FUNCTIONS


class UnsupportedRecurrence(NcdError):
    code = "unsupported"
    template = "{detail}"


BETA = sympy.Symbol("bt", real=True)  # the per-token scaling input inside the kernels
RIDGE = sympy.Symbol("a", positive=True)
NORM = sympy.Symbol("n", positive=True)


@dataclass(frozen=True)
class RecurrenceRoles:
    q: str
    k: str
    v: str
    g: str
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


@dataclass(frozen=True)
class RecurrencePlan:
    roles: RecurrenceRoles
    ridge: float
    iterations: int
    key_scale: sympy.Expr  # in BETA
    value_scale: sympy.Expr
    rho: sympy.Expr  # in RIDGE
    origins: dict[str, str] = field(compare=False)
    family = "recurrence"

    @property
    def output(self) -> str:
        return self.roles.output

    def describe(self) -> list[str]:
        r = self.roles
        return [
            "kernel family: gated outer-product recurrence with a ridge solve (Gated KalmaNet)",
            f"  roles: queries {r.q}, keys {r.k}, values {r.v}, log gate {r.g}, scaling {r.beta or '-'}, "
            f"alpha {r.alpha or '-'}, scale {r.scale or '1'}; scan over '{r.time}', per ({r.batch}, {r.head})",
            f"  states: {r.H}[{r.kdim} {r.kcol}] = sum_s exp(G_t - G_s) kb_s kb_s^T  ({self.origins['H']}),  "
            f"{r.U}[{r.vdim} {r.kdim}] = sum_s exp(G_t - G_s) vb_s kb_s^T  ({self.origins['U']})",
            f"  scalings: kb = {r.k} * ({self.key_scale}),  vb = {r.v} * ({self.value_scale})  [bt = {r.beta}]",
            "chunked form (chunk C; G = cumulative log gate inside a chunk; D[t, s] = exp(G_t - G_s) for s <= t):",
            "  pass 1 (sequential over chunks, both states in one launch): chunk-start states H_0 [K, K], S_0 = U_0^T"
            " [K, V] (fp16 tiles over power-of-two scales for the default fp16 products, else fp32); the H scan also"
            " emits kb^T H_0 kb and ||H_0||^2 for the norm",
            "  pass 2 (parallel over chunks): H_t x = exp(G_t) H_0 x + ((x Kb^T) o D) Kb   (H_t never formed)",
            "    ||H_t||^2 = exp(2 G_t) ||H_0||^2 + 2 exp(G_t) rowsum(D diag(kb^T H_0 kb)) + rowsum(D o (D (G o G))),"
            " G = Kb Kb^T  (Gram form)",
            f"    lambda_t = {self.ridge:g} ||H_t||,  rho = (L - mu)/(L + mu) = {self.rho} = "
            f"{float(self.rho.subs(RIDGE, self.ridge)):.6f} for every token: one omega schedule",
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
            "kernels)",
        ]

    def render(self, program: ir.Program, op_id: str) -> str:
        from .codegen.gka import render_gka_module

        return render_gka_module(program, self, op_id)

    def validation_sizes(self, program: ir.Program) -> dict[str, int]:
        r = self.roles
        sizes = {r.batch: 2, r.time: 37, r.head: 2}
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
        out[r.g] = torch.nn.functional.logsigmoid(inputs[r.g].float() + 3.0).to(inputs[r.g].dtype)
        for optional in (r.beta, r.alpha):
            if optional is not None:
                out[optional] = torch.sigmoid(inputs[optional].float()).to(inputs[optional].dtype)
        return out

    # The default products carry a 10-bit mantissa (scaled fp16 in the solve), and the solve's sensitivity to that
    # rounding is about 2^-11 / ridge (kappa <= 1 + 1 / ridge), reached on a sequence's first tokens.
    @property
    def output_tolerance(self) -> dict[str, float]:
        bound = 2.0 ** -11 / self.ridge
        return {"float32": bound, "bfloat16": max(1e-2, bound), "float16": max(5e-3, bound)}

    # the gradients combine two solves' rounding (x and the adjoint z), hence twice the output's bound (`ncd
    # check`'s reference differentiates the solve implicitly too, so the iteration's convergence is not in it)
    @property
    def gradient_tolerance(self) -> dict[str, float]:
        bound = 2.0 ** -10 / self.ridge
        return {"float32": max(2e-2, bound), "bfloat16": max(3e-2, bound), "float16": max(3e-2, bound)}


# --- recognition --------------------------------------------------------------------------------------------


def plan_recurrence(front: FrontEnd, bindings: dict[str, int]) -> RecurrencePlan | None:
    program = front.program
    if not any(isinstance(n, ir.Scan) for d in program.definitions for n in ir.walk(d.value)):
        return None
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
        self.file = program.source.filename.rsplit("/", 1)[-1]

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

    def run(self) -> RecurrencePlan:
        outputs = self.program.outputs
        if len(outputs) != 1:
            raise _fail(outputs[-1].span if outputs else None, "the recurrence family compiles one output")
        out = outputs[0].name
        value = self.lets[out].value
        scale: str | None = None
        if isinstance(value, ir.Binary) and value.op == "*":
            scalar, value = (value.lhs, value.rhs) if not value.lhs.axes else (value.rhs, value.lhs)
            scale = self.input_of(scalar, "the output's scale factor")
        if not (isinstance(value, ir.Contract) and len(value.over) == 1):
            raise _fail(value, "expected the output to be `scale * (U . qa over kdim)`: a state read by a vector")
        sides = [value.lhs, value.rhs]
        states = [s for s in sides if isinstance(s, ir.Load) and isinstance(self.lets.get(s.tensor, None) and
                                                                              self.lets[s.tensor].value, ir.Scan)]
        if len(states) != 1:
            raise _fail(value, "expected one side of the output contraction to be a scanned state (`scan(...)`)")
        u_name = states[0].tensor
        qa_name, qa_value = self.let_of(sides[1] if sides[0] is states[0] else sides[0], "the query side", value)
        kdim = value.over[0]

        x_name, q_name, alpha = self.alpha_connection(qa_name, qa_value)
        solve = self.lets[x_name].value
        assert isinstance(solve, ir.ChebyshevSolve)
        h_name, lam_name, norm_name, ridge = self.ridge_system(solve, q_name)
        h_scan, u_scan = self.lets[h_name].value, self.lets[u_name].value
        assert isinstance(h_scan, ir.Scan) and isinstance(u_scan, ir.Scan)
        g_h, kb1, kb2 = self.gated_outer(h_scan, h_name)
        g_u, vb, kb3 = self.gated_outer(u_scan, u_name)
        if g_h != g_u:
            raise _fail(u_scan, f"the two scans must share one gate; {h_name} uses {g_h}, {u_name} uses {g_u}")
        if not (kb1.tensor == kb2.tensor == kb3.tensor):
            raise _fail(h_scan, f"expected {h_name} = scan(exp(g) * prev + kb * kb[...]) and {u_name} = "
                        "scan(exp(g) * prev + vb * kb) with the same kb")
        k_name, beta1, key_scale = self.scaled_input(kb1.tensor)
        v_name, beta2, value_scale = self.scaled_input(vb.tensor)
        beta: str | None = beta1 or beta2
        if beta1 and beta2 and beta1 != beta2:
            raise _fail(self.lets[vb.tensor], f"keys and values must be scaled by one input; got {beta1}, {beta2}")

        q_axes = self.program.tensor(q_name).axes
        if len(q_axes) != 4 or q_axes[3] != kdim:
            raise _fail(self.program.tensor(q_name).span, f"declare {q_name} as [batch time head {kdim}]")
        batch, time, head = q_axes[:3]
        if h_scan.over != time or u_scan.over != time:
            raise _fail(h_scan, f"the scans must run over '{time}', the second axis of {q_name}")
        kcol = solve.over
        vdim = next(a for a in self.program.tensor(u_name).axes if a not in (batch, time, head, kdim))
        for name, axes in ((k_name, (batch, time, head, kdim)), (v_name, (batch, time, head, vdim)),
                           (g_h, (batch, time, head)), (beta, (batch, time, head)), (alpha, (batch, time, head))):
            if name is not None and self.program.tensor(name).axes != axes:
                raise _fail(self.program.tensor(name).span, f"declare {name} as [{' '.join(axes)}] (fla layout)")
        rho = sympy.simplify(((NORM + RIDGE * NORM) - RIDGE * NORM) / ((NORM + RIDGE * NORM) + RIDGE * NORM))
        if rho.has(NORM):
            raise _fail(solve, "the Chebyshev contraction rate depends on the token; expected mu = lam, "
                        "L = normH + lam")
        roles = RecurrenceRoles(q=q_name, k=k_name, v=v_name, g=g_h, beta=beta, alpha=alpha, scale=scale,
                                output=out, batch=batch, time=time, head=head, kdim=kdim, kcol=kcol, vdim=vdim,
                                H=h_name, U=u_name)
        origins = {"H": self.origin(h_name), "U": self.origin(u_name), "norm": self.origin(norm_name),
                   "lam": self.origin(lam_name), "solve": self.origin(x_name), "qa": self.origin(qa_name),
                   "output": self.origin(out),
                   "scale": (f"{self.file}:{self.program.tensor(scale).span.line}" if scale else self.origin(out))}
        return RecurrencePlan(roles=roles, ridge=ridge, iterations=solve.iterations, key_scale=key_scale,
                              value_scale=value_scale, rho=rho, origins=origins)

    # -- pieces --

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

    def ridge_system(self, solve: ir.ChebyshevSolve, q_name: str) -> tuple[str, str, str, float]:
        """matrix = H + lam * where(row == col, 1, 0), lam = ridge * normH, normH = sqrt(sum(H^2)), mu = lam,
        L = normH + lam."""
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
        if not (isinstance(eye, ir.Where) and isinstance(eye.cond, ir.Binary) and eye.cond.op == "==" and
                _number(eye.then) == 1 and _number(eye.otherwise) == 0):
            raise _fail(ridge_side, "expected the identity as `where(kdim == kcol, 1, 0)`")
        lam_name, lam_value = self.let_of(lam_side, "the ridge lambda", ridge_side)
        if not (isinstance(lam_value, ir.Binary) and lam_value.op == "*"):
            raise _fail(self.lets[lam_name], f"expected {lam_name} = ridge * normH (a constant times ||H||_F)")
        const, norm_side = (lam_value.lhs, lam_value.rhs) if _number(lam_value.lhs) is not None else \
            (lam_value.rhs, lam_value.lhs)
        ridge = _number(const)
        if ridge is None or ridge <= 0:
            raise _fail(self.lets[lam_name], f"expected {lam_name} = ridge * normH with a positive constant ridge")
        norm_name, norm_value = self.let_of(norm_side, "||H||_F", lam_value)
        if not (isinstance(norm_value, ir.Unary) and norm_value.fn == "sqrt" and isinstance(norm_value.arg, ir.Reduce)
                and norm_value.arg.op == "sum" and isinstance(norm_value.arg.arg, ir.Pow)
                and norm_value.arg.arg.exponent == 2 and isinstance(norm_value.arg.arg.base, ir.Load)
                and norm_value.arg.arg.base.tensor == h_name and len(norm_value.arg.over) == 2):
            raise _fail(self.lets[norm_name], f"expected {norm_name} = sqrt(sum({h_name}^2, over both state axes)): "
                        "the Frobenius norm")
        if not (isinstance(solve.mu, ir.Load) and solve.mu.tensor == lam_name):
            raise _fail(solve, f"expected mu = {lam_name}")
        lip = solve.lipschitz
        if not (isinstance(lip, ir.Binary) and lip.op == "+" and
                {getattr(lip.lhs, "tensor", None), getattr(lip.rhs, "tensor", None)} == {norm_name, lam_name}):
            raise _fail(solve, f"expected L = {norm_name} + {lam_name} (the spectrum bound of H + lam I)")
        return h_name, lam_name, norm_name, ridge

    def gated_outer(self, scan: ir.Scan, name: str) -> tuple[str, ir.Load, ir.Load]:
        """exp(g) * prev + a * b with g an input per token and a, b per-token vectors on different axes."""
        if scan.init is not None:
            raise _fail(scan, "initial states come from the op's `initial_state` argument, not the spec")
        body = scan.body
        if not (isinstance(body, ir.Binary) and body.op == "+"):
            raise _fail(body, f"expected {name} = scan(exp(g) * prev + a * b, over time)")
        decay, update = (body.lhs, body.rhs) if any(isinstance(n, ir.Prev) for n in ir.walk(body.lhs)) else \
            (body.rhs, body.lhs)
        if not (isinstance(decay, ir.Binary) and decay.op == "*"):
            raise _fail(decay, "expected the decay `exp(g) * prev`")
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


def _number(node: ir.Node) -> float | None:
    if isinstance(node, ir.Const):
        return node.value
    if isinstance(node, ir.Unary) and node.fn == "neg":
        inner = _number(node.arg)
        return None if inner is None else -inner
    return None


def _elementwise_sympy(node: ir.Node) -> sympy.Expr:
    """An element-wise expression with every load as a symbol named after its tensor."""
    if isinstance(node, ir.Load):
        return sympy.Symbol(node.tensor)
    if isinstance(node, ir.Const):
        value = node.value
        return sympy.Integer(int(value)) if value == int(value) else sympy.Rational(str(value))
    if isinstance(node, ir.Unary):
        arg = _elementwise_sympy(node.arg)
        return -arg if node.fn == "neg" else SYMPY_FUNCTIONS[node.fn](arg)
    if isinstance(node, ir.Binary) and not node.boolean and node.op in "+-*/":
        lhs, rhs = _elementwise_sympy(node.lhs), _elementwise_sympy(node.rhs)
        return {"+": lhs + rhs, "-": lhs - rhs, "*": lhs * rhs, "/": lhs / rhs}[node.op]
    if isinstance(node, ir.Pow):
        return _elementwise_sympy(node.base) ** node.exponent
    raise _fail(node, f"{type(node).__name__} is not supported in a per-token expression of the recurrence family")
