"""Gated KalmaNet variants compiled by the recurrence family's kernels: the covariance H with a gate of its own or
none (the official layer's use_forgetting_gate_kk=False), U ungated, no gates at all, and a ridge with a constant
term (lambda = a ||H|| + b) or a constant alone. Each against the float64 per-token recurrence (naive_gka), in the
interpreter: forward, final states and every gradient, decoding after a chunked prefill, non-finite gates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ncd
from ncd.backend import FallbackWarning
from ncd.errors import CallError
from ncd.families.recurrence.reference import naive_gka

from .conftest import ROOT, raise_float_errors
from .test_gka import rms_ratio, worst_token

K, V = 16, 12
BASE = (ROOT / "specs" / "gka.ncd").read_text()
H_SCAN = "H[batch time head kdim kcol] = scan(exp(g) * prev"
U_SCAN = "U[batch time head vdim kdim] = scan(exp(g) * prev"
G_DECL = "in  g[batch time head] : f32\n"
LAM = "lam[batch time head] = ridge * normH"
SOLVE = "chebyshev_solve(H + lam * where(kdim == kcol, 1, 0), q, over kcol,"
BOUNDS = "mu = lam, L = normH + lam)"

# name -> (replacements of specs/gka.ncd, the op argument that gates H (None: ungated), the ridge, its offset)
VARIANTS = {
    "ungated_covariance": ([(H_SCAN, H_SCAN.replace("exp(g) * prev", "prev"))], None, 0.02, 0.0),
    "own_covariance_gate": ([(G_DECL, G_DECL + "in  gk[batch time head] : f32\n"),
                             (H_SCAN, H_SCAN.replace("exp(g)", "exp(gk)"))], "gk", 0.02, 0.0),
    "covariance_gate_only": ([(U_SCAN, U_SCAN.replace("exp(g) * prev", "prev"))], "gk", 0.02, 0.0),
    "ungated": ([(G_DECL, ""), (H_SCAN, H_SCAN.replace("exp(g) * prev", "prev")),
                 (U_SCAN, U_SCAN.replace("exp(g) * prev", "prev"))], None, 0.02, 0.0),
    "ridge_offset": ([(LAM, LAM + " + 0.3")], "g", 0.02, 0.3),
    "constant_ridge": ([(LAM + "\n", ""), (SOLVE, SOLVE.replace("lam *", "0.5 *")),
                        (BOUNDS, "mu = 0.5, L = normH + 0.5)")], "g", 0.0, 0.5),
}


def variant_text(name: str) -> str:
    text = BASE
    for old, new in VARIANTS[name][0]:
        assert old in text, old
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def variant_ops(tmp_path_factory):
    """One op per variant, IEEE fp32 products (the interpreter's arithmetic then shows the algorithm's error)."""
    folder = tmp_path_factory.mktemp("gka_variants")
    ops = {}
    for name in VARIANTS:
        path = folder / f"gka_{name}.ncd"
        path.write_text(variant_text(name))
        ops[name] = ncd.load(path, sizes={"kdim": K, "vdim": V}).with_config(dot_precision="ieee")
    return ops


def draw(B=1, T=37, H=2, seed=0):  # T 37: three chunks of 16, the last one partial
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3.0)
    gk = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 1.0)  # decays faster than g: the two differ
    b = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    a = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return {"q": q, "k": k, "v": v, "g": g, "gk": gk, "beta": b, "alpha": a}


def op_gates(name: str, x: dict) -> dict:
    """The op's gate arguments for variant `name`: g (U's gate; None where U is ungated) and gk (H's, where the
    spec gives H a gate of its own: the spec's g where it gates H alone)."""
    if name == "own_covariance_gate":
        return {"g": x["g"], "gk": x["gk"]}
    if name == "covariance_gate_only":
        return {"g": None, "gk": x["g"]}
    if name == "ungated":
        return {"g": None}
    return {"g": x["g"]}


def naive_gates(name: str, gates: dict) -> dict:
    """naive_gka's g and gk from the op's gate arguments."""
    h_gate = VARIANTS[name][1]
    return {"g": gates.get("g"), "gk": gates.get(h_gate) if h_gate else None}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_forward_states_and_every_gradient_match_the_naive_recurrence(variant_ops, name):
    module = variant_ops[name].module
    x = draw()
    B, H = 1, 2
    h0 = torch.randn(B, H, K, K, generator=torch.Generator().manual_seed(1))
    h0 = h0 @ h0.transpose(-1, -2) * 0.05  # a covariance: symmetric positive semi-definite
    s0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(2)) * 0.1
    gates = op_gates(name, x)
    leaves = {n: t.clone().requires_grad_() for n, t in
              {"q": x["q"], "k": x["k"], "v": x["v"], "beta": x["beta"], "alpha": x["alpha"], "h0": h0, "s0": s0,
               **{n: t for n, t in gates.items() if t is not None}}.items()}
    lg = {n: leaves[n] if t is not None else None for n, t in gates.items()}
    with raise_float_errors():
        o, (h_fin, s_fin) = module.chunk(leaves["q"], leaves["k"], leaves["v"], lg.pop("g"), leaves["beta"],
                                         initial_state=(leaves["h0"], leaves["s0"]), output_final_state=True,
                                         alpha=leaves["alpha"], chunk_size=16, **lg)
    gen = torch.Generator().manual_seed(3)
    do, dh, ds = (torch.randn(t.shape, generator=gen) for t in (o, h_fin, s_fin))
    grads = torch.autograd.grad((o * do).sum() + (h_fin * dh).sum() + (s_fin * ds).sum(), list(leaves.values()))

    ref_leaves = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    by_role = naive_gates(name, ref_leaves)
    _, _, ridge, offset = VARIANTS[name]
    ref, (h_ref, s_ref) = naive_gka(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], by_role["g"],
                                    ref_leaves["beta"], ref_leaves["alpha"], gk=by_role["gk"], ridge=ridge,
                                    ridge_offset=offset, initial_state=(ref_leaves["h0"], ref_leaves["s0"]))
    ref_grads = torch.autograd.grad((ref * do.double()).sum() + (h_ref * dh.double()).sum()
                                    + (s_ref * ds.double()).sum(), list(ref_leaves.values()))
    assert rms_ratio(o, ref) < 1e-4 and worst_token(o, ref) < 1e-3, name
    assert rms_ratio(h_fin, h_ref) < 1e-5 and rms_ratio(s_fin, s_ref) < 1e-5
    for leaf, got, want in zip(leaves, grads, ref_grads, strict=True):
        assert rms_ratio(got, want) <= 0.02, (name, leaf)
    assert rms_ratio(grads[0], ref_grads[0]) < 1e-5  # dq: exact for Chebyshev (implicit == autograd)


