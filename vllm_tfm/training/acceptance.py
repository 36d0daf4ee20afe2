"""Mean accepted length of chain / DDTree / Weaver drafting, with the engine's own
draft round and verifiers.

Drafting is the engine's (vllm_tfm/drafting/draft_round.py, which the proposer also
calls): a DFlash block of D = `draft_depth` masks after the root (the previous bonus
token), `candidate_pools` of the raw target-LM-head logits per position (pool size as
the engine resolves it: the Weaver's for tree "weaver", else min(512, V)), then
`draft_trees` with the engine's default fanout and expand width.

Two measurements:

- `simulate` (tools/eval_acceptance.py): real decoding of one prompt. Each step the
  target scores EVERY tree node exactly: every root-to-leaf path runs as an ordinary
  causal sequence from a copy of the committed cache (transformers, fp32), node i's row
  is its path's output at depth(i); then `verify_greedy` (T=0) or `verify_target_only`
  (T>0, seeds from `derive_seeds`) accepts a path and a bonus, and the accepted path is
  appended to the committed cache.
- `greedy_tau` (periodic estimates in the training tools): on held-out sequences that
  ARE the target's greedy continuations, greedy verification follows the sequence
  itself: the target's argmax at a node of depth d on the sequence's path is x_{p+d+1},
  and the verifier never leaves that path. So `verify_greedy` gets one-hot logits of
  x_{p+depth+1} at every node and no target forward is needed; it equals `simulate` at
  T=0 up to floating-point near-ties (tests/test_training_tools.py checks a case).

tau = completion tokens produced by verification steps / verification steps (each step
yields its accepted drafted tokens plus the bonus token); the token sampled by the
prefill is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_tfm.drafting.draft_round import draft_depth, draft_trees
from vllm_tfm.drafting.tree import DraftTree, derive_seeds
from vllm_tfm.drafting.verifiers import verify_greedy, verify_target_only, verify_traversal
from vllm_tfm.drafting.weaver import Weaver
from vllm_tfm.options import TREE_KINDS, default_candidate_pool

from vllm_tfm.training.dflash import DFlashDrafter
from vllm_tfm.training.features import TargetHead
from vllm_tfm.training.target import DecodeSession
from vllm_tfm.training.weaver_lk import lm_head_pools


@dataclass
class Drafters:
    """What drafting needs: the frozen target's head (a whole `Target` for `simulate`,
    which runs it), the DFlash drafter and (for tree "weaver") a Weaver whose tables were
    prepared from the target. `pool_size` None: the pool the engine would use
    (`options.default_candidate_pool`); `expand_width` None: Weaver's nodes expanded per
    call as the engine's default (`options.default_expand_width`); `first_exponent`: a
    sampled tree's first-slot exponent, None for each kind's own (`draft_trees`)."""

    target: TargetHead
    dflash: DFlashDrafter
    weaver: Weaver | None = None
    pool_size: int | None = None
    expand_width: int | None = None
    first_exponent: float | None = None

    def depth(self, tree: str, budget: int) -> int:
        """Draft positions D of a round, as the engine sizes them."""
        return draft_depth(budget, self.dflash.draft_depth,
                           self.weaver if tree == "weaver" else None)

    def check(self, tree: str, budget: int) -> None:
        if tree not in TREE_KINDS:
            raise ValueError(f"tree must be one of {list(TREE_KINDS)}, got {tree!r}")
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        if tree == "weaver" and self.weaver is None:
            raise ValueError("tree 'weaver' needs a Weaver")

    @torch.no_grad()
    def propose(self, tree: str, budget: int, roots: torch.Tensor, aux: torch.Tensor,
                anchors: torch.Tensor, h_v: torch.Tensor,
                sample_seeds: torch.Tensor | None = None) -> tuple[DraftTree, torch.Tensor]:
        """Draft trees for R requests.

        Args:
            roots: [R] int64 root (bonus) tokens, at positions `anchors` [R].
            aux: [R, C, n * d] target layer outputs (positions >= anchors are ignored).
            h_v: [R, d] target final-norm state at positions anchors - 1.
            sample_seeds: [R] int64: trees whose children are sampled (`draft_trees`).

        Returns:
            the trees and their pools' ids [R, D, P].
        """
        self.check(tree, budget)
        depth = self.depth(tree, budget)
        blocks = self.dflash.block_inputs(roots, depth)[:, None]
        hidden = self.dflash(aux, blocks, anchors[:, None], self.target.embed)[:, 0, 1:]
        pool_size = self.pool_size
        if pool_size is None:
            weaver_pool = self.weaver.config.candidate_pool_size if tree == "weaver" else None
            pool_size = default_candidate_pool(self.target.vocab_size, weaver_pool)
        pools = lm_head_pools(hidden, self.target.lm_head, pool_size)
        trees = draft_trees(tree, roots, pools, budget, weaver=self.weaver, h_v=h_v,
                            dflash_hidden=hidden, sample_seeds=sample_seeds,
                            expand_width=self.expand_width,
                            first_exponent=self.first_exponent)
        return trees, pools.ids


@torch.no_grad()
def greedy_tau(drafters: Drafters, tree: str, budget: int, tokens: torch.Tensor,
               aux: torch.Tensor, final: torch.Tensor, prompt_len: int) -> float:
    """tau of greedy decoding along greedy continuations (see the module docstring).

    Args:
        tokens: [N, T] prompt + GREEDY target continuation.
        aux, final: [N, T, ...] target layer outputs and final states of `tokens`.
        prompt_len: the first root is tokens[:, prompt_len] (the prefill's token).

    All rows decode in lockstep; a row stops when its next block would read past T.
    """
    drafters.check(tree, budget)
    device = drafters.target.device
    depth = drafters.depth(tree, budget)
    count, length = tokens.shape
    tokens = tokens.to(device)
    position = torch.full((count,), prompt_len, dtype=torch.int64, device=device)
    produced = steps = 0
    while True:
        rows = (position + depth + 1 < length).nonzero()[:, 0]
        if rows.numel() == 0:
            break
        anchor = position[rows]
        row_tokens = tokens[rows]
        drafted, _ = drafters.propose(
            tree, budget, row_tokens.gather(1, anchor[:, None])[:, 0],
            aux[rows.cpu()].to(device), anchor, final[rows.cpu(), (anchor - 1).cpu()].to(device),
        )
        truth = row_tokens.gather(1, anchor[:, None] + drafted.depths.long() + 1)
        result = verify_greedy(drafted, F.one_hot(truth, drafters.target.vocab_size).float())
        produced += int((result.accepted_len + 1).sum())
        steps += rows.numel()
        position[rows] += result.accepted_len + 1
    if steps == 0:
        raise ValueError(f"sequences of {length} tokens leave no room for a block of {depth}")
    return produced / steps


@dataclass
class RunStats:
    """One simulated generation.

    accepted: drafted tokens accepted per verification step.
    retained: per step s and depth j = 0..min(accepted, D - 1), the target's T=1
        next-token mass at the accepted path's depth-j node that lies inside pool row j
        (the candidates for depth j + 1).
    tokens: the generated token ids (prefill token first).
    """

    accepted: list[int] = field(default_factory=list)
    retained: list[list[float]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def produced(self) -> int:
        return sum(self.accepted) + len(self.accepted)


def _leaf_paths(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """Root-to-leaf node paths of request 0: nodes [L, S] (-1 padded, S = deepest + 1)
    and their tokens [L, S] (0 padded)."""
    count = int(tree.num_nodes[0])
    parents = tree.parents[0, :count].tolist()
    depths = tree.depths[0, :count].tolist()
    has_child = set(parents[1:])
    leaves = [i for i in range(count) if i not in has_child]
    width = max(depths) + 1
    nodes = torch.full((len(leaves), width), -1, dtype=torch.int64)
    for row, leaf in enumerate(leaves):
        node = leaf
        while node >= 0:
            nodes[row, depths[node]] = node
            node = parents[node]
    tokens = tree.tokens[0].cpu()[nodes.clamp(min=0)].masked_fill(nodes < 0, 0)
    return nodes, tokens


def tree_logits(session: DecodeSession, tree: DraftTree) -> torch.Tensor:
    """[N, V] the target's exact logits at every node of request 0's tree: each
    root-to-leaf path run from the session's committed state (``score_paths``)."""
    nodes, paths = _leaf_paths(tree)
    device = session.target.device
    scored = session.score_paths(paths.to(device)).logits  # [L, S, V]
    logits = scored.new_zeros(tree.max_nodes, scored.shape[-1])
    real = nodes >= 0
    logits[nodes[real].to(device)] = scored[real.to(device)]
    return logits


@torch.no_grad()
def simulate(drafters: Drafters, tree: str, budget: int, prompt: torch.Tensor,
             temperature: float, max_new_tokens: int, seed: int,
             sampled_trees: bool = False) -> RunStats:
    """Generate at least `max_new_tokens` tokens after `prompt` ([S] int64) with drafting.

    temperature 0: greedy (`verify_greedy`); > 0: target samples at that temperature
    (`verify_target_only`), the prefill token drawn with a generator seeded by `seed`.
    `sampled_trees` (T > 0 only): trees whose children are sampled, verified by
    traversal (`verify_traversal`), as the engine does for sampled requests.
    """
    drafters.check(tree, budget)
    if temperature < 0 or max_new_tokens < 1 or prompt.numel() < 1:
        raise ValueError(
            f"need temperature >= 0, max_new_tokens >= 1 and a non-empty prompt; got "
            f"{temperature}, {max_new_tokens}, {prompt.numel()} tokens"
        )
    target = drafters.target
    device = target.device
    session = target.session(drafters.dflash.target_layer_ids)
    out = session.extend(prompt.to(device)[None])
    aux, h_v = out.aux, out.final[:, -1]
    logits = out.logits[0, -1]
    if temperature == 0:
        root = logits.argmax()
    else:
        generator = torch.Generator(device=device).manual_seed(seed)
        root = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[0]
    stats = RunStats(tokens=[int(root)])
    while len(stats.tokens) - 1 < max_new_tokens:
        anchor = torch.tensor([session.length], device=device)
        seeds = derive_seeds(torch.tensor([seed], device=device), stats.steps)
        # The tree's draws hash a seed derived from the verifier's: independent streams.
        tree_seeds = derive_seeds(seeds, -1) if sampled_trees and temperature > 0 else None
        drafted, pool_ids = drafters.propose(tree, budget, root.view(1), aux, anchor, h_v,
                                             tree_seeds)
        node_logits = tree_logits(session, drafted)
        if temperature == 0:
            result = verify_greedy(drafted, node_logits[None])
        else:
            probs = torch.softmax(node_logits / temperature, -1)
            verifier = verify_traversal if tree_seeds is not None else verify_target_only
            result = verifier(drafted, probs[None], seeds)
        accepted = int(result.accepted_len[0])
        path = result.path[0, : accepted + 1]
        mass = torch.softmax(node_logits[path[: pool_ids.shape[1]]], -1)
        rows = pool_ids[0, : mass.shape[0]]
        stats.retained.append(mass.gather(-1, rows).sum(-1).tolist())
        stats.accepted.append(accepted)
        committed = drafted.tokens[0, path]
        out = session.extend(committed[None])
        aux = torch.cat([aux, out.aux], 1)
        h_v = out.final[:, -1]
        root = result.bonus_token[0]
        stats.tokens += committed[1:].tolist() + [int(root)]
    return stats
