"""Random draft trees, error measures and sm_90 compile reports for the tests and the
benchmark tools.

A tree of ``n`` nodes is drawn in topological order: node 0 is a root and node
``i > 0`` takes a parent uniformly from a window of earlier nodes that its
shape fixes (``-1`` in the window makes a new root):

    chain   i - 1                    star    0
    bushy   the BUSHY_WINDOW nodes before i (deep and branching, like beam search)
    random  any of 0 .. i - 1        forest  any of -1 .. i - 1

Everything is drawn from the caller's ``torch.Generator``, so a seed replays it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import triton
import triton.language as tl

from triton_ops.tree_metadata import TreeMetadata, build_tree_metadata

TREE_SHAPES = ("chain", "star", "bushy", "random", "forest")
BUSHY_WINDOW = 4


def random_parents(gen: torch.Generator, shape: str, num_nodes: int) -> torch.Tensor:
    """[num_nodes] int64 parents of one tree of ``shape`` (one of ``TREE_SHAPES``)."""
    node = torch.arange(num_nodes)
    windows = {
        "chain": (node - 1, node),
        "star": (torch.zeros_like(node), torch.ones_like(node)),
        "bushy": ((node - BUSHY_WINDOW).clamp(min=0), node),
        "random": (torch.zeros_like(node), node),
        "forest": (torch.full_like(node, -1), node),
    }
    if shape not in windows:
        raise ValueError(f"shape must be one of {TREE_SHAPES}, got {shape!r}")
    low, high = windows[shape]
    span = high - low
    draw = torch.rand(num_nodes, generator=gen, dtype=torch.float64)
    parents = low + torch.minimum((draw * span).long(), span - 1)
    parents[:1] = -1
    return parents


def random_tree_batch(
    gen: torch.Generator,
    shapes: Sequence[str],
    max_nodes: int,
    num_nodes: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree per entry of ``shapes``, padded to ``max_nodes``.

    ``num_nodes`` defaults to a full first request (every tile of a kernel
    used) and uniform counts in [1, max_nodes] for the others.

    Returns:
        parents: [B, max_nodes] int64; padding holds arbitrary values in
            [-1, max_nodes), which every consumer must ignore.
        num_nodes: [B] int32.
    """
    batch = len(shapes)
    if num_nodes is None:
        rest = torch.randint(1, max_nodes + 1, (batch - 1,), generator=gen).tolist()
        num_nodes = [max_nodes, *rest][:batch]
    parents = torch.randint(-1, max_nodes, (batch, max_nodes), generator=gen)
    for b, (shape, count) in enumerate(zip(shapes, num_nodes)):
        parents[b, :count] = random_parents(gen, shape, count)
    return parents, torch.tensor(num_nodes, dtype=torch.int32)


def random_tree_metadata(
    gen: torch.Generator,
    shapes: Sequence[str],
    max_nodes: int,
    num_nodes: Sequence[int] | None = None,
    conv_width: int = 4,
    device: torch.device | str = "cpu",
) -> TreeMetadata:
    """:func:`random_tree_batch` built into metadata on ``device``."""
    parents, counts = random_tree_batch(gen, shapes, max_nodes, num_nodes)
    return build_tree_metadata(parents.to(device), counts.to(device), conv_width)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``|x - ref| / |ref|`` in float64 (Frobenius norms); inf when ``x`` holds NaN or inf."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp(min=1e-30))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical contents (NaN payloads included), whatever the dtype."""
    return torch.equal(a.cpu().flatten().view(torch.uint8), b.cpu().flatten().view(torch.uint8))


def triton_kernels() -> dict[str, object]:
    """Every Triton kernel of ``triton_ops`` by name (``module:name``): the ``@triton.jit``
    functions whose names end in ``_kernel``."""
    import importlib
    import pkgutil

    import triton_ops

    kernels = {}
    for info in pkgutil.walk_packages(triton_ops.__path__, "triton_ops."):
        for name, value in vars(importlib.import_module(info.name)).items():
            if name.endswith("_kernel") and isinstance(value, triton.runtime.jit.KernelInterface):
                kernels[f"{info.name}:{name}"] = value
    return kernels


