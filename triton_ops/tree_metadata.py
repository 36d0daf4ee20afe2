"""Per-step tree metadata shared by every tree kernel (GDN, conv, attention).

A draft tree is given per request as ``parents`` [B, N]: node ``i``'s parent is
``parents[b, i] < i`` (topological order) or ``-1`` when the node continues
directly from the committed state (the root; a forest has several). Requests
may hold fewer than N nodes: ``num_nodes[b]`` counts the real ones, the rest
is padding and is turned into isolated roots that no real node can see.

Everything here depends on the topology only, so it is built once per decoding
step and read by all layers. On CUDA one Triton program per request builds it
(:func:`_tree_metadata_kernel`): the vectorised torch build is ~100 small launches,
host time the engine's step waits for before its target graph can replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_ops.utils import (
    INDEX_DTYPES,
    bit_is_set,
    check_index_vector,
    dot_block,
    host_readable,
    interpreting,
    use_triton,
)

BITS_PER_WORD = 64
# Trees the one-program kernel takes: it holds the [N, N] ancestor closure as one tile;
# larger trees (129 nodes: budget 128) take the torch build.
KERNEL_MAX_NODES = 128


@dataclass(frozen=True)
class TreeMetadata:
    """Topology of a batch of draft trees.

    Attributes:
        parents: [B, N] int32, ``-1`` for roots and padding.
        num_nodes: [B] int32, real nodes per request (``1 <= num_nodes <= N``).
        valid: [B, N] bool, ``i < num_nodes[b]``.
        depths: [B, N] int32, 0 for roots; a node's position offset.
        ancestors: [B, N, N] bool, ``ancestors[b, i, j]`` iff ``j`` is ``i``
            or a proper ancestor of ``i`` (the mask ``Mbar = M + I``).
        ancestor_words: [B, N, W] int64 with W = ceil(N / 64): ``ancestors``
            as bitsets, bit ``j % 64`` of word ``j // 64``.
        conv_sources: [B, N, conv_width] int32. Tap ``t`` of node ``i`` reads
            its ``t``-th ancestor (``t = 0``: itself). A value ``>= 0`` is that
            node's index; a value ``v < 0`` means the path ran past the root
            and the tap reads column ``conv_width - 1 + v`` of the committed
            conv state (columns oldest to newest, ``-1`` = the newest input).
    """

    parents: torch.Tensor
    num_nodes: torch.Tensor
    valid: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    ancestor_words: torch.Tensor
    conv_sources: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.parents.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.parents.shape[1]

    @property
    def conv_width(self) -> int:
        return self.conv_sources.shape[2]

    def path_mask(self, accepted_leaf: torch.Tensor) -> torch.Tensor:
        """[B, N] bool: the nodes on the root-to-leaf path of each request.

        ``accepted_leaf`` [B] holds a node index, or -1 when nothing is
        accepted (the row is then all False).
        """
        check_accepted_leaf(accepted_leaf, self)
        leaf = accepted_leaf.long().clamp(min=0)
        rows = torch.gather(
            self.ancestors, 1, leaf.view(-1, 1, 1).expand(-1, 1, self.max_nodes)
        ).squeeze(1)
        return rows & (accepted_leaf >= 0).view(-1, 1)


def path_first_order(meta: TreeMetadata, accepted_leaf: torch.Tensor,
                     token_rows: torch.Tensor, total: int, backend: str = "auto") -> torch.Tensor:
    """[total] int64 row permutation that puts each request's accepted path first.

    ``token_rows`` [B, N] holds the row of each node in a batch of ``total`` rows (-1 for
    padding nodes). Request b's rows then take, in order, its accepted path from the root
    down (``accepted_leaf`` [B], -1: none) and its other real nodes by index; rows that
    hold no real node keep their place. ``order[row]`` is the row that moves there.
    ``backend`` as in :func:`build_tree_metadata`; the Triton path is one launch (and
    an arange) with no host sync, the PyTorch one a dozen.
    """
    check_accepted_leaf(accepted_leaf, meta)
    check_node_tensor(meta, "token_rows", token_rows, ())
    device = token_rows.device
    if use_triton(backend, token_rows):
        order = torch.arange(total, device=device)
        B, N = token_rows.shape
        words = meta.ancestor_words.contiguous()
        _path_first_order_kernel[(B,)](
            order, token_rows, words, meta.depths, meta.num_nodes.to(device), accepted_leaf,
            N, *token_rows.stride(), words.shape[-1], NP=dot_block(N), WORD=BITS_PER_WORD)
        return order
    # One slot past the rows: padding nodes scatter there (below), and it is dropped.
    order = torch.arange(total + 1, device=device)
    on_path = meta.path_mask(accepted_leaf)
    # Sort key per node: path nodes by depth first, then the others in order.
    N = meta.max_nodes
    node = torch.arange(N, device=device).expand_as(token_rows)
    key = torch.where(on_path, meta.depths.long(), N + node)
    key = torch.where(meta.valid, key, 3 * N + node)
    ranked = torch.argsort(key, dim=1, stable=True)
    sources = torch.gather(token_rows, 1, ranked)
    # Scattered, not mask-indexed (a mask index reads its count on the host).
    targets = torch.where(meta.valid, token_rows.long(), total)
    order.scatter_(0, targets.flatten(), sources.long().flatten())
    return order[:total]


@triton.jit
def _path_first_order_kernel(order_ptr, token_rows_ptr, words_ptr, depths_ptr, num_nodes_ptr,
                             leaf_ptr, N, stride_tb, stride_tn, W,
                             NP: tl.constexpr, WORD: tl.constexpr):
    """One request: node j's rank is its depth on the path, else the path's length plus
    the real nodes off the path before it; the row of the node at that rank gets j's."""
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, NP)
    valid = node < tl.load(num_nodes_ptr + b)
    leaf = tl.load(leaf_ptr + b).to(tl.int64)
    leaf_words = words_ptr + (b * N + tl.maximum(leaf, 0)) * W
    on_path = valid & (leaf >= 0) & bit_is_set(
        tl.load(leaf_words + node // WORD, mask=valid, other=0), node)
    off_path = (valid & ~on_path).to(tl.int32)
    depth = tl.load(depths_ptr + b * N + node, mask=valid, other=0)
    rank = tl.where(on_path, depth,
                    tl.sum(on_path.to(tl.int32), axis=0) + tl.cumsum(off_path, axis=0) - 1)
    rows = token_rows_ptr + b * stride_tb
    source = tl.load(rows + node * stride_tn, mask=valid, other=0)
    target = tl.load(rows + rank * stride_tn, mask=valid, other=0)
    tl.store(order_ptr + target, source.to(tl.int64), mask=valid)


def check_accepted_leaf(accepted_leaf: torch.Tensor, meta: TreeMetadata) -> None:
    """[B] int32/int64, each -1 (nothing accepted) or a real node; the values are
    checked where that costs no host sync (:func:`~triton_ops.utils.host_readable`)."""
    check_index_vector("accepted_leaf", accepted_leaf, meta.batch_size)
    if not host_readable(accepted_leaf):
        return
    bad = (accepted_leaf < -1) | (accepted_leaf >= meta.num_nodes.to(accepted_leaf.device))
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"accepted_leaf[{b}] = {int(accepted_leaf[b])} is outside "
            f"[-1, num_nodes[{b}] = {int(meta.num_nodes[b])})"
        )


def check_node_tensor(
    meta: TreeMetadata, name: str, t: torch.Tensor, dims: tuple[str, ...]
) -> None:
    """``t`` must be [B, N, *dims] for the B requests of N nodes that ``meta``
    describes; ``dims`` names the trailing dimensions for the error."""
    if not isinstance(meta, TreeMetadata):
        raise ValueError(f"meta must be a TreeMetadata, got {type(meta).__name__}")
    if t.dim() != 2 + len(dims) or t.shape[:2] != (meta.batch_size, meta.max_nodes):
        shape = ", ".join([f"B={meta.batch_size}", f"N={meta.max_nodes}", *dims])
        raise ValueError(f"{name} must be [{shape}] as meta describes, got {list(t.shape)}")


def root_to_node_path(parents: list[int], node: int) -> list[int]:
    """Node indices from the root down to ``node``, following ``parents`` (-1 ends).

    The per-node walk that defines the topology; the naive references use it
    instead of the vectorised fields built here, so they check those too.
    """
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _validate_parents(parents: torch.Tensor, num_nodes: torch.Tensor) -> None:
    if parents.dim() != 2:
        raise ValueError(f"parents must be [B, N], got shape {list(parents.shape)}")
    if parents.dtype not in INDEX_DTYPES:
        raise ValueError(f"parents must be int32 or int64, got {parents.dtype}")
    B, N = parents.shape
    if B == 0 or N == 0:
        raise ValueError(f"parents must have B >= 1 and N >= 1, got shape {[B, N]}")
    if num_nodes.shape != (B,):
        raise ValueError(f"num_nodes must have shape [{B}], got {list(num_nodes.shape)}")
    if bool(((num_nodes < 1) | (num_nodes > N)).any()):
        raise ValueError(f"num_nodes must lie in [1, {N}], got {num_nodes.tolist()}")
    node = torch.arange(N, device=parents.device)
    valid = node < num_nodes.view(-1, 1).to(parents.device)
    out_of_range = valid & (parents < -1)
    if bool(out_of_range.any()):
        b, i = out_of_range.nonzero()[0].tolist()
        raise ValueError(f"parents[{b}, {i}] = {int(parents[b, i])} is out of range (< -1)")
    not_topological = valid & (parents >= node)
    if bool(not_topological.any()):
        b, i = not_topological.nonzero()[0].tolist()
        raise ValueError(
            "parents must be topologically ordered (parent < node): "
            f"parents[{b}, {i}] = {int(parents[b, i])} >= {i}"
        )


def build_tree_metadata(
    parents: torch.Tensor,
    num_nodes: torch.Tensor | None = None,
    conv_width: int = 4,
    validate: bool = True,
    backend: str = "auto",
) -> TreeMetadata:
    """Build the layer-invariant tree metadata for one decoding step.

    Args:
        parents: [B, N] int32/int64, topological (``parents[b, i] < i``),
            ``-1`` for nodes that continue from the committed state.
        num_nodes: [B] int, real nodes per request; defaults to N for all.
        conv_width: width of the causal conv that precedes GDN (taps incl.
            the node itself).
        validate: check the topology (one host sync); the engine skips it for
            trees it built itself.
        backend: "auto" (the Triton kernel for CUDA tensors of at most
            ``KERNEL_MAX_NODES`` nodes, torch otherwise), "torch" or "triton" (see
            :func:`triton_ops.utils.use_triton`; up to ``KERNEL_MAX_NODES`` nodes).

    Both paths run in O(log N) steps (pointer jumping, or the closure squared), no
    per-node loop.
    """
    B, N = parents.shape if parents.dim() == 2 else (0, 0)
    device = parents.device
    if num_nodes is None:
        num_nodes = torch.full((max(B, 0),), N, dtype=torch.int32, device=device)
    if validate:
        _validate_parents(parents, num_nodes)
    if conv_width < 1:
        raise ValueError(f"conv_width must be >= 1, got {conv_width}")
    triton_path = use_triton(backend, parents)
    if backend == "triton" and N > KERNEL_MAX_NODES:
        raise ValueError(f"the Triton tree metadata kernel takes at most {KERNEL_MAX_NODES} "
                         f"nodes, got {N}: use backend='torch' or 'auto'")
    if triton_path and N <= KERNEL_MAX_NODES:
        return _build_triton(parents, num_nodes.to(device), conv_width)

    node = torch.arange(N, device=device)
    valid = node < num_nodes.view(-1, 1).to(device)
    par = torch.where(valid, parents.long(), torch.full_like(parents, -1, dtype=torch.long))

    # Pointer jumping: after step k, ``ancestors`` holds every ancestor within
    # distance < 2^k and ``jump`` the 2^k-th ancestor (-1 past the root).
    ancestors = torch.eye(N, dtype=torch.bool, device=device).expand(B, N, N).clone()
    jump = par
    batch_index = torch.arange(B, device=device).view(-1, 1)
    for _ in range(max(1, (N - 1).bit_length())):
        has_jump = jump >= 0
        reached = ancestors[batch_index, jump.clamp(min=0)] & has_jump.unsqueeze(-1)
        ancestors = ancestors | reached
        jump = torch.where(has_jump, torch.gather(jump, 1, jump.clamp(min=0)), jump)
    depths = ancestors.sum(-1, dtype=torch.int32) - 1

    conv_sources = _conv_sources(parents, valid, depths, conv_width)
    return TreeMetadata(
        parents=torch.where(valid, parents, -1).to(torch.int32),
        num_nodes=num_nodes.to(device=device, dtype=torch.int32),
        valid=valid,
        depths=depths,
        ancestors=ancestors,
        ancestor_words=pack_bitsets(ancestors),
        conv_sources=conv_sources,
    )


@triton.jit
def _tree_metadata_kernel(
    parents_ptr, num_nodes_ptr,
    parents_out_ptr, valid_ptr, depths_ptr, ancestors_ptr, words_ptr, conv_ptr,
    N, stride_pb, stride_pn,
    W: tl.constexpr, CONV: tl.constexpr, NP: tl.constexpr, SQUARINGS: tl.constexpr,
    CLOSURE_DTYPE: tl.constexpr, WORD: tl.constexpr,
):
    """One request's metadata (outputs contiguous, node-major). ``reach[i, j]``: j is i or
    an ancestor of i within distance d; it starts at d = 1 (self and parent) and each
    boolean square doubles d, so SQUARINGS = ceil(log2(N - 1)) squares reach the root.
    0/1 products summed over at most NP terms are exact in every dot precision."""
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, NP)
    in_range = node < N
    valid = node < tl.load(num_nodes_ptr + b)
    parent = tl.load(parents_ptr + b * stride_pb + node * stride_pn, mask=valid, other=-1)
    parent = parent.to(tl.int32)
    reach = (node[:, None] == node[None, :]) | (parent[:, None] == node[None, :])
    for _ in tl.static_range(SQUARINGS):
        closure = reach.to(CLOSURE_DTYPE)
        reach = tl.dot(closure, closure) > 0
    depth = tl.sum(reach.to(tl.int32), axis=1) - 1

    rows = b * N + node
    pair = in_range[:, None] & in_range[None, :]
    tl.store(parents_out_ptr + rows, parent, mask=in_range)
    tl.store(valid_ptr + rows, valid.to(tl.uint8), mask=in_range)
    tl.store(depths_ptr + rows, depth, mask=in_range)
    tl.store(ancestors_ptr + rows[:, None] * N + node[None, :], reach.to(tl.uint8), mask=pair)
    # Disjoint bits: the wrapping int64 sum is the bitwise OR (bit 63 included).
    bit = tl.full((NP,), 1, tl.int64) << (node % WORD).to(tl.int64)
    for w in tl.static_range(W):
        in_word = (node >= w * WORD) & (node < (w + 1) * WORD)
        word = tl.sum(tl.where(reach & in_word[None, :], bit[None, :], 0), axis=1)
        tl.store(words_ptr + rows * W + w, word, mask=in_range)
    # Tap t reads the ancestor t levels up; past the root, committed column depth - t.
    for t in tl.static_range(CONV):
        level = reach & (depth[None, :] == (depth - t)[:, None])
        source = tl.sum(tl.where(level, node[None, :], 0), axis=1)
        tl.store(conv_ptr + rows * CONV + t, tl.where(depth >= t, source, depth - t),
                 mask=in_range)


