"""The prefill side of the NIXL handover (nixl_connector.py describes the protocol): a
decode rank's claim pins a lease's blocks and is answered with a grant, or refused once the
lease ended; its "done" unpins them, and so does its deadline when no "done" comes (a decode
that died). It runs on the connector's loop thread, like everything NIXL.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch

from .config import KVTransferConfig
from .connector import KVConnector
from .nixl_agent import Mailbox
from .nixl_layout import CacheLayout, checksum, decode_blocks

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Claim:
    """A decode rank's claim on a transfer's blocks."""

    peer: str  # the decode rank's agent
    claim_id: int
    transfer_id: str
    block_ids: tuple[int, ...]
    verify: bool
    deadline: float  # waiting for the lease, then (pinned) for "done"
    is_pinned: bool = False
    grant_at: float | None = None  # when to answer; None once answered (or never, when dropped)


class NixlPrefillSide(KVConnector):
    """NixlConnector's half that answers claims; the connector supplies the mailbox, and the
    registered caches and their layout that a grant announces."""

    _mail: Mailbox
    kv_caches: list[torch.Tensor]
    _layout: CacheLayout | None

    def __init__(self, config: KVTransferConfig) -> None:
        super().__init__(config)
        self._claims: dict[tuple[str, int], Claim] = {}  # by (decode agent, claim id)

    def _on_claim(self, peer: str, message: dict) -> None:
        claim = Claim(
            peer,
            message["claim"],
            message["transfer_id"],
            decode_blocks(message["blocks"]),
            bool(message["verify"]),
            time.monotonic() + self.config.timeout_s,
        )
        self._claims[(peer, claim.claim_id)] = claim  # answered by _advance_claims, this same step

    def _advance_claims(self, now: float) -> None:
        for key, claim in list(self._claims.items()):
            try:
                self._advance_claim(key, claim, now)
            except Exception as error:  # this claim only; the others carry on
                logger.warning("KV transfer %s to %s failed: %s", claim.transfer_id, claim.peer, error)
                self._refuse(key, claim, f"{type(error).__name__}: {error}", now)

    def _advance_claim(self, key: tuple[str, int], claim: Claim, now: float) -> None:
        if not claim.is_pinned:
            is_pinned = self._pin(claim.transfer_id, claim.block_ids)
            claim.is_pinned = bool(is_pinned)
            if is_pinned is None and now <= claim.deadline:
                return  # the lease is not announced yet
            if not is_pinned:
                self._refuse(key, claim, "the prefill side's lease expired", now)
                return
            faults = self.faults
            claim.deadline = now + self.config.timeout_s
            claim.grant_at = None if faults.drop else now + faults.delay_s
        if claim.grant_at is not None and now >= claim.grant_at:
            claim.grant_at = None
            self._grant(claim, now)
        if now > claim.deadline:  # no "done": the decode gave up or died
            del self._claims[key]
            self._unpin(claim.transfer_id, ok=False)

    def _refuse(self, key: tuple[str, int], claim: Claim, reason: str, now: float) -> None:
        del self._claims[key]
        if claim.is_pinned:
            self._unpin(claim.transfer_id, ok=False)
        self._mail.send(claim.peer, {"op": "refused", "claim": claim.claim_id, "reason": reason}, now)

    def _grant(self, claim: Claim, now: float) -> None:
        crc = None
        if claim.verify:
            crc = checksum(self.kv_caches, claim.block_ids)
            if self.faults.corrupt:
                crc ^= 0xFFFFFFFF
        grant = {"op": "grant", "claim": claim.claim_id, "layout": asdict(self._layout), "checksum": crc}
        self._mail.send(claim.peer, grant, now)

    def _on_done(self, peer: str, message: dict) -> None:
        claim = self._claims.pop((peer, message["claim"]), None)
        if claim is not None and claim.is_pinned:
            self._unpin(claim.transfer_id, ok=bool(message["ok"]))
