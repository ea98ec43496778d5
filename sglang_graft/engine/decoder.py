"""The reference speculative decoder: one code path for every policy, on transformers.

Invariant between rounds: the target's cache holds every verified token of a request
except the last one, the *root*. A round then is

1. **propose**: the drafter reads the tokens verified last round and drafts a tree
   (dense / pruned / graft), the ``GraftScheduler`` prunes and grafts retrieval into it
   (every speculative policy is a ``SchedulerConfig``); ``ar`` proposes nothing, so its
   tree is the root alone and the round is a plain decoding step;
2. **verify**: one target forward over the root and the tree with a 4D ancestor mask at
   positions ``length + depth``, then greedy or rejection-sampled acceptance from the core
   (``verify.greedy_accept`` / ``verify.verify_tree_sampled``);
3. **compact**: the target cache keeps exactly the accepted path's KV (the root included);
   the bonus token becomes the next root;
4. **learn**: the scheduler observes the outcome (gate calibration, retrieval calibration,
   the recycling table fed with the target's top-k at every node).

The prompt's last token is the first root, so even the first generated token comes out of
a verify step: greedy and sampled outputs of every policy are produced by the same code.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from sglang_graft.candidates import SOURCE_NAMES, Source
from sglang_graft.cost import RoundCost
from sglang_graft.cost_meter import CostMeter
from sglang_graft.engine.config import EngineConfig, SamplingConfig
from sglang_graft.engine.draft_head import DraftHead
from sglang_graft.engine.draft_int8 import int8_draft, span_reader
from sglang_graft.engine.drafter import Drafter, ModelDrafter
from sglang_graft.engine.kv import PaddedKV, left_pad
from sglang_graft.engine.models import weight_cost_ratio
from sglang_graft.engine.outputs import BatchOutput, RequestOutput
from sglang_graft.retrieval import Retriever, RetrieverConfig
from sglang_graft.scheduler import GraftScheduler, accepted_mask_from_nodes
from sglang_graft.tree import TokenTree
from sglang_graft.verify import SampledVerify, greedy_accept, target_distribution, verify_tree_sampled

logger = logging.getLogger(__name__)

#: Target top-k recorded per verified node for token recycling (and the top-2 margin).
_RECYCLING_K = 8


class SpecEngine:
    """Decodes batches of prompts with one policy; learned state persists across calls.

    Args:
        target: the target causal LM.
        draft: the draft causal LM (needed by ``dense``, ``pruned`` and ``graft``).
        config: the policy and its tree settings.
        stop_token_ids: a request ends after emitting one of these.
        retriever: retrieval sources for ``retrieval`` / ``graft`` (default: all three, sized
            to the target's vocabulary). Its history index fills with finished requests.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | None,
        config: EngineConfig,
        stop_token_ids: Sequence[int] = (),
        retriever: Retriever | None = None,
    ) -> None:
        if config.uses_draft and draft is None:
            raise ValueError(f"policy {config.policy!r} needs a draft model")
        if draft is not None and config.draft_int8 and config.uses_draft:
            draft = int8_draft(draft, config.draft_int8_kernel)
        if draft is not None and config.draft_cost_ratio is None:
            ratio = weight_cost_ratio(draft, target, config.draft_vocab)
            config = dataclasses.replace(config, draft_cost_ratio=ratio)
        self.target = target
        self.draft = draft
        self.config = config
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.device = next(target.parameters()).device
        self.vocab_size = int(target.config.get_text_config().vocab_size)
        if config.uses_retrieval and retriever is None:
            retriever = Retriever(
                RetrieverConfig(vocab_size=self.vocab_size, recycling_k=_RECYCLING_K, output_device=str(self.device))
            )
        self.retriever = retriever if config.uses_retrieval else None
        sched = config.scheduler_config()
        self.scheduler = None if sched is None else GraftScheduler(sched, self.retriever, device=self.device)
        # Plain decoding (no scheduler) verifies one token a round: one step on any curve.
        verify = self.scheduler.verify_cost if self.scheduler is not None else None
        self.round_cost = RoundCost(verify, config.draft_cost_ratio or 0.0, config.resolved_read_cost)
        # Learned forward costs (``online_costs``): only a policy that trims its trees prices them.
        self.meter: CostMeter | None = None
        if config.online_costs:
            if config.verify_costs is None:
                raise ValueError(
                    "online_costs needs verify_costs to start from (the CLI's --verify-costs auto measures them)"
                )
            if self.scheduler is not None and self.scheduler.config.trims:
                self.meter = CostMeter(
                    self.scheduler.verify_cost,
                    config.draft_cost_ratio or 1.0,
                    config.resolved_read_cost,
                    config.num_nodes,
                )
        self._rid_counter = itertools.count()

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """Raise ``ValueError`` on an empty batch, an empty prompt, an id outside the
        vocabulary, or a request longer than a model's context window."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not prompts:
            raise ValueError("no prompts to generate from")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; it needs at least one token")
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"prompt {i} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
            self._check_context(i, len(p), max_new_tokens)

    def _check_context(self, i: int, length: int, max_new_tokens: int) -> None:
        """A request must fit the positions each model was trained for: past them a rotary
        model keeps going but computes what it never learned, silently."""
        reads = [("target", self.target, length)]
        if self.draft is not None and self.config.uses_draft:
            window = self.config.draft_window  # the draft reads only the prompt's last ``window`` tokens
            reads.append(("draft", self.draft, min(length, window) if window else length))
        for name, model, read in reads:
            limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
            if limit and read + max_new_tokens > limit:
                room = limit - read
                fix = f"lower max_new_tokens to at most {room}" if room >= 1 else f"shorten it below {limit} tokens"
                raise ValueError(
                    f"prompt {i} ({length} tokens) with max_new_tokens {max_new_tokens} needs "
                    f"{read + max_new_tokens} positions of the {name} model, whose context window is {limit} "
                    f"(max_position_embeddings): {fix}"
                )

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        sampling: SamplingConfig = SamplingConfig(),
        seed: int = 0,
        progress: bool = False,
    ) -> BatchOutput:
        """Generate up to ``max_new_tokens`` for every prompt (a batch, one tree each)."""
        start = time.perf_counter()
        run = self.start(prompts, max_new_tokens, sampling, seed, progress)
        run.decode()
        if self.meter is not None:
            logger.info("%s: online costs after this batch: %s", self.config.policy, self.meter.flags())
        return BatchOutput(run.outputs, time.perf_counter() - start)

    @torch.inference_mode()
    def start(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        sampling: SamplingConfig = SamplingConfig(),
        seed: int = 0,
        progress: bool = False,
    ) -> "DecodeRun":
        """Check the prompts, prefill the target's cache and return the run, ready for its rounds."""
        self.check_prompts(prompts, max_new_tokens)
        return DecodeRun(self, [list(map(int, p)) for p in prompts], max_new_tokens, sampling, seed, progress)