def _build_triton(parents: torch.Tensor, num_nodes: torch.Tensor,
                  conv_width: int) -> TreeMetadata:
    B, N = parents.shape
    NP = dot_block(N)
    words = -(-N // BITS_PER_WORD)
    device = parents.device

    def empty(dtype, *shape):
        return torch.empty(B, N, *shape, dtype=dtype, device=device)

    meta = TreeMetadata(
        parents=empty(torch.int32), num_nodes=num_nodes.to(torch.int32),
        valid=empty(torch.bool), depths=empty(torch.int32), ancestors=empty(torch.bool, N),
        ancestor_words=empty(torch.int64, words), conv_sources=empty(torch.int32, conv_width),
    )
    # The interpreter's 16-bit dot is unreliable (triton#11584); fp32 0/1 is as exact.
    closure_dtype = tl.float32 if interpreting() else tl.float16
    _tree_metadata_kernel[(B,)](
        parents, meta.num_nodes,
        meta.parents, meta.valid.view(torch.uint8), meta.depths,
        meta.ancestors.view(torch.uint8), meta.ancestor_words, meta.conv_sources,
        N, *parents.stride(),
        W=words, CONV=conv_width, NP=NP, SQUARINGS=max(1, (N - 2).bit_length()),
        CLOSURE_DTYPE=closure_dtype, WORD=BITS_PER_WORD, num_warps=8 if NP >= 128 else 4,
    )
    return meta


def _conv_sources(
    parents: torch.Tensor, valid: torch.Tensor, depths: torch.Tensor, conv_width: int
) -> torch.Tensor:
    B, N = parents.shape
    par = torch.where(valid, parents.long(), -1)
    current = torch.arange(N, device=parents.device).expand(B, N)
    taps = [current]
    for t in range(1, conv_width):
        current = torch.where(current >= 0, torch.gather(par, 1, current.clamp(min=0)), current)
        # Past the root, tap t reads the (t - depth)-th newest committed input.
        taps.append(torch.where(current >= 0, current, depths.long() - t))
        current = torch.where(current >= 0, current, torch.full_like(current, -1))
    return torch.stack(taps, dim=-1).to(torch.int32)


def pack_bitsets(mask: torch.Tensor) -> torch.Tensor:
    """[..., N] bool -> [..., ceil(N / 64)] int64, bit ``j % 64`` of word ``j // 64``."""
    N = mask.shape[-1]
    words = -(-N // BITS_PER_WORD)
    padded = torch.nn.functional.pad(mask, (0, words * BITS_PER_WORD - N))
    bits = padded.view(*mask.shape[:-1], words, BITS_PER_WORD).long()
    shifts = torch.arange(BITS_PER_WORD, device=mask.device)
    # Disjoint bits: the wrapping int64 sum equals the bitwise OR.
    return (bits << shifts).sum(-1)


def unpack_bitsets(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitsets`."""
    shifts = torch.arange(BITS_PER_WORD, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :num_bits].bool()
