"""The best-first frontier of a Weaver round: pop the best entries, push a node's children.

Per request the frontier is a fixed set of C columns filled in insertion order
(score -inf = empty or spent), so ranking by (score descending, column
ascending) is the reference builder's (score descending, insertion order
ascending). Children rank by (log q descending, pool index ascending). Both
orders are those of a stable descending sort (a sampled push scores by the ranks' log
q, the first one scaled, but takes its tokens in the order it is given); the torch
path IS that sort, the Triton path takes one winner per iteration (at most 32 pops or
a fan-out of a few children), one program per request or per expanded node, and also does
the bookkeeping around it, so a pop or a push is one launch. A NaN score ranks
first in the sort and as -inf in the kernels (a NaN log q is a broken Weaver).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton_ops.utils import use_triton


class Frontier(NamedTuple):
    """Candidates not yet in the tree, [R, C] each: score (float32, -inf = none),
    token, parent node, depth (int64) and log q of the token (float32)."""

    score: torch.Tensor
    token: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    logq: torch.Tensor


class GrowingTree(NamedTuple):
    """Nodes added so far, [R, N + 1] each (column N is scratch): token, parent,
    depth (int64), log q (float32); num [R] int64 nodes per request."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    logq: torch.Tensor
    num: torch.Tensor


class ExpandBatch(NamedTuple):
    """The w nodes of one Weaver call, [R, w] each: node index (-1 = not expanded:
    padding, or a node at the depth limit), token, parent (-1 where node is -1),
    depth, and the node's path score (float32)."""

    node: torch.Tensor
    token: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor


def pop_frontier(frontier: Frontier, tree: GrowingTree, count: int, max_depth: int, *,
                 backend: str = "auto") -> ExpandBatch:
    """Move the best ``count`` entries of each request into the tree.

    The popped entries become nodes ``num[r], num[r] + 1, ...`` (a request whose
    frontier runs dry pops fewer; ``num`` advances by what it popped) and spend
    their frontier columns. Returns them as the next Weaver call's batch: nodes
    at ``max_depth`` and dry rows get node -1.
    """
    R, C = frontier.score.shape
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= C:
        raise ValueError(f"count must be an int in [1, C={C}], got {count!r}")
    if not use_triton(backend, frontier.score):
        return _torch_pop(frontier, tree, count, max_depth)
    if not all(t.is_contiguous() for t in (*frontier, *tree)):
        raise ValueError("the frontier and tree tensors must be contiguous (written in place)")
    out = _empty_batch(R, count, frontier.score.device)
    _pop_kernel[(R,)](
        *frontier, *tree, *out, C, tree.tokens.shape[1], max_depth,
        COUNT=count, BLOCK=triton.next_power_of_2(C), PICKS=triton.next_power_of_2(count),
    )
    return out


def push_children(frontier: Frontier, start: int, rows: torch.Tensor, batch: ExpandBatch,
                  pool_ids: torch.Tensor, children: int, *, drawn: torch.Tensor | None = None,
                  first_exponent: float = 1.0, backend: str = "auto") -> None:
    """Write the top ``children`` of each node of ``batch`` into frontier columns
    ``start + j * children + i`` with score = the node's score + log q.

    ``rows``: [R, w, P] float32 log q over each node's pool row (row
    min(depth, D - 1) of ``pool_ids`` [R, D, P]); nodes -1 push -inf entries.

    ``drawn``: [R, w, children] int64 pool positions in the order they were drawn (a
    sample without replacement from each row). Entry i then scores the node's score + the
    i-th largest log q, a value that does not depend on the token drawn there, and holds
    the i-th drawn token with its own log q: the slot of a sampled tree. Entry 0 scores
    ``first_exponent`` times the largest log q (in probabilities, ``max q ** first_exponent``;
    without ``drawn`` it must be 1). At most 1, so that no entry outranks an earlier one:
    a node's children are then always the first of its draws, which traversal
    verification's proof needs.
    """
    R, w, P = rows.shape
    if not 1 <= children <= P:
        raise ValueError(f"children must be in [1, P={P}], got {children!r}")
    if drawn is not None and (tuple(drawn.shape) != (R, w, children)
                              or drawn.dtype != torch.int64):
        raise ValueError(f"drawn must be int64 [{R}, {w}, {children}], got "
                         f"{drawn.dtype} {list(drawn.shape)}")
    if not 0 < first_exponent <= 1 or (drawn is None and first_exponent != 1):
        raise ValueError("first_exponent must be in (0, 1], and 1 without drawn; got "
                         f"{first_exponent!r}")
    if start + w * children > frontier.score.shape[1]:
        raise ValueError(f"frontier of {frontier.score.shape[1]} columns has no room for "
                         f"{w * children} entries at {start}")
    if not use_triton(backend, rows):
        return _torch_push(frontier, start, rows, batch, pool_ids, children, drawn,
                           first_exponent)
    if not all(t.is_contiguous() for t in frontier):
        raise ValueError("the frontier tensors must be contiguous (written in place)")
    _push_kernel[(R * w,)](
        *frontier, rows.contiguous(), *(t.contiguous() for t in batch), pool_ids.contiguous(),
        rows if drawn is None else drawn.contiguous(), first_exponent, start, w, P,
        pool_ids.shape[1], frontier.score.shape[1], CHILDREN=children,
        BLOCK=triton.next_power_of_2(P), PICKS=triton.next_power_of_2(children),
        DRAWN=drawn is not None,
    )


