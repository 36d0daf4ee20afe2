"""A PyTorch DFlash drafter that reads and writes the checkpoints of vLLM's `dflash` method.

Architecture (as vLLM's `DFlashQwen3ForCausalLM` computes it; written here from that
description, no code shared):

- Context. The outputs of the target layers `dflash_config.target_layer_ids` at the
  committed positions 0..p-1 are concatenated ([C, n * d_target]), projected by `fc` (no
  bias) and normed by `hidden_norm`: c [C, d]. Every draft layer turns c into context
  K/V with its own k_proj / v_proj, per-head k_norm and RoPE at the context positions.
  The context skips the layers' input_layernorm and never becomes a query.
- Block. [x_p, MASK x D] at positions p..p+D, embedded with the TARGET's embedding (the
  drafter has none). Qwen3 decoder layers: RMSNorm, attention whose keys are
  [context K ; block K] with NO causal mask (every block entry sees the whole block),
  per-head q/k RMSNorm, neox RoPE, GQA; residual; RMSNorm, SwiGLU MLP; residual. The
  final `norm` gives the block's hidden states H; the TARGET's LM head turns H[k]
  (k = 1..D) into the marginal of x_{p+k}.

Checkpoint names are vLLM's (no `model.` prefix, no embedding, no LM head):
fc, hidden_norm, norm, layers.{i}.{input_layernorm, post_attention_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}.

Training (DESIGN.md section 2) runs many blocks of one sequence in one pass: block a, at
anchor p_a, sees the context positions < p_a and its own entries only (an attention
mask), so the blocks never see each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Per-position loss weight w_k = exp(-(k - 1) / LOSS_DECAY), k = 1..D (DESIGN.md section 2).
LOSS_DECAY = 7.0


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm in fp32: x / rms(x) * weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 1e6))
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"config.rope_parameters.rope_type must be 'default', got {rope_type!r}")
    return float(theta)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox (rotate-half) RoPE over the whole head dim. x [..., S, H, hd], positions [..., S]."""
    head_dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32)
                         / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [..., S, hd/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[..., None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[..., None, :]
    xf = x.float()
    half = head_dim // 2
    turned = torch.cat([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos + turned * sin).to(x.dtype)


class DFlashLayer(nn.Module):
    """One Qwen3 decoder layer whose attention also reads the context K/V."""

    def __init__(self, config: dict):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.theta = _rope_theta(config)
        eps = config["rms_norm_eps"]
        bias = bool(config.get("attention_bias", False))
        inter = config["intermediate_size"]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = nn.Module()
        attn = self.self_attn
        attn.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        attn.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        attn.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        attn.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        attn.q_norm = RMSNorm(self.head_dim, eps)
        attn.k_norm = RMSNorm(self.head_dim, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, hidden, bias=False)

    def _keys_values(self, h: torch.Tensor, positions: torch.Tensor):
        attn = self.self_attn
        k = attn.k_norm(attn.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = attn.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return rotate(k, positions, self.theta), v

    def forward(self, x, context, context_positions, positions, mask):
        """x [B, Q, d] block stream at `positions` [B, Q]; context [B, C, d] (normed) at
        `context_positions` [B, C]; mask [B, Q, C + Q] bool (True = visible)."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim)))
        q = rotate(q, positions, self.theta)
        k_block, v_block = self._keys_values(h, positions)
        k_ctx, v_ctx = self._keys_values(context, context_positions)
        k = torch.cat([k_ctx, k_block], 1).transpose(1, 2)  # [B, Hkv, C+Q, hd]
        v = torch.cat([v_ctx, v_block], 1).transpose(1, 2)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
        x = x + attn.o_proj(out.transpose(1, 2).flatten(-2))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class DFlashDrafter(nn.Module):
    """The drafter; parameter names are the checkpoint's.

    Attributes:
        config: the checkpoint's config.json dict.
        mask_token_id, target_layer_ids: from `config["dflash_config"]`.
        block_size: bonus token + draft positions the drafter was trained for (16).
    """

    def __init__(self, config: dict, target_hidden_size: int):
        super().__init__()
        _check_config(config)
        self.config = config
        hidden = config["hidden_size"]
        dflash = config["dflash_config"]
        self.mask_token_id = int(dflash["mask_token_id"])
        self.target_layer_ids = tuple(int(i) for i in dflash["target_layer_ids"])
        self.block_size = int(config.get("block_size", 16))
        self.fc = nn.Linear(target_hidden_size * len(self.target_layer_ids), hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config["rms_norm_eps"])
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(hidden, config["rms_norm_eps"])

    @property
    def draft_depth(self) -> int:
        """Mask positions per block (block_size - 1)."""
        return self.block_size - 1

    @classmethod
    def load(cls, directory: str | Path, target_hidden_size: int) -> DFlashDrafter:
        """Read config.json + model.safetensors (every key checked by name), fp32."""
        directory = Path(directory)
        config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        for needed in (config_path, weights_path):
            if not needed.is_file():
                raise ValueError(f"{directory}: a DFlash drafter directory needs {needed.name}")
        config = json.loads(config_path.read_text(encoding="utf-8"))
        drafter = cls(config, target_hidden_size)
        state = load_file(str(weights_path))
        expected = drafter.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{weights_path}: missing keys {missing}, unexpected keys {unexpected}"
            )
        for key, want in expected.items():
            if state[key].shape != want.shape:
                raise ValueError(
                    f"{weights_path}: {key} has shape {list(state[key].shape)}, "
                    f"expected {list(want.shape)}"
                )
        drafter.load_state_dict({k: v.float() for k, v in state.items()})
        return drafter

    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write config.json + model.safetensors (`dtype`, vLLM's names)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        text = json.dumps(self.config, indent=2, sort_keys=True) + "\n"
        (directory / CONFIG_FILE).write_text(text, encoding="utf-8")

    def forward(
        self,
        aux: torch.Tensor,
        block_tokens: torch.Tensor,
        anchors: torch.Tensor,
        embed: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states of A blocks per sequence.

        Args:
            aux: [B, C, n * d_target] target layer outputs at positions 0..C-1.
            block_tokens: [B, A, S] block inputs (x_p, then masks), S <= block_size.
            anchors: [B, A] int64 position p of each block's first entry, in [1, C].
                Block a sees context positions < anchors[:, a] and its own S entries.
            embed: [V, d] the target's input embedding.

        Returns:
            [B, A, S, d] final-norm hidden states (entry k predicts x_{p+k}).
        """
        batch, count, width = block_tokens.shape
        context_len = aux.shape[1]
        if anchors.shape != (batch, count):
            raise ValueError(f"anchors must be [B={batch}, A={count}], got {list(anchors.shape)}")
        device = aux.device
        context = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        context_positions = torch.arange(context_len, device=device).expand(batch, -1)
        offsets = torch.arange(width, device=device)
        positions = (anchors[..., None] + offsets).reshape(batch, count * width)
        query_anchor = anchors.repeat_interleave(width, 1)[..., None]  # [B, A*S, 1]
        sees_context = context_positions[:, None, :] < query_anchor
        block_of = torch.arange(count, device=device).repeat_interleave(width)
        same_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
        mask = torch.cat([sees_context, same_block], -1)
        x = F.embedding(block_tokens.reshape(batch, count * width), embed).to(context.dtype)
        for layer in self.layers:
            x = layer(x, context, context_positions, positions, mask)
        return self.norm(x).view(batch, count, width, -1)

    def block_inputs(self, anchor_tokens: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """[..., 1 + depth] blocks [x_p, MASK x depth] from anchor tokens [...]."""
        depth = self.draft_depth if depth is None else depth
        masks = torch.full((*anchor_tokens.shape, depth), self.mask_token_id,
                           dtype=torch.int64, device=anchor_tokens.device)
        return torch.cat([anchor_tokens[..., None].long(), masks], -1)


def _check_config(config: dict) -> None:
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "rms_norm_eps", "dflash_config")
    missing = [key for key in required if key not in config]
    if missing:
        raise ValueError(f"DFlash config is missing keys {missing}")
    dflash = config["dflash_config"]
    if not isinstance(dflash, dict) or not dflash.get("target_layer_ids") or (
        dflash.get("mask_token_id") is None
    ):
        raise ValueError("config.dflash_config needs mask_token_id and target_layer_ids")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.hidden_act must be 'silu', got {config['hidden_act']!r}")
    causal = config.get("is_causal", dflash.get("causal"))
    if causal or dflash.get("use_swa") or config.get("layer_types"):
        raise ValueError(
            "only non-causal full-attention DFlash drafters are supported (config sets "
            "is_causal / dflash_config.causal / use_swa / layer_types)"
        )
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError("config.num_attention_heads must be a multiple of num_key_value_heads")


def sample_anchors(batch: int, count: int, low: int, high: int,
                   generator: torch.Generator) -> torch.Tensor:
    """[batch, count] int64 anchors uniform in [low, high] (CPU generator)."""
    if not 1 <= low <= high:
        raise ValueError(f"anchor range must satisfy 1 <= low <= high, got [{low}, {high}]")
    return torch.randint(low, high + 1, (batch, count), generator=generator)


def position_weights(depth: int, device=None) -> torch.Tensor:
    """[depth] w_k = exp(-(k - 1) / LOSS_DECAY) for k = 1..depth."""
    return torch.exp(-torch.arange(depth, device=device, dtype=torch.float32) / LOSS_DECAY)


def block_loss(
    drafter: DFlashDrafter,
    aux: torch.Tensor,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DFlash training loss of blocks at `anchors`.

    Args:
        aux: [B, T, n * d_target] target layer outputs of `tokens` [B, T].
        anchors: [B, A] positions with anchors + block_size - 1 <= T - 1.
        embed, lm_head: the target's [V, d] embedding and LM head (frozen).

    Returns:
        loss: scalar, sum_k w_k CE(lm_head(H_k), x_{p+k}) / sum_k w_k, mean over blocks.
        correct: [D] float fraction of blocks whose argmax at k equals x_{p+k}.
    """
    depth = drafter.draft_depth
    if int(anchors.max()) + depth >= tokens.shape[1]:
        raise ValueError(f"anchors + {depth} must stay below T={tokens.shape[1]}")
    batch = torch.arange(tokens.shape[0], device=tokens.device)[:, None, None]
    span = anchors[..., None] + torch.arange(depth + 1, device=tokens.device)
    block_tokens = drafter.block_inputs(tokens[batch[..., 0], anchors])
    hidden = drafter(aux, block_tokens, anchors, embed)[:, :, 1:]
    logits = (hidden @ lm_head.T).float()  # [B, A, D, V]
    labels = tokens[batch, span[..., 1:]]
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
    weights = position_weights(depth, tokens.device)
    loss = (ce.view(labels.shape) * weights).sum(-1).mean() / weights.sum()
    correct = (logits.argmax(-1) == labels).float().mean((0, 1))
    return loss, correct

