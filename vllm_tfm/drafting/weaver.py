"""Weaver: the one-layer residual transformer that grows a proposal tree over DFlash marginals.

Per draft round and request (D = number of DFlash draft positions, at most K):

- Prefix pass. x = proposal_in(output_norm([h_v; H_1..H_D])), [D+1, d_rank], runs
  causally through the blocks at positions 0..D; its per-layer K/V are cached.
- Node step. A tree node at depth d (the root, depth 0, holds the bonus token) enters
  as x = E'[token] at position d+1, attends to all D+1 prefix entries, to its
  ancestors and to itself, and leaves as y = out_norm(x). Its children are drawn
  from the pool of depth d+1 (pool row d): with s the raw target logits of the pool
  ids c_k, l_k = s_k + <W_q[c_k], y> and log q(c_k | path) = l_k - logsumexp(l).

Positions enter through the block layout, chosen by the checkpoint's keys:

- "learned_pos" (layout a): ``blocks.{i}.{norm_attn, q_proj, k_proj, v_proj, o_proj,
  norm_mlp, fc1, fc2}`` and a learned table ``pos_emb`` [K, d_rank]. Row p-1 is added
  to the input at position p in 1..K; position 0 (h_v) gets none. So DFlash state
  H_k and a node at depth k-1 share row k-1, and the deepest node ever expanded
  (depth K-1) uses the last row. The MLP is fc2(GELU(fc1(.))) with the exact (erf)
  GELU, as the public PyTorch loader of this layout computes it (its JAX port uses
  the tanh approximation; the two differ by < 1e-3 per activation).
- "rope_swiglu" (layout b): ``blocks.{i}.{norm_attn, qkv_proj, o_proj, norm_mlp,
  gate_up_proj, down_proj}``, rotary embedding (rotate-half form, base rope_theta)
  on q and k, MLP down_proj(silu(gate) * up) with gate the first half of gate_up_proj.

All norms are RMSNorm with weight and bias, evaluated in fp32. Attention has no
biases; softmax runs in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from triton_ops.pool_logits import pool_logits_log_softmax
from triton_ops.weaver_step import (
    add_rms_norm,
    apply_rotary,
    extend_paths,
    node_attention,
    rms_norm,
    silu_mul,
)
from triton_ops.utils import capturing_graph

LAYOUTS = ("learned_pos", "rope_swiglu")
# Sanity bounds: DFlash blocks are 16 wide and pools 512 deep; values far past
# these come from a corrupt or mislabelled config.
MAX_DEPTH = 64
MAX_POOL_SIZE = 1 << 16
# Public configs carry these mode keys; other values mean a different model.
_MODE_VALUES = {"encoder_mode": (3, "global_prompt"), "score_head": (4, "simple_score")}
_ACTIVATION = {"learned_pos": "gelu", "rope_swiglu": "swiglu"}
_REQUIRED_KEYS = ("d_model", "d_embed", "d_rank", "num_layers", "num_heads", "mlp_dim")
# Rows of a vocabulary-sized table built per chunk in prepare_tables.
_TABLE_CHUNK_ROWS = 8192


@dataclass(frozen=True)
class WeaverConfig:
    """Weaver hyper-parameters.

    Attributes:
        d_model: target hidden size (h_v, DFlash hidden states, LM-head width).
        d_embed: target embedding width.
        d_rank: Weaver residual width.
        num_layers, num_heads, mlp_dim: block stack shape; head_dim = d_rank / num_heads.
        K: maximum tree depth (15), NOT the pool size.
        candidate_pool_size: pool entries per depth the model was trained with (512).
        layout: "learned_pos" (layout a) or "rope_swiglu" (layout b).
        rope_theta: rotary base of "rope_swiglu" (public key ``rope_base``).
        rms_eps: RMSNorm epsilon.
        extra: config keys this code does not use, kept for round trips.
    """

    d_model: int
    d_embed: int
    d_rank: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    K: int = 15
    candidate_pool_size: int = 512
    layout: str = "rope_swiglu"
    rope_theta: float = 1e4
    rms_eps: float = 1e-6
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (*_REQUIRED_KEYS, "K", "candidate_pool_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.{name} must be a positive integer, got {value!r}")
        if self.K > MAX_DEPTH:
            raise ValueError(f"config.K (max tree depth) must be in [1, {MAX_DEPTH}], got {self.K}")
        if self.candidate_pool_size > MAX_POOL_SIZE:
            raise ValueError(
                f"config.candidate_pool_size must be in [1, {MAX_POOL_SIZE}], "
                f"got {self.candidate_pool_size}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"config.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.d_rank % self.num_heads:
            raise ValueError(
                f"config.d_rank ({self.d_rank}) must be divisible by "
                f"config.num_heads ({self.num_heads})"
            )
        if self.layout == "rope_swiglu" and self.head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"config.rope_theta must be positive, got {self.rope_theta!r}")
        if not self.rms_eps > 0:
            raise ValueError(f"config.rms_eps must be positive, got {self.rms_eps!r}")
        for key, allowed in _MODE_VALUES.items():
            if key in self.extra and self.extra[key] not in allowed:
                raise ValueError(f"config.{key} must be one of {allowed}, got {self.extra[key]!r}")

    @property
    def head_dim(self) -> int:
        return self.d_rank // self.num_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], layout: str | None = None) -> WeaverConfig:
        """Build from a checkpoint config; unknown keys go to ``extra``.

        ``layout`` is the layout found in the state dict; a config that names a
        different one is rejected. ``rope_base`` (public name) and ``rope_theta``
        are accepted as the same value; ``activation`` is checked against the layout
        (learned_pos: "gelu", rope_swiglu: "swiglu") and not stored.
        """
        if not isinstance(raw, dict):
            raise ValueError(f"config must be a dict, got {type(raw).__name__}")
        missing = [key for key in _REQUIRED_KEYS if key not in raw]
        if missing:
            raise ValueError(f"config is missing required keys {missing}")
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {key: value for key, value in raw.items() if key in known}
        extra = {key: value for key, value in raw.items() if key not in known}
        if "rope_base" in extra:
            base = extra.pop("rope_base")
            if "rope_theta" in kwargs and kwargs["rope_theta"] != base:
                raise ValueError(
                    f"config.rope_base ({base}) and config.rope_theta "
                    f"({kwargs['rope_theta']}) disagree"
                )
            kwargs["rope_theta"] = base
        if layout is not None:
            if kwargs.setdefault("layout", layout) != layout:
                raise ValueError(
                    f"config.layout is {kwargs['layout']!r} but the state dict holds "
                    f"layout {layout!r}"
                )
        layout = kwargs.get("layout", cls.layout)
        activation = extra.pop("activation", _ACTIVATION.get(layout))
        if layout in _ACTIVATION and activation != _ACTIVATION[layout]:
            raise ValueError(
                f"config.activation must be {_ACTIVATION[layout]!r} for layout {layout!r}, "
                f"got {activation!r}"
            )
        for key in ("rope_theta", "rms_eps"):
            if key in kwargs and not isinstance(kwargs[key], (int, float)):
                raise ValueError(f"config.{key} must be a number, got {kwargs[key]!r}")
            if key in kwargs:
                kwargs[key] = float(kwargs[key])
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """Every field under its own name, ``extra`` keys merged in (our JSON format)."""
        out = dict(self.extra)
        out.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"})
        return out

    def to_public_dict(self) -> dict[str, Any]:
        """The config as public loaders expect it: their key names, no layout key."""
        out = dict(self.extra)
        for key in (*_REQUIRED_KEYS, "K", "candidate_pool_size"):
            out[key] = getattr(self, key)
        if self.layout == "rope_swiglu":
            out.update(rope_base=self.rope_theta, activation="swiglu")
        if self.rms_eps != 1e-6:
            out["rms_eps"] = self.rms_eps
        return out


class WeaverRMSNorm(nn.Module):
    """RMSNorm with weight and bias, computed in fp32: x / rms(x) * weight + bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.bias, self.eps, backend=_kernel_backend())

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm): one kernel on CUDA."""
        return add_rms_norm(x, residual, self.weight, self.bias, self.eps, backend=_kernel_backend())


def _kernel_backend() -> str:
    """The fused kernels have no backward: training keeps the PyTorch forms."""
    return "torch" if torch.is_grad_enabled() else "auto"


class _WeaverBlock(nn.Module):
    """Residual attention + residual MLP; subclasses fix the projections and positions."""

    def __init__(self, config: WeaverConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.norm_attn = WeaverRMSNorm(config.d_rank, config.rms_eps)
        self.norm_mlp = WeaverRMSNorm(config.d_rank, config.rms_eps)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.num_heads, self.head_dim))

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [..., d_rank], positions [...] int64 -> q, k (rotated where the layout
        rotates), v [..., H, hd]."""
        q, k, v = self.project(self.norm_attn(x))
        tables = self.rotary_tables(positions)
        if tables is None:
            return q, k, v
        return apply_rotary(q, *tables), apply_rotary(k, *tables), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [..., d_rank] plus o_proj of attn [..., H, hd], then plus the MLP."""
        x, mlp_out = self.finish_parts(x, attn)
        return x + mlp_out

    def finish_parts(self, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`finish` before its last sum: (x plus o_proj of attn, the MLP's output), for
        a caller that adds them inside the next norm (``add_and_norm``, one launch)."""
        x, normed = self.norm_mlp.add_and_norm(x, self.o_proj(attn.flatten(-2).to(x.dtype)))
        return x, self.mlp(normed)


