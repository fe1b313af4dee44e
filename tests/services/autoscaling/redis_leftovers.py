"""What Redis still holds for a worker (services/router/keys.py names every structure): a
replica that left must leave nothing a router could read (load row, registry, block marks in
its slot, its own keys, speculative hints), however it left."""

from __future__ import annotations

from baton.services.router.config import RouterConfig
from baton.services.router.keys import WORKER_KEY_PARTS, Keyspace
from baton.services.router.redis_client import create_redis_client


class RedisView:
    def __init__(self, config: RouterConfig) -> None:
        self.client = create_redis_client(config.redis)
        self.keys = Keyspace(config.redis.key_prefix, config.model)

    def slots(self) -> dict[str, int]:
        """Registered worker id -> its slot (its bit in the block masks)."""
        return {k.decode(): int(v) for k, v in self.client.hgetall(self.keys.slots).items()}

    def worker_ids(self, role: str) -> set[str]:
        return {m.decode() for m in self.client.smembers(self.keys.role(role))}

    def leftovers(self, worker_id: str, slot: int | None) -> list[str]:
        """Every place `worker_id` (which had `slot`) still appears; [] when it is gone for good."""
        found = []
        for name, key in (
            ("workers", self.keys.workers),
            ("loads", self.keys.loads),
            ("slots", self.keys.slots),
            ("stored", self.keys.stored),
        ):
            if self.client.hexists(key, worker_id):
                found.append(name)
        for role in ("prefill", "decode"):
            if self.client.sismember(self.keys.role(role), worker_id):
                found.append(f"role:{role}")
        name, _, epoch = worker_id.rpartition("@")
        if name and (self.client.hget(self.keys.names, name) or b"").decode() == epoch:
            found.append("names")
        found += [part for part in WORKER_KEY_PARTS if self.client.exists(self.keys.worker(worker_id, part))]
        if slot is not None and slot not in self.slots().values():  # a slot taken again is another worker's
            byte, bit = divmod(slot, 8)
            marked = sum(
                1 for mask in self.client.hvals(self.keys.blocks) if len(mask) > byte and mask[byte] >> bit & 1
            )
            if marked:
                found.append(f"{marked} block marks in slot {slot}")
        for key in self.client.scan_iter(match=f"{self.keys.namespace}:predicted:*", count=1000):
            if self.client.sismember(key, worker_id):
                found.append(key.decode())
        return found
