"""SGLang's ``EagleVerifyInput`` for a grafted tree: two properties differ, nothing else.

EAGLE's trees are at most ``spec_steps`` deep, and SGLang sizes each request's
``accept_index`` row (``max_tree_depth``) by that. A grafted chain can be deeper (a
retrieved continuation may use every slot), so the row must hold ``n`` nodes, as for
NGRAM's node-budgeted trees; and the tree has no fixed branching factor
(``tree_topk = -1``, the convention of SGLang's irregular NGRAM trees). Verify, KV
moves and draft re-extension read the same fields as for EAGLE and stay SGLang's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.speculative.eagle_info import EagleVerifyInput


@dataclass
class GraftVerifyInput(EagleVerifyInput):
    """An ``EagleVerifyInput`` whose tree may chain all ``draft_token_num`` nodes."""

    @property
    def max_tree_depth(self) -> int:
        return self.draft_token_num

    @property
    def tree_topk(self) -> int:
        return -1
