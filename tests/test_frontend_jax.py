"""The JAX frontend: imported graphs against the framework's own counts and partopt's own generator."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from click.testing import CliRunner

from partopt import io
from partopt.cli import main
from partopt.cluster import preset
from partopt.costmodel import training_flops
from partopt.errors import PartoptError
from partopt.frontends.jax import from_function
from partopt.inter import optimize
from partopt.models import gpt
from partopt.models.flops import flop_split
from partopt.ops import Behaviour

sys.path.insert(0, str(Path(__file__).parent))
import jax_models as jm  # noqa: E402

CFG = jm.CONFIG
MODEL = str(Path(__file__).parent / "jax_models.py")
S = jax.ShapeDtypeStruct


@pytest.fixture(scope="module")
def imported():
    return from_function(jm.gpt_loss, *jm.gpt_shapes(**CFG))


def test_parameters_are_the_pytree_leaves(imported):
    params, _ = jm.gpt_shapes(**CFG)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    names = {"params/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in leaves}
    assert {t.name for t in imported.params} == names
    assert "params/blocks/1/mlp/w1" in names
    assert imported.num_params == sum(leaf.size for _, leaf in leaves)
    h, l, v, s = CFG["hidden"], CFG["layers"], CFG["vocab"], CFG["seq"]
    assert imported.num_params == 12 * l * h * h + 13 * l * h + (v + s) * h + 2 * h  # GPT's closed form


def test_dims_follow_the_data_not_the_sizes():
    """w1 is [64, 64]: its two axes are two dims, tied to x's features and to w2's rows by the equations."""
    def mlp(p, x):
        return jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]).sum()

    g = from_function(mlp, {"w1": S((64, 64), jnp.float32), "w2": S((64, 64), jnp.float32)}, S((8, 64), jnp.float32))
    w1, w2, x = g.tensors["params/w1"].dims, g.tensors["params/w2"].dims, g.tensors["batch"].dims
    assert w1[0] != w1[1] and w2[0] != w2[1]
    assert x[1] == w1[0] and w1[1] == w2[0]
    assert g.batch_dim == x[0]


def test_attention_names_key_positions_apart(imported):
    scores = [op for op in imported.ops if op.kind == "softmax"]
    assert len(scores) == CFG["layers"]
    dims = imported.tensors[scores[0].output].dims
    seq = [d for d in dims if imported.dims[d] == CFG["seq"]]
    assert len(seq) == 2 and seq[0] != seq[1]  # query and key positions
    assert list(scores[0].attrs["axes"]) == [seq[1]]  # normalised over the keys


def test_imported_gpt_has_the_generators_ops(imported):
    ref = gpt(**CFG, dtype="fp32")
    kinds, ref_kinds = Counter(op.kind for op in imported.ops), Counter(op.kind for op in ref.ops)
    for kind in ("einsum", "layernorm", "softmax", "embedding", "cross_entropy", "elementwise"):
        assert kinds[kind] == ref_kinds[kind], kind
    assert kinds["reshape"] == 2 * CFG["layers"]  # keys and values renamed to key positions (the generator: 1)
    assert imported.layers == ref.layers == list(range(CFG["layers"]))
    assert flop_split(imported) == flop_split(ref)


def test_flops_match_xla():
    """Forward FLOPs within 1 % of XLA's count of the jitted loss. XLA's count of value_and_grad adds its
    own backward of the cheap ops (softmax, norms, gelu: several FLOPs per element where partopt's model
    counts one), so partopt's training FLOPs are compared with 3 × XLA's forward (matmuls: two backward
    GEMMs each), and with XLA's value_and_grad more loosely."""
    args = jm.gpt_shapes(hidden=256, layers=1, heads=8, seq=128, vocab=1024, batch=2)
    imported = from_function(jm.gpt_loss, *args)
    forward = jax.jit(jm.gpt_loss).lower(*args).compile().cost_analysis()["flops"]
    assert imported.forward_flops == pytest.approx(forward, rel=0.01)
    split = flop_split(imported)
    train = training_flops(split.matmul, True) + training_flops(split.other, False)
    assert train == pytest.approx(3 * forward, rel=0.01)
    both = jax.jit(jax.value_and_grad(jm.gpt_loss)).lower(*args).compile().cost_analysis()["flops"]
    assert train == pytest.approx(both, rel=0.03)


