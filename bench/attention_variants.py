"""GPU check and benchmark of the attention variants of issue 32 (masks and score modifiers from the spec) against
FlexAttention (softmax) and torch.compile of the eager formula (other normalisers).

Run on a CUDA machine, with ncd importable (installed, or the repository root on sys.path):

    PYTHONUNBUFFERED=1 python3 bench/attention_variants.py [--quick] [--ns 1024,4096,16384] [--variants a,b]
                                                           [--budget-s 420] [--json PATH]

and as a smoke test on a CPU (ncd's kernels in Triton's interpreter, FlexAttention eager, forward only, at tiny
sizes; the times mean nothing):

    python3 bench/attention_variants.py --cpu --quick

The variants (`--variants`, default all, in this order) are the shipped specs below (VARIANTS): causal softmax (the
anchor row), sliding window W, document masking (per-token segment ids, causal within documents), prefix-LM,
key/query padding, ALiBi (learned slope per head), learned temperature per head, an additive [head query key] bias,
softcapping with document masking, a bidirectional window, and two other normalisers: spherical with a sliding
window and causal sigmoid with ALiBi; then (issue 32, second session) causal softmax with a learned sink logit per
head (`sink`, gpt-oss), softmax-plus-one (`plus_one`, b(z) = 1 + z, non-causal), MLA-style value width (`mla`: q, k
of 192, v of 128, causal), QK-norm (`qk_norm`: RMS norm of q and k with learned gains, causal), cosine attention
(`cosine`: l2-normalised q, k, learned temperature per head), a T5 relative-position table (`t5_bias`: [head 33]
read at clamp(kv - q, -16, 16) + 16, causal), elu + 1 feature maps of q and k (`feature_map`, causal softmax) and
(third session) T5's own log buckets (`t5_log`: [head 32], bidirectional buckets up to distance 128, no mask).
Each variant's mask and score modifier are written once (`mask_mod(b, h, q, kv)`, `score_mod(s, b, h, q, kv)` in
FlexAttention's convention); the same functions are FlexAttention's mods and, on broadcast index tensors, the dense
formula that is the fp32 reference and the torch.compile baseline. A Q/K transform (`prologue(q, k, ex)`) and a sink
(`sink(h, ex)`, the logit per head) are likewise one function each, in the dense formula and in FlexAttention's form
(`flex_form`): the transform in PyTorch before flex_attention, the sink after it as O_flex * sigmoid(lse - sink)
(Flex's lse is log Z in base e and differentiable: its backward takes the lse's gradient), the whole compiled as one
function. Specs written at head dim 64 are loaded at 128 (`Variant.sizes`, ncd.load's size overrides).

For each variant, in turn:

1. Spec agreement (CPU, float64, B 2 H 3 N 37, window 8): the dense formula against `ncd.reference.evaluate` of the
   spec, so that the baselines compute the spec's own math (catches a bench formula that drifted from the spec).
2. Correctness (bf16, B 2, H 4, N 1000, window 256; `--cpu`: B 2, H 2, N 70, window 16): ncd's output, dQ, dK,
   dV and the gradient of every parameter (ALiBi slope, temperature, sink logit, QK-norm gains, T5 table) against
   the dense formula in fp32,
   ||x - ref|| / ||ref|| < 1e-2, outputs NaN-poisoned before the call; the error of the same formula in eager bf16
   is printed beside it (the issue asks for no worse than 2x that; a note, not a failure). FlexAttention eager is
   checked against the same reference (forward), so the baseline computes the same thing.
3. Timings (`triton.testing.do_bench`, median; bf16, head dim 128, 16 heads, B*N = 32768 tokens, N in --ns,
   `--quick`: 4096 only): ncd forward (no grad) and forward+backward (grad of sum(O * dO), dO fixed), against
   `torch.compile(flex_attention)` with the same score_mod/mask_mod and a BlockMask built once outside the timing
   (softmax), or `torch.compile` of the dense eager formula (bf16 scores, fp32 normaliser; other normalisers).
   Window 256; 8 documents of uneven length per sequence (fixed seed); prefix N/4; kv_len and q_len uniform in
   [N/2, N]. The modifier parameters require grad on both sides. The baseline column names Flex's form: "Flex",
   "Flex+lse sink" (the sink as above; if Flex's backward refused the lse's gradient, its f+b cell says why) or
   "Flex+torch q,k" (the Q/K transform compiled with it).

ncd's op is called as `op(Q, K, V, **others)`, the others by their names in the spec (op.signature), a scalar input
left out where the bench's value is the spec's default. A variant whose spec does not load is reported in the
tables as "ncd: <first line of the error>", one whose op cannot be called with the spec's inputs as "ncd call:
<error>", and the run goes on with the next; one that the compiler hands to the generic family (a FallbackWarning:
correct, not the attention kernels) is checked but not timed unless `--time-fallback` (the generic family
materialises [N, N] scores). Baselines are timed only for variants whose ncd op is timed, unless
`--baselines-anyway`. `--no-check` skips stages 1-2 (only for a tree whose variants an earlier call checked).

Wall time (estimated, not measured: this script was written on a machine without a GPU): per variant ~20-40 s for
loading the spec and its check (ncd's kernels compile at first call); per (variant, N) ~40-80 s, mostly the two
torch.compile's of flex_attention (no grad, and forward+backward) for that mask and shape, plus ncd's autotuning at
that shape. So all 19 variants at one N take ~25-40 minutes: split them over calls with `--variants`, e.g. (each
~4-7 minutes at one N):

    --ns 16384 --variants causal,sliding_window,document,softcap_document      # where block sparsity shows
    --quick --variants prefix_lm,padded,alibi,learned_temperature
    --quick --variants biased,bidirectional_window,sliding_window_spherical,alibi_sigmoid
    --ns 1024,4096,16384 --variants sink,plus_one                              # the new ones: 2 per call, 3 N
    --ns 1024,4096,16384 --variants qk_norm,cosine
    --ns 1024,4096,16384 --variants mla,t5_bias
    --ns 1024,4096,16384 --variants feature_map,causal                         # causal: the anchor row

`--budget-s` (default 420; none with --cpu) starts no new variant and no new (variant, N) after that many seconds
from the start, so one call under a 600 s limit prints its tables; the rows left show "skipped (budget)". The log
has each variant's check time and each (variant, N)'s time ("timed VARIANT N=... in S s") to plan the next call by.

The correctness table, then the timing table, are printed last. With $OUT set, the rows go to
$OUT/attention_variants.json and the log to $OUT/attention_variants.log (each row is logged as it is measured).
`--json PATH` writes the rows of the variants that passed their check through bench/results.py. Exit status: 1 when
a check failed (or a timing is not finite), else 2 when some variant's spec did not load, else 0.
"""

