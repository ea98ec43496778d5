"""Lossless tree verification: greedy and stochastic, for any tree of deterministic proposals.

Both walk the tree from the root along SGLang's links (``retrive_next_token`` = first
child, ``retrive_next_sibling`` = next sibling). The walk visits each node at most once,
so a fixed ``n``-step loop of batched tensor ops covers every request with no host sync
and no per-request Python code.

Greedy: at each accepted node, descend into the first child (in sibling order) whose token
equals the target's argmax there; stop when none does. This is a functional twin of
SGLang's ``verify_tree_greedy`` kernel.

Stochastic (temperature > 0): proposals are deterministic (a draft node or a retrieved
token is a point mass), so rejection sampling reduces to: at node ``u`` with target
distribution ``p``, test the children in sibling order; child token ``t`` is accepted with
probability ``p(t)``; on rejection ``p`` becomes ``p`` with ``t`` removed and renormalised;
if every child is rejected, the bonus token is drawn from what is left. For one node this
emits token ``x`` with probability exactly ``p(x)`` (the residual after removing ``t`` is
``p`` conditioned on "not ``t``"), so the output keeps the target's distribution whatever
the tree, duplicate siblings included (a second ``t`` meets ``p(t) = 0``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def verify_tree_greedy(
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    num_speculative_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of SGLang's ``verify_tree_greedy`` kernel.

    Args:
        candidates: ``[bs, n]`` int64 tree tokens (column 0 the root).
        retrive_index: ``[bs, n]`` global index of each node in the flattened batch.
        retrive_next_token, retrive_next_sibling: ``[bs, n]`` links, -1 for none.
        target_predict: ``[bs, n]`` int64 target argmax at each node (read through
            ``retrive_index``, i.e. as a flattened ``[bs * n]`` array).
        num_speculative_tokens: most tokens one request may accept, root included.

    Returns:
        ``predicts`` ``[bs * n]`` int32 (target token at each accepted node, else 0),
        ``accept_index`` ``[bs, num_speculative_tokens]`` int32 (global indices of the
        accepted path, -1 padded), ``accept_token_num`` ``[bs]`` int32 (accepted drafts).
    """
    bs, n = candidates.shape
    for name, t in (
        ("retrive_index", retrive_index),
        ("retrive_next_token", retrive_next_token),
        ("retrive_next_sibling", retrive_next_sibling),
    ):
        if t.shape != (bs, n):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(bs, n)} like candidates")
    if target_predict.numel() != bs * n:
        raise ValueError(f"target_predict has {target_predict.numel()} elements, expected bs*n = {bs * n}")
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    device = candidates.device
    flat_target = target_predict.reshape(-1).long()
    rows = torch.arange(bs, device=device)

    predicts = torch.zeros(bs * n, dtype=torch.int32, device=device)
    accept_index = torch.full((bs, num_speculative_tokens), -1, dtype=torch.int32, device=device)
    last = retrive_index[:, 0].long()  # global index of the last accepted node
    accept_index[:, 0] = last.int()
    num_accepted = torch.zeros(bs, dtype=torch.int64, device=device)
    cur = retrive_next_token[:, 0].long()  # node being tested (-1: no more candidates)
    for _ in range(n):
        active = (cur >= 0) & (num_accepted < num_speculative_tokens - 1)
        c = cur.clamp(min=0)
        hit = active & (candidates[rows, c].long() == flat_target[last])
        # On a hit: record it, then test the hit node's first child next.
        predicts[last[hit]] = flat_target[last[hit]].int()
        num_accepted = num_accepted + hit.long()
        slot = num_accepted.clamp(max=num_speculative_tokens - 1)
        accept_index[rows[hit], slot[hit]] = retrive_index[rows, c][hit].int()
        last = torch.where(hit, retrive_index[rows, c].long(), last)
        following = torch.where(hit, retrive_next_token[rows, c], retrive_next_sibling[rows, c]).long()
        cur = torch.where(active, following, torch.full_like(cur, -1))
    predicts[last] = flat_target[last].int()
    return predicts, accept_index, num_accepted.int()


class SampledVerify(NamedTuple):
    """Outcome of ``verify_tree_sampled``."""

    accept_nodes: torch.Tensor  # [bs, max_depth + 1] int64 node columns of the accepted path, root first, -1 padded
    accept_length: torch.Tensor  # [bs] int64 accepted proposals (root excluded)
    bonus_tokens: torch.Tensor  # [bs] int64 token sampled after the last accepted node


