"""Issue 32 item 5: split-K decoding (ncd/families/attention/kernel_decode.py) on the CPU interpreter.

Few queries (N_Q 1, 3, 7) against N_K = 301 keys in 3 key ranges (the last one ragged), head dim 40 (tile 64), GQA
groups 1 and 3 packed into one tile per kv head. The decode path's O and saved statistics Z, M must equal the
standard forward's (`AttentionKernels.forward`) for every kind of spec the kernels take: softmax (running max,
EXP2), spherical (plain sums), causal, a tensor mask with fully masked rows (padded_softmax), score modifiers with a
mask (ALiBi) and without one over every key (a per-head temperature, a [head query key] bias), per-key weights, a
value width of its own and a negative scale; outputs start as NaN (conftest). The backward kernels run from the
decode path's saved statistics and must give the standard path's gradients; outputs are also checked against
float64 formulas written here. Where a split starts on keys a row does not see, its (Z, M) may be another, equivalent,
pair than the standard forward's: O, M + log Z and the gradients agree."""

from __future__ import annotations

import ast
import inspect
import zlib

import pytest
import torch

import ncd
from ncd.families.attention import kernel_decode as dec
from ncd.families.attention.kernel import Spec
from ncd.families.attention.plan import AttentionPlan

from .conftest import ROOT, raise_float_errors

B, HKV, D, NK = 2, 2, 40, 301  # head dim 40 runs at the 64 tile with columns masked; 301 keys: 19 blocks of 16
SCALE = 0.3
SPLITS = 3  # 7 blocks a split: keys [0, 112), [112, 224), [224, 301) (a ragged last split)

SPECS = ["softmax_attention", "spherical_attention", "causal_softmax_attention", "padded_softmax", "alibi_softmax",
         "learned_temperature_softmax", "biased_softmax"]
SHAPES = [(1, 3), (3, 1), (7, 3)]  # (N_Q, GROUP)


def _load(stem: str, cache):
    op = ncd.load(ROOT / "specs" / f"{stem}.ncd", cache_dir=cache)
    assert isinstance(op.plan, AttentionPlan)
    return op.module


