"""The Graft workers: SGLang's EAGLE V2 (or standalone V2) worker with a Graft draft side.

Like ``StandaloneWorkerV2``, Graft swaps only the draft worker. The target prefill,
tree-attention verify (FlashInfer/Triton read the tree mask), the KV move of the
accepted path and the draft re-extension are SGLang's own code, run unchanged.

The draft worker differs from EAGLE's in two methods:

* ``draft_forward``: EAGLE's multi-step top-k drafting (``select_top_k_tokens``, one
  draft forward per level), gated after each level by Graft's confidence gates; in eager
  mode the batch stops drafting when no request may continue. It returns every drafted
  candidate (not EAGLE's top ``n - 1``) as batch-first tensors, so SGLang's draft CUDA
  graph captures it unchanged; inside a graph all levels run (a graph cannot branch on
  the gates) and the gates prune afterwards.
* ``draft``: turns those candidates into the verify tree with ``TreeBuilder`` (prune,
  retrieve into the freed slots, graft, pack; the pruning and grafting replayed from a
  CUDA graph per batch bucket unless ``--graft-eager-core``; retrieval runs on the host and
  hands its proposals over) and gives SGLang a ``GraftVerifyInput`` with exactly
  ``--speculative-num-draft-tokens`` nodes per request.

After SGLang's verify, the spec worker feeds the accepted path and the target's top-k
back into calibration and retrieval and attaches per-request accepted tokens by source
to the response's ``meta_info`` (key ``graft_accepted``: one ``{source: tokens}`` dict
per verify round, emitted when the request finishes; a streaming request gets the
rounds done by its first chunk).

SGLang builds its own draft worker inside ``EAGLEWorkerV2.__init__`` (loading the draft
weights there); rather than copy that constructor, the Graft worker lets it run and then
re-classes the finished draft worker to its Graft subclass, which adds state but no
constructor. This needs a GPU; the pure parts (``tree_step``, ``session``, ``feedback``)
are tested on CPU.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative.base_spec_worker import EagleDraftWorkerBase
from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc
from sglang.srt.speculative.eagle_worker_common import prepare_for_draft
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2
from sglang.srt.speculative.spec_utils import renorm_draft_probs, select_top_k_tokens
from sglang.srt.speculative.standalone_worker_v2 import StandaloneDraftWorker, StandaloneWorkerV2
from sglang.srt.utils.common import fast_topk

from sglang_graft.sglang import radix_feed
from sglang_graft.sglang.feedback import META_KEY
from sglang_graft.sglang.plugin import add_hooks
from sglang_graft.sglang.session import GraftSession
from sglang_graft.sglang.settings import settings_of
from sglang_graft.sglang.tree_step import DraftOutputs, flatten_draft_steps
from sglang_graft.sglang.verify_input import GraftVerifyInput

logger = logging.getLogger(__name__)

_MASK_MODES = {TreeMaskMode.FULL_MASK: "full", TreeMaskMode.QLEN_ONLY: "qlen"}

#: ``(dotted target, hook name)``: ``AFTER`` hooks the worker installs in its scheduler process.
WORKER_HOOKS: tuple[tuple[str, str], ...] = (
    (
        "sglang.srt.managers.scheduler_components.output_streamer."
        "SchedulerOutputStreamer.is_request_level_customized_info_key",
        "_graft_meta_is_request_level",
    ),
)


def _graft_meta_is_request_level(result: bool, streamer: Any, key: str) -> bool | None:
    """Graft's per-round counts are one list per request, not one value per output token:
    SGLang must emit them whole (when the request finishes) instead of slicing them."""
    return True if key == META_KEY else None


class GraftDraftMixin(EagleDraftWorkerBase):
    """Graft's ``draft_forward`` and ``draft`` on top of an EAGLE-style draft worker.

    It derives from SGLang's draft-worker base so that a built EAGLE or standalone draft
    worker can be re-classed to its Graft subclass (same object layout).
    """

    session: GraftSession

    def draft_forward(self, forward_batch: Any) -> tuple[torch.Tensor, ...]:
        """All draft candidates of this round (see ``flatten_draft_steps``); never idle
        (``draft`` answers idle batches without drafting)."""
        spec_info = forward_batch.spec_info
        builder = self.session.builder
        topk_p, topk_index, hidden_states = spec_info.topk_p, spec_info.topk_index, spec_info.hidden_states
        if self.hot_token_id is not None:
            topk_index = self.hot_token_id[topk_index]
        out_cache_loc = per_step_draft_out_cache_loc(
            forward_batch.out_cache_loc, forward_batch.batch_size, self.topk, self.speculative_num_steps
        )
        # A CUDA graph cannot branch on the gates: it drafts every level, pruning follows.
        may_stop = builder.gates_active and not (
            torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        )
        score_list, token_list, parents_list, continues = [], [], [], []
        scores = None
        for i in range(self.speculative_num_steps):
            input_ids, hidden_states, scores, (level_scores, level_tokens, level_parents) = select_top_k_tokens(
                i, topk_p, topk_index, hidden_states, scores, self.topk
            )
            score_list.append(level_scores)
            token_list.append(level_tokens)
            parents_list.append(level_parents)
            if i == self.speculative_num_steps - 1:
                break
            go_on = builder.draft_continues(i + 1, level_scores)
            continues.append(go_on)
            if may_stop and not bool(go_on.any()):
                break  # every request of the batch is gated: skip the remaining draft forwards
            forward_batch.input_ids = input_ids
            forward_batch.out_cache_loc = out_cache_loc[i]
            spec_info.hidden_states = hidden_states
            with forward_context(
                ForwardContext(attn_backend=self.draft_attn_backend.attn_backends[i]), forward_batch=forward_batch
            ):
                logits_output = self.draft_runner.forward(forward_batch).logits_output
            probs = renorm_draft_probs(logits_output.next_token_logits, forward_batch.sampling_info, False)
            topk_p, topk_index = fast_topk(probs, self.topk, dim=-1)
            forward_batch.positions.add_(1)
            if self.draft_runner.model_config.model_is_mrope:
                forward_batch.mrope_positions.add_(1)
            if self.hot_token_id is not None:
                topk_index = self.hot_token_id[topk_index]
            hidden_states = logits_output.hidden_states
        return flatten_draft_steps(score_list, token_list, parents_list, continues)

    def draft(self, batch: Any, *, with_topology: bool = False) -> GraftVerifyInput:
        """Draft, build the grafted tree and return SGLang's verify input for it."""
        if with_topology:
            raise RuntimeError("Graft does not support pipeline parallelism (refused at startup)")
        draft_input = batch.spec_info
        if batch.forward_mode.is_idle():
            return GraftVerifyInput.create_idle_input(
                self.topk, self.speculative_num_steps, self.speculative_num_draft_tokens, self.device
            )
        rids = self.session.begin_round(batch.reqs)
        forward_batch, can_run_graph, kv_loc_plan = prepare_for_draft(
            draft_input,
            self.req_to_token_pool,
            batch,
            self.cuda_graph_runner,
            self.draft_runner,
            self.topk,
            self.speculative_num_steps,
            target_translator=self.target_worker.model_runner.kv_index_translator,
            num_draft_tokens=self.speculative_num_draft_tokens,
        )
        if can_run_graph:
            outputs = self.cuda_graph_runner.execute(forward_batch)
        else:
            if self.speculative_num_steps > 1:
                self.draft_attn_backend.init_forward_metadata(forward_batch)
                forward_batch.mark_forward_metadata_ready()
            outputs = self.draft_forward(forward_batch)
        drafts = DraftOutputs.from_flat(*outputs, topk=self.topk)
        verify_input = self._graft_verify_input(batch, rids, draft_input.bonus_tokens, drafts)
        if kv_loc_plan is not None:
            verify_input.kv_loc_plan = kv_loc_plan
            verify_input.prepared_out_cache_loc = kv_loc_plan.write_virtual
        return verify_input

    def _graft_verify_input(self, batch: Any, rids: list[str], bonus: torch.Tensor, drafts: DraftOutputs) -> GraftVerifyInput:
        bs = batch.seq_lens.shape[0]
        verify_mask = self.target_worker.model_runner.attn_backend.verify_mask
        mode = self.tree_mask_mode if verify_mask is None else verify_mask.mode
        if mode not in _MASK_MODES:
            raise ValueError(
                f"Graft packs FULL_MASK or QLEN_ONLY tree masks; this attention backend needs {TreeMaskMode(mode).name}"
            )
        seq_lens_sum = batch.seq_lens_sum
        if seq_lens_sum is None and batch.seq_lens_cpu is not None:
            seq_lens_sum = int(batch.seq_lens_cpu.sum())
        built = self.session.build(rids, bonus, drafts, batch.seq_lens, _MASK_MODES[mode], seq_lens_sum)
        mask = built.layout.tree_mask
        if verify_mask is not None and verify_mask.fits(bs) and mask.numel() <= verify_mask.buffer.numel():
            # The backend reads its own preallocated buffer (cells past this batch are unread).
            verify_mask.buffer[: mask.numel()].copy_(mask)
            mask = verify_mask.buffer
        layout = built.layout
        return GraftVerifyInput(
            draft_token=layout.draft_tokens,
            custom_mask=mask,
            positions=layout.positions,
            retrieve_index=layout.retrive_index,
            retrieve_next_token=layout.retrive_next_token,
            retrieve_next_sibling=layout.retrive_next_sibling,
            retrieve_cum_len=None,
            spec_steps=self.speculative_num_steps,
            topk=self.topk,
            draft_token_num=self.speculative_num_draft_tokens,
            capture_hidden_mode=None,
            seq_lens_sum=None,
            seq_lens_cpu=None,
        )


