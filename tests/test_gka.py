"""Gated KalmaNet core compiled from specs/gka.ncd, run on the CPU Triton interpreter: forward against the naive
per-timestep recurrence running the same Chebyshev iteration, every gradient against autograd through it, final
and initial states, packed sequences, the layer, call-time checks and the recurrence pass's rejections.
Fresh random inputs in the layer's domain at odd sizes (T = 100 with chunk 16, T not a multiple of the chunk);
outputs poisoned with NaN (NCD_POISON_OUTPUTS, tests/conftest.py). Precisions and tiles are forced through the
op's config (ncd/families/recurrence/config.py): `op.with_config(...)` is another op with its own generated module,
never a change to a module's globals."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import ncd
from ncd.errors import CallError
from ncd.families.recurrence import kernel as kernels
from ncd.families.recurrence.reference import chunked_gka, naive_gka
from ncd.ops import chunk_gka, shipped_spec

from .conftest import ROOT, raise_float_errors, with_alpha

K, V = 32, 24
EXACT = {"dot_precision": "ieee"}  # IEEE fp32 products, as gka_op's, for tests going through ncd.ops (its config=)


@pytest.fixture(scope="module")
def gka_op():
    """The op with IEEE fp32 products: the interpreter's exact arithmetic then shows the chunked algorithm's own
    error. The default scaled-fp16 products have their own tests (test_default_fp16_...). Other precisions and
    tiles: `gka_op.with_config(...)`, overrides added to this op's."""
    return ncd.load(shipped_spec("gka"), sizes={"kdim": K, "vdim": V}).with_config(**EXACT)


@pytest.fixture(scope="module")
def gka_module(gka_op):
    """gka_op's generated module."""
    return gka_op.module


def draw(B=2, T=53, H=2, gen_seed=None, beta=True, alpha=True):  # four chunks of 16, the last partial
    gen = torch.Generator().manual_seed(gen_seed if gen_seed is not None else torch.randint(1 << 30, ()).item())
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3.0)
    b = torch.sigmoid(torch.randn(B, T, H, generator=gen)) if beta else None
    a = torch.sigmoid(torch.randn(B, T, H, generator=gen)) if alpha else None
    return q, k, v, g, b, a


