"""At each microbatch count the search leaves out a logical mesh whose axes are another's swapped, each no faster
than that mesh's axis of its size, and whose pipeline sends are no faster (`inter._outpriced`): every sharding on
it is one on the other at no more cost and the same memory. On one link the two are mirrors, priced alike, and the
one that gathers its sends over the smaller second axis stays; on a p3 node (2, 4) outprices (4, 2) where its
sends are no slower. Checked against the ILPs on both meshes, the sends by hand, and the search with both kept."""

import math

import pytest

from partopt import costmodel, inter, intra, optimize
from partopt.assemble import pipeline_of
from partopt.cluster import preset
from partopt.layering import build_layers
from partopt.models.gpt import gpt
from partopt.options import Options
from partopt.stages import End


@pytest.fixture(scope="module")
def model():
    return gpt(hidden=1024, layers=4, heads=16, seq=512, vocab=8192, batch=32)


def _mirrors(mesh, other):
    """Whether two meshes outprice each other: one is the other with its axes swapped, each priced alike."""
    return mesh.outprices(other) and other.outprices(mesh)


def test_only_meshes_on_one_link_mirror():
    node = preset("dgx-a100", nodes=2).logical_mesh  # a switch: every group in a node sees the same link
    assert _mirrors(node((1, 8), (2, 4)), node((1, 8), (4, 2)))
    assert _mirrors(node((1, 8), (8, 1)), node((1, 8), (1, 8)))  # the size-1 axis costs nothing, whatever its link
    assert not _mirrors(node((1, 8), (2, 4)), node((1, 8), (2, 4)))  # (2, 4) swapped is (4, 2), not itself
    assert _mirrors(node((1, 4), (2, 2)), node((1, 4), (2, 2)))
    # across two nodes the first axis crosses them and the second does not: (8, 2) is not (2, 8) swapped
    assert not _mirrors(node((2, 8), (8, 2)), node((2, 8), (2, 8)))
    assert not _mirrors(node((2, 8), (4, 4)), node((2, 8), (4, 4)))
    # a p3 node's lanes (COSTMODEL §2): (2, 4)'s axes see 25 and 100 GB/s, (4, 2)'s 50 and 25; the whole node and
    # a quad's pairs (both 1-lane) still mirror
    p3 = preset("p3.16xlarge", nodes=2).logical_mesh
    assert not _mirrors(p3((1, 8), (2, 4)), p3((1, 8), (4, 2)))
    assert _mirrors(p3((1, 8), (8, 1)), p3((1, 8), (1, 8))) and _mirrors(p3((1, 4), (2, 2)), p3((1, 4), (2, 2)))


def _space(model, cluster, submesh):
    """The search space of `model` on `cluster` with one submesh and every logical shape of it."""
    meshes = {(submesh, s): cluster.logical_mesh(submesh, s) for s in inter._shapes(cluster, submesh, Options())}
    return inter._Space(model, cluster, Options(), build_layers(model, 64), math.inf, [submesh], meshes)


def test_the_search_keeps_the_mirror_with_the_smaller_second_axis(model):
    cluster = preset("dgx-a100", nodes=2)
    left_out = {sub: {shape for _, shape in inter._outpriced(_space(model, cluster, sub), 8)}
                for sub in [(1, 8), (1, 4), (2, 8)]}
    assert left_out == {(1, 8): {(2, 4), (1, 8)}, (1, 4): {(1, 4)}, (2, 8): set()}  # across nodes none mirrors
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


def test_the_search_finds_the_same_plan_with_mirrors_and_outpriced_meshes_searched(model, monkeypatch):
    cluster = preset("p3.16xlarge", nodes=1)
    options = Options(workers=1, microbatches=[1, 8])  # (4, 2) outpriced at one microbatch (32 MiB sends), not at 8
    pruned = optimize(model, cluster, options=options)
    monkeypatch.setattr(inter, "_outpriced", lambda space, count: frozenset())
    full = optimize(model, cluster, options=options)
    assert pruned.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert pruned.solver["ilps"] < full.solver["ilps"]


