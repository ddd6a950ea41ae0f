"""Mamba-2's SSD scan under CP: per-piece decay and state, a scan across ranks, a rerun from true states.

Legend: B batch, L local length, H heads, P head dim, G groups (each serves H/G heads), N state
size, W = cp_size, T stream rows, S segments (pieces) of the stream; state h [P, N] per head.

Recurrence (what transformers' ``mamba2_chunk_scan`` computes in chunks; ``dt`` after its bias,
softplus and clamp, ``A`` < 0 one scalar per head, B and C repeated from their group):

    h_t = exp(A dt_t) h_{t-1} + dt_t x_t B_t^T;    y_t = h_t C_t + D x_t

The decay is a scalar per head and step, so a piece's final state is affine in its initial state
with a scalar slope: h_out = exp(sum_t A dt_t) h_in + h_0, h_0 the final state from zeros. Each
rank computes (sum A dt, h_0) of its pieces (a weighted sum, no chunked scan), one all-gather
gives every rank every piece's pair, and each rank scans the 2W pieces of each document in global
order (from zero at the document start) up to its own pieces. ``chunk_ssd_scan`` then runs its
pieces from those initial states. The backward is autograd's: the all-gather's adjoint is the
reduce-scatter (``differentiable_all_gather_dim0``), which sums at each piece's owner what every
rank's scan says about that piece's pair.

Bytes per rank and layer (elements; n_docs documents): the forward all-gather receives
(W-1) * 2 * n_docs * B * H * (P * N + 1); the backward's reduce-scatter moves the same. The conv
halo (conv.py) is separate.

Precision: transformers' torch path computes the scan in float32 whatever the model's dtype (it
casts x, B, C and dt with ``.float()``, after forming dt in the model's dtype); here a float64
input runs in float64 and anything else in float32 (``delta_rule.compute_dtype``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpvlm.attention.linear.delta_rule import _layout, compute_dtype
from cpvlm.attention.linear.layout import chunk_owner
from cpvlm.distributed.collectives import differentiable_all_gather_dim0
from cpvlm.distributed.shard_plan import ShardPlan

# ---- the local scan ------------------------------------------------------------------------------


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``[..., L]`` -> ``[..., L, L]``: entry (i, j) is ``sum_{j<k<=i} a_k``, -inf above the diagonal.

    A masked cumsum (transformers' ``segment_sum``), not a difference of cumsums: no cancellation
    when the decays are large.
    """
    size = a.shape[-1]
    ones = torch.ones(size, size, dtype=torch.bool, device=a.device)
    x = a[..., None].expand(*a.shape, size).masked_fill(~ones.tril(-1), 0)
    return x.cumsum(-2).masked_fill(~ones.tril(0), float("-inf"))


def _chunked(xdt, a, b, c, state):
    """Equal-length segments: xdt [n,c,L,H,P], a [n,c,L,H], b/c [n,c,L,H,N], state [n,H,P,N]
    -> (y [n,c,L,H,P] without the D term, final state)."""
    a = a.permute(0, 3, 1, 2)  # [n, H, c, L]
    cum = a.cumsum(-1)
    decay = _segsum(a).exp().permute(0, 2, 3, 4, 1)  # [n, c, L, L, H]
    scores = torch.einsum("zclhd,zcshd->zclsh", c, b) * decay
    y_diag = torch.einsum("zclsh,zcshp->zclhp", scores, xdt)
    # Each kernel chunk's own contribution to the state at its end, and the decays to its rows.
    to_end = (cum[..., -1:] - cum).exp().permute(0, 2, 3, 1)  # [n, c, L, H]
    chunk_states = torch.einsum("zclhd,zclh,zclhp->zchpd", b, to_end, xdt)
    chunk_decay = cum[..., -1].exp()  # [n, H, c]
    from_start = cum.exp().permute(0, 2, 3, 1)  # [n, c, L, H]
    y_off = []
    for i in range(xdt.shape[1]):
        y_off.append(torch.einsum("zlhd,zhpd->zlhp", c[:, i], state) * from_start[:, i, ..., None])
        state = state * chunk_decay[:, :, i, None, None] + chunk_states[:, i]
    return y_diag + torch.stack(y_off, dim=1), state


