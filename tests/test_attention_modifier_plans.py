"""Issue 32: how the attention family plans masks and score modifiers (ncd/families/attention/modifiers.py): what it
rejects and where, what `--emit plan` says, and that blocks a mask empties are never read (block sparsity)."""

from __future__ import annotations

import textwrap

import pytest
import torch
import triton

import ncd
from ncd.errors import CallError, NcdError

from .conftest import ROOT

HEADER = """\
spec t
axis batch, head, query, key
axis dim = 16
in  Q[batch head query dim] : f32
in  K[batch head key dim]   : f32
in  V[batch head key dim]   : f32
"""


def _spec(tmp_path, body: str, name: str = "t.ncd"):
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return path


def _plan_text(run_cli, path) -> str:
    code, out, err = run_cli("compile", str(path), "--emit", "plan")
    assert code == 0, err
    return out


def test_an_exponential_in_the_score_modifier_falls_back_with_the_reason_and_place(tmp_path, run_cli):
    """The attention family refuses it (it could overflow before the stabiliser), at the normalised score; the
    generic family compiles the spec instead."""
    path = _spec(tmp_path, """\
        param slope[head] : f32
        S[batch head query key] = exp(Q . K over dim) + slope * (key - query)
        A[batch head query key] = normalize(S, over key, a1(x) = x, a2(x) = x, b(z) = z)
        out O[batch head query dim] = A . V over key
        """)
    text = _plan_text(run_cli, path)
    assert text.startswith("family: generic")
    assert "declined by attention: t.ncd:9:37: recognised, but: the score modifier" in text
    assert "holds an exponential" in text


def test_a_modifier_in_a_spelled_out_normaliser_says_to_use_normalize(tmp_path):
    from ncd.streaming import certify

    path = _spec(tmp_path, """\
        param slope[head] : f32
        S[batch head query key] = (Q . K over dim) + slope * (key - query)
        E[batch head query key] = exp(S)
        A[batch head query key] = E / sum(E, over key)
        out O[batch head query dim] = A . V over key
        """)
    with pytest.raises(NcdError, match="normalize"):
        certify(ncd.load_spec(path).program)


def test_the_plan_prints_the_mask_and_its_intervals(run_cli):
    text = _plan_text(run_cli, ROOT / "specs" / "sliding_window_softmax.ncd")
    assert "mask: (key <= query) & (key > query - window)" in text
    assert "keys: key in [query - window + 1, query]" in text
    assert "queries: query in [key, key + window - 1]" in text
    text = _plan_text(run_cli, ROOT / "specs" / "alibi_softmax.ncd")
    assert "score modifier: s' = " in text and "slope" in text
    text = _plan_text(run_cli, ROOT / "specs" / "document_softmax.ncd")
    assert "outer bound" in text  # same document: not one interval; causal still bounds the blocks


def test_blocks_the_window_empties_are_never_read():
    """A causal window of 3 over 64 queries and keys (the interpreter's 16 x 16 tiles): query blocks from row 32 on
    never visit key block 0, so NaN in its values and keys reaches no output row past 31 (a visited block, even
    masked, would spread it: 0 * NaN in the products)."""
    op = ncd.load(ROOT / "specs" / "sliding_window_softmax.ncd")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 128, generator=g) for _ in range(3))
    expected = op(q, k, v, 3)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :16] = float("nan")
    v2[:, :, :16] = float("nan")
    out = op(q, k2, v2, 3)
    assert out[:, :, :16].isnan().any()  # the rows that do read key block 0
    assert not out[:, :, 32:].isnan().any()
    torch.testing.assert_close(out[:, :, 32:], expected[:, :, 32:], rtol=0, atol=0)


def test_an_integer_mask_tensor_must_be_an_integer():
    op = ncd.load(ROOT / "specs" / "padded_softmax.ncd")
    q, k, v = (torch.randn(2, 1, 5, 128) for _ in range(3))
    with pytest.raises(CallError, match="kv_len"):
        op(q, k, v, torch.tensor([3.0, 5.0]), torch.tensor([5, 5]))