def _empty_batch(R: int, count: int, device) -> ExpandBatch:
    index = [torch.empty(R, count, dtype=torch.int64, device=device) for _ in range(4)]
    return ExpandBatch(*index, torch.empty(R, count, dtype=torch.float32, device=device))


def _torch_pop(frontier: Frontier, tree: GrowingTree, count: int, max_depth: int) -> ExpandBatch:
    R = frontier.score.shape[0]
    N = tree.tokens.shape[1] - 1
    device = frontier.score.device
    batch = torch.arange(R, device=device)[:, None]
    score, pick = torch.sort(frontier.score, dim=-1, descending=True, stable=True)
    score, pick = score[:, :count], pick[:, :count]
    frontier.score.scatter_(1, pick, float("-inf"))
    popped = score > float("-inf")  # a prefix of each row: the sort put -inf last
    node = torch.where(popped, tree.num[:, None] + torch.arange(count, device=device), -1)
    slot = torch.where(popped, node, N)
    token, parent = frontier.token.gather(1, pick), frontier.parent.gather(1, pick)
    depth = frontier.depth.gather(1, pick)
    tree.tokens[batch, slot] = token
    tree.parents[batch, slot] = parent
    tree.depths[batch, slot] = depth
    tree.logq[batch, slot] = frontier.logq.gather(1, pick)
    tree.num.add_(popped.sum(1))
    expandable = popped & (depth < max_depth)
    return ExpandBatch(torch.where(expandable, node, -1), token,
                       torch.where(expandable, parent, -1), depth, score)


def _torch_push(frontier: Frontier, start: int, rows: torch.Tensor, batch: ExpandBatch,
                pool_ids: torch.Tensor, children: int, drawn: torch.Tensor | None,
                first_exponent: float) -> None:
    R, w, _ = rows.shape
    top, pos = torch.sort(rows, dim=-1, descending=True, stable=True)
    top, pos = top[..., :children], pos[..., :children]
    logq = top
    if drawn is not None:
        pos, logq = drawn, rows.gather(-1, drawn)
        top = torch.cat([top[..., :1] * first_exponent, top[..., 1:]], -1)
    requests = torch.arange(R, device=rows.device)[:, None]
    candidates = pool_ids[requests, batch.depth.clamp(max=pool_ids.shape[1] - 1)].gather(-1, pos)
    expandable = (batch.node >= 0)[..., None]
    span = slice(start, start + w * children)

    def per_child(t: torch.Tensor) -> torch.Tensor:
        return t[..., None].expand(-1, -1, children).reshape(R, -1)

    frontier.score[:, span] = torch.where(expandable, batch.score[..., None] + top,
                                          float("-inf")).reshape(R, -1)
    frontier.parent[:, span] = per_child(batch.node)
    frontier.token[:, span] = candidates.reshape(R, -1)
    frontier.depth[:, span] = per_child(batch.depth + 1)
    frontier.logq[:, span] = logq.reshape(R, -1)


@triton.jit
def _next_best(values, free, offs, BLOCK: tl.constexpr):
    """The largest free value and its lowest column (-inf is a value like any other)."""
    best = tl.max(tl.where(free, values, -float("inf")), axis=0)
    column = tl.min(tl.where(free & (values == best), offs, BLOCK), axis=0)
    return best, column


