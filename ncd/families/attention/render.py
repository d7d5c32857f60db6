"""Code generation for normalized-contraction attention: the generated module holds only what the spec decides.

The kernels are static (kernel.py, kernel_chunked.py). The compiler lowers a spec to
an :class:`AttentionKernelSpec` (Triton expressions for the scalar maps a1, a2, b and their derivatives, printed
from sympy, plus flags), and :func:`render_attention_module` writes, with `# spec.ncd:LINE` origins:

- the maps as ``@triton.jit`` device functions, which the static kernels take as ``tl.constexpr`` arguments;
- the plan's :class:`AttentionConfig` as a literal (tiles, precisions, accumulation, modes, factorized form);
- one ``AttentionKernels`` (the launchers) built from the above, whose methods are the module's ``forward`` /
  ``backward`` API. Tests and benchmarks change a choice through the config (``Op.with_config``, or a config
  passed to :func:`render_attention_module`), never by writing module globals.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ncd.codegen.pytext import comment_lines, fit
from ncd.families.attention.config import AttentionConfig
from ncd.families.attention.factorize import Factorization
from ncd.families.attention.modifiers import NONE as NO_MODIFIERS
from ncd.families.attention.modifiers import Modifiers

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
    forward_configs: tuple[tuple[int, ...], ...] = ()
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
            if len(config) not in (4, 5) or not all(isinstance(v, int) and v >= 0 for v in config) or 0 in config[:4]:
                raise AttentionSpecError(f"forward configs are 4 positive ints (and HEADS_FAST), got {config!r}")
        for pair in self.origin:
            if len(pair) != 2 or not all(isinstance(p, str) and "\n" not in p for p in pair):
                raise AttentionSpecError(f"origin entries must be (label, location) string pairs: {pair!r}")


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _origins(spec: AttentionKernelSpec) -> tuple[dict[str, list[str]], Callable[[str], str]]:
    origin: dict[str, list[str]] = {}
    for label, loc in spec.origin:
        origin.setdefault(label, []).append(loc)

    def origin_comment(label: str) -> str:
        locs = origin.get(label)
        return f"  # {', '.join(locs)}" if locs else ""

    return origin, origin_comment


def _header(spec: AttentionKernelSpec, all_origins: list[tuple[str, list[str]]]) -> list[str]:
    w = "w_j " if spec.has_weight else ""
    lines = ["# Generated by ncd from a neural-circuit-diagram spec. Do not edit: regenerate instead.", "#",
             f'# Normalized-contraction attention "{spec.name}"', "# (kernels: ncd/families/attention/kernel*.py):",
             "#   s_ij = scale * q_i . k_j" + (", key j visible to query i iff j <= i" if spec.causal else ""),
             f"#   z_i  = sum_j {w}a2(s_ij),  o_i = sum_j {w}a1(s_ij) v_j / b(z_i)",
             f"#   a1(x) = {spec.a1}", f"#   a2(x) = {spec.a2}", f"#   b(z)  = {spec.b}",
             f"#   online max rescaling: {'on' if spec.online_max else 'off'}"]
    if spec.pre:
        lines += comment_lines("#   ", f"pre-map (stabiliser): a1, a2 take t = h(s_ij), h(x) = {spec.pre}; the running "
                               "max is of t")
    if all_origins:
        lines += ["#", "# Origins:", *(f"#   {label}: {', '.join(locs)}" for label, locs in all_origins)]
    return lines


def _coefficients(f: Factorization) -> tuple[float, ...]:
    """(c0, c1, e0, e1, e2): a1 = c0 + c1 s, a2 = e0 + e1 s + e2 s^2."""
    return (f.c0, f.c1, f.e0, f.e1, f.e2)


def _config_literal(config: AttentionConfig) -> str:
    """`AttentionConfig(...)` with every field that differs from the default, one per line."""
    defaults = AttentionConfig()
    lines = ["CONFIG = AttentionConfig("]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value == getattr(defaults, field.name):
            continue
        line = f"    {field.name}={value!r},"
        if len(line) > 116 and isinstance(value, tuple):  # a long autotune set: one tile a line
            line = "\n".join([f"    {field.name}=(", *(f"        {item!r}," for item in value), "    ),"])
        lines.append(line)
    return "\n".join([*lines, ")"])


_MAP_FACTS = ("online_max", "exp2", "shared_map", "fold")  # config fields the maps decide, not the user


def spec_config(spec: AttentionKernelSpec, factorization: Factorization | None = None,
                score_modifier: bool = False) -> AttentionConfig:
    """The config the plan would give `spec` (plan.py: attention_config); tests override fields of it."""
    from ncd.families.attention.plan import KernelMaps, attention_config

    maps = KernelMaps(spec.a1, spec.a2, spec.da1, spec.da2, spec.b, spec.db_over_b, spec.pre, spec.dpre)
    return attention_config(maps, spec.online_max, spec.forward_configs, factorization, score_modifier)


def render_attention_module(spec: AttentionKernelSpec, factorization: Factorization | None = None,
                            config: AttentionConfig | None = None, modifiers: Modifiers | None = None) -> str:
    """Render the generated Python module (source text) for ``spec``: its device functions, its config and the
    calls into kernel.py; with ``factorization`` (a1, a2 polynomials of degree <= 1, <= 2) the
    kernels also hold the factorized form (kernel_chunked.py): ``forward_factorized`` /
    ``backward_factorized``."""
    if factorization is not None and spec.online_max:
        raise AttentionSpecError("the factorized form needs polynomial maps (no running max)")
    origin, origin_comment = _origins(spec)
    modifiers = modifiers or NO_MODIFIERS
    derived = spec_config(spec, factorization, modifiers.has_score)
    if config is None:
        config = derived
    facts = [f for f in _MAP_FACTS if getattr(config, f) != getattr(derived, f)]
    if facts:  # the kernels' arithmetic relies on these (e.g. the folded statistics' exp): an override is wrong maths
        raise AttentionSpecError(f"the config's {', '.join(facts)} follow from the spec's maps (here "
                                 f"{', '.join(f'{f}={getattr(derived, f)}' for f in facts)}): leave them out of "
                                 "with_config")
    if modifiers.has_mask and (spec.causal or factorization is not None):
        raise AttentionSpecError("a mask hook replaces the causal flag, and rules out the factorized form")
    functions = [("a1", "x", spec.a1, "a1: numerator map"), ("a2", "x", spec.a2, "a2: normaliser map"),
                 ("da1", "x", spec.da1, "a1'"), ("da2", "x", spec.da2, "a2'"),
                 ("b", "z", spec.b, "b: applied to the row normaliser z"),
                 ("db_over_b", "z", spec.db_over_b, "b'(z) / b(z)")]
    if spec.pre:
        functions += [("pre", "x", spec.pre, "h: stabiliser pre-map of the score"), ("dpre", "x", spec.dpre, "h'")]
    uses_tl = any(_uses_name(expr, "tl") or not _uses_name(expr, var) for _, var, expr, _ in functions)
    lines = [*_header(spec, list(origin.items())),
             f'"""Normalized-contraction attention "{spec.name}" (generated by ncd).', "", MODULE_API, '"""', "",
             "import math as math  # (a re-export: spliced expressions and the op's scale may use it)", "",
             "import torch", "import triton", *(["import triton.language as tl"] if uses_tl else []), "",
             "from ncd.families.attention import kernel as _kernels",
             *(["from ncd.families.attention import kernel_chunked as _chunked"] if factorization is not None else []),
             "from ncd.families.attention.kernel import AttentionConfig",
             *(["from ncd.families.attention.mask_table import table_range"] if modifiers.tables else []), "",
             f'NAME = "{spec.name}"', f"ONLINE_MAX = {spec.online_max}", _config_literal(config)]
    for label, var, expr, doc in functions:
        expr = ast.unparse(ast.parse(expr.strip(), mode="eval"))  # the same tree, without redundant parentheses
        body = expr if _uses_name(expr, var) else f"tl.full({var}.shape, {expr}, tl.float32)"
        ret = f"    return {body}"
        if len(ret + origin_comment(label)) <= 120:
            ret, doc = ret + origin_comment(label), doc
        else:  # the origin on the comment line above; a long map broken inside parentheses
            doc = doc + origin_comment(label).replace("  #", ";", 1)
            ret = fit("return ", body)
        lines += ["", "", "@triton.jit", f"def _{label}({var}):", f"    # {doc}", ret]
    hooks = [f'    "{label.upper()}": _{label},' for label, *_ in functions]
    if modifiers.has_score:
        hooks += ['    "SCORE": _score,', '    "DSCORE": _dscore,', '    "SCORE_GRADS": _score_grads,']
    if modifiers.has_mask:
        hooks += ['    "MASK": _mask,', '    "KEY_RANGE": _key_range,', '    "QUERY_RANGE": _query_range,']
        lines += ["", "", "# Score and mask modifiers (ncd/families/attention/modifiers.py): C is the call's context",
                  "# tuple, G the modifier tensors' fp32 gradient buffers; i, j the query and key positions, b, h the",
                  "# batch and query head.", *modifiers.source.lstrip("\n").split("\n")]
    kernels = "_chunked.FactorizedAttentionKernels" if factorization else "_kernels.AttentionKernels"
    coefficients = [] if factorization is None else [
        f"    coefficients={_coefficients(factorization)},{origin_comment('factorized')}"]
    lines += ["", "", "MAPS = {", *hooks, "}", f"KERNELS = {kernels}(",
              "    NAME, CONFIG, MAPS, globals(),", f"    causal={spec.causal},{origin_comment('causal')}",
              f"    has_weight={spec.has_weight},{origin_comment('weight')}", *coefficients,
              *_modifier_flags(modifiers), ")", PUBLIC_API]
    if factorization is not None:
        need_vec = bool(factorization.c0 or factorization.e1)
        lines += ["", "", f"FACT_CAUSAL = {spec.causal}", f"FACT_NEED_VEC = {need_vec}",
                  f"FACT_MAX_HEAD_DIM = {factorization.max_head_dim}", FACTORIZED_API]
    text = "\n".join(lines) + "\n"
    ast.parse(text)  # the renderer must always produce valid Python
    return text


def _modifier_flags(modifiers: Modifiers) -> list[str]:
    if not modifiers.has_mask:
        return []
    return [f"    has_score={modifiers.has_score}, has_mask={modifiers.has_mask}, mask_hides={modifiers.hides}, "
            f"has_score_grads={bool(modifiers.grad_tensors)},"]


# Fixed text of every generated attention module (no spec text reaches it).
MODULE_API = """Public API:
    forward(q, k, v, w=None, scale=None) -> (o, stats)
    backward(do, q, k, v, o, stats, w=None, scale=None) -> (dq, dk, dv)
    Attention.apply(q, k, v, w, scale) -> o            (torch.autograd.Function)
    attention(q, k, v, w=None, scale=None) -> o         (same, with defaults)

