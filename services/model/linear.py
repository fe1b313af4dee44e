"""Megatron-style linear layers. Column-parallel layers split the output features across
ranks and never communicate; row-parallel layers split the input features and all-reduce
their partial sums. Each parameter carries a `weight_loader` that reads its rank's shard.

On the CPU, `process_weights_after_loading` repacks the weights once the checkpoint is in.
float32 weights go into 16-channel blocks for Baton's own kernel where it builds (an AVX-512
or AVX2 CPU; blocked_linear.py), and so do bfloat16 weights where the CPU has AVX512-BF16 but no
AMX, or AVX2 but no AVX-512 (the kernel widens them to float32; oneDNN has no bfloat16 GEMM
there, and torch's matmul took 2-10x the kernel's time on the bench model's shapes).
Against oneDNN's packed layout on the bench model's shapes (an AMD EPYC, 2 threads):
float32 0.58-0.74x its time at 1-8 rows, 0.82-0.88x at 16-32, at par at 64-256, within 5%
at 2,048 but for the LM head's shape (1.1-1.3x; prompt logprobs only); bfloat16 0.65-0.79x
at 1-4 rows, 0.89x at 16, at par at 64, 1.07-1.09x at 256-2,048 (a bfloat16 decode step of
1-2 requests 2.9-3.4 ms instead of 5.6-6.9). Elsewhere, and for float16, `linear` multiplies
by oneDNN's packed layout with oneDNN's GEMM (torch.ops.mkldnn, as torch.compile's CPU
backend does). On an AMD Zen 5 (2 cores) float32 ran there at ~490 GFLOP/s where F.linear
(MKL) reaches ~200, and ~430 vs ~150 at decode sizes (32 rows). bfloat16 and float16 weights
are packed where the CPU multiplies them natively (AMX on an Intel Xeon: the 512x3072
gate/up projection takes 0.86 ms for 512 rows packed, 1.0 ms through F.linear, 5.5 ms in
float32; 124 vs 186 us at 8 rows). Either way the repacked tensor replaces the dense
weight, so memory does not grow; `dense_weight` (a layer's `dense_parameters`) turns it back
for whoever reads weights.

With quantization "int8" (int8_linear.py) the same step quantizes each layer instead, and
with "w8a8" (w8a8_linear.py) too, for the kernel that also quantizes the activations: the
int8 blocks replace the float weight, and unpacking for a weight update dequantizes, so an
update's float values are re-quantized when the layer is repacked.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .blocked_linear import BlockedWeight, uses_blocked_kernel
from .cpu_tuning import pad_rows_for_onednn
from .int8_linear import Int8Weight
from .parallel import TPGroup
from .w8a8_linear import W8A8Weight
from .weights import LoadedWeight, copy_into, narrow, read_all, shape_of


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies `dtype` natively on this CPU: float32 always; bfloat16 and
    float16 where the CPU has instructions for them (AVX512-BF16/AMX, AVX512-FP16/AMX-FP16),
    without which oneDNN would convert to float32 on every call."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def pack_weight_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a [out, in] weight for `linear`; None where it does not
    apply: not on the CPU, a dtype this CPU has no oneDNN kernel for, or a torch built
    without oneDNN."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or not _onednn_runs(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b, for a dense weight or one from `pack_weight_for_cpu`."""
    if weight.layout == torch._mkldnn:
        # oneDNN builds and caches a primitive per row count: padding bounds them (cpu_tuning.py)
        y = torch.ops.mkldnn._linear_pointwise(pad_rows_for_onednn(x), weight, bias, "none", [], "")
        return y[: x.numel() // x.shape[-1]].view(*x.shape[:-1], y.shape[-1])
    return F.linear(x, weight, bias)


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_dense() if weight.layout == torch._mkldnn else weight


class CpuPackable(ABC):
    """A layer whose weight may be repacked for the CPU once loaded (Baton's blocks or
    oneDNN's layout), and unpacked again so a weight update can write into it through the
    same weight loader. An int8 layer (`is_int8`) is quantized instead of packed, every time
    it is repacked."""

    is_int8 = False
    int8_activations = False  # quantization w8a8: the activations int8 too (not the LM head's)
    int8: Int8Weight | W8A8Weight | None = None  # the quantized weight while packed
    blocked: BlockedWeight | None = None  # the float32 blocks while packed

    @abstractmethod
    def pack_for_cpu(self, impl: str) -> bool: ...

    @abstractmethod
    def quantize(self, impl: str) -> bool:
        """int8 from the dense weight (and the `weight_scale` a pre-quantized checkpoint
        staged: compressed_tensors.py)."""

    @abstractmethod
    def unpack_for_loading(self, keep_values: bool = True) -> None:
        """Dense again; `keep_values=False` when the update overwrites the whole weight
        (no copy out of the packed layout)."""

    num_weight_shards = 1  # checkpoint tensors that make up the weight (q, k, v: 3)


def packable_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, CpuPackable)]


