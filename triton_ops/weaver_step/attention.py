"""Attention of w new tree nodes over the prefix, their ancestors and themselves.

One Weaver node step per layer: node j of request r (depth d) attends to the
T prefix entries, to the cached K/V of its strict ancestors (added by earlier
steps of the round) and to itself. Rotary position embedding (rotate-half
form) of q and k and the write of the node's own K/V into the tree cache are
part of the op, so the Triton form is one launch per layer: one program per
(node, head) computes its scores over at most T + D + 1 entries in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.utils import check_same_device, use_triton


def apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``t`` [..., H, hd] with ``cos``/``sin`` [..., hd/2]
    (fp32, broadcast over heads), computed in fp32 and returned in t's dtype."""
    half = t.shape[-1] // 2
    tf = t.float()
    first, second = tf[..., :half], tf[..., half:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([first * c - second * s, second * c + first * s], -1).to(t.dtype)


def node_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    node_keys: torch.Tensor,
    node_values: torch.Tensor,
    kv_slot: torch.Tensor,
    ancestor_slots: torch.Tensor,
    positions: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """One attention step of w nodes per request; writes their K/V into the tree cache.

    Args:
        q, k, v: [R, w, H, hd] the nodes' projections, before rotary.
        prefix_keys, prefix_values: [R, T, H, hd] the prefix entries (keys rotated).
        node_keys, node_values: [R, M, H, hd] the round's tree cache; node j's
            rotated k and its v are written at slot ``kv_slot[r, j]``.
        kv_slot: [R, w] int64 in [0, M): where each node's K/V go (padding rows
            share a scratch slot that no ancestor list names).
        ancestor_slots: [R, w, S] int64 cache slots of each node's strict
            ancestors, -1 for none; all written by earlier calls.
        positions: [R, w] int64 each node's position, with ``rotary`` = (cos, sin)
            [L, hd/2] float32 tables of positions 0..L-1; both None where
            positions enter elsewhere.

    Returns:
        [R, w, H, hd] float32: softmax(q.K / sqrt(hd)) V over [prefix, ancestors,
        the node], q and k rounded to the cache dtype after rotation.
    """
    triton_path = use_triton(backend, q)
    _check_inputs(q, k, v, prefix_keys, prefix_values, node_keys, node_values, kv_slot,
                  ancestor_slots, positions, rotary)
    if not triton_path:
        if rotary is not None:
            cos, sin = (table[positions] for table in rotary)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return _torch_node_attention(q, k, v, prefix_keys, prefix_values, node_keys,
                                     node_values, kv_slot, ancestor_slots)
    return _triton_node_attention(q, k, v, prefix_keys, prefix_values, node_keys, node_values,
                                  kv_slot, ancestor_slots, positions, rotary)


def _torch_node_attention(q, k, v, prefix_keys, prefix_values, node_keys, node_values, kv_slot,
                          ancestor_slots):
    R, w, H, hd = q.shape
    batch = torch.arange(R, device=q.device)[:, None]
    node_keys[batch, kv_slot] = k
    node_values[batch, kv_slot] = v
    known = ancestor_slots >= 0
    slots = torch.where(known, ancestor_slots, 0)
    # Entries: the prefix, the ancestors, the node itself (last).
    keys = torch.cat([node_keys[batch[..., None], slots], k[:, :, None]], 2)  # [R, w, S+1, H, hd]
    values = torch.cat([node_values[batch[..., None], slots], v[:, :, None]], 2)
    mask = torch.cat([known, known.new_ones(R, w, 1)], 2)
    qf = q.float() * hd**-0.5
    prefix_scores = torch.einsum("rwhd,rthd->rwht", qf, prefix_keys.float())
    path_scores = torch.einsum("rwhd,rwshd->rwhs", qf, keys.float())
    path_scores = path_scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([prefix_scores, path_scores], -1), dim=-1)
    prefix_probs, path_probs = probs.split([prefix_keys.shape[1], keys.shape[2]], dim=-1)
    attn = torch.einsum("rwht,rthd->rwhd", prefix_probs, prefix_values.float())
    return attn + torch.einsum("rwhs,rwshd->rwhd", path_probs, values.float())


