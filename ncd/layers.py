"""Sequence-mixing layers built on compiled specs.

`GatedKalmaNet`: the GKA layer of papers/gated-kalmanet.txt with the official implementation's conventions
(shared/anchors.md): q, k, v projections with short causal depthwise convolutions and SiLU, l2-normalised q and
k (eps 1e-6), beta = sigmoid(.) scaling k and v by (beta + 1e-6), alpha = sigmoid(.) for the alpha-connection, a
Mamba2-style gate g = -exp(A_log) softplus(a + dt_bias) (natural log, <= 0; of U alone with
use_forgetting_gate_kk=False, the key covariance then ungated), the core `ncd.ops.chunk_gka`, then an RMSNorm gated
by silu(g_proj(x)) and the output projection.

`SimpleGatedLinearAttention`: fla's simple GLA layer (fla.layers.simple_gla): q, k, v projections (optional short
convolutions), a per-head log gate logsigmoid(gk_proj(x)) / gate_logit_normalizer, the core
`ncd.ops.chunk_simple_gla`, an RMSNorm gated by silu(g_proj(x)) and the output projection.

`GatedLinearAttention`: fla's GLA layer (fla.layers.gla), the same with a log gate per key dimension from a
low-rank projection, logsigmoid(gk_proj(x)) / gate_logit_normalizer (floored at clamp_min when given), and the
core `ncd.ops.chunk_gla`.

`GatedDeltaNet` and `DeltaNet`: fla's layers (fla.layers.gated_deltanet, fla.layers.delta_net): q, k, v
projections with short convolutions and SiLU, l2-normalised q and k, beta = sigmoid(b_proj(x)) (times 2 with
`allow_neg_eigval`), the Mamba2-style gate of GatedKalmaNet (GatedDeltaNet only), the core
`ncd.ops.chunk_gated_delta_rule` / `chunk_delta_rule`, an RMSNorm gated by silu(g_proj(x)) and the output
projection.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .errors import CallError
from .ops import chunk_delta_rule, chunk_gated_delta_rule, chunk_gka, chunk_gla, chunk_simple_gla


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time followed by SiLU; packed sequences never mix."""

    def __init__(self, dim: int, kernel_size: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel_size, groups=dim, padding=kernel_size - 1, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if cu_seqlens is not None:
            bounds = cu_seqlens.tolist()
            return torch.cat([self(x[:, lo:hi]) for lo, hi in itertools.pairwise(bounds)], 1)
        length = x.shape[1]
        return F.silu(self.conv(x.transpose(1, 2))[..., :length].transpose(1, 2))


class GatedRMSNorm(nn.Module):
    """rmsnorm(o) * weight * silu(gate), over the head dimension."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        o32 = o.float()
        normed = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return (normed * F.silu(gate.float()) if gate is not None else normed).to(o.dtype)


def _check_input(layer: str, x: object, hidden_size: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise CallError(None, detail=f"{layer}: x must be a tensor [batch time hidden], got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != hidden_size:
        raise CallError(None, detail=f"{layer}: x: expected [batch time {hidden_size}], got {list(x.shape)}")


class GatedKalmaNet(nn.Module):
    def __init__(self, hidden_size: int = 2048, num_heads: int = 16, head_dim: int | None = None,
                 num_iter: int = 30, ridge: float = 0.02, conv_size: int = 4, use_short_conv: bool = True,
                 use_beta: bool = True, use_alpha: bool = True, use_output_gate: bool = True, chunk_size: int = 64,
                 norm_eps: float = 1e-6, use_forgetting_gate_kk: bool = True) -> None:
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_dim = head_dim or hidden_size // num_heads
        self.num_iter, self.ridge, self.chunk_size = num_iter, ridge, chunk_size
        self.use_forgetting_gate_kk = use_forgetting_gate_kk
        inner = num_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.convs = nn.ModuleList([ShortConvolution(inner, conv_size) for _ in range(3)]) if use_short_conv else None
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=True) if use_beta else None
        self.alpha_proj = nn.Linear(hidden_size, num_heads, bias=True) if use_alpha else None
        # Mamba2 gate parameters: A in [0, 16), dt in [1e-3, 1e-1) log-uniform (the official initialisation)
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(0, 16).clamp_min(1e-4).log())
        dt = torch.exp(torch.rand(num_heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.g_proj = nn.Linear(hidden_size, inner, bias=False) if use_output_gate else None
        self.o_norm = GatedRMSNorm(self.head_dim, norm_eps)
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, initial_state=None,
                output_final_state: bool = False):
        """x [B, T, hidden] -> [B, T, hidden] (and the final state when asked)."""
        _check_input("GatedKalmaNet", x, self.hidden_size)
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.convs is not None:
            q, k, v = (conv(t, cu_seqlens) for conv, t in zip(self.convs, (q, k, v), strict=True))
        q, k, v = (t.view(B, T, self.num_heads, self.head_dim) for t in (q, k, v))
        q = q / (q.float().norm(dim=-1, keepdim=True).to(q.dtype) + 1e-6)
        k = k / (k.float().norm(dim=-1, keepdim=True).to(k.dtype) + 1e-6)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        beta = torch.sigmoid(self.b_proj(x).float()) if self.b_proj is not None else None
        alpha = torch.sigmoid(self.alpha_proj(x).float()) if self.alpha_proj is not None else None
        o, state = chunk_gka(q, k, v, g, beta, scale=self.head_dim ** -0.5, alpha=alpha, ridge=self.ridge,
                             num_iter=self.num_iter, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                             chunk_size=self.chunk_size, gate_covariance=self.use_forgetting_gate_kk)
        gate = self.g_proj(x).view(B, T, self.num_heads, self.head_dim) if self.g_proj is not None else None
        out = self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))
        return (out, state) if output_final_state else out


class SimpleGatedLinearAttention(nn.Module):
    def __init__(self, hidden_size: int = 1024, num_heads: int = 4, head_dim: int | None = None,
                 expand_v: float = 1.0, use_short_conv: bool = False, conv_size: int = 4,
                 use_output_gate: bool = True, gate_logit_normalizer: float = 16.0, chunk_size: int = 64,
                 norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_k_dim = head_dim or hidden_size // num_heads
        self.head_v_dim = int(self.head_k_dim * expand_v)
        self.gate_logit_normalizer, self.chunk_size = gate_logit_normalizer, chunk_size
        key_dim, value_dim = num_heads * self.head_k_dim, num_heads * self.head_v_dim
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.convs = nn.ModuleList([ShortConvolution(d, conv_size) for d in (key_dim, key_dim, value_dim)]) \
            if use_short_conv else None
        self.gk_proj: nn.Module = nn.Linear(hidden_size, num_heads, bias=True)
        self.g_proj = nn.Linear(hidden_size, value_dim, bias=False) if use_output_gate else None
        self.g_norm = GatedRMSNorm(self.head_v_dim, norm_eps)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, initial_state=None,
                output_final_state: bool = False):
        """x [B, T, hidden] -> [B, T, hidden] (and the final state [N, H, K, V] when asked)."""
        _check_input(type(self).__name__, x, self.hidden_size)
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.convs is not None:
            q, k, v = (conv(t, cu_seqlens) for conv, t in zip(self.convs, (q, k, v), strict=True))
        q, k = (t.view(B, T, self.num_heads, self.head_k_dim) for t in (q, k))
        v = v.view(B, T, self.num_heads, self.head_v_dim)
        o, state = self._core(q, k, v, self._gate(x), self.head_k_dim ** -0.5, initial_state, output_final_state,
                              cu_seqlens, chunk_size=self.chunk_size)
        gate = self.g_proj(x).view(B, T, self.num_heads, self.head_v_dim) if self.g_proj is not None else None
        out = self.o_proj(self.g_norm(o, gate).reshape(B, T, -1))
        return (out, state) if output_final_state else out


    _core = staticmethod(chunk_simple_gla)

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        """Natural-log gates [B, T, H] (<= 0)."""
        return F.logsigmoid(self.gk_proj(x).float()) / self.gate_logit_normalizer


class GatedLinearAttention(SimpleGatedLinearAttention):
    def __init__(self, hidden_size: int = 1024, num_heads: int = 4, head_dim: int | None = None,
                 expand_v: float = 1.0, use_short_conv: bool = False, conv_size: int = 4,
                 use_output_gate: bool = True, gate_logit_normalizer: float = 16.0, gate_low_rank_dim: int = 16,
                 clamp_min: float | None = None, chunk_size: int = 64, norm_eps: float = 1e-5) -> None:
        super().__init__(hidden_size, num_heads, head_dim, expand_v, use_short_conv, conv_size, use_output_gate,
                         gate_logit_normalizer, chunk_size, norm_eps)
        self.clamp_min = clamp_min
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, gate_low_rank_dim, bias=False),
                                     nn.Linear(gate_low_rank_dim, num_heads * self.head_k_dim, bias=True))

    _core = staticmethod(chunk_gla)

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        """Natural-log gates [B, T, H, K] (<= 0), one per key dimension."""
        g = F.logsigmoid(self.gk_proj(x).float()) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            g = g.clamp_min(self.clamp_min)
        return g.view(*x.shape[:2], self.num_heads, self.head_k_dim)


class GatedDeltaNet(nn.Module):
    gated = True

    def __init__(self, hidden_size: int = 2048, num_heads: int = 16, head_dim: int | None = None,
                 expand_v: float = 1.0, use_short_conv: bool = True, conv_size: int = 4, use_output_gate: bool = True,
                 allow_neg_eigval: bool = False, chunk_size: int = 64, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_k_dim = head_dim or hidden_size // num_heads
        self.head_v_dim = int(self.head_k_dim * expand_v)
        self.allow_neg_eigval, self.chunk_size = allow_neg_eigval, chunk_size
        key_dim, value_dim = num_heads * self.head_k_dim, num_heads * self.head_v_dim
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.convs = nn.ModuleList([ShortConvolution(d, conv_size) for d in (key_dim, key_dim, value_dim)]) \
            if use_short_conv else None
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if self.gated:  # Mamba2 gate parameters, initialised as GatedKalmaNet's (and fla's)
            self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
            self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(0, 16).clamp_min(1e-4).log())
            dt = torch.exp(torch.rand(num_heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp_min(1e-4)
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.g_proj = nn.Linear(hidden_size, value_dim, bias=False) if use_output_gate else None
        self.o_norm = GatedRMSNorm(self.head_v_dim, norm_eps)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, initial_state=None,
                output_final_state: bool = False):
        """x [B, T, hidden] -> [B, T, hidden] (and the final state [N, H, K, V] when asked)."""
        _check_input(type(self).__name__, x, self.hidden_size)
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.convs is not None:
            q, k, v = (conv(t, cu_seqlens) for conv, t in zip(self.convs, (q, k, v), strict=True))
        q, k = (F.normalize(t.view(B, T, self.num_heads, self.head_k_dim).float(), dim=-1, eps=1e-6).to(x.dtype)
                for t in (q, k))
        v = v.view(B, T, self.num_heads, self.head_v_dim)
        beta = torch.sigmoid(self.b_proj(x).float()) * (2.0 if self.allow_neg_eigval else 1.0)
        scale = self.head_k_dim ** -0.5
        if self.gated:
            g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                              chunk_size=self.chunk_size)
        else:
            o, state = chunk_delta_rule(q, k, v, beta, scale, initial_state, output_final_state, cu_seqlens,
                                        chunk_size=self.chunk_size)
        gate = self.g_proj(x).view(B, T, self.num_heads, self.head_v_dim) if self.g_proj is not None else None
        out = self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))
        return (out, state) if output_final_state else out


class DeltaNet(GatedDeltaNet):
    gated = False
