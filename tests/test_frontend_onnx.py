"""The ONNX frontend on small models built in code with onnx.helper (no downloads)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from partopt import io
from partopt.cli import main
from partopt.errors import PartoptError
from partopt.frontends.onnx import from_model
from partopt.ops import Behaviour


def _init(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros(shape, np.float32), name)


def _model(nodes, inputs, outputs, inits, name="m") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph)
    onnx.checker.check_model(model)
    return model


def _cnn() -> onnx.ModelProto:
    """conv 3x3 (bias) -> batch norm -> relu -> max pool 2x2 -> conv 3x3 -> concat with the pool -> global
    average pool -> flatten -> gemm (bias) -> softmax, on x[4, 3, 16, 16]."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "g", "beta", "mu", "var"], ["n1"]),
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Concat", ["c2", "p1"], ["cat"], axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["gp"]),
        helper.make_node("Flatten", ["gp"], ["f"]),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["y"], axis=-1),
    ]
    inits = [_init("w1", 8, 3, 3, 3), _init("b1", 8), _init("g", 8), _init("beta", 8), _init("mu", 8), _init("var", 8),
             _init("w2", 16, 8, 3, 3), _init("wf", 10, 24), _init("bf", 10)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 16, 16])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 10])], inits, "cnn")


def test_cnn_params_flops_and_kinds():
    g = from_model(_cnn())
    # every initializer but the batch norm's running mean and variance (statistics, not trained)
    assert g.num_params == 8 * 3 * 9 + 8 + 8 + 8 + 16 * 8 * 9 + 10 * 24 + 10
    assert {t.name for t in g.params} == {"w1", "b1", "g", "beta", "w2", "wf", "bf"}
    ops = {op.output: op for op in g.ops}
    assert g.flops(ops["c1.conv"]) == 2 * 4 * 8 * 16 * 16 * 3 * 3 * 3  # 2·N·O·HO·WO·C·KH·KW
    assert g.flops(ops["c2"]) == 2 * 4 * 16 * 8 * 8 * 8 * 3 * 3
    assert g.flops(ops["logits.matmul"]) == 2 * 4 * 24 * 10
    x = g.tensors["x"].dims
    bn = ops["n1"]
    assert bn.kind == "layernorm" and bn.inputs[1:] == ("g", "beta")
    assert set(bn.attrs["axes"]) == {g.batch_dim, *g.tensors["c1"].dims[2:]}  # batch and spatial
    assert g.batch_dim == x[0]
    assert ops["p1"].kind == "pool" and list(ops["p1"].attrs["kernel"]) == [2, 2]
    assert ops["cat"].kind == "opaque" and g.dims[g.tensors["cat"].dims[1]] == 24
    assert g.tensors["cat"].dims[0] == g.batch_dim  # the concatenation keeps the batch dim it does not touch
    assert set(g.behaviours(ops["cat"]).values()) == {Behaviour.WINDOWED}
    assert ops["gp"].kind == "reduce" and ops["y"].kind == "softmax"
    assert g.tensors["y"].role == "output"


def test_transformer_pieces():
    """MatMul with batched operands, LayerNormalization, Gelu, Gather as an embedding."""
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["x"], axis=0),
        helper.make_node("LayerNormalization", ["x", "scale", "shift"], ["n"], axis=-1),
        helper.make_node("MatMul", ["n", "w"], ["h"]),
        helper.make_node("Gelu", ["h"], ["a"]),
        helper.make_node("MatMul", ["a", "a_t"], ["s"]),
    ]
    inits = [_init("emb", 100, 16), _init("scale", 16), _init("shift", 16), _init("w", 16, 32)]
    at = helper.make_node("Transpose", ["a"], ["a_t"], perm=[0, 2, 1])
    model = _model([*nodes[:4], at, nodes[4]], [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 8])],
                   [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 8, 8])], inits)
    g = from_model(model)
    ops = {op.output: op for op in g.ops}
    assert ops["x"].kind == "embedding" and ops["x"].inputs == ("ids", "emb")
    assert ops["n"].kind == "layernorm" and list(ops["n"].attrs["axes"]) == [g.tensors["n"].dims[-1]]
    assert g.flops(ops["h"]) == 2 * 2 * 8 * 16 * 32
    s = g.tensors["s"].dims
    assert len(set(s)) == 3 and g.dims[s[1]] == g.dims[s[2]] == 8  # a·aᵀ: two position dims, kept apart
    assert g.flops(ops["s"]) == 2 * 2 * 8 * 8 * 32


def test_unmapped_op_and_opaque(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("CumSum", ["h", "axis"], ["y"])]
    axis = numpy_helper.from_array(np.array(1, np.int64), "axis")
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [_init("w", 8, 8), axis])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(PartoptError) as err:
        from_model(path)
    assert "CumSum" in err.value.line() and "m.onnx" in err.value.line() and "--opaque" in err.value.line()
    g = from_model(path, opaque=True)
    op = next(op for op in g.ops if op.kind == "opaque")
    assert op.attrs["primitive"] == "CumSum" and op.attrs["flops"] == 4 * 8  # one per output element
    assert g.num_params == 64  # the integer axis is an input of CumSum, not a parameter


def test_dynamic_dims_and_bad_files(tmp_path):
    model = _model([helper.make_node("Relu", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])], [])
    with pytest.raises(PartoptError, match="dynamic dims"):
        from_model(model)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(PartoptError, match="junk.onnx"):
        from_model(junk)


def test_cli_import_onnx(tmp_path):
    path, out = tmp_path / "cnn.onnx", tmp_path / "cnn.json"
    onnx.save(_cnn(), path)
    result = CliRunner().invoke(main, ["import", "onnx", str(path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert io.read_graph(out).num_params == from_model(path).num_params
    missing = CliRunner().invoke(main, ["import", "onnx", str(tmp_path / "none.onnx"), "-o", str(out)])
    assert missing.exit_code == 2 and "none.onnx" in missing.output and "Traceback" not in missing.output
