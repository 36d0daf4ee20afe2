"""Structured outputs inside draft trees: every node is held to the grammar state of its
own root-to-node path.

vLLM 0.32 checks drafts against a request's grammar as one chain: the scheduler
truncates them at the first token the chain rejects (``validate_tokens``) and fills
one bitmask row per draft position by advancing the grammar draft after draft
(``grammar_bitmask``). A tree's drafts are siblings and cousins, not a chain, so
under dflash_tfm:

* the runner hands the scheduler each structured request's tree (the parent of every
  drafted node) on the ``DraftTokenIds`` it returns (``attach_tree_parents``); it
  travels wherever vLLM sends that object (the first tensor-parallel rank's, which
  grew the trees every rank verifies; pickled between processes);
* the scheduler records the tree on the request (``wrap_update_draft_token_ids``),
  keeps every drafted node (``wrap_validate_tokens``) and fills row j of
  the request's bitmask with the grammar state after node j's path, by one walk of
  the tree that accepts each node's token and rolls it back after its subtree
  (``wrap_grammar_bitmask``, ``fill_tree_bitmask``). Row j is the mask of the logits row of node j, the
  layout vLLM's ``apply_grammar_bitmask`` already applies before the sampling step,
  so verification sees each node's logits masked by its own path: greedy is
  constrained greedy, sampling the constrained distribution. A node whose token the
  grammar forbids is unreachable (its probability is zero); it and its subtree get
  their parent's row;
* after verification the scheduler's grammar advances by the accepted path and the
  bonus token, as vLLM's ``accept_tokens`` does for a chain;
* a structured request whose grammar does not hold from its first token on (a
  reasoning parser, still reasoning) drafts nothing until it does: where the
  grammar starts would differ from path to path.

On the runner, :class:`DraftGrammars` keeps a copy of each structured request's
grammar, compiled by vLLM's own backend, advanced by the request's output tokens, so
that the tree builders skip candidates the grammar forbids while the tree grows
(:class:`GrammarConstraint`); the scheduler's masks alone keep the output exact.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)

# The attribute of a DraftTokenIds that maps each structured request to the parent of
# each of its drafted nodes (node j + 1's parent at j; 0 = the root).
DRAFT_PARENTS = "tfm_draft_parents"
# The attribute of a scheduler Request that holds its drafted tree:
# (drafted tokens, their parents) as the runner sent them.
_REQUEST_TREE = "_tfm_draft_tree"


# -- runner side: the tree travels with the drafts ------------------------------------


def attach_tree_parents(drafts, proposer, requests) -> None:
    """Name, on ``drafts`` (a DraftTokenIds), the parents of each structured request's
    drafted nodes (``proposer.scheduled_parents``); ``requests``: the runner's
    CachedRequestStates by id."""
    parents = {}
    for req_id, tokens in zip(drafts.req_ids, drafts.draft_token_ids):
        state = requests.get(req_id)
        if not tokens or state is None or not _is_structured(state.sampling_params):
            continue
        parents[req_id] = proposer.scheduled_parents(req_id, len(tokens) + 1)[1:].tolist()
    setattr(drafts, DRAFT_PARENTS, parents)


def _is_structured(sampling_params) -> bool:
    params = getattr(sampling_params, "structured_outputs", None)
    return params is not None and not params.all_constraints_none()


# -- scheduler side -------------------------------------------------------------------


def constrained_from_start(manager, request) -> bool:
    """The request's grammar masks every token from the next one on (no reasoning
    section in between), which is what a tree's per-path masks assume."""
    return tuple(manager._get_constraint_bounds(request, ())) == (0, 0)


def wrap_update_draft_token_ids(original):
    """Record each structured request's tree on the request; a structured request whose
    tree did not come (or whose grammar does not hold from the next token on) drafts
    nothing this step."""

    @functools.wraps(original)
    def update_draft_token_ids(self, draft_token_ids):
        trees = getattr(draft_token_ids, DRAFT_PARENTS, None)
        if trees is None:  # not a dflash_tfm runner
            return original(self, draft_token_ids)
        manager = self.structured_output_manager
        for index, req_id in enumerate(draft_token_ids.req_ids):
            request = self.requests.get(req_id)
            if request is None or not request.use_structured_output:
                continue
            tokens = draft_token_ids.draft_token_ids[index]
            parents = trees.get(req_id)
            if not tokens or parents is None or not constrained_from_start(manager, request):
                draft_token_ids.draft_token_ids[index] = []
                setattr(request, _REQUEST_TREE, None)
                continue
            if len(parents) != len(tokens):
                raise ValueError(f"request {req_id}: {len(tokens)} drafted tokens but "
                                 f"{len(parents)} parents")
            setattr(request, _REQUEST_TREE, (list(tokens), list(parents)))
        return original(self, draft_token_ids)

    return update_draft_token_ids


