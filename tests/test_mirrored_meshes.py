"""A logical mesh whose axes are another's swapped, on one link, is not searched (`inter._unmirrored`): every
sharding on it is one on its mirror at the same cost and memory, and its pipeline sends gather over a larger
second axis. Checked against the ILPs on both meshes, the sends, and the search with both meshes kept."""

import pytest

from partopt import inter, intra, optimize
from partopt.assemble import pipeline_of
from partopt.cluster import preset
from partopt.layering import build_layers
from partopt.models.gpt import gpt
from partopt.options import Options
from partopt.stages import End


@pytest.fixture(scope="module")
def model():
    return gpt(hidden=1024, layers=4, heads=16, seq=512, vocab=8192, batch=32)


def test_only_meshes_on_one_link_mirror():
    node = preset("dgx-a100", nodes=2).logical_mesh  # a switch: every group in a node sees the same link
    assert node((1, 8), (2, 4)).mirrors(node((1, 8), (4, 2)))
    assert node((1, 8), (8, 1)).mirrors(node((1, 8), (1, 8)))  # the size-1 axis costs nothing, whatever its link
    assert not node((1, 8), (2, 4)).mirrors(node((1, 8), (2, 4)))  # (2, 4) swapped is (4, 2), not itself
    assert node((1, 4), (2, 2)).mirrors(node((1, 4), (2, 2)))
    # across two nodes the first axis crosses them and the second does not: (8, 2) is not (2, 8) swapped
    assert not node((2, 8), (8, 2)).mirrors(node((2, 8), (2, 8)))
    assert not node((2, 8), (4, 4)).mirrors(node((2, 8), (4, 4)))
    # a p3 node's lanes (COSTMODEL §2): (2, 4)'s axes see 25 and 100 GB/s, (4, 2)'s 50 and 25; the whole node and
    # a quad's pairs (both 1-lane) still mirror
    p3 = preset("p3.16xlarge", nodes=2).logical_mesh
    assert not p3((1, 8), (2, 4)).mirrors(p3((1, 8), (4, 2)))
    assert p3((1, 8), (8, 1)).mirrors(p3((1, 8), (1, 8))) and p3((1, 4), (2, 2)).mirrors(p3((1, 4), (2, 2)))


def test_the_search_keeps_the_mirror_with_the_smaller_second_axis():
    cluster = preset("dgx-a100", nodes=2)
    assert inter._shapes(cluster, (1, 8), Options()) == [(8, 1), (4, 2)]
    assert inter._shapes(cluster, (1, 4), Options()) == [(4, 1), (2, 2)]
    assert inter._shapes(cluster, (2, 8), Options()) == [(16, 1), (8, 2), (4, 4), (2, 8)]  # none mirrors another
    assert inter._shapes(cluster, (1, 8), Options(logical_shapes=[(2, 4)])) == [(2, 4)]  # its mirror is not asked for


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_mirrored_meshes_price_a_layer_alike_with_memory_free_and_capped(model, recompute):
    cluster = preset("dgx-a100", nodes=1)
    g = intra.with_batch(model, 4)
    ops = [op for op in g.ops if op.name.startswith("l1.")]
    for shape in [(2, 4), (1, 8)]:
        pair = [cluster.logical_mesh((1, 8), shape), cluster.logical_mesh((1, 8), shape[::-1])]
        free = [intra.shard_stage(g, mesh, ops, microbatches=8, inflight=4, recompute=recompute) for mesh in pair]
        assert free[0].solution.objective == pytest.approx(free[1].solution.objective, rel=1e-12)
        assert free[0].memory_bytes == pytest.approx(free[1].memory_bytes, rel=1e-12)
        cap = (free[0].least_memory_bytes + free[0].memory_bytes) / 2  # the free optimum does not fit: the row binds
        capped = [intra.shard_stage(g, mesh, ops, microbatches=8, inflight=4, recompute=recompute, memory_budget=cap)
                  for mesh in pair]
        assert capped[0].solution.objective > free[0].solution.objective
        assert capped[0].solution.objective == pytest.approx(capped[1].solution.objective, rel=1e-9)


def test_the_kept_mirror_sends_no_slower(model):
    for name in ["p3.16xlarge", "dgx-a100"]:
        cluster = preset(name, nodes=2)
        pipe = pipeline_of(model, cluster, build_layers(model, 64), 8, False)
        middle = len(pipe.boundary) // 2
        for kept, dropped in [((4, 2), (2, 4)), ((8, 1), (1, 8)), ((4, 1), (1, 4)), ((2, 1), (1, 2))]:
            sub = (1, kept[0] * kept[1])
            fast, slow = (pipe.send_s(middle, middle, End(sub, shape)) for shape in (kept, dropped))
            assert fast < slow  # the dropped mesh gathers over its larger second axis


def test_the_search_finds_the_same_plan_with_mirrors_searched(model, monkeypatch):
    cluster = preset("p3.16xlarge", nodes=1)
    options = Options(workers=1, microbatches=8)
    pruned = optimize(model, cluster, options=options)
    monkeypatch.setattr(inter, "_unmirrored", lambda cluster, submesh, shapes: shapes)
    full = optimize(model, cluster, options=options)
    assert pruned.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert pruned.solver["ilps"] < full.solver["ilps"]
