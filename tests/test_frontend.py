"""Every shipped spec reaches verified IR; the IR is typed, printable, and its verifier catches breakage."""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest
import sympy

from ncd import ir
from ncd.pipeline import front_end, load_spec

from .conftest import SPECS

REQUIRED = {
    "spherical_attention", "softmax_attention", "group_rational", "kat_rational", "cheby_kan",
    "legendre_kan", "gka",
}


def test_required_specs_are_shipped():
    assert {p.stem for p in SPECS} >= REQUIRED


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_spec_reaches_verified_ir(path):
    result = load_spec(path)
    program = result.program
    program.verify()
    assert program.name == path.stem
    assert not result.warnings, [w.render() for w in result.warnings]
    axes = {a.name: a for a in program.axes}
    for tensor in program.tensors:  # every wire has an axis and a size
        for axis in tensor.axes:
            assert isinstance(axes[axis].size, sympy.Expr)
    for definition in program.definitions:
        for node in ir.walk(definition.value):
            assert all(a in axes for a in node.axes)
            assert node.span.line > 0 or isinstance(node, ir.Lambda)
    graph = program.graph()
    assert nx.is_directed_acyclic_graph(graph)
    for out in program.outputs:  # every output depends on some input
        assert any(nx.has_path(graph, t.name, out.name) for t in (*program.inputs, *program.params))


def _program(text: str) -> ir.Program:
    return front_end(text, "t.ncd").program


def test_spherical_ir_structure():
    program = load_spec(next(p for p in SPECS if p.stem == "spherical_attention")).program
    s, a, o = program.definitions
    assert isinstance(s.value, ir.Binary) and isinstance(s.value.rhs, ir.Contract)
    assert s.value.rhs.over == ("dim",) and s.value.axes == ("batch", "head", "query", "key")
    assert isinstance(a.value, ir.Normalize) and a.value.over == "key"
    assert isinstance(a.value.a2.body, ir.Pow) and a.value.a2.body.exponent == 2
    assert isinstance(o.value, ir.Contract) and o.value.axes == ("batch", "head", "query", "dim")
    assert program.tensor("O").role == "out" and program.tensor("Q").dtype == "bf16"
    assert program.axis("dim").fixed == 128 and program.axis("key").fixed is None


def test_split_axis_sizes_and_factor_absorption():
    program = load_spec(next(p for p in SPECS if p.stem == "kat_rational")).program
    chan = program.axis("chan")
    assert chan.factors == ("group", "width")
    assert sympy.simplify(chan.size - 8 * program.axis("width").size) == 0
    q = next(d for d in program.definitions if d.tensor == "Q")
    body = next(n for n in ir.walk(q.value) if isinstance(n, ir.FiniteSum))
    assert (body.lo, body.hi) == (1, 4)
    assert q.value.axes == ("row", "chan")  # B[group ...] absorbed into chan


def test_gqa_heads_weave_by_factor():
    program = _program("""
spec gqa
axis batch, query, key, kvhead, qgroup
axis head = kvhead * qgroup
axis dim = 64
in Q[batch head query dim] : f16
in K[batch kvhead key dim] : f16
in V[batch kvhead key dim] : f16
S[batch head query key] = Q . K over dim
A = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z, mask = key <= query)
out O[batch head query dim] = A . V over key
""")
    a = program.definitions[1].value
    assert isinstance(a, ir.Normalize) and isinstance(a.mask, ir.Binary) and a.mask.op == "<="
    assert program.tensor("A").axes == ("batch", "head", "query", "key")


def test_definitions_are_ordered_by_dependency():
    program = _program("""
axis a
in x[a] : f32
out y[a] = z * 2
z[a] = exp(x)
""")
    assert [d.tensor for d in program.definitions] == ["z", "y"]
    assert program.name == "t"


def test_basis_recurrence_in_ir():
    program = load_spec(next(p for p in SPECS if p.stem == "legendre_kan")).program
    (basis,) = program.bases
    assert len(basis.initial) == 2 and basis.step_var == "n"
    assert {t.back for t in ir.walk(basis.step) if isinstance(t, ir.BasisTerm)} == {0, 1}


def test_gka_scan_and_solve():
    program = load_spec(next(p for p in SPECS if p.stem == "gka")).program
    h = next(d for d in program.definitions if d.tensor == "H").value
    assert isinstance(h, ir.Scan) and h.over == "time"
    assert any(isinstance(n, ir.Prev) for n in ir.walk(h.body))
    x = next(d for d in program.definitions if d.tensor == "x").value
    assert isinstance(x, ir.ChebyshevSolve)
    assert (x.row, x.over, x.iterations) == ("kdim", "kcol", 30)


def _replace_definition(program: ir.Program, index: int, value: ir.Node) -> ir.Program:
    defs = list(program.definitions)
    defs[index] = dataclasses.replace(defs[index], value=value)
    return dataclasses.replace(program, definitions=tuple(defs))


def test_verifier_rejects_broken_ir():
    program = load_spec(next(p for p in SPECS if p.stem == "spherical_attention")).program
    program.verify()
    s = program.definitions[0]
    stray = dataclasses.replace(s.value, axes=(*s.value.axes, "nonexistent"))
    with pytest.raises(ir.IRVerificationError, match="undeclared axis"):
        _replace_definition(program, 0, stray).verify()
    out_of_order = dataclasses.replace(program, definitions=tuple(reversed(program.definitions)))
    with pytest.raises(ir.IRVerificationError, match="before it is defined"):
        out_of_order.verify()
    extra_axis = dataclasses.replace(s.value, axes=(*s.value.axes, "dim"))
    with pytest.raises(ir.IRVerificationError, match="lacks"):
        _replace_definition(program, 0, extra_axis).verify()
    missing = dataclasses.replace(program, definitions=program.definitions[:2])
    with pytest.raises(ir.IRVerificationError, match="never defined"):
        missing.verify()