from __future__ import annotations

import os
import sys

if "--cpu" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # ncd's kernels in Triton's CPU interpreter: chosen before Triton loads

import argparse
import inspect
import json
import math
import time
import traceback
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

# bench/attention.py, beside this script; it puts the checkout on sys.path where ncd is not installed
from attention import DIM, DTYPE, HEADS, SPEC_DIR, TOKENS, TOL, _is_oom, rel_err
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

import ncd
import ncd.ir
import ncd.reference
from ncd.settings import poisoned

ON_GPU = "--cpu" not in sys.argv[1:]  # as TRITON_INTERPRET above; main's --cpu is the same flag
Ex = dict[str, Any]  # a variant's inputs and parameters after Q, K, V, by their names in the spec
MaskMod = Callable[[Any, Any, Any, Any, Ex], Any]  # (b, h, q, kv, ex) -> bool
ScoreMod = Callable[[Any, Any, Any, Any, Any, Ex], Any]  # (s, b, h, q, kv, ex) -> score
SinkFn = Callable[[Any, Ex], Any]  # (h, ex) -> the sink logit per head, broadcast over h's shape
Prologue = Callable[[Any, Any, Ex], tuple[Any, Any]]  # (q, k, ex) -> the q, k that the scores read

CAP = 30.0  # softcap_document_softmax.ncd's `const cap`
DOCS = 8  # documents per sequence
WINDOW = 256
T5_R = 16  # t5_bias_softmax.ncd: the table's 2R + 1 entries, read at clamp(key - query, -R, R) + R
MLA_DIM, MLA_DIM_V = 192, 128  # mla_style_softmax.ncd's `axis dim`, `axis vdim`


# ----------------------------------------------------------------------------------------------- the variants
# Written as FlexAttention's mods: b, h, q, kv are int tensors (0-d under Flex's vmap; broadcast [B 1 1 1],
# [1 H 1 1], [1 1 N 1], [1 1 1 N] in the dense formula); `&`, `|` as Flex needs.

def causal(b, h, q, kv, ex):
    return kv <= q


def sliding_window(b, h, q, kv, ex):
    return (kv <= q) & (kv > q - ex["window"])


def bidirectional_window(b, h, q, kv, ex):
    return (kv <= q + ex["window"]) & (kv >= q - ex["window"])


def document(b, h, q, kv, ex):
    return (ex["q_doc"][b, q] == ex["k_doc"][b, kv]) & (kv <= q)


def prefix_lm(b, h, q, kv, ex):
    return (kv <= q) | (kv < ex["prefix"][b])


def padded(b, h, q, kv, ex):
    return (kv < ex["kv_len"][b]) & (q < ex["q_len"][b])


def alibi(s, b, h, q, kv, ex):
    return s + ex["slope"][h] * (kv - q)


def temperature(s, b, h, q, kv, ex):
    return s * ex["tau"][h]


def additive_bias(s, b, h, q, kv, ex):
    return s + ex["bias"][h, q, kv]


def softcap(s, b, h, q, kv, ex):
    return CAP * torch.tanh(s / CAP)


def t5_bias(s, b, h, q, kv, ex):
    return s + ex["table"][h, torch.clamp(kv - q, -T5_R, T5_R) + T5_R]


def t5_bucket(relative):
    """T5's bidirectional buckets (32, max distance 128), as Hugging Face's `_relative_position_bucket`."""
    distance = torch.abs(relative)
    large = 8 + (torch.log(distance.float().clamp_min(1) / 8) / math.log(128 / 8) * 8).to(relative.dtype)
    return (relative > 0).to(relative.dtype) * 16 + torch.where(distance < 8, distance, torch.clamp(large, max=15))


def t5_log_bias(s, b, h, q, kv, ex):
    return s + ex["table"][h, t5_bucket(kv - q)]


# A sink (sink_softmax.ncd's `sink = sink`; b(z) = 1 + z is a sink of logit 0): one more entry of the softmax's sum,
# exp(sink_h), with no value. FlexAttention has none: its form is O_flex * sigmoid(lse - sink_h) (flex_full).

def sink_logit(h, ex):
    return ex["sink"][h]


def plus_one(h, ex):
    return torch.zeros(h.shape, dtype=torch.float32, device=h.device)


# Q/K transforms (the specs' Qn, Kn): computed in float32 (float64 for float64 inputs), handed on in the inputs'
# dtype, as ncd's prologue does (ncd/families/attention/prologue.py); the same functions for FlexAttention's form.

