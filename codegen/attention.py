"""Code generation for normalized-contraction attention kernels (forward + backward).

The compiler's passes lower a spec to an :class:`AttentionKernelSpec` (strings of Triton
expressions for the scalar maps a1, a2, b and their derivatives, plus a few flags), and
:func:`render_attention_module` splices them into ``templates/attention.py.jinja``, which renders
one self-contained Python module holding the Triton kernels, host launchers and a
``torch.autograd.Function``.

The maths (``s_ij = scale * q_i . k_j``, optional causal mask, optional per-key weight ``w_j``)::

    z_i     = sum_j w_j a2(s_ij)
    o_i     = sum_j w_j a1(s_ij) v_j / b(z_i)
    dV_j    = sum_i w_j a1(s_ij) / b(z_i) dO_i
    delta_i = (dO_i . o_i) b'(z_i) / b(z_i)
    dS_ij   = w_j [a1'(s_ij) (dO_i . v_j) / b(z_i) - a2'(s_ij) delta_i]
    dQ      = scale dS K,  dK = scale dS^T Q

With ``online_max`` the kernels evaluate a1, a2 at ``s - m`` for a running row max ``m`` (valid
when a1, a2 are exponentials and b is homogeneous of the matching degree) and rescale the
accumulators by ``a1(m_old - m_new)`` and ``a2(m_old - m_new)``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

import jinja2

from ncd.factorize import Factorization

TEMPLATE_NAME = "attention.py.jinja"

# Origin labels with a fixed place in the generated code; any other label is listed in the header.
ORIGIN_SITES = ("a1", "a2", "da1", "da2", "b", "db_over_b", "online_max", "causal", "weight", "scale", "factorized",
                "pre", "dpre")
CHUNKED_TEMPLATE_NAME = "attention_chunked.py.jinja"

# Names an expression may use besides its free variable.
_ALLOWED_NAMES = {"tl", "math"}


class AttentionSpecError(ValueError):
    """An :class:`AttentionKernelSpec` that cannot be rendered."""


def _check_expression(field: str, text: str, var: str) -> None:
    if "\n" in text or "\r" in text:
        raise AttentionSpecError(f"{field}: expression must be a single line, got {text!r}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise AttentionSpecError(f"{field}: not a Python expression: {text!r} ({exc.msg})") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in _ALLOWED_NAMES and node.id != var:
            raise AttentionSpecError(
                f"{field}: unknown name {node.id!r} in {text!r}; only {var!r}, 'tl' and 'math' may appear"
            )
        if isinstance(node, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
            raise AttentionSpecError(f"{field}: unsupported construct in {text!r}")


def _same_expression(text: str, other: str) -> bool:
    """Equal as Python expressions (spacing and redundant parentheses ignored)."""
    return ast.dump(ast.parse(text.strip(), mode="eval")) == ast.dump(ast.parse(other, mode="eval"))


def _uses_name(text: str, var: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == var for n in ast.walk(ast.parse(text, mode="eval")))


@dataclass(frozen=True)
class AttentionKernelSpec:
    """What the compiler fills in for one normalized-contraction attention kernel.

    Expressions are Triton expressions in the fp32 tile variable ``x`` (a1, a2, da1, da2) or the
    fp32 row-vector variable ``z`` (b, db_over_b); they may use ``tl`` and ``math``.
    """

    name: str  # python identifier used in kernel names
    a1: str  # e.g. "x", "x * x", "tl.exp(x)", "tl.sigmoid(x)", "tl.abs(x)"
    a2: str
    da1: str  # derivative of a1 w.r.t. x
    da2: str
    b: str  # e.g. "tl.sqrt(z)" or "z"
    db_over_b: str  # b'(z) / b(z), e.g. "0.5 / z" or "1.0 / z"
    online_max: bool  # running-max rescaling (softmax-like)
    causal: bool  # key j visible to query i iff j <= i
    has_weight: bool  # per-key multiplicity w[batch, key] (fp32) multiplies both sums
    origin: tuple[tuple[str, str], ...] = ()  # (label, "spec.ncd:LINE") pairs
    # forward autotune set (BLOCK_M, BLOCK_N, num_warps, num_stages), from the plan's cost ranking;
    # empty: the template's measured default list
    forward_configs: tuple[tuple[int, int, int, int], ...] = ()
    # stabiliser pre-map t = pre(s) of the scaled score and its derivative (the maps a1, a2 take t; the backward
    # multiplies dS by dpre(s)); "" when a1, a2 take s itself
    pre: str = ""
    dpre: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise AttentionSpecError(f"name must be a Python identifier, got {self.name!r}")
        for field in ("a1", "a2", "da1", "da2"):
            _check_expression(field, getattr(self, field), "x")
        for field in ("b", "db_over_b"):
            _check_expression(field, getattr(self, field), "z")
        if bool(self.pre) != bool(self.dpre):
            raise AttentionSpecError("pre and dpre come together")
        for field in ("pre", "dpre"):
            if getattr(self, field):
                _check_expression(field, getattr(self, field), "x")
        for config in self.forward_configs:
            if len(config) != 4 or not all(isinstance(v, int) and v > 0 for v in config):
                raise AttentionSpecError(f"forward configs are 4 positive ints, got {config!r}")
        for pair in self.origin:
            if len(pair) != 2 or not all(isinstance(p, str) and "\n" not in p for p in pair):
                raise AttentionSpecError(f"origin entries must be (label, location) string pairs: {pair!r}")


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _templates_loader() -> jinja2.BaseLoader:
    """Templates load as package resources (`ncd.templates`), the same from a checkout, an editable install or
    a wheel."""
    from importlib.resources import files

    return jinja2.FunctionLoader(lambda name: files("ncd.templates").joinpath(name).read_text("utf-8"))


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=_templates_loader(),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def _device_function(fn_name: str, var: str, expr: str, doc: str) -> dict[str, str]:
    """One tiny ``@triton.jit`` function ``fn_name(var) -> expr``; constants are broadcast to var's shape."""
    body = expr if _uses_name(expr, var) else f"tl.full({var}.shape, {expr}, tl.float32)"
    return {"name": fn_name, "var": var, "body": body, "doc": doc}