def rms_ratio(value: torch.Tensor, ref: torch.Tensor) -> float:
    value, ref = value.detach().double(), ref.detach().double()
    assert not torch.isnan(value).any()
    return float((value - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def token_errors(value: torch.Tensor, ref: torch.Tensor, floor: float = 1e-2) -> torch.Tensor:
    """Per-row relative errors (a row: one index of every axis but the last, one token of one head):
    ||value_i - ref_i|| / max(||ref_i||, floor * RMS of the reference's row norms). A whole-tensor norm hides a few
    bad tokens among many good ones (fp16 products put the first tokens 7-27% off at 0.74% overall)."""
    value, ref = value.detach().double(), ref.detach().double()
    value, ref = value.reshape(-1, value.shape[-1]), ref.reshape(-1, ref.shape[-1])
    norms = ref.norm(dim=1)
    denom = torch.clamp(norms, min=floor * float(norms.pow(2).mean().sqrt()) + 1e-300)
    return (value - ref).norm(dim=1) / denom


def worst_token(value: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(value).any()
    return float(token_errors(value, ref).max())


def f64(ts):
    return [t.double() if t is not None else None for t in ts]


def test_forward_matches_the_naive_recurrence_and_is_close_to_the_exact_solve(gka_module):
    inputs = draw()
    o, _ = gka_module.chunk(*inputs[:5], alpha=inputs[5], chunk_size=16)
    ref, _ = naive_gka(*f64(inputs))
    exact, _ = naive_gka(*f64(inputs), exact=True)
    assert rms_ratio(o, ref) <= 0.005
    assert rms_ratio(o, ref) < 1e-4  # fp32 against fp64, same algorithm
    assert worst_token(o, ref) < 1e-3  # and every token of it
    vs_exact = rms_ratio(o, exact)
    print(f"GKA forward vs exact solve: RMS ratio {vs_exact:.2e} (30 Chebyshev steps)")
    assert vs_exact < 0.05


def test_inference_call_skips_the_saved_solution_and_gives_the_same_output(gka_module, monkeypatch):
    """Without a backward to follow (no_grad, or no input requiring a gradient) the solve does not store x; the
    output is the same bits as a call that saves it for the backward."""
    saved = []
    forward = gka_module.forward

    def spy(*args):
        out = forward(*args)
        saved.append(out[3].numel())
        return out

    monkeypatch.setattr(gka_module, "forward", spy)
    inputs = draw()
    leaves = [t.clone().requires_grad_() for t in inputs]
    with_grad, _ = gka_module.chunk(*leaves[:5], alpha=leaves[5], chunk_size=16)
    with torch.no_grad():
        in_no_grad, _ = gka_module.chunk(*leaves[:5], alpha=leaves[5], chunk_size=16)
    plain, _ = gka_module.chunk(*inputs[:5], alpha=inputs[5], chunk_size=16)
    assert saved == [inputs[0].numel(), 0, 0]
    assert torch.equal(with_grad.detach(), in_no_grad) and torch.equal(in_no_grad, plain)


def test_torch_compile_sees_the_custom_ops_and_eager_calls_skip_them(gka_module, monkeypatch):
    """torch.compile(fullgraph=True) of the op (its custom ops, fake tensors, registered autograd) gives the eager
    output, final state and gradients; eager calls run the kernels' autograd.Function, never the custom ops."""
    from ncd.op_runtime import REGISTERED

    leaves = [t.clone().requires_grad_() for t in draw(T=21)]  # two chunks of 16: the compile, not the numerics

    def run(*args):
        o, (h, s) = gka_module.chunk(*args[:5], alpha=args[5], chunk_size=16, output_final_state=True)
        return o, h, s

    def loss(outs):  # every output reaches the backward, the final states too
        return sum((out * torch.linspace(-1, 1, out.shape[-1])).sum() for out in outs)

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")(*leaves)
    compiled_grads = torch.autograd.grad(loss(compiled), leaves)
    ident = gka_module.__name__.removeprefix("ncd_generated_")
    kernel_ops = [k for name, k in REGISTERED.items() if name == f"ncd::{ident}"]
    assert len(kernel_ops) == 1, sorted(REGISTERED)

    def no_dispatch(*args, **kwargs):
        raise AssertionError("an eager call dispatched through a custom op")
    for name in ("forward_op", "backward_op"):
        monkeypatch.setattr(kernel_ops[0], name, no_dispatch)
    eager = run(*leaves)
    for got, want in zip(eager, compiled, strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(torch.autograd.grad(loss(eager), leaves), compiled_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("beta,alpha", [(True, True), (False, False)])
def test_all_gradients_and_states_match_autograd_through_the_naive_recurrence(gka_module, beta, alpha):
    B, H = 2, 2
    inputs = draw(B=B, H=H, beta=beta, alpha=alpha)
    h0 = torch.randn(B, H, K, K)
    h0 = h0 @ h0.transpose(-1, -2) * 0.05  # a covariance: symmetric positive semi-definite
    s0 = torch.randn(B, H, K, V) * 0.1
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (*inputs, h0, s0)]
    with raise_float_errors():
        o, (h_fin, s_fin) = gka_module.chunk(*leaves[:5], initial_state=(leaves[6], leaves[7]),
                                              output_final_state=True, alpha=leaves[5], chunk_size=16)
        do, dh, ds = torch.randn_like(o), torch.randn_like(h_fin), torch.randn_like(s_fin)
        present = [t for t in leaves if t is not None]
        grads = torch.autograd.grad((o * do).sum() + (h_fin * dh).sum() + (s_fin * ds).sum(), present)

    ref_leaves = [t.detach().double().requires_grad_() if t is not None else None for t in leaves]
    ref, (h_ref, s_ref) = naive_gka(*ref_leaves[:6], initial_state=(ref_leaves[6], ref_leaves[7]))
    ref_present = [t for t in ref_leaves if t is not None]
    ref_grads = torch.autograd.grad((ref * do.double()).sum() + (h_ref * dh.double()).sum()
                                    + (s_ref * ds.double()).sum(), ref_present)
    assert rms_ratio(o, ref) <= 0.005 and worst_token(o, ref) < 1e-3
    assert rms_ratio(h_fin, h_ref) < 1e-5 and rms_ratio(s_fin, s_ref) < 1e-5
    names = [n for n, t in zip(["q", "k", "v", "g", "beta", "alpha", "h0", "s0"], leaves, strict=True) if t is not None]
    for name, got, want in zip(names, grads, ref_grads, strict=True):
        assert rms_ratio(got, want) <= 0.02, name
    # q's gradient is exact for Chebyshev (papers/gated-kalmanet.txt, Lemma 2): implicit == autograd
    assert rms_ratio(grads[0], ref_grads[0]) < 1e-5


def _forward_and_grads(core, inputs, initial_state=None):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in inputs]
    state = None if initial_state is None else tuple(t.clone().requires_grad_() for t in initial_state)
    o, _ = core(*leaves, initial_state=state)
    present = [t for t in (*leaves, *(state or ())) if t is not None]
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(o.dtype)
    return o, torch.autograd.grad((o * do).sum(), present)


def _tolerances(dtype="float32", split=True):
    """The limits the recurrence plan states at `dtype` for split (the defaults) or single 10-bit products (the ones
    `ncd check` applies)."""
    from ncd.backend import plan

    output, gradient = plan(ncd.load(shipped_spec("gka"), sizes={"kdim": K, "vdim": V}).front).bounds(split)
    return {"o": output[dtype], "grad": gradient[dtype]}


def test_fp16_products_have_ten_bit_accuracy(gka_op):
    """The fp16 products (dot_precision "fp16": scaled fp16, TF32's 10-bit mantissa) against the float64 recurrence
    at slow gates (tests/test_gka_trust.py has fast ones). The solve's
    sensitivity to operand rounding is about eps / ridge = 2^-11 / 0.02 = 2.4e-2 (kappa <= 1 / ridge + 1), reached
    on the first tokens of a sequence where H_t has rank one; measured 5.6e-3 to 7.8e-3 for o, up to 1.9e-2 for
    dalpha."""
    fp16 = gka_op.with_config(dot_precision="fp16").module  # fp32 inputs default to fp32-class products
    inputs = draw(T=53)
    o, grads = _forward_and_grads(with_alpha(fp16.chunk, chunk_size=16), inputs)
    ref, ref_grads = _forward_and_grads(naive_gka, f64(inputs))
    exact = gka_op.with_config(dot_precision="ieee").module
    with torch.no_grad():
        o_exact, _ = with_alpha(exact.chunk, chunk_size=16)(*inputs, initial_state=None)
    errors = {name: rms_ratio(got, want) for name, got, want in
              zip(["o", "q", "k", "v", "g", "beta", "alpha"], (o, *grads), (ref, *ref_grads), strict=True)}
    print("GKA fp16 products vs float64:", ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    assert rms_ratio(o, o_exact) > 1e-5  # the products did run in fp16
    bound = _tolerances("float16", split=False)  # the plan's bounds for 10-bit-mantissa products
    assert errors.pop("o") <= bound["o"]
    assert max(errors.values()) <= bound["grad"]  # two solves' rounding: x and the adjoint z


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_split_fp16_products_match_fp32_products(gka_op, dtype):
    """The backward's accumulation kernels multiply fp16x3 products by default (each fp32 operand split into two
    scaled fp16 ones, three products): about fp32 accuracy, which the gate gradient's cancelling sums need (TF32
    puts dg 4e-2 from float64 at T = 2048). Against the same backward with IEEE fp32 products every gradient agrees
    to 1e-5; without the low halves (one fp16 product) they differ by 1e-3 to 7e-3. (The solves run IEEE products
    in both: the default fp16 solve's own rounding would hide the difference.) bf16 keys, values and dO enter the
    products unsplit (one or two products): the fp32 gradients (g, beta, alpha, which every changed product feeds)
    still agree to 1e-5, and q, k, v's to their bf16 rounding."""
    default = gka_op.with_config(dot_precision=None, grad_precision=None)
    assert kernels.grad_precision(default.module.CONFIG, dtype) == "fp16x3"
    split_op = gka_op.with_config(dot_precision="ieee", grad_precision="fp16x3")
    q, k, v, g, b, a = draw(T=53)
    inputs = [q.to(dtype), k.to(dtype), v.to(dtype), g, b, a]
    _, split = _forward_and_grads(with_alpha(split_op.module.chunk, chunk_size=16), inputs)
    exact_op = split_op.with_config(grad_precision="ieee")
    _, exact = _forward_and_grads(with_alpha(exact_op.module.chunk, chunk_size=16), inputs)
    errors = {name: rms_ratio(a, b) for name, a, b in
              zip(["q", "k", "v", "g", "beta", "alpha"], split, exact, strict=True)}
    print(f"GKA fp16x3 backward vs fp32 products, {dtype}:", ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    assert max(errors[n] for n in ("g", "beta", "alpha")) <= 1e-5
    assert max(errors[n] for n in ("q", "k", "v")) <= (1e-5 if dtype == torch.float32 else 2.0 ** -9)


@pytest.mark.parametrize("precision,bound", [("ieee", 1e-5), ("fp16", 5e-4)])
def test_saved_norms_match_the_frobenius_norm_of_the_naive_states(gka_op, precision, bound):
    """||H_t||_F as the forward saves it: the Gram term in the norm kernel, each chunk's initial-state terms from
    the H scan (an initial state, so they matter from the first chunk). Default precision: the Gram term from
    scaled fp16 operands."""
    from ncd.families.recurrence.reference import _scaled

    module = gka_op.with_config(dot_precision=precision).module
    q, k, v, g, b, a = draw(B=1, H=2, T=45)
    h0 = torch.randn(1, 2, K, K)
    h0 = h0 @ h0.transpose(-1, -2) / K
    s0 = torch.randn(1, 2, K, V)
    *_, norm = module.forward(q, k, v, g, None, b, a, h0, s0, None, K ** -0.5, 0.02, 0.0, 3, 16, False)
    kb, _ = _scaled(k.double(), v.double(), b.double())
    state, want = h0.double(), []
    for t in range(q.shape[1]):
        state = g[:, t].double().exp()[..., None, None] * state + kb[:, t, :, :, None] * kb[:, t, :, None, :]
        want.append(state.pow(2).sum((-1, -2)).sqrt())
    want = torch.stack(want, 1)
    assert float(((norm.double() - want).abs() / want).max()) <= bound


def test_fp16_products_scale_operands_into_range(gka_op):
    """States, keys and values far beyond fp16's range (65504 for values, their squares for keys): the scaled
    operands keep the default path finite and as accurate as at unit scale (unscaled, o would be NaN)."""
    B, H = 1, 2
    q, k, v, g, b, a = draw(B=B, H=H, T=40)
    h0 = torch.randn(B, H, K, K)
    h0 = h0 @ h0.transpose(-1, -2) * 1e5
    s0 = torch.randn(B, H, K, V) * 1e5
    inputs = (q, k * 30, v * 1e5, g, b, a)
    fp16 = gka_op.with_config(dot_precision="fp16").module
    o, grads = _forward_and_grads(with_alpha(fp16.chunk, chunk_size=16), inputs, (h0, s0))
    ref, ref_grads = _forward_and_grads(naive_gka, f64(inputs), (h0.double(), s0.double()))
    bound = _tolerances("float16", split=False)
    assert rms_ratio(o, ref) <= bound["o"]
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(got).all() and rms_ratio(got, want) <= bound["grad"]


def test_fp16_chunk_states_read_back_across_tiles_of_different_scales(gka_op):
    """The forward's scans store fp16 state tiles over their own power-of-two scales; the solve (H_0, and S_0 in its
    output) puts the tiles of one block back on a common scale. With 16 x 16 scan tiles (H in 2 x 2 tiles, S in
    2 x 2, an output block spanning two) and an initial state whose blocks differ by 1e4, a misplaced tile scale
    would be off by orders of magnitude; read back right, o is as accurate as with one tile per state, also with the
    output split into 16-column blocks."""
    fp16 = gka_op.with_config(dot_precision="fp16")
    q, k, v, g, b, a = draw(B=1, H=2, T=40)
    rows = torch.cat([torch.full((K // 2,), 1.0), torch.full((K // 2,), 100.0)])
    h0 = torch.randn(1, 2, K, K) * rows[:, None]
    h0 = h0 @ h0.transpose(-1, -2) / K
    s0 = torch.randn(1, 2, K, V) * rows[:, None]
    ref, _ = naive_gka(*f64((q, k, v, g, b, a)), initial_state=(h0.double(), s0.double()))
    one_tile, _ = fp16.module.chunk(q, k, v, g, b, initial_state=(h0, s0), alpha=a, chunk_size=16)
    tiles = fp16.with_config(scan_tiles_fwd=(16, 16, 4))
    tiled, _ = tiles.module.chunk(q, k, v, g, b, initial_state=(h0, s0), alpha=a, chunk_size=16)
    blocks = tiles.with_config(output_bv=16)  # the solve's output over two blocks of value columns
    split = blocks.module.chunk(q, k, v, g, b, initial_state=(h0, s0), alpha=a, chunk_size=16)[0]
    bound = _tolerances("float16", split=False)["o"]
    assert rms_ratio(one_tile, ref) <= bound
    assert rms_ratio(tiled, ref) <= bound
    assert rms_ratio(split, ref) <= bound


def test_output_value_column_blocks_agree_with_one_block(gka_op, gka_module):
    """The solve's output walks the value columns in blocks of OUTPUT_BV inside one program per chunk (V = 24: one
    block of 32, or two of 16 whose second is partly masked); with IEEE products the two agree to rounding."""
    inputs = draw(B=1, H=2, T=45)
    one_block, _ = gka_module.chunk(*inputs[:5], alpha=inputs[5], chunk_size=16)
    two_blocks, _ = gka_op.with_config(output_bv=16).module.chunk(*inputs[:5], alpha=inputs[5], chunk_size=16)
    assert rms_ratio(two_blocks, one_block) <= 1e-6


def test_fp16_products_scan_bf16_inputs_with_bf16_products_within_the_bf16_limits(gka_op, monkeypatch):
    """bf16 inputs with the fast fp16 products (dot_precision "fp16"): the forward's state scans multiply bf16
    operands (the keys or values exactly, the weighted keys rounded); the backward recomputes its states with TF32
    products. Output, final states and gradients against the float64 recurrence on the same bf16 inputs, within the
    bf16 limits the plan states (at these slow gates; tests/test_gka_trust.py has the fast ones). The default
    (fp16x3) splits the scans' operands as well."""
    assert kernels.scan_precision(gka_op.with_config(dot_precision=None).module.CONFIG, torch.bfloat16) == "fp16x3"
    by_dtype = gka_op.with_config(dot_precision="fp16").module
    q, k, v, g, b, a = draw(T=53)
    inputs = [t.bfloat16() for t in (q, k, v)] + [g, b.bfloat16(), a.bfloat16()]
    assert kernels.scan_precision(by_dtype.CONFIG, torch.bfloat16) == "bf16"
    assert kernels.scan_precision(gka_op.with_config(dot_precision=None).module.CONFIG, torch.float32) == "ieee"
    o, grads = _forward_and_grads(with_alpha(by_dtype.chunk, chunk_size=16), inputs)
    ref, ref_grads = _forward_and_grads(naive_gka, f64(inputs))
    bound = _tolerances("bfloat16", split=False)
    assert o.dtype == torch.bfloat16
    assert rms_ratio(o, ref) <= bound["o"]
    for name, got, want in zip(["q", "k", "v", "g", "beta", "alpha"], grads, ref_grads, strict=True):
        assert rms_ratio(got, want) <= bound["grad"], name
    _, (h_bf16, s_bf16) = by_dtype.chunk(*inputs[:5], output_final_state=True, alpha=inputs[5], chunk_size=16)
    monkeypatch.setattr(kernels, "scan_precision", lambda config, dtype: "tf32")
    _, (h_tf32, s_tf32) = by_dtype.chunk(*inputs[:5], output_final_state=True, alpha=inputs[5], chunk_size=16)
    _, (h_ref, s_ref) = naive_gka(*f64(inputs))
    for got, other, want in ((h_bf16, h_tf32, h_ref), (s_bf16, s_tf32, s_ref)):
        print(f"final state vs float64: bf16 scan {rms_ratio(got, want):.1e}, TF32 {rms_ratio(other, want):.1e}")
        assert rms_ratio(got, other) > 1e-6  # the bf16 products did run
        assert rms_ratio(got, want) <= 2.0 ** -8 and rms_ratio(other, want) <= 2.0 ** -10


def test_packed_sequences_equal_separate_runs(gka_module):
    lengths = [37, 16, 50]
    q, k, v, g, b, a = draw(B=1, T=sum(lengths))
    cu = torch.tensor([0, 37, 53, 103], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, b, a)]
    o, (h_fin, _) = gka_module.chunk(*leaves[:5], cu_seqlens=cu, output_final_state=True, alpha=leaves[5],
                                     chunk_size=16)
    do = torch.randn_like(o)
    grads = torch.autograd.grad((o * do).sum(), leaves)
    for n, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        part = [t[:, lo:hi].clone().requires_grad_() for t in (q, k, v, g, b, a)]
        o_n, (h_n, _) = gka_module.chunk(*part[:5], output_final_state=True, alpha=part[5], chunk_size=16)
        grads_n = torch.autograd.grad((o_n * do[:, lo:hi]).sum(), part)
        assert rms_ratio(o[:, lo:hi], o_n) < 1e-6
        assert rms_ratio(h_fin[n], h_n[0]) < 1e-6
        for got, want in zip(grads, grads_n, strict=True):
            assert rms_ratio(got[:, lo:hi], want) < 1e-5


def test_packed_layout_is_read_from_the_device_once_per_step(gka_module, monkeypatch):
    """The call check, the forward and the backward share one read of cu_seqlens (a host sync on a GPU); an
    in-place change of cu_seqlens is seen by the next call."""
    reads = []
    tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(self.numel())
        return tolist(self)

    q, k, v, g, b, a = draw(B=1, T=60)
    cu = torch.tensor([0, 25, 60], dtype=torch.int32)
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, b, a)]
    o, _ = gka_module.chunk(*leaves[:5], cu_seqlens=cu, alpha=leaves[5], chunk_size=16)
    o.sum().backward()
    assert reads == [3]
    cu[1] = 40  # same tensor, new layout: read again, and the result follows the new boundaries
    o2, _ = gka_module.chunk(*(t.detach() for t in leaves[:5]), cu_seqlens=cu, alpha=leaves[5].detach(), chunk_size=16)
    assert reads == [3, 3]
    monkeypatch.undo()
    first, _ = gka_module.chunk(q[:, :40], k[:, :40], v[:, :40], g[:, :40], b[:, :40], alpha=a[:, :40], chunk_size=16)
    assert rms_ratio(o2[:, :40], first) < 1e-6

def test_chunked_torch_reference_and_public_op_agree_with_the_naive_recurrence():
    inputs = draw(T=45)
    ref, _ = naive_gka(*f64(inputs))
    assert rms_ratio(chunked_gka(*inputs, chunk=16), ref) < 1e-4
    o, state = chunk_gka(*inputs[:5], alpha=inputs[5], num_iter=10, chunk_size=32, config=EXACT)
    ref10, _ = naive_gka(*f64(inputs), num_iter=10)
    assert state is None and rms_ratio(o, ref10) < 1e-4


def test_layer_runs_forward_and_backward_and_uses_the_compiled_core(monkeypatch):
    from ncd import layers

    torch.manual_seed(0)
    layer = layers.GatedKalmaNet(hidden_size=2 * K, num_heads=2, num_iter=12, chunk_size=16)
    x = torch.randn(2, 29, 2 * K, requires_grad=True)
    y = layer(x)
    y.square().mean().backward()
    assert y.shape == x.shape and torch.isfinite(x.grad).all() and torch.isfinite(layer.A_log.grad).all()

    def naive_core(q, k, v, g, beta, alpha, scale, ridge, num_iter, initial_state, output_final_state,
                   cu_seqlens, chunk_size, gate_covariance):
        assert gate_covariance
        o, _ = naive_gka(q.double(), k.double(), v.double(), g.double(), beta.double(), alpha.double(), scale,
                         ridge, num_iter)
        return o.float(), None

    monkeypatch.setattr(layers, "chunk_gka", partial(chunk_gka, config=EXACT))  # the layer's core, IEEE products
    y = layer(x)
    monkeypatch.setattr(layers, "chunk_gka", naive_core)
    assert rms_ratio(y, layer(x)) < 1e-4


def test_the_layer_survives_pickle_deepcopy_and_torch_save(tmp_path):
    """A GatedKalmaNet layer pickled, deep-copied and saved with torch.save (whole module, not a state dict) comes
    back with its parameters and computes the same output: no compiled op or kernel handle is captured in it."""
    import copy
    import pickle

    from ncd import layers

    torch.manual_seed(1)
    layer = layers.GatedKalmaNet(hidden_size=2 * K, num_heads=2, num_iter=5, chunk_size=16)
    x = torch.randn(1, 21, 2 * K)
    want = layer(x)
    torch.save(layer, tmp_path / "layer.pt")
    copies = [pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer),
              torch.load(tmp_path / "layer.pt", weights_only=False)]
    for other in copies:
        assert other is not layer and other.num_iter == 5 and other.chunk_size == 16
        assert all(torch.equal(a, b) for a, b in zip(layer.state_dict().values(), other.state_dict().values(),
                                                    strict=True))
        assert torch.isfinite(want).all() and torch.equal(other(x), want)


def test_call_time_errors_name_the_tensor_and_axis(gka_module):
    q, k, v, g, b, a = draw(T=20)
    with pytest.raises(CallError, match="v: axis 'time' has size 19"):
        gka_module.chunk(q, k, v[:, :19], g, b, alpha=a)
    with pytest.raises(CallError, match="k: axis 'kdim' has size 31, but the spec fixes it at 32"):
        gka_module.chunk(q, k[..., :31], v, g, b, alpha=a)
    with pytest.raises(CallError, match="batch 1"):
        gka_module.chunk(q, k, v, g, b, cu_seqlens=torch.tensor([0, 20], dtype=torch.int32), alpha=a)
    with pytest.raises(CallError, match="cu_seqlens must rise from 0 to 20"):
        gka_module.chunk(*(t[:1] for t in (q, k, v, g, b)), cu_seqlens=torch.tensor([0, 7, 5, 20]), alpha=a[:1])
    with pytest.raises(CallError, match="cu_seqlens must rise from 0 to 20"):  # rejected before any chunking
        gka_module.chunk(*(t[:1] for t in (q, k, v, g, b)), cu_seqlens=torch.tensor([0, 10**12]), alpha=a[:1])
    with pytest.raises(CallError, match="dtype"):
        gka_module.chunk(q, k.to(torch.float16), v, g, b, alpha=a)
    with pytest.raises(CallError, match=r"initial_state\[0\] must have shape"):
        gka_module.chunk(q, k, v, g, b, initial_state=(torch.zeros(2, 2, K, V), torch.zeros(2, 2, K, V)), alpha=a)


BASE = (ROOT / "specs" / "gka.ncd").read_text()


@pytest.mark.parametrize("old,new,message", [
    ("U[batch time head vdim kdim] = scan(exp(g) * prev", "U[batch time head vdim kdim] = scan(exp(beta) * prev",
     "beta serves as both the log gate of U and the scaling"),
    ("U[batch time head vdim kdim] = scan(exp(g) * prev", "U[batch time head vdim kdim] = scan(sigmoid(g) * prev",
     "expected a gate exp(g)"),
    ("L = normH + lam)", "L = normH)", "expected L = ||H||_F + lam"),
    ("mu = lam,", "mu = normH,", "expected mu = lam"),
    ("lam[batch time head] = ridge * normH", "lam[batch time head] = ridge * normH * normH",
     "the family takes lam = ridge * n + offset"),
    ("lam[batch time head] = ridge * normH", "lam[batch time head] = ridge * normH - 0.5",
     "must be positive"),
    ("lam[batch time head] = ridge * normH", "lam[batch time head] = ridge * sum(H, over kdim kcol)",
     "not one of them"),
    ("qa[batch time head kdim] = q + alpha * (x[batch time head kdim] - q)",
     "qa[batch time head kdim] = q + alpha * x[batch time head kdim]", "alpha-connection"),
])
def test_recurrence_declines_what_it_cannot_chunk_with_its_location(tmp_path, old, new, message):
    assert old in BASE
    spec = tmp_path / "gka_variant.ncd"
    spec.write_text(BASE.replace(old, new))
    result = subprocess.run([sys.executable, "-m", "ncd.cli", "compile", str(spec), "--emit", "plan"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr  # the generic family compiles it from the IR
    assert result.stdout.startswith("family: generic")
    declined = [line for line in result.stdout.splitlines() if "declined by recurrence: gka_variant.ncd:" in line]
    assert declined and message in declined[0], result.stdout
    assert "ncd: note: recurrence: gka_variant.ncd:" in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr


def test_solve_is_tuned_per_step_count(gka_module):
    """The solve's best warps depend on its step count (H200, T = 8192: tuned at num_iter 0, 8 warps; kept for
    10 steps that cost 1,108 us against 677 with 4), so num_iter is part of its autotune key."""
    assert "n_iter" in kernels._solve.keys


def test_every_tuned_kernel_is_tuned_per_problem_size(gka_module):
    """A config tuned on a small first call (bench/gka.py's 300-token check, a model's warm-up) must not be reused
    at full size: the (then separate) output kernel kept one that ran 225 us against 157 at T = 4096 (H100). So
    every autotuned kernel's key holds WORK, the chunk x head count rounded up to a power of two."""
    import triton

    tuned = {name: obj for name, obj in vars(kernels).items() if isinstance(obj, triton.runtime.Autotuner)}
    assert {"_norm_fwd", "_solve", "_grads_h", "_grads_s"} <= set(tuned)
    for name, kernel in tuned.items():
        assert "WORK" in kernel.keys, name
    assert kernels._work(5, 2) == 16 and kernels._work(512, 8) == 4096


def test_every_launch_passes_only_arguments_its_kernel_takes(gka_op, monkeypatch):
    """A compiled GPU launch rejects a keyword its kernel does not declare; the interpreter accepts it silently (the
    backward's untuned scan was passed WORK, and failed only on the GPU). So every launch of a forward and backward,
    with initial and final states, is checked against the kernel's parameters here, and each launch's kernel must
    reach fit_carveout (ncd/families/recurrence/carveout.py)."""
    import inspect

    import triton

    by_dtype = gka_op.with_config(dot_precision=None).module
    launched = set()

    def python_function(kernel):
        while hasattr(kernel, "fn"):
            kernel = kernel.fn
        return kernel

    class StrictKernel:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel
            self.params = set(inspect.signature(python_function(kernel)).parameters)
            self.options = set() if isinstance(kernel, triton.runtime.Autotuner) else {"num_warps", "num_stages"}

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.add(self.name)
                assert len(args) + len(kwargs) <= len(self.params) + len(self.options), self.name
                assert set(kwargs) <= self.params | self.options, (self.name, set(kwargs) - self.params - self.options)
                self.kernel[grid](*args, **kwargs)
                return self.name  # stands for the compiled kernel, which the interpreter does not return
            return launch

    launchable = {name: obj for name, obj in vars(kernels).items() if name.startswith("_") and hasattr(obj, "fn")
                  and "tl.program_id" in inspect.getsource(python_function(obj))}  # launched, not device functions
    for name, kernel in launchable.items():
        monkeypatch.setattr(kernels, name, StrictKernel(name, kernel))
    fitted = []
    monkeypatch.setattr(kernels, "_fit_carveout", fitted.append)
    q, k, v, g, b, a = draw(B=1, H=2, T=20)
    h0 = torch.randn(1, 2, K, K)
    state = (h0 @ h0.transpose(-1, -2) / K, torch.randn(1, 2, K, V))
    _forward_and_grads(with_alpha(by_dtype.chunk, chunk_size=16, output_final_state=True), (q, k, v, g, b, a), state)
    assert launched == set(launchable)
    assert set(fitted) == launched and len(fitted) == 11  # 3 forward launches, 8 backward (its own state scan too)


def test_plan_shows_the_derived_chunked_form():
    spec = str(ROOT / "specs" / "gka.ncd")
    result = subprocess.run([sys.executable, "-m", "ncd.cli", "compile", spec, "--emit", "plan"],
                            capture_output=True, text=True, check=True)
    expected_lines = ("1/(2*a + 1)", "Gram form", "implicit differentiation", "gka.ncd:26", "(bt + 1/1000000)",
                      "config:", "iterations 30, ridge 0.02", "scan tiles")
    for expected in expected_lines:
        assert expected in result.stdout


def test_generated_module_holds_the_hooks_and_config_and_the_kernels_are_static():
    """The kernels live in families/recurrence/kernel.py; the generated module holds only the spec's device functions
    (the scalings and their derivatives, with origins) and the plan's config as literals, which the op uses."""
    import inspect

    import triton

    from ncd.backend import plan

    op = ncd.load(shipped_spec("gka"), sizes={"kdim": K, "vdim": V})
    jitted = {name for name, obj in vars(op.module).items() if isinstance(obj, triton.runtime.JITFunction)
              or type(obj).__name__ == "InterpretedFunction"}
    assert jitted == {"_key_scale", "_value_scale", "_key_scale_grad", "_value_scale_grad"}
    assert not any(isinstance(obj, triton.runtime.Autotuner) for obj in vars(op.module).values())
    text = op.path.read_text()
    assert "tl.dot" not in text and "gka.ncd:24" in inspect.getsource(op.module._key_scale.fn)
    assert len(text.splitlines()) <= 300  # issue 31's target for a generated module
    config = plan(op.front).config
    embedded = op.module.CONFIG  # the shipped op's own module (the fixtures' precisions are ops of their own)
    assert embedded == config.with_settings()
    defaults = (op.module.RIDGE, op.module.ITERATIONS, op.module.CHUNK)  # the op's keyword defaults
    assert defaults == (config.ridge, config.iterations, config.chunk)
    assert op.module.HOOKS.rho(0.02) == pytest.approx(1 / 1.04)
    with pytest.raises(ValueError, match="dot_precision must be None or one of"):
        dataclasses.replace(config, dot_precision="fp8")


def test_precision_settings_are_validated(monkeypatch):
    from ncd.settings import Settings

    monkeypatch.setenv("NCD_GKA_DOT_PRECISION", "FP16")
    monkeypatch.setenv("NCD_GKA_GRAD_PRECISION", "tf32")
    parsed = Settings.from_env()
    assert (parsed.gka_dot_precision, parsed.gka_grad_precision) == ("fp16", "tf32")
    monkeypatch.setenv("NCD_GKA_GRAD_PRECISION", "fp16")  # the backward's products are never unscaled fp16
    with pytest.raises(ValueError,
                       match="NCD_GKA_GRAD_PRECISION must be one of fp16x3, tf32x3, tf32, ieee, not 'fp16'"):
        Settings.from_env()


@pytest.mark.parametrize("beta, alpha", [(True, True), (False, False)])
def test_decoding_token_by_token_continues_a_chunked_prefill(gka_module, beta, alpha):
    """`recurrent` (the decoding kernels) from the state a chunked prefill ends
    in gives the chunked op's outputs for the following tokens, one token per call and several per call, and the
    chunked op's final states; from zero states over the whole sequence too."""
    inputs = draw(B=2, T=45, beta=beta, alpha=alpha)
    q, k, v, g, b, a = inputs
    full, (h_full, s_full) = gka_module.chunk(q, k, v, g, b, alpha=a, output_final_state=True, chunk_size=16)
    split = 37  # the prefill ends inside a chunk
    _, state = gka_module.chunk(*(t[:, :split] if t is not None else None for t in (q, k, v, g, b)),
                                alpha=a[:, :split] if a is not None else None, output_final_state=True,
                                chunk_size=16)
    steps = []
    for lo, hi in ((split, split + 1), (split + 1, split + 2), (split + 2, 45)):  # one token, one, the rest
        part = [x[:, lo:hi] if x is not None else None for x in inputs]
        o, state = gka_module.recurrent(*part[:5], initial_state=state, alpha=part[5])
        steps.append(o)
    assert rms_ratio(torch.cat(steps, 1), full[:, split:]) < 1e-5
    assert rms_ratio(state[0], h_full) < 1e-5 and rms_ratio(state[1], s_full) < 1e-5
    whole, (h, s) = gka_module.recurrent(q, k, v, g, b, alpha=a)
    assert torch.isfinite(whole).all() and rms_ratio(whole, full) < 1e-5
    assert rms_ratio(h, h_full) < 1e-5 and rms_ratio(s, s_full) < 1e-5
    ref, _ = naive_gka(*f64(inputs))
    assert rms_ratio(whole, ref) < 1e-5
    if beta:  # the public function, any head size (a compile of its own: once)
        top, _ = ncd.ops.recurrent_gka(q, k, v, g, b, alpha=a, config=EXACT)
        assert rms_ratio(top, full) < 1e-5


def test_decoding_reads_out_every_block_of_value_columns():
    """The decoding read-out runs one program per 64 value columns: at V = 72 the second block is partial (8 of 64
    columns). Every column of o and of S continues a chunked prefill as the chunked op computes it, and the key
    state H (updated by the solve's programs, not the read-out's) too."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, KD, VD = 1, 21, 2, 16, 72
    q = F.normalize(torch.randn(B, T, H, KD, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, KD, generator=gen), dim=-1)
    v = torch.randn(B, T, H, VD, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 1.0)
    b, a = (torch.sigmoid(torch.randn(B, T, H, generator=gen)) for _ in range(2))
    kw = {"num_iter": 7, "config": EXACT}
    full, (h_full, s_full) = ncd.ops.chunk_gka(q, k, v, g, b, alpha=a, output_final_state=True, chunk_size=16, **kw)
    _, state = ncd.ops.chunk_gka(q[:, :17], k[:, :17], v[:, :17], g[:, :17], b[:, :17], alpha=a[:, :17],
                                 output_final_state=True, chunk_size=16, **kw)
    o, (h, s) = ncd.ops.recurrent_gka(q[:, 17:], k[:, 17:], v[:, 17:], g[:, 17:], b[:, 17:], alpha=a[:, 17:],
                                      initial_state=state, **kw)
    assert o.shape == (B, 4, H, VD) and torch.isfinite(o).all()
    per_column = (o - full[:, 17:]).abs().amax((0, 1, 2)) / full[:, 17:].abs().amax()
    assert per_column.max() < 1e-5  # the partial block's columns (64..71) included
    assert rms_ratio(h, h_full) < 1e-5 and rms_ratio(s, s_full) < 1e-5


def test_decoding_remembers_only_call_checks_that_passed(gka_module, monkeypatch):
    """Decoding is host-bound, so a call whose tensors have the shapes, dtypes and devices of one that passed skips
    the checks (rt.CheckMemo). A failure is never remembered, initial states are part of the signature (and
    (None, None) is refused, not taken for no state), and packed calls, whose cu_seqlens values are checked, are
    checked every time."""
    import ncd.runtime as rt

    checks = []
    bind_axes = rt.bind_axes
    monkeypatch.setattr(rt, "bind_axes", lambda *args: checks.append(1) or bind_axes(*args))
    q, k, v, g, b, a = draw(B=3, T=1)  # a batch no other test of this shared op decodes
    state = (torch.zeros(3, 2, K, K), torch.zeros(3, 2, K, V))
    with torch.no_grad():
        for _ in range(3):
            gka_module.recurrent(q, k, v, g, b, alpha=a, initial_state=state)
        assert len(checks) == 1
        gka_module.recurrent(q, k, v, g, b, alpha=a)  # no state: another signature
        gka_module.recurrent(q.clone(), k, v, g, b, alpha=a)
        assert len(checks) == 2
        for _ in range(2):
            with pytest.raises(CallError, match=r"initial_state\[0\] must have shape"):
                gka_module.recurrent(q, k, v, g, b, alpha=a, initial_state=(torch.zeros(3, 2, K, K + 1), state[1]))
            with pytest.raises(CallError, match=r"initial_state\[0\] must have shape"):
                gka_module.recurrent(q, k, v, g, b, alpha=a, initial_state=(None, None))
        with pytest.raises(CallError, match=r"beta has dtype torch\.int64"):
            gka_module.recurrent(q, k, v, g, torch.ones(3, 1, 2, dtype=torch.long), alpha=a)
        packed = [t.reshape(1, 3, *t.shape[2:]) for t in (q, k, v, g, b, a)]
        seqlens = torch.tensor([0, 1, 3])
        before = len(checks)
        for _ in range(2):
            gka_module.chunk(*packed[:5], alpha=packed[5], cu_seqlens=seqlens)
        assert len(checks) == before + 2
        with pytest.raises(CallError, match="cu_seqlens must rise from 0 to 3"):
            gka_module.chunk(*packed[:5], alpha=packed[5], cu_seqlens=torch.tensor([0, 2, 1, 3]))


def test_decoding_refuses_inputs_that_require_a_gradient_and_bad_states(gka_module):
    q, k, v, g, b, a = draw(B=1, T=3)
    with pytest.raises(CallError, match="no backward"):
        gka_module.recurrent(q.requires_grad_(), k, v, g, b, alpha=a)
    with torch.no_grad():
        o, state = gka_module.recurrent(q, k, v, g, b, alpha=a, output_final_state=False)
    assert state is None and torch.isfinite(o).all()
    with pytest.raises(CallError, match=r"initial_state\[1\] must have shape"):
        gka_module.recurrent(q.detach(), k, v, g, b, alpha=a,
                             initial_state=(torch.zeros(1, 2, K, K), torch.zeros(1, 2, K, V + 1)))