@pytest.mark.parametrize("stage", ["ast", "ir"])
@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_cli_emits_stage(run_cli, path, stage):
    code, out, err = run_cli("compile", str(path), "--emit", stage)
    assert code == 0, err
    if stage == "ir":
        assert out.startswith(f"spec {path.stem}\n")
        assert f"# {path.name}:" in out  # origin comments
    else:
        assert out.startswith("Module ") and "TensorDecl" in out


def test_cli_writes_stages_to_directory(run_cli, tmp_path):
    spec = next(p for p in SPECS if p.stem == "cheby_kan")
    code, out, _ = run_cli("compile", str(spec), "-o", str(tmp_path / "o"), "--emit", "ast", "--emit", "ir")
    assert code == 0
    assert (tmp_path / "o" / "cheby_kan.ir.txt").read_text().startswith("spec cheby_kan")
    assert (tmp_path / "o" / "cheby_kan.ast.txt").exists() and "wrote" in out


def test_cli_check_says_what_it_checks(run_cli):
    # a fixed seed: this tests the report. At random seeds the bf16 case's worst row fails about 1 draw in 20
    # (2 of 40 measured: o 0.13 against 0.098, dalpha 0.26 against 0.20), an open question of GKA's bf16 bounds
    spec = next(p for p in SPECS if p.stem == "gka")
    code, out, _ = run_cli("check", str(spec), "--seed", "1")
    assert code == 0, out
    assert "spec gka" in out and "ok   axes" in out and "ok   numerics" in out and "FAIL" not in out


def test_chebyshev_solve_reference_is_differentiated_as_the_exact_solve():
    """The float64 reference differentiates chebyshev_solve implicitly, as the generated backward does: at
    convergence that is the exact solve's gradient (and autograd through the iterations'); after 5 iterations
    the two differ, and the implicit one is the adjoint system solved by the same 5 iterations."""
    import torch

    from ncd.reference import _ImplicitSolve, chebyshev_iteration

    gen = torch.Generator().manual_seed(0)
    m = torch.randn(3, 6, 6, generator=gen, dtype=torch.float64)
    a = (m @ m.transpose(-1, -2) + 0.5 * torch.eye(6, dtype=torch.float64)).requires_grad_()
    b = torch.randn(3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    eig = torch.linalg.eigvalsh(a.detach())
    mu, lip = eig[:, :1], eig[:, -1:]
    dx = torch.randn(3, 6, generator=gen, dtype=torch.float64)

    def rel(x, y):
        return float((x - y).norm() / y.norm())

    exact = torch.autograd.grad(torch.linalg.solve(a, b.unsqueeze(-1)).squeeze(-1), (a, b), dx)
    converged = torch.autograd.grad(_ImplicitSolve.apply(a, b, mu, lip, 200), (a, b), dx)
    assert max(rel(g, e) for g, e in zip(converged, exact, strict=True)) < 1e-12
    implicit = torch.autograd.grad(_ImplicitSolve.apply(a, b, mu, lip, 5), (a, b), dx)
    unrolled = torch.autograd.grad(chebyshev_iteration(a, b, mu, lip, 5), (a, b), dx)
    assert rel(implicit[0], unrolled[0]) > 0.1
    z = chebyshev_iteration(a.detach(), dx, mu, lip, 5)
    x = chebyshev_iteration(a.detach(), b.detach(), mu, lip, 5)
    assert rel(implicit[1], z) < 1e-14 and rel(implicit[0], -z.unsqueeze(-1) * x.unsqueeze(-2)) < 1e-14


def test_cli_check_of_a_short_chebyshev_solve(run_cli, tmp_path):
    """A user's GKA spec with 3 Chebyshev iterations. Its backward is implicit differentiation (the official
    kernels'), which is not autograd through 3 iterations: `ncd check` holds it to the same definition, passes,
    and says how far autograd through the iterations is (it failed the gradient check before)."""
    import re

    text = next(p for p in SPECS if p.stem == "gka").read_text()
    for old, new in (("spec gka", "spec gka_short"), ("kdim = 128", "kdim = 16"), ("vdim = 128", "vdim = 12"),
                     ("ridge = 0.02", "ridge = 0.1"), ("iterations = 30 ", "iterations = 3 ")):
        assert old in text
        text = text.replace(old, new)
    (tmp_path / "gka_short.ncd").write_text(text)
    code, out, _ = run_cli("check", str(tmp_path / "gka_short.ncd"))
    assert code == 0 and "ok   numerics" in out and "FAIL" not in out, out
    gap = re.search(r"chebyshev_solve \(3 iterations\) .* differs from that by up to (\S+) \((d\w+)\)", out)
    assert gap is not None and float(gap.group(1)) > 2e-2, out  # above the gradient tolerance


def test_cli_version_and_usage(run_cli):
    code, out, _ = run_cli("--version")
    assert code == 0 and out.startswith("ncd ")
    assert run_cli("compile")[0] == 2
    assert run_cli("frobnicate")[0] == 2
    code, _, err = run_cli("check", "/nonexistent/x.ncd")
    assert code == 2 and "cannot read" in err
