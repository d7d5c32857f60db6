"""Issue 32: the shipped attention specs with masks and score modifiers, on the CPU interpreter.

Sliding windows (causal and bidirectional), prefix-LM, key and query padding, document masking, ALiBi, a learned
per-head temperature, an additive bias and softcapping, under the softmax, spherical and sigmoid normalisers: the
op's output and every gradient (Q, K, V and the modifier parameters slope, tau, bias) against float64 references
written here from the formulas in the specs' headers, not from ncd's reference evaluator. Masked rows follow the
convention of docs/language.md §21: output 0 and no gradient. The references are checked themselves: the dense
masked form against a per-row loop over the visible keys (a second mask, written pair by pair) and, for softmax,
against PyTorch's scaled_dot_product_attention."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import ncd
from ncd.errors import CallError
from ncd.families.attention.plan import AttentionPlan
from ncd.validate import TOLERANCE

from .conftest import ROOT, raise_float_errors

B, H, D = 2, 3, 128  # head dim: the specs' `axis dim = 128`
SCALE = D**-0.5  # the specs' default `scale = 1 / sqrt(size(dim))`
DEFAULT_WINDOW = 256  # the window specs' `in window : i32 = 256`: more than any N here
CAP = 30.0  # softcap_document_softmax's `const cap = 30`
TOL = TOLERANCE[torch.float32]  # 1e-4 relative (Frobenius), as the attention validation's fp32 rows


def _per_batch(t: torch.Tensor) -> torch.Tensor:
    """A [batch] tensor against the [batch head query key] scores."""
    return t.view(-1, 1, 1, 1)


def _window(x: dict) -> int:
    return int(x.get("window", DEFAULT_WINDOW))


def _scale(x: dict) -> float:
    return float(x.get("scale", SCALE))


def _alibi(x: dict, qk: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return _scale(x) * qk + x["slope"].view(1, -1, 1, 1) * (j - i)


def _same_document(x: dict) -> torch.Tensor:
    return x["q_doc"][:, None, :, None] == x["k_doc"][:, None, None, :]


@dataclass(frozen=True)
class Variant:
    """One spec's math. `mask(x, i, j)` is the dense mask over [batch head query key] (i a column of query
    positions, j a row of key positions; None: every key); `visible(x, b, i, j)` the same mask for one pair, written
    independently; `score(x, qk, i, j)` the normalised score from the raw contraction Q . K over dim."""

    normaliser: str  # softmax | spherical | sigmoid
    mask: Callable[[dict, torch.Tensor, torch.Tensor], torch.Tensor] | None
    visible: Callable[[dict, int, int, int], bool] | None
    score: Callable[[dict, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = \
        lambda x, qk, i, j: _scale(x) * qk
    params: tuple[str, ...] = ()  # float inputs with gradients besides Q, K, V


VARIANTS = {
    "sliding_window_softmax": Variant(
        "softmax", lambda x, i, j: (j <= i) & (j > i - _window(x)),
        lambda x, b, i, j: 0 <= i - j < _window(x)),
    "bidirectional_window_softmax": Variant(
        "softmax", lambda x, i, j: (j <= i + _window(x)) & (j >= i - _window(x)),
        lambda x, b, i, j: abs(i - j) <= _window(x)),
    "prefix_lm_softmax": Variant(
        "softmax", lambda x, i, j: (j <= i) | (j < _per_batch(x["prefix"])),
        lambda x, b, i, j: j <= i or j < int(x["prefix"][b])),
    "padded_softmax": Variant(
        "softmax", lambda x, i, j: (j < _per_batch(x["kv_len"])) & (i < _per_batch(x["q_len"])),
        lambda x, b, i, j: j < int(x["kv_len"][b]) and i < int(x["q_len"][b])),
    "document_softmax": Variant(
        "softmax", lambda x, i, j: _same_document(x) & (j <= i),
        lambda x, b, i, j: j <= i and int(x["q_doc"][b, i]) == int(x["k_doc"][b, j])),
    "alibi_softmax": Variant(
        "softmax", lambda x, i, j: j <= i, lambda x, b, i, j: j <= i, _alibi, ("slope",)),
    "learned_temperature_softmax": Variant(
        "softmax", None, None, lambda x, qk, i, j: x["tau"].view(1, -1, 1, 1) * qk, ("tau",)),
    "biased_softmax": Variant(
        "softmax", None, None, lambda x, qk, i, j: _scale(x) * qk + x["bias"], ("bias",)),
    "sliding_window_spherical": Variant(
        "spherical", lambda x, i, j: (j <= i) & (j > i - _window(x)),
        lambda x, b, i, j: 0 <= i - j < _window(x), lambda x, qk, i, j: qk),
    "alibi_sigmoid": Variant("sigmoid", lambda x, i, j: j <= i, lambda x, b, i, j: j <= i, _alibi, ("slope",)),
    "softcap_document_softmax": Variant(
        "softmax", lambda x, i, j: _same_document(x) & (j <= i),
        lambda x, b, i, j: j <= i and int(x["q_doc"][b, i]) == int(x["k_doc"][b, j]),
        lambda x, qk, i, j: CAP * torch.tanh(_scale(x) * qk / CAP)),
}


def _documents(*lengths: int) -> list[int]:
    """Per-token document ids of a packed sequence with documents of these lengths."""
    return [d for d, n in enumerate(lengths) for _ in range(n)]


def _ids(*rows: int | list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


PACKED = _ids(_documents(1, 12, 7, 17), _documents(20, 1, 15, 1))  # uneven documents, some of length 1 (N 37)


@dataclass(frozen=True)
class Case:
    stem: str
    label: str
    nq: int
    nk: int
    fixed: dict = field(default_factory=dict)  # the spec's other inputs, as passed (scalars, integer tensors)
    heads: int = H

    @property
    def id(self) -> str:
        return f"{self.stem}-{self.label}"

    @property
    def variant(self) -> Variant:
        return VARIANTS[self.stem]


# Each spec runs once at 3 heads; its further mask inputs at 1 head (the masks do not depend on the head), to keep
# the interpreter's time down.
CASES = [
    Case("sliding_window_softmax", "w1", 37, 37, {"window": 1}, heads=1),  # the diagonal alone: dQ = dK = 0
    Case("sliding_window_softmax", "w3", 37, 37, {"window": 3}),
    Case("sliding_window_softmax", "default-w256", 37, 37, heads=1),  # the default, wider than N: causal
    Case("bidirectional_window_softmax", "w1", 37, 29, {"window": 1}),  # rows 30.. see no key
    Case("bidirectional_window_softmax", "w40", 37, 29, {"window": 40}, heads=1),  # wider than N: every key
    Case("prefix_lm_softmax", "p0-p50", 37, 37, {"prefix": _ids(0, 50)}, heads=1),  # causal; bidirectional
    Case("prefix_lm_softmax", "p13-p1", 37, 37, {"prefix": _ids(13, 1)}),
    Case("padded_softmax", "kv0-full", 37, 29, {"kv_len": _ids(0, 29), "q_len": _ids(37, 20)}),
    Case("padded_softmax", "kv17-kv5", 37, 29, {"kv_len": _ids(17, 5), "q_len": _ids(1, 36)}, heads=1),
    Case("document_softmax", "packed", 37, 37, {"q_doc": PACKED, "k_doc": PACKED}),
    # other documents on the key side (cross-attention between packings): rows whose document has no earlier key
    Case("document_softmax", "cross", 37, 37,
         {"q_doc": PACKED, "k_doc": _ids(_documents(3, 30, 4), [1] * 5 + [3] * 32)}, heads=1),
    Case("alibi_softmax", "causal", 37, 37),
    Case("learned_temperature_softmax", "cross", 37, 29),
    Case("biased_softmax", "cross", 37, 29),
    Case("sliding_window_spherical", "w1", 37, 37, {"window": 1}, heads=1),
    Case("sliding_window_spherical", "w3", 37, 37, {"window": 3}),
    Case("alibi_sigmoid", "causal", 37, 37),
    # scale 0.5 puts the scores at up to ~+-20, where the cap bends them (test_modifiers_change_the_reference)
    Case("softcap_document_softmax", "packed", 37, 37, {"q_doc": PACKED, "k_doc": PACKED, "scale": 0.5}),
]

# One per mask kind whose rows can be fully masked (a prefix-LM row always sees key 0): output 0 and zero gradient.
MASKED_ROW_CASES = [
    Case("sliding_window_softmax", "past-keys", 37, 29, {"window": 3}, heads=1),  # rows 31.. see no key
    Case("bidirectional_window_softmax", "past-keys", 37, 29, {"window": 2}, heads=1),  # rows 31..
    Case("padded_softmax", "kv0-q20", 37, 29, {"kv_len": _ids(0, 29), "q_len": _ids(37, 20)}, heads=1),
    Case("document_softmax", "foreign-ids", 37, 37, {"q_doc": PACKED, "k_doc": _ids([5] * 37, _documents(22, 15))},
         heads=1),
    Case("softcap_document_softmax", "foreign-ids", 37, 37,
         {"q_doc": PACKED, "k_doc": _ids(_documents(4, 33), [7] * 37)}, heads=1),
    Case("sliding_window_spherical", "past-keys", 37, 29, {"window": 3}, heads=1),
]


# ---------------------------------------------------------------------------------------------------------------
# float64 references from the formulas
# ---------------------------------------------------------------------------------------------------------------

def _positions(nq: int, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(nq)[:, None], torch.arange(nk)[None, :]


def _scores(variant: Variant, x: dict) -> torch.Tensor:
    i, j = _positions(x["Q"].shape[-2], x["K"].shape[-2])
    return variant.score(x, x["Q"] @ x["K"].transpose(-1, -2), i, j)


def _dense_mask(variant: Variant, x: dict) -> torch.Tensor:
    """[batch head query key] booleans: which keys each query sees."""
    batch, heads, nq, _ = x["Q"].shape
    nk = x["K"].shape[-2]
    if variant.mask is None:
        return torch.ones(batch, heads, nq, nk, dtype=torch.bool)
    return variant.mask(x, *_positions(nq, nk)).expand(batch, heads, nq, nk)


def dense_reference(variant: Variant, x: dict) -> torch.Tensor:
    """O = sum_j m a1(s) v / b(sum_j m a2(s)) over dense masked scores. A masked score never reaches a1 or a2 (it is
    replaced by 0 first), and a row with no visible key divides by 1, not b(0), and is set to 0: the NaN or inf that
    0 / 0, exp(-inf - -inf) or sqrt'(0) would give never forms, in the forward or the backward."""
    s, mask = _scores(variant, x), _dense_mask(variant, x)
    seen = mask.any(-1, keepdim=True)
    weight = mask.to(s.dtype)
    if variant.normaliser == "softmax":
        with torch.no_grad():  # the shift cancels exactly; the row max of the visible scores, 0 on empty rows
            shift = torch.where(seen, torch.where(mask, s, -torch.inf).amax(-1, keepdim=True), 0.0)
        a1 = a2 = torch.exp(torch.where(mask, s - shift, 0.0)) * weight
    elif variant.normaliser == "spherical":
        visible = torch.where(mask, s, 0.0)
        a1, a2 = visible * weight, visible**2 * weight
    elif variant.normaliser == "sigmoid":
        a1 = a2 = torch.sigmoid(torch.where(mask, s, 0.0)) * weight
    else:
        raise AssertionError(variant.normaliser)
    z = torch.where(seen, a2.sum(-1, keepdim=True), 1.0)
    b = torch.sqrt(z) if variant.normaliser == "spherical" else z  # b(z) = sqrt(z) or z
    return torch.where(seen, (a1 @ x["V"]) / b, 0.0)


