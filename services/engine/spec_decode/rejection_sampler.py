"""Verifies draft tokens against the target model: which drafts a request keeps, and the one
token it emits after them.

For a request with drafts x_0 .. x_{k-1} (drawn from the drafter's q_0 .. q_{k-1}) and the
target's final probabilities p_0 .. p_k (after every sampling transform):

  random   accept x_j with probability min(1, p_j(x_j) / q_j(x_j)), in order; at the first
           rejection r, emit one token from normalize(max(p_r - q_r, 0)) (from p_r where that
           is all zero) and stop; when all k are accepted, emit a bonus token from p_k.
           Every emitted token is then distributed exactly as the target alone would sample
           it, whatever q is (Leviathan et al. 2023; Chen et al. 2023).
  greedy   accept while x_j == argmax p_j, then emit argmax p_r. No random numbers.

q = None says q is one-hot on the drafts (n-gram drafts): x_j is accepted with probability
p_j(x_j), and the residual after a rejection is p_j without x_j.

Random numbers: a request draws its k uniforms, then one Exp(1) per vocabulary entry, from
its own generator (the global RNG when it has none), whatever else is in the batch. The
emitted token is the exponential race argmax(dist / Exp(1)), as in the engine's Sampler, so a
request without drafts samples exactly the token it would sample without speculation.

Layout: flat and request-major, as the model runner lays out the logits it verifies
(here three requests with k = 2, 0, 3):

  num_draft_tokens   [2, 0, 3]
  draft_token_ids    [a0 a1 | c0 c1 c2]                     D = sum k         [D]
  draft_probs        one row per draft                                        [D, V]
  target_probs       [pa0 pa1 pa2 | pb0 | pc0 pc1 pc2 pc3]   D + B rows        [D + B, V]

Request b's first draft is draft number first_draft[b] = k_0 + .. + k_{b-1}; draft d of
request b is verified at target row d + b, and the request's bonus row is
first_draft[b] + b + k_b.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RequestDrafts:
    """One request's drafts and the distributions they are checked against."""

    draft_token_ids: list[int]  # the k drafts, k >= 0
    target_probs: torch.Tensor  # [k + 1, V] the target's final probabilities at each draft and the bonus
    draft_probs: torch.Tensor | None = None  # [k, V] q at each draft; None: one-hot on the drafts
    is_greedy: bool = False  # temperature 0: argmax matching, no random numbers
    generator: torch.Generator | None = None  # this request's RNG; None: the global one


