"""One small interface over the three retrieval sources.

Per decode round the engine calls, for the requests of the batch:

1. ``observe(...)`` with the verified tree: calibration learns from the outcome of every
   retrieved node, and the recycling table records the target's top-k at every position;
2. ``append(rid, tokens)`` with each request's accepted tokens (including the bonus);
3. ``propose(rids, budget)``: one ``Candidates`` for the batch, rooted at each request's
   last token, holding at most ``budget`` nodes per request, best first, all sources
   merged by score (duplicates across sources are left to grafting, which merges them).

Requests are opened with ``start_request`` and closed with ``finish_request`` (whose
tokens then feed the history index, if so configured) or ``abort_request``; both free all
of the request's state. The history index is also open to the engine's radix-cache glue
as ``retriever.history`` (``insert`` / ``evict`` per namespace).

Determinism: no randomness, wall time, set iteration or string hashing anywhere; the same
sequence of calls gives the same candidates in every process.

Two implementations of a round, one result: batched tensor ops (on the GPU, and for large
CPU batches) and, for small batches on the CPU, Python loops over host arrays that share
memory with the tensors (``host_loop_max_batch``). On the CPU every tensor op costs
microseconds of dispatch, so a round of a few dozen tiny ops costs more than looping over
its few dozen nodes; tests drive both paths with the same calls and compare every output.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from sglang_graft.candidates import SOURCE_NAMES, Candidates, Source
from sglang_graft.host_arrays import shared_array
from sglang_graft.retrieval.context import ContextIndex, TokenWindow
from sglang_graft.retrieval.continuations import EMPTY_PROPOSAL, HostProposal, Occurrence, continuation_tree
from sglang_graft.retrieval.history import HistoryIndex
from sglang_graft.retrieval.recycling import RecycledNodes, RecycledPicks, RecyclingTable
from sglang_graft.retrieval.scoring import RETRIEVAL_SOURCES, RetrievalCalibration
from sglang_graft.retrieval.selection import HostColumns, PackedCandidates, budget_list, select_top, select_top_host
from sglang_graft.retrieval.tokens import TokenIds, check_id_range, check_integer_ids, tensor_bounds, token_array
from sglang_graft.tree import TokenTree


@dataclass(frozen=True)
class RetrieverConfig:
    """Which sources run, and every bound they keep.

    Attributes:
        vocab_size: token ids lie in ``[0, vocab_size)``.
        recycling, context, history: enable each source.
        recycling_k: successors per token in the recycling table.
        recycling_max_nodes: rank paths a recycling proposal explores (its largest size).
        recycling_max_depth: deepest recycled node.
        context_ngram: suffix tokens a context match needs. 1 by default: a copy of a
            span of the prompt usually begins right after a token the target just
            emitted for itself, so the current suffix's last two tokens occur nowhere
            before; with 2, every copy lost its first round. Matches of one token are
            often chance, and the calibration (bucketed by match length) scores them so.
        history_ngram: suffix tokens a history match needs.
        max_match: match lengths are measured up to this cap.
        max_chain: hash-chain links examined per context or history lookup (32: a common
            token's latest 8 occurrences often hold none of its longer matches).
        max_occurrences: matches merged into one context or history proposal (2: more
            split the slots between continuations that agree less).
        max_continuation: deepest context or history node.
        below_min_match: ``propose_below`` continues a draft path only where the request's
            tokens followed by that path match an earlier span for at least this many
            tokens (shorter matches of a guessed path are too often chance).
        max_request_tokens: tokens kept per request (older halves are dropped beyond it).
        max_requests: open requests allowed at once (a leak guard: finish or abort them).
        history_max_tokens: token budget of the history index (LRU eviction beyond it).
        history_from_finished: feed finished requests into the history (the reference
            engine's mode; inside SGLang the radix-cache glue feeds it instead).
        prior_strength, decay: of the acceptance calibration (``AcceptanceCalibrator``).
        device: where the recycling table lives and the rounds run.
        output_device: where proposals are returned (and the trees to observe come
            from); None: ``device``. A GPU worker runs retrieval on the host
            (``device="cpu"``, host loops for small batches) and hands the GPU one copy of
            each round's proposals: the indexes are host structures, and on the device
            every round paid host syncs and a few hundred kernel launches.
        host_loop_max_batch: on the CPU, batches up to this size run ``propose`` and
            ``observe`` as Python loops over host arrays instead of tensor operations
            (same results; on small batches the ops' dispatch cost dominates); 0: never.
    """

    vocab_size: int
    recycling: bool = True
    context: bool = True
    history: bool = True
    recycling_k: int = 8
    recycling_max_nodes: int = 64
    recycling_max_depth: int = 6
    context_ngram: int = 1
    history_ngram: int = 3
    max_match: int = 64
    max_chain: int = 32
    max_occurrences: int = 2
    max_continuation: int = 16
    below_min_match: int = 4
    max_request_tokens: int = 1 << 20
    max_requests: int = 4096
    history_max_tokens: int = 1 << 22
    history_from_finished: bool = True
    prior_strength: float = 8.0
    decay: float = 0.999
    device: str = "cpu"
    output_device: str | None = None
    host_loop_max_batch: int = 8

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        for name in ("context_ngram", "history_ngram", "max_continuation", "max_requests", "below_min_match"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.host_loop_max_batch < 0:
            raise ValueError(f"host_loop_max_batch must be >= 0, got {self.host_loop_max_batch}")


@dataclass(eq=False)
class _Request:
    namespace: Hashable
    window: TokenWindow  # a ContextIndex when the context source is on


class Retriever:
    """Owns the enabled retrieval sources, their calibration and per-request state."""

    def __init__(self, config: RetrieverConfig) -> None:
        self.config = config
        self.device = _concrete(config.device)
        self.output_device = _concrete(config.output_device or config.device)
        self.recycling: RecyclingTable | None = None
        if config.recycling:
            self.recycling = RecyclingTable(
                config.vocab_size,
                config.recycling_k,
                max_nodes=config.recycling_max_nodes,
                max_depth=config.recycling_max_depth,
                device=self.device,
            )
        self.history: HistoryIndex | None = None
        if config.history:
            self.history = HistoryIndex(
                vocab_size=config.vocab_size,
                max_tokens=config.history_max_tokens,
                ngram=config.history_ngram,
                max_match=config.max_match,
                max_chain=config.max_chain,
                max_occurrences=config.max_occurrences,
            )
        self.calibration = RetrievalCalibration(config.recycling_k, config.prior_strength, config.decay, self.device)
        self._requests: dict[Hashable, _Request] = {}
        # Counts kept on the device (no sync): proposed nodes per Source, and verified nodes
        # per (Source, accepted) as cell ``2 * source + accepted``. On the CPU they live in
        # host arrays too, for the host loops.
        self._host_loops = self.device.type == "cpu" and config.host_loop_max_batch > 0
        self._host_proposed: array | None = None
        self._host_outcomes: array | None = None
        if self.device.type == "cpu":
            self._host_proposed, self._proposed = shared_array("q", len(Source), 0)
            self._host_outcomes, self._outcomes = shared_array("q", 2 * len(Source), 0)
        else:
            self._proposed = torch.zeros(len(Source), dtype=torch.int64, device=self.device)
            self._outcomes = torch.zeros(2 * len(Source), dtype=torch.int64, device=self.device)
        self._one = torch.ones((), dtype=torch.int64, device=self.device)

    # ----------------------------------------------------------------- lifecycle

    def start_request(self, rid: Hashable, prompt_ids: TokenIds, namespace: Hashable = None) -> None:
        """Open a request; its prompt must hold at least one token (the first root)."""
        if self._lookup(rid) is not None:
            raise ValueError(f"request {rid!r} is already started")
        if len(self._requests) >= self.config.max_requests:
            raise ValueError(
                f"cannot start request {rid!r}: {len(self._requests)} requests are open, "
                f"max_requests={self.config.max_requests} (finish or abort some)"
            )
        try:
            dict.fromkeys((namespace,))
        except TypeError:
            raise ValueError(f"namespace must be hashable, got {type(namespace).__name__}") from None
        tokens = token_array(prompt_ids, self.config.vocab_size, f"prompt of request {rid!r}")
        if not tokens:
            raise ValueError(f"prompt of request {rid!r} is empty; it needs at least one token")
        c = self.config
        window: TokenWindow
        if c.context:
            window = ContextIndex(
                tokens,
                vocab_size=c.vocab_size,
                ngram=c.context_ngram,
                max_match=c.max_match,
                max_chain=c.max_chain,
                max_occurrences=c.max_occurrences,
                max_tokens=c.max_request_tokens,
            )
        else:
            window = TokenWindow(tokens, c.max_request_tokens)
        self._requests[rid] = _Request(namespace, window)

    def append(self, rid: Hashable, new_token_ids: TokenIds) -> None:
        """Add a request's newly accepted tokens (the bonus token included)."""
        req = self._get(rid)
        req.window.extend(token_array(new_token_ids, self.config.vocab_size, f"tokens appended to request {rid!r}"))

    def finish_request(self, rid: Hashable) -> None:
        """Close a request; with ``history_from_finished`` its tokens enter the history."""
        req = self._get(rid)
        del self._requests[rid]
        if self.history is not None and self.config.history_from_finished:
            self.history.insert(req.namespace, req.window.tokens)

    def abort_request(self, rid: Hashable) -> None:
        """Close a request and forget it (nothing enters the history)."""
        self._get(rid)
        del self._requests[rid]

    # ----------------------------------------------------------------- rounds

    def propose(self, rids: Sequence[Hashable], budget: int | torch.Tensor) -> Candidates:
        """Retrieved candidates for a batch: at most ``budget`` nodes per request, best first.

        ``budget`` is an int for all requests or a ``[bs]`` integer tensor; 0 gives that
        request no valid node, and a batch whose budgets are all 0 gets ``Candidates.empty``.
        Negative budgets raise. The width is the largest budget (or less if every source
        is short); padding columns have ``valid`` False.
        """
        return self._propose(rids, budget).to(self.output_device)

    def _propose(self, rids: Sequence[Hashable], budget: int | torch.Tensor) -> Candidates:
        reqs = [self._get(rid) for rid in rids]
        bs = len(reqs)
        self._check_distinct(rids)
        budgets = budget_list(budget, bs)
        top = max(budgets, default=0)
        if top == 0:
            return Candidates.empty(bs, self.device)
        if self._on_host(bs):
            return self._propose_on_host(reqs, budgets, top)
        recycled = None
        if self.recycling is not None:
            roots = torch.frombuffer(array("q", [r.window.last_token for r in reqs]), dtype=torch.int64)
            rates = self.calibration.step_rates(Source.RECYCLING)
            recycled = self.recycling.expand_tokens(roots.to(self.device), rates)
        packed = self._pack(recycled, self._host_proposals(reqs, budgets))
        if packed is None:
            return Candidates.empty(bs, self.device)
        limit = budget.to(self.device) if isinstance(budget, torch.Tensor) else budget
        out = select_top(packed, limit, top)
        self._proposed.scatter_add_(0, out.sources.view(-1), out.valid.view(-1).long())
        return out

    def propose_below(self, rids: Sequence[Hashable], tree: TokenTree, anchors: int) -> Candidates | None:
        """Context continuations below the best draft nodes of each request's ``tree``.

        Retrieval proposes from the root, so at the start of a copied span (its first
        token fresh, the suffix new) it has nothing, while the draft model, which reads the
        context, often begins the copy. For each request, the ``anchors`` highest-scoring
        draft nodes whose path, appended to the request's tokens, matches an earlier span
        for at least ``below_min_match`` tokens get what followed that span, merged into a
        subtree as ``propose`` does (``ContextIndex.occurrences_after``), each node scored
        by the anchor's score times the context source's calibrated step rates.

        Returns the nodes in ``graft.graft_below``'s terms (a parent below ``n`` is that
        tree position, one at ``n + j`` is column ``j`` of this set; padding is invalid),
        or None when no path continues. Host work: the tree is read back once.
        """
        if anchors < 1:
            raise ValueError(f"anchors must be >= 1 draft node per request, got {anchors}")
        if not self.config.context:
            return None
        reqs = [self._get(rid) for rid in rids]
        n = tree.num_nodes
        draft = int(Source.DRAFT)
        rows: list[HostProposal] = []
        for req, tokens, parents, sources, scores in zip(
            reqs, *(t.tolist() for t in (tree.tokens, tree.parents, tree.sources, tree.scores))
        ):
            picks = sorted((i for i in range(1, n) if sources[i] == draft), key=lambda i: (-scores[i], i))[:anchors]
            row = HostProposal([], [], [], [])
            for anchor in picks:
                path: list[int] = []
                node = anchor
                while node > 0:
                    path.append(tokens[node])
                    node = parents[node]
                path.reverse()
                found = req.window.occurrences_after(path, n - 1 - len(path), self.config.below_min_match)
                if not found:
                    continue
                sub = continuation_tree(found, n - 1, self.calibration.step_rates(Source.CONTEXT))
                first = n + len(row.tokens)
                row.tokens.extend(sub.tokens)
                row.parents.extend(anchor if p < 0 else first + p for p in sub.parents)
                row.scores.extend(scores[anchor] * s for s in sub.scores)
                row.bins.extend(sub.bins)
            rows.append(row)
        width = max(len(r.tokens) for r in rows)
        if width == 0:
            return None
        pad = [width - len(r.tokens) for r in rows]
        self._proposed[int(Source.CONTEXT)] += width * len(rows) - sum(pad)

        def padded(values: list[list[float]] | list[list[int]], fill: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([v + [fill] * p for v, p in zip(values, pad)], dtype=dtype, device=self.device)

        valid = padded([[True] * len(r.tokens) for r in rows], False, torch.bool)
        return Candidates(
            tokens=padded([r.tokens for r in rows], 0, torch.int64),
            parents=padded([r.parents for r in rows], 0, torch.int64),
            scores=padded([r.scores for r in rows], 0.0, torch.float32),
            sources=torch.where(valid, int(Source.CONTEXT), int(Source.FILLER)),
            valid=valid,
            bins=padded([r.bins for r in rows], 0, torch.int64),
        ).to(self.output_device)

    def observe(
        self,
        rids: Sequence[Hashable],
        tree_tokens: torch.Tensor,
        tree_parents: torch.Tensor,
        tree_sources: torch.Tensor,
        accepted_mask: torch.Tensor,
        target_topk: torch.Tensor | None = None,
        *,
        tree_bins: torch.Tensor,
        target_logits: torch.Tensor | None = None,
    ) -> None:
        """Learn from one verify round.

        Args:
            rids: the requests of the batch, in row order.
            tree_tokens, tree_parents, tree_sources, tree_bins: ``[bs, n]`` the verified
                tree (``TokenTree`` layout: column 0 is the root, parent -1; every other
                node's parent is an earlier column; ``bins`` as proposed).
            accepted_mask: ``[bs, n]`` bool, the accepted path (the root counts as
                accepted whatever its entry says).
            target_topk: ``[bs, n, k]`` the target's top-k ids at every tree position,
                for the recycling table; or pass ``target_logits`` ``[bs, n, vocab]``.
                With neither, the table is not updated this round.
        """
        for rid in rids:
            self._get(rid)
        self._check_distinct(rids)
        bs = len(rids)
        if tree_tokens.dim() != 2 or tree_tokens.shape[0] != bs or tree_tokens.shape[1] < 1:
            raise ValueError(f"tree_tokens must be [bs={bs}, n>=1], got shape {tuple(tree_tokens.shape)}")
        shape = tree_tokens.shape
        for name, t in (
            ("tree_parents", tree_parents),
            ("tree_sources", tree_sources),
            ("tree_bins", tree_bins),
            ("accepted_mask", accepted_mask),
        ):
            if t.shape != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like tree_tokens")
        if bs == 0:
            return
        if tree_tokens.device != self.device:
            if self.recycling is not None and target_logits is not None and target_topk is None:
                target_topk = self.recycling.target_ids(tree_tokens, None, logits=target_logits)  # where the logits are
                target_logits = None
            tree_tokens, tree_parents, tree_sources, tree_bins, accepted_mask, target_topk = _fetch(
                self.device, tree_tokens, tree_parents, tree_sources, tree_bins, accepted_mask, target_topk
            )
        recycle = self.recycling is not None and (target_topk is not None or target_logits is not None)
        ids = None
        if recycle:
            assert self.recycling is not None
            ids = self.recycling.target_ids(tree_tokens, target_topk, logits=target_logits)
            check_integer_ids("recycling tokens", tree_tokens)
        if self._on_host(bs):
            self._observe_on_host(tree_tokens, tree_parents, tree_sources, tree_bins, accepted_mask, ids)
            return
        checked = [tree_sources] if ids is None else [tree_sources, tree_tokens, ids]
        self._check_tree_bounds(tensor_bounds([t for t in checked if t.numel()]))
        sources = tree_sources.long()
        accepted = accepted_mask.bool()
        self.calibration.observe(tree_parents.long(), sources, tree_bins.long(), accepted)
        # One accumulate for both verified and accepted counts: cell ``2 * source + accepted``.
        self._outcomes.index_put_(((sources * 2 + accepted).view(-1),), self._one, accumulate=True)
        if ids is not None:
            assert self.recycling is not None
            self.recycling.write(tree_tokens, ids)

    # ----------------------------------------------------------------- reports

    def stats(self) -> dict[str, object]:
        """Per-source counts and acceptance, history occupancy, open requests, memory."""
        proposed = self._proposed.tolist()
        outcomes = self._outcomes.tolist()
        accepted = outcomes[1::2]
        verified = [r + a for r, a in zip(outcomes[::2], accepted)]
        enabled = {
            Source.RECYCLING: self.recycling is not None,
            Source.CONTEXT: self.config.context,
            Source.HISTORY: self.history is not None,
        }
        out: dict[str, object] = {}
        for s in RETRIEVAL_SOURCES:
            out[SOURCE_NAMES[s]] = {
                "enabled": enabled[s],
                "proposed": proposed[s],
                "verified": verified[s],
                "accepted": accepted[s],
                "acceptance_rate": accepted[s] / verified[s] if verified[s] else None,
            }
        if self.history is not None:
            out["history_index"] = {
                "sequences": self.history.num_sequences,
                "tokens": self.history.num_tokens,
                "namespaces": self.history.num_namespaces,
                "evicted": self.history.num_evicted,
            }
        out["requests"] = len(self._requests)
        out["memory_bytes"] = self.memory_bytes()
        return out

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by each structure (host dictionaries estimated)."""
        return {
            "recycling": 0 if self.recycling is None else self.recycling.memory_bytes(),
            "context": sum(r.window.memory_bytes() for r in self._requests.values()),
            "history": 0 if self.history is None else self.history.memory_bytes(),
        }

    # ----------------------------------------------------------------- internals

    def _lookup(self, rid: Hashable) -> _Request | None:
        try:
            return self._requests.get(rid)
        except TypeError:
            raise ValueError(f"request id must be hashable, got {type(rid).__name__}") from None

    def _get(self, rid: Hashable) -> _Request:
        req = self._lookup(rid)
        if req is None:
            raise ValueError(f"unknown request {rid!r} (not started, or already finished or aborted)")
        return req

    def _on_host(self, bs: int) -> bool:
        """Whether a round of ``bs`` requests runs as host loops (CPU, small batches)."""
        return self._host_loops and bs <= self.config.host_loop_max_batch

    @staticmethod
    def _check_distinct(rids: Sequence[Hashable]) -> None:
        if len(rids) > 1 and len(dict.fromkeys(rids)) != len(rids):
            raise ValueError(f"request ids in a batch must be distinct, got {list(rids)!r}")

    def _check_tree_bounds(self, bounds: list[tuple[int, int]]) -> None:
        """Range-check the ``(min, max)`` of the verified tree's sources (and, when recycling
        records them, of its tokens and the target's ids): an id outside its range would
        silently corrupt a shared table. (The tensor path reads them with one host sync.)"""
        lo, hi = bounds[0]
        if lo < 0 or hi >= len(Source):
            raise ValueError(f"tree_sources holds {lo if lo < 0 else hi}, outside the Source codes [0, {len(Source)})")
        vocab = self.config.vocab_size
        for what, (lo, hi) in zip(("recycling tokens", "recycling topk_ids"), bounds[1:]):
            check_id_range(what, lo, hi, vocab)

    def _tree(self, occurrences: list[Occurrence], budget: int, source: Source) -> HostProposal:
        """``continuation_tree`` scored with ``source``'s rates, which are only computed
        (from the calibration counts) when there is something to score."""
        if not occurrences:
            return EMPTY_PROPOSAL
        return continuation_tree(occurrences, budget, self.calibration.step_rates(source))

    def _host_proposals(self, reqs: list[_Request], budgets: list[int]) -> list[tuple[HostProposal, HostProposal]]:
        """Context and history proposals of every request (none when both are off)."""
        if not self.config.context and self.history is None:
            return []
        proposals = []
        for req, b in zip(reqs, budgets):
            depth = min(b, self.config.max_continuation)
            ctx = self._tree(req.window.occurrences(depth), b, Source.CONTEXT)
            hist = EMPTY_PROPOSAL
            if self.history is not None:
                hist = self._tree(self.history.occurrences(req.namespace, req.window.tokens, depth), b, Source.HISTORY)
            proposals.append((ctx, hist))
        return proposals

    def _pack(
        self, recycled: RecycledNodes | None, proposals: list[tuple[HostProposal, HostProposal]]
    ) -> PackedCandidates | None:
        """All proposals of the batch in one padded block: recycled nodes first, then each
        request's context and history nodes.

        Only the recycled tokens live on the device; every other field is known on the
        host, so it is laid out there and copied once (when there are host proposals at
        all: otherwise the recycling table's own packing is used).
        """
        width = max((len(c.tokens) + len(h.tokens) for c, h in proposals), default=0)
        if width == 0:
            if recycled is None:
                return None
            assert self.recycling is not None
            return self.recycling.pack(recycled)
        bs = len(proposals)
        n_rec = 0 if recycled is None else len(recycled.scores)
        tokens, parents, sources, bins = array("q"), array("q"), array("q"), array("q")
        scores = array("f")
        rec_parents, rec_sources, rec_bins, rec_scores = array("q"), array("q"), array("q"), array("f")
        if recycled is not None:
            rec_parents = array("q", recycled.parents)
            rec_sources = array("q", [int(Source.RECYCLING)]) * n_rec
            rec_bins = array("q", recycled.ranks)
            rec_scores = array("f", recycled.scores)
        for ctx, hist in proposals:
            nc, nh = len(ctx.tokens), len(hist.tokens)
            pad = width - nc - nh
            tokens.extend(ctx.tokens)
            tokens.extend(hist.tokens)
            tokens.extend([-1] * pad)
            parents.extend(rec_parents)
            parents.extend(_block_parents(ctx, hist, n_rec))
            parents.extend([-1] * pad)
            sources.extend(rec_sources)
            sources.extend([int(Source.CONTEXT)] * nc + [int(Source.HISTORY)] * nh + [int(Source.FILLER)] * pad)
            bins.extend(rec_bins)
            bins.extend(ctx.bins)
            bins.extend(hist.bins)
            bins.extend([0] * pad)
            scores.extend(rec_scores)
            scores.extend(ctx.scores)
            scores.extend(hist.scores)
            scores.extend([0.0] * pad)
        m = n_rec + width
        host_tokens = torch.frombuffer(tokens, dtype=torch.int64).view(bs, width).to(self.device)
        all_tokens = host_tokens if recycled is None else torch.cat([recycled.tokens, host_tokens], dim=1)
        rest = torch.frombuffer(parents + sources + bins, dtype=torch.int64).view(3, bs, m).to(self.device)
        return PackedCandidates(
            torch.cat([all_tokens.unsqueeze(0), rest]),
            torch.frombuffer(scores, dtype=torch.float32).view(bs, m).to(self.device),
        )

    def _propose_on_host(self, reqs: list[_Request], budgets: list[int], top: int) -> Candidates:
        """``propose``'s tensor path as host loops (CPU, small batches): the same kept nodes.

        Only nodes that can make a request's top ``top`` are listed: its ``top`` best known
        recycled nodes and every context and history node.
        """
        bs = len(reqs)
        proposals = self._host_proposals(reqs, budgets) or [(EMPTY_PROPOSAL, EMPTY_PROPOSAL)] * bs
        picks = RecycledPicks([], [], [], [[]] * bs, [[]] * bs)
        if self.recycling is not None:
            rates = self.calibration.step_rates(Source.RECYCLING)
            picks = self.recycling.best_existing([r.window.last_token for r in reqs], rates, top)
        n_rec = len(picks.scores)
        width = min(top, n_rec + max(len(c.tokens) + len(h.tokens) for c, h in proposals))
        rows = []
        for (ctx, hist), nodes, tokens in zip(proposals, picks.nodes, picks.tokens):
            nc, nh = len(ctx.tokens), len(hist.tokens)
            rows.append(
                HostColumns(
                    columns=nodes + list(range(n_rec, n_rec + nc + nh)),
                    tokens=tokens + ctx.tokens + hist.tokens,
                    parents=[picks.parents[j] for j in nodes]
                    + _block_parents(ctx, hist, n_rec),
                    sources=[int(Source.RECYCLING)] * len(nodes)
                    + [int(Source.CONTEXT)] * nc
                    + [int(Source.HISTORY)] * nh,
                    bins=[picks.ranks[j] for j in nodes] + ctx.bins + hist.bins,
                    scores=[picks.scores[j] for j in nodes] + array("f", ctx.scores + hist.scores).tolist(),
                )
            )
        assert self._host_proposed is not None
        return select_top_host(rows, budgets, width, self._host_proposed)

    def _observe_on_host(
        self,
        tree_tokens: torch.Tensor,
        tree_parents: torch.Tensor,
        tree_sources: torch.Tensor,
        tree_bins: torch.Tensor,
        accepted_mask: torch.Tensor,
        ids: torch.Tensor | None,
    ) -> None:
        """``observe``'s tensor path as host loops (CPU, small batches): the same updates."""
        sources = tree_sources.tolist()
        accepted = (accepted_mask if accepted_mask.dtype == torch.bool else accepted_mask.bool()).tolist()
        flat_sources = [s for row in sources for s in row]
        bounds = [(min(flat_sources), max(flat_sources))]
        flat_tokens: list[int] = []
        flat_ids: list[int] = []
        if ids is not None:  # the tokens only matter to the recycling table
            flat_tokens = [t for row in tree_tokens.tolist() for t in row]
            bounds.append((min(flat_tokens), max(flat_tokens)))
            if ids.numel():
                flat_ids = ids.reshape(-1).tolist()
                bounds.append((min(flat_ids), max(flat_ids)))
        self._check_tree_bounds(bounds)
        self.calibration.observe_rows(tree_parents.tolist(), sources, tree_bins.tolist(), accepted)
        outcomes = self._host_outcomes
        assert outcomes is not None
        for row_sources, row_accepted in zip(sources, accepted):
            for source, acc in zip(row_sources, row_accepted):
                outcomes[2 * source + acc] += 1
        if ids is not None:
            assert self.recycling is not None
            self.recycling.write_rows(flat_tokens, array("i", flat_ids), ids.shape[-1])


def _block_parents(ctx: HostProposal, hist: HostProposal, first: int) -> list[int]:
    """The parents of a request's context then history nodes, as columns of a packed block
    where the context nodes start at column ``first`` (-1 stays the root)."""
    return [p + first if p >= 0 else -1 for p in ctx.parents] + [
        p + first + len(ctx.tokens) if p >= 0 else -1 for p in hist.parents
    ]


def _fetch(device: torch.device, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``[bs, n, ...]`` integer tensors (a ``None`` stays None) moved to ``device`` in one
    copy: one host sync per round instead of one per tensor."""
    present = [t for t in tensors if t is not None]
    bs, n = present[0].shape[:2]
    widths = [t[0, 0].numel() for t in present]
    packed = torch.cat([t.reshape(bs, n, -1).long() for t in present], dim=2).to(device)
    parts = iter(torch.split(packed, widths, dim=2))
    out: list[torch.Tensor | None] = []
    for t in tensors:
        out.append(None if t is None else next(parts).reshape(t.shape).to(t.dtype))
    return out


def _concrete(device: str) -> torch.device:
    """The device as its tensors report it (``cuda`` is ``cuda:0`` there), so that
    comparing it with a tensor's device means what it says."""
    return torch.empty(0, device=device).device
