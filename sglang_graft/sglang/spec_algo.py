"""The algorithm objects SGLang dispatches on: ``GRAFT`` and ``GRAFT_STANDALONE``.

SGLang's scheduler, model runner and KV code branch on ``is_eagle()``, ``is_eagle3()``
and ``is_standalone()`` to decide hidden-state capture, draft KV, bigram radix keys and
CUDA-graph shapes. Graft drafts exactly like those algorithms and only builds a
different tree from the drafts, so each variant claims the identity of its draft model,
which is true rather than a trick to reach a branch:

* ``GRAFT``: an EAGLE-3 draft head (target aux hidden states, shared embeddings);
  ``is_eagle()`` and ``is_eagle3()``.
* ``GRAFT_STANDALONE``: a plain small LM with the target's vocabulary; ``is_standalone()``.

SGLang 0.5.23's ``CustomSpecAlgo`` lacks ``create_future_map``, ``need_topk``,
``carries_draft_hidden_states`` and ``get_platform_worker_cls``, which the scheduler,
the overlap relay and the adaptive-spec check call on every algorithm; they are defined
here with the answers the built-in EAGLE-family algorithms give.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

if TYPE_CHECKING:
    import torch

class GraftSpecAlgo(CustomSpecAlgo):
    """Graft with an EAGLE-3 draft head (``--speculative-algorithm GRAFT``)."""

    draft_kind = "eagle3"

    def is_eagle(self) -> bool:
        return self.draft_kind == "eagle3"

    def is_eagle3(self) -> bool:
        return self.draft_kind == "eagle3"

    def is_standalone(self) -> bool:
        return self.draft_kind == "standalone"

    def need_topk(self) -> bool:
        # The draft input relays top-k tokens and probabilities between rounds.
        return True

    def carries_draft_hidden_states(self) -> bool:
        # Only an EAGLE head consumes the target's hidden states.
        return self.is_eagle()

    def get_platform_worker_cls(self) -> None:
        # No out-of-tree platform ships a Graft worker.
        return None

    def create_future_map(
        self,
        device: torch.device,
        req_to_token_pool: Any,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ) -> Any:
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)


class GraftStandaloneSpecAlgo(GraftSpecAlgo):
    """Graft with a plain small draft LM (``--speculative-algorithm GRAFT_STANDALONE``)."""

    draft_kind = "standalone"


def graft_worker(server_args: Any) -> type:
    """Worker factory of ``GRAFT``, called in each scheduler process (imports lazily)."""
    from sglang_graft.sglang.worker import GraftWorker

    return GraftWorker


def graft_standalone_worker(server_args: Any) -> type:
    """Worker factory of ``GRAFT_STANDALONE``."""
    from sglang_graft.sglang.worker import GraftStandaloneWorker

    return GraftStandaloneWorker


#: Registered name -> (spec class, worker factory).
ALGORITHMS: dict[str, tuple[type[GraftSpecAlgo], Any]] = {
    "GRAFT": (GraftSpecAlgo, graft_worker),
    "GRAFT_STANDALONE": (GraftStandaloneSpecAlgo, graft_standalone_worker),
}


def is_graft_algorithm(name: str | None) -> bool:
    """Whether a ``--speculative-algorithm`` value names one of Graft's algorithms."""
    return name is not None and name.upper() in ALGORITHMS