class GraftDraftWorker(GraftDraftMixin, EagleDraftWorker):
    """EAGLE-3 draft head, Graft tree."""


class GraftStandaloneDraftWorker(GraftDraftMixin, StandaloneDraftWorker):
    """Plain small draft LM, Graft tree."""


class GraftSpecWorkerMixin:
    """Verify feedback and request lifecycle, shared by both Graft spec workers."""

    def _adopt_graft_draft_worker(self, upstream: type, graft: type) -> None:
        draft_worker = self._draft_worker
        if type(draft_worker) is not upstream:
            raise RuntimeError(
                f"sglang-graft expected SGLang to build a {upstream.__name__} draft worker, "
                f"got {type(draft_worker).__name__}; this SGLang is not the pinned version"
            )
        draft_worker.__class__ = graft
        settings = settings_of(self.server_args)
        if get_parallel().tp_rank != 0:
            settings = dataclasses.replace(settings, log_interval=0)  # one log line per round, not per rank
        draft_worker.session = GraftSession.for_launch(
            settings,
            num_nodes=self.speculative_num_draft_tokens,
            topk=self.topk,
            num_steps=self.speculative_num_steps,
            vocab_size=self.target_worker.model_runner.model_config.vocab_size,
            device=self.device,
        )
        add_hooks((target, globals()[name], "AFTER") for target, name in WORKER_HOOKS)
        retriever = draft_worker.session.retriever
        if retriever is not None and retriever.history is not None:
            radix_feed.install(retriever.history)

    def verify(self, batch: Any, pp_proxy_tensors: Any = None, grammar_barrier: Any = None) -> Any:
        result = super().verify(batch, pp_proxy_tensors=pp_proxy_tensors, grammar_barrier=grammar_barrier)
        if batch.forward_mode.is_idle():
            return result
        logits_output = result.logits_output
        rows = self._draft_worker.session.finish_round(result.accept_index, logits_output.next_token_logits)
        info = logits_output.customized_info if logits_output.customized_info is not None else {}
        info[META_KEY] = rows
        logits_output.customized_info = info
        return result

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self._draft_worker.session.close_request(rid)


class GraftWorker(GraftSpecWorkerMixin, EAGLEWorkerV2):
    """``--speculative-algorithm GRAFT``."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        self._adopt_graft_draft_worker(EagleDraftWorker, GraftDraftWorker)


class GraftStandaloneWorker(GraftSpecWorkerMixin, StandaloneWorkerV2):
    """``--speculative-algorithm GRAFT_STANDALONE``."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        self._adopt_graft_draft_worker(StandaloneDraftWorker, GraftStandaloneDraftWorker)