def test_kernels_that_add_modifier_gradients_start_every_run_from_zero():
    """The dK/dV kernels add each modifier tensor's gradient into G with atomics, and the autotuner runs a config
    many times: each run (and the real launch) must find G zeroed, or the gradient is counted once per run (it was,
    4e3 times over, on the GPU)."""
    from ncd.families.attention import kernel

    g, q = torch.ones(3), torch.zeros(1)
    for kind in ("dkdv", "fused"):
        g.fill_(1.0)
        (config,) = kernel.tile_configs(kind, ())  # the interpreter's single config
        config.pre_hook({"G": (g, 1), "HEAD_DIM": 16, "BLOCK_M": 16, "BLOCK_N": 16, "Q": q, "DO": q, "DS": q})
        assert torch.equal(g, torch.zeros(3)), kind
    (config,) = kernel.tile_configs("fwd", ())
    g.fill_(1.0)
    config.pre_hook({"G": (g, 1), "HEAD_DIM": 16, "BLOCK_M": 16, "BLOCK_N": 16, "Q": q, "K": q, "V": q, "O": q})
    assert torch.equal(g, torch.ones(3))  # the forward accumulates nothing


def test_pruning_keeps_a_config_that_fits_the_shared_memory_when_every_tile_looks_too_large():
    """fp32 at a 192-wide q/k head (tile 256) and a 128-wide value: every forward tile at the validation's small
    lengths needs more shared memory than an H100 has (254,736 bytes against 232,448 on the GPU), and a lone config
    is launched untimed; a single-stage 32 x 32 tile must join it. bf16 at head 128 keeps its list unchanged."""
    from ncd.families.attention import kernel
    from ncd.families.attention.config import DEFAULT_FORWARD_TILES

    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "HEADS_FAST": 0}, num_warps=w, num_stages=s)
               for m, n, w, s, *_ in DEFAULT_FORWARD_TILES]
    small = {"Q_BUCKET": 64, "K_BUCKET": 64}
    wide = kernel._prune(configs, {"Q": torch.zeros(1), **small}, HEAD_DIM=256, HEAD_DIM_V=128)
    fits = [c for c in wide if kernel.shared_memory_estimate(c, 4 * 384) <= kernel.shared_memory_limit()]
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages) for c in fits] == [(32, 32, 1)]
    assert len(wide) >= 2  # timed against the others: Triton skips the ones that do not fit
    narrow = kernel._prune(configs, {"Q": torch.zeros(1, dtype=torch.bfloat16), "Q_BUCKET": 4096,
                                     "K_BUCKET": 4096}, HEAD_DIM=128, HEAD_DIM_V=128)
    assert narrow == configs


def test_the_backward_skips_the_query_blocks_a_prefix_lm_key_never_sees():
    """Prefix-LM's queries per key are [0, N) for a prefix key and [j, N) after it (one interval, through a
    Piecewise bound): the dK/dV programs of keys 32.. never read query block 0, so NaN in those queries leaves
    their dK finite (a visited block, even masked, would spread it through dS^T Q)."""
    op = ncd.load(ROOT / "specs" / "prefix_lm_softmax.ncd")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 64, 128, generator=g) for _ in range(3))
    q[:, :, :16] = float("nan")
    k.requires_grad_()
    out = op(q, k, v, torch.tensor([4], dtype=torch.int32))
    (dk,) = torch.autograd.grad(out[:, :, 16:].sum(), [k])
    assert dk[:, :, :4].isnan().any()  # prefix keys are seen by the NaN queries
    assert not dk[:, :, 32:].isnan().any()


def test_modifier_ops_trace_under_torch_compile_with_their_gradients():
    """The custom op takes the modifier tensors as arguments (the slope with its gradient, integer lengths as
    constants): fullgraph tracing gives the eager op's output and gradients."""
    op = ncd.load(ROOT / "specs" / "alibi_softmax.ncd")
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 20, 128, generator=g) for _ in range(3))
    slope = torch.tensor([0.5, 0.25])
    results = []
    for fn in (op, torch.compile(lambda *a: op(*a), fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, slope)]
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
    for eager, traced in zip(*results, strict=True):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)
    padded = ncd.load(ROOT / "specs" / "padded_softmax.ncd")
    traced = torch.compile(lambda *a: padded(*a), fullgraph=True, backend="aot_eager")
    out = traced(q, k, v, torch.tensor([7], dtype=torch.int32), torch.tensor([15], dtype=torch.int32))
    assert out[:, :, 15:].eq(0).all() and out[:, :, :15].ne(0).any()


