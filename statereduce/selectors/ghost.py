"""``ghost``: a balanced-truncation proxy per state channel, s_j = sqrt(mean_t K[t,j]^2 * mean_t Q[t,j]^2).

After GHOST (Menezes & Kyrillidis, "GHOST: Unmasking Phantom States in Mamba2 via Grouped Hidden-state Output-aware
Selection & Truncation", arXiv:2602.11408, ICML 2026), which prunes Mamba-2's ``d_state`` (N) from forward-pass
statistics and reports about +1 WikiText-2 perplexity at 50% of N on Mamba-2 130M-2.7B without fine-tuning.

What the paper does (from its abstract, the authors' blog post and a public review of the paper and its code; the
method section itself was not available here, so no formula below is quoted from it): it ranks each state channel n
of a Mamba-2 group by the product of an empirical *controllability* energy (how strongly the inputs drive channel n
of the hidden state) and an empirical *observability* energy (how strongly channel n reaches the output through C),
effectively ``sum_t h_t[n]^2 C_t[n]^2`` with h_t the hidden state: read both as the empirical analogue of a Hankel
singular value and as the local mean-squared output error of zeroing that channel. It measures the hidden states
themselves, layer by layer, re-collecting the statistics after each layer is pruned ("two forward passes per layer,
sequential recalibration"), and selects over Mamba-2's grouped state channels (B and C are shared by the heads of a
group).

What this module computes, and why. The workflow captures, per q/k head (for Mamba-2: per group), a uniform random
sample of token rows of K = B_t and Q = C_t as they enter the recurrence (``activations.h5``; the capture is not
changed for this selector), not the hidden state, dt or A, and the sampled rows carry no time order. The proxy is
therefore derived from B and C alone:

- Mamba-2's recurrence per head, channel n, is ``S_t[:, n] = exp(dt_t A) S_{t-1}[:, n] + dt_t x_t B_t[n]`` and
  ``y_t = sum_n S_t[:, n] C_t[n]``. The decay ``exp(dt_t A)`` is a scalar per head, the same for every channel n,
  and dt_t, x_t are the same for every n too: channel n differs from the others only through B[n] and C[n].
- The controllability Gramian of this (diagonal, time-varying) system driven by white input is the state
  covariance, ``P_nn = sum_s w_{t,s}^2 E[B_s[n]^2]`` with weights w (products of decays, dt and the input's power)
  that do not depend on n; likewise the observability Gramian ``Q_nn = sum_s w'_{s,t}^2 E[C_s[n]^2]``. With B and C
  independent of dt, ``P_nn = kappa_P E[B_n^2]`` and ``Q_nn = kappa_O E[C_n^2]`` with kappa the same for every
  channel of the group, so the Hankel-singular-value proxy of channel n, ``sigma_n = sqrt(P_nn Q_nn)``, ranks
  channels as ``sqrt(E[B_n^2] E[C_n^2])``, which is what is computed (means over the calibration rows, float64):

      p_j = mean_t K[t, j]^2,   q_j = mean_t Q[t, j]^2,   s_j = sqrt(p_j * q_j)   (variant "kq")

  and the top d_k' channels by s_j are kept (ties: lower index first; sorted indices; the scores are s_j of the
  kept channels). Variant "k" takes the observability side as uniform (s_j = sqrt(p_j)), "q" the controllability
  side (s_j = sqrt(q_j)): the ``ghost-k`` / ``ghost-q`` tokens, one-sided ablations of GHOST, whose premise is to
  measure both sides jointly. A channel that no input drives (B_n = 0) or that the readout never sees (C_n = 0)
  scores 0 and goes first, however large its other side, unlike DRRQR or column norms of [K; Q], which add the two
  sides.
- The paper's local-MSE reading gives the same ranking: zeroing channel n removes ``S_t[:, n] C_t[n]`` from y_t,
  of mean square ``E[||S_t[:, n]||^2 C_t[n]^2] ~ P_nn E[C_n^2] ~ s_n^2`` when the state (a sum over many past
  tokens) is nearly independent of the current C_t.

Approximations (what the paper measures that this does not): (1) the hidden-state energy comes from E[B_n^2] under
white input; the real inputs x_t and B_t[n] are correlated over time (B after conv + SiLU has a positive mean), which
makes a channel's true state energy depend on its own autocorrelation and mean, which the captured rows cannot
give (no time order, no dt). (2) No sequential recalibration: all layers are scored from the unpruned model's
statistics, as every selector of this workflow is. (3) Every group keeps the same N' (Mamba-2's ``state_size`` is
global); a per-layer width comes from the ``@<budget>`` tokens (the greedy budget uses the score mass of s, the
share of the balanced-truncation error bound ``2 sum sigma_n`` that the kept channels carry). (4) A subset of
coordinates is kept, never a rotation (the checkpoint's channels are sliced), so the Gramians' off-diagonal terms
are ignored: true balanced truncation would rotate into the balanced basis first.

Families. Mamba-2 (``tiny-mamba2``, ``mamba2-370m``, ``codestral7b``): the derivation above, K = B, Q = C per group.
DeltaNet, Gated DeltaNet and Qwen3.5's Gated DeltaNet layers: an approximation. Their state update is the delta rule
``S_t = a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T`` (a_t = 1 for DeltaNet, a scalar per head for Gated
DeltaNet): the write term ``beta_t v_t k_t^T`` plays ``dt_t x_t B_t^T`` (beta_t, v_t the same for every key
channel), the gate is channel-independent as Mamba-2's decay, but the erase term ``-beta_t S k k^T`` couples the key
channels (not a diagonal SSM), and keys and queries are L2-normalized in the kernel (K and Q here are taken before
that norm, as DRRQR takes them; the norm scales all channels of a token alike, so it reweights tokens, not the
channels within one). The score is that of the same system without
the erase term (gated linear attention), so for these families it is a controllability x observability heuristic,
not a Gramian of the model. Qwen3.5's softmax-attention layers are not pruned by any selector.

Key side only (no ``-v`` / ``-kv``); no options; needs the calibration activations only.
"""

