"""`quantize=int8|nf4|fp8`: a LoRA's frozen base held as quantized weights (QLoRA).

Every `nn.Linear` of the module (the UNet or transformer before its adapters are added, a frozen text encoder) is
replaced by bitsandbytes' `Linear8bitLt` (LLM.int8: int8 weights, a scale per row) or `Linear4bit` (NF4 in blocks of
64, the blocks' scales quantized again), quantized where it is moved to the run's device, or becomes a
`Float8Linear` holding torchao's float8 weight (`fp8`: e4m3 values and an fp32 scale per row,
dequantized for each matmul and again in backward, not kept). Under ZeRO-3
the 4-bit weights are packed into tensors of the compute dtype (bitsandbytes' `quant_storage`, as PEFT documents for
ZeRO-3), so that DeepSpeed flattens, partitions and gathers them with the module's other 16-bit parameters; their
scales stay on the parameter object, whole on every rank. peft adds its LoRA layers around them as it does around
`nn.Linear` (its bitsandbytes and torchao dispatch), so the adapters' names, and the LoRA file written from them,
are those of the unquantized base. Convolutions, norms and embeddings stay in the 16-bit type.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ds_trainer.train.backends.params import Whole

log = logging.getLogger("ds_trainer")

KINDS = {"int8": "LLM.int8 (int8 weights, a scale per row)", "nf4": "4-bit NormalFloat (blocks of 64, QLoRA)",
         "fp8": "torchao's float8 e4m3 (weight-only, an fp32 scale per row)"}
NF4_BLOCK = 64  # bitsandbytes' default 4-bit block (Params4bit's blocksize)


@dataclass
class Quantized:
    """What `apply` replaced: the layers, and their weights' bytes before and after (scales included)."""

    layers: int
    before: int
    after: int


def is_float8(tensor: object) -> bool:
    """torchao's float8 weight (quantize=fp8): a tensor subclass holding its e4m3 values (`qdata`) and scales."""
    return hasattr(tensor, "qdata")


