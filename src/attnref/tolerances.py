"""Numerical tolerances by dtype, stated in one place.

Two rules use them:

- **direct comparison** (tests, reference vs an independent computation):
  ``|actual - expected| <= atol[dtype] + rtol[dtype] * |expected|`` elementwise, with
  ``expected`` computed in float64 from the same (already rounded) inputs;
- **the audit rule** (PyTorch's and FlashAttention's rule for their own kernels, plus a
  conditioning term):
  ``max|backend - oracle| <= max(floor, FUDGE * max|reference_same_dtype - oracle|)``
  and the same for the mean error, where the oracle is the reference in float64,
  ``reference_same_dtype`` is the reference run in the backend's dtype, and
  ``floor = max(atol[dtype], (eps(compute dtype) * kappa + 2 u[dtype] + 2 sqrt(n) u_c)
  * max|V|)`` with ``kappa = scale * max_ij sum_d |q_id| |k_jd|``, ``u`` the unit
  roundoff of the inputs' dtype, ``u_c`` that of the compute dtype and ``n`` the most
  keys a row sees.

  The conditioning term is first-order error analysis of the problem, not of any
  implementation: rounding ``q . k`` in precision ``eps`` moves a score by up to about
  ``eps * kappa``, and the softmax passes a score error on to the output scaled by at
  most ``max|V|``. On "hot" inputs (peaky softmax) it exceeds ``atol`` and keeps correct
  kernels from being failed for the conditioning of the input; on ordinary inputs it is
  below ``atol`` and changes nothing. Half precision computes scores in float32 (every
  kernel we know accumulates ``QK^T`` in float32), so ``eps`` is float32's there.
  The ``2 u`` term is the two roundings every kernel makes on purpose: the
  probabilities are rounded to the inputs' dtype before the ``P @ V`` matmul, which
  moves an output by up to ``u * max|V|``, and the output itself is rounded to that
  dtype, which moves it by up to ``u * |out| <= u * max|V|``; they matter when ``|V|``
  is well above 1.

The half-precision values cover one rounding of the output (float16 keeps 11 significant
bits, bfloat16 8) with room for an accumulation in float32; float32 covers softmax
and matmul accumulation over a few thousand keys while ``|V|`` is about 1. Past that
(a mean of V far from 0, thousands of keys) the floor's ``2 sqrt(n) u_c * max|V|`` term,
the probabilistic error of two sums over ``n`` keys in the compute precision, does: a
float32 output near 28 over 2047 keys was 4.05e-5 off in torch's SDPA on this CPU.
"""

import math
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from attnref._checking import checked, checked_internal
from attnref.functional import default_scale

__all__ = [
    "FUDGE",
    "GRAD_FUDGE",
    "TOLERANCES",
    "Tolerance",
    "attention_atol",
    "score_condition",
    "score_eps",
    "score_rounding",
    "tolerance",
]


@dataclass(frozen=True)
class Tolerance:
    """Absolute and relative tolerance for one dtype."""

    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=1e-3, rtol=1e-3),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2),
}

#: How many times the reference's own low-precision error a backend may make (audit rule).
FUDGE = 3.0
#: The same for gradients (dQ, dK, dV): backward passes round more intermediate values
#: (the recomputed probabilities, ``dP``, ``dS``) and sum over both sequence lengths.
GRAD_FUDGE = 4.0


def score_eps(dtype: torch.dtype) -> float:
    """Machine epsilon of the precision scores are computed in for inputs of ``dtype``."""
    eps: float = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    return eps


def score_rounding(dtype: torch.dtype, head_dim: int) -> float:
    """How far rounding moves a score, relative to ``kappa`` (`score_condition`), for
    inputs of ``dtype`` and dot products of ``head_dim`` terms: ``(2 + sqrt(D)) u_c``
    (``u_c``, the unit roundoff of the compute precision, `score_eps` / 2): a rounding of
    each product and of the scaling, and ``sqrt(D) u_c`` for the sum over the ``D`` dims
    (the probabilistic bound of recursive summation, as for the sums over keys:
    Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019). A correct float32 kernel was
    ``8 u_c kappa`` off an LSE of 1325 over ``D = 192`` (outlier channels, scale 2.5),
    past the ``2 u_c kappa`` this once allowed (docs/conformance.md)."""
    return (2 + math.sqrt(max(head_dim, 0))) * score_eps(dtype) / 2


def tolerance(dtype: torch.dtype) -> Tolerance:
    """The tolerance for ``dtype``.

    Raises:
        ValueError: no tolerance is defined for ``dtype``.
    """
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance defined for {dtype}") from None


@checked
def score_condition(
    query: Float[Tensor, "*batch h Tq Dh"],
    key: Float[Tensor, "*batch g Tk Dh"],
    scale: float | None = None,
    visible: Bool[Tensor, "*#batch #h #Tq #Tk"] | None = None,
) -> float:
    """``kappa = scale * max_ij sum_d |q_id| |k_jd|`` over the (visible) query-key pairs.

    Rounding a dot product in precision ``eps`` moves a score by up to ``eps * kappa``.
    Keys nobody sees (and NaN or inf planted there) do not count.

    Inputs of at most 32 bits are summed in float32, two to four times faster than in
    float64 (their values are exact there): ``D`` nonnegative terms summed in unit
    roundoff ``u`` come out at least ``(1 - gamma_D)`` times their sum,
    ``gamma_D = D u / (1 - D u)`` (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., section 3.1), so dividing by ``1 - gamma_D`` never gives less
    than the exact ``kappa``. A sum past float32's range is redone in float64.
    """
    if query.numel() == 0 or key.numel() == 0:
        return 0.0
    D = query.shape[-1]
    narrow = max(query.dtype.itemsize, key.dtype.itemsize) <= 4 and D * _U32 < 0.01
    largest = _largest_term(query, key, visible, torch.float32 if narrow else torch.float64)
    if narrow and math.isfinite(largest):
        gamma = D * _U32 / (1 - D * _U32)
        largest /= 1 - gamma
    elif narrow:  # past float32's range: in float64
        largest = _largest_term(query, key, visible, torch.float64)
    s = default_scale(D) if scale is None else scale
    return largest * abs(s)


