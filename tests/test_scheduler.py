"""One Graft round end to end on a toy model pair: every policy is lossless."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from toy_lm import ToyPair
from sglang_graft.candidates import Candidates, Source
from sglang_graft.graft import source_counts
from sglang_graft.prune import GateConfig
from sglang_graft.retrieval import Retriever, RetrieverConfig
from sglang_graft.scheduler import POLICIES, GraftScheduler, SchedulerConfig, accepted_mask_from_nodes
from sglang_graft.tree import child_links, eagle_candidates
from sglang_graft.verify import greedy_accept, target_distribution, verify_tree_sampled


class RandomChains:
    """A deliberately bad retriever: random chains with made-up scores. Whatever it
    proposes, verification must keep the output equal to plain decoding."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.observed = 0

    def propose(self, rids: Sequence[str], budget: int) -> Candidates:
        bs, m = len(rids), 6
        return Candidates(
            tokens=torch.randint(0, self.vocab, (bs, m), generator=self.gen),
            parents=torch.tensor([-1, 0, 1, -1, 3, 4]).expand(bs, m).clone(),
            scores=torch.tensor([0.5, 0.4, 0.3, 0.45, 0.2, 0.1]).expand(bs, m).clone(),
            sources=torch.full((bs, m), int(Source.CONTEXT)),
            valid=torch.arange(m).expand(bs, m) < budget,
        )

    def observe(self, rids, tree_tokens, tree_parents, tree_sources, accepted_mask, target_topk=None, *, tree_bins) -> None:
        assert tree_tokens.shape == accepted_mask.shape == tree_bins.shape
        self.observed += 1


def _decode(pair: ToyPair, sched: GraftScheduler, prompts: list[list[int]], steps: int, topk: int, depth: int, temperature: float = 0.0, seed: int = 0):
    seqs = [list(p) for p in prompts]
    rids = [f"r{i}" for i in range(len(seqs))]
    lifecycle = isinstance(sched.retriever, Retriever)
    if lifecycle:
        for rid, p in zip(rids, prompts):
            sched.retriever.start_request(rid, p)
    gen = torch.Generator().manual_seed(seed)
    rounds = 0
    n = sched.config.num_nodes
    while min(len(s) - len(p) for s, p in zip(seqs, prompts)) < steps:
        rounds += 1
        roots = torch.tensor([s[-1] for s in seqs])
        drafts, continues = None, None
        if sched.config.uses_draft:
            sl, tl, pl, continues = pair.eagle_draft(seqs, topk, depth, sched.draft_continues)
            drafts = eagle_candidates(sl, tl, pl, topk)
        tree, _ = sched.build_tree(rids, roots, drafts, continues)
        tree.validate(vocab_size=pair.vocab)
        assert tree.tokens.shape == (len(seqs), n)
        logits = pair.tree_target(seqs, tree)
        nxt, sib = child_links(tree.parents)
        if temperature == 0:
            out = greedy_accept(tree.tokens, nxt, sib, logits.argmax(-1))
        else:
            probs = target_distribution(logits, temperature)
            out = verify_tree_sampled(tree.tokens, nxt, sib, probs, torch.rand(len(seqs), n, generator=gen), torch.rand(len(seqs), generator=gen))
        sched.observe(rids, tree, accepted_mask_from_nodes(out.accept_nodes, n), logits.topk(4, dim=-1).indices)
        for b in range(len(seqs)):
            nodes = [int(x) for x in out.accept_nodes[b] if x >= 0][1:]
            new = [int(tree.tokens[b, c]) for c in nodes] + [int(out.bonus_tokens[b])]
            seqs[b] += new
            if lifecycle:
                sched.retriever.append(rids[b], new)
    if lifecycle:
        for rid in rids:
            sched.retriever.finish_request(rid)
    return [s[len(p) : len(p) + steps] for s, p in zip(seqs, prompts)], rounds


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n", [4, 16])
def test_every_policy_is_lossless_against_plain_greedy(policy, n):
    pair = ToyPair(vocab=30, noise=0.7, seed=1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 9]]
    retriever = RandomChains(30) if policy in ("retrieval", "graft") else None
    sched = GraftScheduler(SchedulerConfig(policy=policy, num_nodes=n, gates=GateConfig(root_threshold=0.3)), retriever)
    out, rounds = _decode(pair, sched, prompts, steps=24, topk=3, depth=4)
    assert out == [pair.greedy_ar(p, 24) for p in prompts]
    if policy != "retrieval":
        assert rounds < 24, "a draft that mostly agrees with the target must save verify rounds"
    if retriever is not None:
        assert retriever.observed == rounds


