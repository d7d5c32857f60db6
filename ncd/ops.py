"""`ncd.load(path)`: compile a spec (or reuse the cached result), import the generated module, return the op.

Generated modules are cached under their op id (spec text, file name, sizes, options and the compiler's own
sources) in the per-user cache directory or NCD_CACHE_DIR; ncd/cache.py checks each entry before it runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from .cache import CacheError, import_generated
from .compiler import Compiled, ConfigError, ConfigOverrides, advance, compile_spec, config_overrides, with_config
from .family import KernelPlan

__all__ = ["CacheError", "ConfigError", "Op", "chunk_delta_rule", "chunk_gated_delta_rule", "chunk_gka",
           "chunk_gla", "chunk_simple_gla", "import_generated", "load", "recurrent_delta_rule",
           "recurrent_gated_delta_rule", "recurrent_gka", "recurrent_gla", "recurrent_simple_gla", "shipped_spec"]


class Op:
    """A compiled spec: call it like a function; `.module` is the generated code, `.Module` an nn.Module."""

    def __init__(self, compiled: Compiled) -> None:
        if compiled.module is None or compiled.path is None:
            raise ValueError("Op needs a spec compiled through the `import` stage (ncd.compiler.compile_front)")
        self.compiled = compiled
        self.front = front = compiled.front
        self.module: ModuleType = compiled.module
        self.path: Path = compiled.path
        self.name = front.program.name
        # positional arguments: the spec's inputs, then its parameters, in declaration order
        self.signature = (*front.program.inputs, *front.program.params)
        self.fn = getattr(self.module, self.name)
        self.Module = self.module.Module
        self.__doc__ = self.fn.__doc__

    @property
    def plan(self) -> KernelPlan:
        """The family's plan (derived on first use, once: a cached module is imported without it)."""
        return self.compiled.plan

    @property
    def config(self) -> Any:
        """The family's frozen config of this op (its plan's; the generated module embeds it as `CONFIG`)."""
        return self.plan.config  # type: ignore[attr-defined]

    def with_config(self, **fields: Any) -> Op:
        """This spec compiled with `dataclasses.replace(config, **fields)`: another op (its own op id, cached like
        any op), e.g. `op.with_config(factorize="always")`, `op.with_config(use_tma=False)`. Overrides add to this
        op's; ConfigError (naming the config's fields) for a field the family's config does not have."""
        merged = {**dict(self.compiled.config), **fields}
        variant = dataclasses.replace(self.compiled, module=None, path=None, config=config_overrides(merged))
        found = self.compiled.__dict__.get("selection")
        if found is not None:  # this op's plan with the fields replaced: the spec is not planned again
            changed = with_config(found.plan, dict(config_overrides(fields)))
            variant.__dict__["selection"] = dataclasses.replace(found, plan=changed)
        return Op(advance(variant, "import", self.path.parent))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<ncd op {self.name} from {self.front.source.filename}>"


def load(path: str | Path, cache_dir: str | Path | None = None, sizes: Mapping[str, int] | None = None,
         options: Mapping[str, str] | None = None, config: Mapping[str, Any] | None = None) -> Op:
    """Compile the spec at `path` (cached by content) and return its op. `sizes` overrides fixed axis sizes
    (`sizes={"deg": 25}` compiles `axis deg = 9` as 25, re-checking the spec); `options` are family options
    (polykan: `{"basis_eval": "lut" | "recurrence"}`); `config` overrides fields of the family's config
    (`Op.with_config`). All are part of the cache key. Raises `CacheError` when the cache directory is unusable or
    not private to this user, `ConfigError` for a field the family's config does not have."""
    return Op(compile_spec(path, sizes, options, cache_dir=cache_dir, config=config))


# --- shipped ops with library conventions -------------------------------------------------------------------

_SHIPPED_OPS: dict[tuple[str, int, int, ConfigOverrides], Op] = {}


def shipped_spec(name: str) -> Path:
    """A spec shipped with ncd (package data `ncd.specs`)."""
    from importlib import resources

    return Path(str(resources.files("ncd.specs").joinpath(f"{name}.ncd")))


def _gka_spec(gate_covariance: bool) -> str:
    return "gka" if gate_covariance else "gka_ungated_covariance"