def test_outpricing_is_a_mirror_no_slower_on_each_axis():
    p3 = preset("p3.16xlarge", nodes=1).logical_mesh  # (2, 4): a pair at 25 GB/s, a quad at 100; (4, 2): 50, 25
    assert p3((1, 8), (2, 4)).outprices(p3((1, 8), (4, 2))) and not p3((1, 8), (4, 2)).outprices(p3((1, 8), (2, 4)))
    assert not p3((1, 8), (2, 4)).outprices(p3((1, 8), (2, 4)))  # (2, 4) swapped is (4, 2), not itself
    node = preset("dgx-a100", nodes=2).logical_mesh  # a switch: in a node outpricing goes both ways (mirrors)
    for sub, shape, both in [((1, 8), (2, 4), True), ((1, 8), (8, 1), True), ((2, 8), (8, 2), False),
                             ((2, 8), (4, 4), False)]:  # across nodes the first axis crosses, the second does not
        pair = node(sub, shape), node(sub, shape[::-1])
        assert pair[0].outprices(pair[1]) is both and pair[1].outprices(pair[0]) is both


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_an_outpriced_mesh_prices_no_layer_cheaper(model, recompute):
    cluster = preset("p3.16xlarge", nodes=1)
    g = intra.with_batch(model, 4)
    ops = [op for op in g.ops if op.name.startswith("l1.")]
    fast, slow = cluster.logical_mesh((1, 8), (2, 4)), cluster.logical_mesh((1, 8), (4, 2))
    free = [intra.shard_stage(g, mesh, ops, microbatches=8, inflight=4, recompute=recompute) for mesh in (fast, slow)]
    assert free[0].solution.objective <= free[1].solution.objective * (1 + 1e-9)
    assert free[0].least_memory_bytes == pytest.approx(free[1].least_memory_bytes, rel=1e-12)  # mirrored shardings
    cap = (free[1].least_memory_bytes + free[1].memory_bytes) / 2
    capped = [intra.shard_stage(g, mesh, ops, microbatches=8, inflight=4, recompute=recompute, memory_budget=cap)
              for mesh in (fast, slow)]
    assert capped[0].solution.objective <= capped[1].solution.objective * (1 + 1e-9)


def test_a_mesh_is_outpriced_at_the_counts_whose_sends_it_does_not_beat(model):
    """A received microbatch boundary of x bytes is all-gathered over the second axis: (2, 4) gathers 3/8 of it
    over a quad at 100 GB/s in 3 ring steps, (4, 2) 1/8 over a pair at 25 GB/s in 1 step (5 µs each, plus a 5 µs
    launch), equal at x = 8 MB. GPT h1024 × seq 512 sends 1 MiB per sequence: at one microbatch of 32 (32 MiB)
    (4, 2) is outpriced, at 32 microbatches of one (1 MiB) its fewer steps win and it stays."""
    cluster = preset("p3.16xlarge", nodes=1)
    layering = build_layers(model, 64)
    meshes = {((1, 8), s): cluster.logical_mesh((1, 8), s) for s in [(8, 1), (2, 4), (4, 2)]}
    space = inter._Space(model, cluster, Options(), layering, math.inf, [(1, 8)], meshes)
    for count, x in [(1, 2**25), (32, 2**20)]:
        pipe = pipeline_of(model, cluster, layering, count, False)
        assert pipe.in_s(1, End((1, 8), (2, 4))) == pytest.approx(3 * x / 8 / 100e9 + 5e-6 + 3 * 5e-6, rel=1e-12)
        assert pipe.in_s(1, End((1, 8), (4, 2))) == pytest.approx(x / 8 / 25e9 + 5e-6 + 5e-6, rel=1e-12)
    assert costmodel.COLLECTIVE_LAUNCH_S == 5e-6
    assert inter._outpriced(space, 1) == {((1, 8), (4, 2))}
    assert inter._outpriced(space, 32) == set()
