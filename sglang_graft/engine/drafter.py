"""Draft models: propose a dynamic token tree the EAGLE-2 way.

A ``Drafter`` turns the newly verified tokens of each request into draft ``Candidates``
(tokens, parents, raw cumulative draft probabilities). ``ModelDrafter`` does it with a
smaller causal LM that shares the target's tokenizer and keeps its own KV cache:

1. one forward over the tokens it has not read yet (at its first draft the whole prompt;
   later, the tokens verified since it last drafted; both end with the new root and are
   left-padded across the batch) gives the root's next-token distribution; its top-k
   are depth 1. *Seeds* (``graft``: the round's retrieved nodes, a forest below the
   root) ride along in the same forward under a tree mask: each gets the draft's own
   score (the product of its probabilities along its path, so drafted and retrieved
   nodes are judged alike; the tree keeps that score, see ``GraftScheduler.build_tree``'s
   ``seeded``) and its top-k children. A forward over a few more tokens costs
   about as much as over one, so retrieval deepens the draft tree for free; a root child
   that repeats a seed is the seed, and is dropped. Seeds keep their retrieval source and
   bin, so their verify outcomes keep calibrating retrieval (which decides whether the
   next rounds draft at all) and the statistics credit the source that found them;
2. each further level expands the ``topk`` best nodes of the previous level (by cumulative
   probability) in one forward: all of them at once, with a tree attention mask over the
   draft's own cache (each node sees the verified prefix and its own ancestors only);
3. after every level the caller's gate (``continues``) says which requests may go deeper
   (judged on the draft's own chain, as without seeds); drafting stops for the batch once
   none may. Nodes carry the level that proposed them (``Candidates.levels``), which is
   where pruning cuts;
4. the prompt and any later long unread span can be read by another model than the
   drafting one (``span_reader``: the bf16 model an int8 draft came from, which reads many
   tokens faster and the first token without int8's clipping); its KV is cast to the
   drafting model's dtype, and drafting goes on from there;
5. the tree nodes' KV stays until the next round: the fed nodes (seeds included) that
   lie on the path the target accepted are kept (their KV is exactly a causal forward
   over that path), the rest dropped, so next round's first forward reads only what the
   draft never saw, usually just the new root.

Another drafter (an EAGLE-3 head reading the target's hidden states, say) only has to
implement the same two methods.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch

from sglang_graft.candidates import Candidates, Source
from sglang_graft.graft import summarise_paths
from sglang_graft.engine.draft_head import DraftHead
from sglang_graft.engine.kv import PaddedKV, causal_block

#: Unread tokens from which a ``span_reader`` reads them instead of the drafting model: on a
#: 2-core AMX Xeon the bf16 0.5B draft and its int8 copy cost the same for 64 new tokens
#: (105 against 109 ms), and the int8 copy is faster below that (61 against 75 for 16).
SPAN_READ_MIN_TOKENS = 64

#: ``continues(depth, level_scores [bs, w]) -> [bs] bool``: may each request draft deeper.
ContinueFn = Callable[[int, torch.Tensor], torch.Tensor]


class DraftOutput(NamedTuple):
    candidates: Candidates  # all drafted nodes, level by level (parents precede children)
    continues: list[torch.Tensor]  # the gate's answer after each level but the last
    forwards: int  # draft model forwards this round
    read_tokens: int = 0  # tokens read before drafting, beyond the root (a prompt, skipped rounds)


class Drafter(Protocol):
    """What the engine needs from a drafter."""

    def draft(self, tokens: torch.Tensor, valid: torch.Tensor, continues: ContinueFn) -> DraftOutput:
        """Read the tokens not read yet (``[bs, q]``, left-padded, ``valid`` marks real ones;
        the last column is each request's root; at the first draft, the prompt) and draft."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the requests ``rows`` (finished ones leave the batch)."""

    def cold(self) -> torch.Tensor:
        """``[bs]`` bool: which requests' drafters have read nothing yet."""


class ModelDrafter:
    """EAGLE-2-style dynamic tree drafting with a small causal LM.

    Args:
        model: the draft model (same tokenizer as the target).
        topk: children per expanded node, and nodes expanded per level.
        depth: most levels drafted per round.
        vocab_limit: the target's vocabulary size; draft logits beyond it are ignored.
        batch_size, device: of the batch being decoded.
        head: an LM head over part of the vocabulary (``engine.draft_head``), or None for
            the model's own.
        span_reader: a model with the same weights (in another precision) that reads the
            first span (the prompt but its root) and later spans of at least ``span_min``
            unread tokens before the root, or None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        topk: int,
        depth: int,
        vocab_limit: int,
        batch_size: int,
        device: torch.device | str,
        head: DraftHead | None = None,
        span_reader: torch.nn.Module | None = None,
        span_min: int = SPAN_READ_MIN_TOKENS,
    ) -> None:
        if topk < 1 or depth < 1:
            raise ValueError(f"draft topk and depth must be >= 1, got topk={topk}, depth={depth}")
        self.model = model
        self.topk = topk
        self.depth = depth
        self.vocab_limit = vocab_limit
        self.head = head
        self.span_reader = span_reader
        self.span_min = span_min
        self.kv = PaddedKV(batch_size, device)
        # Tree nodes fed last round, per forward: (tokens [bs, w] (-1: never to match),
        # parent fed index [bs, w] (-1: the root), depths [bs, w]). Their KV sits in the
        # cache right after the verified columns, in fed-index order.
        self._fed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._fed_depth = 0  # a bound on the deepest fed node

    def cold(self) -> torch.Tensor:
        return self.kv.lengths == 0

    def select_rows(self, rows: torch.Tensor) -> None:
        self._drop_tree()
        self.kv.select_rows(rows)

    def _drop_tree(self) -> None:
        if self._fed:
            self.kv.commit(self.kv.valid.clone())
            self._fed = []
            self._fed_depth = 0

    def _reuse(self, tokens: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the KV of last round's fed nodes that match the newly verified tokens.

        Walks down the fed nodes once (batched over requests): a node matches when its
        parent matched and its token is the next verified one. The root (last token) is
        never matched: its logits are needed. Returns the tokens still to be read.
        """
        if not self._fed:
            return tokens, valid
        kv = self.kv
        bs, q = tokens.shape
        device = tokens.device
        rows = torch.arange(bs, device=device)
        count = valid.sum(dim=1)
        first = q - count
        fed_tokens, fed_parents, fed_depths = (torch.cat(f, dim=1) for f in zip(*self._fed))
        num_fed = fed_tokens.shape[1]
        keep_fed = torch.zeros(bs, num_fed, dtype=torch.bool, device=device)
        cur = torch.full((bs,), -1, dtype=torch.int64, device=device)
        alive = torch.ones(bs, dtype=torch.bool, device=device)
        matched = torch.zeros(bs, dtype=torch.int64, device=device)
        for depth in range(1, min(self._fed_depth, q - 1) + 1):
            tok = tokens.gather(1, (first + depth - 1).clamp(max=q - 1).unsqueeze(1))
            alive = alive & (depth < count)
            hit = (fed_depths == depth) & (fed_parents == cur.unsqueeze(1)) & (fed_tokens == tok) & alive.unsqueeze(1)
            found = hit.any(dim=1)
            idx = hit.long().argmax(dim=1)
            keep_fed[rows[found], idx[found]] = True
            cur = torch.where(found, idx, cur)
            alive = found
            matched = matched + found.long()
        committed = kv.width - num_fed
        kv.commit(torch.cat([kv.valid[:, :committed], keep_fed], dim=1))
        self._fed = []
        cols = torch.arange(q, device=device)
        valid = cols.unsqueeze(0) >= (q - (count - matched)).unsqueeze(1)
        live = valid.any(dim=0)
        lead = int(live.long().argmax()) if bool(live.any()) else 0
        return tokens[:, lead:], valid[:, lead:]

    def _read_span(self, tokens: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Have ``span_reader`` read every unread token but the root at the first draft (the
        prompt's first token must not go through an int8 ``down_proj``: ``engine.draft_int8``)
        and whenever there are at least ``span_min`` of them; returns what the drafting
        forward still has to read. Not counted as a draft forward: it is the prompt's read,
        which ``draft_read_cost`` prices."""
        span = tokens.shape[1] - 1
        if self.span_reader is None or span == 0 or (span < self.span_min and self.kv.width > 0):
            return tokens, valid
        kv = self.kv
        own = next(self.model.parameters()).dtype
        kv.cast(next(self.span_reader.parameters()).dtype)
        # One forward: the 0.5B draft gains nothing from chunks (708 tokens: 0.85-0.87 s at
        # once, 0.88-0.92 s in chunks of 384, 1.00-1.04 s in chunks of 256).
        kv.prefill(self.span_reader, tokens[:, :span], valid[:, :span], chunk=span)
        kv.cast(own)
        return tokens[:, span:], valid[:, span:]

    def draft(
        self, tokens: torch.Tensor, valid: torch.Tensor, continues: ContinueFn, seeds: Candidates | None = None
    ) -> DraftOutput:
        kv = self.kv
        tokens, valid = self._reuse(tokens, valid)
        read_tokens = tokens.shape[1] - 1
        tokens, valid = self._read_span(tokens, valid)
        bs, q = tokens.shape
        k = self.topk
        device = tokens.device
        seed = _seed_forest(seeds, bs, device)
        r = seed.tokens.shape[1]
        # First forward: the unread tokens (causal) and the seed forest below the root.
        offsets, block = causal_block(valid)
        positions = kv.lengths.unsqueeze(1) + offsets
        read = tokens
        if r:
            block = torch.cat(
                [
                    torch.cat([block, torch.zeros(bs, q, r, dtype=torch.bool, device=device)], dim=2),
                    torch.cat([valid.unsqueeze(1).expand(bs, r, q), seed.ancestors], dim=2),
                ],
                dim=1,
            )
            positions = torch.cat([positions, positions[:, -1:] + seed.depths], dim=1)
            read = torch.cat([tokens, seed.tokens], dim=1)
        logits = kv.forward(self.model, read, positions, block, logits_to_keep=r + 1, head=self.head)  # [root, seeds]
        kv.valid[:, kv.width - q - r : kv.width - r] = valid
        kv.lengths = kv.lengths + valid.sum(dim=1)
        committed = kv.width - r
        probs = self._probs(logits)
        vocab = probs.shape[-1]
        root_scores, root_tokens = self._top(probs[:, 0], k)
        # A seed's draft score: the product of the draft's probabilities along its path,
        # each read off its parent's row (the root's is row 0); 0 for a token it cannot draft.
        cols, known = self._columns(seed.tokens, vocab)
        step = probs.reshape(bs, -1).gather(1, (seed.parents + 1) * vocab + cols)
        step = torch.where(known, step, 0.0)
        seed_scores = (seed.ancestors.float() @ step.clamp(min=1e-30).log().unsqueeze(2)).squeeze(2).exp()
        seed_scores = torch.where(seed.valid, seed_scores, 0.0)
        child_p, child_t = self._top(probs[:, 1:], k)  # [bs, r, k]
        kk = root_tokens.shape[1]
        # The first level: the root's children, then each seed's; a child the seed forest
        # already holds (same parent, same token) is that seed, so the copy is dropped.
        level_tokens = torch.cat([root_tokens, child_t.reshape(bs, r * kk)], dim=1)
        level_scores = torch.cat([root_scores, (seed_scores.unsqueeze(2) * child_p).reshape(bs, r * kk)], dim=1)
        parent_fed = torch.cat(
            [torch.full_like(root_tokens, -1), torch.arange(r, device=device).repeat_interleave(kk).expand(bs, r * kk)],
            dim=1,
        )
        level_depths = torch.cat([torch.ones_like(root_tokens), (seed.depths + 1).repeat_interleave(kk, dim=1)], dim=1)
        copies = (parent_fed.unsqueeze(2) == seed.parents.unsqueeze(1)) & (
            level_tokens.unsqueeze(2) == seed.tokens.unsqueeze(1)
        )
        root_valid = torch.ones_like(root_tokens, dtype=torch.bool)
        level_valid = torch.cat([root_valid, seed.valid.repeat_interleave(kk, dim=1)], dim=1)
        level_valid = level_valid & ~(copies & seed.valid.unsqueeze(1)).any(dim=2)
        toks, scores = [seed.tokens, level_tokens], [seed_scores, level_scores]
        parents, valids = [seed.parents, parent_fed], [seed.valid, level_valid]
        levels = [torch.ones_like(seed.tokens), torch.ones_like(level_tokens)]
        # Seeds are the first fed nodes (fed index = seed column); invalid ones never match.
        self._fed = [(torch.where(seed.valid, seed.tokens, -1), seed.parents, seed.depths)] if r else []
        self._fed_depth = r
        frontier_depth = r + 1  # deepest node of the current level (a bound)
        fed_anc = seed.ancestors  # ancestor-or-self among fed nodes
        gates: list[torch.Tensor] = []
        forwards = 1
        level_start = r  # candidate column of the current level's first node
        # The depth gates judge the draft's own chain, as without seeds (level 1: the
        # root's children), so seeds add nodes to a round without making it draft deeper.
        gate_scores = root_scores
        for d in range(2, self.depth + 1):
            go = continues(d - 1, gate_scores)
            gates.append(go)
            if not bool(go.any()):
                break
            width = min(k, level_scores.shape[1])
            best = torch.where(level_valid, level_scores, -1.0).topk(width, dim=1).indices  # [bs, width] local columns
            fed_tokens = level_tokens.gather(1, best)
            fed_scores = level_scores.gather(1, best)
            fed_valid = level_valid.gather(1, best)
            fed_depths = level_depths.gather(1, best)
            fed_cols = level_start + best
            # Each fed node sees its parent's ancestors (none when the parent is the root) and itself.
            f = fed_anc.shape[1]
            par = parent_fed.gather(1, best)
            rows = fed_anc.gather(1, par.clamp(min=0).unsqueeze(2).expand(bs, width, f)) & (par >= 0).unsqueeze(2)
            prefix = torch.cat([kv.valid[:, :committed].unsqueeze(1).expand(bs, width, committed), rows], dim=2)
            eye = torch.eye(width, dtype=torch.bool, device=device).expand(bs, width, width)
            positions = kv.lengths.unsqueeze(1) + fed_depths - 1
            logits = kv.forward(self.model, fed_tokens, positions, eye, prefix_mask=prefix, head=self.head)
            forwards += 1
            self._fed.append((torch.where(fed_valid, fed_tokens, -1), par, fed_depths))
            self._fed_depth = max(self._fed_depth, frontier_depth)
            fed_anc = torch.cat(
                [
                    torch.cat([fed_anc, torch.zeros(bs, f, width, dtype=torch.bool, device=device)], dim=2),
                    torch.cat([rows, eye], dim=2),
                ],
                dim=1,
            )
            child_p, child_t = self._top(self._probs(logits), k)  # [bs, width, k]
            kk = child_t.shape[2]
            level_start += level_tokens.shape[1]
            frontier_depth += 1
            level_tokens = child_t.reshape(bs, width * kk)
            level_scores = (fed_scores.unsqueeze(2) * child_p).reshape(bs, width * kk)
            level_valid = fed_valid.repeat_interleave(kk, dim=1)
            level_depths = (fed_depths + 1).repeat_interleave(kk, dim=1)
            parent_fed = (f + torch.arange(width, device=device)).repeat_interleave(kk).expand(bs, width * kk)
            toks.append(level_tokens)
            scores.append(level_scores)
            parents.append(fed_cols.repeat_interleave(kk, dim=1))
            valids.append(level_valid)
            levels.append(torch.full_like(level_tokens, d))
            gate_scores = torch.where(level_valid, level_scores, 0.0)
        tokens_all = torch.cat(toks, dim=1)
        # The first ``r`` columns are the seeds, with their retrieval source and bin; every
        # other node is the draft's (its bin is set by pruning).
        drafted = tokens_all[:, r:]
        cands = Candidates(
            tokens=tokens_all,
            parents=torch.cat(parents, dim=1),
            scores=torch.cat(scores, dim=1).clamp(0.0, 1.0),
            sources=torch.cat([seed.sources, torch.full_like(drafted, int(Source.DRAFT))], dim=1),
            valid=torch.cat(valids, dim=1),
            bins=torch.cat([seed.bins, torch.zeros_like(drafted)], dim=1),
            levels=torch.cat(levels, dim=1),
        )
        return DraftOutput(cands, gates, forwards, read_tokens)

    # The draft's distributions live over *columns*: the draft head's kept ids with a head,
    # else the token ids below ``vocab_limit``.

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            logits = logits[..., : self.vocab_limit]
        return torch.softmax(logits.float(), dim=-1)

    def _top(self, probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most probable entries of each row: probabilities and token ids."""
        p, columns = probs.topk(min(k, probs.shape[-1]), dim=-1)
        return p, columns if self.head is None else self.head.ids[columns]

    def _columns(self, tokens: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's column (0 where it has none) and whether it has one."""
        cols = tokens if self.head is None else self.head.columns[tokens]
        known = (cols >= 0) & (cols < width)
        return torch.where(known, cols, 0), known


class _SeedForest(NamedTuple):
    tokens: torch.Tensor  # [bs, r] (0 where invalid, so it can be fed)
    parents: torch.Tensor  # [bs, r] earlier seed column, or -1 for the root
    valid: torch.Tensor  # [bs, r] the node and its whole path are valid
    depths: torch.Tensor  # [bs, r] 1 for children of the root
    ancestors: torch.Tensor  # [bs, r, r] ancestor-or-self
    sources: torch.Tensor  # [bs, r] the retrieval source that proposed each seed
    bins: torch.Tensor  # [bs, r] and its calibration bin there


def _seed_forest(seeds: Candidates | None, bs: int, device: torch.device) -> _SeedForest:
    """The seed nodes in the form the first draft forward feeds them (width 0 for none)."""
    if seeds is None or seeds.width == 0:
        z = torch.zeros(bs, 0, dtype=torch.int64, device=device)
        return _SeedForest(z, z, z.bool(), z, torch.zeros(bs, 0, 0, dtype=torch.bool, device=device), z, z)
    paths = summarise_paths(seeds)
    valid = seeds.valid & paths.valid
    return _SeedForest(
        torch.where(valid, seeds.tokens, 0), seeds.parents, valid, paths.depth, paths.ancestors, seeds.sources, seeds.bins
    )