def chunk_gka(q: Any, k: Any, v: Any, g: Any, beta: Any = None, scale: Any = None, initial_state: Any = None,
              output_final_state: bool = False, cu_seqlens: Any = None, *, alpha: Any = None, ridge: float = 0.02,
              num_iter: int = 30, chunk_size: int = 64, gate_covariance: bool = True,
              config: Mapping[str, object] | None = None) -> Any:
    """Gated KalmaNet core compiled from `specs/gka.ncd`, with fla's conventions and positional order (q, k, v, g,
    beta, scale, initial_state, output_final_state, cu_seqlens, as fla's chunk_gated_delta_rule; alpha and the
    rest by keyword). q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] natural-log gates (<= 0), beta and alpha
    [B, T, H] (None: no key/value scaling; alpha = 1), scale a number or a one-element tensor (with its gradient
    when it requires one; double backward raises), default K^-1/2; non-finite inputs give NaN outputs only where
    they reach (g = -inf is a reset); states (H [N, H, K, K], S [N, H, K, V]) fp32, `cu_seqlens` packs N
    sequences into B = 1. Returns (o [B, T, H, V], final_state or None). Any head sizes: the spec is compiled
    once per (K, V) with its fixed axes overridden. `gate_covariance=False`: g gates U alone and the key
    covariance H is ungated (`specs/gka_ungated_covariance.ncd`; the official layer's
    use_forgetting_gate_kk=False). `config` overrides fields of the recurrence family's config (`Op.with_config`,
    e.g. `{"dot_precision": "ieee"}`): another op, compiled once per (K, V, config)."""
    op = _shipped_op(_gka_spec(gate_covariance), "chunk_gka", q, v, config)
    return op.module.chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, alpha=alpha,
                           ridge=ridge, num_iter=num_iter, chunk_size=chunk_size)


def recurrent_gka(q: Any, k: Any, v: Any, g: Any, beta: Any = None, scale: Any = None, initial_state: Any = None,
                  output_final_state: bool = True, *, alpha: Any = None, ridge: float = 0.02, num_iter: int = 30,
                  gate_covariance: bool = True, config: Mapping[str, object] | None = None) -> Any:
    """Gated KalmaNet decoding (fla's fused_recurrent convention): the recurrence token by token from a state,
    for the few tokens of a decoding step after a prefill by `chunk_gka(..., output_final_state=True)`. Arguments
    as `chunk_gka`'s (one state per batch entry: no cu_seqlens); returns (o, (H, S) after the last token, or
    None). Inference only: an input that requires a gradient is refused."""
    op = _shipped_op(_gka_spec(gate_covariance), "recurrent_gka", q, v, config)
    return op.module.recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, alpha=alpha, ridge=ridge,
                               num_iter=num_iter)


def chunk_simple_gla(q: Any, k: Any, v: Any, g: Any, scale: Any = None, initial_state: Any = None,
                     output_final_state: bool = False, cu_seqlens: Any = None, *, chunk_size: int = 64,
                     config: Mapping[str, object] | None = None) -> Any:
    """Gated linear attention with a scalar gate per token and head (simple GLA; RetNet with a constant gate),
    compiled from `specs/simple_gla.ncd`, in fla's chunk_gla positional order (q, k, v, g, scale, initial_state,
    output_final_state, cu_seqlens): S_t = exp(g_t) S_(t-1) + k_t v_t^T, o_t = scale S_t^T q_t. q, k [B, T, H,
    K], v [B, T, H, V], g [B, T, H] natural-log gates (<= 0; -inf resets), scale a number or a one-element tensor
    (default K^-1/2), initial_state S [N, H, K, V] fp32; returns (o [B, T, H, V], final state or None). Any head
    sizes up to 256 (compiled once per (K, V, config)); `config` overrides LinearScanConfig fields (e.g.
    `{"grad_precision": "input"}`: the backward in the inputs' 16-bit products, about 2x faster, less exact)."""
    return _shipped_op("simple_gla", "chunk_simple_gla", q, v, config).module.chunk(
        q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, chunk_size=chunk_size)


def recurrent_simple_gla(q: Any, k: Any, v: Any, g: Any, scale: Any = None, initial_state: Any = None,
                         output_final_state: bool = True, *, config: Mapping[str, object] | None = None) -> Any:
    """Decoding for `chunk_simple_gla` (fla's fused_recurrent convention): token by token from a state S [B, H,
    K, V] fp32 (or None), typically one token after a prefill by `chunk_simple_gla(..., output_final_state=
    True)`. Returns (o, the state after the last token or None). Inference only."""
    return _shipped_op("simple_gla", "recurrent_simple_gla", q, v, config).module.recurrent(
        q, k, v, g, scale, initial_state, output_final_state)


def chunk_gla(q: Any, k: Any, v: Any, g: Any, scale: Any = None, initial_state: Any = None,
              output_final_state: bool = False, cu_seqlens: Any = None, *, chunk_size: int = 64,
              config: Mapping[str, object] | None = None) -> Any:
    """Gated linear attention with a gate per key dimension (GLA; fla's chunk_gla), compiled from
    `specs/gla.ncd`, in fla's positional order: S_t = diag(exp(g_t)) S_(t-1) + k_t v_t^T, o_t = scale S_t^T q_t.
    q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K] natural-log gates (<= 0; -inf resets that key row), scale
    a number or a one-element tensor (default K^-1/2), initial_state S [N, H, K, V] fp32; returns (o [B, T, H,
    V], final state or None). Any head sizes up to 256 (compiled once per (K, V, config)); `config` overrides
    LinearScanConfig fields."""
    return _shipped_op("gla", "chunk_gla", q, v, config).module.chunk(
        q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, chunk_size=chunk_size)