def _origins(spec: AttentionKernelSpec) -> tuple[dict[str, list[str]], Callable[[str], str]]:
    origin: dict[str, list[str]] = {}
    for label, loc in spec.origin:
        origin.setdefault(label, []).append(loc)

    def origin_comment(label: str) -> str:
        locs = origin.get(label)
        return f"  # {', '.join(locs)}" if locs else ""

    return origin, origin_comment


def render_attention_module(spec: AttentionKernelSpec, factorization: Factorization | None = None) -> str:
    """Render the generated Python module (source text) for ``spec``; with ``factorization`` (a1, a2
    polynomials of degree <= 1, <= 2) the module also holds the factorized form's kernels
    (``templates/attention_chunked.py.jinja``): ``forward_factorized`` / ``backward_factorized``."""
    origin, origin_comment = _origins(spec)

    prefix = f"_{spec.name}"
    same_a = spec.a1.strip() == spec.a2.strip() and spec.da1.strip() == spec.da2.strip()
    # a1 = a2 = a1' = a2' = exp with the running max: the kernels evaluate exp2 with log2(e) folded into the
    # scale (one FFMA and one MUFU.EX2 per score) instead of the spliced tl.exp.
    # (not with a pre-map: the score goes through h before the exponential)
    exp2 = spec.online_max and not spec.pre and all(
        _same_expression(getattr(spec, f), "tl.exp(x)") for f in ("a1", "a2", "da1", "da2"))
    functions = [
        _device_function(f"{prefix}_a1", "x", spec.a1, "a1: numerator map"),
        _device_function(f"{prefix}_a2", "x", spec.a2, "a2: normaliser map"),
        _device_function(f"{prefix}_da1", "x", spec.da1, "a1'"),
        _device_function(f"{prefix}_da2", "x", spec.da2, "a2'"),
        _device_function(f"{prefix}_b", "z", spec.b, "b: applied to the row normaliser z"),
        _device_function(f"{prefix}_db_over_b", "z", spec.db_over_b, "b'(z) / b(z)"),
    ]
    labels = ["a1", "a2", "da1", "da2", "b", "db_over_b"]
    if spec.pre:
        functions += [_device_function(f"{prefix}_pre", "x", spec.pre, "h: stabiliser pre-map of the score"),
                      _device_function(f"{prefix}_dpre", "x", spec.dpre, "h'")]
        labels += ["pre", "dpre"]
    for fn, label in zip(functions, labels, strict=True):
        fn["origin"] = origin_comment(label)
    other_origins = [(label, locs) for label, locs in origin.items() if label not in ORIGIN_SITES]

    template = _environment().get_template(TEMPLATE_NAME)
    text = template.render(
        spec=spec,
        p=prefix,
        functions=functions,
        same_a=same_a,
        exp2=exp2,
        forward_configs=[list(c) for c in spec.forward_configs],
        origin_comment=origin_comment,
        all_origins=list(origin.items()),
        other_origins=other_origins,
    )
    if factorization is not None:
        if spec.online_max:
            raise AttentionSpecError("the factorized form needs polynomial maps (no running max)")
        text += _environment().get_template(CHUNKED_TEMPLATE_NAME).render(
            spec=spec, p=prefix, f=factorization, need_vec=bool(factorization.c0 or factorization.e1),
            origin_comment=origin_comment,
        )
    ast.parse(text)  # the template must always produce valid Python
    return text
