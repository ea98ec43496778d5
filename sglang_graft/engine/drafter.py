"""Draft models: propose a dynamic token tree the EAGLE-2 way.

A ``Drafter`` turns the newly verified tokens of each request into draft ``Candidates``
(tokens, parents, raw cumulative draft probabilities). ``ModelDrafter`` does it with a
smaller causal LM that shares the target's tokenizer and keeps its own KV cache:

1. one forward over the tokens it has not read yet (at its first draft the whole prompt;
   later, the tokens verified since it last drafted; both end with the new root and are
   left-padded across the batch) gives the root's next-token distribution; its top-k
   are depth 1;
2. each further level expands the ``topk`` best nodes of the previous level (by cumulative
   probability) in one forward: all of them at once, with a tree attention mask over the
   draft's own cache (each node sees the verified prefix and its own ancestors only);
3. after every level the caller's gate (``continues``) says which requests may go deeper;
   drafting stops for the batch once none may;
4. the tree nodes' KV stays until the next round: the fed nodes that lie on the path the
   target accepted are kept (their KV is exactly a causal forward over that path), the
   rest dropped, so next round's first forward reads only what the draft never saw,
   usually just the new root.

Another drafter (an EAGLE-3 head reading the target's hidden states, say) only has to
implement the same two methods.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch

from sglang_graft.candidates import Candidates, Source
from sglang_graft.engine.kv import PaddedKV, causal_block

#: ``continues(depth, level_scores [bs, w]) -> [bs] bool``: may each request draft deeper.
ContinueFn = Callable[[int, torch.Tensor], torch.Tensor]


class DraftOutput(NamedTuple):
    candidates: Candidates  # all drafted nodes, level by level (parents precede children)
    continues: list[torch.Tensor]  # the gate's answer after each level but the last
    forwards: int  # draft model forwards this round


class Drafter(Protocol):
    """What the engine needs from a drafter."""

    def draft(self, tokens: torch.Tensor, valid: torch.Tensor, continues: ContinueFn) -> DraftOutput:
        """Read the tokens not read yet (``[bs, q]``, left-padded, ``valid`` marks real ones;
        the last column is each request's root; at the first draft, the prompt) and draft."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the requests ``rows`` (finished ones leave the batch)."""


class ModelDrafter:
    """EAGLE-2-style dynamic tree drafting with a small causal LM.

    Args:
        model: the draft model (same tokenizer as the target).
        topk: children per expanded node, and nodes expanded per level.
        depth: most levels drafted per round.
        vocab_limit: the target's vocabulary size; draft logits beyond it are ignored.
        batch_size, device: of the batch being decoded.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        topk: int,
        depth: int,
        vocab_limit: int,
        batch_size: int,
        device: torch.device | str,
    ) -> None:
        if topk < 1 or depth < 1:
            raise ValueError(f"draft topk and depth must be >= 1, got topk={topk}, depth={depth}")
        self.model = model
        self.topk = topk
        self.depth = depth
        self.vocab_limit = vocab_limit
        self.kv = PaddedKV(batch_size, device)
        # Tree nodes fed last round, per level: (tokens [bs, w], parent fed index [bs, w]
        # (-1: the root), fed index of the level's first node). Their KV sits in the cache
        # right after the verified columns, in fed-index order.
        self._fed: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def select_rows(self, rows: torch.Tensor) -> None:
        self._drop_tree()
        self.kv.select_rows(rows)

    def _drop_tree(self) -> None:
        if self._fed:
            self.kv.commit(self.kv.valid.clone())
            self._fed = []

    def _reuse(self, tokens: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the KV of last round's fed nodes that match the newly verified tokens.

        Walks the fed levels once (batched over requests): a node matches when its parent
        matched and its token is the next verified one. The root (last token) is never
        matched: its logits are needed. Returns the tokens still to be read.
        """
        if not self._fed:
            return tokens, valid
        kv = self.kv
        bs, q = tokens.shape
        device = tokens.device
        rows = torch.arange(bs, device=device)
        count = valid.sum(dim=1)
        first = q - count
        num_fed = sum(t.shape[1] for t, _, _ in self._fed)
        keep_fed = torch.zeros(bs, num_fed, dtype=torch.bool, device=device)
        cur = torch.full((bs,), -1, dtype=torch.int64, device=device)
        alive = torch.ones(bs, dtype=torch.bool, device=device)
        matched = torch.zeros(bs, dtype=torch.int64, device=device)
        for level, (lt, lp, start) in enumerate(self._fed):
            tok = tokens.gather(1, (first + level).clamp(max=q - 1).unsqueeze(1))
            alive = alive & (level < count - 1)
            hit = (lp == cur.unsqueeze(1)) & (lt == tok) & alive.unsqueeze(1)
            found = hit.any(dim=1)
            idx = hit.long().argmax(dim=1) + start
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

    def draft(self, tokens: torch.Tensor, valid: torch.Tensor, continues: ContinueFn) -> DraftOutput:
        kv = self.kv
        tokens, valid = self._reuse(tokens, valid)
        bs, q = tokens.shape
        k = self.topk
        device = tokens.device
        offsets, block = causal_block(valid)
        logits = kv.forward(self.model, tokens, kv.lengths.unsqueeze(1) + offsets, block, logits_to_keep=1)
        kv.valid[:, -q:] = valid
        kv.lengths = kv.lengths + valid.sum(dim=1)
        committed = kv.width
        probs = self._probs(logits[:, -1])
        level_scores, level_tokens = probs.topk(min(k, probs.shape[-1]), dim=-1)
        toks = [level_tokens]
        scores = [level_scores]
        parents = [torch.full_like(level_tokens, -1)]
        gates: list[torch.Tensor] = []
        forwards = 1
        level_start = 0  # candidate column of the current level's first node
        fed_anc = torch.zeros(bs, 0, 0, dtype=torch.bool, device=device)  # ancestor-or-self among fed nodes
        parent_fed = torch.full_like(level_tokens, -1)  # fed index of each current-level node's parent
        for d in range(2, self.depth + 1):
            go = continues(d - 1, level_scores)
            gates.append(go)
            if not bool(go.any()):
                break
            width = min(k, level_scores.shape[1])
            best = level_scores.topk(width, dim=1).indices  # [bs, width] local columns
            fed_tokens = level_tokens.gather(1, best)
            fed_scores = level_scores.gather(1, best)
            fed_cols = level_start + best
            # Each fed node sees its parent's ancestors (none when the parent is the root) and itself.
            f = fed_anc.shape[1]
            par = parent_fed.gather(1, best)
            rows = fed_anc.gather(1, par.clamp(min=0).unsqueeze(2).expand(bs, width, f)) & (par >= 0).unsqueeze(2)
            prefix = torch.cat([kv.valid[:, :committed].unsqueeze(1).expand(bs, width, committed), rows], dim=2)
            eye = torch.eye(width, dtype=torch.bool, device=device).expand(bs, width, width)
            positions = (kv.lengths + d - 2).unsqueeze(1).expand(bs, width)
            logits = kv.forward(self.model, fed_tokens, positions, eye, prefix_mask=prefix)
            forwards += 1
            self._fed.append((fed_tokens, par, f))
            fed_anc = torch.cat(
                [
                    torch.cat([fed_anc, torch.zeros(bs, f, width, dtype=torch.bool, device=device)], dim=2),
                    torch.cat([rows, eye], dim=2),
                ],
                dim=1,
            )
            child_p, child_t = self._probs(logits).topk(min(k, self.vocab_limit), dim=-1)  # [bs, width, k]
            kk = child_t.shape[2]
            level_start += level_tokens.shape[1]
            level_tokens = child_t.reshape(bs, width * kk)
            level_scores = (fed_scores.unsqueeze(2) * child_p).reshape(bs, width * kk)
            parent_fed = (f + torch.arange(width, device=device)).repeat_interleave(kk).expand(bs, width * kk)
            toks.append(level_tokens)
            scores.append(level_scores)
            parents.append(fed_cols.repeat_interleave(kk, dim=1))
        tokens_all = torch.cat(toks, dim=1)
        cands = Candidates(
            tokens=tokens_all,
            parents=torch.cat(parents, dim=1),
            scores=torch.cat(scores, dim=1).clamp(0.0, 1.0),
            sources=torch.full_like(tokens_all, int(Source.DRAFT)),
            valid=torch.ones_like(tokens_all, dtype=torch.bool),
        )
        return DraftOutput(cands, gates, forwards)

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits[..., : self.vocab_limit].float(), dim=-1)