from __future__ import annotations

import numpy as np

from statereduce.selectors.registry import HeadData, HeadSelection, register_selector, top_k


def gramian_diagonals(data: HeadData, variant: str = "kq") -> dict[str, np.ndarray]:
    """The per-channel energies the score multiplies: ``{"k": mean_t K[t]^2, "q": mean_t Q[t]^2}`` (float64 [d_k]),
    the sides ``variant`` uses ("kq": both; "k": keys; "q": queries); a missing or misshapen side raises ValueError."""
    sides = "kq" if variant == "kq" else variant
    d_k = data.d_k
    out = {}
    for side in sides:
        field = {"k": "K", "q": "Q"}[side]
        value = getattr(data, field)
        if value is None:
            raise ValueError(f"selector 'ghost' (variant {variant!r}) needs HeadData.{field}, which is None")
        arr = np.asarray(value, dtype=np.float64)
        if arr.ndim != 2 or arr.shape[1] != d_k or arr.shape[0] == 0:
            raise ValueError(f"{field} must be [N, d_k={d_k}] with N >= 1, got shape {arr.shape}")
        out[side] = np.einsum("ij,ij->j", arr, arr) / arr.shape[0]
    return out


def ghost_scores(data: HeadData, variant: str = "kq") -> np.ndarray:
    """The score of every channel: ``sqrt(p_j * q_j)`` for "kq", ``sqrt(p_j)`` for "k", ``sqrt(q_j)`` for "q"
    (:func:`gramian_diagonals`; module docstring)."""
    energies = gramian_diagonals(data, variant)
    product = np.ones(data.d_k)
    for e in energies.values():
        product = product * e
    return np.sqrt(product)


@register_selector("ghost", needs={"activations"})
def ghost(data: HeadData, n_keep: int, *, variant: str = "kq", rng: np.random.Generator) -> HeadSelection:
    """Keep the ``n_keep`` channels with the largest balanced-truncation proxy ``sqrt(E[K_j^2] E[Q_j^2])``.

    Args:
        data: needs ``K`` and/or ``Q`` ([N, d_k], calibration rows as they enter the recurrence) by the variant.
        n_keep: channels to keep.
        variant: "kq" (controllability x observability), "k" (controllability only) or "q" (observability only).
        rng: unused (deterministic).
    """
    return top_k(ghost_scores(data, variant), n_keep)