def test_the_states_gates_enter_where_each_state_is_read(variant_ops):
    """The gradients of each gate are not mixed up: H's gate moves only what H reaches. With U ungated and H gated
    (`covariance_gate_only`), the final U does not depend on the gate (its gradient from dS alone is 0), and the
    final H does (its gradient from dH alone is not)."""
    module = variant_ops["covariance_gate_only"].module
    x = draw(T=21)
    gk = x["g"].clone().requires_grad_()
    _, (h_fin, s_fin) = module.chunk(x["q"], x["k"], x["v"], None, x["beta"], alpha=x["alpha"], gk=gk,
                                     output_final_state=True, chunk_size=16)
    (from_s,) = torch.autograd.grad(s_fin.sum(), gk, retain_graph=True)
    (from_h,) = torch.autograd.grad(h_fin.sum(), gk)
    assert torch.equal(from_s, torch.zeros_like(from_s))
    assert from_h.abs().max() > 1e-3


def test_one_gate_given_twice_equals_the_shared_gate(variant_ops):
    """The spec with a gate of H's own, called with H's gate equal to U's, gives the shared-gate spec's output and
    states (the same kernels with each state's gate read apart) and, summed, its gate gradient."""
    own, shared = variant_ops["own_covariance_gate"].module, variant_ops["ridge_offset"].module
    x = draw(T=21)
    g1, g2, g3 = (x["g"].clone().requires_grad_() for _ in range(3))
    o1, (h1, s1) = own.chunk(x["q"], x["k"], x["v"], g1, x["beta"], alpha=x["alpha"], gk=g2,
                             output_final_state=True, chunk_size=16, ridge_offset=0.3)
    o2, (h2, s2) = shared.chunk(x["q"], x["k"], x["v"], g3, x["beta"], alpha=x["alpha"], output_final_state=True,
                                chunk_size=16)
    assert torch.equal(o1, o2) and torch.equal(h1, h2) and torch.equal(s1, s2)
    do = torch.randn(o1.shape, generator=torch.Generator().manual_seed(4))
    d1 = torch.autograd.grad((o1 * do).sum(), (g1, g2))
    (d2,) = torch.autograd.grad((o2 * do).sum(), g3)
    assert rms_ratio(d1[0] + d1[1], d2) < 1e-5
    assert rms_ratio(d1[1], d2) > 1e-2  # H's share alone is not the whole gradient


