"""V2's request-level sampling on tree nodes (vllm_glue/v2/node_processing.py, verify.py).

The reference is model runner V2's own code: vLLM's V2 sampler modules (the same kernels in
0.32.0, installed here, as in 0.33.0) re-executed with the real Triton (vLLM disables it on
CPU) under the interpreter, host buffers in place of pinned ones. Its real ``Sampler``, with
per-slot state filled by its own ``add_request``, processes each tree node's path laid out as
a chain (V2's ``apply_sampling_params``, the chain rejection sampler's call); our node rows
must equal its last row, and the tree verifiers must reproduce the distributions it gives.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from host_reads import HostRead, no_host_reads

from vllm_tfm.drafting.draft_round import candidate_pools, draft_trees

_V2_MODULES = (
    "buffer_utils", "input_batch", "metrics.logits", "sample.gumbel", "sample.min_p", "sample.penalties",
    "sample.bad_words", "sample.logit_bias", "sample.logprob", "sample.states",
    "sample.thinking_budget", "sample.sampler",
)
VOCAB, MAX_LEN, SLOTS = 48, 40, 6


class _HostUvaBuffer:
    """V2's UvaBuffer (pinned host memory seen by the GPU) on a CPU: the host tensor."""

    def __init__(self, size, dtype):
        self.cpu = torch.zeros(size, dtype=dtype)
        self.np = self.cpu.numpy()

    def uva(self, n=None):
        return self.cpu if n is None else self.cpu[:n]