def loop_reference(variant: Variant, x: dict) -> torch.Tensor:
    """The same attention row by row: the visible keys listed with `visible`, then torch.softmax (or the spherical
    or sigmoid weights) of their scores alone; a row without keys is zeros."""
    s = _scores(variant, x)
    batch, heads, nq, nk = s.shape
    scores = [[s_bh.unbind(0) for s_bh in s_b.unbind(0)] for s_b in s.unbind(0)]  # unbind: a cheap backward
    values = [v_b.unbind(0) for v_b in x["V"].unbind(0)]
    rows = {}
    for b in range(batch):
        for i in range(nq):
            keys = torch.tensor([j for j in range(nk) if variant.visible is None or variant.visible(x, b, i, j)],
                                dtype=torch.long)
            for h in range(heads):
                if not len(keys):
                    rows[b, h, i] = torch.zeros(D, dtype=s.dtype)
                    continue
                row = scores[b][h][i][keys]
                if variant.normaliser == "softmax":
                    p = torch.softmax(row, 0)
                elif variant.normaliser == "spherical":
                    p = row / torch.linalg.vector_norm(row)
                else:
                    p = torch.sigmoid(row) / torch.sigmoid(row).sum()
                rows[b, h, i] = p @ values[b][h][keys]
    return torch.stack([rows[key] for key in sorted(rows)]).view(batch, heads, nq, D)


