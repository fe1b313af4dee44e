"""Where the index lives in Redis. Every key starts with one namespace per model:

    {prefix}:{<model>}                      the braces are a Redis Cluster hash tag: one model's
                                            keys share a slot, so each Lua script runs on one shard
    ns:workers          HASH  worker id -> WorkerInfo JSON (the registry)
    ns:names            HASH  worker name -> current epoch (a new epoch wipes the old one)
    ns:role:<role>      SET   ids of workers that take prefill / decode requests
    ns:slots            HASH  worker id -> its slot: its bit in the block masks
    ns:blocks           HASH  16-byte block hash -> mask of the slots whose workers hold it
                               (bit slot % 8 of byte slot // 8; a block nobody holds has none)
    ns:stored           HASH  worker id -> how many blocks its set holds
    ns:loads            HASH  worker id -> "<alive until> <reported_at_ms>,<WorkerLoad>
                               <requests> <tokens> <until>": when its heartbeat expires (ms,
                               Redis's clock), its last report, and the placements since that
                               report (counted until `until` ms). One hash, so that a query
                               reads every worker's row with one command
    ns:w:<id>:alive     STRING the heartbeat: it expires after the heartbeat TTL (as the row
                               says); a worker without it is dead and garbage-collected
    ns:w:<id>:cached    SET   16-byte hashes of the blocks the worker's events stored
    ns:w:<id>:spec      ZSET  routers' speculative entries: checkpoint block hash -> expiry ms
    ns:w:<id>:seq       STRING next KV-event sequence number the index expects from it
    ns:w:<id>:snapshot  SET   a snapshot being uploaded, renamed onto :cached when complete
    ns:retired:<id>     STRING a router retired the worker (its replica drains or died): its
                               heartbeats are refused until this expires
    ns:predicted:<hex>  SET   ids of workers that may hold speculative entries for prompts
                               whose first block hash is <hex>: a query searches only their
                               :spec sets. It expires a speculative TTL after the last such
                               placement (kept when tests inject a clock other than Redis's)

The Lua scripts (lua_scripts.py, lua_routing.py) build the same names from the namespace;
this class is their Python twin, for the snapshot upload and for tests.
"""

from __future__ import annotations

from .config import check_key_part

WORKER_KEY_PARTS = ("alive", "cached", "spec", "seq", "snapshot")


class Keyspace:
    def __init__(self, key_prefix: str, model: str) -> None:
        self.namespace = f"{check_key_part('key_prefix', key_prefix)}:{{{check_key_part('model', model)}}}"

    @property
    def workers(self) -> str:
        return f"{self.namespace}:workers"

    @property
    def names(self) -> str:
        return f"{self.namespace}:names"

    @property
    def slots(self) -> str:
        return f"{self.namespace}:slots"

    @property
    def blocks(self) -> str:
        return f"{self.namespace}:blocks"

    @property
    def stored(self) -> str:
        return f"{self.namespace}:stored"

    @property
    def loads(self) -> str:
        return f"{self.namespace}:loads"

    def predicted(self, first_block_hash: bytes) -> str:
        return f"{self.namespace}:predicted:{first_block_hash.hex()}"

    def retired(self, worker_id: str) -> str:
        return f"{self.namespace}:retired:{worker_id}"

    def role(self, role: str) -> str:
        return f"{self.namespace}:role:{role}"

    def worker(self, worker_id: str, part: str) -> str:
        if part not in WORKER_KEY_PARTS:
            raise ValueError(f"unknown worker key part {part!r}; one of {WORKER_KEY_PARTS}")
        return f"{self.namespace}:w:{worker_id}:{part}"
