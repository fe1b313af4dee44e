"""One rank's side of weight updates and sleep: where its weights come from and go.

Every update checks all names and full shapes against the checkpoint the rank loaded
(model/weight_update.py) before writing anything, then writes through the loader's own
per-shard path, so each TP rank keeps only its shard, packed weights are repacked and a
tied LM head stays tied. The engine core drives these between steps, on every rank.

Disk and tensor updates come in two phases, so a caller with many replicas can make an
update all-or-nothing (prepare everywhere, then commit everywhere):

    prepare(staged)   every tensor read (a folder: all its bytes, into host memory) and
                      checked: names, full shapes (the ones start-up sharded, so each
                      rank's shard exists), floating-point values; live weights untouched
    commit()          writes the staged tensors; nothing left to refuse but completeness
                      after a sleep(2) since prepare, which is checked before any write
    discard()         drops the staged tensors

A write that still fails part-way (a caller who changed its staged tensors, an I/O error
of the device) releases the weights, as a trainer lost mid-transfer does: half-written
weights never serve.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ...model.config import ModelArch, load_model_arch
from ...model.errors import ModelLoadError
from ...model.loader import CheckpointLayout, iter_checkpoint
from ...model.weight_update import (
    WeightWriter,
    check_same_architecture,
    check_update,
    check_values,
    release_weights,
    restore_weights,
    weight_bytes,
)
from ...model.weights import LoadedWeight, read_all, shape_of
from .weight_sync import WeightSyncGroup, core_left_for_receiving, plan_buckets, receive_buckets


class RankWeights:
    def __init__(
        self, model: torch.nn.Module, arch: ModelArch, layout: CheckpointLayout, kernel_impl: str, tp_rank: int
    ) -> None:
        self.model = model
        self.arch = arch
        self.layout = layout
        self.kernel_impl = kernel_impl
        self.tp_rank = tp_rank
        self.groups: dict[str, WeightSyncGroup] = {}
        # Parameter shapes while the weights are released (sleep level 2); None: loaded.
        self._released: dict[str, torch.Size] | None = None
        # A prepared update's checked tensors, until commit or discard (module docstring).
        self.prepared: list[tuple[str, torch.Tensor]] | None = None

    @property
    def is_released(self) -> bool:
        return self._released is not None

    @property
    def num_bytes(self) -> int:
        return weight_bytes(self.model)

    # -- updates ----------------------------------------------------------------------

    def stage_from_disk(self, path: str | Path) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of a folder, read into host memory and checked; nothing written."""
        source = str(path)
        check_same_architecture(self.arch, load_model_arch(path), source)
        shapes = {name: shape_of(tensor) for name, tensor in iter_checkpoint(path)}  # headers only
        try:  # a folder is a whole checkpoint: a missing tensor is a mismatch, not a partial update
            check_update(self.layout, self.arch, shapes, complete=True)
            staged = [(name, read_all(tensor)) for name, tensor in iter_checkpoint(path)]
            if [name for name, _ in staged] != list(shapes):
                raise ModelLoadError("the folder changed while it was read")
            check_values(staged)
        except ModelLoadError as e:
            raise ModelLoadError(f"{source}: {e}") from e
        return staged

    def stage_from_tensors(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The caller's tensors, checked (not copied: they must stay as they are until written)."""
        staged = [(name, tensor.detach()) for name, tensor in named_tensors]
        shapes = {name: tuple(tensor.shape) for name, tensor in staged}
        if len(shapes) != len(staged):
            raise ModelLoadError("a tensor name is given twice")
        self._check(shapes)
        check_values(staged)
        return staged

    def prepare(self, staged: list[tuple[str, torch.Tensor]]) -> None:
        self.prepared = staged

    def commit_prepared(self) -> None:
        if self.prepared is None:
            raise RuntimeError("no update is prepared: call prepare_weights_from_disk (or _from_tensors) first")
        staged, self.prepared = self.prepared, None
        self._commit(staged)

    def discard_prepared(self) -> None:
        self.prepared = None

    def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} already exists")
        device = next(self.model.parameters()).device  # NCCL receives where the weights live
        self.groups[group_name] = WeightSyncGroup(
            master_address, master_port, rank_offset + self.tp_rank, world_size, group_name, backend, device=device
        )

    def update_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype | str],
        shapes: Sequence[Sequence[int]],
        group_name: str | None,
        bucket_bytes: int,
    ) -> None:
        """Writes each bucket as it arrives, while the next one is received. Names and shapes
        are checked first, then the trainer's bucket plan: either refusal changes nothing."""
        group = self._group(group_name)
        self._check({name: tuple(shape) for name, shape in zip(names, shapes, strict=True)})
        buckets = receive_buckets(group, plan_buckets(names, dtypes, shapes, bucket_bytes))
        with core_left_for_receiving(group):
            first = next(buckets, [])  # the trainer's plan is checked here, before any write
            try:
                self._write(names, itertools.chain([first], buckets))
            except Exception:
                # Buckets are written as they arrive: a transfer that breaks part-way leaves
                # no consistent weights, so they are released (as by sleep(2)) until a
                # complete update.
                self.release()
                raise

    def check_distributed_update(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype | str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
    ) -> None:
        """A trainer's preflight, reading nothing: the bucket plan's names and dtypes, every
        shape against the running model, and the group."""
        plan_buckets(names, dtypes, shapes)
        self._check({name: tuple(shape) for name, shape in zip(names, shapes, strict=True)})
        self._group(group_name)

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}")
        group.destroy()

    # -- sleep ------------------------------------------------------------------------

    def release(self) -> None:
        if self._released is None:
            self._released = release_weights(self.model)

    # -- internals --------------------------------------------------------------------

    def _group(self, group_name: str | None) -> WeightSyncGroup:
        if group_name is None:
            if len(self.groups) != 1:
                raise ValueError(f"name the weight update group: there are {len(self.groups)}")
            return next(iter(self.groups.values()))
        if group_name not in self.groups:
            raise ValueError(f"no weight update group {group_name!r}: call init_weights_update_group first")
        return self.groups[group_name]

    def _check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        check_update(self.layout, self.arch, shapes, complete=self.is_released)

    def _commit(self, staged: list[tuple[str, torch.Tensor]]) -> None:
        names = [name for name, _ in staged]
        self._check({name: tuple(tensor.shape) for name, tensor in staged})  # sleep(2) since prepare?
        try:
            self._write(names, [staged])
        except Exception:
            self.release()  # part-written: never serve it (module docstring)
            raise

    def _write(self, names: Iterable[str], batches: Iterable[Iterable[tuple[str, LoadedWeight]]]) -> None:
        if self._released is not None:
            restore_weights(self.model, self._released)
            self._released = None
        writer = WeightWriter(self.model, names, self.kernel_impl)
        try:
            for batch in batches:
                writer.write(batch)
        finally:
            writer.close()