def _draw(case: Case) -> tuple[dict, torch.Tensor]:
    """Fresh fp32 Q, K, V and modifier parameters (seeded by the case), the case's fixed inputs, and dO."""
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    heads = case.heads
    x: dict = {"Q": torch.randn(B, heads, case.nq, D, generator=g),
               "K": torch.randn(B, heads, case.nk, D, generator=g),
               "V": torch.randn(B, heads, case.nk, D, generator=g)}
    x.update(case.fixed)
    if "slope" in case.variant.params:  # ALiBi's geometric slopes, jittered, one negative (favours far keys)
        x["slope"] = 2.0 ** (-torch.arange(1, heads + 1) * 8.0 / heads) * (1 + 0.5 * torch.rand(heads, generator=g))
        x["slope"][-1] = -x["slope"][-1]
    if "tau" in case.variant.params:  # about 1 / sqrt(D), a different one per head
        x["tau"] = SCALE * (0.25 + 2 * torch.rand(heads, generator=g))
    if "bias" in case.variant.params:
        x["bias"] = torch.randn(heads, case.nq, case.nk, generator=g)
    if case.variant.normaliser == "spherical":
        _redraw_near_singular_rows(case.variant, x, g)
    return x, torch.randn(B, heads, case.nq, D, generator=g)


