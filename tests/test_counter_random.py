"""triton_ops.counter_random: both backends give SplitMix64's bits, spelled out here with
Python integers, for any seeds, streams and counter shapes."""

import math

import pytest
import torch

from triton_ops.counter_random import counter_gumbel, counter_uniform

MASK = (1 << 64) - 1


def splitmix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference_uniform(seed: int, stream: int, counter: int, open_interval: bool) -> float:
    key = splitmix((seed & MASK) ^ splitmix(stream))
    bits = splitmix((key + ((counter + 1) & MASK) * 0x9E3779B97F4A7C15) & MASK) >> 11
    return (bits + (0.5 if open_interval else 0.0)) * 2.0**-53


def random_inputs(gen, shape, dtype):
    seeds = torch.randint(-(1 << 62), 1 << 62, (shape[0],), generator=gen)
    seeds[0] = -1  # all bits set
    counters = torch.randint(-(1 << 31), 1 << 31, shape, generator=gen)
    return seeds.to(dtype), counters.to(dtype)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (2, 1500), (4, 3, 7), (5,)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("open_interval", [False, True])
def test_uniforms_are_splitmix_bits(backend, shape, dtype, open_interval, gen):
    seeds, counters = random_inputs(gen, shape, dtype)
    stream = int(torch.randint(0, 1000, (1,), generator=gen))
    got = counter_uniform(seeds, stream, counters, open_interval, backend=backend)
    assert got.dtype == torch.float64 and got.shape == counters.shape
    indices = torch.cartesian_prod(*map(torch.arange, shape)).view(-1, len(shape))
    want = [reference_uniform(int(seeds[row[0]]), stream, int(counters[row]), open_interval)
            for row in map(tuple, indices)]
    assert got.flatten().tolist() == want
    low = (got > 0) if open_interval else (got >= 0)
    assert low.all() and (got < 1).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gumbel_is_minus_log_minus_log_of_the_open_uniforms(backend, gen):
    seeds, counters = random_inputs(gen, (3, 40), torch.int64)
    got = counter_gumbel(seeds, 9, counters, backend=backend)
    uniforms = counter_uniform(seeds, 9, counters, open_interval=True, backend="torch")
    want = [-math.log(-math.log(u)) for u in uniforms.flatten().tolist()]
    want = torch.tensor(want, dtype=torch.float64)
    assert torch.allclose(got.flatten(), want, rtol=1e-15, atol=0)


def test_strided_counters_and_empty_batches(gen):
    seeds = torch.tensor([7, 8], dtype=torch.int64)
    counters = torch.arange(6).expand(2, -1)  # stride 0 over requests
    assert torch.equal(counter_uniform(seeds, 1, counters, backend="triton"),
                       counter_uniform(seeds, 1, counters, backend="torch"))
    assert counter_uniform(seeds, 1, torch.zeros(2, 0, dtype=torch.int64),
                           backend="triton").shape == (2, 0)
    assert counter_uniform(seeds[:0], 1, torch.zeros(0, 3, dtype=torch.int64),
                           backend="triton").shape == (0, 3)


def test_bad_arguments_name_the_field():
    seeds = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="seeds must be"):
        counter_uniform(seeds.double(), 1, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="seeds must be"):
        counter_uniform(seeds[None], 1, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="counters must be"):
        counter_uniform(seeds, 1, torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="counters must be"):
        counter_gumbel(seeds, 1, torch.zeros(2, 3))