@pytest.fixture(scope="module")
def v2():
    """V2's sampler modules with real Triton, in sys.modules while this module's tests run
    (the code under test imports them lazily)."""
    import triton

    # Imported first, with vLLM's CPU view of Triton: top-k / top-p take its torch path
    # (the same op for the code under test and the reference).
    import vllm.v1.sample.ops.topk_topp_sampler  # noqa: F401

    shim = types.ModuleType("vllm.triton_utils")
    shim.triton, shim.tl, shim.HAS_TRITON = triton, triton.language, True
    names = [f"vllm.v1.worker.gpu.{name}" for name in _V2_MODULES]
    saved = {name: sys.modules.get(name) for name in ["vllm.triton_utils", *names]}
    sys.modules["vllm.triton_utils"] = shim
    loaded = {}
    try:
        for name in names:
            spec = importlib.util.find_spec(name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            if name.endswith("buffer_utils"):
                module.UvaBuffer = _HostUvaBuffer
            loaded[name.rsplit(".", 1)[1]] = module
        sys.modules["vllm.triton_utils"] = saved["vllm.triton_utils"]
        yield SimpleNamespace(**loaded)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _sampler(v2, logprobs_mode="raw_logprobs"):
    buffers = v2.buffer_utils
    cpu = torch.device("cpu")
    requests = SimpleNamespace(
        device=cpu, max_num_reqs=SLOTS, vocab_size=VOCAB,
        all_token_ids=buffers.StagedWriteTensor((SLOTS, MAX_LEN), torch.int32, cpu),
        prompt_len=buffers.UvaBackedTensor(SLOTS, torch.int32),
        prefill_len=buffers.UvaBackedTensor(SLOTS, torch.int32),
        total_len=buffers.StagedWriteTensor(SLOTS, torch.int32, cpu))
    sampler = v2.sampler.Sampler(SimpleNamespace(reasoning_config=None), SLOTS, VOCAB, cpu,
                                 requests, logprobs_mode=logprobs_mode)
    return sampler, requests


def _add(sampler, requests, slot, prompt, output, params):
    """A request in ``slot`` whose committed tokens are ``prompt`` + ``output``."""
    tokens = list(prompt) + list(output)
    requests.all_token_ids.gpu[slot].zero_()
    requests.all_token_ids.gpu[slot, : len(tokens)] = torch.tensor(tokens)
    requests.prompt_len.np[slot] = len(prompt)
    requests.prefill_len.np[slot] = len(tokens)  # the output is counted by bincount
    requests.prompt_len.copy_to_uva()
    requests.prefill_len.copy_to_uva()
    requests.total_len.gpu[slot] = len(tokens)
    sampler.add_request(slot, params)
    sampler.apply_staged_writes()


def _random_params(generator, prompt, output):
    from vllm import SamplingParams

    def pick(*values):
        return values[int(torch.randint(len(values), (1,), generator=generator))]

    history = list(prompt) + list(output)
    bad = [[history[-1], pick(*range(VOCAB))], [pick(*range(VOCAB))],
           [pick(*history), pick(*history), pick(*range(VOCAB))]]
    params = dict(
        temperature=pick(0.0, 0.7, 1.0, 1.3), top_k=pick(-1, 5, 20), top_p=pick(1.0, 0.9, 0.6),
        min_p=pick(0.0, 0.05), repetition_penalty=pick(1.0, 1.3, 0.8),
        frequency_penalty=pick(0.0, 0.4), presence_penalty=pick(0.0, 0.6, -0.3),
        min_tokens=pick(0, len(output) + 2), stop_token_ids=[pick(*range(VOCAB)), 3],
        bad_words=None, seed=int(torch.randint(1 << 20, (1,), generator=generator)))
    if pick(False, True):
        params["logit_bias"] = {pick(*range(VOCAB)): 2.5, 7: -1.0}
    if pick(False, False, True):
        params["allowed_token_ids"] = sorted({pick(*range(VOCAB)) for _ in range(12)})
    sampling = SamplingParams(**params)
    # bad_words are text; V2 reads the token ids the frontend derives from them.
    sampling._bad_words_token_ids = pick(None, bad)
    return sampling


def _batch(v2, generator, num_reqs, budget=6, depth=3, logprobs_mode="raw_logprobs"):
    """A V2 sampler holding ``num_reqs`` random requests, their trees, raw node logits and
    root positions."""
    sampler, requests = _sampler(v2, logprobs_mode)
    slots = torch.randperm(SLOTS, generator=generator)[:num_reqs].to(torch.int32)
    prefix = []
    for slot in slots.tolist():
        prompt = torch.randint(VOCAB, (int(torch.randint(2, 8, (1,), generator=generator)),),
                               generator=generator).tolist()
        output = torch.randint(VOCAB, (int(torch.randint(1, 6, (1,), generator=generator)),),
                               generator=generator).tolist()
        _add(sampler, requests, slot, prompt, output, _random_params(generator, prompt, output))
        prefix.append(len(prompt) + len(output) - 1)  # the root: the last output token
    roots = requests.all_token_ids.gpu[slots.long(), torch.tensor(prefix)].long()
    # Small pools over a small vocabulary: paths repeat prompt and output tokens.
    pools = candidate_pools(torch.randn(num_reqs, depth, VOCAB, generator=generator), 3)
    tree = draft_trees("ddtree", roots, pools, budget, validate=True)
    raw = torch.randn(num_reqs, tree.max_nodes, VOCAB, generator=generator) * 3
    return sampler, requests, slots, tree, raw, torch.tensor(prefix, dtype=torch.int32)


def _chain_reference(sampler, tree, raw, slots, prefix):
    """[R, N, V] each node's row as V2 processes it at the end of a chain holding the
    node's path (V2's apply_sampling_params over one chain per node)."""
    rows, width = tree.tokens.shape
    logits, local, inputs, owners, positions, last = [], [], [], [], [], []
    for r in range(rows):
        parents, tokens = tree.parents[r].tolist(), tree.tokens[r].tolist()
        for j in range(width):
            path = [j]
            while path[-1] > 0:
                path.append(parents[path[-1]])
            path = path[::-1]  # root .. j
            for k, node in enumerate(path):
                logits.append(raw[r, node])
                local.append(k)
                inputs.append(tokens[node])
                owners.append(int(slots[r]))
                positions.append(int(prefix[r]) + k)
            last.append(len(logits) - 1)
    owners = torch.tensor(owners, dtype=torch.int32)
    processed = sampler.apply_sampling_params(
        torch.stack(logits), owners, slots, slots.numpy(), torch.tensor(positions),
        torch.tensor(inputs), torch.tensor(local, dtype=torch.int32),
        np.full(rows, MAX_LEN))
    return processed[torch.tensor(last)].view(rows, width, -1)


@pytest.mark.parametrize("num_reqs", [1, 3, 5])
@pytest.mark.parametrize("case", range(3))
def test_node_rows_equal_v2s_processing_of_each_nodes_path(v2, gen, num_reqs, case):
    from vllm_tfm.vllm_glue.v2.node_processing import process_node_rows

    sampler, _, slots, tree, raw, prefix = _batch(v2, gen, num_reqs)
    ours = process_node_rows(sampler, raw.flatten(0, 1).clone(), tree, prefix, slots,
                             slots.numpy())
    expected = _chain_reference(sampler, tree, raw, slots, prefix)
    ours = ours.view_as(raw)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


def test_path_tokens_list_each_nodes_drafts_newest_first():
    from vllm_tfm.drafting.tree import DraftTree
    from vllm_tfm.vllm_glue.v2.node_processing import path_tokens

    # root 9 -> 4 -> (5 -> 7), 6; one padding column.
    tree = DraftTree(tokens=torch.tensor([[9, 4, 5, 6, 7, 0]]),
                     parents=torch.tensor([[-1, 0, 1, 1, 2, -1]], dtype=torch.int32),
                     depths=torch.tensor([[0, 1, 2, 2, 3, 0]], dtype=torch.int32),
                     num_nodes=torch.tensor([5], dtype=torch.int32),
                     draft_logq=torch.zeros(1, 6), max_depth=3)
    assert path_tokens(tree)[0].tolist() == [
        [-1, -1, -1], [4, -1, -1], [5, 4, -1], [6, 4, -1], [7, 5, 4], [-1, -1, -1]]


def test_a_batch_needing_no_processing_keeps_its_logits(v2, gen):
    from vllm import SamplingParams

    from vllm_tfm.vllm_glue.v2.node_processing import process_node_rows

    sampler, requests, slots, tree, raw, prefix = _batch(v2, gen, 2)
    for slot in slots.tolist():
        _add(sampler, requests, slot, [1, 2], [3], SamplingParams(temperature=1.0, top_k=-1))
    flat = raw.flatten(0, 1)
    assert process_node_rows(sampler, flat, tree, prefix, slots, slots.numpy()) is flat


def _law_of_target_only(tree, probs, row=0):
    """{output tokens: probability} of target-only verification of a deterministic tree:
    the path to node v is accepted with the product of its tokens' probabilities, then the
    bonus is any token that is not one of v's children (which would extend the path)."""
    parents, tokens = tree.parents[row].tolist(), tree.tokens[row].tolist()
    count = int(tree.num_nodes[row])
    law, reach, paths = {}, {0: 1.0}, {0: ()}
    for v in range(count):
        if v > 0:
            reach[v] = reach[parents[v]] * float(probs[parents[v], tokens[v]])
            paths[v] = paths[parents[v]] + (tokens[v],)
        children = {tokens[c] for c in range(1, count) if parents[c] == v}
        for x in range(probs.shape[-1]):
            if x not in children and probs[v, x] > 0:
                law[paths[v] + (x,)] = reach[v] * float(probs[v, x])
    return law


def test_tree_verification_samples_v2s_distribution_at_every_node(v2, gen):
    from vllm import SamplingParams

    from vllm_tfm.vllm_glue.v2.node_processing import process_node_rows
    from vllm_tfm.vllm_glue.v2.verify import verify_batch

    sampler, requests, slots, tree, raw, prefix = _batch(v2, gen, 1, budget=4, depth=2)
    raw /= 3  # flat rows: many outputs, each with a visible probability
    slot = int(slots[0])
    history = requests.all_token_ids.gpu[slot, : int(prefix[0]) + 1].tolist()
    _add(sampler, requests, slot, history[:2], history[2:],
         SamplingParams(temperature=0.8, top_k=6, top_p=0.9, repetition_penalty=1.4,
                        presence_penalty=0.5, seed=5))
    processed = process_node_rows(sampler, raw.flatten(0, 1).clone(), tree, prefix, slots,
                                  slots.numpy()).view_as(raw)
    exact = _law_of_target_only(
        tree, torch.softmax(_chain_reference(sampler, tree, raw, slots, prefix)[0].double(), -1))
    draws = 20000
    many = tree.select(torch.zeros(draws, dtype=torch.long))
    result = verify_batch(many, processed.expand(draws, -1, -1), np.full(draws, 0.8),
                          np.zeros(draws, dtype=bool), torch.arange(draws) * 7919 + 11, "auto")
    seen: dict[tuple, int] = {}
    for out in result.output_tokens.tolist():
        key = tuple(t for t in out if t >= 0)
        seen[key] = seen.get(key, 0) + 1
    assert set(seen) <= set(exact), "an output plain decoding cannot produce"
    distance = 0.5 * sum(abs(seen.get(k, 0) / draws - p) for k, p in exact.items())
    assert distance < 0.03, distance


def test_greedy_with_penalties_follows_v2s_argmax_along_the_tree(v2, gen):
    from vllm import SamplingParams

    from vllm_tfm.vllm_glue.v2.node_processing import process_node_rows
    from vllm_tfm.vllm_glue.v2.verify import verify_batch

    sampler, requests, slots, tree, raw, prefix = _batch(v2, gen, 3)
    for r, slot in enumerate(slots.tolist()):
        history = requests.all_token_ids.gpu[slot, : int(prefix[r]) + 1].tolist()
        _add(sampler, requests, slot, history[:1], history[1:],
             SamplingParams(temperature=0.0, repetition_penalty=1.8, presence_penalty=1.5,
                            frequency_penalty=0.7))
    # Every drafted node is its parent's best token once penalised, but its own row holds
    # its own token higher still: only the path's counts (the node is on its own path)
    # push that repeat below the next node.
    for r in range(tree.batch_size):
        for j in range(1, int(tree.num_nodes[r])):
            raw[r, tree.parents[r, j], tree.tokens[r, j]] += 8.0 + j
            raw[r, j, tree.tokens[r, j]] += 16.0
    processed = process_node_rows(sampler, raw.flatten(0, 1).clone(), tree, prefix, slots,
                                  slots.numpy()).view_as(raw)
    result = verify_batch(tree, processed, np.zeros(3), np.zeros(3, dtype=bool), torch.arange(3),
                          "auto")
    expected = _chain_reference(sampler, tree, raw, slots, prefix)
    for r in range(tree.batch_size):
        node, out = 0, []
        while True:  # plain greedy decoding, with V2's processing, along the tree
            token = int(expected[r, node].argmax())
            out.append(token)
            children = [c for c in range(1, int(tree.num_nodes[r]))
                        if int(tree.parents[r, c]) == node and int(tree.tokens[r, c]) == token]
            if not children:
                break
            node = children[0]
        assert result.output_tokens[r, : len(out)].tolist() == out
        assert int(result.accepted_len[r]) == len(out) - 1


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits"])
def test_path_logprobs_score_each_output_token_at_its_path_node(v2, gen, mode):
    from vllm_tfm.vllm_glue.v2.verify import path_logprobs

    rows, width, num_logprobs = 3, 5, 2
    nodes = torch.randn(rows, width, VOCAB, generator=gen)
    path = torch.tensor([[0, 2, 3, -1, -1], [0, -1, -1, -1, -1], [0, 1, 2, 4, -1]])
    sampled = torch.tensor([[5, 6, 7, -1, -1], [8, -1, -1, -1, -1], [1, 2, 3, 4, -1]])
    num_sampled = torch.tensor([3, 0, 4])  # request 1: a prompt chunk, nothing sampled
    num_rows = [5, 1, 5]
    cu_np = np.concatenate([[0], np.cumsum(num_rows)]).astype(np.int32)
    out = path_logprobs(nodes, path, sampled, num_sampled, torch.from_numpy(cu_np), cu_np,
                        num_logprobs, logits_mode=mode == "raw_logits")
    assert out.cu_num_generated_tokens == cu_np.tolist()
    assert out.logprobs.shape == (int(cu_np[-1]), 1 + num_logprobs)
    for r in range(rows):
        for k in range(int(num_sampled[r])):
            row = int(cu_np[r]) + k
            logits = nodes[r, int(path[r, k])].double()
            scores = logits if mode == "raw_logits" else torch.log_softmax(logits, -1)
            token = int(sampled[r, k])
            assert int(out.logprob_token_ids[row, 0]) == token
            top = torch.topk(logits, num_logprobs).indices
            assert out.logprob_token_ids[row, 1:].tolist() == top.tolist()
            expected = scores[torch.cat([torch.tensor([token]), top])].float()
            torch.testing.assert_close(out.logprobs[row], expected, rtol=1e-5, atol=1e-5)
            assert int(out.selected_token_ranks[row]) == int((logits >= logits[token]).sum())


def _tree_decode_step(tree, slots, prefix, sampled=None):
    """(slot trees, step, model state, V2 input batch) of a decode step scoring every node
    of ``tree``, kept in ``slots``, roots at ``prefix``: what TreeRejectionSampler reads.
    ``sampled`` [R] bool: the rows of a sampled ``tree`` whose trees are sampled."""
    from vllm_tfm.vllm_glue.v2.trees import SlotTrees

    rows, width = tree.tokens.shape
    pools = None if sampled is None else tuple(tree.pool_ids.shape[1:])
    store = SlotTrees.allocate(SLOTS, width, tree.max_depth, torch.device("cpu"), pools)
    store.store(slots, tree)
    if sampled is not None:
        store.sampled[slots.numpy()] = sampled
    num_nodes = torch.full((rows,), width, dtype=torch.int32)
    step = SimpleNamespace(meta=SimpleNamespace(num_nodes=num_nodes), prefix_lens=prefix,
                           num_nodes_host=num_nodes.numpy().astype(np.int64), accepted_leaf=None)
    state = SimpleNamespace(engine=SimpleNamespace(step=step, trees=store, verify="auto"),
                            num_nodes=width)
    cu = np.arange(rows + 1, dtype=np.int32) * width
    batch = SimpleNamespace(
        num_reqs=rows, idx_mapping=slots, idx_mapping_np=slots.numpy(),
        cu_num_logits=torch.from_numpy(cu), cu_num_logits_np=cu,
        seq_lens=(prefix + width).to(torch.int32))
    return store, step, state, batch


@pytest.mark.parametrize("chunk_requests", [None, 1, 2])
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_tree_rejection_sampler_verifies_processed_nodes_and_returns_path_logprobs(
        v2, gen, monkeypatch, mode, chunk_requests):
    # The processed rows become the probabilities in place unless the logprobs read them.
    # chunk_requests: requests verified at a time (None: the whole batch at once).
    from vllm_tfm.vllm_glue.v2 import model_state
    from vllm_tfm.vllm_glue.v2.verify import sampled_tokens, step_seeds, verify_batch

    monkeypatch.setattr(model_state, "get_num_sampled_and_rejected",
                        v2.input_batch.get_num_sampled_and_rejected)
    sampler, _, slots, tree, raw, prefix = _batch(v2, gen, 3, logprobs_mode=mode)
    sampler.sampling_states.num_logprobs[int(slots[1])] = 2
    rows, width = tree.tokens.shape
    if chunk_requests is not None:
        monkeypatch.setattr(model_state, "VERIFY_CHUNK_BYTES",
                            chunk_requests * 4 * width * raw.shape[-1])
        assert len(model_state.request_chunks(rows, width, raw.shape[-1])) == -(-rows // chunk_requests)
    store, step, state, batch = _tree_decode_step(tree, slots, prefix)
    out = model_state.TreeRejectionSampler(state, sampler)(raw.flatten(0, 1), batch)

    stored = store.gather(slots)
    reference_rows = _chain_reference(sampler, stored, raw, slots, prefix)
    expected = verify_batch(
        stored, reference_rows.clone(),
        sampler.sampling_states.temperature.np[slots.numpy()], np.zeros(rows, dtype=bool),
        step_seeds(sampler.sampling_states.seeds.gpu[slots], prefix), "auto")
    assert torch.equal(out.sampled_token_ids, sampled_tokens(expected, width))
    assert torch.equal(step.accepted_leaf, expected.accepted_leaf)
    assert out.num_sampled.tolist() == (expected.accepted_len + 1).tolist()
    assert out.num_rejected.tolist() == (width - 1 - expected.accepted_len).tolist()
    logprobs = out.logprobs_tensors
    assert logprobs.logprobs.shape == (rows * width, 3)
    scored = raw if mode == "raw_logprobs" else reference_rows
    for k in range(int(expected.accepted_len[1]) + 1):
        node = int(expected.path[1, k])
        token = int(out.sampled_token_ids[1, k])
        row = width + k
        assert int(logprobs.logprob_token_ids[row, 0]) == token
        reference = torch.log_softmax(scored[1, node].double(), -1)[token].float()
        torch.testing.assert_close(logprobs.logprobs[row, 0], reference, rtol=1e-5, atol=1e-5)


def test_unknown_logits_processors_are_refused_by_name(v2):
    from vllm_tfm.vllm_glue.v2.node_processing import check_processors

    sampler, _ = _sampler(v2)
    check_processors(sampler)
    sampler.logits_processors.append(SimpleNamespace())
    with pytest.raises(ValueError, match="SimpleNamespace"):
        check_processors(sampler)



def _greedy():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0)


def _sampled_with_every_processor():
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=0.2, seed=3)
    params._bad_words_token_ids = [[1, 2], [4]]
    return params


