"""Plain PyTorch references for the Gated KalmaNet core and for gated linear attention (naive_simple_gla), in fla's
layout: q, k [B, T, H, K], v [B, T, H, V], g, beta, alpha [B, T, H]; states H [B, H, K, K], S = U^T [B, H, K, V].

`naive_gka`: the per-timestep recurrence running the same Chebyshev iteration (or an exact solve), differentiable
by autograd: the test oracle. `chunked_gka`: the chunked algorithm in torch ops (the benchmark's chunked baseline).
"""

from __future__ import annotations

import torch

from ncd.reference import chebyshev_iteration


def _scaled(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if beta is None:
        return k, v
    return k * (beta[..., None] + 1e-6), v * (beta[..., None] + 1e-6)


SHARED = "g"  # naive_gka's gk: H takes U's gate


def naive_gka(q, k, v, g, beta=None, alpha=None, scale=None, ridge=0.02, num_iter=30, initial_state=None,
              exact=False, gk=SHARED, ridge_offset=0.0):
    """Returns (o [B, T, H, V], (H_T, S_T)); computes in q's dtype (pass float64 for an oracle). g: U's log gates
    (None: ungated); gk: H's (SHARED: g's; None: ungated); lambda = ridge ||H|| + ridge_offset."""
    B, T, heads, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    kb, vb = _scaled(k, v, beta)
    if initial_state is None:
        h = q.new_zeros(B, heads, K, K)
        s = q.new_zeros(B, heads, K, V)
    else:
        h, s = (t.to(q.dtype) for t in initial_state)
    eye = torch.eye(K, dtype=q.dtype, device=q.device)
    outs = []
    gk = g if gk is SHARED else gk

    def decay(gate: torch.Tensor | None, t: int) -> torch.Tensor | float:
        return 1.0 if gate is None else gate[:, t].exp()[..., None, None].to(q.dtype)

    for t in range(T):
        h = decay(gk, t) * h + kb[:, t, :, :, None] * kb[:, t, :, None, :]
        s = decay(g, t) * s + kb[:, t, :, :, None] * vb[:, t, :, None, :]
        norm = h.pow(2).sum((-1, -2)).sqrt()[..., None]
        lam = ridge * norm + ridge_offset
        system = h + lam[..., None] * eye
        if exact:
            x = torch.linalg.solve(system, q[:, t])
        else:
            x = chebyshev_iteration(system, q[:, t], lam, norm + lam, num_iter)
        qa = x if alpha is None else q[:, t] + alpha[:, t, :, None] * (x - q[:, t])
        outs.append(scale * (s.transpose(-1, -2) @ qa[..., None])[..., 0])
    return torch.stack(outs, 1), (h, s)


def chunked_gka(q, k, v, g, beta=None, alpha=None, scale=None, ridge=0.02, num_iter=30, chunk=64):
    """The chunked algorithm in torch ops (fp32, or float64 for float64 q): chunk-start states by a loop over
    chunks, then the Gram-form norms, the Chebyshev iteration and the output for all chunks at once. Forward and
    autograd backward."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, heads, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    kb, vb = _scaled(k.to(dt), v.to(dt), beta)
    pad = (-T) % chunk
    n = (T + pad) // chunk

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, n, C, ...]
        t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 3) + (0, 0, 0, pad))
        return t.reshape(B, n, chunk, heads, *t.shape[3:]).transpose(1, 3).transpose(2, 3)

    qc, kc, vc = blocks(q.to(dt)), blocks(kb), blocks(vb)
    gc = blocks(g.to(dt)[..., None])[..., 0].cumsum(-1)  # [B, H, n, C]
    mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(mask, (gc[..., :, None] - gc[..., None, :]).masked_fill(~mask, 0).exp(), 0)
    eg = gc.exp()
    h = q.new_zeros(B, heads, K, K, dtype=dt)
    s = q.new_zeros(B, heads, K, V, dtype=dt)
    h0s, s0s = [], []
    for i in range(n):
        h0s.append(h)
        s0s.append(s)
        w = (gc[:, :, i, -1:] - gc[:, :, i]).exp()[..., None] * kc[:, :, i]
        total = gc[:, :, i, -1].exp()[..., None, None]
        h = total * h + w.transpose(-1, -2) @ kc[:, :, i]
        s = total * s + w.transpose(-1, -2) @ vc[:, :, i]
    h0, s0 = torch.stack(h0s, 2), torch.stack(s0s, 2)
    gram = kc @ kc.transpose(-1, -2)
    khk = ((kc @ h0) * kc).sum(-1)
    norm2 = eg**2 * h0.pow(2).sum((-1, -2))[..., None] + 2 * eg * (decay * khk[..., None, :]).sum(-1) \
        + ((decay @ gram.pow(2)) * decay).sum(-1)
    norm = norm2.clamp_min(0).sqrt()
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    lam = (ridge * norm)[..., None]
    step0 = (2 / (safe * (1 + 2 * ridge)))[..., None]
    rho2 = (1 / (1 + 2 * ridge)) ** 2

    def matvec(x: torch.Tensor) -> torch.Tensor:
        return eg[..., None] * (x @ h0) + ((x @ kc.transpose(-1, -2)) * decay) @ kc

    x_prev, x, omega = torch.zeros_like(qc), step0 * qc, 2.0
    for _ in range(num_iter):
        omega = 4 / (4 - rho2 * omega)
        x, x_prev = x - step0 * omega * (matvec(x) + lam * x - qc) + (omega - 1) * (x - x_prev), x
    qa = x if alpha is None else qc + blocks(alpha.to(dt)[..., None]) * (x - qc)
    o = scale * (eg[..., None] * (qa @ s0) + ((qa @ kc.transpose(-1, -2)) * decay) @ vc)
    o = o.transpose(2, 3).transpose(1, 3).reshape(B, n * chunk, heads, V)[:, :T]
    return o.to(v.dtype)


def naive_simple_gla(q, k, v, g, scale=None, initial_state=None):
    """Gated linear attention token by token, S_t = exp(g_t) S_(t-1) + k_t v_t^T, o_t = scale S_t^T q_t, with g
    [B, T, H] (a gate per head) or [B, T, H, K] (GLA: a gate per key row of S): returns (o [B, T, H, V], S_T [B, H,
    K, V]); computes in q's dtype (pass float64 for an oracle), differentiable."""
    B, T, heads, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    s = q.new_zeros(B, heads, K, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for t in range(T):
        decay = g[:, t].exp()[..., None] if g.dim() == 4 else g[:, t].exp()[..., None, None]
        s = decay.to(q.dtype) * s + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(scale * (q[:, t, :, None, :] @ s)[..., 0, :])
    return torch.stack(outs, 1), s


def naive_delta_rule(q, k, v, beta, g=None, scale=None, initial_state=None):
    """The (gated) delta rule token by token, S_t = exp(g_t) (I - b_t k_t k_t^T) S_(t-1) + b_t k_t v_t^T (g None:
    no gate), o_t = scale S_t^T q_t: returns (o [B, T, H, V], S_T [B, H, K, V]); computes in q's dtype (pass
    float64 for an oracle), differentiable."""
    B, T, heads, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    s = q.new_zeros(B, heads, K, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for t in range(T):
        if g is not None:
            s = g[:, t].exp()[..., None, None].to(q.dtype) * s
        kt = k[:, t, :, :, None]
        u = beta[:, t, :, None].to(q.dtype) * (v[:, t] - (kt * s).sum(-2))
        s = s + kt * u[..., None, :]
        outs.append(scale * (q[:, t, :, None, :] @ s)[..., 0, :])
    return torch.stack(outs, 1), s
