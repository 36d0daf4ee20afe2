"""Thinking budgets inside draft trees: every node is forced the way plain decoding would
force it after that node's own root-to-node path.

vLLM 0.32 keeps a request's thinking budget in the sampler's
``ThinkingBudgetStateHolder``: one state per request, stepped once per decoding step
(``_update_think_state``) over the request's output, which forces the end-of-thinking
tokens (``reasoning_end_str``, one per step) once the thinking section since the last
``reasoning_start_str`` has reached the budget (logit of the forced token set to 1e9,
after penalties, before temperature). With drafts it reasons about one chain
(``force_index`` into the drafts); a tree's nodes are siblings and cousins.

Under dflash_tfm each request's budget lives in a :class:`TreeThinkingBudgets` (it
replaces the input batch's holder, :func:`install`), which steps vLLM's own
``_update_think_state`` exactly as plain decoding does, one token at a time:

* the committed state follows the request's output token by token (what the holder
  of an engine without speculation computes at each step);
* node j's state is its parent's state stepped once more, over the output followed by
  node j's path, so the forcing of node j's logits row is what plain decoding would
  apply after that path (:meth:`TreeThinkingBudgets.force_tree_rows`, called by
  ``verify.verify_step`` after the request-level processing and before temperature);
  every verifier then accepts only what the target with forcing emits;
* rows vLLM's own samplers handle under dflash_tfm (steps without trees, the fallback
  that samples every root) get the committed state's forcing
  (:meth:`TreeThinkingBudgets.apply_to_logits`).

Stepping token by token is the reference: it is what an uninterrupted request of an
engine without speculation sees. (vLLM re-creates a request's state from its prompt
when the request re-enters the batch, e.g. after preemption; such a request's forcing
depends on the schedule in any engine, with or without speculation.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from vllm.v1.sample.logits_processor.interface import MoveDirectionality
from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

# The logit vLLM's holder writes on a forced token (``_apply_forcing_to_logits``).
FORCED_LOGIT = 1e9


class _History:
    """``base[:length] + path`` as the read-only sequence ``_update_think_state`` reads
    (``len``, slices, indices), without copying the request's output per node."""

    __slots__ = ("base", "length", "path")

    def __init__(self, base: list[int], length: int, path: tuple[int, ...] = ()):
        self.base, self.length, self.path = base, length, path

    def __len__(self) -> int:
        return self.length + len(self.path)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            head = self.base[start:min(stop, self.length)] if start < self.length else []
            tail = self.path[max(start - self.length, 0):max(stop - self.length, 0)]
            return head + list(tail)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.base[index] if index < self.length else self.path[index - self.length]


@dataclasses.dataclass
class _Tracked:
    """One budgeted request: its output (the input batch's live list), the state of
    vLLM's machine before any step (from the prompt), and the state after the first
    ``consumed`` output tokens (None: not stepped yet)."""

    output: list[int]
    initial: dict[str, Any]
    state: dict[str, Any] | None = None
    consumed: int = 0