@dataclass(slots=True)
class DraftBatch:
    """A batch of requests to verify, in the flat layout of the module header.

    Rows of p and q must be distributions (non-negative, summing to 1): acceptance compares
    p(x) with q(x) directly. Shapes, devices and token ranges are checked here; sums are not.
    """

    num_draft_tokens: list[int]  # [B] drafts per request (k_b, 0 allowed)
    draft_token_ids: torch.Tensor  # [D] int64, D = sum(num_draft_tokens), request-major
    target_probs: torch.Tensor  # [D + B, V] float: p at each draft position, then at the bonus
    draft_probs: torch.Tensor | None  # [D, V] float: q at each draft; None: one-hot on the drafts
    is_greedy: list[bool]  # [B] temperature 0: argmax matching
    generators: list[torch.Generator | None]  # [B] each request's RNG; None: the global one

    def __post_init__(self) -> None:
        self._check_shapes()

    @classmethod
    def from_requests(cls, requests: Sequence[RequestDrafts]) -> DraftBatch:
        """Concatenates per-request inputs. Requests without q get one-hot rows when others have q."""
        if not requests:
            raise ValueError("requests: a batch needs at least one request")
        vocab = requests[0].target_probs.shape[-1]
        for i, r in enumerate(requests):
            k = len(r.draft_token_ids)
            _require(
                r.target_probs.dim() == 2 and r.target_probs.shape[0] == k + 1,
                f"requests[{i}].target_probs has shape {tuple(r.target_probs.shape)}, expected [k + 1 = {k + 1}, V]",
            )
            _require(
                r.draft_probs is None or tuple(r.draft_probs.shape) == (k, r.target_probs.shape[1]),
                f"requests[{i}].draft_probs has shape {_shape(r.draft_probs)}, expected [k = {k}, V]",
            )
            _require(
                r.target_probs.shape[1] == vocab,
                f"requests[{i}].target_probs has V = {r.target_probs.shape[1]}, requests[0]'s {vocab}",
            )
            _require(
                all(0 <= t < vocab for t in r.draft_token_ids),
                f"requests[{i}].draft_token_ids must lie in [0, V = {vocab}), got {r.draft_token_ids}",
            )
        target_probs = torch.cat([r.target_probs for r in requests])
        device = target_probs.device
        draft_ids = [torch.as_tensor(r.draft_token_ids, dtype=torch.long, device=device) for r in requests]
        draft_probs = None
        if any(r.draft_probs is not None for r in requests):
            rows = [
                r.draft_probs.to(device) if r.draft_probs is not None else _one_hot(ids, vocab, target_probs.dtype)
                for r, ids in zip(requests, draft_ids)
            ]
            draft_probs = torch.cat(rows)
        return cls(
            num_draft_tokens=[len(r.draft_token_ids) for r in requests],
            draft_token_ids=torch.cat(draft_ids),
            target_probs=target_probs,
            draft_probs=draft_probs,
            is_greedy=[r.is_greedy for r in requests],
            generators=[r.generator for r in requests],
        )

    @property
    def num_requests(self) -> int:
        return len(self.num_draft_tokens)

    def _check_shapes(self) -> None:
        num_reqs = self.num_requests
        _require(num_reqs > 0, "num_draft_tokens: a batch needs at least one request")
        _require(
            all(isinstance(k, int) and k >= 0 for k in self.num_draft_tokens),
            f"num_draft_tokens must be non-negative ints, got {self.num_draft_tokens}",
        )
        num_drafts = sum(self.num_draft_tokens)
        ids, p, q = self.draft_token_ids, self.target_probs, self.draft_probs
        _require(
            ids.dim() == 1 and ids.shape[0] == num_drafts and ids.dtype == torch.long,
            f"draft_token_ids must be int64 of shape [sum(num_draft_tokens) = {num_drafts}], "
            f"got {ids.dtype} {tuple(ids.shape)}",
        )
        _require(
            p.dim() == 2 and p.shape[0] == num_drafts + num_reqs and p.is_floating_point(),
            f"target_probs must be float of shape [sum(num_draft_tokens) + num_requests = {num_drafts + num_reqs}, V], "
            f"got {p.dtype} {tuple(p.shape)}",
        )
        vocab = p.shape[1]
        _require(
            q is None or (tuple(q.shape) == (num_drafts, vocab) and q.is_floating_point()),
            f"draft_probs must be None or float of shape [{num_drafts}, V = {vocab}], got {_shape(q)}",
        )
        _require(ids.device == p.device, f"draft_token_ids is on {ids.device}, target_probs on {p.device}")
        _require(q is None or q.device == p.device, f"draft_probs is on {_device(q)}, target_probs on {p.device}")
        _require(
            len(self.is_greedy) == num_reqs, f"is_greedy has {len(self.is_greedy)} entries for {num_reqs} requests"
        )
        _require(
            len(self.generators) == num_reqs, f"generators has {len(self.generators)} entries for {num_reqs} requests"
        )
        if num_drafts:
            low, high = int(ids.min()), int(ids.max())
            _require(low >= 0 and high < vocab, f"draft_token_ids must lie in [0, V = {vocab}), got [{low}, {high}]")


@dataclass(slots=True)
class RejectionOutput:
    # [B] per request: its accepted drafts, then one recovered (after a rejection) or bonus token.
    token_ids: list[list[int]]
    # [B] drafts accepted per request (len(token_ids[b]) - 1).
    num_accepted: list[int]


