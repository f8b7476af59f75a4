"""Wide-ResNet with bottleneck blocks, as in Alpa's benchmark suite (Flax ResNet v1.5).

Stage i (1..4) has base·2^(i-1) bottleneck channels `ci_a`; its 3×3 convolution widens them by
the width factor to `ci_b`, and the block outputs 4·base·2^(i-1) channels `ci_o`. Spatial dims
are named by size (`h56`, `w56`); kernel axes `kh3`, `kw3`, … BatchNorm is a `layernorm`
normalising over the batch and spatial dims with per-channel scale and shift.
"""

from __future__ import annotations

from partopt.errors import InstanceError
from partopt.graph import Graph
from partopt.models.builder import GraphBuilder, require_positive

STAGES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}


def _halved(size: int) -> int:
    """Spatial size after a stride-2 window with 'same' padding."""
    return (size + 1) // 2


def _spatial(b: GraphBuilder, size: int) -> tuple[str, str]:
    return b.dim(f"h{size}", size), b.dim(f"w{size}", size)


def _kernel(b: GraphBuilder, k: int) -> tuple[str, str]:
    return b.dim(f"kh{k}", k), b.dim(f"kw{k}", k)


def _batchnorm(b: GraphBuilder, name: str, x: str) -> str:
    """Batch statistics over (batch, height, width); per-channel scale and shift."""
    batch, channel, height, width = b.dims_of(x)
    scale, shift = b.param(f"{name}.scale", [channel]), b.param(f"{name}.shift", [channel])
    return b.op("layernorm", name, [x, scale, shift], b.dims_of(x), axes=[batch, height, width])


def _conv(b: GraphBuilder, name: str, x: str, out_channels: str, kernel: int, stride: int) -> str:
    """A bias-free convolution. A 1×1 stride-1 one is an einsum over channels (no window, so its
    spatial dims stay shardable); the others are `conv2d` with their window and stride."""
    batch, channels, height, width = b.dims_of(x)
    if kernel == 1 and stride == 1:
        return b.linear(name, x, (out_channels, channels), (batch, out_channels, height, width), bias=False)
    size = b.dims[height] if stride == 1 else _halved(b.dims[height])
    w = b.param(f"{name}.w", (out_channels, channels, *_kernel(b, kernel)))
    return b.op("conv2d", name, [x, w], (batch, out_channels, *_spatial(b, size)), stride=stride)


def _relu(b: GraphBuilder, name: str, x: str) -> str:
    return b.op("elementwise", name, [x], b.dims_of(x), fn="relu")


def _bottleneck(b: GraphBuilder, x: str, channels: tuple[str, str, str], stride: int) -> str:
    """1×1 -> BN -> relu -> 3×3 (stride) -> BN -> relu -> 1×1 -> BN, plus the shortcut, relu.

    The shortcut is a projection (1×1 conv with the stride, BN) when the shape changes."""
    inner, wide, out = channels
    y = _relu(b, "relu1", _batchnorm(b, "bn1", _conv(b, "conv1", x, inner, 1, 1)))
    y = _relu(b, "relu2", _batchnorm(b, "bn2", _conv(b, "conv2", y, wide, 3, stride)))
    y = _batchnorm(b, "bn3", _conv(b, "conv3", y, out, 1, 1))
    shortcut = x
    if b.dims_of(x) != b.dims_of(y):
        shortcut = _batchnorm(b, "bn_proj", _conv(b, "proj", x, out, 1, stride))
    return _relu(b, "relu3", b.op("elementwise", "residual", [y, shortcut], b.dims_of(y), fn="add"))


def wresnet(depth: int, base_channels: int, width_factor: int, batch: int, image: int = 224,
            classes: int = 1024, dtype: str = "fp32", optimizer: str = "sgd", name: str | None = None) -> Graph:
    """Wide-ResNet-`depth` (50 or 101) classifier on image×image×3 inputs with a cross-entropy loss.

    Stem: conv 7×7/2 + BN + relu + max-pool 3×3/2; stages of bottleneck blocks (3, 4, 6, 3) or
    (3, 4, 23, 3), the first block of stages 2-4 striding by 2; global average pool; fc to `classes`.
    One layer tag per bottleneck block (the stem with the first, the head with the last). Trained
    with SGD with momentum by default (as ResNets are, and Alpa's Wide-ResNet benchmark).
    """
    require_positive("wresnet", depth=depth, base_channels=base_channels, width_factor=width_factor,
                     batch=batch, image=image, classes=classes)
    if depth not in STAGES:
        raise InstanceError(f"depth {depth} is not supported", "wresnet(depth=...)",
                            f"use one of {sorted(STAGES)}")
    b = GraphBuilder(name or f"wresnet{depth}-c{base_channels}-w{width_factor}", dtype, "b",
                     dict(b=batch, rgb=3, stem=base_channels, classes=classes), optimizer)
    x = b.input("images", ("b", "rgb", *_spatial(b, image)))
    labels = b.input("labels", ("b",), "int32")
    with b.scope("stem", 0):
        x = _relu(b, "relu", _batchnorm(b, "bn", _conv(b, "conv", x, "stem", 7, 2)))
        size = _halved(b.dims[b.dims_of(x)[2]])
        x = b.op("pool", "maxpool", [x], ("b", "stem", *_spatial(b, size)), kernel=[3, 3], stride=2)
    layer = 0
    for i, blocks in enumerate(STAGES[depth]):
        width = base_channels * 2 ** i
        channels = (b.dim(f"c{i + 1}_a", width), b.dim(f"c{i + 1}_b", width * width_factor),
                    b.dim(f"c{i + 1}_o", 4 * width))
        for j in range(blocks):
            with b.scope(f"l{layer}", layer):
                x = _bottleneck(b, x, channels, 2 if i > 0 and j == 0 else 1)
            layer += 1
    with b.scope("head", layer - 1):
        channel = b.dims_of(x)[1]
        pooled = b.op("reduce", "avgpool", [x], ("b", channel), fn="mean")
        logits = b.linear("fc", pooled, (channel, "classes"), ("b", "classes"), bias=True)
        b.mark_output(b.op("cross_entropy", "loss", [logits, labels], ()))
    return b.build()