NEAR_ZERO_NORMALISER = 1e-2


def _redraw_near_singular_rows(variant: Variant, x: dict, g: torch.Generator) -> None:
    """Spherical rows normalise by |s| over few keys (one key at window 1): where that is near 0, d(s / |s|) is
    ill-conditioned and fp32 rounding of the inputs alone moves the gradients (as the attention validation says), so
    query rows with b(z) below 1e-2 of the median row's are redrawn: the test measures the kernel, not the maths."""
    for _ in range(20):
        with torch.no_grad():
            mask = _dense_mask(variant, x)
            size = torch.sqrt((torch.where(mask, _scores(variant, x), 0.0) ** 2).sum(-1))
            near = (size < NEAR_ZERO_NORMALISER * size[mask.any(-1)].median()) & mask.any(-1)
        if not near.any():
            return
        x["Q"][near] = torch.randn(int(near.sum()), D, generator=g)
    raise AssertionError("could not draw well-conditioned spherical rows")


def _differentiable(case: Case) -> tuple[str, ...]:
    return ("Q", "K", "V", *case.variant.params)


def _float64_leaves(x: dict, differentiable: tuple[str, ...]) -> dict:
    return {n: t.detach().double().requires_grad_(n in differentiable) if torch.is_tensor(t) and t.is_floating_point()
            else t for n, t in x.items()}


@contextlib.contextmanager
def _one_thread():
    """Hundreds of tiny tensor ops (the per-row loop, the interpreter's launches): on a busy 2-core box OpenMP's
    thread wake-ups made them up to 100x slower (3 s against 0.03 s for one loop)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _reference(case: Case, x: dict, grad_out: torch.Tensor, form=dense_reference) -> tuple[torch.Tensor, dict]:
    leaves = _float64_leaves(x, _differentiable(case))
    with _one_thread():
        out = form(case.variant, leaves)
        grads = torch.autograd.grad(out, [leaves[n] for n in _differentiable(case)], grad_out.double())
    return out.detach(), dict(zip(_differentiable(case), grads, strict=True))


def _run_op(op, case: Case, x: dict, grad_out: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The op on fp32 leaves (integer mask inputs and scalars as given), by input name."""
    leaves = {n: t.detach().clone().requires_grad_(n in _differentiable(case)) if torch.is_tensor(t) else t
              for n, t in x.items()}
    others = {n: t for n, t in leaves.items() if n not in ("Q", "K", "V")}
    with raise_float_errors(), _one_thread():
        out = op(leaves["Q"], leaves["K"], leaves["V"], **others)
        grads = torch.autograd.grad(out, [leaves[n] for n in _differentiable(case)], grad_out)
    return out, dict(zip(_differentiable(case), grads, strict=True))