Shapes: q [B, Hq, Nq, D]; k, v [B, Hkv, Nk, D] with Hq % Hkv == 0; w [B, Nk] float32 per-key multiplicity. D is
any head dim (the kernels run at a power-of-two tile of it, `head_tile`, with the extra columns masked). fp16 / bf16
/ fp32 inputs, fp32 accumulation, outputs in the input dtype. stats = (z, m): float32 [B, Hq, Nq] row normalisers
and row maxima (None when online rescaling is off). A row with z_i = 0 (a masked row) has output 0 and passes no
gradient (FlexAttention's convention; docs/language.md)."""

PUBLIC_API = """forward = KERNELS.forward
backward = KERNELS.backward
backward_from_saved = KERNELS.backward_from_saved
weight_gradient = KERNELS.weight_gradient
head_tile = _kernels.head_tile
_save_for_backward = _kernels.save_for_backward
_saved_backward = KERNELS.saved_backward
_tma_ok = KERNELS.tma_ok
Attention: type[torch.autograd.Function] = KERNELS.autograd_function()


def attention(q, k, v, w=None, scale=None):
    return Attention.apply(q, k, v, w, scale)"""

FACTORIZED_API = """CHUNK = KERNELS.chunk  # keys per causal chunk: CONFIG.chunk, else the platform's
forward_factorized = KERNELS.forward_factorized
backward_factorized = KERNELS.backward_factorized
factorized_backward_from_saved = KERNELS.factorized_backward_from_saved
FactorizedAttention: type[torch.autograd.Function] = KERNELS.autograd_function(
    "forward_factorized", "factorized_backward_from_saved"
)"""