class DecodeRun:
    """The state of one ``generate`` call; rows leave the batch as their requests finish.

    ``SpecEngine.generate`` runs it to the end; tests step it with ``round()`` to inspect
    the caches in between.
    """

    def __init__(
        self,
        engine: SpecEngine,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingConfig,
        seed: int,
        progress: bool,
    ) -> None:
        self.e = engine
        self.sampling = sampling
        self.max_new_tokens = max_new_tokens
        device = engine.device
        bs = len(prompts)
        self.outputs = [RequestOutput() for _ in prompts]
        self.rows = list(range(bs))  # row -> request index
        self.rids = [f"g{next(engine._rid_counter)}" for _ in prompts]
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.bar = tqdm(total=bs * max_new_tokens, desc=engine.config.policy, unit="tok", disable=not progress, leave=False)
        heads, head_valid = left_pad([p[:-1] for p in prompts], 0, device)
        self.target_kv = PaddedKV(bs, device)
        start = _clock(device)
        self.target_kv.prefill(engine.target, heads, head_valid)
        prefill_s = _clock(device) - start
        for out in self.outputs:
            out.prefill_s = prefill_s
        self.drafter: Drafter | None = None
        if engine.config.uses_draft:
            assert engine.draft is not None
            c = engine.config
            head = DraftHead(engine.draft, c.draft_vocab, prompts, engine.vocab_size) if c.draft_vocab else None
            self.drafter = ModelDrafter(
                engine.draft, c.draft_topk, c.draft_depth, engine.vocab_size, bs, device, head, span_reader(engine.draft)
            )
        if engine.retriever is not None:
            for rid, p in zip(self.rids, prompts):
                engine.retriever.start_request(rid, p)
        self.roots = torch.tensor([p[-1] for p in prompts], dtype=torch.int64, device=device)
        # Tokens the drafter has yet to read (right-aligned; the last is the root). It reads
        # the prompt lazily, at its first draft: rounds that skip drafting cost no draft prefill.
        window = engine.config.draft_window
        self.pending, self.pending_valid = left_pad([p[-window:] for p in prompts] if window else prompts, 0, device)

    @torch.inference_mode()
    def decode(self) -> None:
        """Run rounds until every request has finished."""
        try:
            while self.rows:
                self.round()
        finally:
            self.bar.close()
            if self.e.retriever is not None:
                for rid in self.rids:
                    self.e.retriever.abort_request(rid)

    def propose(self) -> tuple[TokenTree, int, int]:
        """This round's tree, the draft forwards it took and the tokens the drafter read first."""
        e = self.e
        if e.scheduler is None:
            return _root_only(self.roots), 0, 0
        retrieved = e.scheduler.retrieve(self.rids)
        drafts, gates, forwards, read, seeds = None, [], 0, 0, None
        if self.drafter is not None and e.scheduler.wants_draft(
            retrieved, self.pending_valid.sum(dim=1), self.drafter.cold()
        ):
            seeds = retrieved if e.config.seed_draft else None
            start = _clock(e.device) if e.meter is not None else 0.0
            drafts, gates, forwards, read = self.drafter.draft(
                self.pending, self.pending_valid, e.scheduler.draft_continues, seeds
            )
            if e.meter is not None:
                e.meter.observe_draft(forwards, read, _clock(e.device) - start)
        tree = e.scheduler.build_tree(self.rids, self.roots, drafts, gates, retrieved, seeded=seeds is not None).tree
        return tree, forwards, read

    def verify(self, tree: TokenTree) -> tuple[SampledVerify, torch.Tensor]:
        """One target forward over the tree; returns the acceptance and the logits."""
        kv = self.target_kv
        positions = kv.lengths.unsqueeze(1) + tree.depths
        logits = kv.forward(self.e.target, tree.tokens, positions, tree.ancestors)
        next_token, next_sibling = tree.child_links()
        s = self.sampling
        if s.greedy:
            # ``max`` picks the first maximum, as ``argmax`` does, and on the CPU reduces bf16
            # logits 4.7x faster (16 x 151,936: 0.96 against 4.48 ms on 2 cores).
            return greedy_accept(tree.tokens, next_token, next_sibling, logits.max(dim=-1).indices), logits
        probs = target_distribution(logits, s.temperature, s.top_p, s.top_k)
        bs, n = tree.tokens.shape
        uniforms = torch.rand(bs, n, generator=self.generator, device=logits.device)
        bonus_u = torch.rand(bs, generator=self.generator, device=logits.device)
        return verify_tree_sampled(tree.tokens, next_token, next_sibling, probs, uniforms, bonus_u), logits

    @torch.inference_mode()
    def round(self) -> None:
        """One propose-verify-compact-learn round for every unfinished request."""
        e = self.e
        tree, draft_forwards, read_tokens = self.propose()
        start = _clock(e.device) if e.meter is not None else 0.0
        result, logits = self.verify(tree)
        n = tree.num_nodes
        if e.meter is not None:
            e.meter.observe_verify(len(self.rows) * n, _clock(e.device) - start)
        cost = e.round_cost(len(self.rows), n, draft_forwards, read_tokens)
        accepted = accepted_mask_from_nodes(result.accept_nodes, n)
        keep = self.target_kv.valid.clone()
        keep[:, -n:] = accepted
        self.target_kv.commit(keep)
        top_values, top_ids = logits.topk(min(_RECYCLING_K, logits.shape[-1]), dim=-1)
        top_values = top_values.float()
        if e.scheduler is not None:
            e.scheduler.observe(self.rids, tree, accepted, top_ids, draft_forwards)
        if e.meter is not None:
            e.scheduler.set_costs(e.meter.verify_cost(), e.meter.draft_cost_ratio())
        # Emitted tokens: the accepted path below the root, then the bonus token. The
        # token emitted at step i was chosen from the logits of path node i.
        path = result.accept_nodes.clamp(min=0)
        lengths = result.accept_length
        emitted = torch.cat([tree.tokens.gather(1, path)[:, 1:], torch.zeros_like(path[:, :1])], dim=1)
        emitted.scatter_(1, lengths.unsqueeze(1), result.bonus_tokens.unsqueeze(1))
        margins = (top_values[..., 0] - top_values[..., 1]) if top_values.shape[-1] > 1 else top_values[..., 0]
        emitted_margins = margins.gather(1, path)
        path_sources = tree.sources.gather(1, path)[:, 1:]
        self._record(emitted, lengths, emitted_margins, path_sources, n if e.scheduler else 1, draft_forwards, cost)
        self._advance(emitted, lengths, result.bonus_tokens, drafted=draft_forwards > 0)

    def _record(
        self,
        emitted: torch.Tensor,
        lengths: torch.Tensor,
        margins: torch.Tensor,
        sources: torch.Tensor,
        verify_tokens: int,
        draft_forwards: int,
        cost: float,
    ) -> None:
        """Host bookkeeping (one transfer per round): outputs, stop and length limits."""
        e = self.e
        emitted_l, lengths_l, margins_l, sources_l = (t.tolist() for t in (emitted, lengths, margins, sources))
        self.finished = []
        for row, req in enumerate(self.rows):
            out = self.outputs[req]
            count = lengths_l[row] + 1
            new = emitted_l[row][:count]
            out.rounds += 1
            out.draft_forwards += draft_forwards
            out.verify_tokens += verify_tokens
            out.model_cost += cost
            for s in sources_l[row][: lengths_l[row]]:
                out.accepted[SOURCE_NAMES[s]] += 1
            room = self.max_new_tokens - len(out.token_ids)
            take = new[:room]
            stop_at = next((i for i, t in enumerate(take) if t in e.stop_token_ids), None)
            if stop_at is not None:
                take = take[: stop_at + 1]
                out.finish_reason = "stop"
            out.token_ids.extend(take)
            out.margins.extend(margins_l[row][: len(take)])
            self.bar.update(len(take))
            done = stop_at is not None or len(out.token_ids) >= self.max_new_tokens
            if done:
                self.finished.append(row)
            if e.retriever is not None:
                e.retriever.append(self.rids[row], take if done else new)

    def _advance(self, emitted: torch.Tensor, lengths: torch.Tensor, bonus: torch.Tensor, drafted: bool) -> None:
        """Next round's roots and drafter input; finished rows leave the batch.

        The drafter reads everything verified since it last drafted: this round's emitted
        tokens, after the ones of the rounds it skipped (``drafted`` False).
        """
        counts = lengths + 1
        width = emitted.shape[1]
        cols = torch.arange(width, device=emitted.device)
        shift = (width - counts).unsqueeze(1)
        src = (cols.unsqueeze(0) - shift).clamp(min=0)
        pending, pending_valid = emitted.gather(1, src), cols.unsqueeze(0) >= shift
        if not drafted and self.drafter is not None:
            pending, pending_valid = _right_align(
                torch.cat([self.pending, pending], dim=1), torch.cat([self.pending_valid, pending_valid], dim=1)
            )
        self.pending, self.pending_valid = pending, pending_valid
        self.roots = bonus
        if not self.finished:
            return
        done = set(self.finished)
        if self.e.retriever is not None:
            for row in self.finished:
                self.e.retriever.finish_request(self.rids[row])
        keep_rows = [r for r in range(len(self.rows)) if r not in done]
        keep = torch.tensor(keep_rows, dtype=torch.int64, device=emitted.device)
        self.rows = [self.rows[r] for r in keep_rows]
        self.rids = [self.rids[r] for r in keep_rows]
        self.roots = self.roots[keep]
        self.pending = self.pending[keep]
        self.pending_valid = self.pending_valid[keep]
        self.target_kv.select_rows(keep)
        if self.drafter is not None:
            self.drafter.select_rows(keep)
        # Trim padding columns that every remaining row has.
        live = self.pending_valid.any(dim=0)
        first = int(live.long().argmax()) if bool(live.any()) else 0
        self.pending = self.pending[:, first:]
        self.pending_valid = self.pending_valid[:, first:]


def _clock(device: torch.device) -> float:
    """Wall-clock seconds once the device has finished what was queued (``online_costs``,
    the prefill's time)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _right_align(tokens: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's valid entries to its right end, in order (a stable sort on ``valid``)."""
    order = valid.long().argsort(dim=1, stable=True)
    return tokens.gather(1, order), valid.gather(1, order)


def _root_only(roots: torch.Tensor) -> TokenTree:
    """The tree of plain decoding: the root alone (verifying it is one decode step)."""
    bs = roots.shape[0]
    col = roots.view(bs, 1)
    zeros = torch.zeros_like(col)
    return TokenTree(
        tokens=col,
        parents=torch.full_like(col, -1),
        depths=zeros,
        scores=torch.ones(bs, 1, device=roots.device),
        sources=torch.full_like(col, int(Source.ROOT)),
        bins=zeros.clone(),
    )