GQA_COMBINED = """\
spec gqa_window_alibi
axis batch, query, key
axis kvhead, qgroup
axis head = kvhead * qgroup
axis dim = 16
in  Q[batch head query dim]  : f32
in  K[batch kvhead key dim]  : f32
in  V[batch kvhead key dim]  : f32
in  kv_len[batch] : i32
param slope[head] : f32
in  window : i32 = 6
S[batch head query key] = (Q . K over dim) / 4 + slope * (key - query)
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z,
                                    mask = key <= query and key > query - window and key < kv_len)
out O[batch head query dim] = A . V over key
"""


def test_grouped_heads_with_a_window_padding_and_alibi_match_float64(tmp_path):
    """Grouped K/V heads (each K/V head read by two query heads, a slope per query head), a window, key padding
    and ALiBi together: the validation's default case (odd sizes, the mask inputs drawn to cut them), forward and
    every gradient against the float64 reference."""
    from ncd.validate import validate

    path = tmp_path / "gqa_window_alibi.ncd"
    path.write_text(GQA_COMBINED)
    op = ncd.load(path)
    assert op.plan.family == "attention"
    rows = validate(op, torch.float32, seed=5)
    assert {r.quantity for r in rows} == {"O", "dQ", "dK", "dV", "dslope"}
    for row in rows:
        assert row.ok, row


def test_a_masked_row_whose_first_scores_lie_far_below_zero_is_not_lost_to_underflow(tmp_path):
    """Query 0 sees every key, queries 1.. only keys from 40 on, so the first key block of their tile shows them none;
    their visible scores all lie near -1200. Their running max must stay -inf until they see a key (a stand-in 0
    would make every exp(s - 0) underflow, z = 0, and the row a wrong "masked" 0): output and gradients against the
    float64 formula."""
    path = tmp_path / "late_keys.ncd"
    path.write_text("""spec late_keys
axis batch, head, query, key
axis dim = 16
in  Q[batch head query dim] : f32
in  K[batch head key dim]   : f32
in  V[batch head key dim]   : f32
in  first[batch query] : i32
S[batch head query key] = Q . K over dim
A[batch head query key] = normalize(S, over key, a1(x) = exp(x), a2(x) = exp(x), b(z) = z, mask = key >= first)
out O[batch head query dim] = A . V over key
""")
    op = ncd.load(path, cache_dir=tmp_path / "cache")
    g = torch.Generator().manual_seed(3)
    n_q, n_k = 5, 70
    q = torch.randn(1, 1, 1, 16, generator=g).expand(1, 1, n_q, 16).contiguous()
    k = -1200 * q[:, :, :1] / q[:, :, :1].norm() ** 2 + 0.05 * torch.randn(1, 1, n_k, 16, generator=g)
    v = torch.randn(1, 1, n_k, 16, generator=g)
    first = torch.tensor([[0, 40, 40, 40, 40]], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = op(*leaves, first)
    visible = torch.arange(n_k)[None, :] >= first[0][:, None]
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    s = (exact[0] @ exact[1].transpose(-1, -2)).masked_fill(~visible, -torch.inf)
    want = torch.softmax(s, -1) @ exact[2]
    assert want[0, 0, 1:].abs().max() > 0.1 and s[0, 0, 1:].max() < -500
    assert (out.double() - want).abs().max() < 1e-4 * want.abs().max()
    do = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, leaves, do)
    expected = torch.autograd.grad(want, exact, do.double())
    for a, e in zip(got, expected, strict=True):  # (fp32 scores near -1200 carry ~1e-4 absolute error: 2e-3)
        assert ((a.double() - e).norm() / e.norm()) < 2e-3


def test_a_bias_table_the_batch_shares_gets_heads_fast_forward_tiles():
    """A [head, query, key] bias is read again by every batch entry; heads-fast grid orders bring one tile's batch
    entries together in time (plan.py: batch_shared_table), so the forward's autotune set gets them. A table read at
    an index expression of positions (T5) is small and a per-head slope has no key axis: their sets stay as before."""
    from ncd.backend import plan

    def forward_tiles(stem: str) -> tuple:
        front = ncd.front_end((ROOT / "specs" / f"{stem}.ncd").read_text(), f"{stem}.ncd")
        return plan(front).config.forward_tiles

    biased = forward_tiles("biased_softmax")
    assert any(len(t) == 5 and t[4] == 1 for t in biased)
    assert len(set(biased)) == len(biased)
    for stem in ("alibi_softmax", "t5_bias_softmax", "causal_softmax_attention"):
        assert all(len(t) == 4 or t[4] == 0 for t in forward_tiles(stem)), stem
