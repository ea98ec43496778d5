"""A toy language model pair for end-to-end tests of the core without transformers.

The target is a random trigram table; the drafter is the same table plus noise, so some
drafts are accepted and some rejected. Drafting follows EAGLE's draft loop exactly
(``select_top_k_tokens``), and verification computes the target at every tree node.
"""

from __future__ import annotations

import torch

from sglang_graft.tree import TokenTree


class ToyPair:
    def __init__(self, vocab: int = 40, noise: float = 1.0, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.target = torch.randn(vocab, vocab, vocab, generator=gen, dtype=torch.float64) * 2
        self.draft = self.target + noise * torch.randn(vocab, vocab, vocab, generator=gen, dtype=torch.float64)

    def target_logits(self, seq: list[int]) -> torch.Tensor:
        return self.target[seq[-2], seq[-1]]

    def draft_probs(self, seq: list[int]) -> torch.Tensor:
        return torch.softmax(self.draft[seq[-2], seq[-1]], dim=-1).float()

    def greedy_ar(self, prompt: list[int], steps: int) -> list[int]:
        seq = list(prompt)
        for _ in range(steps):
            seq.append(int(self.target_logits(seq).argmax()))
        return seq[len(prompt) :]

    def eagle_draft(self, seqs: list[list[int]], topk: int, steps: int, continues_fn=None):
        """EAGLE's draft outputs for a batch; stops early when ``continues_fn`` says so."""
        bs = len(seqs)
        paths = [[[t] for t in []] for _ in seqs]  # per request: path of each expanded node
        probs = torch.stack([self.draft_probs(s) for s in seqs])
        tp, ti = probs.topk(topk, dim=-1)
        score_list, token_list = [tp.unsqueeze(1)], [ti]
        parents_list = [torch.arange(-1, topk).unsqueeze(0).repeat(bs, 1)]
        scores = tp
        paths = [[[int(ti[b, k])] for k in range(topk)] for b in range(bs)]
        continues = []
        if continues_fn is not None:
            continues.append(continues_fn(1, tp))
        for i in range(1, steps):
            if continues and not bool(continues[-1].any()):
                break
            probs = torch.stack([self.draft_probs(seqs[b] + paths[b][k]) for b in range(bs) for k in range(topk)])
            tp, ti = probs.topk(topk, dim=-1)
            expand = scores.unsqueeze(2) * tp.view(bs, topk, topk)
            cs_p, cs_i = expand.flatten(1).topk(topk, dim=-1)
            flat_tok = ti.view(bs, topk * topk)
            score_list.append(expand)
            token_list.append(flat_tok)
            parents_list.append(cs_i + (topk * topk * (i - 1) + topk))
            paths = [[paths[b][int(cs_i[b, k]) // topk] + [int(flat_tok[b, cs_i[b, k]])] for k in range(topk)] for b in range(bs)]
            scores = cs_p
            if continues_fn is not None:
                continues.append(continues_fn(i + 1, cs_p))
        return score_list, token_list, parents_list, continues

    def tree_target(self, seqs: list[list[int]], tree: TokenTree) -> torch.Tensor:
        """``[bs, n, vocab]`` target logits after every node of every tree."""
        bs, n = tree.tokens.shape
        out = torch.empty(bs, n, self.vocab, dtype=torch.float64)
        for b in range(bs):
            for i in range(n):
                path, cur = [], i
                while cur > 0:
                    path.append(int(tree.tokens[b, cur]))
                    cur = int(tree.parents[b, cur])
                out[b, i] = self.target_logits(seqs[b] + path[::-1])
        return out
