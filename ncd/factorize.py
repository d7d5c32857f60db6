"""Factorisation: when a normalized contraction's maps are low-degree polynomials of the score, reassociate
the contractions so the [query key] matrix is never formed at all.

With s = scale q.k, a1(s) = c0 + c1 s and a2(s) = e0 + e1 s + e2 s^2 (no mask):

    sum_j w_j a1(s_ij) v_j = c0 V_w + c1 scale q_i (K_w^T V)          V_w = sum_j w_j v_j
    sum_j w_j a2(s_ij)     = e0 W + e1 scale q_i . k_w + e2 scale^2 q_i^T (K_w^T K) q_i

where K_w = diag(w) K, k_w = sum_j w_j k_j and W = sum_j w_j. The moments K_w^T V and K_w^T K are D x D per
head: the cost is O((Nq + Nk) D^2) instead of O(Nq Nk D). Spherical attention (a1 = x, a2 = x^2, b = sqrt)
and linear attention qualify; causal masks do not (the moments would become prefix sums). The cost model
picks the cheaper form per call from the sizes; NCD_ATTENTION_FACTORIZE overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from .streaming import Certificate, X, Z
from .symbolic import torch_expr

# The streamed form costs 4 Nq Nk D tensor-core FLOPs; the factorized one ~8 (Nq + Nk) D^2 FLOPs but runs
# memory-bound with several passes over [N, D] tensors. Counting FLOPs alone puts the crossover at
# Nq Nk / (Nq + Nk) = 2 D; measured on H100 (BENCHMARKS.md, 2026-11-21: bf16, D = 128, 32k tokens x 16 heads,
# factorized 0.76 ms fwd / 3.5 ms fwd+bwd at every N, streamed 0.52 / 2.78 ms at N = 1024 and 0.94 / 4.88 ms
# at N = 2048) it sits near N = 12 D for self-attention, i.e. Nq Nk / (Nq + Nk) = 6 D.
CROSSOVER = 6


@dataclass(frozen=True)
class Factorization:
    c0: float
    c1: float
    e0: float
    e1: float
    e2: float
    b_torch: str  # b(z) as torch source in `z`
    crossover: int = CROSSOVER

    def describe(self) -> list[str]:
        return [
            "factorized form (no mask; a1, a2 polynomials of degree <= 1, <= 2 in the score):",
            f"  numerator  = {self.c0:g} * sum_j w_j v_j + {self.c1:g} * scale * q (K_w^T V)",
            f"  z          = {self.e0:g} * sum_j w_j + {self.e1:g} * scale * q . sum_j w_j k_j"
            f" + {self.e2:g} * scale^2 * q^T (K_w^T K) q",
            f"  O = numerator / b(z), b(z) = {self.b_torch};  moments are D x D per head, so the cost is "
            f"O((Nq + Nk) D^2); chosen per call when Nq Nk / (Nq + Nk) > {self.crossover} D (measured crossover)",
        ]


def factorize(cert: Certificate, causal: bool) -> Factorization | None:
    if causal:
        return None
    try:
        p1, p2 = sympy.Poly(cert.a1, X), sympy.Poly(cert.a2, X)
    except sympy.PolynomialError:
        return None
    if p1.degree() > 1 or p2.degree() > 2 or not all(c.is_number for c in (*p1.all_coeffs(), *p2.all_coeffs())):
        return None
    c = [float(p1.coeff_monomial(X**i)) for i in range(2)]
    e = [float(p2.coeff_monomial(X**i)) for i in range(3)]
    try:
        b = torch_expr(cert.b, Z)
    except ValueError:
        return None
    return Factorization(c[0], c[1], e[0], e[1], e[2], b)
