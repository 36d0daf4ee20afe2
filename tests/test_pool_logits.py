"""pool_logits_log_softmax: Triton (interpreted on CPU) and torch paths vs the float64 reference."""

import math

import pytest
import torch

from triton_ops.pool_logits import naive_pool_logits_log_softmax, pool_logits_log_softmax
from triton_ops.testing import rel_err

# (R, w, P, D, V): P and D off powers of two, w = 1, a pool wider than one
# kernel tile, a query wider than one width tile (MAX_BLOCK_D), a single-entry pool.
SHAPES = [
    (1, 2, 9, 2100, 30),
    (1, 1, 1, 8, 5),
    (1, 1, 16, 32, 300),
    (2, 3, 13, 24, 50),
    (3, 1, 37, 40, 97),
    (2, 4, 70, 33, 200),
    (1, 2, 130, 136, 400),
]


def _inputs(shape, gen, dtype=torch.float32):
    rows, width, pool, dim, vocab = shape
    y = torch.randn(rows, width, dim, generator=gen).to(dtype)
    table = (torch.randn(vocab, dim, generator=gen) / math.sqrt(dim)).to(dtype)
    ids = torch.randint(0, vocab, (rows, width, pool), generator=gen)
    scores = 3.0 * torch.randn(rows, width, pool, generator=gen)
    return y, table, ids, scores


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference(backend, shape, gen):
    y, table, ids, scores = _inputs(shape, gen)
    out = torch.full(ids.shape, float("nan"))
    got = pool_logits_log_softmax(y, table, ids, scores, backend=backend, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.float32
    ref = naive_pool_logits_log_softmax(y, table, ids, scores)
    err = rel_err(got, ref)
    assert err < 2e-6, f"relative error {err:.2e}"
    # Each row is a distribution over its pool.
    sums = got.double().exp().sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)


def test_triton_equals_torch_on_noncontiguous_and_bf16_table(gen):
    y, table, ids, scores = _inputs((2, 3, 21, 48, 120), gen)
    # Strided views: the launcher must not assume contiguity.
    y_nc = torch.cat([y, y], dim=-1)[..., ::2]
    scores_nc = torch.cat([scores, scores], dim=-1)[..., ::2]
    a = pool_logits_log_softmax(y_nc, table, ids, scores_nc, backend="triton")
    b = pool_logits_log_softmax(y_nc, table, ids, scores_nc, backend="torch")
    ref = naive_pool_logits_log_softmax(y_nc, table, ids, scores_nc)
    assert rel_err(a, ref) < 2e-6 and rel_err(b, ref) < 2e-6
    # The torch path takes a bf16 table (the serving dtype) and accumulates in fp32.
    t16 = table.bfloat16()
    c = pool_logits_log_softmax(y_nc.bfloat16(), t16, ids, scores_nc, backend="torch")
    ref16 = naive_pool_logits_log_softmax(y_nc.bfloat16(), t16, ids, scores_nc)
    assert rel_err(c, ref16) < 1e-5


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_pool_rows_pick_each_querys_pool(backend, gen):
    # Per-request pools [R, D, P]; each query names its row, -1 = no pool (-inf row).
    R, w, D, P, width, vocab = 3, 4, 5, 37, 24, 90
    y, table, _, _ = _inputs((R, w, P, width, vocab), gen)
    ids = torch.randint(0, vocab, (R, D, P), generator=gen)
    scores = 3.0 * torch.randn(R, D, P, generator=gen)
    pool_rows = torch.randint(-1, D, (R, w), generator=gen)
    pool_rows[0, 0], pool_rows[0, 1] = -1, D - 1
    out = torch.full((R, w, P), float("nan"))
    got = pool_logits_log_softmax(y, table, ids, scores, pool_rows=pool_rows, backend=backend,
                                  out=out)
    batch = torch.arange(R)[:, None]
    picked = pool_rows.clamp(min=0)
    ref = naive_pool_logits_log_softmax(y, table, ids[batch, picked], scores[batch, picked])
    has_pool = pool_rows >= 0
    assert rel_err(got[has_pool], ref[has_pool]) < 2e-6
    assert torch.isneginf(got[~has_pool]).all()
    with pytest.raises(ValueError, match="pool_rows must be int64"):
        pool_logits_log_softmax(y, table, ids, scores, pool_rows=pool_rows.int(), backend=backend)


def test_repeated_ids_and_extreme_scores(gen):
    # Repeated candidates are allowed; one dominant score must not overflow.
    y, table, ids, scores = _inputs((2, 2, 9, 16, 4), gen)
    scores[0, 0, 3] = 1e4
    scores[1, 1] = -1e4
    for backend in ("triton", "torch"):
        got = pool_logits_log_softmax(y, table, ids, scores, backend=backend)
        ref = naive_pool_logits_log_softmax(y, table, ids, scores)
        assert torch.isfinite(got[1]).all()
        assert (got.double() - ref).abs().max().item() < 1e-3


def test_empty_rows(gen):
    y, table, ids, scores = _inputs((0, 3, 5, 8, 10), gen)
    assert pool_logits_log_softmax(y, table, ids, scores, backend="triton").shape == (0, 3, 5)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(backend="cuda"), "backend"),
        (lambda a: a.update(ids=a["ids"].int()), "ids must be an int64"),
        (lambda a: a.update(scores=a["scores"][..., :-1]), "scores must have the shape"),
        (lambda a: a.update(table=a["table"][:, :-1]), "table width"),
        (lambda a: a.update(y=a["y"][0]), "y must be"),
        (lambda a: a.update(ids=a["ids"][..., :0], scores=a["scores"][..., :0]), "P >= 1"),
        (lambda a: a.update(out=torch.empty(1, 2, 3)), "out must be"),
        (lambda a: a.update(out=torch.empty(1, 6, 2).transpose(1, 2)), "out must be contiguous"),
    ],
)
def test_rejects_bad_arguments(mutate, match, gen):
    y, table, ids, scores = _inputs((1, 2, 6, 8, 10), gen)
    args = dict(y=y, table=table, ids=ids, scores=scores, backend="torch", out=None)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        pool_logits_log_softmax(
            args["y"], args["table"], args["ids"], args["scores"],
            backend=args["backend"], out=args["out"],
        )


def test_triton_without_the_interpreter_refuses_cpu_tensors(gen, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors.*TRITON_INTERPRET=1"):
        pool_logits_log_softmax(*_inputs((1, 2, 6, 8, 10), gen), backend="triton")
