"""ONNX frontend: an .onnx model (shapes inferred by onnx.shape_inference) as a partopt Graph.

Floating-point initializers are parameters (named as in the file), except BatchNormalization's
running mean and variance, which are statistics, not trained (integer ones are constants); graph inputs are data (the batch dim is axis 0 of the
first). Conv, Gemm, MatMul, BatchNormalization, pooling, activations and arithmetic, Concat,
Reshape/Flatten, Transpose, Softmax and LayerNormalization map (docs/FRONTENDS.md has the table).
Every dim must be static: fix dynamic dims in the file before importing. Requires onnx.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

from partopt.errors import InstanceError, first_line
from partopt.frontends.draft import INTEGER_DTYPES, UnsupportedError
from partopt.frontends.values import NoMapping, Scope, Value, Values
from partopt.graph import Graph
from partopt.ops import stride_attr

ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Gelu", "Erf", "Exp", "Log", "Sqrt",
    "Reciprocal", "Neg", "Abs", "Clip", "HardSigmoid", "HardSwish", "Elu", "Selu", "Softplus", "Mish", "Max", "Min",
    "Where", "Equal", "Less", "Greater", "Not", "And", "Or", "PRelu", "Sin", "Cos", "Floor", "Ceil", "Sum",
})
ALIASES = frozenset({"Identity", "Dropout", "Cast"})
REDUCES = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max", "ReduceMin": "min", "ReduceProd": "prod"}
DTYPES = {onnx.TensorProto.FLOAT: "fp32", onnx.TensorProto.FLOAT16: "fp16", onnx.TensorProto.BFLOAT16: "bf16",
          onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT8: "int8",
          onnx.TensorProto.UINT8: "int8", onnx.TensorProto.BOOL: "bool"}


def from_model(source: str | Path | onnx.ModelProto, opaque: bool = False, name: str | None = None) -> Graph:
    """The graph of an ONNX model (a path or a ModelProto). An op with no mapping raises
    UnsupportedError naming it; with `opaque` it becomes an unsharded opaque op priced by its output size."""
    where = str(source) if not isinstance(source, onnx.ModelProto) else "model"
    model = _load(source, where)
    try:
        inferred = shape_inference.infer_shapes(model, strict_mode=True)
    except Exception as err:  # onnx raises its own InferenceError and friends
        raise InstanceError(f"shape inference failed: {first_line(err)}", where,
                            "check the model with onnx.checker.check_model") from None
    return _Importer(inferred.graph, where, opaque).run(name or inferred.graph.name or Path(where).stem)


def _load(source: str | Path | onnx.ModelProto, where: str) -> onnx.ModelProto:
    if isinstance(source, onnx.ModelProto):
        return source
    try:
        return onnx.load(str(source))
    except OSError as err:
        raise InstanceError(f"cannot read: {err.strerror or err}", where) from None
    except Exception as err:  # a file that is not a protobuf ModelProto
        raise InstanceError(f"not an ONNX model: {first_line(err)}", where, "give an .onnx file") from None


def _dtype(elem_type: int, where: str) -> str:
    if elem_type not in DTYPES:
        raise UnsupportedError(f"element type {onnx.TensorProto.DataType.Name(elem_type)} has no partopt dtype", where,
                               f"convert the model to one of {sorted(set(DTYPES.values()))}")
    return DTYPES[elem_type]


class _Importer(Values):
    """Walks an ONNX graph (in its stored order, which ONNX requires to be topological) into a Draft."""

    def __init__(self, graph: Any, where: str, opaque: bool):
        super().__init__()
        self.graph = graph
        self.where = where
        self.opaque_ok = opaque
        self.shapes: dict[str, tuple[tuple[int, ...], int]] = {}
        self.consts: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.env: dict[str, Value] = {}
        for info in (*graph.input, *graph.value_info, *graph.output):
            tensor_type = info.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
            self.shapes[info.name] = (dims, tensor_type.elem_type)
        for t in graph.initializer:
            self.shapes[t.name] = (tuple(t.dims), t.data_type)

    def shape(self, name: str, node: Any) -> tuple[int, ...]:
        if name not in self.shapes or any(d <= 0 for d in self.shapes[name][0]):
            raise UnsupportedError(f"tensor {name!r} has no static shape after shape inference",
                                   self.place(node), "fix every dynamic dim (batch, sequence) in the model file")
        return self.shapes[name][0]

    def place(self, node: Any) -> str:
        index = list(self.graph.node).index(node)
        return f"{self.where}: node {index}{f' {node.name}' if node.name else ''} ({node.op_type})"

    def run(self, title: str) -> Graph:
        statistics = {n.input[k] for n in self.graph.node if n.op_type == "BatchNormalization" for k in (3, 4)
                      if len(n.input) > k}
        batch_dim = None
        for t in self.graph.initializer:  # integer initializers (shapes, axes, indices) are constants
            if t.name not in statistics and _dtype(t.data_type, t.name) not in INTEGER_DTYPES:
                self.env[t.name] = self.leaf(t.name, tuple(t.dims), "param", _dtype(t.data_type, t.name))
        for info in self.graph.input:
            if info.name in self.env or info.name in self.consts:
                continue
            dims, elem = self.shapes[info.name]
            if any(d <= 0 for d in dims):
                raise UnsupportedError(f"input {info.name!r} has dynamic dims {list(dims)}", self.where,
                                       "fix every dynamic dim (batch, sequence) in the model file")
            self.env[info.name] = self.leaf(info.name, dims, "input", _dtype(elem, info.name))
            if batch_dim is None and self.env[info.name].axes and self.env[info.name].axes[0] is not None:
                batch_dim = self.env[info.name].axes[0]
        for name in statistics:
            self.env[name] = self.constant(self.shapes[name][0])
        for node in self.graph.node:
            ins = [self.env[i] if i in self.env else self.constant(self.shapes.get(i, ((),))[0]) for i in node.input if i]
            try:
                outs = self.node(node, ins)
            except NoMapping as err:
                if not self.opaque_ok:
                    raise UnsupportedError(f"ONNX op {node.op_type} has no partopt mapping" + (f" ({err})" if str(err) else ""),
                                           self.place(node), "import with --opaque to keep it as an unsharded opaque op") from None
                out = node.output[0]
                shape = self.shape(out, node)
                outs = [self.opaque(ins, shape, _dtype(self.shapes[out][1], out), out, (), node.op_type, math.prod(shape))]
            for out, value in zip(node.output, outs):
                self.env[out] = value
        outputs = []
        for info in self.graph.output:
            value = self.env[info.name]
            if value.tensor is None:
                raise UnsupportedError(f"output {info.name!r} does not depend on the inputs", self.where)
            outputs.append(value.tensor)
        params = [t.dtype for t in self.draft.tensors.values() if t.role == "param"]
        dtype = max(set(params), key=params.count) if params else "fp32"
        return self.draft.finish(title, batch_dim, dtype, list(dict.fromkeys(outputs)))

    # ------------------------------------------------------------ nodes
    def attr(self, node: Any, key: str, default: Any = None) -> Any:
        for a in node.attribute:
            if a.name == key:
                return onnx.helper.get_attribute_value(a)
        return default

    def node(self, node: Any, ins: list[Value]) -> list[Value]:
        op, out = node.op_type, node.output[0]
        scope: Scope = ()
        if op == "Constant":
            self.consts[out] = numpy_helper.to_array(self.attr(node, "value"))
            return [self.constant(self.consts[out].shape)]
        if all(v.tensor is None for v in ins):
            return [self.constant(self.shapes.get(o, ((),))[0]) for o in node.output]
        shape = self.shape(out, node)
        dtype = _dtype(self.shapes[out][1], out)
        if op in ALIASES:
            return [ins[0]]
        if op in ELEMENTWISE:
            return [self.elementwise(ins, shape, dtype, out, scope, op.lower())]
        if op == "Transpose":
            perm = self.attr(node, "perm", list(range(len(ins[0].axes)))[::-1])
            return [Value(ins[0].tensor, tuple(ins[0].axes[p] for p in perm))]
        if op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
            return [self.reshape(ins[0], self.shape(node.input[0], node), shape, out, scope)]
        if op in REDUCES:
            return [self.reduce_node(node, ins, shape, dtype)]
        if op == "MatMul":
            return [self.matmul(node, ins, shape, dtype)]
        if op == "Gemm":
            return [self.gemm(node, ins, shape, dtype)]
        if op == "Conv":
            return [self.conv(node, ins, shape, dtype)]
        if op in ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"):
            return [self.pool(node, ins, shape, dtype)]
        if op == "BatchNormalization":
            return [self.norm(node, ins[:3], [0, *range(2, len(ins[0].axes))], "layernorm", out, dtype)]
        if op == "LayerNormalization":
            rank = len(ins[0].axes)
            axis = self.attr(node, "axis", -1) % rank
            return [self.norm(node, ins[:3], list(range(axis, rank)), "layernorm", out, dtype)]
        if op in ("Softmax", "LogSoftmax"):
            axis = self.attr(node, "axis", -1) % len(ins[0].axes)
            return [self.norm(node, ins[:1], [axis], "softmax", out, dtype)]
        if op == "Gather":
            return [self.gather(node, ins, shape, dtype)]
        if op == "Concat":
            return [self.concatenate(ins, self.attr(node, "axis") % len(shape), shape, dtype, out, scope)]
        raise NoMapping("")

    def reduce_node(self, node: Any, ins: list[Value], shape: Sequence[int], dtype: str) -> Value:
        rank = len(ins[0].axes)
        axes = self.attr(node, "axes")
        if axes is None and len(node.input) > 1 and node.input[1] in self.consts:
            axes = list(self.consts[node.input[1]])
        axes = list(range(rank)) if axes is None else [a % rank for a in axes]
        keepdims = bool(self.attr(node, "keepdims", 1))
        return self.reduce(ins[0], axes, dtype, node.output[0], (), REDUCES[node.op_type], keepdims)

    def matmul(self, node: Any, ins: list[Value], shape: Sequence[int], dtype: str) -> Value:
        """numpy matmul: [..., m, k] @ [..., k, n], batch axes broadcast from the right."""
        a, b = ins
        if len(a.axes) < 2 or len(b.axes) < 2:
            raise NoMapping("MatMul of a vector (reshape it to a matrix first)")
        batch = min(len(a.axes), len(b.axes)) - 2
        la, lb = len(a.axes), len(b.axes)
        pairs = [(la - 3 - k, lb - 3 - k) for k in range(batch)][::-1]
        lbatch = [i for i, j in pairs if a.axes[i] is not None and b.axes[j] is not None]
        rbatch = [j for i, j in pairs if a.axes[i] is not None and b.axes[j] is not None]
        return self.contract(a, b, [la - 1], [lb - 2], lbatch, rbatch, dtype, node.output[0], ())

    def gemm(self, node: Any, ins: list[Value], shape: Sequence[int], dtype: str) -> Value:
        """Gemm: op(A) · op(B) (+ C); alpha and beta scale inside the GEMM and add no work worth an op."""
        a, b = ins[0], ins[1]
        ka = 0 if self.attr(node, "transA", 0) else 1
        kb = 1 if self.attr(node, "transB", 0) else 0
        y = self.contract(a, b, [ka], [kb], [], [], dtype, f"{node.output[0]}.matmul", ())
        if len(ins) < 3:
            return y
        return self.elementwise([y, ins[2]], shape, dtype, node.output[0], (), "add")

    def conv(self, node: Any, ins: list[Value], shape: Sequence[int], dtype: str) -> Value:
        x, w = ins[0], ins[1]
        if len(x.axes) != 4 or self.attr(node, "group", 1) != 1:
            raise NoMapping("only 2-D convolutions without groups map")
        if x.tensor is None or w.tensor is None or not (self.held(x, 1) and self.held(w, 1)):
            raise NoMapping("a convolution of constants")
        x, w = self.pair(x, 1, w, 1, ())
        axes = (x.axes[0], w.axes[0], *self.axes(shape[2:]))
        if any(a is None for a in axes):
            raise NoMapping("a convolution whose batch, channels or output map has size 1")
        strides = self.attr(node, "strides", [1, 1])
        y = self.draft.op("conv2d", f"{node.output[0]}.conv" if len(ins) > 2 else node.output[0], [x.tensor, w.tensor],
                          list(axes), dtype, (), stride=stride_attr(strides))
        if len(ins) < 3:
            return Value(y, axes)
        return self.elementwise([Value(y, axes), Value(ins[2].tensor, (ins[2].axes[0], None, None))], shape, dtype,
                                node.output[0], (), "add")

    def pool(self, node: Any, ins: list[Value], shape: Sequence[int], dtype: str) -> Value:
        x = ins[0]
        fn = "max" if "Max" in node.op_type else "mean"
        if node.op_type.startswith("Global") or all(s == 1 for s in shape[2:]):
            return self.reduce(x, [2, 3], dtype, node.output[0], (), fn, keepdims=True)
        kernel = [int(k) for k in self.attr(node, "kernel_shape")]
        if len(x.axes) != 4 or x.axes[0] is None or x.axes[1] is None:
            raise NoMapping("only 2-D pooling of [N, C, H, W] maps")
        strides = self.attr(node, "strides", [1, 1])
        axes = (x.axes[0], x.axes[1], *self.axes(shape[2:]))
        y = self.draft.op("pool", node.output[0], [x.tensor], [a for a in axes if a is not None], dtype, (),
                          kernel=kernel, stride=stride_attr(strides), fn=fn)
        return Value(y, axes)

    def norm(self, node: Any, ins: list[Value], axes: Sequence[int], kind: str, name: str, dtype: str) -> Value:
        """softmax / layernorm (BatchNormalization: normalised over batch and spatial axes, scale per channel)."""
        x = ins[0]
        params = []
        for p in ins[1:]:  # scale and shift over x's trailing axes (LayerNorm) or its channel axis (BatchNorm)
            if p.tensor is None:
                continue
            channel = 1 if node.op_type == "BatchNormalization" else len(x.axes) - len(p.axes)
            for k in range(len(p.axes)):
                x, p = self.pair(x, channel + k, p, k, ())
            params.append(p.tensor)
        if x.tensor is None:
            raise NoMapping("a normalisation of a constant")
        dims = [x.axes[a] for a in axes if x.axes[a] is not None]
        y = self.draft.op(kind, name, [x.tensor, *params], self.draft.dims_of(x.tensor), dtype, (), axes=dims)
        return Value(y, x.axes)

    def gather(self, node: Any, ins: list[Value], shape: Sequence[int], dtype: str) -> Value:
        table, ids = ins
        axis = self.attr(node, "axis", 0) % len(table.axes)
        rank = len(shape)
        rows = [k for k in range(rank) if not axis <= k < axis + len(ids.axes)]
        if axis != 0:
            raise NoMapping("only Gather along axis 0 (an embedding lookup) maps")
        return self.lookup(table, axis, ids, ids.axes, rows, rank, dtype, node.output[0], ())
