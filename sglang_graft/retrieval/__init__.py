"""Retrieval sources for grafting: token recycling, the request's context, shared history.

Everything here is plain PyTorch and the Python standard library (no SGLang, no
transformers). ``Retriever`` is the one interface the engines use; the sources are usable
on their own for tests and tools.
"""

from sglang_graft.retrieval.context import ContextIndex, TokenWindow
from sglang_graft.retrieval.continuations import HostProposal, Occurrence, continuation_tree
from sglang_graft.retrieval.history import HistoryIndex
from sglang_graft.retrieval.recycling import RankTemplate, RecyclingTable, rank_template, rounded_rates
from sglang_graft.retrieval.retriever import Retriever, RetrieverConfig
from sglang_graft.retrieval.scoring import RETRIEVAL_SOURCES, RetrievalCalibration, length_bucket, match_bin
from sglang_graft.retrieval.selection import PackedCandidates, select_top

__all__ = [
    "RETRIEVAL_SOURCES",
    "ContextIndex",
    "HistoryIndex",
    "HostProposal",
    "Occurrence",
    "PackedCandidates",
    "RankTemplate",
    "RecyclingTable",
    "RetrievalCalibration",
    "Retriever",
    "RetrieverConfig",
    "TokenWindow",
    "continuation_tree",
    "length_bucket",
    "match_bin",
    "rank_template",
    "rounded_rates",
    "select_top",
]