def _scheduled_tree(request, spec_tokens) -> list[int] | None:
    """Parents of ``spec_tokens`` when they are (a prefix of) the request's recorded
    tree, else None. The scheduler cuts drafts to a prefix only, and a prefix of a
    topologically ordered tree is a tree."""
    tree = getattr(request, _REQUEST_TREE, None)
    if tree is None or not spec_tokens:
        return None
    tokens, parents = tree
    count = len(spec_tokens)
    if list(spec_tokens) != tokens[:count]:
        return None
    return parents[:count]


def wrap_validate_tokens(original):
    """A tree's drafts are not one chain: keep them all (each node is masked by its own
    path when verified)."""

    @functools.wraps(original)
    def validate_tokens(self, request, spec_tokens):
        if _scheduled_tree(request, spec_tokens) is not None:
            return list(spec_tokens)
        return original(self, request, spec_tokens)

    return validate_tokens


def wrap_grammar_bitmask(original):
    """Rows of a tree request: row j = the grammar state after node j's path."""

    @functools.wraps(original)
    def grammar_bitmask(self, requests, structured_output_request_ids,
                        scheduled_spec_decode_tokens):
        trees = {}
        for req_id in structured_output_request_ids:
            spec = scheduled_spec_decode_tokens.get(req_id, ())
            parents = _scheduled_tree(requests[req_id], spec)
            if parents is not None:
                trees[req_id] = (list(spec), parents)
            elif spec and hasattr(requests[req_id], _REQUEST_TREE):
                # A dflash_tfm request's drafts are a tree: as a chain they would get
                # wrong masks. update_draft_token_ids keeps no drafts without their tree.
                raise RuntimeError(f"request {req_id}: scheduled drafts {list(spec)} are not "
                                   "the tree its runner sent")
        if not trees:
            return original(self, requests, structured_output_request_ids,
                            scheduled_spec_decode_tokens)
        # vLLM fills each tree request's first row (the root: the grammar's state now)
        # and treats the rest as padding; this fills them along each node's path.
        as_padding = {**scheduled_spec_decode_tokens,
                      **{req_id: [-1] * len(spec) for req_id, (spec, _) in trees.items()}}
        bitmask = original(self, requests, structured_output_request_ids, as_padding)
        rows = torch.from_numpy(bitmask)
        first_row = 0
        for req_id in structured_output_request_ids:
            if req_id in trees:
                tokens, parents = trees[req_id]
                grammar = requests[req_id].structured_output_request.grammar
                fill_tree_bitmask(grammar, tokens, parents, rows, first_row)
            first_row += 1 + len(scheduled_spec_decode_tokens.get(req_id, ()))
        return bitmask

    return grammar_bitmask


def fill_state_row(grammar, rows: torch.Tensor, row: int) -> None:
    """Row ``row`` of ``rows`` = the mask of the grammar's state; all allowed once it
    has terminated, as vLLM's manager fills it (``_fill_bitmasks``)."""
    if grammar.is_terminated():
        rows[row] = -1
    else:
        grammar.fill_bitmask(rows, row)


def fill_tree_bitmask(grammar, tokens: list[int], parents: list[int], rows: torch.Tensor,
                      first_row: int) -> None:
    """Fill rows ``first_row + 1 ..`` of ``rows`` ([*, words] int32) for a tree's
    drafted nodes: ``tokens[j - 1]``, ``parents[j - 1]`` of node j (parents < j, 0 the
    root), row ``first_row + j`` = the mask after node j's path (``fill_state_row``).
    Row ``first_row`` must hold the root's (the grammar's current state). The grammar
    is left as it was found."""
    count = len(tokens) + 1
    children: list[list[int]] = [[] for _ in range(count)]
    for node, parent in enumerate(parents, start=1):
        if not 0 <= parent < node:
            raise ValueError(f"parents must be topologically ordered: parent[{node}] = "
                             f"{parent}")
        children[parent].append(node)
    # Depth-first, with the grammar one token deeper per level: each node costs one
    # accept, one fill and one rollback (a node the grammar rejects: none).
    stack: list[tuple[int, bool]] = [(child, True) for child in reversed(children[0])]
    while stack:
        node, entering = stack.pop()
        if not entering:
            grammar.rollback(1)
            continue
        token = tokens[node - 1]
        if grammar.is_terminated() or grammar.validate_tokens([token]) != [token]:
            _copy_subtree(rows, first_row, node, parents[node - 1], children)
            continue
        grammar.accept_tokens("", [token])
        fill_state_row(grammar, rows, first_row + node)
        stack.append((node, False))
        stack.extend((child, True) for child in reversed(children[node]))


def _copy_subtree(rows, first_row: int, node: int, parent: int, children) -> None:
    """An unreachable node and its subtree take the parent's row (a finite mask: the
    logits there are never sampled, but they are computed)."""
    pending = [node]
    while pending:
        current = pending.pop()
        rows[first_row + current] = rows[first_row + parent]
        pending.extend(children[current])


# -- runner side: grammars for drafting ---------------------------------------------