class RejectionSampler:
    """Exact speculative verification of a `DraftBatch` (see the module header)."""

    def __call__(self, batch: DraftBatch) -> RejectionOutput:
        p, draft_ids = batch.target_probs, batch.draft_token_ids
        device = p.device
        num_reqs, max_k = batch.num_requests, max(batch.num_draft_tokens)
        num_drafts = torch.tensor(batch.num_draft_tokens, device=device)
        first_draft_list = list(itertools.accumulate(batch.num_draft_tokens, initial=0))[:-1]
        first_draft = torch.tensor(first_draft_list, device=device)
        req_of_draft = torch.repeat_interleave(torch.arange(num_reqs, device=device), num_drafts)  # [D]
        draft_rows = torch.arange(draft_ids.shape[0], device=device) + req_of_draft  # [D] target row of each draft
        greedy = torch.tensor(batch.is_greedy, device=device)
        random_reqs = [b for b, is_greedy in enumerate(batch.is_greedy) if not is_greedy]
        uniforms, noise = _draw(batch, random_reqs, first_draft_list)
        target_argmax = p.argmax(dim=-1) if any(batch.is_greedy) else None  # [D + B]

        accepted = self._accept(batch, draft_rows, uniforms, target_argmax, greedy[req_of_draft])  # [D]
        # The run of accepted drafts from the first, per request: pad to [B, max_k], multiply along.
        position = torch.arange(draft_ids.shape[0], device=device) - first_draft[req_of_draft]
        padded_accepted = torch.zeros(num_reqs, max_k, dtype=torch.long, device=device)
        padded_accepted[req_of_draft, position] = accepted.long()
        num_accepted = padded_accepted.cumprod(dim=1).sum(dim=1)  # [B]

        final_rows = first_draft + torch.arange(num_reqs, device=device) + num_accepted  # [B] row after the run
        final = torch.empty(num_reqs, dtype=torch.long, device=device)
        if target_argmax is not None:
            final[greedy] = target_argmax[final_rows[greedy]]
        if random_reqs:
            index = torch.tensor(random_reqs, device=device)
            final[index] = self._recover_or_bonus(
                batch, final_rows[index], (first_draft + num_accepted)[index], (num_accepted < num_drafts)[index], noise
            )

        out = torch.full((num_reqs, max_k + 1), -1, dtype=torch.long, device=device)
        out[req_of_draft, position] = draft_ids
        out[:, :max_k].masked_fill_(torch.arange(max_k, device=device) >= num_accepted[:, None], -1)
        out[torch.arange(num_reqs, device=device), num_accepted] = final
        num_accepted_list = num_accepted.tolist()
        token_ids = [row[: n + 1] for row, n in zip(out.tolist(), num_accepted_list)]
        return RejectionOutput(token_ids, num_accepted_list)

    @staticmethod
    def _accept(
        batch: DraftBatch,
        draft_rows: torch.Tensor,
        uniforms: torch.Tensor,
        target_argmax: torch.Tensor | None,
        is_greedy: torch.Tensor,
    ) -> torch.Tensor:
        """[D] whether each draft passes its own test (the run is cut at the first that fails)."""
        draft_ids = batch.draft_token_ids
        p_draft = batch.target_probs[draft_rows, draft_ids].double()
        if batch.draft_probs is None:
            q_draft = torch.ones_like(p_draft)
        else:
            q_draft = batch.draft_probs[torch.arange(draft_ids.shape[0], device=draft_ids.device), draft_ids].double()
        # u < p / q without dividing: q = 0 < p accepts, p = q = 0 rejects.
        accepted = uniforms * q_draft < p_draft
        if target_argmax is not None:
            accepted = torch.where(is_greedy, draft_ids == target_argmax[draft_rows], accepted)
        return accepted

    @staticmethod
    def _recover_or_bonus(
        batch: DraftBatch,
        rows: torch.Tensor,
        rejected_drafts: torch.Tensor,
        is_rejected: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        """[R] the random requests' last token: from max(p - q, 0) after a rejection, else from p.

        rows: [R] target row after each accepted run; rejected_drafts: [R] the draft rejected
        there (meaningful where is_rejected); noise: [R, V] Exp(1) draws.
        """
        p_rows = batch.target_probs[rows].to(noise.dtype)
        dist = p_rows
        if bool(is_rejected.any()):
            rejected = rejected_drafts.clamp(max=batch.draft_token_ids.shape[0] - 1)
            if batch.draft_probs is None:
                residual = p_rows.clone()
                residual[torch.arange(rows.shape[0], device=rows.device), batch.draft_token_ids[rejected]] = 0.0
            else:
                residual = (p_rows - batch.draft_probs[rejected].to(noise.dtype)).clamp_(min=0.0)
            # p == q leaves nothing to recover from; p itself is then the right distribution.
            has_mass = residual.sum(dim=-1, keepdim=True) > 0
            dist = torch.where(is_rejected[:, None] & has_mass, residual, p_rows)
        # Normalising is unnecessary: the race's argmax does not change when a row is scaled.
        return (dist / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _draw(batch: DraftBatch, random_reqs: list[int], first_draft: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each random request's uniforms ([D] float64, zero for greedy drafts) and Exp(1) noise ([R, V])."""
    p = batch.target_probs
    device = p.device
    uniforms = torch.zeros(batch.draft_token_ids.shape[0], dtype=torch.float64, device=device)
    noise = torch.empty(len(random_reqs), p.shape[1], dtype=torch.promote_types(p.dtype, torch.float32), device=device)
    on_global_rng = []
    for i, b in enumerate(random_reqs):
        generator, k, start = batch.generators[b], batch.num_draft_tokens[b], first_draft[b]
        if generator is None:
            on_global_rng.append(i)
            continue
        if k:
            uniforms[start : start + k] = torch.rand(k, generator=generator, dtype=torch.float64, device=device)
        noise[i].exponential_(generator=generator)
    if on_global_rng:
        # Requests without a generator share the global RNG: one draw for all of them.
        spans = [(first_draft[random_reqs[i]], batch.num_draft_tokens[random_reqs[i]]) for i in on_global_rng]
        drafts = torch.tensor([start + j for start, k in spans for j in range(k)], dtype=torch.long, device=device)
        if drafts.numel():
            uniforms[drafts] = torch.rand(drafts.numel(), dtype=torch.float64, device=device)
        index = torch.tensor(on_global_rng, device=device)
        noise[index] = torch.empty(len(on_global_rng), p.shape[1], dtype=noise.dtype, device=device).exponential_()
    return uniforms, noise


def _one_hot(token_ids: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.nn.functional.one_hot(token_ids, vocab).to(dtype)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _shape(t: torch.Tensor | None) -> str:
    return "None" if t is None else str(tuple(t.shape))


def _device(t: torch.Tensor | None) -> str:
    return "None" if t is None else str(t.device)