@pytest.mark.parametrize("name", ["own_covariance_gate", "covariance_gate_only", "constant_ridge"])
def test_variant_decoding_continues_a_chunked_prefill(variant_ops, name):
    module = variant_ops[name].module
    x = draw(T=40)
    gates = op_gates(name, x)
    first = {n: (t[:, :29] if t is not None else None) for n, t in gates.items()}
    common = dict(alpha=x["alpha"])
    full, (h_full, s_full) = module.chunk(x["q"], x["k"], x["v"], gates.pop("g"), x["beta"], output_final_state=True,
                                          chunk_size=16, **common, **gates)
    _, state = module.chunk(x["q"][:, :29], x["k"][:, :29], x["v"][:, :29], first.pop("g"), x["beta"][:, :29],
                            alpha=x["alpha"][:, :29], output_final_state=True, chunk_size=16, **first)
    rest = {n: (t[:, 29:] if t is not None else None) for n, t in op_gates(name, x).items()}
    o, state = module.recurrent(x["q"][:, 29:], x["k"][:, 29:], x["v"][:, 29:], rest.pop("g"), x["beta"][:, 29:],
                                initial_state=state, alpha=x["alpha"][:, 29:], **rest)
    assert rms_ratio(o, full[:, 29:]) < 1e-5
    assert rms_ratio(state[0], h_full) < 1e-5 and rms_ratio(state[1], s_full) < 1e-5
    ref_gates = naive_gates(name, {n: t.double() for n, t in op_gates(name, x).items() if t is not None})
    ref, _ = naive_gka(*(x[n].double() for n in ("q", "k", "v")), ref_gates["g"], x["beta"].double(),
                       x["alpha"].double(), gk=ref_gates["gk"], ridge=VARIANTS[name][2],
                       ridge_offset=VARIANTS[name][3])
    assert rms_ratio(full, ref) < 1e-4


def test_a_non_finite_covariance_gate_poisons_what_it_reaches(variant_ops):
    module = variant_ops["own_covariance_gate"].module
    x = draw(B=2, T=40)
    gk = x["gk"].clone()
    gk[1, 20, 0] = float("nan")
    gk[0, 5, 1] = float("inf")
    gk[0, 9, 0] = float("-inf")  # a full reset of H: legal
    o, (h_fin, _) = module.chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], alpha=x["alpha"], gk=gk,
                                 output_final_state=True, chunk_size=16)
    nan_rows = torch.isnan(o).any(-1)
    expected = torch.zeros_like(nan_rows)
    expected[1, 20:, 0] = True
    expected[0, 5:, 1] = True
    assert torch.equal(nan_rows, expected)
    assert torch.isnan(o[nan_rows]).all() and torch.isfinite(o[~nan_rows]).all()
    assert torch.isnan(h_fin[1, 0]).all() and torch.isfinite(h_fin[0, 0]).all() and torch.isfinite(h_fin[1, 1]).all()


