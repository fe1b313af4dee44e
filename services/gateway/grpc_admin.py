"""The gRPC `baton.v1.Admin` service: the RL admin calls (gateway/weight_admin.py) as rpcs.

A base of `Gateway`: Ray Serve's gRPC proxy calls the deployment's methods named like the
rpcs, so they live on the gateway class; this keeps them, and their admin-key rule, here.
The same calls as the HTTP admin routes (admin_http.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from baton.v1 import inference_pb2 as pb

from ..serving_errors import NoHealthyWorkersError, PermissionDeniedError
from .api_keys import ApiKeys
from .weight_admin import DEFAULT_GROUP, DEFAULT_UPDATE_PAUSE, WeightAdmin


class GrpcAdmin:
    """Needs of its subclass: `weight_admin`, `api_keys`, and Gateway's `_caller`,
    `_grpc_errors` and `_parsed` (the same authentication, status codes and parsing as
    the Inference rpcs)."""

    weight_admin: WeightAdmin | None
    api_keys: ApiKeys

    async def UpdateWeightsFromDisk(self, request: pb.UpdateWeightsFromDiskRequest, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            request = self._parsed(request)
            version = request.weight_version if request.HasField("weight_version") else None
            pause_mode = request.pause_mode if request.HasField("pause_mode") else DEFAULT_UPDATE_PAUSE
            result = await admin.update_weights_from_disk(request.model_path, version, pause_mode)
            return pb.WeightUpdateResponse(
                success=result.ok, weight_version=result.weight_version, updated=result.updated, failed=result.failed
            )

    async def PauseGeneration(self, request: pb.PauseGenerationRequest, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            mode = self._parsed(request).mode or "abort"
            return pb.AdminResponse(success=True, replicas=await admin.pause_generation(mode))

    async def ContinueGeneration(self, request, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            self._parsed(request)
            return pb.AdminResponse(success=True, replicas=await admin.continue_generation())

    async def ResetPrefixCache(self, request, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            self._parsed(request)
            return pb.AdminResponse(success=True, replicas=await admin.reset_prefix_cache())

    async def Sleep(self, request: pb.SleepRequest, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            level = self._parsed(request).level or 1
            return pb.AdminResponse(success=True, replicas=await admin.sleep(level))

    async def WakeUp(self, request, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            self._parsed(request)
            return pb.AdminResponse(success=True, replicas=await admin.wake_up())

    async def GetWeightVersion(self, request, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            self._parsed(request)
            replicas = await admin.weight_versions()
            versions = set(replicas.values())
            return pb.WeightVersionResponse(
                weight_version=versions.pop() if len(versions) == 1 else "", replicas=replicas
            )

    async def GetWeightUpdateRanks(self, request, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            self._parsed(request)
            ranks = await admin.weight_update_ranks()
            return pb.WeightUpdateRanksResponse(num_engine_ranks=sum(ranks.values()), replicas=ranks)

    async def InitWeightsUpdateGroup(self, request: pb.InitWeightsUpdateGroupRequest, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            request = self._parsed(request)
            offsets = await admin.init_weights_update_group(
                request.master_address,
                request.master_port,
                request.world_size,
                request.group_name or DEFAULT_GROUP,
                request.backend or "gloo",
                request.rank_offset if request.HasField("rank_offset") else 1,
            )
            return pb.InitWeightsUpdateGroupResponse(rank_offsets=offsets)

    async def UpdateWeightsFromDistributed(self, request: pb.UpdateWeightsFromDistributedRequest, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            request = self._parsed(request)
            version = request.weight_version if request.HasField("weight_version") else None
            tensors = list(request.tensors)
            result = await admin.update_weights_from_distributed(
                [t.name for t in tensors],
                [t.dtype for t in tensors],
                [list(t.shape) for t in tensors],
                version,
                request.group_name or DEFAULT_GROUP,
            )
            return pb.WeightUpdateResponse(
                success=result.ok, weight_version=result.weight_version, updated=result.updated, failed=result.failed
            )

    async def DestroyWeightsUpdateGroup(self, request: pb.DestroyWeightsUpdateGroupRequest, grpc_context=None):  # noqa: N802
        with self._admin(grpc_context) as admin:
            group_name = self._parsed(request).group_name or DEFAULT_GROUP
            return pb.AdminResponse(success=True, replicas=await admin.destroy_weights_update_group(group_name))

    @contextlib.contextmanager
    def _admin(self, grpc_context) -> Iterator[WeightAdmin]:
        with self._grpc_errors(grpc_context):
            caller = self._caller(grpc_context)
            if self.api_keys.is_enabled and not caller.is_admin:
                raise PermissionDeniedError("the Admin service needs an admin key")
            if self.weight_admin is None:
                raise NoHealthyWorkersError("this gateway serves no engine replicas to administer")
            yield self.weight_admin
