"""Build the tiny model family (tokenizer, target, DFlash drafter, Weaver) and check it in vLLM.

    python tools/make_tiny_models.py build [--out DIR] [--force]
    python tools/make_tiny_models.py check [--out DIR]      # build, then both engines
    python tools/make_tiny_models.py generate --target DIR [--speculative-config JSON] \
        --json-out FILE
    python tools/make_tiny_models.py hf-generate --target DIR --json-out FILE
    python tools/make_tiny_models.py batch --runs JSON --json-out FILE

`check` runs greedy generation with the target alone and with vLLM's `dflash` method (one
engine per subprocess) and prints, per prompt, how many greedy tokens agree. `generate`
(vLLM) and `hf-generate` (transformers, fp32) are the one-process steps that `check` and
tests/test_tiny_models.py start; `batch` runs batches of requests with any sampling options,
one engine per run (`vllm_tfm.tiny.engine_runs.engine_batches`), for tests/test_plugin_inert.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_tfm.tiny import engine_runs
from vllm_tfm.tiny.family import DEFAULT_OUT_DIR, TinyFamily, build_family


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _build(args: argparse.Namespace) -> TinyFamily:
    family = build_family(args.out, force=args.force)
    print(f"family   {family.root}  (build {family.build_hash[:12]})")
    for name in ("target", "dflash"):
        path = getattr(family, name)
        print(f"{name:8s} {path}  {_dir_size(path) / 2**20:.2f} MiB")
    print(f"weaver   {family.weaver}  {family.weaver.stat().st_size / 2**20:.2f} MiB")
    return family


def _check(args: argparse.Namespace) -> int:
    family = _build(args)
    tokens = args.max_tokens
    base = engine_runs.greedy_in_subprocess(family.target, max_tokens=tokens)
    dflash = engine_runs.dflash_speculative_config(family.dflash)
    spec = engine_runs.greedy_in_subprocess(family.target, dflash, max_tokens=tokens)
    print(f"engine start: target {base['start_s']:.1f} s, target+dflash {spec['start_s']:.1f} s")
    print(f"chat reply: {base['chat_text']!r}")
    print(f"dflash drafts {spec['num_drafts']}, accepted tokens {spec['num_accepted']}")
    print("prompt  matched/length  first-difference margin")
    rows = engine_runs.compare_greedy(base, spec)
    for i, row in enumerate(rows):
        margin = "-"
        if "margin" in row:
            margin = f"{row['margin']:.3f} ({'tie' if row['tie'] else 'MISMATCH'})"
        print(f"{i:6d}  {row['matched']:7d}/{row['length']:<6d}  {margin}")
    return 1 if any(row.get("tie") is False for row in rows) else 0


def _write(path: Path, result: dict) -> int:
    path.write_text(json.dumps(result), encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("build", "check"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
        p.add_argument("--force", action="store_true", help="rebuild even if a build matches")
        if name == "check":
            p.add_argument("--max-tokens", type=int, default=32)
    for name, help_text in (("generate", "greedy run in vLLM"),
                            ("hf-generate", "greedy run in transformers, fp32")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--target", type=Path, required=True)
        if name == "generate":
            p.add_argument("--speculative-config", type=json.loads, help="JSON object")
        p.add_argument("--max-tokens", type=int, default=32)
        p.add_argument("--prompts", type=json.loads, default=list(engine_runs.PROMPTS),
                       help="JSON list of strings")
        p.add_argument("--json-out", type=Path, required=True)
    p = sub.add_parser("batch", help="batches of requests in vLLM, one engine per run")
    p.add_argument("--runs", type=json.loads, required=True,
                   help="JSON list of runs (see engine_runs.engine_batches)")
    p.add_argument("--json-out", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.command == "build":
        _build(args)
        return 0
    if args.command == "check":
        return _check(args)
    if args.command == "batch":
        return _write(args.json_out, engine_runs.engine_batches(args.runs))
    prompts = tuple(args.prompts)
    if args.command == "generate":
        result = engine_runs.engine_greedy(
            args.target, args.speculative_config, prompts, args.max_tokens
        )
    else:
        result = engine_runs.transformers_greedy(args.target, prompts, args.max_tokens)
    return _write(args.json_out, result)


if __name__ == "__main__":
    sys.exit(main())