def test_variant_calls_check_their_gates_and_ridge(variant_ops):
    x = draw(B=1, T=5)
    own, ungated = variant_ops["own_covariance_gate"].module, variant_ops["ungated"].module
    args = (x["q"], x["k"], x["v"])
    with pytest.raises(CallError, match="gk must be a tensor"):
        own.chunk(*args, x["g"], x["beta"], alpha=x["alpha"])
    with pytest.raises(CallError, match="the spec has no gk input"):
        variant_ops["ungated_covariance"].module.chunk(*args, x["g"], x["beta"], alpha=x["alpha"], gk=x["gk"])
    with pytest.raises(CallError, match="the spec has no g input"):
        ungated.chunk(*args, x["g"], x["beta"], alpha=x["alpha"])
    with pytest.raises(CallError, match=r"gk.*time"):
        own.chunk(*args, x["g"], x["beta"], alpha=x["alpha"], gk=x["gk"][:, :4])
    with pytest.raises(CallError, match="ridge and ridge_offset must be >= 0 and not both 0"):
        variant_ops["constant_ridge"].module.chunk(*args, x["g"], x["beta"], alpha=x["alpha"], ridge_offset=0.0)
    o = getattr(own, own.NAME)(x["q"], x["k"], x["v"], x["g"], x["gk"], x["beta"], x["alpha"])  # the spec's order
    ref, _ = own.chunk(*args, x["g"], x["beta"], alpha=x["alpha"], gk=x["gk"])
    assert torch.equal(o, ref)
    o = getattr(ungated, ungated.NAME)(*args, x["beta"], x["alpha"])  # no gate among the spec's inputs
    ref, _ = ungated.chunk(*args, None, x["beta"], alpha=x["alpha"])
    assert torch.equal(o, ref)
    h_only = variant_ops["covariance_gate_only"].module  # the spec's g gates H alone: the op's gk
    o = getattr(h_only, h_only.NAME)(*args, x["g"], x["beta"], x["alpha"])
    ref, _ = h_only.chunk(*args, None, x["beta"], alpha=x["alpha"], gk=x["g"])
    assert torch.equal(o, ref)


def test_plans_state_each_variant(variant_ops):
    from ncd.backend import plan

    texts = {}
    for name in ("ungated_covariance", "own_covariance_gate", "constant_ridge"):
        texts[name] = "\n".join(plan(variant_ops[name].front).describe())
        assert "kernel family: gated outer-product recurrence with a ridge solve" in texts[name]
    assert "log gates g of U, - (H ungated) of H" in texts["ungated_covariance"]
    assert "sum_s 1 kb_s kb_s^T" in texts["ungated_covariance"]
    assert "log gates g of U, gk of H" in texts["own_covariance_gate"]
    assert "sum_s exp(Gk_t - Gk_s) kb_s kb_s^T" in texts["own_covariance_gate"]
    assert "lambda_t = 0.5,  rho_t" in texts["constant_ridge"] and "an omega schedule per token" in \
        texts["constant_ridge"]


@pytest.mark.parametrize("name", ["ridge_offset", "constant_ridge"])
def test_few_steps_follow_each_tokens_chebyshev_schedule(variant_ops, name):
    """With a ridge offset the contraction rate differs per token; after 3 steps (far from converged) the chunked
    and the decoding kernels still equal the float64 iteration, so each token's schedule is the spec's."""
    module = variant_ops[name].module
    x = draw(T=21)
    _, _, ridge, offset = VARIANTS[name]
    ref, _ = naive_gka(*(x[n].double() for n in ("q", "k", "v", "g", "beta", "alpha")), ridge=ridge,
                       ridge_offset=offset, num_iter=3)
    converged, _ = naive_gka(*(x[n].double() for n in ("q", "k", "v", "g", "beta", "alpha")), ridge=ridge,
                             ridge_offset=offset, exact=True)
    o, _ = module.chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], alpha=x["alpha"], chunk_size=16, num_iter=3)
    step, _ = module.recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], alpha=x["alpha"], num_iter=3)
    assert rms_ratio(o, ref) < 1e-5 and rms_ratio(step, ref) < 1e-5
    assert rms_ratio(ref, converged) > 1e-3  # 3 steps are not the solution: the schedule shows