def _modifier_inputs(stem: str, n_q: int, heads: int, g: torch.Generator) -> dict:
    """The tensors the spec's hooks read, by input name (the float ones take gradients)."""
    if stem == "padded_softmax":  # batch 0: keys past 217 padded, rows past n_q // 2 masked; batch 1: no key at all
        return {"kv_len": torch.tensor([217, 0], dtype=torch.int32),
                "q_len": torch.tensor([n_q // 2 + 1, n_q], dtype=torch.int32)}
    if stem == "alibi_softmax":
        return {"slope": torch.linspace(-0.5, 0.7, heads)}
    if stem == "learned_temperature_softmax":
        return {"tau": SCALE * (0.5 + torch.rand(heads, generator=g))}
    if stem == "biased_softmax":
        return {"bias": torch.randn(heads, n_q, NK, generator=g)}
    return {}


def _draw(stem: str, n_q: int, group: int, batch: int = B, dv: int = D):
    g = torch.Generator().manual_seed(zlib.crc32(f"{stem}-{n_q}-{group}-{batch}-{dv}".encode()))
    heads = HKV * group
    q = torch.randn(batch, heads, n_q, D, generator=g)
    k = torch.randn(batch, HKV, NK, D, generator=g)
    v = torch.randn(batch, HKV, NK, dv, generator=g)
    return q, k, v, _modifier_inputs(stem, n_q, heads, g), torch.randn(batch, heads, n_q, dv, generator=g)


def _context(module, q, k, tensors: dict) -> tuple | None:
    """The hooks' context tuple, as the op builds it for its backward (its tensors in the op's order; the columns
    table too, which the forward never reads: built without it, the context holds the rows table in its place, and
    the dK/dV kernels read that [.., N_Q, 4] table at key indices, past its end: a CI run's dK was off by 0.34)."""
    return module._OP._context(q, k, _in_order(module, tensors), [], columns=True)


def _in_order(module, tensors: dict) -> list:
    names = [name for name, _, _ in module._OP.mod_tensors]
    assert sorted(names) == sorted(tensors)
    return [tensors[name] for name in names]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), (what, "non-finite")
    error = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    assert error < tol, (what, error)


def _compare_forwards(kernels, q, k, v, w=None, context=None, scale=SCALE):
    """Both forwards (NaN-poisoned outputs, numpy's float errors raised); asserts they agree, returns the decode
    path's (o, z, m)."""
    with raise_float_errors():
        o, (z, m) = kernels.forward(q, k, v, w, scale, context)
        o_d, (z_d, m_d) = dec.decode_forward(kernels, q, k, v, w, scale, context, splits=SPLITS)
    _close(o_d, o, "O")
    _close(z_d, z, "Z")
    assert (m is None) == (m_d is None) == (not kernels.config.online_max)
    if m is not None:
        _close(m_d, m, "M", 1e-6)
    return o_d, z_d, m_d


@pytest.mark.parametrize("n_q,group", SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("stem", SPECS)
def test_decode_forward_equals_the_standard_forward(stem, n_q, group, op_cache):
    module = _load(stem, op_cache)
    q, k, v, tensors, _ = _draw(stem, n_q, group)
    o, z, m = _compare_forwards(module.KERNELS, q, k, v, context=_context(module, q, k, tensors))
    if stem == "padded_softmax":  # the masked rows: output 0, z 0, m 0 (never -inf)
        assert (o[1] == 0).all() and (z[1] == 0).all() and (m[1] == 0).all()
        assert (o[0, :, n_q // 2 + 1:] == 0).all() and (z[0, :, n_q // 2 + 1:] == 0).all()
        assert (z[0, :, : n_q // 2 + 1] > 0).all()


WEIGHTED = """\
spec weighted_softmax
axis batch, head, query, key
axis dim = 40
in  Q[batch head query dim] : f32
in  K[batch head key dim]   : f32
in  V[batch head key dim]   : f32
in  M[batch key]            : f32
S[batch head query key] = Q . K over dim
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z, weight = M)
out O[batch head query dim] = A . V over key
"""


SOFTCAPPED = """\
spec softcapped_softmax
axis batch, head, query, key
axis dim = 40
in  Q[batch head query dim] : f32
in  K[batch head key dim]   : f32
in  V[batch head key dim]   : f32
S[batch head query key] = Q . K over dim
A[batch head query key] = normalize(S, over key, a1(x) = exp(5 * tanh(x / 5)), a2(x) = exp(5 * tanh(x / 5)),
                                    b(z) = z)
out O[batch head query dim] = A . V over key
"""


@pytest.mark.parametrize("stem", ["weighted_softmax", "causal_gqa_spherical", "softcapped_softmax"])
def test_decode_forward_with_weights_and_a_pre_map(stem, op_cache, tmp_path):
    """Per-key weights (zero on a run of keys) over every split (softmax), and with the causal flag (spherical); a
    softcap written in the maps, exp(5 tanh(x / 5)), streams with the pre-map t = 5 tanh(s / 5) (HAS_PRE: the running
    max and the combine take t)."""
    if stem == "causal_gqa_spherical":
        module = _load(stem, op_cache)
    else:
        path = tmp_path / f"{stem}.ncd"
        path.write_text(WEIGHTED if stem == "weighted_softmax" else SOFTCAPPED)
        module = ncd.load(path, cache_dir=op_cache).module
    q, k, v, _, _ = _draw(stem, 3, 3)
    w = None
    if stem != "softcapped_softmax":
        w = torch.rand(B, NK, generator=torch.Generator().manual_seed(7)) + 0.5
        w[:, 100:130] = 0.0
    assert module.KERNELS.has_weight == (w is not None)
    assert module.KERNELS.flags["HAS_PRE"] == (stem == "softcapped_softmax")
    _compare_forwards(module.KERNELS, q, k, v, w, scale=3.0 if stem == "softcapped_softmax" else SCALE)


def test_decode_forward_with_a_value_width_of_its_own_and_a_negative_scale(op_cache):
    """v 24 wide (tile 32) against q, k 40 wide (tile 64); a negative scale (EXP2's running max of the minimum)."""
    kernels = _load("softmax_attention", op_cache).KERNELS
    q, k, v, _, _ = _draw("softmax_attention", 7, 1, dv=24)
    o, _, _ = _compare_forwards(kernels, q, k, v)
    assert o.shape == (B, HKV, 7, 24)
    _compare_forwards(kernels, q, k, v[..., :D // 2].contiguous(), scale=-SCALE)


def test_decode_forward_equals_a_float64_formula_with_gqa(op_cache):
    """Softmax with GROUP 3 against softmax(scale q k^T) v in float64, the kv head of query head h being h // 3; and
    the default number of splits (from N_K and the SM count), a single split (no combine), one block a split and K, V
    read through tensor descriptors agree with it."""
    kernels = _load("softmax_attention", op_cache).KERNELS
    q, k, v, _, _ = _draw("softmax_attention", 5, 3)
    kr, vr = (t.double().repeat_interleave(3, dim=1) for t in (k, v))
    s = SCALE * q.double() @ kr.transpose(-1, -2)
    want = torch.softmax(s, -1) @ vr
    lse = torch.logsumexp(s, -1)
    for splits, tma in ((None, False), (1, False), (SPLITS, False), (40, False), (SPLITS, True)):
        # 40: more than the blocks (19), clipped to one block a split; tma: K, V through tensor descriptors
        assert not tma or kernels.tma_ok(k, v)
        with raise_float_errors():
            o, (z, m) = dec.decode_forward(kernels, q, k, v, None, SCALE, None, splits=splits, tma=tma)
        _close(o, want, f"O, splits {splits}")
        _close(m + torch.log(z), lse, f"LSE, splits {splits}")
        _close(m, s.amax(-1), f"M, splits {splits}", 1e-6)


@pytest.mark.parametrize("stem,n_q,group", [("softmax_attention", 3, 3), ("spherical_attention", 7, 1),
                                            ("padded_softmax", 3, 1), ("alibi_softmax", 3, 3)])
def test_backward_from_the_decode_statistics_equals_the_standard_path(stem, n_q, group, op_cache):
    """The standard backward kernels, given the decode forward's O and (Z, M), give the standard path's dQ, dK, dV
    (and the modifier parameters' gradients)."""
    module = _load(stem, op_cache)
    kernels = module.KERNELS
    q, k, v, tensors, do = _draw(stem, n_q, group, batch=B if stem == "padded_softmax" else 1)
    context = _context(module, q, k, tensors)
    grads = {}
    with raise_float_errors():
        for name, forward in (("standard", kernels.forward), ("decode", dec.decode_forward)):
            args = (kernels, q, k, v, None, SCALE, context) if name == "decode" else (q, k, v, None, SCALE, context)
            if name == "decode":
                o, stats = forward(*args, splits=SPLITS)
            else:
                o, stats = forward(*args)
            buffers, grad_args = module._OP._grad_buffers(_in_order(module, tensors))
            dq, dk, dv = kernels.backward(do, q, k, v, o, stats, None, SCALE, context, grad_args)
            grads[name] = [dq, dk, dv, *buffers]
    assert len(grads["decode"]) == 3 + (stem == "alibi_softmax")
    for label, got, want in zip(("dQ", "dK", "dV", "dparam"), grads["decode"], grads["standard"], strict=False):
        _close(got, want, label, 1e-4)


def test_use_decode_rule():
    sms = 132
    assert dec.use_decode(1, 32768, 8 * 16, sms)  # the target: q 1, KV 32k, B 8, 16 heads
    assert dec.use_decode(16, 4096, 64, sms)
    assert not dec.use_decode(17, 32768, 8, sms)  # more queries: the standard forward's tiles fill up
    assert not dec.use_decode(1, dec.DECODE_MIN_KEYS - 1, 8, sms)  # few keys: nothing to split
    assert not dec.use_decode(1, 32768, 2 * sms + 1, sms)  # enough query tiles already


def test_split_count_rule():
    # few kv-head tiles: many splits, each at least MIN_SPLIT_BLOCKS blocks, at most MAX_SPLITS
    assert dec.decode_splits(32768, 1, 64, 132) == dec.MAX_SPLITS
    assert dec.decode_splits(32768, 2, 64, 132) == 66  # one program an SM
    assert dec.decode_splits(32768, 128, 64, 132) == 1  # 128 tiles already fill the SMs
    assert dec.decode_splits(32768, 32, 64, 132) == 4
    assert dec.decode_splits(301, 4, 16, 132) == 4  # 19 blocks: 4 blocks a split at least
    assert dec.decode_splits(40, 4, 16, 132) == 1
    assert dec.decode_splits(32768, 10_000, 64, 132) == 1
    assert dec.packed_rows(1, 1) == 16 and dec.packed_rows(3, 7) == 32 and dec.packed_rows(4, 4) == 16


DOCUMENTS = """\
spec doc_softmax
axis batch, head, query, key
axis dim = 40
in  Q[batch head query dim] : f32
in  K[batch head key dim]   : f32
in  V[batch head key dim]   : f32
in  q_doc[batch query]      : i32
in  k_doc[batch key]        : i32
S[batch head query key] = 0.3 * (Q . K over dim)
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z, mask = q_doc == k_doc)
out O[batch head query dim] = A . V over key
"""


def test_a_split_that_starts_on_keys_a_row_does_not_see(op_cache, tmp_path):
    """Every visible score negative, and the second split's first block (keys 112..127) of another document: that
    split's running max starts at 0 (kernel.py's `_fwd_block` rule for a row that has seen no key yet), the standard
    forward's stays the true (negative) maximum. (Z, M) are then two equivalent pairs: O, M + log Z and every
    gradient agree."""
    path = tmp_path / "doc_softmax.ncd"
    path.write_text(DOCUMENTS)
    module = ncd.load(path, cache_dir=op_cache).module
    kernels = module.KERNELS
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, 1, D, generator=g)
    k = -0.2 * q.expand(1, 1, NK, D) + 0.05 * torch.randn(1, 1, NK, D, generator=g)  # scores about -0.06 |q|^2
    v = torch.randn(1, 1, NK, D, generator=g)
    do = torch.randn(1, 1, 1, D, generator=g)
    k_doc = torch.zeros(1, NK, dtype=torch.int32)
    k_doc[0, 50:130] = 1
    context = _context(module, q, k, {"q_doc": torch.zeros(1, 1, dtype=torch.int32), "k_doc": k_doc})
    with raise_float_errors():
        o, (z, m) = kernels.forward(q, k, v, None, 0.3, context)
        o_d, (z_d, m_d) = dec.decode_forward(kernels, q, k, v, None, 0.3, context, splits=SPLITS)
        # the standard forward's M is the true (negative) maximum; the decode path's 0 with kernel.py's rule today
        # (the pairs differ), the same should that rule keep -inf until a row sees a key
        assert float(m.max()) < -0.5 and float(m_d.max()) in (0.0, float(m.max()))
        _close(o_d, o, "O")
        _close(m_d + z_d.log(), m + z.log(), "M + log Z")
    scores = (0.3 * q.double() @ k.double().transpose(-1, -2)).masked_fill(k_doc[:, None, None, :] != 0, -torch.inf)
    _close(o_d, torch.softmax(scores, -1) @ v.double(), "O against float64")
    with raise_float_errors():
        grads = [kernels.backward(do, q, k, v, out, stats, None, 0.3, context) for out, stats in
                 ((o, (z, m)), (o_d, (z_d, m_d)))]
    for label, got, want in zip(("dQ", "dK", "dV"), grads[1], grads[0], strict=True):
        _close(got, want, label, 1e-4)


def test_no_keys_gives_masked_rows(op_cache):
    """N_K = 0: every row is masked (output 0, z 0, m 0; docs/language.md), with no NaN left from the poisoning."""
    kernels = _load("softmax_attention", op_cache).KERNELS
    q = torch.randn(1, 3, 2, D)
    k = v = torch.zeros(1, 1, 0, D)
    with raise_float_errors():
        o, (z, m) = dec.decode_forward(kernels, q, k, v, None, SCALE)
    assert (o == 0).all() and (z == 0).all() and (m == 0).all()


def test_the_split_kernel_takes_and_bundles_the_spec_in_order():
    """As test_attention_spec_bundle checks kernel.py's: the host passes `**kernels.spec` by name, the device
    functions read the bundle by position."""
    jit = dec.decode_split_kernel
    start = jit.arg_names.index("A1")
    assert tuple(jit.arg_names[start:start + len(Spec._fields)]) == Spec._fields
    (call,) = [node for node in ast.walk(ast.parse(inspect.getsource(jit.fn)))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Spec"]
    assert [arg.id for arg in call.args if isinstance(arg, ast.Name)] == list(Spec._fields)
