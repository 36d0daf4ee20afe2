"""Counter-based random numbers: a uniform is a hash of (request seed, stream, counter).

A request's draws depend on its own seed only, not on the batch it sits in or on the
device. The hash is SplitMix64's finaliser: ``key = mix(seed ^ mix(stream))`` per
request, then ``mix(key + (counter + 1) * GOLDEN) >> 11`` gives 53 random bits.

The PyTorch path (CPU, and the reference) spells the hash as about 40 int64 tensor ops;
on CUDA one kernel computes it, bit for bit: the sampled tree builder draws Gumbel noise
over a pool row per expanded node and depth, inside the draft round's graph, and the
verifiers draw per node outside any graph, where each op is a launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.utils import INDEX_DTYPES, check_same_device, use_triton

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
BLOCK = 1024


def _signed(value: int) -> int:
    """``value`` mod 2^64 as an int64 (torch's int64 arithmetic wraps modulo 2^64)."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix_int(x: int) -> int:
    """The finaliser on one Python int (a stream's key, computed on the host)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's is arithmetic: mask the sign bits)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser over an int64 tensor."""
    z = x + _signed(GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _signed(MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(MIX2)
    return z ^ _shift_right(z, 31)


@triton.jit
def _mix(z):
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _counter_random_kernel(
    seeds, counters, out, stream_key, M,
    HALF: tl.constexpr, GUMBEL: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    seed = tl.load(seeds + r).to(tl.uint64, bitcast=True)
    # (A key that fits 32 bits arrives as an i32 argument: widen before the bitcast.)
    key = _mix(seed ^ stream_key.to(tl.int64).to(tl.uint64, bitcast=True))
    counter = tl.load(counters + r * M + offs, mask=mask, other=0).to(tl.uint64, bitcast=True)
    bits = _mix(key + (counter + 1) * 0x9E3779B97F4A7C15) >> 11
    u = (bits.to(tl.float64) + HALF) * 1.1102230246251565e-16  # 2^-53
    if GUMBEL:
        u = -tl.log(-tl.log(u))
    tl.store(out + r * M + offs, u, mask=mask)


def counter_uniform(
    seeds: torch.Tensor, stream: int, counters: torch.Tensor, open_interval: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Uniform numbers from (seed, stream, counter) hashes.

    Args:
        seeds: [R] int64, one per request.
        stream: small int naming the use, so different uses never share numbers.
        counters: [R, ...] int64, the draw's index within the request's stream.
        open_interval: draw from (0, 1) instead of [0, 1).
        backend: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"torch"`` or
            ``"triton"`` (see :func:`triton_ops.utils.use_triton`).

    Returns:
        [R, ...] float64, 53 random bits each.
    """
    return _counter_random(seeds, stream, counters, open_interval, False, backend)


def counter_gumbel(seeds: torch.Tensor, stream: int, counters: torch.Tensor,
                   backend: str = "auto") -> torch.Tensor:
    """Standard Gumbel noise, [R, ...] float64: ``-log(-log(u))`` of
    :func:`counter_uniform`'s open-interval draws."""
    return _counter_random(seeds, stream, counters, True, True, backend)


def _counter_random(seeds, stream, counters, open_interval, gumbel, backend):
    R = seeds.shape[0] if seeds.dim() == 1 else -1
    if seeds.dim() != 1 or seeds.dtype not in INDEX_DTYPES:
        raise ValueError(f"seeds must be an int32/int64 [R] tensor, got {seeds.dtype} "
                         f"{list(seeds.shape)}")
    if counters.dim() < 1 or counters.shape[0] != R or counters.dtype not in INDEX_DTYPES:
        raise ValueError(f"counters must be an int32/int64 [R={R}, ...] tensor, got "
                         f"{counters.dtype} {list(counters.shape)}")
    check_same_device("seeds", seeds, counters=counters)
    stream_key = _signed(_mix_int(stream))
    if not use_triton(backend, seeds):
        key = mix64(seeds.long() ^ stream_key).view(-1, *([1] * (counters.dim() - 1)))
        bits = _shift_right(mix64(key + (counters.long() + 1) * _signed(GOLDEN)), 11)
        u = (bits.double() + (0.5 if open_interval else 0.0)) * 2.0**-53
        return -torch.log(-torch.log(u)) if gumbel else u
    M = counters[0].numel() if R else 0
    flat = counters.long().reshape(R, M).contiguous()
    out = torch.empty(R, M, dtype=torch.float64, device=seeds.device)
    if R and M:
        _counter_random_kernel[(triton.cdiv(M, BLOCK), R)](
            seeds.long(), flat, out, stream_key, M,
            HALF=0.5 if open_interval else 0.0, GUMBEL=gumbel, BLOCK=BLOCK,
        )
    return out.view(counters.shape)