def test_imported_gpt_plans_like_the_generators_gpt(imported):
    cluster = preset("p3.16xlarge").resized(1).narrowed(4)
    ours = optimize(imported, cluster, workers=1, microbatches=[2])
    theirs = optimize(gpt(**CFG, dtype="fp32"), cluster, workers=1, microbatches=[2])
    assert ours.iteration_time_s == pytest.approx(theirs.iteration_time_s, rel=0.02)
    assert [s.logical_mesh for s in ours.stages] == [s.logical_mesh for s in theirs.stages]


def test_scan_unrolls_into_one_layer_per_step(imported):
    g = from_function(jm.gpt_scan_loss, *jm.gpt_shapes(**CFG, stacked=True))
    assert g.num_params == imported.num_params
    assert g.layers == list(range(CFG["layers"]))
    steps = sorted(t.name for t in g.params if t.name.startswith("params/blocks/mlp/w1"))
    assert steps == [f"params/blocks/mlp/w1[{i}]" for i in range(CFG["layers"])]
    assert "params/blocks/mlp/w1" not in g.tensors
    assert flop_split(g) == flop_split(imported)


def test_layers_from_repeated_structure_without_scopes(imported):
    """The same GPT without named scopes: the repeated block is found, and cut where the scopes cut it."""
    def unscoped(params, batch):
        x = params["wte"][batch["tokens"]] + params["wpe"][None]
        for p in params["blocks"]:
            x = jm._block(x, p)
        logits = jm._layernorm(x, params["ln_f"]) @ params["wte"].T
        return -(jax.nn.log_softmax(logits) * jax.nn.one_hot(batch["labels"], logits.shape[-1])).sum(-1).mean()

    g = from_function(unscoped, *jm.gpt_shapes(**CFG))
    assert [op.layer for op in g.ops] == [op.layer for op in imported.ops]
    assert g.layers == list(range(CFG["layers"]))


def test_norms_inside_remat_and_custom_vjp():
    @jax.custom_vjp
    def clip(x):
        return jnp.clip(x, -1.0, 1.0)

    clip.defvjp(lambda x: (clip(x), x), lambda x, g: (g,))

    @jax.checkpoint
    def rms(x, scale):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale

    def f(p, x):
        return clip(rms(x, p["scale"]) @ p["w"]).sum()

    g = from_function(f, {"scale": S((32,), jnp.float32), "w": S((32, 16), jnp.float32)}, S((4, 32), jnp.float32))
    norms = [op for op in g.ops if op.kind == "rmsnorm"]
    assert len(norms) == 1 and norms[0].inputs[1] == "params/scale"
    assert any(op.kind == "elementwise" and op.attrs["fn"] == "max+min" for op in g.ops)  # the custom_vjp body


def _cumsum_loss(p, x):
    return jnp.cumsum(x @ p["w"], axis=1).sum()


def test_an_unmapped_primitive_names_itself_and_its_line():
    args = ({"w": S((8, 8), jnp.float32)}, S((4, 8), jnp.float32))
    with pytest.raises(PartoptError) as err:
        from_function(_cumsum_loss, *args)
    line = err.value.line()
    assert "cumsum" in line and "test_frontend_jax.py" in line and "--opaque" in line


def test_opaque_ops_are_priced_and_never_sharded():
    args = ({"w": S((8, 8), jnp.float32)}, S((4, 8), jnp.float32))
    g = from_function(_cumsum_loss, *args, opaque=True)
    op = next(op for op in g.ops if op.kind == "opaque")
    assert op.attrs["primitive"] == "cumsum" and op.attrs["flops"] > 0
    assert set(g.behaviours(op).values()) == {Behaviour.WINDOWED}
    assert io.graph_from_dict(json.loads(json.dumps(io.graph_to_dict(g)))).ops == g.ops  # the file format holds it


def test_cli_import_jax_writes_a_graph(tmp_path):
    out = tmp_path / "g.json"
    result = CliRunner().invoke(main, ["import", "jax", f"{MODEL}:make_model", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert io.read_graph(out).num_params == from_function(jm.gpt_loss, *jm.gpt_shapes(**CFG)).num_params
    bad = CliRunner().invoke(main, ["import", "jax", f"{MODEL}:no_such_function", "-o", str(out)])
    assert bad.exit_code == 2 and "no function 'no_such_function'" in bad.output and "Traceback" not in bad.output


def test_help_imports_no_framework():
    code = ("import sys; from click.testing import CliRunner; from partopt.cli import main; "
            "CliRunner().invoke(main, ['--help']); CliRunner().invoke(main, ['import', '--help']); "
            "print(sorted(m for m in ('jax', 'onnx') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