#: float32's unit roundoff
_U32 = 2.0**-24


@checked_internal
def _largest_term(
    query: Float[Tensor, "*batch h Tq Dh"],
    key: Float[Tensor, "*batch g Tk Dh"],
    visible: Bool[Tensor, "*#batch #h #Tq #Tk"] | None,
    dtype: torch.dtype,
) -> float:
    """``max_ij sum_d |q_id| |k_jd|`` over the visible pairs, summed in ``dtype``."""
    q, k = (_finite_abs(t, dtype) for t in (query, key))
    terms = _grouped(q, k.shape[-3]) @ k.transpose(-2, -1)  # (*batch, g, group * Tq, Tk)
    terms = terms.reshape(*q.shape[:-1], k.shape[-2])  # (*batch, h, Tq, Tk)
    if visible is not None:
        terms = terms.masked_fill(~visible, 0.0)
    return float(terms.max())


@checked_internal
def _finite_abs(t: Float[Tensor, "*shape"], dtype: torch.dtype) -> Float[Tensor, "*shape"]:
    """``|t|`` in ``dtype``, its NaN and infinities 0: one copy, then in place (K and V
    of a long case are tens of MB, and each new buffer costs its pages)."""
    out = t.detach().to(dtype, copy=True)
    out.abs_()
    return out.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


@checked_internal
def _grouped(q: Float[Tensor, "*batch h Tq D"], g: int) -> Float[Tensor, "*batch {g} r D"]:
    """``(*batch, h, Tq, D)`` as ``(*batch, g, (h / g) * Tq, D)``: the queries of each KV
    head's group as rows of one matrix (the interleaved GQA mapping of
    `attnref.functional.expand_kv_heads`), so that no K is repeated."""
    return q.reshape(*q.shape[:-3], g, -1, q.shape[-1])


@checked
def attention_atol(
    query: Float[Tensor, "*batch h Tq Dh"],
    key: Float[Tensor, "*batch g Tk Dh"],
    value: Float[Tensor, "*batch g Tk Dv"],
    scale: float | None = None,
    visible: Bool[Tensor, "*#batch #h #Tq #Tk"] | None = None,
) -> float:
    """The absolute error no correct attention in the inputs' dtype can be asked to beat.

    ``max(atol[dtype], (r * kappa + 2 u + 2 sqrt(n) u_c) * max|V|)``: ``r * kappa``
    (`score_rounding`, `score_condition`) bounds how far rounding a dot product of ``D``
    terms in the compute precision moves a score, and the softmax passes a score
    error on to the output scaled by at most ``max|V|``; ``u`` (the unit roundoff of the
    inputs' dtype) covers rounding the probabilities to that dtype before ``P @ V``, as
    fused kernels do, and ``u`` more rounding the output, which is at most ``max|V|``, to
    it; ``sqrt(n) u_c`` per sum covers the two sums over the ``n`` keys a row sees (the
    softmax's denominator, relative to ``|out|``, and ``P @ V``, relative to
    ``sum_j w_j |v_j| <= max|V|``) accumulated in the compute precision (unit roundoff
    ``u_c = eps / 2``: float32's for half inputs), the probabilistic bound of recursive
    summation (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019); it matters when
    ``|V|`` is far from 0 over thousands of keys.
    With ``visible`` (which keys each query sees), keys nobody sees do not count;
    non-finite entries (NaN planted in padding) never do.
    """
    atol = tolerance(query.dtype).atol
    if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
        return atol
    v = _finite_abs(value, value.dtype)  # |V| in its own dtype (its largest rounds nothing)
    if visible is not None:  # the keys some query of a KV head's group sees
        g, Tk = key.shape[-3], key.shape[-2]
        seen = visible.expand(*query.shape[:-1], Tk).any(dim=-2)  # (*batch, h, Tk)
        seen = seen.reshape(*seen.shape[:-2], g, -1, Tk).any(dim=-2)  # (*batch, g, Tk)
        v.masked_fill_(~seen.unsqueeze(-1), 0.0)
    kappa = score_condition(query, key, scale, visible)
    u = torch.finfo(query.dtype).eps / 2
    # the two sums over the n keys a row sees (the softmax's denominator, P @ V), in the
    # compute precision
    Tk = key.shape[-2]
    n = Tk if visible is None else int(visible.expand(*query.shape[:-1], Tk).sum(-1).max())
    sums = 2 * math.sqrt(n) * score_eps(query.dtype) / 2  # 2 sqrt(n) u_c
    rounding = score_rounding(query.dtype, query.shape[-1])
    return max(atol, (rounding * kappa + 2 * u + sums) * float(v.max()))
