"""The streamability pass: certificates derived symbolically, and located rejections with reasons."""

from __future__ import annotations

import pytest
import sympy

from ncd.errors import NotStreamable
from ncd.pipeline import front_end, load_spec
from ncd.streaming import Rescale, X, Z, certify, derive_rescale

from .conftest import SPECS

BASE = """spec t
axis batch, head, query, key
axis dim = 64
in Q[batch head query dim] : f32
in K[batch head key dim] : f32
in V[batch head key dim] : f32
S[batch head query key] = Q . K over dim
"""


def _certificate(body: str):
    program = front_end(BASE + body + "\nout O[batch head query dim] = A . V over key\n", "t.ncd").program
    (cert,) = certify(program)
    return cert


def _rejection(body: str) -> NotStreamable:
    with pytest.raises(NotStreamable) as info:
        _certificate(body)
    return info.value


def _spec(stem: str):
    return load_spec(next(p for p in SPECS if p.stem == stem)).program


def test_spherical_streams_with_two_additive_accumulators():
    (cert,) = certify(_spec("spherical_attention"))
    assert (cert.a1, cert.a2, cert.b) == (X, X**2, sympy.sqrt(Z))
    assert cert.rescale is None and cert.state == ("o", "z")
    d = cert.derivatives()
    assert sympy.simplify(d["da2"] - 2 * X) == 0 and sympy.simplify(d["db_over_b"] - 1 / (2 * Z)) == 0
    assert cert.axis == "key" and cert.output == "O"


def test_softmax_derives_the_running_max():
    (cert,) = certify(_spec("softmax_attention"))
    assert cert.rescale == Rescale(1, 1)
    assert cert.state == ("m", "o", "z")
    assert str(cert.scale) == "scale"  # the scalar input scales the score, applied in the kernel


def test_bounded_normaliser_needs_neither_rescale_nor_special_case():
    cert = _certificate("A = normalize(S, over key, a1(x) = sigmoid(x), a2(x) = sigmoid(x), b(z) = z)")
    assert cert.rescale is None
    assert sympy.simplify(cert.a1 - 1 / (1 + sympy.exp(-X))) == 0


def test_spelled_out_softmax_is_separated_into_a1_and_b():
    cert = _certificate("E = exp(S)\nA = E / sum(E, over key)")
    assert sympy.simplify(cert.a1 - sympy.exp(X)) == 0 and sympy.simplify(cert.a2 - sympy.exp(X)) == 0
    assert cert.b == Z and cert.rescale == Rescale(1, 1)


def test_spelled_out_spherical_and_prescaled_exponential():
    cert = _certificate("A = S / sqrt(sum(S^2, over key))")
    assert (cert.a1, cert.a2, cert.b, cert.rescale) == (X, X**2, sympy.sqrt(Z), None)
    cert = _certificate("A = normalize(S, over key, a1(x) = exp(2*x), a2(x) = exp(4*x), b(z) = sqrt(z))")
    assert cert.rescale == Rescale(2, 4)


def test_pre_map_composes_into_a1_and_a2():
    cert = _certificate("A = normalize(tanh(S), over key, a1(x) = x, a2(x) = abs(x), b(z) = z)")
    assert cert.a1 == sympy.tanh(X) and cert.a2 == sympy.Abs(sympy.tanh(X))
    cert = _certificate("A = normalize(max(S, 0), over key, a1(x) = x, a2(x) = x, b(z) = z)")
    assert cert.a1 == sympy.Max(X, 0) and cert.rescale is None


@pytest.mark.parametrize(
    ("body", "line", "col", "reason"),
    [
        ("A = (S - sum(S, over key))^2", 8, 5, "a1 depends on the aggregate"),
        ("A = S / max(S, over key)", 8, 9, "not a function of a sum"),
        ("A = S / sum(S, over key) / sum(S^2, over key)", 8, 28, "combines 2 aggregates"),
        ("A = normalize(S, over key, a1(x) = exp(2*x), a2(x) = exp(x), b(z) = z)", 8, 5,
         "not homogeneous of degree 2"),
        ("A = normalize(S, over key, a1(x) = exp(x), a2(x) = x^2, b(z) = z)", 8, 5,
         "a1 grows exponentially but the other does not"),
        ("A = normalize(S - sum(S, over key), over key, a1(x) = x, a2(x) = x^2, b(z) = sqrt(z))", 8, 19,
         "is not an element-wise map of one score"),
    ],
    ids=["aggregate-inside-a1", "max-normaliser", "two-aggregates", "b-not-homogeneous", "one-exponential",
         "non-elementwise-premap"],
)
def test_rejections_name_the_operation_and_reason(body, line, col, reason):
    err = _rejection(body)
    assert reason in err.message
    assert (err.span.line, err.span.col) == (line, col)


def test_derive_rescale_cases():
    assert derive_rescale(X, X**2, sympy.sqrt(Z)) is None
    assert derive_rescale(sympy.exp(X), sympy.exp(X), Z) == Rescale(1, 1)
    assert "homogeneous" in derive_rescale(sympy.exp(X), sympy.exp(X), sympy.log(Z))


def test_non_attention_specs_have_no_certificate():
    for stem in ("kat_rational", "cheby_kan", "gka"):
        assert certify(_spec(stem)) == []


def test_cli_plan_shows_certificate_and_cost(run_cli):
    spec = next(p for p in SPECS if p.stem == "softmax_attention")
    code, out, err = run_cli("compile", str(spec), "--emit", "plan", "--bind", "query=1024", "--bind", "key=1024")
    assert code == 0, err
    assert "online max" in out and "saved per row: m, z" in out
    assert "HBM" in out and "L2->SMEM" in out and "registers" in out and "roofline" in out
    assert "query=1024" in out and "autotune set" in out


def test_cli_falls_back_from_non_streamable_with_location(run_cli, tmp_path):
    """Attention recognises the contraction but cannot stream it: the generic family compiles it, and both the
    plan and a note on stderr say where and why attention declined."""
    spec = tmp_path / "bad.ncd"
    spec.write_text(BASE + "A = (S - sum(S, over key))^2\nout O[batch head query dim] = A . V over key\n")
    code, out, err = run_cli("compile", str(spec), "--emit", "plan")
    assert code == 0, err
    assert out.startswith("family: generic")
    assert "declined by attention: bad.ncd:8:5: recognised, but:" in out and "a1 depends on the aggregate" in out
    assert "ncd: note: attention: bad.ncd:8:5:" in err and "compiled by the generic family" in err
    assert "Traceback" not in err
    code, _, err = run_cli("compile", str(spec), "--bind", "key")
    assert code == 2 and "AXIS=SIZE" in err