def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def qk_rms_norm(q, k, ex):
    def norm(x, gain):
        x32 = _acc(x)
        return (gain * x32 / torch.sqrt((x32 * x32).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    return norm(q, ex["gq"]), norm(k, ex["gk"])


def l2_normalise(q, k, ex):
    def norm(x):
        x32 = _acc(x)
        return (x32 / torch.sqrt(torch.clamp_min((x32 * x32).sum(-1, keepdim=True), 1e-12))).to(x.dtype)
    return norm(q), norm(k)


def elu_plus_one(q, k, ex):
    def phi(x):
        x32 = _acc(x)
        return torch.where(x32 > 0, x32 + 1, torch.exp(torch.clamp_max(x32, 0.0))).to(x.dtype)
    return phi(q), phi(k)


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    n: int
    window: int
    device: str


def _segment_ids(n: int, gen: torch.Generator) -> torch.Tensor:
    """DOCS documents of uneven length over n tokens: ids 0..DOCS-1, cut at DOCS-1 distinct random places."""
    cuts = torch.randperm(n - 1, generator=gen)[: DOCS - 1] + 1
    starts = torch.zeros(n, dtype=torch.int32)
    starts[cuts] = 1
    return starts.cumsum(0).to(torch.int32)


def no_inputs(shape: Shape, gen: torch.Generator) -> Ex:
    return {}


def window_input(shape: Shape, gen: torch.Generator) -> Ex:
    return {"window": shape.window}


def document_ids(shape: Shape, gen: torch.Generator) -> Ex:
    ids = torch.stack([_segment_ids(shape.n, gen) for _ in range(shape.batch)]).to(shape.device)
    return {"q_doc": ids, "k_doc": ids}  # self-attention: the same ids for queries and keys


def prefix_lengths(shape: Shape, gen: torch.Generator) -> Ex:
    return {"prefix": torch.full((shape.batch,), shape.n // 4, dtype=torch.int32, device=shape.device)}


def valid_lengths(shape: Shape, gen: torch.Generator) -> Ex:
    kv_len, q_len = (torch.randint(shape.n // 2, shape.n + 1, (shape.batch,), generator=gen, dtype=torch.int32)
                     for _ in range(2))
    return {"kv_len": kv_len.to(shape.device), "q_len": q_len.to(shape.device)}


def alibi_slopes(shape: Shape, gen: torch.Generator) -> Ex:
    """The ALiBi paper's slopes 2^(-8 (h+1) / H), learned here (requires grad)."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, shape.heads + 1, dtype=torch.float32) / shape.heads)
    return {"slope": slopes.to(shape.device).requires_grad_()}


def temperatures(shape: Shape, gen: torch.Generator) -> Ex:
    tau = DIM**-0.5 * (0.5 + torch.rand(shape.heads, generator=gen))
    return {"tau": tau.to(shape.device).requires_grad_()}


def bias_table(shape: Shape, gen: torch.Generator) -> Ex:
    bias = torch.randn(shape.heads, shape.n, shape.n, generator=torch.Generator(shape.device).manual_seed(7),
                       device=shape.device)
    return {"bias": bias}  # an `in` of the spec: no gradient asked for


def sink_logits(shape: Shape, gen: torch.Generator) -> Ex:
    """A learned sink logit per head, around 1 (a few percent of a long row's weight, most of an early row's)."""
    return {"sink": (1.0 + torch.randn(shape.heads, generator=gen)).to(shape.device).requires_grad_()}


def qk_gains(shape: Shape, gen: torch.Generator) -> Ex:
    return {name: (1.0 + 0.1 * torch.randn(DIM, generator=gen)).to(shape.device).requires_grad_()
            for name in ("gq", "gk")}


def cosine_temperatures(shape: Shape, gen: torch.Generator) -> Ex:
    """Swin V2's logit scale, learned per head: cosines in [-1, 1] times 5..15."""
    return {"tau": (5.0 + 10.0 * torch.rand(shape.heads, generator=gen)).to(shape.device).requires_grad_()}


def t5_table(shape: Shape, gen: torch.Generator) -> Ex:
    return {"table": (0.5 * torch.randn(shape.heads, 2 * T5_R + 1, generator=gen)).to(shape.device).requires_grad_()}


def t5_log_table(shape: Shape, gen: torch.Generator) -> Ex:
    return {"table": (0.5 * torch.randn(shape.heads, 32, generator=gen)).to(shape.device).requires_grad_()}


@dataclass(frozen=True)
class Variant:
    name: str
    spec: str  # file in specs/
    mask: MaskMod | None = None
    score: ScoreMod | None = None
    inputs: Callable[[Shape, torch.Generator], Ex] = no_inputs
    normaliser: str = "softmax"  # "softmax", "spherical" (x, x^2, sqrt) or "sigmoid" (sigmoid, sigmoid, z)
    scale: float = DIM**-0.5  # multiplies Q . K before `score` (the spec's default scale)
    batch_mask: bool = False  # the mask reads per-sequence tensors: the BlockMask is per batch
    sink: SinkFn | None = None  # softmax with a sink logit per head (normalize's `sink =`, or b(z) = 1 + z)
    prologue: Prologue | None = None  # q, k transformed before the scores
    dim: int = DIM  # the head dim of q and k
    dim_v: int = DIM  # of v and the output
    sizes: tuple[tuple[str, int], ...] = ()  # ncd.load's size overrides (a spec written at head dim 64)

    @property
    def softmax(self) -> bool:
        return self.normaliser == "softmax"

    @property
    def baseline(self) -> str:
        """The baseline's label in the tables: FlexAttention's form, or torch.compile of the dense formula."""
        if not self.softmax:
            return "compile"
        return "Flex" + ("+lse sink" if self.sink else "") + ("+torch q,k" if self.prologue else "")


VARIANTS = {v.name: v for v in (
    Variant("causal", "causal_softmax_attention.ncd", mask=causal),
    Variant("sliding_window", "sliding_window_softmax.ncd", mask=sliding_window, inputs=window_input),
    Variant("document", "document_softmax.ncd", mask=document, inputs=document_ids, batch_mask=True),
    Variant("prefix_lm", "prefix_lm_softmax.ncd", mask=prefix_lm, inputs=prefix_lengths, batch_mask=True),
    Variant("padded", "padded_softmax.ncd", mask=padded, inputs=valid_lengths, batch_mask=True),
    Variant("alibi", "alibi_softmax.ncd", mask=causal, score=alibi, inputs=alibi_slopes),
    Variant("learned_temperature", "learned_temperature_softmax.ncd", score=temperature, inputs=temperatures,
            scale=1.0),
    Variant("biased", "biased_softmax.ncd", score=additive_bias, inputs=bias_table),
    Variant("softcap_document", "softcap_document_softmax.ncd", mask=document, score=softcap, inputs=document_ids,
            batch_mask=True),
    Variant("bidirectional_window", "bidirectional_window_softmax.ncd", mask=bidirectional_window,
            inputs=window_input),
    Variant("sliding_window_spherical", "sliding_window_spherical.ncd", mask=sliding_window, inputs=window_input,
            normaliser="spherical", scale=1.0),
    Variant("alibi_sigmoid", "alibi_sigmoid.ncd", mask=causal, score=alibi, inputs=alibi_slopes,
            normaliser="sigmoid"),
    Variant("sink", "sink_softmax.ncd", mask=causal, sink=sink_logit, inputs=sink_logits, sizes=(("dim", DIM),)),
    Variant("plus_one", "softmax_plus_one.ncd", sink=plus_one, sizes=(("dim", DIM),)),
    Variant("mla", "mla_style_softmax.ncd", mask=causal, dim=MLA_DIM, dim_v=MLA_DIM_V, scale=MLA_DIM**-0.5),
    Variant("qk_norm", "qk_norm_softmax.ncd", mask=causal, prologue=qk_rms_norm, inputs=qk_gains),
    Variant("cosine", "cosine_attention.ncd", score=temperature, prologue=l2_normalise, inputs=cosine_temperatures,
            scale=1.0),
    Variant("t5_bias", "t5_bias_softmax.ncd", mask=causal, score=t5_bias, inputs=t5_table, sizes=(("dim", DIM),)),
    Variant("feature_map", "feature_map_softmax.ncd", mask=causal, prologue=elu_plus_one),
    Variant("t5_log", "t5_log_bucket_softmax.ncd", score=t5_log_bias, inputs=t5_log_table, sizes=(("dim", DIM),)),
)}


def dense(variant: Variant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ex: Ex) -> torch.Tensor:
    """The variant as one writes it in PyTorch: dense [B H N N] scores from q k^T in the inputs' dtype, the modifier,
    mask and normaliser in fp32 (float64 for float64 inputs), weights cast back for the product with V. Fully
    masked rows give 0 (and no NaN in any gradient). fp32 inputs: the reference; bf16: the eager baseline. A Q/K
    prologue runs first (fp32, handed on in the inputs' dtype); a sink is one more entry of the softmax's sum."""
    acc = torch.promote_types(q.dtype, torch.float32)
    if variant.prologue is not None:
        q, k = variant.prologue(q, k, ex)
    batch, heads, n_q, n_k = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    b = torch.arange(batch, device=q.device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=q.device).view(1, -1, 1, 1)
    i = torch.arange(n_q, device=q.device).view(1, 1, -1, 1)
    j = torch.arange(n_k, device=q.device).view(1, 1, 1, -1)
    s = (q @ k.transpose(-1, -2)).to(acc) * variant.scale
    if variant.score is not None:
        s = variant.score(s, b, h, i, j, ex)
    keep = (variant.mask(b, h, i, j, ex) if variant.mask is not None
            else torch.ones((), dtype=torch.bool, device=q.device)).expand(s.shape)
    if variant.normaliser == "softmax" and variant.sink is not None:
        sink = torch.as_tensor(variant.sink(h, ex)).to(acc).expand(batch, heads, n_q, 1)
        s = torch.where(keep, s, float("-inf"))
        m = torch.maximum(s.amax(-1, keepdim=True), sink).detach()  # finite: the sink is in every row
        e = torch.exp(s - m)
        w, den = e / (e.sum(-1, keepdim=True) + torch.exp(sink - m)), None
    elif variant.normaliser == "softmax":
        some = keep.any(-1, keepdim=True)
        s = torch.where(keep, s, torch.where(some, float("-inf"), 0.0))  # a fully masked row: finite, then zeroed
        w, den = torch.where(keep, torch.softmax(s, -1), 0.0), None
    elif variant.normaliser == "spherical":
        w = torch.where(keep, s, 0.0)
        z = (w * w).sum(-1, keepdim=True)
        den = torch.where(z > 0, z, 1.0).sqrt()
    elif variant.normaliser == "sigmoid":
        w = torch.where(keep, torch.sigmoid(s), 0.0)
        z = w.sum(-1, keepdim=True)
        den = torch.where(z > 0, z, 1.0)
    else:
        raise ValueError(f"unknown normaliser {variant.normaliser}")
    o = (w.to(v.dtype) @ v).to(acc)
    return (o if den is None else o / den).to(q.dtype)


def flex_mods(variant: Variant, ex: Ex) -> tuple[Callable | None, Callable | None]:
    """FlexAttention's (score_mod, mask_mod) of the variant, reading `ex`'s tensors."""
    score, mask = variant.score, variant.mask
    score_mod = mask_mod = None
    if score is not None:
        def score_mod(s, b, h, q, kv):
            return score(s, b, h, q, kv, ex)
    if mask is not None:
        def mask_mod(b, h, q, kv):
            return mask(b, h, q, kv, ex)
    return score_mod, mask_mod


_AUX_REQUEST = getattr(torch.nn.attention.flex_attention, "AuxRequest", None)  # torch >= 2.9
LSE_REQUEST = _AUX_REQUEST(lse=True) if _AUX_REQUEST is not None else None  # built once, outside compiled code


def flex_lse(flex_fn, q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """flex_attention's output and its log-sum-exp of the (modified, masked) scores, [B H N], natural log (Flex's
    frontend rescales its kernels' base-2 statistics) and differentiable (Flex's backward takes a grad_logsumexp)."""
    if LSE_REQUEST is not None:
        o, aux = flex_fn(q, k, v, return_aux=LSE_REQUEST, **kwargs)
        return o, aux.lse
    return flex_fn(q, k, v, return_lse=True, **kwargs)  # older: return_lse (deprecated since)


def flex_form(variant: Variant, ex: Ex, score_mod, bm, flex_fn) -> Callable:
    """FlexAttention's form of the variant, as (q, k, v) -> o: the Q/K prologue in PyTorch, then `flex_fn`
    (flex_attention) with the variant's score_mod and BlockMask, then a sink as the standard epilogue:
    O = O_flex * Z / (Z + exp(sink)) = O_flex * sigmoid(lse - sink) per row. Only plain functions and tensors in
    the closure, so that torch.compile of it traces the whole (prologue and epilogue fused by Inductor)."""
    prologue, sink, scale = variant.prologue, variant.sink, variant.scale

    def run(q, k, v):
        if prologue is not None:
            q, k = prologue(q, k, ex)
        if sink is None:
            return flex_fn(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale)
        o, lse = flex_lse(flex_fn, q, k, v, score_mod=score_mod, block_mask=bm, scale=scale)
        logit = sink(torch.arange(q.shape[1], device=q.device).view(1, -1, 1), ex).to(lse.dtype)
        return (o.to(lse.dtype) * torch.sigmoid(lse - logit).unsqueeze(-1)).to(o.dtype)
    return run


def block_mask(variant: Variant, ex: Ex, shape: Shape):
    mask_mod = flex_mods(variant, ex)[1]
    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, B=shape.batch if variant.batch_mask else None, H=None, Q_LEN=shape.n,
                             KV_LEN=shape.n, device=shape.device)


# ---------------------------------------------------------------------------------------------------- ncd side

@dataclass
class Loaded:
    op: Any = None
    error: str = ""  # "ncd: <first line>" when the spec did not load
    fallback: str = ""  # the FallbackWarning's first line when the generic family compiled it


def first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"[:160]


def load(variant: Variant, log) -> Loaded:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            op = ncd.load(SPEC_DIR / variant.spec, sizes=dict(variant.sizes) or None)
        except Exception as exc:
            log(f"load {variant.name}: {traceback.format_exc(limit=-6)}")
            return Loaded(error=f"ncd: {first_line(exc)}")
    fallback = next((str(w.message).splitlines()[0] for w in caught if type(w.message).__name__ == "FallbackWarning"),
                    "")
    if fallback:
        log(f"load {variant.name}: {fallback}")
    return Loaded(op, fallback=fallback)


def ncd_kwargs(op, ex: Ex) -> dict[str, Any]:
    """The op's arguments after Q, K, V (op.signature: the spec's other inputs and parameters), by their names in the
    spec, from `ex` (the generic family makes scalar inputs keyword-only); one that `ex` lacks, or gives its default's
    value (`in window : i32 = 256` called with 256), is left to its default."""
    kwargs: dict[str, Any] = {}
    for t in op.signature[3:]:
        value = ex.get(t.name)
        if isinstance(t.default, ncd.ir.Const) and isinstance(value, (int, float)) and value == t.default.value:
            value = None
        if value is None and t.default is None:
            raise KeyError(f"the spec's {t.role} {t.name!r} has no value in this bench (it has {sorted(ex)})")
        if value is not None:
            kwargs[t.name] = value
    accepted = inspect.signature(op.fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        unknown = [name for name in kwargs if name not in accepted]
        if unknown:
            raise TypeError(f"the generated {op.name}{inspect.signature(op.fn)} takes no {', '.join(unknown)}, "
                            "declared in the spec")
    return kwargs


# ------------------------------------------------------------------------------------------------ correctness

@dataclass
class Check:
    variant: str
    agreement: str = "-"  # the dense formula against ncd.reference of the spec
    errors: dict[str, float] = field(default_factory=dict)
    eager: dict[str, float] = field(default_factory=dict)  # the eager bf16 formula's errors
    flex: str = "-"  # FlexAttention eager against the reference (softmax variants)
    note: str = ""
    ok: bool = True
    ran: bool = False  # ncd's op was called


def _inputs(variant: Variant, shape: Shape, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output's gradient dO (q, k of width variant.dim; v, dO of variant.dim_v)."""
    gen = torch.Generator(shape.device).manual_seed(seed)
    return tuple(torch.randn(shape.batch, shape.heads, shape.n, dim, device=shape.device, dtype=DTYPE, generator=gen)
                 for dim in (variant.dim, variant.dim, variant.dim_v, variant.dim_v))


def params(ex: Ex) -> dict[str, torch.Tensor]:
    """The entries of `ex` that take a gradient (the spec's `param`s)."""
    return {name: t for name, t in ex.items() if isinstance(t, torch.Tensor) and t.requires_grad}


def _fresh(ex: Ex, dtype: torch.dtype | None = None) -> Ex:
    """`ex` with every float tensor a new leaf (in `dtype` if given), parameters requiring grad as before."""
    out: Ex = {}
    for name, t in ex.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t2 = t.detach().to(dtype or t.dtype).clone()
            out[name] = t2.requires_grad_(t.requires_grad)
        else:
            out[name] = t
    return out


def spec_agreement(variant: Variant) -> str:
    """The dense formula against ncd's float64 reference evaluator of the spec, forward, at a tiny size on the CPU:
    "" when they agree, else what differs."""
    shape = Shape(2, 3, 37, 8, "cpu")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.n, dim, dtype=torch.float64, generator=gen)
               for dim in (variant.dim, variant.dim, variant.dim_v))
    ex = _fresh(variant.inputs(shape, gen), torch.float64)
    with torch.no_grad():
        ours = dense(variant, q, k, v, ex)
        front = ncd.load_spec(SPEC_DIR / variant.spec, sizes=dict(variant.sizes) or None)
        theirs = next(iter(ncd.reference.evaluate(front.program, {"Q": q, "K": k, "V": v, **ex}).values()))
    err = ((ours - theirs).norm() / theirs.norm()).item()
    return "" if err < 1e-9 else f"bench formula differs from the spec's reference: rel err {err:.2e}"


def check(variant: Variant, loaded: Loaded, shape: Shape, log) -> Check:
    result = Check(variant.name)
    try:
        disagreement = spec_agreement(variant)
        result.agreement = disagreement or "OK"
        if disagreement:
            result.ok = False
    except Exception as exc:  # the reference evaluator cannot run the spec: no verdict, say so
        result.agreement = f"not run: {first_line(exc)}"
        log(f"agreement {variant.name}: {traceback.format_exc(limit=-4)}")
    seed = zlib.crc32(variant.name.encode())  # the same inputs in every run (str hashes are salted per process)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = _inputs(variant, shape, seed)
    ex = variant.inputs(shape, gen)
    names = ["o", "dq", "dk", "dv", *(f"d{name}" for name in params(ex))]

    def run(fn, q_, k_, v_, ex_) -> list[torch.Tensor]:
        q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q_, k_, v_))
        o = fn(q_, k_, v_, ex_)
        o.backward(do.to(o.dtype))
        return [o, q_.grad, k_.grad, v_.grad, *(t.grad for t in params(ex_).values())]

    ex32 = _fresh(ex, torch.float32)
    ref = run(lambda *a: dense(variant, *a), q.float(), k.float(), v.float(), ex32)
    eager = run(lambda *a: dense(variant, *a), q, k, v, _fresh(ex))
    result.eager = {n: rel_err(x, r) for n, x, r in zip(names, eager, ref, strict=True)}
    if variant.softmax:
        try:
            ex_flex = _fresh(ex, torch.float32)
            score_mod = flex_mods(variant, ex_flex)[0]
            bm = block_mask(variant, ex, shape)
            with torch.no_grad():
                o_flex = flex_form(variant, ex_flex, score_mod, bm, flex_attention)(q.float(), k.float(), v.float())
            err = rel_err(o_flex, ref[0])
            result.flex = f"o={err:.1e}" + ("" if err < TOL else " FAIL")
            result.ok &= err < TOL
        except Exception as exc:
            result.flex = f"not run: {first_line(exc)}"
            log(f"flex check {variant.name}: {traceback.format_exc(limit=-4)}")
    if loaded.op is None:
        result.note = loaded.error
        return result
    try:
        with poisoned():  # every output buffer starts as NaN: anything left unwritten shows
            got = run(lambda q_, k_, v_, ex_: loaded.op(q_, k_, v_, **ncd_kwargs(loaded.op, ex_)), q, k, v, _fresh(ex))
            sync()
    except Exception as exc:
        log(f"check {variant.name}: {traceback.format_exc(limit=-8)}")
        result.note, result.ok = f"ncd call: {first_line(exc)}", False
        return result
    result.ran = True
    missing = [n for n, g in zip(names, got, strict=True) if g is None]
    result.errors = {n: rel_err(x, r) for n, x, r in zip(names, got, ref, strict=True) if x is not None}
    finite = all(bool(torch.isfinite(x).all()) for x in got if x is not None)
    good = finite and not missing and all(e < _tolerance(n) for n, e in result.errors.items())
    result.ok &= good
    worse = [n for n, e in result.errors.items() if e > 2 * result.eager[n] and e > 1e-3]
    result.note = "; ".join(filter(None, [("no gradient for " + ", ".join(missing)) if missing else "",
                                          "" if finite else "non-finite values",
                                          f"> 2x eager bf16 error: {', '.join(worse)}" if worse else ""]))
    return result


# A modifier parameter's gradient (dslope = sum_ij dS_ij (j - i)) sums a head's scores, and with softmax
# sum_j dS_ij = 0, so it cancels; the kernels' delta_i = dO_i . O_i reads the bf16 output, as FlashAttention's does,
# and its rounding does not cancel in that sum. PyTorch's eager bf16 autograd of the formula, against float64, was
# off by 1.3e-3 to 0.14 over five draws (docs/language.md §21); checked at MODIFIER_TOL, the eager error beside it.
MODIFIER_TOL = 5e-2


def _tolerance(name: str) -> float:
    return TOL if name in ("o", "dq", "dk", "dv") else MODIFIER_TOL


# ---------------------------------------------------------------------------------------------------- timings

def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def bench(fn: Callable[[], Any], grads: list[torch.Tensor]) -> float:
    """Median ms: do_bench on the GPU; on the CPU (smoke test: the code path, not the time) one call after a warm
    one."""
    if ON_GPU:
        return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median"))
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    for t in grads:
        t.grad = None
    return ms


def peak_mib(run: Callable[[], Any], grads: list[torch.Tensor]) -> float:
    """MiB that one call allocates at its peak above what was allocated before it (inputs, dO): its saved tensors,
    workspaces and the gradients it writes."""
    for t in grads:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def time_case(impl: str, mode: str, run: Callable[[], Any], grads: list[torch.Tensor], row_base: Mapping,
              log) -> dict:
    row = {**row_base, "impl": impl, "mode": mode}
    try:
        t0 = time.time()
        run()  # compile and autotune outside the timing
        sync()
        row["first_call_s"] = round(time.time() - t0, 2)
        for t in grads:
            t.grad = None
        row["ms"] = bench(run, grads)
        if ON_GPU and mode == "fwdbwd":
            row["peak_mib"] = peak_mib(run, grads)
    except Exception as exc:
        row["ms"] = None
        row["note"] = "OOM" if _is_oom(exc) else first_line(exc)
        if not _is_oom(exc):
            log(f"{impl} {mode} {row_base}: {traceback.format_exc(limit=-6)}")
    log(json.dumps(row))
    for t in grads:
        t.grad = None
    sync()  # raises on a broken CUDA context: main's handler reports the variant
    if ON_GPU:
        torch.cuda.empty_cache()
    return row


def time_shape(variant: Variant, loaded: Loaded, shape: Shape, flex, compiled_dense, log, time_ncd: bool,
               rows: list[dict]) -> None:
    """Appends the rows of one (variant, N) to `rows` as they are measured."""
    q, k, v, do = _inputs(variant, shape, seed=shape.n)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ex = variant.inputs(shape, torch.Generator().manual_seed(shape.n))
    grads = [q, k, v, *params(ex).values()]
    qd, kd, vd = (t.detach() for t in (q, k, v))
    base = {"variant": variant.name, "n": shape.n, "batch": shape.batch}

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(qd, kd, vd)
        return run

    def fwdbwd(fn):
        def run():
            fn(q, k, v).backward(do)
        return run

    if time_ncd:
        op = loaded.op
        try:
            kwargs = ncd_kwargs(op, ex)  # once: inspect's signature costs microseconds a call
        except (KeyError, TypeError) as exc:
            rows += [{**base, "impl": "ncd", "mode": m, "ms": None, "note": f"ncd call: {first_line(exc)}"}
                     for m in ("fwd", "fwdbwd")]
        else:
            def ours(q_, k_, v_):
                return op(q_, k_, v_, **kwargs)
            rows.append(time_case("ncd", "fwd", fwd(ours), grads, base, log))
            rows.append(time_case("ncd", "fwdbwd", fwdbwd(ours), grads, base, log))
    if ON_GPU:  # the memory yardstick: SDPA's plain attention of the same q, k, v (where it takes them)
        def sdpa(q_, k_, v_):
            return F.scaled_dot_product_attention(q_, k_, v_)
        rows.append(time_case("sdpa", "fwdbwd", fwdbwd(sdpa), grads, base, log))
    if variant.softmax:
        score_mod, _ = flex_mods(variant, ex)
        t0 = time.time()
        try:
            bm = block_mask(variant, ex, shape)  # once, as a model reuses it across layers
        except Exception as exc:
            log(f"block mask {variant.name} N={shape.n}: {traceback.format_exc(limit=-6)}")
            note = "OOM" if _is_oom(exc) else first_line(exc)
            rows += [{**base, "impl": "flex", "mode": m, "ms": None, "note": f"BlockMask: {note}"}
                     for m in ("fwd", "fwdbwd")]
            return
        log(f"block mask {variant.name} N={shape.n}: {time.time() - t0:.1f} s"
            + (f", sparsity {bm.sparsity():.1f}%" if bm is not None else ", none"))

        theirs: Callable
        if variant.prologue is None and variant.sink is None:
            def theirs(q_, k_, v_):
                return flex(q_, k_, v_, score_mod=score_mod, block_mask=bm, scale=variant.scale)
        else:  # prologue, flex_attention and epilogue compiled as one function (eager on the CPU)
            theirs = flex_form(variant, ex, score_mod, bm, flex_attention)
            if ON_GPU:
                theirs = torch.compile(theirs, dynamic=False)
        rows.append(time_case("flex", "fwd", fwd(theirs), grads, base, log))
        if ON_GPU:
            rows.append(time_case("flex", "fwdbwd", fwdbwd(theirs), grads, base, log))
        else:
            rows.append({**base, "impl": "flex", "mode": "fwdbwd", "ms": None, "note": "no Flex backward on CPU"})
    else:
        def eager(q_, k_, v_):
            return compiled_dense(variant, q_, k_, v_, ex)
        rows.append(time_case("compile", "fwd", fwd(eager), grads, base, log))
        rows.append(time_case("compile", "fwdbwd", fwdbwd(eager), grads, base, log))


# ----------------------------------------------------------------------------------------------------- tables

def target(variant: Variant) -> tuple[float, tuple[str, ...]]:
    """The issue's target ratio (baseline ms / ncd ms) and the modes it is asked of."""
    return (1.0, ("fwd", "fwdbwd")) if variant.softmax else (3.0, ("fwdbwd",))


def target_text(variant: Variant) -> str:
    goal, modes = target(variant)
    return f">= {goal:g}x {'Flex fwd, f+b' if len(modes) == 2 else 'compile f+b'}"


def _ms(row: Mapping | None) -> str:
    if row is None:
        return "-"
    return f"{row['ms']:.3f}" if row.get("ms") is not None else row.get("note", "-")


def _ratio(ours: Mapping | None, theirs: Mapping | None) -> float | None:
    if not ours or not theirs or not ours.get("ms") or theirs.get("ms") is None:
        return None
    return theirs["ms"] / ours["ms"]


def check_table(checks: list[Check], log) -> None:
    log("")
    log(f"correctness: ||x - ref|| / ||ref|| against the fp32 dense formula (< {TOL:g}); in brackets the eager bf16 "
        "formula's error")
    log("| variant | spec agreement | o | dQ | dK | dV | params | Flex o | OK | note |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for c in checks:
        def cell(name: str, c: Check = c) -> str:
            if name not in c.errors:
                return "-"
            return f"{c.errors[name]:.1e} ({c.eager[name]:.1e})"
        extra = [n for n in c.errors if n not in ("o", "dq", "dk", "dv")]
        verdict = "NO" if not c.ok else "yes" if c.ran else "-"
        log(f"| {c.variant} | {c.agreement} | {cell('o')} | {cell('dq')} | {cell('dk')} | {cell('dv')} | "
            f"{' '.join(f'{n}={cell(n)}' for n in extra) or '-'} | {c.flex} | {verdict} | {c.note or '-'} |")


def timing_table(rows: list[dict], skipped: list[tuple[str, int, str]], not_timed: Mapping[str, str],
                 checks: Mapping[str, Check], log) -> None:
    """One row per (variant, N) timed; `skipped`: (variant, N, why) not timed at all; `not_timed`: variant -> why
    its ncd op was not timed (its baselines were)."""
    by = {(r["variant"], r["n"], r["impl"], r["mode"]): r for r in rows}
    keys = list(dict.fromkeys((r["variant"], r["n"], r["batch"]) for r in rows))
    log("")
    log("ms (median); ratio = baseline ms / ncd ms (> 1: ncd faster). Baseline: torch.compile(flex_attention) with "
        "its BlockMask (softmax; +lse sink: O * sigmoid(lse - sink) on Flex's lse; +torch q,k: q, k transformed in "
        "PyTorch first, compiled with Flex), torch.compile of the dense eager formula (others). Targets: softmax "
        ">= 1.0x Flex fwd and fwd+bwd; others >= 3x torch.compile fwd+bwd")
    log("| variant | N | B | baseline | ncd fwd | base fwd | ratio fwd | ncd f+b | base f+b | ratio f+b | target | "
        "met | peak MiB f+b: ncd / SDPA |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, n, batch in keys:
        variant = VARIANTS[name]
        base_impl = "flex" if variant.softmax else "compile"
        nf, nb = by.get((name, n, "ncd", "fwd")), by.get((name, n, "ncd", "fwdbwd"))
        bf, bb = by.get((name, n, base_impl, "fwd")), by.get((name, n, base_impl, "fwdbwd"))
        goal, modes = target(variant)
        ratios = {"fwd": _ratio(nf, bf), "fwdbwd": _ratio(nb, bb)}
        check = checks.get(name)
        if check is not None and not check.ok:
            met = "no: check failed"
        elif nf is None:
            met = "no: " + not_timed.get(name, "ncd not timed")
        elif any(by.get((name, n, base_impl, m), {}).get("note") == "OOM" and ratios[m] is None for m in modes):
            met = "baseline OOM"
        elif any(ratios[m] is None for m in modes):
            met = "-"
        else:
            met = "yes" if all((ratios[m] or 0.0) >= goal for m in modes) else "no"
        label = variant.baseline
        same = nb is not None and nf is not None and nb.get("ms") is None and nb.get("note") == nf.get("note")
        cells = [name, str(n), str(batch), label, _ms(nf) if nf else not_timed.get(name, "-"), _ms(bf),
                 _fmt_ratio(ratios["fwd"]), "(as fwd)" if same else _ms(nb), _ms(bb), _fmt_ratio(ratios["fwdbwd"]),
                 target_text(variant), met, _memory(nb, by.get((name, n, "sdpa", "fwdbwd")))]
        log("| " + " | ".join(cells) + " |")
    for name, n, why in skipped:
        label = VARIANTS[name].baseline
        log(f"| {name} | {n} | - | {label} | {why} | - | - | - | - | - | {target_text(VARIANTS[name])} | "
            "no: not timed | - |")


def _memory(ours: Mapping | None, sdpa: Mapping | None) -> str:
    """ncd's f+b peak MiB / SDPA's (plain attention, same inputs; target <= 1.10 at N = 16k)."""
    mine, theirs = (r.get("peak_mib") if r else None for r in (ours, sdpa))
    if mine is None:
        return "-"
    return f"{mine:.0f} / {theirs:.0f} = {mine / theirs:.2f}" if theirs else f"{mine:.0f} / -"


def _fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def result_rows(rows: list[dict], passed: set[str], flex_label: str):
    """bench/results.py rows: ncd against its baseline per (variant, N, mode), with the issue's targets."""
    from results import Row  # bench/results.py, beside this script

    by = {(r["variant"], r["n"], r["impl"], r["mode"]): r for r in rows}
    out = []
    for r in rows:
        if r["impl"] != "ncd" or r["variant"] not in passed:
            continue
        variant = VARIANTS[r["variant"]]
        base_impl, label = (("flex", flex_label + variant.baseline.removeprefix("Flex")) if variant.softmax
                            else ("compile", "torch.compile"))
        other = by.get((r["variant"], r["n"], base_impl, r["mode"]))
        if other is None:
            continue
        goal, modes = target(variant)
        mode = "fwd+bwd" if r["mode"] == "fwdbwd" else "fwd"
        out.append(Row(f"N {r['n']} B {r['batch']}", f"{r['variant']} {mode}", f"{label} {mode}", r.get("ms"),
                       other.get("ms"), target=goal if r["mode"] in modes else None))
    return out


# ------------------------------------------------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="N=4096 only (--cpu: N=96)")
    parser.add_argument("--ns", default="", help="comma list of N (default 1024,4096,16384; --cpu: 96)")
    parser.add_argument("--variants", default="", help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new variant and no new (variant, N) after this many seconds (default 420; "
                        "--cpu: none)")
    parser.add_argument("--cpu", action="store_true", help="smoke test: CPU, Triton interpreter, tiny sizes")
    parser.add_argument("--no-check", action="store_true", help="skip the agreement and correctness checks")
    parser.add_argument("--time-fallback", action="store_true",
                        help="also time variants that the generic family compiled (FallbackWarning)")
    parser.add_argument("--baselines-anyway", action="store_true",
                        help="time the baselines of variants whose ncd op is not timed")
    parser.add_argument("--json", help="write the rows of the variants that passed to this file (bench/results.py)")
    args = parser.parse_args()
    if args.budget_s is None:
        args.budget_s = math.inf if args.cpu else 420.0
    t_start = time.time()
    names = [x for x in args.variants.split(",") if x] or list(VARIANTS)
    unknown = [x for x in names if x not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu for the smoke test")
    device = "cpu" if args.cpu else "cuda"
    if args.cpu:
        heads, tokens, window, check_shape = 2, 192, 16, Shape(2, 2, 70, 16, "cpu")
        ns = [96] if args.quick or not args.ns else [int(x) for x in args.ns.split(",")]
    else:
        heads, tokens, window, check_shape = HEADS, TOKENS, WINDOW, Shape(2, 4, 1000, WINDOW, "cuda")
        ns = [4096] if args.quick else [int(x) for x in (args.ns or "1024,4096,16384").split(",")]
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    log_file = (out_dir / "attention_variants.log").open("w") if out_dir else None

    def log(line: str) -> None:
        print(line, flush=True)
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()

    device_name = torch.cuda.get_device_name() if not args.cpu else "cpu (Triton interpreter)"
    log(f"device={device_name} torch={torch.__version__} triton={triton.__version__} head_dim={DIM} "
        f"ncd={Path(ncd.__file__).parent} date={time.strftime('%Y-%m-%d %H:%M')} variants={','.join(names)} "
        f"ns={ns} budget={args.budget_s:.0f} s")
    for attr, limit in (("cache_size_limit", 256), ("recompile_limit", 256), ("accumulated_cache_size_limit", 4096),
                        ("accumulated_recompile_limit", 4096)):
        if hasattr(torch._dynamo.config, attr):
            setattr(torch._dynamo.config, attr, limit)
    # one compiled flex_attention (recompiled per mask, shape and grad mode, as a model's layers share it); on the
    # CPU (smoke test) Flex runs eagerly, forward only: inductor's CPU Flex and Flex's CPU backward are not there
    flex = flex_attention if args.cpu else torch.compile(flex_attention, dynamic=False)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # on purpose here
    compiled_dense = torch.compile(dense, dynamic=False)

    rows: list[dict] = []
    checks: dict[str, Check] = {}
    skipped: list[tuple[str, int, str]] = []
    not_timed: dict[str, str] = {}
    load_failed = False
    for name in names:
        variant = VARIANTS[name]
        if time.time() - t_start > args.budget_s:
            log(f"skip {name}: over the time budget")
            skipped += [(name, n, "skipped (budget)") for n in ns]
            continue
        done: list[int] = []
        try:
            t0 = time.time()
            loaded = load(variant, log)
            load_failed |= loaded.op is None
            if not args.no_check:
                checks[name] = c = check(variant, loaded, check_shape, log)
                log(f"check {name}: agreement={c.agreement} flex={c.flex} ok={c.ok} "
                    + " ".join(f"{k}={e:.2e}" for k, e in c.errors.items()) + f" {c.note} ({time.time() - t0:.0f} s)")
            call_error = checks[name].note if name in checks and checks[name].note.startswith("ncd call") else ""
            time_ncd = (loaded.op is not None and not call_error
                        and (not loaded.fallback or args.time_fallback or args.cpu))
            if not time_ncd:
                why = loaded.error or call_error or f"not timed: generic family ({loaded.fallback})"
                not_timed[name] = why
                if not args.baselines_anyway:
                    skipped += [(name, n, why) for n in ns]
                    continue
            for n in ns:
                if time.time() - t_start > args.budget_s:
                    log(f"skip {name} N={n}: over the time budget")
                    skipped.append((name, n, "skipped (budget)"))
                    done.append(n)
                    continue
                t0 = time.time()
                shape = Shape(max(tokens // n, 1), heads, n, window, device)
                try:
                    time_shape(variant, loaded, shape, flex, compiled_dense, log, time_ncd, rows)
                finally:
                    # this mask's compiled graphs are never called again: drop them with the tensors their guards
                    # and closures hold (a [H N N] bias is 17 GB at N 16k)
                    torch._dynamo.reset()
                    if ON_GPU:
                        torch.cuda.empty_cache()
                done.append(n)
                log(f"timed {name} N={n} B={shape.batch} in {time.time() - t0:.0f} s")
        except Exception as exc:  # a broken CUDA context, or a bug: the tables still print
            log(f"{name}: {traceback.format_exc(limit=-8)}")
            checks.setdefault(name, Check(name)).ok = False
            checks[name].note += f" crashed: {first_line(exc)}"
            skipped += [(name, n, f"crashed: {first_line(exc)}") for n in ns if n not in done]
    ok = all(c.ok for c in checks.values())
    finite = all(r["ms"] is None or math.isfinite(r["ms"]) for r in rows)
    passed = {name for name in names if checks.get(name, Check(name)).ok}  # --no-check: all that did not crash
    if out_dir:
        (out_dir / "attention_variants.json").write_text(json.dumps(
            {"device": device_name, "torch": torch.__version__, "triton": triton.__version__, "correct": ok,
             "checks": [c.__dict__ for c in checks.values()], "rows": rows}, indent=1))
    if args.json:
        flex_label = "FlexAttention (eager, CPU)" if args.cpu else "FlexAttention (compiled)"
        from results import new_run, write_results  # bench/results.py, beside this script

        write_results(args.json, new_run("attention_variants", device_name, result_rows(rows, passed, flex_label),
                                         title="ncd against FlexAttention and torch.compile",
                                         source=f"bench/attention_variants.py {' '.join(sys.argv[1:])}"))
    ran = sum(c.ran for c in checks.values())
    verdict = "not checked (--no-check)" if args.no_check else "OK" if ok else "FAILED"
    log(f"total {time.time() - t_start:.0f} s; correctness {verdict} ({ran} of {len(names)} variants' ncd ops "
        "checked)" + ("" if not load_failed else "; some specs did not load"))
    if checks:
        check_table(list(checks.values()), log)
    timing_table(rows, skipped, not_timed, checks, log)
    return 1 if not ok or not finite else 2 if load_failed else 0


if __name__ == "__main__":
    sys.exit(main())
