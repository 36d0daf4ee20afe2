"""Building and loading the tiny model family: tokenizer, Qwen3-Next hybrid target, DFlash
drafter and Weaver.

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
  top-1 probability ~0.9). Compare greedy runs with `engine_runs.compare_greedy` and
  `engine_runs.TIE_MARGIN`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import sysconfig
import tempfile
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / "artifacts" / "tiny_family"
# The trained family (tools/train_family.py), committed with its recipe.
TRAINED_DIR = REPO_ROOT / "models" / "tiny_trained"
# The trained family with experts enough for tensor parallelism (`trained_family_with_experts`).
TP_OUT_DIR = REPO_ROOT / "artifacts" / "tiny_trained_tp"
SLIDING_DRAFTER_OUT_DIR = REPO_ROOT / "artifacts" / "tiny_sliding_drafter"
TP_NUM_EXPERTS = 4

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


def train_tokenizer(texts: list[str], out_dir: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Byte-level BPE (vocab `vocab_size`, `SPECIAL_TOKENS` first at ids 0..3) trained on
    `texts`; writes tokenizer.json and tokenizer_config.json (ChatML template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"BPE training gave {tokenizer.get_vocab_size()} tokens, want {vocab_size}"
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


def build_tokenizer(out_dir: Path) -> None:
    """The family's tokenizer: `train_tokenizer` on `CORPUS_FILES`."""
    train_tokenizer([path.read_text(encoding="utf-8") for path in corpus_paths()], out_dir)


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


def trained_family_with_experts(
    num_experts: int = TP_NUM_EXPERTS, out_dir: str | os.PathLike = TP_OUT_DIR
) -> TinyFamily:
    """The trained family, its target's one expert (and router row) copied `num_experts`
    times, written to `out_dir` (reused while the trained family is unchanged).

    vLLM refuses a MoE layer with fewer experts than tensor-parallel ranks. Identical experts
    behind identical router rows give every top-1 choice the same output at routing weight
    1, so this target computes what the trained one does, and TP can split it.
    """
    import re

    from safetensors.torch import load_file, save_file

    trained = trained_family()
    root = Path(out_dir).resolve()
    source = f"{trained.build_hash}:{num_experts}"
    if (root / "source.txt").is_file() and (root / "source.txt").read_text() == source:
        return dataclasses.replace(trained, root=root, target=root / "target",
                                   dflash=root / "dflash", weaver=root / "weaver")
    config = json.loads((trained.target / "config.json").read_text(encoding="utf-8"))
    if config["num_experts"] != 1 or config["num_experts_per_tok"] != 1:
        raise ValueError("trained_family_with_experts copies a single top-1 expert")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        for part in ("target", "dflash", "weaver"):
            shutil.copytree(trained.root / part, staging / part)
        state = load_file(trained.target / "model.safetensors")
        for name in list(state):
            expert = re.fullmatch(r"(.*\.mlp\.experts\.)0(\..*)", name)
            for copy in range(1, num_experts) if expert else ():
                state[f"{expert[1]}{copy}{expert[2]}"] = state[name].clone()
            if name.endswith(".mlp.gate.weight"):
                state[name] = state[name].repeat(num_experts, 1)
        save_file(state, str(staging / "target" / "model.safetensors"), metadata={"format": "pt"})
        _write_json(staging / "target" / "config.json", {**config, "num_experts": num_experts})
        (staging / "source.txt").write_text(source)
        if root.exists():
            shutil.rmtree(root)
        staging.rename(root)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return trained_family_with_experts(num_experts, root)


def with_sliding_window_drafter(
    family: TinyFamily, window: int = 24, out_dir: str | os.PathLike = SLIDING_DRAFTER_OUT_DIR
) -> TinyFamily:
    """`family` with a drafter whose layers mix sliding-window and full attention: the same
    weights, layer 0 sliding (`window` tokens) and the others full, written to `out_dir`.

    The shape of z-lab's mixed DFlash drafters, which vLLM builds on model runner V2 only.
    vLLM resolves such a drafter's sliding layers as causal and its full layers as not.
    """
    config = json.loads((family.dflash / "config.json").read_text(encoding="utf-8"))
    layers = config["num_hidden_layers"]
    if layers < 2:
        raise ValueError("a drafter mixing sliding and full attention needs 2 layers or more")
    # The window goes in dflash_config: transformers' Qwen3Config drops a top-level
    # sliding_window unless use_sliding_window is set.
    config = {**config, "dflash_config": {**config["dflash_config"], "swa_window_size": window},
              "layer_types": ["sliding_attention"] + ["full_attention"] * (layers - 1)}
    drafter = Path(out_dir).resolve() / "dflash"
    drafter.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(family.dflash / "model.safetensors", drafter / "model.safetensors")
    _write_json(drafter / "config.json", config)
    return dataclasses.replace(family, dflash=drafter)


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
