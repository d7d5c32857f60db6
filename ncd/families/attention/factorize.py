"""Factorisation: when a normalized contraction's maps are low-degree polynomials of the score, reassociate
the contractions so the [query key] matrix is never formed (or, with a causal mask, only its diagonal
chunks are).

With s = scale q.k, a1(s) = c0 + c1 s and a2(s) = e0 + e1 s + e2 s^2, over the keys j visible to query i:

    sum_j w_j a1(s_ij) v_j = c0 V_w + c1 scale q_i (K_w^T V)          V_w = sum_j w_j v_j
    sum_j w_j a2(s_ij)     = e0 W + e1 scale q_i . k_w + e2 scale^2 q_i^T (K_w^T K) q_i

where K_w = diag(w) K, k_w = sum_j w_j k_j and W = sum_j w_j. The moments K_w^T V and K_w^T K are D x D per
head: the cost is O((Nq + Nk) D^2) instead of O(Nq Nk D). Spherical attention (a1 = x, a2 = x^2, b = sqrt)
and linear attention qualify. With the causal mask the moments become prefix sums: the generated kernels
(kernel_chunked.py) scan the keys chunk by chunk and store the moments at each chunk
start; a query adds the keys of its own chunk as masked scores (fla-style chunked linear attention).

The cost model (ncd/cost.py: `form_estimates`) estimates both forms; the generated op picks one per call
with the measured crossover below. NCD_ATTENTION_FACTORIZE overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ncd.streaming import Certificate, X

# Keys per state of the causal chunked form (the GPU default of the generated module, `CHUNK`).
CHUNK = 128

# Crossover: the factorized form is chosen when Nq Nk / (Nq + Nk) > CROSSOVER * D (self-attention:
# N > 2 * CROSSOVER * D). Measured on H100 (bench/log/2026-11-20-to-22.md, 2026-11-21: bf16, D = 128, 32k tokens x
# 16 heads; ms forward / forward+backward). The factorized form costs about the same at every N: no mask 0.33-0.37 /
# 1.17-1.41, causal 0.63-0.77 / 2.10-2.43 (its [D, 2D] states per chunk of 128 keys are written and read
# back). The streamed kernels cost ~N: no mask 0.52 / 2.73 at N = 1024, causal 0.39 / 1.97 at 1024 and
# 1.03 / 5.42 at 4096. So without a mask the factorized form wins from N = 1024 down to about N = 512; with
# the causal mask the streamed kernels win at N = 1024 and lose at 4096, and the forward alone (linear in N
# for the streamed form) crosses near N = 2048, forward+backward near N = 1300.
CROSSOVER = 2.0  # N > 512 for self-attention at D = 128
CROSSOVER_CAUSAL = 5.0  # N > 1280
# The kernels hold [D, D] blocks of the states as matrix-product operands in shared memory: two of them at
# D = 256 (256 KB in bf16) exceed an H100's 227 KB, so wider heads always take the streamed form.
MAX_HEAD_DIM = 128


@dataclass(frozen=True)
class Factorization:
    c0: float
    c1: float
    e0: float
    e1: float
    e2: float
    causal: bool = False
    chunk: int = CHUNK
    crossover: float = CROSSOVER
    max_head_dim: int = MAX_HEAD_DIM

    def describe(self) -> list[str]:
        mask = "causal: prefix moments, chunked" if self.causal else "no mask"
        lines = [
            f"factorized form (a1, a2 polynomials of degree <= 1, <= 2 in the score; {mask}):",
            f"  numerator  = {self.c0:g} * sum_j w_j v_j + {self.c1:g} * scale * q (K_w^T V)",
            f"  z          = {self.e0:g} * sum_j w_j + {self.e1:g} * scale * q . sum_j w_j k_j"
            f" + {self.e2:g} * scale^2 * q^T (K_w^T K) q",
        ]
        if self.causal:
            lines.append(f"  chunks of {self.chunk} keys: a scan stores K_w^T [V | K] ([D, 2D], input dtype, fp32 "
                         "accumulation) before each chunk; a query block adds its own chunk's keys as masked "
                         "scores; the backward reverse-scans Q^T [dO / b(z) | delta Q]")
        else:
            lines.append("  one [D, 2D] moment K_w^T [V | K] per kv head; backward: Q^T [dO / b(z) | delta Q]")
        lines.append(f"  O = numerator / b(z); cost O((Nq + Nk) D^2{' + N chunk D' if self.causal else ''}); "
                     f"chosen per call when Nq Nk / (Nq + Nk) > {self.crossover:g} D (measured crossover) and the "
                     f"head-dim tile is at most {self.max_head_dim}")
        return lines

    def chosen(self, n_query: int, n_key: int, head_dim: int) -> bool:
        """The generated op's rule (auto mode); head_dim is the kernels' tile."""
        return head_dim <= self.max_head_dim and n_query * n_key > self.crossover * head_dim * (n_query + n_key)


def factorize(cert: Certificate, causal: bool) -> Factorization | None:
    if cert.rescale is not None:
        return None
    try:
        p1, p2 = sympy.Poly(cert.a1, X), sympy.Poly(cert.a2, X)
    except sympy.PolynomialError:
        return None
    if p1.degree() > 1 or p2.degree() > 2 or not all(c.is_number for c in (*p1.all_coeffs(), *p2.all_coeffs())):
        return None
    c = [float(p1.coeff_monomial(X**i)) for i in range(2)]
    e = [float(p2.coeff_monomial(X**i)) for i in range(3)]
    return Factorization(c[0], c[1], e[0], e[1], e[2], causal=causal,
                         crossover=CROSSOVER_CAUSAL if causal else CROSSOVER)
