"""The fan-out of one user request into the engine requests that run it.

    n == 1        one request, named like the user request
    n > 1         a prefix request fills the blocks of all but the last prompt token once
                  (no sampling), then forks into n samples "<id>/<i>" sharing its blocks;
                  a one-token prompt starts the n samples at once, and so does a request
                  asking for prompt logprobs: each sample computes the whole prompt with its
                  logits, so the first output of any sample carries them
    best_of > n   as n > 1 with best_of samples; the output keeps the n best (output_processor)
    beam search   one request per live beam "<id>/beam<k>", forked, extended and dropped
                  by `BeamSearchGroup` (beam_search.py)

`RequestGroups` owns the maps between user and engine request ids, the child seeds and the
one `Request` factory; it turns each sampled token into scheduler and output updates.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...kv_transfer.types import KVTransferParams
from ..api.input_processor import PreparedRequest
from ..api.output_processor import OutputProcessor
from ..api.sampling_params import SamplingParams
from ..errors import InvalidRequestError
from ..structured_output.request_grammar import RequestGrammar
from .beam_search import Beam, BeamSearchGroup, beam_member_params
from .block_hash import request_extra_keys
from .request import Request, RequestStatus
from .scheduler import Scheduler
from .scheduler_output import SampledToken, SchedulerOutput

logger = logging.getLogger(__name__)


class MemberKind(enum.Enum):
    SAMPLE = enum.auto()  # produces sample `index` of the user request
    PREFIX = enum.auto()  # n > 1: fills the shared prompt blocks, then forks the samples
    BEAM = enum.auto()  # one live beam


@dataclass(slots=True)
class Member:
    """What an engine request is to its user request."""

    user_id: str
    kind: MemberKind
    index: int = 0  # sample index (n > 1); 0 for prefix and beam members


@dataclass(slots=True)
class RequestGroup:
    """One user request: what every engine request made for it shares."""

    user_id: str
    prepared: PreparedRequest
    seed: int  # the user's, or one the engine drew
    eos_token_ids: frozenset[int]
    vocab_size: int
    compiled_grammar: Any = None  # structured output: each sampling request gets its own matcher
    engine_ids: list[str] = field(default_factory=list)  # live engine requests
    beams: BeamSearchGroup | None = None

    def new_request(
        self,
        engine_id: str,
        params: SamplingParams | None = None,
        seed: int | None = None,
        token_ids: list[int] | None = None,
        output_token_ids: list[int] | None = None,
        needs_sampling: bool = True,
    ) -> Request:
        """The one place an engine request is built."""
        prepared = self.prepared
        output_token_ids = list(output_token_ids or ())
        params = params or prepared.params
        if params.prompt_logprobs is not None and prepared.handover is not None and prepared.handover.is_decode:
            # The prefill worker sent them with the first token (a resumed request: its first
            # worker did); here the prompt's K/V arrives or is recomputed without them.
            params = dataclasses.replace(params, prompt_logprobs=None)
        grammar = None
        if self.compiled_grammar is not None and needs_sampling:
            grammar = RequestGrammar(self.compiled_grammar, self.vocab_size)
            if not grammar.accept_all(output_token_ids):  # tokens another worker generated
                raise InvalidRequestError(
                    prepared.params.structured_output.field_name, "the tokens handed over do not match it"
                )
        return Request(
            request_id=engine_id,
            prompt_token_ids=prepared.prompt_token_ids if token_ids is None else token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=prepared.max_tokens,
            seed=self.seed if seed is None else seed,
            extra_keys=request_extra_keys(prepared.cache_salt),
            arrival_time=prepared.arrival_time,
            needs_sampling=needs_sampling,
            handover=prepared.handover,
            grammar=grammar,
            output_token_ids=output_token_ids,
        )


class RequestGroups:
    def __init__(
        self,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        seed: int,
        transfer_params: Callable[[Request], KVTransferParams],
    ) -> None:
        self.scheduler = scheduler
        self.outputs = outputs
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.transfer_params = transfer_params  # where a decode worker fetches a leased prompt
        self._rng = random.Random(seed)
        self.groups: dict[str, RequestGroup] = {}
        self.members: dict[str, Member] = {}  # engine request id -> its place in a group
        self.num_constrained = 0  # live groups with a grammar

    def __bool__(self) -> bool:
        return bool(self.groups)

    def engine_ids(self, user_id: str) -> list[str]:
        group = self.groups.get(user_id)
        return [] if group is None else list(group.engine_ids)

    # -- lifecycle --------------------------------------------------------------------

    def is_known(self, user_id: str) -> bool:
        return user_id in self.groups or user_id in self.outputs.states

    def add(self, prepared: PreparedRequest) -> None:
        """Queues the engine requests of a prepared request whose grammar (if any) is compiled;
        raises InvalidRequestError (a reused id, a grammar that failed) before queueing any."""
        user_id, params, prompt_ids = prepared.request_id, prepared.params, prepared.prompt_token_ids
        if self.is_known(user_id):
            raise InvalidRequestError("request_id", f"{user_id!r} is already in use")
        compiled = prepared.compiled_grammar()
        seed = prepared.seed if prepared.seed is not None else self._rng.getrandbits(63)
        group = RequestGroup(user_id, prepared, seed, self.eos_token_ids, self.vocab_size, compiled)
        num_samples = params.beam_width if params.use_beam_search else params.num_samples
        if num_samples == 1 and not params.use_beam_search:
            # Built first: it may refuse handed-over tokens, and nothing is registered yet then.
            single = group.new_request(user_id, output_token_ids=list(prepared.output_prefix))
        self.groups[user_id] = group
        self.num_constrained += compiled is not None
        self.outputs.add_request(
            user_id, prepared.prompt, prompt_ids, params, prepared.arrival_time, num_samples, prepared.output_prefix
        )
        if params.use_beam_search:
            first = group.new_request(f"{user_id}/beam0", params=beam_member_params(params))
            group.beams = BeamSearchGroup(user_id, params, self.eos_token_ids, [Beam(first, 0.0)])
            self._submit(first, Member(user_id, MemberKind.BEAM))
        elif num_samples == 1:
            self._submit(single, Member(user_id, MemberKind.SAMPLE))
        elif len(prompt_ids) == 1 or params.prompt_logprobs is not None:
            for i in range(num_samples):
                child = group.new_request(f"{user_id}/{i}", seed=_child_seed(seed, i))
                self._submit(child, Member(user_id, MemberKind.SAMPLE, i))
        else:
            prefix = group.new_request(f"{user_id}/prefix", token_ids=prompt_ids[:-1], needs_sampling=False)
            self._submit(prefix, Member(user_id, MemberKind.PREFIX))

    def abort(self, user_id: str) -> None:
        """Stops every engine request of the user request and frees their blocks."""
        group = self.groups.pop(user_id, None)
        if group is None:
            return
        self.num_constrained -= group.compiled_grammar is not None
        for engine_id in group.engine_ids:
            self.scheduler.finish_request(engine_id, RequestStatus.FINISHED_ABORTED)
            self.members.pop(engine_id, None)
        self.outputs.abort(user_id)

    # -- each step --------------------------------------------------------------------

    def on_sampled(self, request_id: str, tokens: list[SampledToken], now: float) -> None:
        """Applies a step's tokens of one request (one, or accepted drafts and the token after
        them) in order, up to the one that finishes it: to its beam group, or to the request
        and its output."""
        request = self.scheduler.get_request(request_id)
        member = self.members.get(request_id)
        if request is None or member is None:
            return  # aborted while the step ran
        if request.first_token_time is None:
            request.first_token_time = now
        if member.kind is MemberKind.BEAM:
            (sampled,) = tokens  # beams never speculate
            beams = self.groups[member.user_id].beams
            if beams.report(request_id, sampled):
                self._advance_beams(self.groups[member.user_id])
            return
        for sampled in tokens:
            if self._apply_token(request_id, request, member, sampled):
                return

    def _apply_token(self, request_id: str, request: Request, member: Member, sampled: SampledToken) -> bool:
        """Appends one token to the request and its output; True if it finished the request."""
        finished = self.scheduler.append_token(request, sampled.token_id)
        if request.grammar is not None and self._grammar_ends(request, sampled.token_id):
            self.scheduler.stop(request)
            finished = True
        stop_string = self.outputs.on_token(member.user_id, member.index, sampled.token_id, sampled, request)
        if stop_string is not None:
            self.scheduler.stop(request, stop_string)
            finished = True
        if finished:
            if self.scheduler.is_leased(request_id):
                self.outputs.set_kv_transfer_params(member.user_id, self.transfer_params(request))
            self.outputs.on_finished(member.user_id, member.index, request)
            self._release(request_id)
        return finished

    def grammar_bitmasks(self, scheduler_output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Allowed next tokens of each constrained request that samples in this step: one
        row, or with drafts one row per verified position."""
        if not self.num_constrained:
            return {}  # the common step: nothing to look at
        masks = {}
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.scheduler.get_request(request_id)
            # The scheduler has already advanced num_computed_tokens past this step's tokens.
            if (
                request.grammar is not None
                and request.needs_sampling
                and request.num_computed_tokens >= request.num_tokens
            ):
                drafts = scheduler_output.spec_token_ids.get(request_id)
                masks[request_id] = request.grammar.fill_bitmasks(drafts) if drafts else request.grammar.fill_bitmask()
        return masks

    def fork_completed_prefixes(self) -> None:
        """n > 1: once the shared prompt prefix is computed, fork the n samples from it."""
        for request_id, member in list(self.members.items()):
            if member.kind is not MemberKind.PREFIX:
                continue
            prefix = self.scheduler.get_request(request_id)
            if prefix.status != RequestStatus.RUNNING or prefix.num_computed_tokens < prefix.num_tokens:
                continue
            group = self.groups[member.user_id]
            for i in range(group.prepared.params.num_samples):
                child = group.new_request(f"{member.user_id}/{i}", seed=_child_seed(group.seed, i))
                self.scheduler.add_forked_request(prefix, child)
                self._adopt(child, Member(member.user_id, MemberKind.SAMPLE, i))
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
            self._release(request_id)

    # -- internals --------------------------------------------------------------------

    def _grammar_ends(self, request: Request, token_id: int) -> bool:
        """Advances the request's matcher; True once its output is complete. A token the
        grammar refuses (the mask should make that impossible) ends the request too."""
        if request.grammar.accept(token_id):
            return request.grammar.is_terminated
        logger.error("request %s sampled token %d that its grammar refuses; stopping it", request.request_id, token_id)
        return True

    def _submit(self, request: Request, member: Member) -> None:
        self.scheduler.add_request(request)
        self._adopt(request, member)

    def _adopt(self, request: Request, member: Member) -> None:
        self.members[request.request_id] = member
        self.groups[member.user_id].engine_ids.append(request.request_id)

    def _release(self, request_id: str) -> None:
        member = self.members.pop(request_id, None)
        if member is None:
            return
        group = self.groups[member.user_id]
        group.engine_ids.remove(request_id)
        if not group.engine_ids and (group.beams is None or group.beams.is_done):
            del self.groups[member.user_id]
            self.num_constrained -= group.compiled_grammar is not None

    def _advance_beams(self, group: RequestGroup) -> None:
        user_id, beams = group.user_id, group.beams

        def fork(parent: Request, new_id: str) -> Request:
            child = group.new_request(
                new_id, params=parent.sampling_params, output_token_ids=list(parent.output_token_ids)
            )
            self.scheduler.add_forked_request(parent, child)
            self._adopt(child, Member(user_id, MemberKind.BEAM))
            return child

        def append(request: Request, token_id: int) -> None:
            self.scheduler.append_token(request, token_id, check_stop=False)

        def drop(request: Request) -> None:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            self._release(request.request_id)

        beams.advance(fork, append, drop)
        if not beams.is_done:
            return
        self.groups.pop(user_id, None)
        best = beams.best()
        for index in range(beams.width):
            if index >= len(best):  # fewer hypotheses than beams (several EOS ids)
                self.outputs.set_final(user_id, index, [], 0.0, "stop")
                continue
            hypothesis = best[index]
            ended_by_eos = bool(hypothesis.token_ids) and hypothesis.token_ids[-1] in self.eos_token_ids
            self.outputs.set_final(
                user_id,
                index,
                hypothesis.token_ids,
                hypothesis.cumulative_logprob,
                "stop" if ended_by_eos and not beams.params.ignore_eos else "length",
            )


def _child_seed(seed: int, index: int) -> int:
    """Sample i of a seeded n > 1 request uses seed + i (as vLLM does)."""
    return (seed + index) % 2**63