def _error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """Relative Frobenius error; `floor` stands in for a reference norm that vanishes (dQ and dK at window 1)."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / max(float(want.norm()), floor, 1e-300))


def _floor(name: str, want: torch.Tensor, grad_out: torch.Tensor) -> float:
    """Q-, K- and V-shaped gradients are held to an RMS of 0.1 dO's per element where the reference is smaller: dQ
    and dK of a row that sees one key are exactly 0 (softmax of one score), the rounding of a computation is not.
    Modifier parameters' gradients never vanish here: plain relative error."""
    rms = float(grad_out.norm()) / grad_out.numel() ** 0.5
    return 0.1 * rms * want.numel() ** 0.5 if name in ("Q", "K", "V") else 0.0


def _assert_matches(case: Case, out, grads, ref, ref_grads, grad_out) -> None:
    assert torch.isfinite(out).all() and _error(out, ref) < TOL, (case.id, "O", _error(out, ref))
    for name, grad in grads.items():
        want = ref_grads[name]
        error = _error(grad, want, _floor(name, want, grad_out))
        assert grad.shape == want.shape and torch.isfinite(grad).all() and error < TOL, (case.id, f"d{name}", error)


def _load(stem: str, cache) -> ncd.ops.Op:
    op = ncd.load(ROOT / "specs" / f"{stem}.ncd", cache_dir=cache)
    assert isinstance(op.plan, AttentionPlan), f"{stem} is not compiled by the attention kernels"
    return op


# ---------------------------------------------------------------------------------------------------------------
# the ops against the references
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_and_every_gradient_match_float64(case, op_cache):
    op = _load(case.stem, op_cache)  # outputs start as NaN (NCD_POISON_OUTPUTS, conftest)
    x, grad_out = _draw(case)
    out, grads = _run_op(op, case, x, grad_out)
    ref, ref_grads = _reference(case, x, grad_out)
    _assert_matches(case, out, grads, ref, ref_grads, grad_out)


def test_a_steep_negative_slope_does_not_overflow_in_the_padding_rows(op_cache):
    """Rows past N_Q (37 rows in the interpreter's 16-row tiles: 11 of padding) hold placeholder statistics (m = 0).
    A modified score there, slope * (j - i) = 3 * 47 at slope -3, once overflowed exp into inf and NaN lanes of the
    backward, which the masked last block's `where` then discarded (the results were right; a serial run's global
    RNG drew such a slope). No kernel may overflow, not even in padding: the op runs under raised float errors."""
    case = Case("alibi_softmax", "causal", 37, 37)
    op = _load(case.stem, op_cache)
    x, grad_out = _draw(case)
    x["slope"] = torch.tensor([0.5, -1.0, -3.0])
    out, grads = _run_op(op, case, x, grad_out)
    ref, ref_grads = _reference(case, x, grad_out)
    _assert_matches(case, out, grads, ref, ref_grads, grad_out)


@pytest.mark.parametrize("case", MASKED_ROW_CASES, ids=lambda c: c.id)
def test_fully_masked_rows_give_zero_output_and_zero_gradients(case, op_cache):
    op = _load(case.stem, op_cache)
    x, grad_out = _draw(case)
    mask = _dense_mask(case.variant, x)
    empty_rows, unseen_keys = ~mask.any(-1), ~mask.any(-2)  # [batch head query], [batch head key]
    out, grads = _run_op(op, case, x, grad_out)
    assert torch.equal(out[empty_rows], torch.zeros_like(out[empty_rows]))
    assert torch.equal(grads["Q"][empty_rows], torch.zeros_like(grads["Q"][empty_rows]))
    for name in ("K", "V"):  # a key no query sees (kv_len 0, padding keys) gets no gradient either
        assert torch.equal(grads[name][unseen_keys], torch.zeros_like(grads[name][unseen_keys])), name
    ref, ref_grads = _reference(case, x, grad_out)
    _assert_matches(case, out, grads, ref, ref_grads, grad_out)