@pytest.mark.parametrize("policy", ["retrieval", "graft"])
def test_real_retrieval_is_lossless_and_saves_rounds_on_repetitive_text(policy):
    """A target that loops through a fixed cycle: context retrieval and token recycling
    should predict it, cutting verify rounds well below the token count, while output
    stays identical to plain greedy decoding."""
    pair = ToyPair(vocab=12, noise=2.0, seed=5)
    cycle = torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()
    for i in range(12):  # make the target's argmax after (a, b) always follow the cycle
        a, b = cycle[i], cycle[(i + 1) % 12]
        pair.target[a, b, cycle[(i + 2) % 12]] = 50.0
    prompts = [cycle * 2, cycle[3:] + cycle * 2]
    retriever = Retriever(RetrieverConfig(vocab_size=12))
    sched = GraftScheduler(SchedulerConfig(policy=policy, num_nodes=8), retriever)
    out, rounds = _decode(pair, sched, prompts, steps=36, topk=2, depth=3)
    assert out == [pair.greedy_ar(p, 36) for p in prompts]
    assert rounds <= 12, rounds
    stats = retriever.stats()
    assert stats["context"]["accepted"] > 0


def test_dense_policy_builds_eagles_tree():
    from sglang_graft.tree import build_eagle_tree, pack

    pair = ToyPair(vocab=60, noise=0.5, seed=3)
    seqs = [[1, 2], [3, 4, 5]]
    sl, tl, pl, _ = pair.eagle_draft(seqs, topk=4, steps=3)
    sched = GraftScheduler(SchedulerConfig(policy="dense", num_nodes=10))
    roots = torch.tensor([2, 5])
    tree, _ = sched.build_tree(["a", "b"], roots, eagle_candidates(sl, tl, pl, 4))
    seq_lens = torch.tensor([2, 3])
    for ours, theirs in zip(pack(tree, seq_lens), build_eagle_tree(roots, sl, tl, pl, seq_lens, 4, 3, 10)):
        assert torch.equal(ours, theirs)


def test_gates_stop_drafting_and_free_slots_for_retrieval():
    pair = ToyPair(vocab=30, noise=3.0, seed=2)  # a poor drafter: low confidence
    seqs = [[1, 2, 3]]
    sched = GraftScheduler(SchedulerConfig(policy="graft", num_nodes=12, gates=GateConfig(root_threshold=0.9)), RandomChains(30))
    sl, tl, pl, continues = pair.eagle_draft(seqs, topk=3, steps=4, continues_fn=sched.draft_continues)
    assert len(sl) == 1, "every request gated at depth 1: the batch stops drafting"
    tree, _ = sched.build_tree(["r"], torch.tensor([3]), eagle_candidates(sl, tl, pl, 3), continues)
    counts = source_counts(tree)[0]
    assert int(counts[Source.DRAFT]) <= 3 and int(counts[Source.CONTEXT]) > 0


def test_sampling_is_reproducible_with_a_seed():
    pair = ToyPair(vocab=20, noise=0.5, seed=4)
    prompts = [[1, 2], [3, 4]]

    def run():
        sched = GraftScheduler(SchedulerConfig(policy="graft", num_nodes=8), RandomChains(20, seed=1))
        return _decode(pair, sched, prompts, steps=12, topk=2, depth=3, temperature=0.8, seed=7)[0]

    assert run() == run()


def test_scheduler_rejects_bad_settings():
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(policy="eagle9")
    with pytest.raises(ValueError, match="num_nodes"):
        SchedulerConfig(num_nodes=1)
    with pytest.raises(ValueError, match="needs a retriever"):
        GraftScheduler(SchedulerConfig(policy="graft"))
    sched = GraftScheduler(SchedulerConfig(policy="dense"))
    with pytest.raises(ValueError, match="needs draft candidates"):
        sched.build_tree(["a"], torch.tensor([1]), None)


def test_a_seeded_round_keeps_the_drafts_score_for_each_retrieved_node():
    """When the draft model scored the retrieved nodes (seeds), its estimate stands; the
    retrieved copy's higher score must not replace it (the larger of two estimates of one
    event over-predicts), and the retrieved copy is not grafted a second time."""
    retrieved = Candidates(
        tokens=torch.tensor([[7]]),
        parents=torch.tensor([[-1]]),
        scores=torch.tensor([[0.9]]),
        sources=torch.tensor([[int(Source.RECYCLING)]]),
        valid=torch.tensor([[True]]),
    )
    drafts = Candidates(  # the seed (token 7, as the draft scored it), then the draft's own child of the root
        tokens=torch.tensor([[7, 5]]),
        parents=torch.tensor([[-1, -1]]),
        scores=torch.tensor([[0.1, 0.5]]),
        sources=torch.tensor([[int(Source.RECYCLING), int(Source.DRAFT)]]),
        valid=torch.tensor([[True, True]]),
        levels=torch.tensor([[1, 1]]),
    )
    sched = GraftScheduler(SchedulerConfig(policy="graft", num_nodes=4, gates=GateConfig(mode="fixed")), RandomChains(30))

    def node_scores(seeded: bool) -> dict[int, float]:
        tree, _ = sched.build_tree(["r"], torch.tensor([3]), drafts, [], retrieved, seeded=seeded)
        real = tree.sources[0] != int(Source.FILLER)
        return {int(t): float(s) for t, s in zip(tree.tokens[0, 1:][real[1:]], tree.scores[0, 1:][real[1:]])}

    assert node_scores(seeded=True) == pytest.approx({5: 0.5, 7: 0.1})
    assert node_scores(seeded=False) == pytest.approx({5: 0.5, 7: 0.9})  # merged copies: the best score