def process_weights_after_loading(
    model: nn.Module, impl: str, modules: Iterable[nn.Module] | None = None, quantization: str | None = None
) -> int:
    """Repacks the linear layers' CPU weights for oneDNN (impl "auto" or "cpp"; "torch"
    keeps the plain F.linear reference): all of them, or just `modules` (those a weight
    update unpacked). Quantization "int8" makes every layer int8 from now on, weight-only even
    where a W8A8 checkpoint asked for int8 activations; "w8a8" makes them int8 with int8
    activations; a layer that staged a checkpoint's int8 scales is int8 too. Returns how many
    weights it repacked."""
    modules = packable_modules(model) if modules is None else list(modules)
    count = 0
    for module in modules:
        if quantization is not None:
            module.int8_activations = quantization == "w8a8"
        module.is_int8 = module.is_int8 or module.int8_activations or quantization == "int8"
        module.is_int8 = module.is_int8 or "weight_scale" in module._parameters
        if module.is_int8:
            count += module.quantize(impl)
        elif impl in ("auto", "cpp"):
            count += module.pack_for_cpu(impl)
    return count


def dense_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter with a float weight as the checkpoint's dense [out, in] again (blocks
    and oneDNN's layout unpacked); int8 layers keep their int8 blocks."""
    blocked = {id(m.weight): m.blocked for m in packable_modules(model) if m.blocked is not None}
    return {
        name: blocked[id(p)].dense() if id(p) in blocked else dense_weight(p.detach())
        for name, p in model.named_parameters()
    }


def _pack_parameter(module: nn.Module, impl: str) -> bool:
    if uses_blocked_kernel(module.weight, impl):
        module.blocked = BlockedWeight.from_dense(module.weight)
        module.weight = nn.Parameter(module.blocked.values, requires_grad=False)
        return True
    packed = pack_weight_for_cpu(module.weight)
    if packed is None:
        return False
    module.weight = nn.Parameter(packed, requires_grad=False)
    return True


def _quantize_parameter(module: nn.Module, impl: str) -> bool:
    """The int8 blocks replace the float weight (a parameter still: its bytes are counted)."""
    scale = module._parameters.pop("weight_scale", None)  # staged by compressed_tensors.py
    kind = W8A8Weight if module.int8_activations else Int8Weight
    module.int8 = kind.from_float(module.weight, impl, None if scale is None else scale.view(-1))
    module.weight = nn.Parameter(module.int8.values, requires_grad=False)
    return True