def test_public_op_and_layer_leave_the_covariance_ungated_when_asked(monkeypatch):
    """`chunk_gka(..., gate_covariance=False)` and `recurrent_gka` compile specs/gka_ungated_covariance.ncd (H
    ungated, as the official layer's use_forgetting_gate_kk=False), and the layer's option reaches them."""
    from ncd import layers

    x = draw(T=21)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    exact = {"dot_precision": "ieee"}
    o, _ = ncd.ops.chunk_gka(*args, alpha=x["alpha"], gate_covariance=False, chunk_size=16, config=exact)
    ref, _ = naive_gka(*(t.double() for t in args), x["alpha"].double(), gk=None)
    assert rms_ratio(o, ref) < 1e-4
    step, _ = ncd.ops.recurrent_gka(*args, alpha=x["alpha"], gate_covariance=False, config=exact)
    assert rms_ratio(step, ref) < 1e-4

    torch.manual_seed(0)
    layer = layers.GatedKalmaNet(hidden_size=2 * K, num_heads=2, num_iter=12, chunk_size=16,
                                 use_forgetting_gate_kk=False)
    seen = []

    def core(*a, gate_covariance=True, **kw):
        seen.append(gate_covariance)
        return ncd.ops.chunk_gka(*a, gate_covariance=gate_covariance, **kw, config=exact)

    monkeypatch.setattr(layers, "chunk_gka", core)
    h = torch.randn(2, 21, 2 * K, requires_grad=True)
    y = layer(h)
    y.square().mean().backward()
    assert seen == [False] and torch.isfinite(h.grad).all() and torch.isfinite(layer.A_log.grad).all()
    layer.use_forgetting_gate_kk = True
    assert rms_ratio(layer(h), y) > 1e-3 and seen == [False, True]  # the covariance's gate changes the output


GQA = BASE.replace("axis batch, time, head", "axis batch, time, kvhead, qgroup\naxis head = kvhead * qgroup").replace(
    "in  k[batch time head kdim]", "in  k[batch time kvhead kdim]").replace(
    "in  v[batch time head vdim]", "in  v[batch time kvhead vdim]")


def test_gqa_keys_and_values_serve_their_group_of_query_heads(tmp_path):
    """`axis head = kvhead * qgroup` with k, v on kvhead (the official layer's num_k_heads, num_v_heads): query head
    h reads key/value head h // qgroup. Output, final states and decoding equal the plain spec's on repeated keys
    and values, dk and dv are the group sums of its gradients, and a wrong head count is refused by name."""
    assert GQA.count("kvhead") == 4
    spec = tmp_path / "gka_gqa.ncd"
    spec.write_text(GQA)
    gqa = ncd.load(spec, sizes={"kdim": K, "vdim": V}).with_config(dot_precision="ieee").module
    plain = ncd.load(ROOT / "specs" / "gka.ncd", sizes={"kdim": K, "vdim": V}).with_config(
        dot_precision="ieee").module
    x = draw(T=21, H=4)
    k, v = (x[n][:, :, :2].clone().requires_grad_() for n in ("k", "v"))  # two key/value heads, groups of two
    k_rep, v_rep = (t.detach().repeat_interleave(2, 2).requires_grad_() for t in (k, v))
    rest = (x["g"], x["beta"])
    o, (h, s) = gqa.chunk(x["q"], k, v, *rest, alpha=x["alpha"], output_final_state=True, chunk_size=16)
    ref, (h_ref, s_ref) = plain.chunk(x["q"], k_rep, v_rep, *rest, alpha=x["alpha"], output_final_state=True,
                                      chunk_size=16)
    assert torch.equal(o, ref) and torch.equal(h, h_ref) and torch.equal(s, s_ref)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5))
    dk, dv = torch.autograd.grad((o * do).sum(), (k, v))
    dk_ref, dv_ref = torch.autograd.grad((ref * do).sum(), (k_rep, v_rep))
    torch.testing.assert_close(dk, dk_ref.unflatten(2, (2, 2)).sum(3))
    torch.testing.assert_close(dv, dv_ref.unflatten(2, (2, 2)).sum(3))
    with torch.no_grad():
        step, _ = gqa.recurrent(x["q"], k, v, *rest, alpha=x["alpha"])
    assert rms_ratio(step, ref) < 1e-5
    three = {n: t[:, :, :3] for n, t in x.items()}  # 3 query heads over 2 key heads
    with pytest.raises(CallError, match="kvhead"):
        gqa.chunk(three["q"], x["k"], x["v"], three["g"], three["beta"], alpha=three["alpha"])
    head_first = GQA.replace("[batch time head", "[batch head time").replace("[batch time kvhead", "[batch kvhead time")
    path = tmp_path / "gka_gqa_head_first.ncd"
    path.write_text(head_first)
    with pytest.warns(FallbackWarning, match=r"gka_gqa_head_first.ncd:\d+:\d+: .*in fla's layout only"):
        ncd.load(path)