@pytest.mark.parametrize(("stem", "bad", "tensor", "axis"), [
    ("padded_softmax", {"kv_len": _ids(29, 29, 29), "q_len": _ids(37, 37)}, "kv_len", "batch"),
    ("document_softmax", {"q_doc": PACKED, "k_doc": _ids([0] * 36, [0] * 36)}, "k_doc", "key"),
    ("prefix_lm_softmax", {"prefix": _ids(3)}, "prefix", "batch"),
])
def test_mask_tensor_of_the_wrong_shape_names_the_tensor_and_axis(op_cache, stem, bad, tensor, axis):
    op = _load(stem, op_cache)
    q, k, v = (torch.randn(B, H, 37, D) for _ in range(3))
    with pytest.raises(CallError) as info:
        op(q, k, v, **bad)
    assert tensor in info.value.message and f"'{axis}'" in info.value.message, info.value.message


@pytest.mark.parametrize("stem", sorted(VARIANTS))
def test_plan_uses_the_attention_kernels_and_names_the_modifier(run_cli, stem):
    code, out, err = run_cli("compile", str(ROOT / "specs" / f"{stem}.ncd"), "--emit", "plan")
    assert code == 0, err
    assert "normalized-contraction attention" in out and "generic" not in err, (out, err)
    if VARIANTS[stem].mask is not None:  # the plan's words are the family's: a mask, or causal for `key <= query`
        assert "mask" in out.lower() or "causal: true" in out.lower(), out
    for name in VARIANTS[stem].params:
        assert name in out, (name, out)


# ---------------------------------------------------------------------------------------------------------------
# the references themselves
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES + MASKED_ROW_CASES, ids=lambda c: c.id)
def test_dense_reference_equals_a_per_row_loop(case):
    """The dense masked reference, forward and every gradient, against the row-by-row form with the pairwise mask;
    neither has a NaN anywhere, masked rows included."""
    x, grad_out = _draw(case)
    ref, ref_grads = _reference(case, x, grad_out)
    loop, loop_grads = _reference(case, x, grad_out, form=loop_reference)
    assert torch.isfinite(ref).all() and _error(ref, loop) < 1e-12
    for name, grad in ref_grads.items():
        assert torch.isfinite(grad).all() and torch.isfinite(loop_grads[name]).all(), name
        assert _error(grad, loop_grads[name], _floor(name, grad, grad_out)) < 1e-10, name


def _sdpa_form(case: Case, x: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(query, additive float mask, scale) for torch's SDPA: the score modifier as a bias, -inf where masked."""
    i, j = _positions(case.nq, case.nk)
    q, scale, bias = x["Q"], _scale(x), torch.zeros(B, case.heads, case.nq, case.nk, dtype=torch.float64)
    if "slope" in x:
        bias = bias + x["slope"].view(1, -1, 1, 1) * (j - i)
    if "bias" in x:
        bias = bias + x["bias"]
    if "tau" in x:
        q, scale = q * x["tau"].view(1, -1, 1, 1), 1.0
    return q, bias.masked_fill(~_dense_mask(case.variant, x), -torch.inf), scale


SDPA_CASES = [c for c in CASES + MASKED_ROW_CASES if c.variant.normaliser == "softmax" and "softcap" not in c.stem]


@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: c.id)
def test_softmax_references_equal_sdpa_on_rows_with_keys(case):
    x, grad_out = _draw(case)
    leaves = _float64_leaves(x, _differentiable(case))
    q, attn_mask, scale = _sdpa_form(case, leaves)
    rows = _dense_mask(case.variant, leaves).any(-1)
    with _one_thread():
        sdpa = F.scaled_dot_product_attention(q, leaves["K"], leaves["V"], attn_mask=attn_mask, scale=scale)
        ref = dense_reference(case.variant, leaves)
    assert _error(ref[rows], sdpa[rows]) < 1e-12
    assert torch.equal(ref[~rows], torch.zeros_like(ref[~rows]))  # SDPA gives NaN there; the convention is 0
    if rows.all():  # every gradient through SDPA, modifier parameters included
        names = _differentiable(case)
        want = torch.autograd.grad(sdpa, [leaves[n] for n in names], grad_out.double())
        for name, got, w in zip(names, torch.autograd.grad(ref, [leaves[n] for n in names], grad_out.double()),
                                want, strict=True):
            assert _error(got, w, _floor(name, w, grad_out)) < 1e-10, name