def compiled_variants(kernels: dict[str, object] | None = None) -> list[str]:
    """One line per variant of our kernels this process has compiled (all of
    :func:`triton_kernels` by default): the kernel, its cache key (the argument types,
    Triton's specialisation of the arguments: divisible by 16, equal to 1, and the
    constexprs) and, once launched, its registers and spills. Two processes that ran the
    same op with other arguments (the engine, the kernel bench) compare here."""
    lines = []
    for name, kernel in (triton_kernels() if kernels is None else kernels).items():
        for device, caches in getattr(kernel, "device_caches", {}).items():
            for key, compiled in caches[0].items():
                usage = ", ".join(f"{attr} {getattr(compiled, attr)}" for attr in ("n_regs", "n_spills")
                                  if getattr(compiled, attr, None) is not None)
                lines.append(f"{name} (device {device}{', ' + usage if usage else ''}): {key}")
    return lines


# --- What ptxas makes of a launch, on a machine without a GPU ---------------------------

POINTER_TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
    torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
}
LAUNCH_OPTIONS = ("num_warps", "num_stages")
# Compiles the launches (JSON on stdin) for sm_90 in a process without the interpreter, where
# every @triton.jit function, Triton's own (tl.sum's combine) included, is a compilable
# JITFunction; prints one JSON line per launch: the PTX's vector global loads and stores,
# cuobjdump's registers and stack, and the SASS's instructions, local loads and stores,
# block barriers and waits for wgmma results (each a dot the warps stop for), and
# (LINES > 0) the LINES source lines of triton_ops ("triton_ops/...py:LINE") with the most
# instructions.
COMPILER = r"""
import collections, importlib, json, os, re, subprocess, sys, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/")
LOCATION = re.compile(r'//## File "([^"]+)", line (\d+)')

def tool(name, *args):
    return subprocess.run([os.path.join(BIN, name), *args], capture_output=True, text=True,
                          check=True).stdout

def lines_of(cubin, count):
    # nvdisasm -gi: before each run of instructions, the chain of inlined-at locations,
    # innermost first; an instruction counts for the innermost line in triton_ops.
    counts, where, in_chain = collections.Counter(), "?", False
    for line in tool("nvdisasm", "-gi", "-c", cubin).splitlines():
        found = LOCATION.search(line)
        if found:
            if not in_chain:
                where, in_chain = None, True
            path = found.group(1)
            if where is None and "triton_ops/" in path:
                where = f"{path[path.rindex('triton_ops/'):]}:{found.group(2)}"
        elif INSTRUCTION.match(line):
            in_chain = False
            counts[where or "?"] += 1
    return counts.most_common(count)

lines = int(sys.argv[1])
for launch in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    constexprs = {(index,): tl.dtype(value["dtype"]) if isinstance(value, dict) else value
                  for index, value in launch["constexprs"]}
    attrs = {(index,): [["tt.divisibility", 16]] for index in launch["divisible"]}
    source = ASTSource(kernel, launch["signature"], constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = tool("cuobjdump", "-res-usage", cubin)
        sass = [l for l in tool("cuobjdump", "-sass", cubin).splitlines() if INSTRUCTION.match(l)]
        top = lines_of(cubin, lines) if lines else []
    print(json.dumps({
        "kernel": launch["kernel"], "options": launch["options"],
        "ld": ptx.count("ld.global.v4") + ptx.count("ld.global.v2"),
        "st": ptx.count("st.global.v4") + ptx.count("st.global.v2"),
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "instructions": len(sass),
        "local_loads": sum(" LDL" in l for l in sass),
        "local_stores": sum(" STL" in l for l in sass),
        "barriers": sum("BAR.SYNC" in l for l in sass),
        "mma_waits": sum("WARPGROUP.DEPBAR" in l for l in sass),
        "lines": top,
    }), flush=True)
"""


