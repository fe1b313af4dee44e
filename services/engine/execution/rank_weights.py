"""One rank's side of weight updates and sleep: where its weights come from and go.

Every update checks all names and full shapes against the checkpoint the rank loaded
(model/weight_update.py) before writing anything, then writes through the loader's own
per-shard path, so each TP rank keeps only its shard, packed weights are repacked and a
tied LM head stays tied. The engine core drives these between steps, on every rank.
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
    release_weights,
    restore_weights,
    weight_bytes,
)
from ...model.weights import LoadedWeight, shape_of
from .weight_sync import WeightSyncGroup, plan_buckets, receive_buckets


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

    @property
    def is_released(self) -> bool:
        return self._released is not None

    @property
    def num_bytes(self) -> int:
        return weight_bytes(self.model)

    # -- updates ----------------------------------------------------------------------

    def update_from_disk(self, path: str | Path) -> None:
        source = str(path)
        check_same_architecture(self.arch, load_model_arch(path), source)
        shapes = {name: shape_of(tensor) for name, tensor in iter_checkpoint(path)}  # headers only
        try:  # a folder is a whole checkpoint: a missing tensor is a mismatch, not a partial update
            check_update(self.layout, self.arch, shapes, complete=True)
        except ModelLoadError as e:
            raise ModelLoadError(f"{source}: {e}") from e
        self._write(shapes, [iter_checkpoint(path)])

    def update_from_tensors(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        shapes = {name: tuple(tensor.shape) for name, tensor in named_tensors}
        if len(shapes) != len(named_tensors):
            raise ModelLoadError("a tensor name is given twice")
        self._check(shapes)
        self._write(shapes, [named_tensors])

    def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} already exists")
        self.groups[group_name] = WeightSyncGroup(
            master_address, master_port, rank_offset + self.tp_rank, world_size, group_name, backend
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
        first = next(buckets, [])  # the trainer's plan is checked here, before any write
        try:
            self._write(names, itertools.chain([first], buckets))
        except Exception:
            # Buckets are written as they arrive: a transfer that breaks part-way leaves
            # no consistent weights, so they are released (as by sleep(2)) until a
            # complete update.
            self.release()
            raise

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
