"""Random draft trees and error measures for the tests and the benchmark tools.

A tree of ``n`` nodes is drawn in topological order: node 0 is a root and node
``i > 0`` takes a parent uniformly from a window of earlier nodes that its
shape fixes (``-1`` in the window makes a new root):

    chain   i - 1                    star    0
    bushy   the BUSHY_WINDOW nodes before i (deep and branching, like beam search)
    random  any of 0 .. i - 1        forest  any of -1 .. i - 1

Everything is drawn from the caller's ``torch.Generator``, so a seed replays it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

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
