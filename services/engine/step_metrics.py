"""What each engine step costs in FLOPs and bytes, from the model's shape, and how well it
used the device: model FLOPs utilisation (MFU) and memory-bandwidth utilisation (MBU).

Per step, with P the non-embedding parameters on this rank, T scheduled tokens, and for
each request q new tokens attending over c context tokens:

    flops = 2 * P * T + 4 * layers * (query heads * head_dim) * sum(q * c)   (matmuls + attention)
    bytes = weights + 2 * layers * (kv heads * head_dim) * dtype * sum(c)    (weights read once, K/V read)

MFU = flops / (step time * peak FLOP/s); MBU = bytes / (step time * peak bytes/s). Peaks
come from the runner config, else from a table of known devices; unknown: not reported.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..model.config import ModelArch

# (bf16 dense TFLOP/s, memory TB/s) for device names torch reports.
_KNOWN_DEVICES = {
    "H200": (989.0, 4.8),
    "H100": (989.0, 3.35),
    "A100": (312.0, 2.0),
    "L40S": (362.0, 0.864),
}


@dataclass(frozen=True, slots=True)
class DevicePeaks:
    flops: float  # FLOP/s
    bytes_per_s: float

    @staticmethod
    def resolve(device_name: str, tflops: float | None, memory_tbs: float | None) -> DevicePeaks | None:
        if tflops and memory_tbs:
            return DevicePeaks(tflops * 1e12, memory_tbs * 1e12)
        for name, (known_tflops, known_tbs) in _KNOWN_DEVICES.items():
            if name in device_name:
                return DevicePeaks((tflops or known_tflops) * 1e12, (memory_tbs or known_tbs) * 1e12)
        return None


_KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class StepCostModel:
    def __init__(self, arch: ModelArch, dtype_bytes: int, tp_size: int, kv_cache_dtype: str | None = None) -> None:
        per_layer = (
            arch.hidden_size * (arch.q_size + 2 * arch.kv_size)  # qkv
            + arch.q_size * arch.hidden_size  # o
            + 3 * arch.hidden_size * arch.intermediate_size  # gate, up, down
        )
        self.params = (per_layer * arch.num_layers + arch.hidden_size * arch.vocab_size) / tp_size  # + LM head
        self.weight_bytes = self.params * dtype_bytes
        self.attn_flops_per_pair = 4 * arch.num_layers * arch.q_size / tp_size
        kv_dtype_bytes = _KV_DTYPE_BYTES[kv_cache_dtype] if kv_cache_dtype else dtype_bytes
        self.kv_bytes_per_token = 2 * arch.num_layers * arch.kv_size * kv_dtype_bytes / max(tp_size, 1)

    def cost(self, num_tokens: int, query_context_pairs: int, context_tokens: int) -> tuple[float, float]:
        """(FLOPs, bytes) of one step."""
        flops = 2 * self.params * num_tokens + self.attn_flops_per_pair * query_context_pairs
        return flops, self.weight_bytes + self.kv_bytes_per_token * context_tokens


@dataclass(slots=True)
class StepWindow:
    """The last steps' cost and time, for utilisation averaged over a few seconds."""

    size: int = 64
    steps: deque = None

    def __post_init__(self) -> None:
        self.steps = deque(maxlen=self.size)

    def add(self, seconds: float, flops: float, num_bytes: float) -> None:
        self.steps.append((seconds, flops, num_bytes))

    def utilisation(self, peaks: DevicePeaks | None) -> tuple[float, float, float]:
        """(mean step seconds, MFU, MBU) over the window; utilisations 0 without peaks."""
        if not self.steps:
            return 0.0, 0.0, 0.0
        seconds = sum(s for s, _, _ in self.steps)
        mean = seconds / len(self.steps)
        if peaks is None or seconds == 0:
            return mean, 0.0, 0.0
        flops = sum(f for _, f, _ in self.steps)
        num_bytes = sum(b for _, _, b in self.steps)
        return mean, flops / seconds / peaks.flops, num_bytes / seconds / peaks.bytes_per_s
