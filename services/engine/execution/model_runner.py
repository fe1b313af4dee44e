"""Runs one scheduled batch through the model on one rank and samples its tokens.

The runner keeps every request's tokens, block table and sampling generator between
steps (`CachedRequestState`) and applies the scheduler's diffs. Each step it flattens the
batch into one varlen forward pass, decodes first:

    input_ids:   [ d0 | d1 | p0 p0 p0 p0 | p1 p1 ]      positions: each token's index in its sequence
    slot_mapping: block_table[r][pos // B] * B + pos % B

Requests that ask for prompt logprobs also get logits at the prompt positions each chunk
computes (prompt_logprobs.py); the list goes out with their first sampled token.

With speculative heads (`hidden_states`), rank 0 also hands back the final hidden states
the heads draft from, as views of the tensors the step computed anyway (no copy):

    "last"  (medusa)  the row whose logits gave each request's newest token
    "all"   (eagle)   every row of each request this step, less its rejected drafts'
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from baton.kernels import cpu_ops
from baton.kernels.ops import KernelImpl

from ...kv_transfer.connector import KVConnector
from ...model.attention import AttentionMetadata, PagedAttentionBackend
from ...model.compressed_tensors import load_quantized_weights
from ...model.config import ModelArch
from ...model.cpu_tuning import release_freed_memory
from ...model.linear import process_weights_after_loading
from ...model.parallel import TPGroup
from ...model.registry import create_model
from ..api.sampling_params import SamplingParams
from ..core.scheduler_output import HiddenRows, ModelRunnerOutput, SampledToken, SchedulerOutput
from ..spec_decode.verify import sample_and_verify
from .decode_graphs import Capture, DecodeGraphs, cuda_capture
from .hidden_rows import HiddenStatesMode, last_rows, verified_rows
from .prompt_logprobs import PromptSpan, prompt_span, score_prompt_spans
from .sampler import LogitBias, Sampler, SamplingRow


@dataclass(slots=True)
class CachedRequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator
    block_ids: list[int]
    num_computed_tokens: int
    needs_sampling: bool
    logit_bias: LogitBias | None = None  # sampling_params.logit_bias on the device
    # Asked for prompt logprobs: the entries so far (prompt_logprobs.py); None once sent.
    prompt_logprobs: list[SampledToken] | None = None


@dataclass(slots=True)
class _BatchInputs:
    request_ids: list[str]  # batch order
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # last token of each request that samples
    sample_request_ids: list[str]
    prompt_spans: list[PromptSpan]  # prompt positions whose logits score prompt tokens
    # hidden_states "all" only: each request's first row in the flat batch (its rows are
    # consecutive: a decode with drafts is one row per token, side by side)
    flat_starts: dict[str, int]


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        arch: ModelArch,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        kernel_impl: KernelImpl,
        tp: TPGroup,
        connector: KVConnector | None = None,
        hidden_states: HiddenStatesMode | None = None,
        quantization: str | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.arch = arch
        self.hidden_states = hidden_states
        self.connector = connector
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype  # bfloat16 under a float32 model halves the cache
        self.device = device
        self.block_size = block_size
        self.tp = tp
        _prepare_cpu_kernels(kernel_impl, device)
        backend = PagedAttentionBackend(kernel_impl)
        self.model = create_model(arch, backend, tp, dtype, device, kernel_impl)
        self.checkpoint_layout = load_quantized_weights(self.model, model_dir)  # what weight updates must match
        process_weights_after_loading(self.model, kernel_impl, quantization=quantization)
        self.model.eval()
        self.sampler = Sampler(arch.eos_token_ids)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        attn = self.model.model.layers[0].self_attn
        self.num_kv_heads = attn.num_kv_heads  # this rank's
        self.graphs: DecodeGraphs | None = None  # engine.runner.cuda_graphs (enable_decode_graphs)

    # -- KV cache ---------------------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block takes across all layers (K and V) on this rank."""
        per_layer = 2 * self.block_size * self.num_kv_heads * self.arch.head_dim
        return per_layer * self.arch.num_layers * self.kv_cache_dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.arch.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device) for _ in range(self.arch.num_layers)
        ]
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_caches)

    def release_kv_cache(self) -> None:
        """Frees the KV-cache tensors (sleep); `initialize_kv_cache` brings them back, zeroed
        (and hands them to the connector). The connector lets go of them too, or nothing is freed."""
        if self.connector is not None:
            self.connector.release_kv_caches()
        if self.graphs is not None:
            self.graphs.drop()
        self.kv_caches = []
        release_freed_memory(self.device)  # to the device or the OS, not just to the allocator

    def enable_decode_graphs(self, max_batch_size: int, max_model_len: int, capture: Capture = cuda_capture) -> None:
        """Decode-only steps replay CUDA graphs from here on, every bucket captured now
        (decode_graphs.py); `capture` is how (CUDA's, or a stand-in that runs eagerly)."""
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, self.block_size, max_batch_size, max_model_len, self.device, capture
        )
        with torch.inference_mode():
            self.graphs.capture_all()

    def refresh_decode_graphs(self) -> None:
        """Between steps: graphs captured on weights or a KV cache since moved are dropped,
        and their memory given back (sleep frees the weights this way)."""
        if self.graphs is not None and self.graphs.refresh(self.kv_caches):
            release_freed_memory(self.device)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    # -- one step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.block_copies:
            self._copy_blocks(scheduler_output.block_copies)
        if self.connector is not None:
            self._hand_over(scheduler_output)
        sampled, hidden = self._run(scheduler_output) if not scheduler_output.is_empty else ({}, {})
        status = self.connector.poll() if self.connector is not None else None
        return ModelRunnerOutput(sampled, status, hidden)

    def _run(self, scheduler_output: SchedulerOutput) -> tuple[dict, dict[str, HiddenRows]]:
        batch = self._prepare_inputs(scheduler_output)
        if self.graphs is not None and self.graphs.fits(batch.metadata):
            hidden = self.graphs.forward(batch.input_ids, batch.positions, batch.metadata)
            if self.hidden_states is not None:  # the heads read them after the next replay may have run
                hidden = hidden.clone()
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata)
        if batch.prompt_spans:
            self._score_prompt(hidden, batch.prompt_spans)
        if not batch.sample_request_ids:
            return {}, self._hidden_rows(scheduler_output, batch, hidden, hidden, {})
        selected = hidden[batch.logits_indices]
        logits = self.model.compute_logits(selected)
        prompt_logprobs = self._take_prompt_logprobs(batch.sample_request_ids)
        if self.tp.rank != 0:
            return {}, {}  # rank 0 samples for the group
        masks = scheduler_output.grammar_bitmasks
        rows = [self._sampling_row(self.requests[rid], masks.get(rid)) for rid in batch.sample_request_ids]
        spec = scheduler_output.spec_token_ids
        if not spec:
            sampled = {rid: [token] for rid, token in zip(batch.sample_request_ids, self.sampler(logits, rows))}
        else:
            sampled = sample_and_verify(
                self.sampler, logits, batch.sample_request_ids, rows, spec, scheduler_output.spec_draft_probs
            )
        for rid, entries in prompt_logprobs.items():
            sampled[rid][0].prompt_logprobs = entries
        return sampled, self._hidden_rows(scheduler_output, batch, hidden, selected, sampled)

    def _hidden_rows(
        self, so: SchedulerOutput, batch: _BatchInputs, hidden: torch.Tensor, selected: torch.Tensor, sampled: dict
    ) -> dict[str, HiddenRows]:
        if self.hidden_states is None or self.tp.rank != 0:
            return {}
        firsts = {rid: self.requests[rid].num_computed_tokens for rid in so.num_scheduled_tokens}
        if self.hidden_states == "last":
            rows = last_rows(so, batch.sample_request_ids, firsts, selected, sampled)
        else:
            rows = verified_rows(so, batch.flat_starts, firsts, hidden, sampled)
        if self.tp.world_size > 1:  # pickled to the engine's process: host memory, each its own storage
            rows = {rid: HiddenRows(r.first_position, r.rows.cpu().clone()) for rid, r in rows.items()}
        return rows

    def _score_prompt(self, hidden: torch.Tensor, spans: list[PromptSpan]) -> None:
        """Adds this step's prompt positions to each asking request's entries."""
        states = {s.request_id: self.requests[s.request_id] for s in spans}
        scored = score_prompt_spans(
            self.model.compute_logits,
            hidden,
            spans,
            {rid: state.token_ids for rid, state in states.items()},
            {rid: state.sampling_params.prompt_logprobs for rid, state in states.items()},
            is_sampling_rank=self.tp.rank == 0,
        )
        for span in spans:
            entries = states[span.request_id].prompt_logprobs
            del entries[span.first_position :]  # a recomputed prompt replaces what it had
            entries.extend(scored.get(span.request_id, ()))

    def _take_prompt_logprobs(self, sample_request_ids: list[str]) -> dict[str, list[SampledToken]]:
        """The finished entries of requests sampling their first token; every rank forgets
        them, so all ranks keep planning the same prompt spans."""
        taken = {}
        for rid in sample_request_ids:
            state = self.requests[rid]
            if state.prompt_logprobs is not None:
                taken[rid], state.prompt_logprobs = state.prompt_logprobs, None
        return taken

    def _hand_over(self, so: SchedulerOutput) -> None:
        """Passes the scheduler's transfer decisions to the connector, before the forward pass:
        ended leases first, so blocks reused by this step are no longer being sent."""
        if so.kv_leases_removed:
            self.connector.remove_leases(so.kv_leases_removed)
        if so.kv_leases_added:
            self.connector.add_leases(so.kv_leases_added)
        for task in so.kv_recvs:
            self.connector.start_recv(task)

    def _update_states(self, so: SchedulerOutput) -> None:
        for request_id in so.finished_req_ids:
            self.requests.pop(request_id, None)
        for request_id in so.preempted_req_ids:
            state = self.requests.get(request_id)
            if state is not None:
                state.block_ids = []
        for new in so.scheduled_new_reqs:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(new.seed)
            self._replay_draws(generator, new)
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                generator=generator,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                needs_sampling=new.needs_sampling,
                logit_bias=LogitBias.build(new.sampling_params.logit_bias, self.device),
                prompt_logprobs=[] if new.sampling_params.prompt_logprobs is not None else None,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            state.token_ids.extend(cached.new_token_ids)
            if cached.block_ids is not None:
                state.block_ids = list(cached.block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _replay_draws(self, generator: torch.Generator, new) -> None:
        """A request that arrives with output tokens sampled elsewhere (the prefill worker drew
        the first one) advances its generator past those draws, so a seeded request samples
        the same tokens as it would have in one engine."""
        num_outputs = len(new.token_ids) - new.num_prompt_tokens
        if num_outputs and not new.sampling_params.is_greedy:
            for _ in range(num_outputs):
                torch.empty(self.arch.vocab_size, device=self.device).exponential_(generator=generator)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for kv_cache in self.kv_caches:
            kv_cache[:, dst] = kv_cache[:, src]

    def _prepare_inputs(self, so: SchedulerOutput) -> _BatchInputs:
        counts, spec = so.num_scheduled_tokens, so.spec_token_ids
        # Attention rows: decodes (one query token) first, then prefill chunks; stable within
        # each group. A decode with drafts is one row per token (its last sampled token, then
        # each draft, each seeing the context up to itself), so verification runs on the
        # decode kernel rather than paying a prefill over the whole context.
        decode_rows, prefill_rows = [], []  # (request id, state, first position, tokens)
        for rid, n in counts.items():
            state = self.requests[rid]
            first = state.num_computed_tokens
            if n == 1 or rid in spec:
                decode_rows.extend((rid, state, first + j, 1) for j in range(n))
            else:
                prefill_rows.append((rid, state, first, n))
        rows = decode_rows + prefill_rows
        order = list(counts)
        num_tokens = np.array([n for *_, n in rows], dtype=np.int64)
        starts = np.array([first for _, _, first, _ in rows], dtype=np.int64)
        seq_lens = starts + num_tokens

        input_ids: list[int] = []
        for rid, state, first, n in rows:
            if first + n <= len(state.token_ids):
                input_ids.extend(state.token_ids[first : first + n])
            else:  # a draft, after the request's last real token
                input_ids.append(spec[rid][first - len(state.token_ids)])
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_tokens, out=query_start_loc[1:])
        row_index = np.repeat(np.arange(len(rows)), num_tokens)
        positions = starts[row_index] + (np.arange(len(input_ids)) - query_start_loc[row_index])

        max_blocks = max(len(state.block_ids) for _, state, _, _ in rows)
        block_tables = np.zeros((len(rows), max_blocks), dtype=np.int64)
        for i, (_, state, _, _) in enumerate(rows):
            block_tables[i, : len(state.block_ids)] = state.block_ids
        slots = block_tables[row_index, positions // self.block_size] * self.block_size
        slots += positions % self.block_size

        # Each request's last query token (and its drafts' tokens) in the flat batch.
        ends: dict[str, list[int]] = {}
        prompt_spans = []
        for i, (rid, state, first, n) in enumerate(rows):
            ends.setdefault(rid, []).append(int(query_start_loc[i + 1]) - 1)
            if state.prompt_logprobs is not None:
                span = prompt_span(rid, first, n, state.num_prompt_tokens, int(query_start_loc[i]))
                if span is not None:
                    prompt_spans.append(span)
        sample_ids, logits_indices = [], []
        for rid in order:
            state, num_drafts = self.requests[rid], len(spec.get(rid, ()))
            if state.needs_sampling and state.num_computed_tokens + counts[rid] == len(state.token_ids) + num_drafts:
                sample_ids.append(rid)
                logits_indices.extend(ends[rid][-1 - num_drafts :])  # the last real token and each draft

        def to_device(array, dtype=torch.int64) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)

        metadata = AttentionMetadata(
            slot_mapping=to_device(slots),
            query_start_loc=to_device(query_start_loc, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            block_tables=to_device(block_tables, torch.int32),
            num_decodes=len(decode_rows),
            max_query_len=int(num_tokens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return _BatchInputs(
            request_ids=order,
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=to_device(positions),
            metadata=metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.device),
            sample_request_ids=sample_ids,
            prompt_spans=prompt_spans,
            flat_starts={rid: ends[rid][-1] + 1 - counts[rid] for rid in order} if self.hidden_states == "all" else {},
        )

    @staticmethod
    def _sampling_row(state: CachedRequestState, grammar_bitmask: torch.Tensor | None) -> SamplingRow:
        return SamplingRow(
            params=state.sampling_params,
            generator=state.generator,
            prompt_token_ids=state.token_ids[: state.num_prompt_tokens],
            output_token_ids=state.token_ids[state.num_prompt_tokens :],
            grammar_bitmask=grammar_bitmask,
            logit_bias=state.logit_bias,
        )


def _prepare_cpu_kernels(kernel_impl: KernelImpl, device: torch.device) -> None:
    """Builds the C++ CPU kernels at start-up rather than in the first decode step; "cpp"
    fails here, with the reason, where they cannot be had."""
    if kernel_impl == "cpp":
        if device.type != "cpu":
            raise ValueError(f"kernel_backend 'cpp' runs on the CPU; this engine's device is {device.type}")
        cpu_ops.require()
    elif kernel_impl == "auto" and device.type == "cpu":
        cpu_ops.available()
