"""Greedy and stochastic tree verification."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import naive_greedy_walk, random_parents
from sglang_graft.tree import child_links
from sglang_graft.verify import (
    greedy_accept,
    target_distribution,
    verify_tree_greedy,
    verify_tree_sampled,
)


def _links(parents: torch.Tensor):
    return child_links(parents)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(2, 20), st.integers(2, 6), st.integers(0, 2**31 - 1))
def test_greedy_matches_naive_walk(bs, n, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([random_parents(n, gen) for _ in range(bs)])
    tokens = torch.randint(0, vocab, (bs, n), generator=gen)  # small vocab: duplicates and hits
    target = torch.randint(0, vocab, (bs, n), generator=gen)
    max_accept = int(torch.randint(1, n, (1,), generator=gen))
    nxt, sib = _links(parents)
    out = greedy_accept(tokens, nxt, sib, target, max_accept)
    ref = naive_greedy_walk(tokens.tolist(), parents.tolist(), target.tolist(), max_accept)
    for b, (path, bonus) in enumerate(ref):
        got = [int(x) for x in out.accept_nodes[b] if x >= 0]
        assert got == path
        assert int(out.accept_length[b]) == len(path) - 1
        assert int(out.bonus_tokens[b]) == bonus
        # The accepted path is a root path: each node's parent is the previous one.
        for a, c in zip(path, path[1:]):
            assert int(parents[b, c]) == a


def test_greedy_kernel_twin_outputs():
    # Root 5 -> {1: tok 8, 2: tok 9}; 2 -> 3: tok 4; 3 -> 4: tok 6. Target argmax spells 9, 4, 6, 1.
    parents = torch.tensor([[-1, 0, 0, 2, 3]])
    tokens = torch.tensor([[5, 8, 9, 4, 6]])
    target = torch.tensor([[9, 0, 4, 6, 1]])
    nxt, sib = _links(parents)
    ridx = torch.arange(5).view(1, 5)
    predicts, accept_index, num = verify_tree_greedy(tokens, ridx, nxt, sib, target, 4)
    assert num.tolist() == [3]
    assert accept_index.tolist() == [[0, 2, 3, 4]]
    assert predicts.tolist() == [9, 0, 4, 6, 1]
    assert predicts.dtype == accept_index.dtype == num.dtype == torch.int32
    # A cap of 2 speculative tokens stops after one accepted draft.
    predicts, accept_index, num = verify_tree_greedy(tokens, ridx, nxt, sib, target, 2)
    assert num.tolist() == [1] and accept_index.tolist() == [[0, 2]]
    assert predicts.tolist() == [9, 0, 4, 0, 0]


def test_greedy_second_request_uses_global_indices():
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
    tokens = torch.tensor([[1, 2, 3], [1, 7, 8]])
    target = torch.tensor([[2, 3, 0], [8, 0, 5]])
    nxt, sib = _links(parents)
    ridx = torch.arange(6).view(2, 3)
    predicts, accept_index, num = verify_tree_greedy(tokens, ridx, nxt, sib, target, 3)
    assert num.tolist() == [2, 1]
    assert accept_index.tolist() == [[0, 1, 2], [3, 5, -1]]
    assert predicts.tolist() == [2, 3, 0, 8, 0, 5]


def test_tree_containing_argmax_chain_accepts_it_whole():
    gen = torch.Generator().manual_seed(3)
    n, vocab = 16, 50
    parents = torch.tensor([random_parents(n, gen)])
    nxt, sib = _links(parents)
    # Pick the deepest node and make the target's argmax spell its root path.
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[int(parents[0, i])] + 1
    leaf = max(range(n), key=lambda i: depth[i])
    path = [leaf]
    while path[-1] != 0:
        path.append(int(parents[0, path[-1]]))
    path.reverse()
    tokens = torch.randint(0, vocab, (1, n), generator=gen)
    target = torch.randint(0, vocab, (1, n), generator=gen)
    for a, c in zip(path, path[1:]):
        target[0, a] = tokens[0, c]
    out = greedy_accept(tokens, nxt, sib, target)
    assert int(out.accept_length[0]) >= len(path) - 1
    assert [int(x) for x in out.accept_nodes[0][: len(path)]] == path


def _run_sampled(tokens, parents, probs, trials, seed):
    bs, n = tokens.shape
    nxt, sib = _links(parents)
    gen = torch.Generator().manual_seed(seed)
    rep = lambda t: t.repeat_interleave(trials, dim=0)  # noqa: E731
    out = verify_tree_sampled(
        rep(tokens), rep(nxt), rep(sib), rep(probs),
        torch.rand(bs * trials, n, generator=gen), torch.rand(bs * trials, generator=gen),
    )
    return out


def _emitted_first_token(out, tokens):
    """The first token emitted after the root: the first accepted draft, else the bonus."""
    first = out.accept_nodes[:, 1]
    tok = tokens.repeat_interleave(out.accept_nodes.shape[0] // tokens.shape[0], 0)
    return torch.where(first >= 0, tok.gather(1, first.clamp(min=0).view(-1, 1)).squeeze(1), out.bonus_tokens)


def test_sampled_first_token_follows_target_distribution():
    """Chi-square goodness of fit: with duplicate sibling tokens, deep chains and
    a "retrieved" child of near-zero probability, the first emitted token is still
    distributed as the target's p at the root. 200k trials, 8 categories, threshold at
    p = 1e-4 (chi2 with 7 dof: 29.9), so a correct sampler fails this once in 10,000 runs."""
    vocab, n, trials = 8, 7, 200_000
    p_root = torch.tensor([0.30, 0.05, 0.20, 0.15, 0.001, 0.099, 0.1, 0.1])
    # Root children: tokens 2, 2 (duplicate), 4 (near-zero), 0; grandchildren below 2.
    parents = torch.tensor([[-1, 0, 0, 0, 0, 1, 5]])
    tokens = torch.tensor([[3, 2, 2, 4, 0, 1, 1]])
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1, n, vocab, generator=gen), dim=-1)
    probs[0, 0] = p_root
    out = _run_sampled(tokens, parents, probs, trials, seed=1)
    first = _emitted_first_token(out, tokens)
    counts = torch.bincount(first, minlength=vocab).double()
    expected = p_root.double() * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 29.9, (chi2, counts.tolist(), expected.tolist())


def test_sampled_two_token_joint_follows_target():
    """The first two emitted tokens follow p(x1) p(x2 | x1) through accepted drafts,
    rejections and bonus tokens alike (total variation < 0.01 over 200k trials)."""
    vocab, trials = 3, 200_000
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]])
    tokens = torch.tensor([[0, 1, 2, 0, 0, 2]])  # root children 1, 2; under 1: 0, 0 (dup); under 2: 2
    p = torch.tensor(
        [
            [0.5, 0.3, 0.2],  # root
            [0.6, 0.1, 0.3],  # after token 1
            [0.2, 0.2, 0.6],  # after token 2
            [0.3, 0.3, 0.4],
            [0.3, 0.3, 0.4],
            [0.1, 0.1, 0.8],
        ]
    ).unsqueeze(0)
    out = _run_sampled(tokens, parents, p, trials, seed=2)
    tok = tokens.repeat_interleave(trials, 0)
    seqs = []
    for b in range(trials):
        nodes = [int(x) for x in out.accept_nodes[b] if x >= 0][1:]
        emitted = [int(tok[b, c]) for c in nodes] + [int(out.bonus_tokens[b])]
        seqs.append(emitted[0] * vocab + emitted[1] if len(emitted) >= 2 else -1)
    seqs_t = torch.tensor(seqs)
    # Where only one token came out (root children all rejected) the pair is not observed;
    # compare the first token alone there and the pair where present.
    p_root = p[0, 0]
    # Conditional of token 2 after x1 comes from the node holding x1 if x1 was drafted.
    cond = {0: None, 1: p[0, 1], 2: p[0, 2]}
    joint = torch.zeros(vocab * vocab, dtype=torch.float64)
    for x1 in range(vocab):
        if cond[x1] is None:
            continue
        for x2 in range(vocab):
            joint[x1 * vocab + x2] = float(p_root[x1] * cond[x1][x2])
    observed = torch.bincount(seqs_t[seqs_t >= 0], minlength=vocab * vocab).double() / trials
    tv = 0.5 * float((observed - joint).abs().sum() + abs(float((seqs_t < 0).double().mean()) - float(p_root[0])))
    assert tv < 0.01, (observed.tolist(), joint.tolist())


def test_target_distribution_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.allclose(target_distribution(logits, 1.0), torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert torch.allclose(target_distribution(logits, 1.0, top_k=2), torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # top_p 0.7 keeps tokens whose preceding mass is < 0.7: 0.5 and 0.25 (0.75 > 0.7 stops after).
    assert torch.allclose(target_distribution(logits, 1.0, top_p=0.7), torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    hot = target_distribution(logits, 2.0)
    assert float(hot[0, 0]) < 0.5 and float(hot[0, 3]) > 0.1
    with pytest.raises(ValueError, match="temperature"):
        target_distribution(logits, 0.0)
    with pytest.raises(ValueError, match="top_k"):
        target_distribution(logits, 1.0, top_k=9)
    with pytest.raises(ValueError, match="top_p"):
        target_distribution(logits, 1.0, top_p=0.0)


def test_verify_rejects_mismatched_shapes():
    t = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="retrive_next_token has shape"):
        verify_tree_greedy(t, t, t[:, :3], t, t, 3)
    with pytest.raises(ValueError, match="target_predict"):
        verify_tree_greedy(t, t, t, t, t[:, :2], 3)
    with pytest.raises(ValueError, match="shapes disagree"):
        verify_tree_sampled(t, t, t, torch.ones(2, 4, 5) / 5, torch.rand(2, 3), torch.rand(2))