class TreeThinkingBudgets(ThinkingBudgetStateHolder):
    """The thinking-budget holder of a dflash_tfm input batch: vLLM's state machine,
    stepped per tree node (module docstring)."""

    @classmethod
    def replacing(cls, holder: ThinkingBudgetStateHolder) -> TreeThinkingBudgets:
        """A holder with ``holder``'s reasoning tokens, mask capacity and device, and no
        requests (``holder`` must track none)."""
        if holder.has_tracked_requests():
            raise RuntimeError("a thinking-budget holder that tracks requests cannot be "
                               "replaced: their states would be lost")
        new = cls.__new__(cls)
        new.__dict__.update(holder.__dict__)
        new._state = {}  # vLLM's per-request dicts: unused, kept empty
        new._tracked = {}
        return new

    # -- vLLM's holder interface ---------------------------------------------------

    def has_tracked_requests(self) -> bool:
        return bool(self._tracked)

    def sync_batch(self, batch_update) -> None:
        if not self.is_enabled or not batch_update:
            return
        for index in batch_update.removed:
            self._tracked.pop(index, None)
        for index, params, prompt_tok_ids, output_tok_ids in batch_update.added:
            budget = params.thinking_token_budget
            if budget is None:
                self._tracked.pop(index, None)
                continue
            self._tracked[index] = _Tracked(
                output=output_tok_ids, initial=self._init_state_entry(prompt_tok_ids, budget))
        for first, second, direction in batch_update.moved:
            moved = self._tracked.pop(first, None)
            if direction == MoveDirectionality.SWAP:
                swapped = self._tracked.pop(second, None)
                if swapped is not None:
                    self._tracked[first] = swapped
            if moved is not None:
                self._tracked[second] = moved

    def update_state(self, output_token_ids, spec_token_ids, repeat_indices=None) -> None:
        """Nothing to refresh: each state follows its request's live output list when it
        is read (vLLM's rejection sampler forces without calling this first)."""

    def apply_to_logits(self, logits: torch.Tensor, predict_bonus_token: bool,
                        spec_token_ids) -> torch.Tensor:
        """Force row i (request i, one row per request: vLLM's sampler under dflash_tfm
        sees no drafts) as plain decoding would after the request's output."""
        rows, tokens = [], []
        for index, tracked in self._tracked.items():
            if index >= logits.shape[0]:
                continue
            forced = self.forced_token(self._committed(tracked))
            if forced is not None:
                rows.append(index)
                tokens.append(forced)
        _force(logits, rows, tokens)
        return logits

    # -- per node --------------------------------------------------------------------

    def force_tree_rows(self, node_logits: torch.Tensor, tree) -> torch.Tensor:
        """Force, in place, row j of request r of ``node_logits`` ([R, N, V], the logits
        of ``tree``'s nodes, request r = input batch index r) where plain decoding would
        force the token after node j's path. Returns ``node_logits``."""
        rows_count, width = tree.tokens.shape
        tracked = {r: t for r, t in self._tracked.items() if r < rows_count}
        if not tracked:
            return node_logits
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        depths, counts = tree.depths.tolist(), tree.num_nodes.tolist()
        flat_rows, forced_tokens = [], []
        for r, entry in tracked.items():
            for node, token in enumerate(self.node_forcing(
                    entry, tokens[r], parents[r], depths[r], counts[r])):
                if token is not None:
                    flat_rows.append(r * width + node)
                    forced_tokens.append(token)
        _force(node_logits.view(rows_count * width, -1), flat_rows, forced_tokens)
        return node_logits

    def node_forcing(self, tracked: _Tracked, tokens: list[int], parents: list[int],
                     depths: list[int], count: int) -> list[int | None]:
        """Per node 0 .. count - 1 (0 the root, whose token ends the output): the token
        plain decoding forces after the node's path, or None."""
        output = tracked.output
        states: list[dict | None] = [None] * count
        paths: list[tuple[int, ...]] = [()] * count
        states[0] = self._committed(tracked)
        for node in sorted(range(1, count), key=depths.__getitem__):
            parent = parents[node]
            paths[node] = paths[parent] + (tokens[node],)
            states[node] = self._step(states[parent], _History(output, len(output),
                                                               paths[node]))
        return [self.forced_token(state) for state in states]

    def forced_token(self, state: dict[str, Any]) -> int | None:
        """The token vLLM's holder forces after ``state``'s step when no drafts are
        scheduled (``_apply_forcing_to_logits`` with predict_bonus_token False: force
        index 0, the request's own row), or None."""
        if not state.get("in_end") or state.get("bonus_token_forced") or not state.get(
                "force_index"):
            return None
        end_count = state.get("end_count", 0)
        if end_count >= len(self.think_end_token_ids):
            return None
        return self.think_end_token_ids[end_count]

    # -- stepping vLLM's machine -------------------------------------------------------

    def _step(self, state: dict[str, Any], history) -> dict[str, Any]:
        """``state`` after one decoding step whose output is ``history``, as vLLM's
        ``update_state`` steps it without drafts. ``state`` is left as it was: every
        list in it is replaced, never changed in place, by ``_update_think_state``."""
        stepped = dict(state)
        stepped.update(output_tok_ids=history, spec_token_ids=[], in_spec_mode=False,
                       force_index=[])
        self._update_think_state(stepped)
        return stepped

    def _committed(self, tracked: _Tracked) -> dict[str, Any]:
        """The state after the request's output, stepped over each output length from
        the last one seen (the first step sees the empty output, as the prompt's
        sampling step does)."""
        output = tracked.output
        if tracked.state is None or len(output) < tracked.consumed:
            # Not stepped yet, or vLLM dropped output tokens (a KV-load failure): replay.
            tracked.state = self._step(tracked.initial, _History(output, 0))
            tracked.consumed = 0
        while tracked.consumed < len(output):
            tracked.consumed += 1
            tracked.state = self._step(tracked.state, _History(output, tracked.consumed))
        return tracked.state


def _force(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """logits[rows[i], tokens[i]] = FORCED_LOGIT, as vLLM's holder writes it."""
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    token = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    logits.index_put_((index, token), logits.new_full((len(rows),), FORCED_LOGIT))


def install(input_batch) -> TreeThinkingBudgets | None:
    """Give ``input_batch`` (a dflash_tfm runner's InputBatch) a TreeThinkingBudgets in
    place of vLLM's holder, before any request is added; None without a reasoning config
    (vLLM then refuses thinking budgets itself)."""
    holder = input_batch.thinking_budget_state_holder
    if holder is None or isinstance(holder, TreeThinkingBudgets):
        return holder
    tree = TreeThinkingBudgets.replacing(holder)
    input_batch.thinking_budget_state_holder = tree
    input_batch.sampling_metadata = dataclasses.replace(
        input_batch.sampling_metadata, thinking_budget_state_holder=tree)
    return tree


def tree_holder(sampling_metadata) -> TreeThinkingBudgets | None:
    """The step's TreeThinkingBudgets when it tracks a budgeted request, else None."""
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    if isinstance(holder, TreeThinkingBudgets) and holder.has_tracked_requests():
        return holder
    return None


def wrap_update_states(original):
    """dflash_tfm runners: the input batch (vLLM builds a new one when the KV cache is
    initialised) holds a TreeThinkingBudgets before its first request arrives."""

    @functools.wraps(original)
    def _update_states(self, scheduler_output):
        if getattr(self, "_tfm_options", None) is not None:
            install(self.input_batch)
        return original(self, scheduler_output)

    return _update_states