def test_cases_cover_the_interesting_masks():
    """Windows 1, 3 and wider than N; kv_len 0 and full; q_len < N; documents of length 1; prefix 0 and > N; rows
    with no key; a spherical row normalised by one score."""
    leaves = {c.id: _float64_leaves(_draw(c)[0], ()) for c in CASES}
    by_id = {c.id: c for c in CASES}
    windows = {_window(leaves[c.id]) for c in CASES if "window" in c.stem}
    assert {1, 3} <= windows and max(windows) > 37
    padded = [leaves[c.id] for c in CASES if c.stem == "padded_softmax"]
    assert any(int(p["kv_len"].min()) == 0 for p in padded) and any(int(p["kv_len"].max()) == 29 for p in padded)
    assert any(int(p["q_len"].min()) < 37 for p in padded)
    prefixes = torch.cat([leaves[c.id]["prefix"] for c in CASES if c.stem == "prefix_lm_softmax"])
    assert int(prefixes.min()) == 0 and int(prefixes.max()) > 37
    assert (torch.unique_consecutive(PACKED[0], return_counts=True)[1] == 1).any()
    visible_keys = {cid: _dense_mask(by_id[cid].variant, x).sum(-1) for cid, x in leaves.items()}
    assert any((n == 0).any() for n in visible_keys.values())  # the main cases have empty rows too
    assert (visible_keys["sliding_window_spherical-w1"] == 1).all()


@pytest.mark.parametrize("case", MASKED_ROW_CASES, ids=lambda c: c.id)
def test_masked_row_cases_have_rows_with_and_without_keys(case):
    x, grad_out = _draw(case)
    mask = _dense_mask(case.variant, x)
    assert mask.any(-1).any() and not mask.any(-1).all()
    ref, ref_grads = _reference(case, x, grad_out)
    empty = ~mask.any(-1)
    assert torch.equal(ref[empty], torch.zeros_like(ref[empty]))
    assert torch.equal(ref_grads["Q"][empty], torch.zeros_like(ref_grads["Q"][empty]))


@pytest.mark.parametrize(("stem", "plain"), [
    ("alibi_softmax", lambda x: {**x, "slope": torch.zeros_like(x["slope"])}),
    ("alibi_sigmoid", lambda x: {**x, "slope": torch.zeros_like(x["slope"])}),
    ("learned_temperature_softmax", lambda x: {**x, "tau": torch.full_like(x["tau"], SCALE)}),
    ("biased_softmax", lambda x: {**x, "bias": torch.zeros_like(x["bias"])}),
    ("softcap_document_softmax", None),
])
def test_modifiers_change_the_reference(stem, plain):
    """Each score modifier moves the drawn case's output far beyond the tolerance: an op that dropped it fails."""
    case = next(c for c in CASES if c.stem == stem)
    x = _float64_leaves(_draw(case)[0], ())
    out = dense_reference(case.variant, x)
    without = (dense_reference(case.variant, plain(x)) if plain is not None
               else dense_reference(VARIANTS["document_softmax"], x))  # the same documents, scores uncapped
    assert _error(without, out) > 100 * TOL


def test_a_batch_shared_bias_under_the_heads_fast_grid_matches_float64(tmp_path):
    """The heads-fast launch order that plan.batch_shared_table adds to a [head, query, key] bias's forward tiles
    (the interpreter keeps one config: forced here, in every kernel) reads the bias at the same positions."""
    case = next(c for c in CASES if c.stem == "biased_softmax")
    op = _load(case.stem, tmp_path)
    for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
        getattr(op.module.KERNELS, f"{kernel}_kernel").configs[0].kwargs["HEADS_FAST"] = 1
    x, grad_out = _draw(case)
    assert x["Q"].shape[0] > 1 and x["Q"].shape[1] > 1  # several batch entries and heads share the program axis
    out, grads = _run_op(op, case, x, grad_out)
    ref, ref_grads = _reference(case, x, grad_out)
    _assert_matches(case, out, grads, ref, ref_grads, grad_out)


class _Launches:
    """A kernel that counts its launches (`kernel[grid](...)`) and otherwise is the kernel."""

    def __init__(self, kernel) -> None:
        self.kernel, self.count = kernel, 0

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