def target_distribution(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_p: torch.Tensor | float = 1.0,
    top_k: torch.Tensor | int = 0,
) -> torch.Tensor:
    """Softmax of ``logits`` ``[..., vocab]`` after temperature, top-k and top-p.

    The per-request settings may be tensors broadcastable to ``logits.shape[:-1]``.
    ``top_k = 0`` disables top-k; ties at the k-th value are all kept. A temperature of 0
    is not a distribution: use greedy verification instead.
    """
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(lead)
    if bool((temp <= 0).any()):
        raise ValueError("temperature must be > 0 for sampled verification (use greedy for 0)")
    x = logits.float() / temp.unsqueeze(-1)
    k = torch.as_tensor(top_k, dtype=torch.int64, device=logits.device).expand(lead)
    if bool((k < 0).any()) or bool((k > vocab).any()):
        raise ValueError(f"top_k must be in [0, {vocab}] (0 = off), got {k.min().item()}..{k.max().item()}")
    sorted_x = torch.sort(x, dim=-1, descending=True).values
    kth = sorted_x.gather(-1, (k.clamp(min=1) - 1).unsqueeze(-1))
    x = torch.where((k.unsqueeze(-1) > 0) & (x < kth), float("-inf"), x)
    probs = torch.softmax(x, dim=-1)
    p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device).expand(lead)
    if bool((p <= 0).any()) or bool((p > 1).any()):
        raise ValueError("top_p must be in (0, 1]")
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
    drop_sorted = before >= p.unsqueeze(-1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
    probs = torch.where(drop, 0.0, probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def verify_tree_sampled(
    tokens: torch.Tensor,
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
    max_accept: int | None = None,
) -> SampledVerify:
    """Rejection-sample the tree against the target distribution at every node.

    Args:
        tokens: ``[bs, n]`` tree tokens (column 0 the root).
        next_token, next_sibling: ``[bs, n]`` local links (columns), -1 for none.
        target_probs: ``[bs, n, vocab]`` target distribution after each node (see
            ``target_distribution``).
        uniforms: ``[bs, n]`` U(0,1) draws, one per node tested (node ``i`` uses ``[:, i]``).
        bonus_uniforms: ``[bs]`` U(0,1) draws for the bonus token.
        max_accept: most proposals one request may accept (default ``n - 1``).

    Passing the random draws in keeps the walk deterministic given them, so every
    tensor-parallel rank reaches the same result from the same seed.
    """
    bs, n, vocab = target_probs.shape
    if tokens.shape != (bs, n) or uniforms.shape != (bs, n) or bonus_uniforms.shape != (bs,):
        raise ValueError(
            f"shapes disagree: tokens {tuple(tokens.shape)}, uniforms {tuple(uniforms.shape)}, "
            f"bonus_uniforms {tuple(bonus_uniforms.shape)} for target_probs {tuple(target_probs.shape)}"
        )
    limit = n - 1 if max_accept is None else max_accept
    device = tokens.device
    rows = torch.arange(bs, device=device)
    residual = target_probs[:, 0].clone()  # distribution at the last accepted node
    last = torch.zeros(bs, dtype=torch.int64, device=device)
    accept_nodes = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    accept_nodes[:, 0] = 0
    length = torch.zeros(bs, dtype=torch.int64, device=device)
    cur = next_token[:, 0].long()
    for _ in range(n):
        active = (cur >= 0) & (length < limit)
        c = cur.clamp(min=0)
        tok = tokens[rows, c].long()
        p_tok = residual[rows, tok]
        hit = active & (uniforms[rows, c] < p_tok)
        miss = active & ~hit
        # Rejection: remove the tested token from the residual and renormalise.
        removed = residual.clone()
        removed[rows, tok] = 0.0
        total = removed.sum(dim=1, keepdim=True)
        removed = torch.where(total > 0, removed / total.clamp(min=1e-30), removed)
        residual = torch.where(miss.unsqueeze(1), removed, residual)
        # Acceptance: move to the child; its own target distribution applies.
        residual = torch.where(hit.unsqueeze(1), target_probs[rows, c], residual)
        length = length + hit.long()
        accept_nodes[rows[hit], length[hit]] = c[hit]
        last = torch.where(hit, c, last)
        following = torch.where(hit, next_token[rows, c], next_sibling[rows, c]).long()
        cur = torch.where(active, following, torch.full_like(cur, -1))
    bonus = _sample(residual, bonus_uniforms)
    width = 1 + limit if limit < n else n
    return SampledVerify(accept_nodes[:, :width], length, bonus)


def _sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample of one token per row from ``u ~ U(0,1)``."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    cdf = cdf / cdf[:, -1:].clamp(min=1e-300)
    idx = torch.searchsorted(cdf, u.double().clamp(0.0, 1.0 - 1e-12).unsqueeze(1), right=True).squeeze(1)
    # Never land on a zero-probability token through rounding at the top of the CDF.
    idx = idx.clamp(max=probs.shape[-1] - 1)
    return idx


def greedy_accept(
    tokens: torch.Tensor,
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    target_argmax: torch.Tensor,
    max_accept: int | None = None,
) -> SampledVerify:
    """Greedy verification in the same local-column form as ``verify_tree_sampled``.

    ``target_argmax`` is ``[bs, n]``; the bonus token is the argmax at the last accepted node.
    """
    bs, n = tokens.shape
    limit = n - 1 if max_accept is None else max_accept
    local = torch.arange(n, device=tokens.device).expand(bs, n)
    flat = local + torch.arange(bs, device=tokens.device).view(bs, 1) * n
    _, accept_index, accepted = verify_tree_greedy(tokens, flat, next_token, next_sibling, target_argmax, limit + 1)
    nodes = torch.where(accept_index >= 0, accept_index.long() % n, -1)
    last = nodes.gather(1, accepted.long().view(bs, 1)).squeeze(1)
    bonus = target_argmax.gather(1, last.view(bs, 1)).squeeze(1).long()
    return SampledVerify(nodes, accepted.long(), bonus)