def linears(module: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The plain `nn.Linear` layers of `module` by name (not a LoRA's wrapper, not one already quantized: an fp8
    layer keeps its class, its weight is torchao's), but those its class keeps in float32
    (diffusers' `_keep_in_fp32_modules`: Wan's time embedder, which casts the timestep to its
    weights' dtype)."""
    kept = set(getattr(type(module), "_keep_in_fp32_modules", None) or ())
    return [(name, m) for name, m in module.named_modules() if type(m) is torch.nn.Linear
            and not is_float8(m.weight) and not kept & set(name.split("."))]


def apply(module: torch.nn.Module, kind: str, compute_dtype: torch.dtype, device: torch.device,  # noqa: PLR0913
          threshold: float = 6.0, compiled: bool = False, storage: torch.dtype = torch.uint8) -> Quantized:
    """Replace every `nn.Linear` of `module` by its quantized counterpart on `device`, frozen; `compute_dtype` is
    what the layer computes in (the training precision's 16-bit type, float32 under fp32); `compiled`: the module
    will run under torch.compile (train.compile); `storage`: the dtype of the tensors nf4's packed weights are held
    in (ZeRO-3: the compute dtype)."""
    if kind == "fp8":
        return _float8(module, compute_dtype, device)
    import bitsandbytes as bnb

    layers = linears(module)
    before = after = 0
    for name, linear in layers:
        # From the CPU: bitsandbytes' int8 weight quantizes only when it moves from the CPU (one already on the GPU
        # would stay in 16 bits); the 4-bit one quantizes on its first move either way.
        weight, bias = linear.weight.data.to("cpu"), linear.bias
        before += weight.numel() * weight.element_size()
        shape = (linear.in_features, linear.out_features)
        quantized: torch.nn.Module
        if kind == "nf4":
            quantized = bnb.nn.Linear4bit(*shape, bias=bias is not None, compute_dtype=compute_dtype,
                                          compress_statistics=True, quant_type="nf4", quant_storage=storage,
                                          device="meta")
            quantized.weight = bnb.nn.Params4bit(weight.to(compute_dtype), requires_grad=False,
                                                 compress_statistics=True, quant_type="nf4", quant_storage=storage,
                                                 module=quantized)
            if linear.in_features % NF4_BLOCK or compiled or storage != torch.uint8:
                # On a CPU with AVX512-BF16 bitsandbytes 0.50 repacks a 4-bit weight at its first inference forward
                # (samples, validation) in rows of whole blocks, and fails on a layer whose input width is not a
                # multiple of the block ("shape '[128, 0]' is invalid": the tiny models' time embedding, 32 wide):
                # such a layer keeps the unpacked kernel. (SDXL's, SD3's and Flux's layers are all multiples of 64.)
                # Under torch.compile the repacked weight's fake kernel has the wrong shape ("expected size
                # 2048==64"): a compiled module keeps the unpacked kernel in every layer. The repack reads a uint8
                # weight ("packed_weight should be [N, K/2]"): one held in 16-bit storage (ZeRO-3) keeps it too.
                quantized.support_avx512bf16_for_cpu = False
            quantized.register_forward_hook(_as_autocast)
        elif kind == "int8":
            quantized = bnb.nn.Linear8bitLt(*shape, bias=bias is not None, has_fp16_weights=False,
                                            threshold=threshold, device="meta")
            quantized.weight = bnb.nn.Int8Params(weight.to(compute_dtype), requires_grad=False,
                                                 has_fp16_weights=False)
            quantized.register_forward_hook(_as_autocast)
        else:
            raise ValueError(f"quantize={kind}: not one of {sorted(KINDS)}")
        if bias is not None:
            quantized.bias = torch.nn.Parameter(bias.data.to(compute_dtype), requires_grad=False)
        quantized = quantized.to(device)  # bitsandbytes quantizes the weight as it moves
        if quantized.weight.dtype not in (torch.int8, torch.uint8, storage):
            raise RuntimeError(f"{name}: bitsandbytes left the {kind} weight in {quantized.weight.dtype} on {device}")
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, quantized)
        after += weight_bytes(quantized.weight)
    return Quantized(len(layers), before, after)


def move(module: torch.nn.Module, device: torch.device | str) -> None:
    """`module.to(device)`, with what bitsandbytes' int8 layers keep beside their weights."""
    module.to(device)
    follow_weights(module)


def follow_weights(module: torch.nn.Module) -> None:
    """Point each LLM.int8 layer's int8 weights and row scales (`Linear8bitLt.state`, or its
    weight's own CB/SCB before its first forward) at where its weight now is. Module.to moves each
    parameter but never calls Linear8bitLt.to, the only code that moves them (review 3's P1): an
    int8 text encoder moved to the CPU after the cache build kept its int8 weights on the GPU, and
    the move added a host copy."""
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if not hasattr(weight, "SCB"):  # not bitsandbytes' Int8Params
            continue
        for holder in (weight, getattr(layer, "state", None)):
            if getattr(holder, "CB", None) is not None:
                holder.CB = weight.data  # type: ignore[union-attr]  # the same int8 values
            if getattr(holder, "SCB", None) is not None:
                holder.SCB = holder.SCB.to(weight.device)  # type: ignore[union-attr]


def _float8(module: torch.nn.Module, compute_dtype: torch.dtype, device: torch.device) -> Quantized:
    """`quantize=fp8`: each linear layer's weight as torchao's Float8Tensor, on `device`; the layer keeps its class
    (peft wraps it in its torchao LoRA layer) and computes in `compute_dtype`."""
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    layers = linears(module)
    before = after = 0
    for name, linear in layers:
        before += linear.weight.numel() * linear.weight.element_size()
        linear.to(device=device, dtype=compute_dtype)
        # set_inductor_config=False: torchao would otherwise turn on inductor's coordinate-descent
        # tuning for the whole process (review 3's P2): under train.compile every Triton kernel
        # benchmarked direction by direction.
        quantize_(linear, Float8WeightOnlyConfig(set_inductor_config=False))
        weight = linear.weight
        if not is_float8(weight):
            raise RuntimeError(f"{name}: torchao left the fp8 weight a {type(weight).__name__} on {device}")
        # A frozen buffer, not a parameter: the backends flatten, broadcast or swap parameters (DDP's first sync,
        # DeepSpeed's move to its device), which a tensor subclass refuses; `weight` reads the same for the layer
        # and for peft. Not persistent: checkpoints hold the adapters; a resume quantizes the base again.
        del linear.weight
        linear.register_buffer("weight", weight.detach(), persistent=False)
        linear.requires_grad_(False)
        # Still an nn.Linear (peft's torchao dispatch, the LoRA names), computed by Float8Linear's
        # forward: a class swap, as torch's parametrize makes its own.
        linear.__class__ = Float8Linear
        linear.register_forward_hook(_as_autocast)
        after += weight_bytes(linear.weight)
    return Quantized(len(layers), before, after)


class Float8Linear(torch.nn.Linear):
    """quantize=fp8's layer: an nn.Linear whose weight is torchao's float8 tensor (a frozen
    buffer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Float8Matmul.apply(x, self.weight, self.bias)  # type: ignore[no-any-return]


class _Float8Matmul(torch.autograd.Function):
    """`input @ W.T + bias` for a frozen float8 W, dequantized again in backward (as bitsandbytes'
    MatMul4Bit does): torchao's F.linear for its Float8Tensor is `matmul(input, W.dequantize())`
    above autograd, so every layer outside a recomputed block kept a 16-bit copy of its weight until
    backward, 2 bytes a weight the planner does not count (review 3's A3). Only the input's gradient
    (and a trained bias's) flows: the weight is a frozen buffer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.weight = weight  # held by its layer anyway: a reference, not a saved copy
        out = torch.matmul(x, weight.dequantize().t())  # as torchao's own F.linear computes it
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, Any]:
        weight = ctx.weight.dequantize()
        grad_input = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.needs_input_grad[2] else None
        return grad_input, None, grad_bias


def _as_autocast(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor:
    """A Linear4bit (and a Float8Tensor's matmul, and a Linear8bitLt without autograd: validation) returns its
    input's dtype; under autocast (DDP's 16-bit training) nn.Linear returns autocast's.
    An fp32 output there (the time embedding's projection, added to a ResNet block's bf16 activations) reaches a
    GroupNorm whose parameters are bf16, which the CPU refuses ("mixed dtype (CPU): expect parameter to have scalar
    type of Float") and a GPU computes in fp32: the output is cast as autocast casts nn.Linear's."""
    kind = output.device.type
    if torch.is_autocast_enabled(kind) and output.is_floating_point():
        return output.to(torch.get_autocast_dtype(kind))
    return output


def weight_bytes(weight: torch.Tensor) -> int:
    """What a (quantized) weight holds in memory: its data and, for bitsandbytes' weights, the scales beside it;
    torchao's float8 weight: its e4m3 values and their scales (it says it is the compute dtype)."""
    if is_float8(weight):
        return sum(t.numel() * t.element_size() for t in (weight.qdata, weight.scale))  # type: ignore[attr-defined]
    total = weight.numel() * weight.element_size() + _state_bytes(getattr(weight, "quant_state", None))
    scale = getattr(weight, "SCB", None)  # Int8Params: a float32 scale per row
    if isinstance(scale, torch.Tensor):
        total += scale.numel() * scale.element_size()
    return total


def _state_bytes(state: Any) -> int:
    """A Params4bit's quantization state: its absmax (uint8 when nested), code book and offset, and the nested one's."""
    total = 0
    while state is not None:
        total += sum(t.numel() * t.element_size() for t in (state.absmax, state.code, state.offset)
                     if isinstance(t, torch.Tensor))
        state = state.state2 if getattr(state, "nested", False) else None
    return total


def _four_bit(module: torch.nn.Module) -> Iterator[tuple[torch.Tensor, Any]]:
    """Each 4-bit weight of `module` once, with its quantization state: on the Params4bit, or on bitsandbytes' layer
    when FSDP2 replaced the parameter with its DTensor shard (peft's LoRA layer names its base layer's weight too)."""
    seen: set[int] = set()
    for part in module.modules():
        weight = getattr(part, "weight", None)
        state = getattr(weight, "quant_state", None) or getattr(part, "quant_state", None)
        if isinstance(weight, torch.Tensor) and state is not None and id(weight) not in seen:
            seen.add(id(weight))
            yield weight, state


def unpacked_shapes(module: torch.nn.Module) -> dict[int, tuple[int, ...]]:
    """By the weight's id, the shape of each 4-bit weight of `module` before bitsandbytes packed it (its quantization
    state keeps it)."""
    return {id(weight): tuple(state.shape) for weight, state in _four_bit(module)}


def partitioned_bytes(module: torch.nn.Module, layout: Whole) -> tuple[int, int, int]:
    """Under ZeRO-3 or FSDP2: (this rank's partition of the packed 4-bit weights, all of them, their scales), in
    bytes. ZeRO-3 keeps the Params4bit (its data gathered away) and its partition beside it; FSDP2 replaces it with a
    DTensor shard, and bitsandbytes' layer keeps the quantization state on itself."""
    held = whole = scales = 0
    for p, state in _four_bit(module):
        local = layout.local(p)
        if local is None:
            continue
        held += local.numel() * local.element_size()
        whole += layout.numel(p) * local.element_size()
        scales += _state_bytes(state)
    return held, whole, scales


def resident_bytes(module: torch.nn.Module) -> int:
    """Every parameter and buffer of `module` as held in memory, quantized weights with their scales (an int8 layer
    moves its row scales from the weight to its own state at its first forward)."""
    total = 0
    for part in module.modules():
        total += sum(weight_bytes(p) for p in part.parameters(recurse=False))
        total += sum(weight_bytes(b) for b in part.buffers(recurse=False))  # fp8's weights are buffers
        scale = getattr(getattr(part, "state", None), "SCB", None)
        if isinstance(scale, torch.Tensor) and getattr(getattr(part, "weight", None), "SCB", None) is None:
            total += scale.numel() * scale.element_size()
    return total