@triton.jit
def _top_columns(values, valid, COUNT: tl.constexpr, BLOCK: tl.constexpr, PICKS: tl.constexpr):
    """The COUNT best of ``values`` (where ``valid``; NaN never wins a place), best first,
    ties to the lowest column: (scores, columns) as [PICKS] vectors, PICKS >= COUNT, and
    the mask of the columns taken. Registers only: the caller then gathers and stores every
    pick at once, not one dependent load and store after another."""
    offs = tl.arange(0, BLOCK)
    picks = tl.arange(0, PICKS)
    values = tl.where(values == values, values, -float("inf"))
    free = valid
    bests = tl.full((PICKS,), -float("inf"), tl.float32)
    columns = tl.zeros((PICKS,), dtype=tl.int64)
    for i in tl.static_range(COUNT):
        best, column = _next_best(values, free, offs, BLOCK)
        free = free & (offs != column)
        bests = tl.where(picks == i, best, bests)
        columns = tl.where(picks == i, column, columns)
    return bests, columns, valid & ~free


@triton.jit
def _pop_kernel(
    f_score, f_token, f_parent, f_depth, f_logq,
    t_tokens, t_parents, t_depths, t_logq, t_num,
    o_node, o_token, o_parent, o_depth, o_score,
    C, WIDTH, MAX_DEPTH,
    COUNT: tl.constexpr, BLOCK: tl.constexpr, PICKS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < C
    values = tl.load(f_score + r * C + offs, mask=inside, other=-float("inf"))
    first = tl.load(t_num + r)
    best, column, taken = _top_columns(values, inside, COUNT, BLOCK, PICKS)
    picks = tl.arange(0, PICKS)
    real = picks < COUNT
    at = r * C + column
    token = tl.load(f_token + at, mask=real, other=0)
    parent = tl.load(f_parent + at, mask=real, other=0)
    depth = tl.load(f_depth + at, mask=real, other=0)
    logq = tl.load(f_logq + at, mask=real, other=0.0)
    popped = real & (best > -float("inf"))
    node = first + picks
    slot = r * WIDTH + node
    tl.store(t_tokens + slot, token, mask=popped)
    tl.store(t_parents + slot, parent, mask=popped)
    tl.store(t_depths + slot, depth, mask=popped)
    tl.store(t_logq + slot, logq, mask=popped)
    expandable = popped & (depth < MAX_DEPTH)
    out = r * COUNT + picks
    tl.store(o_node + out, tl.where(expandable, node, -1), mask=real)
    tl.store(o_token + out, token, mask=real)
    tl.store(o_parent + out, tl.where(expandable, parent, -1), mask=real)
    tl.store(o_depth + out, depth, mask=real)
    tl.store(o_score + out, best, mask=real)
    tl.store(f_score + r * C + offs, tl.full((BLOCK,), -float("inf"), tl.float32), mask=taken)
    tl.store(t_num + r, first + tl.sum(popped.to(tl.int64), axis=0))


@triton.jit
def _push_kernel(
    f_score, f_token, f_parent, f_depth, f_logq,
    rows_ptr, b_node, b_token, b_parent, b_depth, b_score, pool_ids, drawn_ptr, FIRST_EXPONENT,
    START, W, P, D, C,
    CHILDREN: tl.constexpr, BLOCK: tl.constexpr, PICKS: tl.constexpr, DRAWN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    r = row // W
    j = row % W
    offs = tl.arange(0, BLOCK)
    inside = offs < P
    values = tl.load(rows_ptr + row * P + offs, mask=inside, other=-float("inf"))
    node = tl.load(b_node + row)
    depth = tl.load(b_depth + row)
    score = tl.load(b_score + row)
    pool = pool_ids + (r * D + tl.minimum(depth, D - 1)) * P
    best, column, _ = _top_columns(values, inside, CHILDREN, BLOCK, PICKS)
    picks = tl.arange(0, PICKS)
    real = picks < CHILDREN
    logq = best
    if DRAWN:  # ranks keep their scores; tokens and their log q come in drawn order
        column = tl.load(drawn_ptr + row * CHILDREN + picks, mask=real, other=0)
        logq = tl.load(rows_ptr + row * P + column, mask=real, other=-float("inf"))
        best = tl.where(picks == 0, best * FIRST_EXPONENT, best)
    at = r * C + START + j * CHILDREN + picks
    tl.store(f_score + at, tl.where(node >= 0, score + best, -float("inf")), mask=real)
    tl.store(f_token + at, tl.load(pool + column, mask=real, other=0), mask=real)
    tl.store(f_parent + at, tl.zeros((PICKS,), dtype=tl.int64) + node, mask=real)
    tl.store(f_depth + at, tl.zeros((PICKS,), dtype=tl.int64) + depth + 1, mask=real)
    tl.store(f_logq + at, logq, mask=real)