def test_a_bias_that_asks_for_no_gradient_gets_no_gradient_adds_and_the_stored_ds_backward(op_cache, monkeypatch):
    """The biased spec's bias is an `in` whose gradient the caller may not want (a fixed relative-position table):
    the backward then passes no gradient buffers, so its kernels compile without the atomic adds (HAS_SCORE_GRADS
    off; a kernel that kept them would index an empty G), and Q, K, V's gradients still match float64. A score
    modifier without a mask keeps the dQ-from-dS backward: its always-true mask hook hides no pair."""
    case = next(c for c in CASES if c.stem == "biased_softmax")
    op = _load(case.stem, op_cache)
    kernels = op.module.KERNELS
    assert not kernels.mask_hides and op.plan.config.ds_buffer_bytes > 0
    buffers = []
    backward = op.module.backward

    def spy(*args, **kwargs):
        buffers.append(args[9])  # (do, q, k, v, o, stats, w, scale, context, grads, ...)
        return backward(*args, **kwargs)

    monkeypatch.setattr(op.module, "backward", spy)
    from_ds = _Launches(kernels.bwd_dq_ds_kernel)
    monkeypatch.setattr(kernels, "bwd_dq_ds_kernel", from_ds)
    x, grad_out = _draw(case)
    qkv = ("Q", "K", "V")
    leaves = {n: t.detach().clone().requires_grad_(n in qkv) for n, t in x.items()}
    with raise_float_errors(), _one_thread():
        out = op(leaves["Q"], leaves["K"], leaves["V"], bias=leaves["bias"])
        grads = dict(zip(qkv, torch.autograd.grad(out, [leaves[n] for n in qkv], grad_out), strict=True))
    ref, ref_grads = _reference(case, x, grad_out)
    _assert_matches(case, out, grads, ref, {n: ref_grads[n] for n in qkv}, grad_out)
    assert buffers == [()] and from_ds.count == 1
    # asked for, the bias's gradient comes through the same stored-dS backward
    out, grads = _run_op(op, case, x, grad_out)
    assert len(buffers[1]) > 0 and from_ds.count == 2
    _assert_matches(case, out, grads, ref, ref_grads, grad_out)


def test_a_negative_scale_under_a_score_modifier_keeps_the_running_max_of_the_modified_scores(op_cache):
    """The forward streams a score modifier's spec in base 2 (a1 = a2 = exp): the modifier takes the natural score
    scale * q.k, so the row max is a max of the modified scores even where the scale is negative (the unmodified
    path takes the min of q.k then). Logits of +-100 here: a min in its place overflows exp2 into inf."""
    case = next(c for c in CASES if c.stem == "biased_softmax")
    op = _load(case.stem, op_cache)
    assert op.module.KERNELS.forward_spec["EXP2"] and not op.module.KERNELS.spec["EXP2"]
    x, grad_out = _draw(case)
    x["scale"] = -3.0
    out, grads = _run_op(op, case, x, grad_out)
    ref, ref_grads = _reference(case, x, grad_out)
    assert float(ref.abs().amax()) > 0 and float((_scale(x) * x["Q"] @ x["K"].transpose(-1, -2)).abs().amax()) > 60
    _assert_matches(case, out, grads, ref, ref_grads, grad_out)


def test_a_16_bit_modifier_tensor_is_read_in_its_declared_fp32(op_cache):
    """FoX's gate sums declared f32 and passed in bf16 (as a bf16 model would) give the output and gradients of
    the same values in fp32: the hooks widen what they load (the interpreter once negated bf16 -fk bit-wise,
    a relative error of 1.1), and each gradient comes back in its input's dtype."""
    op = ncd.load(ROOT / "specs" / "forgetting_softmax.ncd", cache_dir=op_cache, sizes={"dim": 16})
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 11, 16, generator=gen) for _ in range(3))
    c = F.logsigmoid(torch.randn(1, 2, 11, generator=gen) + 1.0).cumsum(-1).bfloat16()
    do = torch.randn(1, 2, 11, 16, generator=gen)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        fq, fk = (c.to(dtype).detach().clone().requires_grad_() for _ in range(2))
        out = op(q, k, v, fq, fk)
        out.backward(do)
        assert fk.grad.dtype == dtype
        results.append((out, fk.grad.float()))
    (out16, dfk16), (out32, dfk32) = results
    assert float((out16 - out32).norm() / out32.norm()) < 1e-6
    assert float((dfk16 - dfk32).norm() / dfk32.norm()) < 1e-2  # (dfk16 rounded to bf16)
