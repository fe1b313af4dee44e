"""Settings of the KV handover (a section of the engine config)."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..roles import Role

_FROZEN = ConfigDict(frozen=True, extra="forbid")
# The names of an older release; they still load, with a warning naming the role to write.
_DEPRECATED_ROLES = {"none": Role.COLOCATED, "producer": Role.PREFILL, "consumer": Role.DECODE}


class FaultInjection(BaseModel):
    """Test hooks on the sending side, applied to every transfer while set."""

    model_config = _FROZEN

    drop: bool = Field(False, description="Accept the request but never send (the receiver times out)")
    delay_s: float = Field(0.0, ge=0, description="Sleep this long before sending")
    corrupt: bool = Field(
        False,
        description="Spoil the transfer for verify mode to catch (torch: flip bits after the checksum was taken; "
        "nixl: announce a wrong checksum, as one-sided reads leave the data alone)",
    )


class KVTransferConfig(BaseModel):
    model_config = _FROZEN

    role: Role = Field(
        Role.COLOCATED,
        description="prefill: leases blocks and sends them; decode: receives them; colocated: no handover",
    )
    transport: Literal["torch", "nixl"] = Field(
        "torch",
        description="torch: torch.distributed (gloo on CPU, NCCL on CUDA); nixl: one-sided READs over NVIDIA "
        "NIXL/UCX (RDMA, NVLink, shared memory or TCP; DRAM or VRAM), needs baton[nixl]",
    )
    host: str = Field(
        "auto",
        description="Address this worker's transfer server listens on and advertises; auto: the Ray node's IP "
        "(the pod's, on Kubernetes), 127.0.0.1 outside Ray",
    )
    timeout_s: float = Field(10.0, gt=0, description="Both sides give up on a transfer after this long")
    lease_s: float = Field(30.0, gt=0, description="The prefill side frees unclaimed blocks after this long")
    verify: bool = Field(False, description="Checksum every transfer; a mismatch makes the decode side recompute")
    allow_fault_injection: bool = Field(False, description="Allow FaultInjection to be set at run time (tests)")

    @field_validator("role", mode="before")
    @classmethod
    def _renamed_role(cls, role: Any) -> Any:
        if isinstance(role, str) and role in _DEPRECATED_ROLES:
            new = _DEPRECATED_ROLES[role]
            # FutureWarning, not DeprecationWarning: Python shows it by default, and whoever
            # wrote the config reads it.
            warnings.warn(f"kv_transfer.role {role!r} is deprecated: write {new.value!r}", FutureWarning, stacklevel=2)
            return new
        return role