def recurrent_gla(q: Any, k: Any, v: Any, g: Any, scale: Any = None, initial_state: Any = None,
                  output_final_state: bool = True, *, config: Mapping[str, object] | None = None) -> Any:
    """Decoding for `chunk_gla` (fla's fused_recurrent_gla convention): token by token from a state S [B, H, K,
    V] fp32 (or None). Returns (o, the state after the last token or None). Inference only."""
    return _shipped_op("gla", "recurrent_gla", q, v, config).module.recurrent(
        q, k, v, g, scale, initial_state, output_final_state)


def chunk_gated_delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: Any = None, initial_state: Any = None,
                           output_final_state: bool = False, cu_seqlens: Any = None, *, chunk_size: int = 64,
                           config: Mapping[str, object] | None = None) -> Any:
    """The gated delta rule (Gated DeltaNet) compiled from `specs/gated_delta_rule.ncd`, in fla's
    chunk_gated_delta_rule positional order: S_t = exp(g_t) (I - b_t k_t k_t^T) S_(t-1) + b_t k_t v_t^T, o_t =
    scale S_t^T q_t. q, k [B, T, H, K] (k l2-normalised), v [B, T, H, V], g [B, T, H] natural-log gates (<= 0;
    -inf resets), beta [B, T, H], scale a number or a one-element tensor (default K^-1/2), initial_state S [N, H,
    K, V] fp32; returns (o [B, T, H, V], final state or None). Head sizes up to 256; `config` overrides
    LinearScanConfig fields."""
    return _shipped_op("gated_delta_rule", "chunk_gated_delta_rule", q, v, config).module.chunk(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size=chunk_size)


def recurrent_gated_delta_rule(q: Any, k: Any, v: Any, g: Any, beta: Any, scale: Any = None, initial_state: Any = None,
                               output_final_state: bool = True, *, config: Mapping[str, object] | None = None) -> Any:
    """Decoding for `chunk_gated_delta_rule`: token by token from a state S [B, H, K, V] fp32 (or None). Returns
    (o, the state after the last token or None). Inference only."""
    return _shipped_op("gated_delta_rule", "recurrent_gated_delta_rule", q, v, config).module.recurrent(
        q, k, v, g, beta, scale, initial_state, output_final_state)


def chunk_delta_rule(q: Any, k: Any, v: Any, beta: Any, scale: Any = None, initial_state: Any = None,
                     output_final_state: bool = False, cu_seqlens: Any = None, *, chunk_size: int = 64,
                     config: Mapping[str, object] | None = None) -> Any:
    """The delta rule (DeltaNet) compiled from `specs/delta_rule.ncd`, in fla's chunk_delta_rule positional order:
    S_t = (I - b_t k_t k_t^T) S_(t-1) + b_t k_t v_t^T, o_t = scale S_t^T q_t; arguments as
    `chunk_gated_delta_rule`'s without g."""
    return _shipped_op("delta_rule", "chunk_delta_rule", q, v, config).module.chunk(
        q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size=chunk_size)


def recurrent_delta_rule(q: Any, k: Any, v: Any, beta: Any, scale: Any = None, initial_state: Any = None,
                         output_final_state: bool = True, *, config: Mapping[str, object] | None = None) -> Any:
    """Decoding for `chunk_delta_rule`: token by token from a state S [B, H, K, V] fp32 (or None)."""
    return _shipped_op("delta_rule", "recurrent_delta_rule", q, v, config).module.recurrent(
        q, k, v, beta, scale, initial_state, output_final_state)


def _shipped_op(spec: str, caller: str, q: Any, v: Any, config: Mapping[str, object] | None) -> Op:
    """A shipped recurrence spec compiled at q's and v's head sizes (once per spec, sizes and config)."""
    from .errors import CallError

    for name, t in (("q", q), ("v", v)):
        if not hasattr(t, "shape") or len(t.shape) != 4:
            raise CallError(None, detail=f"{caller}: {name} must be a 4-d tensor [batch time head dim], got "
                            f"{type(t).__name__} {list(getattr(t, 'shape', []))}")
    key = (spec, int(q.shape[-1]), int(v.shape[-1]), config_overrides(config))
    if key not in _SHIPPED_OPS:
        _SHIPPED_OPS[key] = load(shipped_spec(spec), sizes={"kdim": key[1], "vdim": key[2]}, config=config)
    return _SHIPPED_OPS[key]
