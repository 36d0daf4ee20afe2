"""The models of the GPU check (tools/gpu_e2e.py): a tiny DENSE hybrid target
(`qwen3_5_text`, Qwen3_5ForCausalLM: 8 layers, (GDN x3 + full attention) x2; the GPU harness
runs no MoE), the tiny family's DFlash drafter and a random Weaver, all with the tiny
family's initialisation (`vllm_tfm.tiny.family`).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_tfm.tiny import family as tiny_family

NUM_LAYERS = 8
TARGET_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": tiny_family.VOCAB_SIZE,
    "hidden_size": tiny_family.HIDDEN,
    "intermediate_size": 512,
    "num_hidden_layers": NUM_LAYERS,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (NUM_LAYERS // 4),
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    # GDN shapes of shared/gpu-vllm/make_tiny.py: its carried Triton cache then holds
    # vLLM's GDN prefill kernels for them.
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": tiny_family.EOS_ID,
    "pad_token_id": tiny_family.PAD_ID,
    "dtype": "bfloat16",
}


def build_target(out_dir: Path) -> None:
    """The dense qwen3_5_text target, weights by the tiny family's rules, bf16 safetensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    kwargs = {k: v for k, v in TARGET_CONFIG.items() if k not in ("architectures", "model_type")}
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kwargs))
    state = {
        name: tiny_family._init_value(name, tuple(tensor.shape), zero_centered_norms=True)
        .to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(TARGET_CONFIG, indent=2) + "\n")
    tiny_family.build_tokenizer(out_dir)


def build_models(root: Path) -> None:
    """root/target (`build_target`), root/dflash and root/weaver.pth (the tiny family's)."""
    for name in ("target", "dflash"):
        (root / name).mkdir(parents=True, exist_ok=True)
    build_target(root / "target")
    tiny_family.build_dflash(root / "dflash")
    tiny_family.build_weaver(root / "weaver.pth")
