"""Rows between ranks: the routed experts' dispatch and combine, and a step's outputs to rank 0.

Data-parallel attention, expert-parallel MoE (DeepSeek's serving shape): each rank runs the
attention of its own sequences' rows, then every layer sends each row's routed-expert input to
the ranks that own at least one of its top-k experts (once per owner, with its choices), each
owner computes its experts' share of every row it received, and the shares go back to the
row's rank, where they are added. A (row, expert) pair is computed once, by the expert's
owner; a rank with no rows of its own still serves its experts to the others.

Two all-to-alls out (the counts, then the rows: input, expert ids and weights in one float
buffer, exact for ids below 2**24) and one back (whose counts are already known).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


def dispatch_order(idx: torch.Tensor, experts_per_rank: int, world: int) -> tuple[torch.Tensor, list[int]]:
    """Which rows go to which rank, rank-major: (row index of each row sent, in the order
    sent; how many go to each rank). A row goes to every rank owning one of its experts, once."""
    hit = torch.zeros(idx.shape[0], world, dtype=torch.bool, device=idx.device)
    hit.scatter_(1, idx // experts_per_rank, True)
    ranks, rows = hit.T.nonzero(as_tuple=True)  # sorted by rank, then row
    counts = torch.bincount(ranks, minlength=world).tolist()
    return rows, counts


def routed_exchange(group, routed_input: Sequence[torch.Tensor], experts_per_rank: int,
                    experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """This rank's rows' routed output [T, D], from (h [T, D], idx [T, k], weights [T, k]):
    dispatched to the experts' owners, `experts(h, idx, weights)` run here on the rows received
    (any rank's), the shares combined back. T may be 0 (this rank has no rows this step)."""
    h, idx, weights = routed_input
    rows, counts = dispatch_order(idx, experts_per_rank, group.world)
    d, k = h.shape[1], idx.shape[1]
    send = torch.cat([h[rows], idx[rows].to(h.dtype), weights[rows].to(h.dtype)], 1)
    got, got_counts = group.exchange(send, counts)
    if got.shape[0]:
        share = experts(got[:, :d].contiguous(), got[:, d:d + k].long(), got[:, d + k:].contiguous())
    else:
        share = got[:, :d]
    back, _ = group.exchange(share.to(h.dtype).contiguous(), got_counts, counts)
    # each row's shares added in rank order: the same sum on every run
    return torch.zeros_like(h).index_add_(0, rows, back)


def gather_rows(group, owners: Sequence[int], counts: Sequence[int],
                outs: Sequence[tuple[torch.Tensor | None, tuple[int, ...]]], device) -> tuple:
    """Rank 0: each output with every sequence's rows, in the step's order (sequence i has
    counts[i] rows, on rank owners[i]); each rank sends its own (None: it has none). Other
    ranks get None for each output."""
    world, rank = group.world, group.rank
    widths = [math.prod(shape) for _, shape in outs]
    mine = [t for t, _ in outs]
    if mine[0] is not None:
        send = torch.cat([t.reshape(t.shape[0], -1).float() for t in mine], 1)
    else:
        send = torch.empty(0, sum(widths), device=device)
    per_rank = [0] * world
    for owner, n in zip(owners, counts, strict=True):
        per_rank[owner] += n
    send_counts = [send.shape[0] if q == 0 else 0 for q in range(world)]
    got, _ = group.exchange(send, send_counts, per_rank if rank == 0 else [0] * world)
    if rank != 0:
        return tuple(None for _ in outs)
    starts = [sum(per_rank[:q]) for q in range(world)]  # rank-major: rank q's rows in step order
    order: list[int] = []
    for owner, n in zip(owners, counts, strict=True):
        order += range(starts[owner], starts[owner] + n)
        starts[owner] += n
    got = got[torch.tensor(order, dtype=torch.int64, device=got.device)]
    parts = torch.split(got, widths, 1)
    return tuple(p.reshape(p.shape[0], *shape) for p, (_, shape) in zip(parts, outs, strict=True))