class DraftGrammars:
    """A runner-side copy of each structured request's grammar, advanced by the tokens
    the request has output, for the tree builders to draft only tokens the grammar
    allows. Compiled by vLLM's StructuredOutputManager (the scheduler's backend
    classes and options); a request whose grammar is still compiling, failed to, or
    starts after a reasoning section drafts unconstrained (the scheduler's masks keep
    its output exact)."""

    def __init__(self, vllm_config):
        from vllm.v1.structured_output import StructuredOutputManager

        self._manager = StructuredOutputManager(vllm_config)
        # Compile on the request's first draft, before its tree grows (the scheduler has
        # compiled the same grammar already, so it is valid; xgrammar caches compiles).
        self._manager._use_async_grammar_compilation = False
        # Grammars apply from the first output token (no reasoning section) only.
        self._enabled = (self._manager.reasoner_cls is None
                         or self._manager.enable_in_reasoning)
        self._entries: dict[str, SimpleNamespace] = {}

    def constraint(self, req_ids: list[str], requests, step_tokens) -> GrammarConstraint | None:
        """The child constraint of a drafted batch (``req_ids`` in row order), None when
        none of its requests is constrained. Each structured request's grammar is at the
        state after every token it has output. ``requests``: the runner's
        CachedRequestStates; ``step_tokens``: [R, width] (tensor or lists, -1 padded),
        each request's tokens of this step, not yet in its output_token_ids."""
        for stale in self._entries.keys() - requests.keys():
            del self._entries[stale]
        structured = [_is_structured(getattr(requests.get(req_id), "sampling_params", None))
                      for req_id in req_ids]
        if not self._enabled or not any(structured):
            return None
        if isinstance(step_tokens, torch.Tensor):
            step_tokens = step_tokens.tolist()
        grammars = [
            self._advanced(req_id, requests[req_id], [t for t in step_tokens[row] if t >= 0])
            if wanted else None
            for row, (req_id, wanted) in enumerate(zip(req_ids, structured))
        ]
        if all(grammar is None for grammar in grammars):
            return None
        return GrammarConstraint(grammars, self._manager.backend.allocate_token_bitmask)

    def _advanced(self, req_id: str, state, step_tokens: list[int]):
        entry = self._entries.get(req_id)
        if entry is None:
            entry = self._start(req_id, state.sampling_params)
        grammar = entry.request.structured_output_request.grammar
        if entry.broken or grammar is None:
            return None
        if isinstance(grammar, Exception):
            entry.broken = True
            return None
        output = list(state.output_token_ids) + list(step_tokens)
        if len(output) < entry.consumed:  # vLLM dropped output tokens (a KV-load failure)
            entry.broken = True
            return None
        new = output[entry.consumed:]
        if new and not grammar.is_terminated() and grammar.validate_tokens(new) != new:
            # The scheduler masks every token, so this cannot happen unless the copy
            # lost step: stop constraining this request's drafts.
            logger.warning("dflash_tfm: request %s's draft-time grammar lost step with its "
                           "output; its trees are no longer pruned by the grammar", req_id)
            entry.broken = True
            return None
        if new:
            grammar.accept_tokens(req_id, new)
        entry.consumed = len(output)
        return grammar

    def _start(self, req_id: str, sampling_params) -> SimpleNamespace:
        from vllm.v1.structured_output.request import StructuredOutputRequest

        request = SimpleNamespace(
            request_id=req_id, sampling_params=sampling_params,
            structured_output_request=StructuredOutputRequest.from_sampling_params(
                sampling_params),
        )
        self._manager.grammar_init(request)
        entry = SimpleNamespace(request=request, consumed=0, broken=False)
        self._entries[req_id] = entry
        return entry


class GrammarConstraint:
    """The tree builders' child constraint (``builders.ChildConstraint``) for a batch:
    the children of an expanded node may take the tokens its grammar state allows.

    ``grammars``: per request row, a vLLM StructuredOutputGrammar at the tree's root
    state, or None (any token). Each expanded node costs one walk down its path
    (accept), one bitmask fill and one rollback, on the host."""

    def __init__(self, grammars: list, allocate):
        self.grammars = grammars
        self._allocate = allocate
        self.rows = [r for r, grammar in enumerate(grammars) if grammar is not None]

    def child_bitmask(self, tokens: torch.Tensor, parents: torch.Tensor,
                      nodes: torch.Tensor) -> torch.Tensor:
        R, w = nodes.shape
        masks = self._allocate(R * w)
        masks.fill_(-1)
        tokens_h, parents_h, nodes_h = tokens.tolist(), parents.tolist(), nodes.tolist()
        for r in self.rows:
            grammar = self.grammars[r]
            for i, node in enumerate(nodes_h[r]):
                if node < 0:
                    continue
                path = _path_tokens(tokens_h[r], parents_h[r], node)
                row = r * w + i
                if grammar.is_terminated() or grammar.validate_tokens(path) != path:
                    masks[row] = 0  # past the grammar's end, or unreachable
                    continue
                if path:
                    grammar.accept_tokens("", path)
                if grammar.is_terminated():
                    masks[row] = 0
                else:
                    grammar.fill_bitmask(masks, row)
                if path:
                    grammar.rollback(len(path))
        return masks.view(R, w, -1).to(nodes.device)


def _path_tokens(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """Tokens of the nodes below the root on ``node``'s path, root side first."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    path.reverse()
    return path