def _verify_reading_nothing_back(sampler, tree, raw, slots, prefix, monkeypatch,
                                 sampled=None):
    """(sampler output, step) of TreeRejectionSampler over a decode step of ``tree`` (kept
    in ``slots``; ``sampled`` as in ``_tree_decode_step``) whose drafts the target likes
    (paths get accepted), run under ``no_host_reads``."""
    from vllm_tfm.vllm_glue.v2 import model_state

    def num_sampled_and_rejected(num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill):
        # V2's Triton kernel, for a batch of decodes (no prompt chunk among them).
        return num_sampled, cu_num_logits.diff() - num_sampled

    monkeypatch.setattr(model_state, "get_num_sampled_and_rejected", num_sampled_and_rejected)
    for r in range(tree.batch_size):
        for j in range(1, int(tree.num_nodes[r])):
            raw[r, tree.parents[r, j], tree.tokens[r, j]] += 4.0
    _, step, state, batch = _tree_decode_step(tree, slots, prefix, sampled)
    verify = model_state.TreeRejectionSampler(state, sampler)
    with no_host_reads():
        with pytest.raises(HostRead, match="__bool__"):
            tree.validate()  # the guard is live
        out = verify(raw.flatten(0, 1), batch)
    return out, step


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("params", [_greedy, _sampled_with_every_processor])
def test_tree_verification_reads_nothing_back_from_the_device(v2, gen, monkeypatch, params,
                                                              chunked):
    """V2's tree rejection sampler makes no host read (no_host_reads: each would be a
    device sync on CUDA) over a greedy batch, nor over a sampled one running every
    processor of V2's sampler, whole or a request group at a time (``chunked``: groups of
    three and one); its paths are the reference verifier's."""
    from vllm_tfm.vllm_glue.v2 import model_state
    from vllm_tfm.vllm_glue.v2.verify import step_seeds, verify_batch

    sampler, requests, slots, tree, raw, prefix = _batch(v2, gen, 4)
    if chunked:
        monkeypatch.setattr(model_state, "VERIFY_CHUNK_BYTES",
                            3 * 4 * tree.max_nodes * raw.shape[-1])
    for r, slot in enumerate(slots.tolist()):
        history = requests.all_token_ids.gpu[slot, : int(prefix[r]) + 1].tolist()
        _add(sampler, requests, slot, history[:1], history[1:], params())
    out, step = _verify_reading_nothing_back(sampler, tree, raw, slots, prefix, monkeypatch)

    states = sampler.sampling_states
    expected = verify_batch(tree, _chain_reference(sampler, tree, raw, slots, prefix),
                            states.temperature.np[slots.numpy()],
                            np.zeros(tree.batch_size, dtype=bool),
                            step_seeds(states.seeds.gpu[slots], prefix), "auto")
    assert torch.equal(step.accepted_leaf, expected.accepted_leaf)
    assert out.num_sampled.tolist() == (expected.accepted_len + 1).tolist()


