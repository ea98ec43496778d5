"""Keep the retriever's per-request state equal to SGLang's running requests.

Rather than interpreting every verify result, each round reads the requests themselves:
SGLang's synchronous scheduler has already appended the previous round's accepted tokens
to ``req.output_ids`` when the next draft starts, so the retriever learns exactly the
tokens SGLang committed. A request seen for the first time (a new one, or one resumed
after retraction) is opened with its whole token history; a request no longer in the
decode batch (finished, aborted or retracted) is closed, which frees its state. Every
tensor-parallel rank sees the same batches, so every rank's retriever holds the same state.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol


class RequestLike(Protocol):
    """The fields of SGLang's ``Req`` this module reads."""

    rid: str
    origin_input_ids: Sequence[int]
    output_ids: Sequence[int]
    extra_key: str | None
    cache_salt: str | None


class RequestRetriever(Protocol):
    def start_request(self, rid: Hashable, prompt_ids: Any, namespace: Hashable = None) -> None: ...

    def append(self, rid: Hashable, new_token_ids: Any) -> None: ...

    def finish_request(self, rid: Hashable) -> None: ...


def namespace_of(extra_key: str | None, cache_salt: str | None) -> tuple[str | None, str | None]:
    """The cache namespace of a request or radix key (SGLang keys its tree on both)."""
    return (extra_key, cache_salt)


class RequestTracker:
    """Feeds each request's committed tokens to the retriever, once, in order."""

    def __init__(self, retriever: RequestRetriever) -> None:
        self.retriever = retriever
        self._fed: dict[str, int] = {}  # rid -> tokens the retriever holds

    @property
    def open_requests(self) -> int:
        return len(self._fed)

    def sync(self, reqs: Sequence[RequestLike]) -> list[str]:
        """Bring the retriever up to date with this decode batch; returns its rids in order."""
        rids = [r.rid for r in reqs]
        in_batch = set(rids)
        for rid in [rid for rid in self._fed if rid not in in_batch]:
            self.close(rid)
        for req in reqs:
            total = len(req.origin_input_ids) + len(req.output_ids)
            fed = self._fed.get(req.rid)
            if fed is None:
                tokens = list(req.origin_input_ids) + list(req.output_ids)
                self.retriever.start_request(req.rid, tokens, namespace=namespace_of(req.extra_key, req.cache_salt))
            elif total > fed:
                self.retriever.append(req.rid, _tokens_after(req, fed))
            elif total < fed:
                raise ValueError(f"request {req.rid!r} shrank from {fed} to {total} tokens between rounds")
            self._fed[req.rid] = total
        return rids

    def close(self, rid: str) -> None:
        """Free a request's retrieval state (no-op for a request never seen)."""
        if self._fed.pop(rid, None) is not None:
            self.retriever.finish_request(rid)


def _tokens_after(req: RequestLike, start: int) -> list[int]:
    """``(origin_input_ids + output_ids)[start:]`` without copying the whole history."""
    n_in = len(req.origin_input_ids)
    if start >= n_in:
        return list(req.output_ids[start - n_in :])
    return list(req.origin_input_ids[start:]) + list(req.output_ids)