def chunk_ssd_scan(
    x_THP: torch.Tensor,
    dt_TH: torch.Tensor,
    A_H: torch.Tensor,
    B_THN: torch.Tensor,
    C_THN: torch.Tensor,
    *,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence on every segment of the stream -> ``(y [T,H,P], final [S,H,P,N])``.

    Segment i is rows ``[cu_seqlens[i], cu_seqlens[i+1])``, from ``initial_state[i]``; y has no D
    term. ``dt`` is the final time step (after bias, softplus and limits), B and C are per head
    (repeated from their groups). All tensors share one floating dtype, the compute dtype. Every
    segment must be non-empty; segments with the same number of kernel chunks run as one batch,
    each padded at its end with zero rows (dt = 0: decay 1, no input), so the final state is the
    one after its last real row. Differentiable in every tensor input.
    """
    t, h, p = x_THP.shape
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if not lengths or bounds[0] != 0 or bounds[-1] != t or min(lengths) < 1:
        raise ValueError(
            f"chunk_ssd_scan: cu_seqlens {bounds} must rise strictly from 0 to the stream "
            f"length {t}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_ssd_scan: chunk_size must be a positive int, got {chunk_size!r}")
    a = A_H * dt_TH
    xdt = x_THP * dt_TH[..., None]
    # Row t of each (a zero row) is what every segment is padded with.
    rows = [torch.cat([z, z.new_zeros(1, *z.shape[1:])]) for z in (xdt, a, B_THN, C_THN)]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(-(-n // chunk_size), []).append(i)
    outs, finals, out_rows, order = [], [], [], []
    for chunks, seg in groups.items():
        index = torch.full((len(seg), chunks * chunk_size), t, dtype=torch.long)
        for row, i in enumerate(seg):
            index[row, : lengths[i]] = torch.arange(bounds[i], bounds[i + 1])
        flat = index.flatten()
        shape = (len(seg), chunks, chunk_size)
        parts = [z.index_select(0, flat.to(z.device)).view(*shape, *z.shape[1:]) for z in rows]
        seg_index = torch.tensor(seg, device=x_THP.device)
        y, final = _chunked(*parts, initial_state.index_select(0, seg_index))
        real = flat < t
        keep = torch.nonzero(real).squeeze(1).to(y.device)
        outs.append(y.reshape(-1, h, p).index_select(0, keep))
        out_rows.append(flat[real])
        finals.append(final)
        order.extend(seg)
    y = torch.cat(outs).index_select(0, torch.argsort(torch.cat(out_rows)).to(x_THP.device))
    final = torch.cat(finals).index_select(0, torch.argsort(torch.tensor(order)).to(y.device))
    return y, final


# ---- state passing across ranks ------------------------------------------------------------------


def _piece_maps(xdt, a, b, layout) -> torch.Tensor:
    """Per local piece, ``[h_0 (flattened P*N) | sum A dt]``: ``[S, H, P*N + 1]``.

    h_0 = sum_t exp(sum_{s>t} A dt_s) dt_t x_t B_t^T, the final state from zeros.
    """
    n_pieces = len(layout.cu_seqlens) - 1
    h, p, n = b.shape[1], xdt.shape[-1], b.shape[-1]
    maps = xdt.new_zeros(n_pieces, h, p * n + 1)
    for rows, pieces in layout.groups:
        rows, pieces = rows.to(xdt.device), pieces.to(xdt.device)
        a_g = a.index_select(0, rows).view(len(pieces), -1, h)  # [m, c, H]
        # sum over s > t within the piece: the inclusive suffix sum shifted by one (no cancellation)
        suffix = a_g.flip(1).cumsum(1).flip(1)
        after = torch.cat([suffix[:, 1:], torch.zeros_like(suffix[:, :1])], dim=1)
        xdt_g = xdt.index_select(0, rows).view(len(pieces), -1, h, p)
        b_g = b.index_select(0, rows).view(len(pieces), -1, h, n)
        state = torch.einsum("mch,mchp,mchd->mhpd", after.exp(), xdt_g, b_g)
        piece = torch.cat([state.flatten(2), suffix[:, 0, :, None]], dim=-1)
        maps = maps.index_copy(0, pieces, piece)
    return maps


def _piece_states(maps_all: torch.Tensor, plan: ShardPlan, cp_rank: int, batch: int):
    """True initial states of this rank's pieces from every piece's map: ``[S, H, P*N]``.

    ``maps_all`` is ``[W * S, H, P*N + 1]``, rank by rank, each in that rank's local order.
    """
    w, n_docs = plan.cp_size, len(plan.doc_lens)
    maps = maps_all.view(w, batch, n_docs, 2, *maps_all.shape[1:])
    state = maps_all.new_zeros(batch, n_docs, maps_all.shape[1], maps_all.shape[2] - 1)
    starts = {}
    for j in range(2 * w - cp_rank):
        if j in (cp_rank, 2 * w - 1 - cp_rank):
            starts[j] = state
        rank, slot = chunk_owner(j, w)
        if j < 2 * w - 1 - cp_rank:
            m = maps[rank, :, :, slot]
            state = m[..., -1:].exp() * state + m[..., :-1]
    # Local order: per row, per document, head then tail.
    return torch.stack([starts[cp_rank], starts[2 * w - 1 - cp_rank]], dim=2).flatten(0, 2)


def cp_ssd_scan(
    x_BLHP: torch.Tensor,
    dt_BLH: torch.Tensor,
    A_H: torch.Tensor,
    B_BLGN: torch.Tensor,
    C_BLGN: torch.Tensor,
    *,
    plan: ShardPlan,
    group: dist.ProcessGroup | None,
    D_H: torch.Tensor | None = None,
    dt_bias_H: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    chunk_size: int = 64,
) -> torch.Tensor:
    """Exact SSD scan of this rank's shard, each document from a zero state.

    Takes what transformers' ``mamba2_chunk_scan`` takes (without ``initial_states``):

    Args:
        x_BLHP: ``[B, L, H, P]``; dt_BLH: ``[B, L, H]`` the raw time step; A_H: ``[H]`` (< 0);
            B_BLGN, C_BLGN: ``[B, L, G, N]`` with H a multiple of G. This rank's shard of ``plan``.
        plan: the layout every rank of ``group`` shares; the state restarts at every document.
        group: the CP group (``None``: the default group).
        D_H: ``[H]`` skip weight (``y += D x``) or None.
        dt_bias_H, dt_softplus, dt_limit: dt = clamp(softplus(dt + dt_bias), *dt_limit), formed
            in dt's dtype as transformers does, then cast to the compute dtype.
        chunk_size: rows per kernel chunk of the local scan.

    Returns ``[B, L, H, P]`` in the compute dtype (float64 for float64 x, else float32, like
    transformers' float32 scan output), 0 at padding positions. Every rank of the group must call
    this with the same plan, shapes and dtype, forward and backward.
    """
    _check(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, plan, group)
    rank, (batch, s, h, p) = dist.get_rank(group), x_BLHP.shape
    dtype = compute_dtype(x_BLHP.dtype)
    if dt_bias_H is not None:
        dt_BLH = dt_BLH + dt_bias_H.to(dt_BLH.dtype)
    if dt_softplus:
        dt_BLH = F.softplus(dt_BLH)
    dt = torch.clamp(dt_BLH, min=dt_limit[0], max=dt_limit[1]).to(dtype).flatten(0, 1)
    x = x_BLHP.to(dtype).flatten(0, 1)
    rep = h // B_BLGN.shape[2]
    b, c = (z.to(dtype).repeat_interleave(rep, dim=2).flatten(0, 1) for z in (B_BLGN, C_BLGN))
    A = A_H.to(dtype)

    layout = _layout(plan, rank, batch)
    maps = _piece_maps(x * dt[..., None], A * dt, b, layout)
    # differentiable: the backward reduce-scatters every rank's gradient of each piece's map
    maps_all = differentiable_all_gather_dim0(maps, group)
    states = _piece_states(maps_all, plan, rank, batch).view(-1, h, p, b.shape[-1])
    y, _ = chunk_ssd_scan(
        x, dt, A, b, c, initial_state=states, cu_seqlens=layout.cu_seqlens, chunk_size=chunk_size
    )
    if D_H is not None:
        y = y + D_H.to(dtype)[:, None] * x
    return y.view(batch, s, h, p) * layout.real.to(y.device).view(1, -1, 1, 1).to(dtype)


def _check(x, dt, A, B, C, plan, group) -> None:
    op = "cp_ssd_scan"
    if not isinstance(plan, ShardPlan):
        raise ValueError(f"{op}: plan must be a ShardPlan, got {type(plan).__name__}")
    if dist.get_world_size(group) != plan.cp_size:
        raise ValueError(
            f"{op}: the group has {dist.get_world_size(group)} ranks but the plan has "
            f"cp_size={plan.cp_size}"
        )
    named = {"x": (x, 4), "dt": (dt, 3), "A": (A, 1), "B": (B, 4), "C": (C, 4)}
    for name, (z, want) in named.items():
        if not isinstance(z, torch.Tensor) or z.dim() != want or not z.is_floating_point():
            shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
            raise ValueError(f"{op}: {name} must be a floating {want}-d tensor, got {shape}")
    b, s, h, _ = x.shape
    if s != plan.local_len:
        raise ValueError(
            f"{op}: the shard has {s} positions but {plan!r} gives each rank "
            f"local_len={plan.local_len} (pad and shard with the plan first)"
        )
    if tuple(dt.shape) != (b, s, h) or tuple(A.shape) != (h,):
        raise ValueError(
            f"{op}: dt must be [B, L, H] = {(b, s, h)} and A [H] = {(h,)}, got "
            f"{tuple(dt.shape)}, {tuple(A.shape)}"
        )
    if B.shape != C.shape or B.shape[:2] != (b, s) or h % B.shape[2]:
        raise ValueError(
            f"{op}: B {tuple(B.shape)} and C {tuple(C.shape)} must be [B, L, G, N] with the "
            f"heads ({h}) a multiple of G"
        )