class LearnedPosBlock(_WeaverBlock):
    """Layout (a): separate q/k/v projections, GELU MLP; positions enter through pos_emb."""

    def __init__(self, config: WeaverConfig):
        super().__init__(config)
        d = config.d_rank
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.fc1 = nn.Linear(d, config.mlp_dim)
        self.fc2 = nn.Linear(config.mlp_dim, d)

    def project(self, h: torch.Tensor):
        """Normed input h [..., d_rank] -> q, k, v [..., H, hd]."""
        return self._heads(self.q_proj(h)), self._heads(self.k_proj(h)), self._heads(self.v_proj(h))

    def rotary_tables(self, positions: torch.Tensor) -> None:
        """No rotary: positions enter through ``pos_emb``."""
        return None

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h)))


class RopeSwigluBlock(_WeaverBlock):
    """Layout (b): fused qkv projection with rotary q/k, SwiGLU MLP."""

    def __init__(self, config: WeaverConfig):
        super().__init__(config)
        d = config.d_rank
        self.rope_theta = config.rope_theta
        self.qkv_proj = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate_up_proj = nn.Linear(d, 2 * config.mlp_dim)
        self.down_proj = nn.Linear(config.mlp_dim, d)

    def project(self, h: torch.Tensor):
        """Normed input h [..., d_rank] -> q, k, v [..., H, hd], before rotary."""
        return self.qkv_proj(h).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., hd/2] float32 of ``positions`` [...] int64."""
        inv_freq = self.rope_theta ** (
            -torch.arange(0, self.head_dim, 2, device=positions.device, dtype=torch.float32)
            / self.head_dim
        )
        angles = positions.float()[..., None] * inv_freq
        return angles.cos(), angles.sin()

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(h), backend=_kernel_backend()))


_BLOCKS = {"learned_pos": LearnedPosBlock, "rope_swiglu": RopeSwigluBlock}


class Weaver(nn.Module):
    """The Weaver tree drafter. Parameter names follow the public checkpoints.

    Use: ``prepare_tables`` once per target model, then per draft round
    ``session = start_round(...)`` and ``session.expand(...)`` per tree step.
    """

    def __init__(self, config: WeaverConfig):
        super().__init__()
        self.config = config
        self.embed_norm = WeaverRMSNorm(config.d_embed, config.rms_eps)
        self.output_norm = WeaverRMSNorm(config.d_model, config.rms_eps)
        self.out_norm = WeaverRMSNorm(config.d_rank, config.rms_eps)
        self.token_in = nn.Linear(config.d_embed, config.d_rank)
        self.proposal_in = nn.Linear(config.d_model, config.d_rank)
        self.lm_head_query_in = nn.Linear(config.d_rank, config.d_model, bias=False)
        block = _BLOCKS[config.layout]
        self.blocks = nn.ModuleList(block(config) for _ in range(config.num_layers))
        if config.layout == "learned_pos":
            self.pos_emb = nn.Parameter(torch.zeros(config.K, config.d_rank))
        # W_q [V, d_rank] and E' [V, d_rank]: derived from the target, never saved.
        self.register_buffer("query_table", None, persistent=False)
        self.register_buffer("token_table", None, persistent=False)
        # Target vocabulary size the tables must have, when the loader was told it.
        self.vocab_size: int | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.token_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.token_in.weight.device

    @torch.no_grad()
    def prepare_tables(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Cache the vocabulary tables used by every round.

        Args:
            embed_weight: [V, d_embed] target input embedding E.
            lm_head_weight: [V, d_model] target LM head W_lm.

        Sets ``query_table`` = W_lm @ lm_head_query_in.weight and ``token_table`` =
        token_in(embed_norm(E)), both [V, d_rank] in the module's dtype and device,
        built in fp32 a chunk of rows at a time.
        """
        cfg = self.config
        if embed_weight.dim() != 2 or embed_weight.shape[1] != cfg.d_embed:
            raise ValueError(
                f"embed_weight must be [V, d_embed={cfg.d_embed}], got {list(embed_weight.shape)}"
            )
        if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != cfg.d_model:
            raise ValueError(
                f"lm_head_weight must be [V, d_model={cfg.d_model}], got "
                f"{list(lm_head_weight.shape)}"
            )
        vocab = embed_weight.shape[0]
        if lm_head_weight.shape[0] != vocab:
            raise ValueError(
                f"embed_weight has {vocab} rows but lm_head_weight has {lm_head_weight.shape[0]}"
            )
        if self.vocab_size is not None and vocab != self.vocab_size:
            raise ValueError(
                f"target vocabulary has {vocab} rows but this Weaver was loaded for "
                f"target_vocab_size={self.vocab_size}"
            )
        query_in = self.lm_head_query_in.weight.float()  # [d_model, d_rank]
        token_w, token_b = self.token_in.weight.float(), self.token_in.bias.float()
        query_table = torch.empty(vocab, cfg.d_rank, dtype=self.dtype, device=self.device)
        token_table = torch.empty_like(query_table)
        for start in range(0, vocab, _TABLE_CHUNK_ROWS):
            rows = slice(start, min(start + _TABLE_CHUNK_ROWS, vocab))
            lm_rows = lm_head_weight[rows].to(self.device, torch.float32)
            query_table[rows] = lm_rows @ query_in
            normed = self.embed_norm(embed_weight[rows].to(self.device, torch.float32))
            token_table[rows] = F.linear(normed, token_w, token_b)
        self.query_table = query_table
        self.token_table = token_table

    def _add_positions(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layout (a): x + pos_emb[p - 1] where p >= 1; layout (b) positions act in attention."""
        if self.config.layout != "learned_pos":
            return x
        rows = self.pos_emb[(positions - 1).clamp(min=0)]
        return x + torch.where((positions >= 1)[..., None], rows, 0).to(x.dtype)

    @torch.no_grad()
    def start_round(
        self,
        h_v: torch.Tensor,
        dflash_hidden: torch.Tensor,
        pool_ids: torch.Tensor,
        pool_scores: torch.Tensor,
        max_nodes: int,
        validate: bool = True,
    ) -> WeaverRound:
        """Run the prefix pass of one draft round for R requests.

        Args:
            h_v: [R, d_model] target final-norm hidden state at the last committed position.
            dflash_hidden: [R, D, d_model] DFlash final hidden states at block
                positions 1..D, 1 <= D <= K.
            pool_ids: [R, D, P] int64 candidate token ids; row d is the pool of depth
                d+1. 1 <= P <= candidate_pool_size; ids in [0, V).
            pool_scores: [R, D, P] float raw target-LM-head logits of ``pool_ids``.
            max_nodes: tree nodes the round may hold (root included); node indices
                given to ``expand`` lie in [0, max_nodes).
            validate: check the pool ids and every ``expand`` call's nodes on the
                host (one device read each). The engine turns it off: its pools come
                from top-k and its nodes from the tree builder.

        Returns:
            A WeaverRound holding the prefix K/V, the per-round tree KV cache and
            the pools.
        """
        cfg = self.config
        if self.query_table is None:
            raise ValueError(
                "prepare_tables(embed_weight, lm_head_weight) must run before start_round"
            )
        if h_v.dim() != 2 or h_v.shape[1] != cfg.d_model:
            raise ValueError(f"h_v must be [R, d_model={cfg.d_model}], got {list(h_v.shape)}")
        rows = h_v.shape[0]
        if dflash_hidden.dim() != 3 or dflash_hidden.shape[::2] != (rows, cfg.d_model):
            raise ValueError(
                f"dflash_hidden must be [R={rows}, D, d_model={cfg.d_model}], got "
                f"{list(dflash_hidden.shape)}"
            )
        depth = dflash_hidden.shape[1]
        if not 1 <= depth <= cfg.K:
            raise ValueError(
                f"dflash_hidden holds D={depth} positions; D must be in [1, K={cfg.K}]"
            )
        ids_typed = pool_ids.dtype == torch.int64 and pool_ids.dim() == 3
        if not ids_typed or pool_ids.shape[:2] != (rows, depth):
            raise ValueError(
                f"pool_ids must be an int64 [R={rows}, D={depth}, P] tensor, got "
                f"{pool_ids.dtype} {list(pool_ids.shape)}"
            )
        pool = pool_ids.shape[2]
        if not 1 <= pool <= cfg.candidate_pool_size:
            raise ValueError(
                f"pool size P={pool} must be in [1, candidate_pool_size={cfg.candidate_pool_size}]"
            )
        if pool_scores.shape != pool_ids.shape or not pool_scores.is_floating_point():
            raise ValueError(
                f"pool_scores must be a float {list(pool_ids.shape)} tensor, got "
                f"{pool_scores.dtype} {list(pool_scores.shape)}"
            )
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be a positive int, got {max_nodes!r}")
        for name, t in (
            ("h_v", h_v),
            ("dflash_hidden", dflash_hidden),
            ("pool_ids", pool_ids),
            ("pool_scores", pool_scores),
        ):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the Weaver on {self.device}")
        vocab = self.query_table.shape[0]
        if validate and _may_sync(pool_ids) and ((pool_ids < 0) | (pool_ids >= vocab)).any():
            raise ValueError(f"pool_ids must lie in [0, V={vocab})")

        prefix = self.causal_pass(h_v, dflash_hidden)
        return WeaverRound(
            self, prefix.keys, prefix.values, pool_ids, pool_scores, max_nodes, validate
        )

    def causal_pass(
        self,
        h_v: torch.Tensor,
        dflash_hidden: torch.Tensor,
        path_inputs: torch.Tensor | None = None,
    ) -> CausalPass:
        """The prefix pass: x = proposal_in(output_norm([h_v; H_1..H_D])) at positions
        0..D, each entry attending to itself and the entries before it.

        ``start_round`` runs it (no grad) and caches its K/V. Training runs it with
        ``path_inputs`` [R, D', d_rank], the inputs of a path's nodes at depths
        0..D'-1 appended at positions 1..D': a node attends to the whole prefix, its
        ancestors and itself, so prefix + path is ONE causal sequence and the output
        at entry D+1+j is node j's (before ``out_norm``). Differentiable.

        Args:
            h_v: [R, d_model]; dflash_hidden: [R, D, d_model] (see ``start_round``).
        """
        cfg = self.config
        depth = dflash_hidden.shape[1]
        states = torch.cat([h_v[:, None], dflash_hidden], dim=1)  # [R, D+1, d_model]
        x = self.proposal_in(self.output_norm(states).to(self.dtype))
        positions = torch.arange(depth + 1, device=x.device)
        if path_inputs is not None:
            x = torch.cat([x, path_inputs], dim=1)
            path = torch.arange(1, path_inputs.shape[1] + 1, device=x.device)
            positions = torch.cat([positions, path])
        x = self._add_positions(x, positions)
        width = positions.shape[0]
        causal = torch.ones(width, width, dtype=torch.bool, device=x.device).tril()
        keys, values = [], []
        for block in self.blocks:
            q, k, v = block.qkv(x, positions)  # [R, T, H, hd]
            scores = torch.einsum("rthd,rshd->rhts", q.float(), k.float()) * cfg.head_dim**-0.5
            probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            x = block.finish(x, torch.einsum("rhts,rshd->rthd", probs, v.float()))
            keys.append(k)
            values.append(v)
        return CausalPass(x, torch.stack(keys), torch.stack(values))


class CausalPass(NamedTuple):
    """Output of ``Weaver.causal_pass`` over T entries.

    hidden: [R, T, d_rank] after the blocks, before ``out_norm``.
    keys, values: [L, R, T, H, hd] per layer.
    """

    hidden: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def _may_sync(t: torch.Tensor) -> bool:
    """Value checks read results on the host; that is illegal while capturing a CUDA graph."""
    return not capturing_graph(t.device)


class WeaverRound:
    """One draft round: prefix K/V, the tree KV cache and the pools of R requests.

    Node ``i`` of request ``r`` lives at slot ``i`` of the tree cache; slot
    ``max_nodes`` is a scratch slot that padding rows write to, so no step needs
    a data-dependent branch. With ``validate``, every ``expand`` call's nodes are
    checked on the host first.

    Attributes:
        num_requests (R), depth (D), pool_size (P), max_nodes (N).
        prefix_keys, prefix_values: [L, R, D+1, H, hd] prefix K/V per layer.
        node_keys, node_values: [L, R, N+1, H, hd] tree K/V per layer.
        node_depth: [R, N+1] int64, depth of each node seen so far, -1 if unseen.
        paths: [R, N+1, D+1] int64, ``paths[r, i, k]`` = node index of the depth-k
            ancestor of node i (i itself at its own depth), -1 past its depth.
    """

    def __init__(
        self,
        weaver: Weaver,
        prefix_keys: torch.Tensor,
        prefix_values: torch.Tensor,
        pool_ids: torch.Tensor,
        pool_scores: torch.Tensor,
        max_nodes: int,
        validate: bool = True,
    ):
        self.weaver = weaver
        self.validate = validate
        self.prefix_keys = prefix_keys
        self.prefix_values = prefix_values
        self.pool_ids = pool_ids
        self.pool_scores = pool_scores
        layers, rows, prefix, heads, head_dim = prefix_keys.shape
        self.num_requests = rows
        self.depth = prefix - 1
        self.pool_size = pool_ids.shape[2]
        self.max_nodes = max_nodes
        device = prefix_keys.device
        self.node_keys = torch.zeros(
            layers, rows, max_nodes + 1, heads, head_dim, dtype=prefix_keys.dtype, device=device
        )
        self.node_values = torch.zeros_like(self.node_keys)
        self.node_depth = torch.full((rows, max_nodes + 1), -1, dtype=torch.int64, device=device)
        self.paths = torch.full((rows, max_nodes + 1, prefix), -1, dtype=torch.int64, device=device)
        # Node positions are depth + 1 <= D: one rotary table per layer for the round.
        positions = torch.arange(prefix + 1, device=device)
        self.rotary_tables = [block.rotary_tables(positions) for block in weaver.blocks]

    @torch.no_grad()
    def expand(
        self,
        node_index: torch.Tensor,
        tokens: torch.Tensor,
        parent_index: torch.Tensor,
        depths: torch.Tensor,
    ) -> torch.Tensor:
        """Add w nodes per request to the tree and score their children's pools.

        Args:
            node_index: [R, w] int64 tree index of each new node, in [0, max_nodes),
                unique and not used before in this round; -1 marks a padding row,
                whose other fields are ignored.
            tokens: [R, w] int64 token of each node, in [0, V).
            parent_index: [R, w] int64 index of the parent, a node added by an
                EARLIER expand call of this round, or -1 for a root.
            depths: [R, w] int64 depth: 0 for a root, parent's depth + 1 otherwise,
                at most D.

        Returns:
            [R, w, P] float32 log q(c_k | root..node) over the pool of depth d+1
            (pool row d). Rows of depth-D nodes (no next pool) and of padding rows
            are -inf; padding rows write nothing.
        """
        rows = self.num_requests
        for name, t in (
            ("node_index", node_index),
            ("tokens", tokens),
            ("parent_index", parent_index),
            ("depths", depths),
        ):
            if t.dim() != 2 or t.shape[0] != rows or t.dtype != torch.int64:
                raise ValueError(
                    f"{name} must be an int64 [R={rows}, w] tensor, got {t.dtype} {list(t.shape)}"
                )
            if t.shape != node_index.shape:
                raise ValueError(
                    f"{name} has shape {list(t.shape)}, node_index {list(node_index.shape)}"
                )
            if t.device != self.node_depth.device:
                raise ValueError(f"{name} is on {t.device}, the round on {self.node_depth.device}")
        if self.validate and _may_sync(node_index):
            self._check_nodes(node_index, tokens, parent_index, depths)

        weaver = self.weaver
        places = extend_paths(self.paths, self.node_depth, node_index, tokens, parent_index,
                              depths)
        x = weaver.token_table[places.token_row]
        x = weaver._add_positions(x, places.positions)
        mlp_out = None  # the last block's MLP output, added inside the next norm
        for layer, block in enumerate(weaver.blocks):
            if mlp_out is None:
                normed = block.norm_attn(x)
            else:
                x, normed = block.norm_attn.add_and_norm(x, mlp_out)
            q, k, v = block.project(normed)  # [R, w, H, hd], before rotary
            tables = self.rotary_tables[layer]
            attn = node_attention(
                q, k, v, self.prefix_keys[layer], self.prefix_values[layer],
                self.node_keys[layer], self.node_values[layer], places.kv_slot,
                places.ancestors, None if tables is None else places.positions, tables,
            )
            x, mlp_out = block.finish_parts(x, attn)
        _, y = weaver.out_norm.add_and_norm(x, mlp_out)

        return pool_logits_log_softmax(
            y, weaver.query_table, self.pool_ids, self.pool_scores, pool_rows=places.pool_row
        )

    def _check_nodes(self, node_index, tokens, parent_index, depths) -> None:
        """Reject inconsistent nodes, reading the device once."""
        rows, width = node_index.shape
        n, d_max, vocab = self.max_nodes, self.depth, self.weaver.query_table.shape[0]
        batch = torch.arange(rows, device=node_index.device)[:, None]
        real = node_index >= 0
        is_root = parent_index == -1
        parent_depth = self.node_depth[batch, parent_index.clamp(0, n - 1)]
        same = node_index[:, :, None] == node_index[:, None, :]
        same &= real[:, :, None] & ~torch.eye(width, dtype=torch.bool, device=node_index.device)
        used = self.node_depth[batch, node_index.clamp(0, n - 1)] >= 0
        child = real & ~is_root
        checks = [
            ((node_index < -1) | (node_index >= n), f"node_index must be -1 or in [0, {n})"),
            (real & used, "node_index was already used in this round"),
            (same.any(-1), "node_index appears twice in one request"),
            (real & ((tokens < 0) | (tokens >= vocab)), f"tokens must lie in [0, V={vocab})"),
            (
                real & ((parent_index < -1) | (parent_index >= n)),
                f"parent_index must be -1 or in [0, {n})",
            ),
            (child & (parent_depth < 0), "parent_index names a node no earlier expand call added"),
            (real & is_root & (depths != 0), "a root (parent_index -1) must have depth 0"),
            (
                child & (parent_depth >= 0) & (depths != parent_depth + 1),
                "depths must be the parent's + 1",
            ),
            (real & (depths > d_max), f"depths must be at most D={d_max}"),
        ]
        flags = torch.stack([bad.any() for bad, _ in checks]).tolist()
        for (bad, message), flagged in zip(checks, flags):
            if flagged:
                r, j = (int(i) for i in bad.nonzero()[0])
                raise ValueError(
                    f"{message}: request {r}, row {j} (node_index {int(node_index[r, j])}, "
                    f"parent_index {int(parent_index[r, j])}, depth {int(depths[r, j])}, "
                    f"token {int(tokens[r, j])})"
                )