def _unpack_parameter(module: nn.Module, keep_values: bool) -> None:
    """Back to a dense parameter with its loader (the packed one has neither)."""
    weight = module.weight
    if module.int8 is not None:
        int8, module.int8 = module.int8, None
        dense = int8.dequantize() if keep_values else torch.empty(int8.shape, dtype=int8.dtype, device=weight.device)
        module.weight = nn.Parameter(dense, requires_grad=False)
        module.weight.weight_loader = module.weight_loader
    elif module.blocked is not None:
        blocked, module.blocked = module.blocked, None
        dense = blocked.dense() if keep_values else torch.empty(blocked.shape, dtype=weight.dtype)
        module.weight = nn.Parameter(dense, requires_grad=False)
        module.weight.weight_loader = module.weight_loader
    elif weight.layout == torch._mkldnn:
        dense = weight.to_dense() if keep_values else torch.empty(weight.shape, dtype=weight.dtype)
        module.weight = nn.Parameter(dense, requires_grad=False)
        module.weight.weight_loader = module.weight_loader


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


class ColumnParallelLinear(nn.Module, CpuPackable):
    """y = x W^T + b with W's output rows split across ranks: each rank holds [out/tp, in]."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.tp = tp
        # Each logical output (e.g. gate and up) is split separately, then concatenated.
        self.shard_sizes = [_divide(size, tp.world_size, "linear output size") for size in output_sizes]
        self.num_weight_shards = len(output_sizes)
        self.weight = _param(sum(self.shard_sizes), input_size, dtype=dtype, device=device)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _param(sum(self.shard_sizes), dtype=dtype, device=device)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: int = 0) -> None:
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        value = narrow(loaded, 0, self.tp.rank * size, size)
        copy_into(param.data.narrow(0, offset, size), value, f"shard {shard_id}")

    def pack_for_cpu(self, impl: str) -> bool:
        return _pack_parameter(self, impl)

    def quantize(self, impl: str) -> bool:
        return _quantize_parameter(self, impl)

    def unpack_for_loading(self, keep_values: bool = True) -> None:
        _unpack_parameter(self, keep_values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8(x, self.bias)
        if self.blocked is not None:
            return self.blocked(x, self.bias)
        return linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """The merged q/k/v projection. Query heads split across ranks; KV heads split too, or,
    when there are fewer KV heads than ranks, each rank holds a replica of one KV head."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.world_size, "num_attention_heads")
        if num_kv_heads >= tp.world_size:
            self.num_kv_heads = _divide(num_kv_heads, tp.world_size, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            _divide(tp.world_size, num_kv_heads, "tensor_parallel_size / num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.world_size
        q_size = self.num_heads * head_dim
        kv_size = self.num_kv_heads * head_dim
        single = TPGroup()  # sizes below are already per rank
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, single, dtype, device)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: str = "q") -> None:
        index = "qkv".index(shard_id)
        size = self.shard_sizes[index]
        offset = sum(self.shard_sizes[:index])
        if shard_id == "q":
            start = self.tp.rank * self.num_heads * self.head_dim
        else:
            start = self.kv_head_start * self.head_dim
        copy_into(param.data.narrow(0, offset, size), narrow(loaded, 0, start, size), f"{shard_id}_proj")


class RowParallelLinear(nn.Module, CpuPackable):
    """y = all_reduce(x_shard W_shard^T) + b, with W's input columns split across ranks."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size_per_rank = _divide(input_size, tp.world_size, "linear input size")
        self.weight = _param(output_size, self.input_size_per_rank, dtype=dtype, device=device)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _param(output_size, dtype=dtype, device=device)
            self.bias.weight_loader = self._bias_loader

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        start = self.tp.rank * self.input_size_per_rank
        copy_into(param, narrow(loaded, 1, start, self.input_size_per_rank), "row-parallel weight")

    def _bias_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        assert len(shape_of(loaded)) == 1
        copy_into(param, read_all(loaded), "row-parallel bias")

    def pack_for_cpu(self, impl: str) -> bool:
        return _pack_parameter(self, impl)

    def quantize(self, impl: str) -> bool:
        return _quantize_parameter(self, impl)

    def unpack_for_loading(self, keep_values: bool = True) -> None:
        _unpack_parameter(self, keep_values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            y = self.int8(x)
        elif self.blocked is not None:
            y = self.blocked(x)
        else:
            y = linear(x, self.weight)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
