"""The GDN node gates (g, beta) in one launch against their float64 definition."""

from __future__ import annotations

import pytest
import torch

from triton_ops.gdn_tree import gdn_gating

BACKENDS = ("torch", "triton")
# (leading dims, HV): edge shapes (one node, one head, heads not a power of two, rows
# not a multiple of the kernel's row block) and the engine's (Qwen3.6-27B: HV = 48).
SHAPES = [((1,), 1), ((1, 1), 5), ((3, 7), 4), ((2, 17), 48), ((1, 65), 48), ((8, 17), 48),
          ((5, 33), 6), ((40,), 3)]


def reference(a, b, A_log, dt_bias):
    """The definition in float64 (softplus's threshold has no float64 effect below 20)."""
    x = a.double() + dt_bias.double()
    return (-torch.exp(A_log.double()) * torch.nn.functional.softplus(x),
            torch.sigmoid(b.double()))


def strided_rows(values: torch.Tensor) -> torch.Tensor:
    """``values`` [..., HV] as the engine hands them over: the odd columns of a wider buffer
    (vLLM splits a and b out of one projection), so rows and heads are both strided."""
    wide = torch.full((*values.shape[:-1], 2 * values.shape[-1]), float("nan"),
                      dtype=values.dtype)
    wide[..., 1::2] = values
    return wide[..., 1::2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("lead", "HV"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates_match_the_float64_definition(backend, lead, HV, dtype, gen):
    # a spans softplus's regimes: deep underflow (-40), 1 + exp(-|x|) rounding to 1, the
    # logarithm, past the threshold.
    a = strided_rows((torch.randn(*lead, HV, generator=gen) * 15).to(dtype))
    b = strided_rows((torch.randn(*lead, HV, generator=gen) * 6).to(dtype))
    A_log = torch.randn(HV, generator=gen).to(dtype)
    dt_bias = torch.randn(HV, generator=gen).to(dtype)
    poisoned = (torch.full((*lead, HV), float("nan")), torch.full((*lead, HV), float("nan")))
    g, beta = gdn_gating(a, b, A_log, dt_bias, backend=backend, out=poisoned)
    assert g is poisoned[0] and beta is poisoned[1]
    want_g, want_beta = reference(a, b, A_log, dt_bias)
    assert torch.isfinite(g).all() and torch.isfinite(beta).all()
    # fp32 arithmetic on exact inputs: a few ulps of the result, plus exp's
    # absolute rounding where softplus is tiny.
    torch.testing.assert_close(g.double(), want_g, rtol=2e-6, atol=1e-12)
    torch.testing.assert_close(beta.double(), want_beta, rtol=2e-6, atol=1e-12)


def test_every_softplus_regime_at_its_edges():
    """Values where 1 + exp(-|x|) rounds to 1 (|x| > 16.6), near 0, at the threshold 20, and
    far past either side, through the kernel."""
    edges = torch.tensor([-100.0, -40.0, -16.7, -16.6, -4.6, -1e-3, 0.0, 1e-3, 4.6, 16.6,
                          16.7, 19.999, 20.0, 20.001, 40.0, 88.0])
    a = edges.view(-1, 1).expand(-1, 3).contiguous()
    b = a.clone()
    zeros = torch.zeros(3)
    g, beta = gdn_gating(a, b, zeros, zeros, backend="triton")
    want_g, want_beta = reference(a, b, zeros, zeros)
    torch.testing.assert_close(g.double(), want_g, rtol=2e-6, atol=1e-12)
    torch.testing.assert_close(beta.double(), want_beta, rtol=2e-6, atol=1e-12)


def test_empty_batches_and_bad_arguments():
    empty = torch.zeros(0, 4)
    g, beta = gdn_gating(empty, empty, torch.zeros(4), torch.zeros(4), backend="triton")
    assert g.shape == (0, 4) and beta.shape == (0, 4)
    a = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="a and b must share one shape"):
        gdn_gating(a, torch.zeros(2, 5), torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match=r"A_log must be \[HV=4\]"):
        gdn_gating(a, a, torch.zeros(5), torch.zeros(4))
    with pytest.raises(ValueError, match="dt_bias must be one of"):
        gdn_gating(a, a, torch.zeros(4), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must hold contiguous tensors"):
        gdn_gating(a, a, torch.zeros(4), torch.zeros(4),
                   out=(torch.zeros(4, 2).t(), torch.zeros(2, 4)))