def _scalar_type(value) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(1 << 31) <= value < (1 << 31) else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__} {value!r}")


def describe_launch(fn, args, kwargs) -> dict:
    """One recorded launch of ``fn`` (the kernel's Python function) as the compiler takes
    it: argument types, constexpr values (dtypes by name), launch options. As a launch
    specialises them: integers equal to 1 become constants, pointers and integers divisible
    by 16 are marked so."""
    parameters = inspect.signature(fn).parameters
    values = dict(zip(parameters, args)) | {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    signature, constexprs, divisible = {}, [], []
    for index, (name, parameter) in enumerate(parameters.items()):
        value = values.get(name, parameter.default)
        if "constexpr" in str(parameter.annotation) or value is None:
            signature[name] = "constexpr"
            constexprs.append((index, {"dtype": value.name} if isinstance(value, tl.dtype) else value))
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + POINTER_TYPES[value.dtype]
            divisible += [index] if value.data_ptr() % 16 == 0 else []
        elif type(value) is int and value == 1:
            signature[name] = "constexpr"
            constexprs.append((index, 1))
        else:
            signature[name] = _scalar_type(value)
            divisible += [index] if type(value) is int and value % 16 == 0 else []
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": signature,
            "constexprs": constexprs, "divisible": divisible,
            "options": {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}}


def gpu_choice_modules() -> tuple:
    """Modules whose kernels' constexprs depend on ``interpreting()`` (fp32 stand-ins for
    16-bit dots): recording a launch as CUDA makes it read False there."""
    import triton_ops.gdn_tree.chunk_triton as chunk_triton
    import triton_ops.tree_metadata as tree_metadata

    return (chunk_triton, tree_metadata)


@contextlib.contextmanager
def recording_launches():
    """Within it, Triton launches (under ``TRITON_INTERPRET=1``) are recorded, not run, into
    the yielded list as (kernel function, args, kwargs), and the ops choose their GPU paths
    (:func:`gpu_choice_modules`)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = []

    def record(kernel, *args, grid, warmup, **kwargs):
        launches.append((kernel.fn, args, kwargs))

    run = InterpretedFunction.run
    modules = gpu_choice_modules()
    choices = [module.interpreting for module in modules]
    InterpretedFunction.run = record
    for module in modules:
        module.interpreting = lambda: False
    try:
        yield launches
    finally:
        InterpretedFunction.run = run
        for module, choice in zip(modules, choices):
            module.interpreting = choice


def compile_sm90(launches: list, triton_root: Path | None = None, lines: int = 0) -> list[dict]:
    """Compile each distinct recorded launch for sm_90 with this environment's Triton, or
    with the one installed under ``triton_root`` (put first on the compiler's path); for
    every launch, what :data:`COMPILER` prints of it."""
    keys = [json.dumps(describe_launch(*launch), sort_keys=True) for launch in launches]
    unique = list(dict.fromkeys(keys))
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    if triton_root is not None:
        if not (Path(triton_root) / "triton").is_dir():
            raise FileNotFoundError(f"{triton_root} holds no Triton: run tools/setup_env.sh")
        repository = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([str(triton_root), repository, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COMPILER, str(lines)], input=f"[{', '.join(unique)}]",
                          capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"compiling for sm_90 failed:\n{done.stderr[-3000:]}")
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(reports) != len(unique):
        raise RuntimeError(f"{len(unique)} launches, {len(reports)} reports:\n{done.stdout[-2000:]}")
    by_key = dict(zip(unique, reports))
    return [by_key[key] for key in keys]


def device_triton() -> Path:
    """Where tools/setup_env.sh installs the device image's Triton (beside the venv)."""
    return Path(sys.prefix) / "triton-device"
