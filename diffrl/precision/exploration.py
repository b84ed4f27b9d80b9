"""The Sol-RL exploration copy: the policy transformer with LoRA merged in, its linear
layers run at a lower precision (reference fake quantization), re-synced from the policy
after every optimizer step.

* ``nvfp4``: weights and input activations in NVFP4 (W4A4); activation tensor scales are
  taken per sample, so a sample's numerics do not depend on its batch.
* ``fp8``: weights E4M3 per output row, activations E4M3 per token (torchao's ``PerRow``).
* ``bf16``: the control; merged weights, no quantization.

Quantized layers are the ``nn.Linear`` layers and the 1x1 ``nn.Conv2d`` layers (stride
1, no padding, one group: a linear layer applied to every pixel, as in SANA's GLUMBConv
``conv_inverted`` / ``conv_point``). For those the weight is viewed as (out, in), and the
input is moved channels-last before quantization, so NVFP4's blocks of 16 run along the
input channels, the dimension the matmul reduces over, exactly as for a linear layer.
Other convolutions (patch embeddings, SANA's depthwise 3x3 ``conv_depth``) stay in high
precision.

Layers whose qualified name fully matches a ``keep_high`` pattern stay in high
precision, and so, with ``min_dim`` > 0, does every layer whose larger dimension is at
most ``min_dim`` (Sol-RL's ``nvfp4_min_dim``: its ``replace_linear_with_te`` skips a
linear when ``max(in, out) <= min_dim``; 2240 keeps SANA's 2240-wide attention
projections in BF16). Patterns are anchored regexes on purpose: a loose ``proj_out`` substring
would also keep every FLUX single block's ``proj_out`` (see ``keep_high.py``).

Sync recomputes every quantized weight (and so its amax and scales) from the current
merged weights W + scale * B @ A; nothing is cached between syncs, so scales cannot go
stale. Every LoRA-wrapped layer, linear or conv, is merged (SANA's LoRA targets its 1x1
convs).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from diffrl.precision.formats import fake_fp8, fake_nvfp4
from diffrl.precision.keep_high import split_keep_high
from diffrl.runtime.sharding import units_gathered

PRECISIONS = ("nvfp4", "fp8", "bf16")
# layers whose weights are loaded one by one at sync (LoRA merged); the rest is copied as is
_WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def _base(module: nn.Module) -> nn.Module:
    return module.base_layer if _is_lora_layer(module) else module


def is_pointwise_conv(module: nn.Module) -> bool:
    """A 1x1 Conv2d with stride 1, no padding and one group: per pixel, exactly a linear
    layer over channels."""
    return (
        isinstance(module, nn.Conv2d)
        and module.kernel_size == (1, 1)
        and module.stride == (1, 1)
        and module.padding in ((0, 0), "valid")
        and module.groups == 1
    )


def is_quantizable(module: nn.Module) -> bool:
    """Whether the exploration copy quantizes this layer (unless it is kept high)."""
    return isinstance(module, nn.Linear) or is_pointwise_conv(module)


def with_lora_deltas(module: nn.Module, detach: bool = False) -> torch.Tensor:
    """A layer's base weight plus every active LoRA delta, merged in fp32 with autocast off:
    W + sum_adapters scale * B @ A, each term and the sum in fp32, whatever the weights'
    dtype and whatever autocast is active around the call. The one merge of both the FP8
    flow (whose training forward keeps the graph: gradients reach the LoRA factors through
    it) and Sol-RL's exploration copy (``detach``: a sync). Under bf16 autocast the
    product B @ A would otherwise be rounded to bf16 before the add, so the quantizer
    would see another weight than the fp32 master weights hold (issue 61: 3 % of FP8
    codes differed), and the flow and the copy would merge differently."""
    weight = _base(module).weight
    weight = (weight.detach() if detach else weight).float()
    if not (_is_lora_layer(module) and not module.disable_adapters):
        return weight
    kind = weight.device.type
    off = contextlib.nullcontext() if kind == "meta" else torch.autocast(kind, enabled=False)
    with off:
        for name in module.active_adapters:
            if name not in module.lora_A:
                continue
            a, b = module.lora_A[name].weight, module.lora_B[name].weight
            a, b = (a.detach(), b.detach()) if detach else (a, b)
            delta = _lora_product(b.float(), a.float()) * module.scaling[name]
            weight = weight + delta.reshape(weight.shape)
    return weight


def _lora_product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """B @ A of one adapter as the base weight's shape would hold it, before the scale:
    a linear's (out, r) @ (r, in); a 1x1 conv's factors are convs with 1x1 kernels, the
    product taken over their channels (peft's ``get_delta_weight`` for kernel size 1)."""
    if a.ndim == 4:
        return (b.squeeze(3).squeeze(2) @ a.squeeze(3).squeeze(2)).unsqueeze(2).unsqueeze(3)
    return b @ a


def layer_dims(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear layer or a 1x1 conv (its channels)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.in_channels, module.out_channels


def merged_weight(module: nn.Module) -> torch.Tensor:
    """The effective fp32 weight of a layer: base + every active LoRA delta, no graph."""
    return with_lora_deltas(module, detach=True)


def _unwrapped_copy(transformer: nn.Module) -> nn.Module:
    """A deep copy with every peft LoRA layer replaced by its base layer."""
    model = copy.deepcopy(transformer)
    for name, module in list(model.named_modules()):
        if _is_lora_layer(module):
            if not isinstance(module.base_layer, _WEIGHT_LAYERS):
                raise NotImplementedError(
                    f"LoRA on '{name}' ({type(module.base_layer).__name__}) is not merged "
                    "by the exploration copy; target linear or conv layers only"
                )
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.base_layer)
    return model.requires_grad_(False).eval()


# elements quantized at once: the pure-PyTorch NVFP4 path holds about 8 fp32 temporaries
# per element (blocks, scales, quotients, rounding branches), 9 GiB for a 1024^2 FLUX
# activation at batch 4 in one piece; 2^24 elements keep it near 0.5 GiB
CHUNK_ELEMENTS = 2**24


def _activation_quantizer(precision: str, chunk_elements: int = CHUNK_ELEMENTS):
    """Fake-quantize an activation so that a sample's numerics never depend on its batch,
    a few samples at a time (the scales never cross samples, so chunking along dim 0
    changes no value):

    * ``fp8``: one E4M3 scale amax / 448 per token (a row over the last dim, the channels),
      as torchao's copy (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``)
      scales its activations, so the CPU's and the GPU's copies quantize alike (until
      issue 61 this took one scale per sample);
    * ``nvfp4``: blocks of 16 along the last dim, the FP32 tensor scale per sample."""
    if precision == "nvfp4":

        def one(x):
            return fake_nvfp4(x, per_sample=True)
    else:

        def one(x):
            return fake_fp8(x, per_row=True)

    def quantize(x):
        rows = max(1, chunk_elements // max(1, x[:1].numel()))
        if x.shape[0] <= rows:
            return one(x).to(x.dtype)
        return torch.cat([one(part).to(x.dtype) for part in x.split(rows)])

    return quantize


def _channels_last(quant):
    """Wrap an activation quantizer for an (N, C, H, W) conv input: NVFP4 blocks run
    along the last dim, so move the channels (the reduction dim) there and back."""
    return lambda x: quant(x.movedim(1, -1)).movedim(-1, 1)


class ExplorationCopy:
    """A low-precision copy of a (possibly LoRA-wrapped) transformer, fake-quantized in
    pure PyTorch (the ``reference`` backend). ``model`` is what exploration calls;
    ``quantized`` lists the layers that run at ``precision`` (for ``bf16``, the ones
    that would)."""

    backend = "reference"

    def __init__(self, transformer: nn.Module, precision: str, keep_high=(), device=None, min_dim: int = 0):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown exploration precision '{precision}'; valid: {', '.join(PRECISIONS)}")
        self.precision, self.keep_high = precision, tuple(keep_high)
        # ``device``: where the copy lives when the transformer is not there (under FSDP the
        # whole transformer stays in host memory until prepare shards it onto the devices)
        self.model = _unwrapped_copy(transformer)
        if device is not None:
            self.model.to(device)
        self.layer_names = [n for n, m in self.model.named_modules() if isinstance(m, _WEIGHT_LAYERS)]
        self._layer_set = set(self.layer_names)
        self.quantizable = [n for n in self.layer_names if is_quantizable(self.model.get_submodule(n))]
        self.quantized, self.kept = split_keep_high(self.quantizable, self.keep_high)
        self.narrow = [n for n in self.quantized if max(layer_dims(self.model.get_submodule(n))) <= min_dim]
        if self.narrow:  # min_dim 0 keeps none: every width is positive
            self.quantized = [n for n in self.quantized if n not in set(self.narrow)]
            self.kept = [*self.kept, *self.narrow]
        self._quantized_set = set(self.quantized)
        self._install_quantizers()
        self.sync(transformer)

    @property
    def module(self) -> nn.Module:
        """The eager ``nn.Module`` holding the weights (``model`` may wrap it)."""
        return self.model

    def _install_quantizers(self) -> None:
        """Forward pre-hooks that fake-quantize the input activations of quantized layers."""
        if self.precision == "bf16":
            return
        quant = _activation_quantizer(self.precision)
        for name in self.quantized:
            layer = self.model.get_submodule(name)
            fn = _channels_last(quant) if isinstance(layer, nn.Conv2d) else quant
            layer.register_forward_pre_hook(lambda _m, args, fn=fn: (fn(args[0]), *args[1:]))

    def quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """Fake-quantize a weight; a 1x1 conv's (out, in, 1, 1) is quantized as (out, in)."""
        flat = weight.reshape(weight.shape[0], -1)
        if self.precision == "nvfp4":
            return fake_nvfp4(flat).reshape(weight.shape)
        if self.precision == "fp8":
            return fake_fp8(flat, per_row=True).reshape(weight.shape)
        return weight

    def _write_layer(self, name: str, target: nn.Module, weight: torch.Tensor) -> None:
        """Load one layer's merged fp32 weight into the copy (quantized if it is)."""
        if name in self._quantized_set:
            weight = self.quantize_weight(weight)
        target.weight.copy_(weight.reshape(target.weight.shape).to(target.weight.dtype))

    @torch.no_grad()
    def sync(self, transformer: nn.Module) -> None:
        """Copy the current weights in (LoRA merged) and re-quantize them.

        A transformer sharded by FSDP is read one unit (transformer block) at a time,
        gathered while it is read (:func:`units_gathered`): the copy itself is whole on
        every process, so exploration runs no collectives, and the sync's extra memory is
        one block. Every process syncs at the same point of the loop."""
        source = dict(transformer.named_modules())
        own = self.module.state_dict()
        for owns in units_gathered(transformer):
            for name in self.layer_names:
                if owns(name):
                    self._sync_layer(name, source[name])
            self._copy_other_tensors(transformer, owns, own)

    def _sync_layer(self, name: str, source: nn.Module) -> None:
        target = self.module.get_submodule(name)
        self._write_layer(name, target, merged_weight(source))
        bias = _base(source).bias
        if bias is not None:
            target.bias.copy_(bias.to(target.bias.dtype))

    def _copy_other_tensors(self, transformer: nn.Module, owns, own: dict) -> None:
        """Everything but the weight layers (norms, embeddings, scale-shift tables), as
        it is, into the copy's state ``own``, for the modules ``owns`` accepts."""
        tensors = [*transformer.named_parameters(), *transformer.named_buffers()]
        for key, value in tensors:
            key = key.replace(".base_layer.", ".")
            module = key.rpartition(".")[0]
            if "lora_" in key or module in self._layer_set or key not in own or not owns(module):
                continue
            own[key].copy_(value.detach())


# -- 1x1 convs as linears, for the library backends (backends.py, modelopt_copy.py) ------
class ConvAsLinear(nn.Module):
    """A 1x1 conv (stride 1, no padding, one group) as the ``nn.Linear`` it is per pixel,
    so a backend that quantizes linears blocks its input along the channels."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        w = conv.weight
        self.linear = nn.Linear(
            conv.in_channels, conv.out_channels, bias=conv.bias is not None, device=w.device, dtype=w.dtype
        )
        with torch.no_grad():
            self.linear.weight.copy_(w.reshape(w.shape[0], -1))
            if conv.bias is not None:
                self.linear.bias.copy_(conv.bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.movedim(1, -1).contiguous()).movedim(-1, 1)


def swap_pointwise_convs(model: nn.Module, names: list[str]) -> set[str]:
    """Replace every conv among ``names`` by a :class:`ConvAsLinear`; return the names of
    the ``nn.Linear`` layers the backend must quantize."""
    targets = set()
    for name in names:
        layer = model.get_submodule(name)
        if isinstance(layer, nn.Conv2d):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, ConvAsLinear(layer))
            name = f"{name}.linear"
        targets.add(name)
    return targets