def test_sampled_trees_are_verified_by_traversal_reading_nothing_back(v2, gen, monkeypatch):
    """A batch whose slots hold sampled trees (as a V2 sampling round leaves them): the
    rejection sampler verifies those rows by traversal, the greedy row greedily and the
    deterministic sampled row target-only, with no host read."""
    import dataclasses

    from vllm import SamplingParams

    from vllm_tfm.drafting.draft_round import draft_trees_per_request
    from vllm_tfm.drafting.verifiers import verify_greedy, verify_target_only, verify_traversal
    from vllm_tfm.vllm_glue.v2.verify import sampled_tokens, step_seeds, verify_batch

    sampler, requests, slots, plain, raw, prefix = _batch(v2, gen, 4)
    temperatures = [0.0, 1.0, 0.7, 1.3]
    for r, slot in enumerate(slots.tolist()):
        history = requests.all_token_ids.gpu[slot, : int(prefix[r]) + 1].tolist()
        _add(sampler, requests, slot, history[:1], history[1:],
             SamplingParams(temperature=temperatures[r], top_k=20, seed=r + 3))
    sampled = np.array([False, True, False, True])
    pools = candidate_pools(torch.randn(4, 3, VOCAB, generator=gen), 3)
    tree = draft_trees_per_request("ddtree", plain.tokens[:, 0], pools, plain.max_nodes - 1,
                                   sampled.tolist(), torch.arange(4) * 31 + 1)
    out, step = _verify_reading_nothing_back(sampler, tree, raw, slots, prefix, monkeypatch,
                                             sampled)

    states = sampler.sampling_states
    processed = _chain_reference(sampler, tree, raw, slots, prefix)
    seeds = step_seeds(states.seeds.gpu[slots], prefix)
    expected = verify_batch(tree, processed, states.temperature.np[slots.numpy()], sampled,
                            seeds, "auto")
    assert torch.equal(step.accepted_leaf, expected.accepted_leaf)
    assert out.num_sampled.tolist() == (expected.accepted_len + 1).tolist()
    probs = torch.softmax(processed.float(), -1)
    width = tree.max_nodes
    traversal = verify_traversal(tree, probs, seeds)
    deterministic = dataclasses.replace(tree, pool_ids=None, proposal_logq=None)
    by_row = [verify_greedy(tree, processed), traversal,
              verify_target_only(deterministic, probs, seeds), traversal]
    for r, result in enumerate(by_row):
        assert int(step.accepted_leaf[r]) == int(result.accepted_leaf[r]), r
        assert out.sampled_token_ids[r].tolist() == sampled_tokens(result, width)[r].tolist()