@triton.jit
def _node_attention_kernel(
    q_ptr, k_ptr, v_ptr, pk_ptr, pv_ptr, nk_ptr, nv_ptr, slot_ptr, anc_ptr, pos_ptr, cos_ptr,
    sin_ptr, out_ptr,
    WIDTH, PREFIX, ANCESTORS, HEAD_DIM, scale,
    s_qr, s_qw, s_qh, s_kr, s_kw, s_kh, s_vr, s_vw, s_vh,
    s_pr, s_pt, s_ph, s_nr, s_nm, s_nh, s_cos,
    ROTARY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    node = tl.program_id(0)
    head = tl.program_id(1)
    r = (node // WIDTH).to(tl.int64)
    j = (node % WIDTH).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_base = q_ptr + r * s_qr + j * s_qw + head * s_qh
    k_base = k_ptr + r * s_kr + j * s_kw + head * s_kh
    q = tl.load(q_base + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    k = tl.load(k_base + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + r * s_vr + j * s_vw + head * s_vh + offs_d, mask=mask_d, other=0.0)
    if ROTARY:
        half = HEAD_DIM // 2
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
        sign = tl.where(offs_d < half, -1.0, 1.0)
        freq = tl.where(offs_d < half, offs_d, offs_d - half)
        position = tl.load(pos_ptr + r * WIDTH + j)
        cos = tl.load(cos_ptr + position * s_cos + freq, mask=mask_d, other=0.0)
        sin = tl.load(sin_ptr + position * s_cos + freq, mask=mask_d, other=0.0)
        q_turn = tl.load(q_base + partner, mask=mask_d, other=0.0).to(tl.float32)
        k_turn = tl.load(k_base + partner, mask=mask_d, other=0.0).to(tl.float32)
        q = q * cos + sign * q_turn * sin
        k = k * cos + sign * k_turn * sin
    # The cache holds k in its dtype; the node reads itself back rounded, like its ancestors.
    k = k.to(nk_ptr.dtype.element_ty)
    q = q.to(nk_ptr.dtype.element_ty).to(tl.float32) * scale
    slot = tl.load(slot_ptr + r * WIDTH + j)
    cache = r * s_nr + slot * s_nm + head * s_nh
    tl.store(nk_ptr + cache + offs_d, k, mask=mask_d)
    tl.store(nv_ptr + cache + offs_d, v.to(nv_ptr.dtype.element_ty), mask=mask_d)

    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < PREFIX
    tile = (offs_t[:, None] * s_pt + offs_d[None, :]) + r * s_pr + head * s_ph
    tile_mask = mask_t[:, None] & mask_d[None, :]
    prefix_k = tl.load(pk_ptr + tile, mask=tile_mask, other=0.0).to(tl.float32)
    prefix_scores = tl.where(mask_t, tl.sum(prefix_k * q[None, :], axis=1), -float("inf"))

    offs_s = tl.arange(0, BLOCK_S)
    slots = tl.load(anc_ptr + (r * WIDTH + j) * ANCESTORS + offs_s, mask=offs_s < ANCESTORS,
                    other=-1)
    known = slots >= 0
    anc_tile = r * s_nr + tl.where(known, slots, 0)[:, None] * s_nm + head * s_nh + offs_d[None, :]
    anc_mask = known[:, None] & mask_d[None, :]
    anc_k = tl.load(nk_ptr + anc_tile, mask=anc_mask, other=0.0).to(tl.float32)
    anc_scores = tl.where(known, tl.sum(anc_k * q[None, :], axis=1), -float("inf"))
    self_score = tl.sum(k.to(tl.float32) * q, axis=0)

    top = tl.maximum(tl.maximum(tl.max(prefix_scores, axis=0), tl.max(anc_scores, axis=0)),
                     self_score)
    prefix_p = tl.exp(prefix_scores - top)
    anc_p = tl.exp(anc_scores - top)
    self_p = tl.exp(self_score - top)
    total = tl.sum(prefix_p, axis=0) + tl.sum(anc_p, axis=0) + self_p
    prefix_v = tl.load(pv_ptr + tile, mask=tile_mask, other=0.0).to(tl.float32)
    anc_v = tl.load(nv_ptr + anc_tile, mask=anc_mask, other=0.0).to(tl.float32)
    acc = tl.sum(prefix_p[:, None] * prefix_v, axis=0) + tl.sum(anc_p[:, None] * anc_v, axis=0)
    acc += self_p * v.to(tl.float32)
    out = out_ptr + ((r * WIDTH + j) * tl.num_programs(1) + head) * HEAD_DIM
    tl.store(out + offs_d, acc / total, mask=mask_d)


def _triton_node_attention(q, k, v, prefix_keys, prefix_values, node_keys, node_values, kv_slot,
                           ancestor_slots, positions, rotary):
    R, w, H, hd = q.shape
    out = torch.empty(R, w, H, hd, dtype=torch.float32, device=q.device)
    if R * w == 0:
        return out
    for name, t in (("prefix_keys", prefix_keys), ("prefix_values", prefix_values),
                    ("node_keys", node_keys), ("node_values", node_values)):
        if t.stride(-1) != 1 or t.stride(1) != H * hd or t.stride(2) != hd:
            raise ValueError(f"{name} must be contiguous in its last three dims, got strides "
                             f"{t.stride()}")
    if node_keys.stride() != node_values.stride():
        raise ValueError("node_keys and node_values must share strides")
    if rotary is not None:
        cos, sin = (table.contiguous() for table in rotary)
        positions = positions.contiguous()
    else:
        cos = sin = positions = q  # not read
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    slots, ancestors = kv_slot.contiguous(), ancestor_slots.contiguous()
    _node_attention_kernel[(R * w, H)](
        q, k, v, prefix_keys, prefix_values, node_keys, node_values, slots, ancestors, positions,
        cos, sin, out, w, prefix_keys.shape[1], ancestors.shape[2], hd, hd**-0.5,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        prefix_keys.stride(0), prefix_keys.stride(1), prefix_keys.stride(2),
        node_keys.stride(0), node_keys.stride(1), node_keys.stride(2),
        cos.stride(0) if rotary is not None else 0,
        ROTARY=rotary is not None, BLOCK_T=triton.next_power_of_2(prefix_keys.shape[1]),
        BLOCK_S=triton.next_power_of_2(max(1, ancestors.shape[2])),
        BLOCK_D=triton.next_power_of_2(hd),
    )
    return out


def _check_inputs(q, k, v, prefix_keys, prefix_values, node_keys, node_values, kv_slot,
                  ancestor_slots, positions, rotary) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [R, w, H, hd], got {list(q.shape)}")
    R, w, H, hd = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {list(q.shape)}, got {list(t.shape)}")
    for name, t in (("prefix_keys", prefix_keys), ("prefix_values", prefix_values),
                    ("node_keys", node_keys), ("node_values", node_values)):
        if t.dim() != 4 or t.shape[0] != R or t.shape[2:] != (H, hd) or t.shape[1] < 1:
            raise ValueError(f"{name} must be [R={R}, T >= 1, H={H}, hd={hd}], got "
                             f"{list(t.shape)}")
    if prefix_values.shape != prefix_keys.shape or node_values.shape != node_keys.shape:
        raise ValueError("keys and values must have the same shape")
    if node_keys.dtype != node_values.dtype:
        raise ValueError("node_keys and node_values must share a dtype")
    if kv_slot.shape != (R, w) or kv_slot.dtype != torch.int64:
        raise ValueError(f"kv_slot must be int64 [R={R}, w={w}], got {kv_slot.dtype} "
                         f"{list(kv_slot.shape)}")
    if ancestor_slots.dim() != 3 or ancestor_slots.shape[:2] != (R, w) or (
        ancestor_slots.dtype != torch.int64
    ):
        raise ValueError(f"ancestor_slots must be int64 [R={R}, w={w}, S], got "
                         f"{ancestor_slots.dtype} {list(ancestor_slots.shape)}")
    if (positions is None) != (rotary is None):
        raise ValueError("positions and rotary must be given together")
    if rotary is not None:
        if positions.shape != (R, w) or positions.dtype != torch.int64:
            raise ValueError(f"positions must be int64 [R={R}, w={w}], got {positions.dtype} "
                             f"{list(positions.shape)}")
        cos, sin = rotary
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dim() != 2 or t.shape[1] != hd // 2 or t.dtype != torch.float32 or hd % 2:
                raise ValueError(f"rotary {name} must be a float32 [L, hd/2={hd // 2}] table "
                                 f"(hd even), got {t.dtype} {list(t.shape)}")
    check_same_device("q", q, k=k, v=v, prefix_keys=prefix_keys, prefix_values=prefix_values,
                      node_keys=node_keys, node_values=node_values, kv_slot=kv_slot,
                      ancestor_slots=ancestor_slots)
