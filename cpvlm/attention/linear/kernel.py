"""The local gated delta rule: chunked, in plain torch, over independent segments of one stream.

Legend: T stream rows, H heads, K key dim, V value dim, N segments, L = chunk_size rows per
kernel chunk, n segments of a group, c kernel chunks per segment of the group.

Recurrence (the definition transformers' ``torch_recurrent_gated_delta_rule`` runs token by
token), per head, state S [K, V]:

    S_t = exp(g_t) S_{t-1};  S_t = S_t + k_t (beta_t (v_t - k_t^T S_t))^T;  o_t = S_t^T q_t

q is taken as given (already normalised and scaled: the caller does that). The chunked form is
transformers' ``torch_chunk_gated_delta_rule`` (UT transform inside a chunk, a scan over chunks)
without its float32 cast: it computes in the inputs' dtype, so float64 stays float64.

Segments are ``[cu_seqlens[i], cu_seqlens[i+1])`` of the stream, each from its own initial state;
the signature is flash-linear-attention's varlen one (``cu_seqlens``, ``initial_state``, a final
state per segment), so a fused kernel with that signature can replace this one. Segments with the
same number of kernel chunks run as one batch; each is padded at its end with zeros (k = 0 and
g = 0 leave the state unchanged), so the final state is the one after its last real row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DeltaRuleKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``kernel(q_THK, k_THK, v_THV, g_TH, beta_TH, *, initial_state [N,H,K,V], cu_seqlens [N+1])
-> (o [T,H,V], final_state [N,H,K,V])``, differentiable in every tensor input."""


def _chunked(q, k, v, g, beta, state):
    """One batch of equal-length segments: q/k [n,H,c,L,K], v [n,H,c,L,V], g/beta [n,H,c,L],
    state [n,H,K,V] -> (o [n,H,c,L,V], final state)."""
    size = q.shape[-2]
    upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(-1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    # (I + strictly_lower(ut)) [u | w] = [v beta | k beta exp(cum)]: the delta rule's corrections
    # within the chunk, solved at once (unitriangular ignores ut's diagonal).
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    uw = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    u, w = uw[..., : v.shape[-1]], uw[..., v.shape[-1] :]
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp().unsqueeze(-1)
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(q.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_dec[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2), state


def _take(x: torch.Tensor, flat: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """Rows ``flat`` of ``x`` [T+1, H, ...] as [n, c, L, H, ...]."""
    return x.index_select(0, flat).view(*shape, *x.shape[1:])


def chunk_gated_delta_rule(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    *,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule on every segment of the stream -> ``(o [T,H,V], final [N,H,K,V])``.

    Every segment must be non-empty. All tensors share one floating dtype, which is the compute
    dtype (cast before calling for a float32 computation of half-precision inputs).
    """
    t, h, _ = q_THK.shape
    dv = v_THV.shape[-1]
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if not lengths or bounds[0] != 0 or bounds[-1] != t or min(lengths) < 1:
        raise ValueError(
            f"chunk_gated_delta_rule: cu_seqlens {bounds} must rise strictly from 0 to the "
            f"stream length {t}"
        )
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(-(-n // chunk_size), []).append(i)
    # One zero row at index t is what every segment is padded with.
    zero = q_THK.new_zeros(1, h)
    rows = [torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (q_THK, k_THK, v_THV)]
    gates = [torch.cat([x, zero.to(x.dtype)]) for x in (g_TH, beta_TH)]
    outs, finals, out_rows, order = [], [], [], []
    for chunks, seg in groups.items():
        span = chunks * chunk_size
        index = torch.full((len(seg), span), t, dtype=torch.long)
        for row, i in enumerate(seg):
            index[row, : lengths[i]] = torch.arange(bounds[i], bounds[i + 1])
        flat = index.flatten().to(q_THK.device)
        shape = (len(seg), chunks, chunk_size)
        q, k, v = (_take(x, flat, shape).movedim(3, 1) for x in rows)
        g, beta = (_take(x, flat, shape).permute(0, 3, 1, 2) for x in gates)
        seg_index = torch.tensor(seg, device=q_THK.device)
        o, final = _chunked(q, k, v, g, beta, initial_state.index_select(0, seg_index))
        # [n,H,c,L,V] -> [n*span, H, V], keeping the real rows only.
        o = o.permute(0, 2, 3, 1, 4).reshape(-1, h, dv)
        real = torch.nonzero(index.flatten() < t).squeeze(1).to(o.device)
        outs.append(o.index_select(0, real))
        out_rows.append(index.flatten()[index.flatten() < t])
        finals.append(final)
        order.extend(seg)
    o = torch.cat(outs).index_select(0, torch.argsort(torch.cat(out_rows)).to(q_THK.device))
    final = torch.cat(finals).index_select(0, torch.argsort(torch.tensor(order)).to(q_THK.device))
    return o, final
