"""`intra.build` prices its edges by memoised tables (`sharding.PairPrices`, `intra._use_tables`): the
cost graph must be the one a slow pair-by-pair pricing gives, to the bit.

The reference below is the obvious loop: for every tensor use and gradient flow, every pair of its
ends' strategies is priced on its own by the scalar functions that `decode` uses to explain a plan
(`intra._use_collectives`, `gradients.collectives`, `sharding.reshard_copy_bytes`), with the
resharding memo switched off. Node rows are compared with a build under the same switch.
"""

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from partopt import gradients, intra, sharding
from partopt.cluster import preset
from partopt.io import read_graph
from partopt.sharding import (
    P, R, Shard, as_gradient_target, collectives_time, gradient_placement, local_bytes, param_eager_collectives,
    reshard_collectives, reshard_copy_bytes, reshard_time, tensor_placements,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def unmemoised(monkeypatch):
    """Resharding priced afresh on every call, and no use tables kept from earlier builds."""
    monkeypatch.setattr(sharding, "_reshard_steps", sharding._reshard_steps.__wrapped__)
    monkeypatch.setattr(sharding, "_PAIR_PRICES", {})
    monkeypatch.setattr(intra, "_TABLES", {})


def _oriented(u: int, v: int, table: np.ndarray) -> tuple[tuple[int, int], np.ndarray]:
    return ((u, v), table) if u < v else ((v, u), table.T)


def reference(model: intra.StageModel) -> tuple[dict, dict]:
    """(edge cost tables, edge transient tables by (pool, owner)) of `model`, pair by pair."""
    g, mesh, options = model.graph, model.mesh, model.strategies
    edges: dict = defaultdict(float)
    transients: dict = defaultdict(lambda: defaultdict(float))
    for use in model.uses:
        rerun = intra._reruns(use, model.ops, model.recompute)
        nbytes = g.nbytes(use.tensor)
        shape = (len(options[use.src]), len(options[use.dst]))
        cost, copy, prefetch = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        for a, s in enumerate(options[use.src]):
            for b, d in enumerate(options[use.dst]):
                c = intra._use_collectives(g, use, s, d, mesh)
                again = c.recomputed(use.param) if rerun else []
                cost[a, b] = (collectives_time(c.per_microbatch + again, mesh, use.calls)
                              + collectives_time(c.per_iteration, mesh, calls=0) / model.microbatches)
                required = d.inputs[use.slot]
                if use.param:  # the gathered weight; in the backward beside it the gradient until its reduce-scatter
                    prefetch[a, b] = reshard_copy_bytes(s.placement, required, nbytes, mesh)
                    grad = gradient_placement(required, d.axes)
                    eager = intra._is_float(g, use.tensor) and param_eager_collectives(grad, s, nbytes, mesh)
                    copy[a, b] = prefetch[a, b] + (local_bytes(nbytes, grad, mesh) if eager else 0.0)
                    continue
                forward = reshard_copy_bytes(s.output, required, nbytes, mesh)
                backward = 0.0
                if intra._is_float(g, use.tensor) and use.gradient:
                    backward = reshard_copy_bytes(gradient_placement(required, d.axes),
                                                  as_gradient_target(s.output), nbytes, mesh)
                copy[a, b] = max(forward, backward)
        key, table = _oriented(use.src, use.dst, cost)
        edges[key] = edges[key] + table
        for pool, table in ((intra.BUFFERS, copy), (intra.PREFETCH, prefetch)):
            if table.any():
                key, table = _oriented(use.src, use.dst, table)
                transients[key][(pool, use.dst)] = transients[key][(pool, use.dst)] + table
    for flow in model.flows:
        cost = np.array([[collectives_time(gradients.collectives(g, flow, a, b, mesh), mesh)
                          for b in options[flow.dst]] for a in options[flow.src]])
        key, table = _oriented(flow.src, flow.dst, cost)
        edges[key] = edges[key] + table
    return edges, transients


NODE = preset("p3.16xlarge", 2)


def _layer(path: str, microbatch: int, layers: tuple[int, ...]):
    graph = intra.with_batch(read_graph(ROOT / "instances" / path), microbatch)
    return graph, [op for op in graph.order if op.layer in layers]


CASES = {  # (instance, microbatch, layers), submesh, logical shape, build options
    "gpt block on one node": (("gpt-350m.json", 8, (3,)), (1, 8), (2, 4), {}),
    "gpt block, 2 nodes, selective recompute, 4 microbatches": (
        ("gpt-350m.json", 4, (3,)), (2, 8), (2, 8), dict(recompute="selective", microbatches=4, inflight=2)),
    "same gpt block, full recompute, no ZeRO": (
        ("gpt-350m.json", 4, (3,)), (2, 8), (2, 8), dict(recompute="full", microbatches=4, allow_zero=False)),
    "two gpt blocks, data parallel": (("gpt-350m.json", 8, (3, 4)), (1, 8), (4, 2), dict(data_parallel=True)),
    "moe block, full recompute": (("moe-380m.json", 8, (1, 2)), (1, 4), (2, 2), dict(recompute="full", microbatches=2)),
    "wide-resnet block": (("wresnet-250m.json", 8, (3,)), (1, 8), (2, 4), dict(microbatches=8, inflight=4)),
}


@pytest.mark.parametrize("case", CASES)
def test_build_equals_pair_by_pair_pricing(case, monkeypatch):
    (path, microbatch, layers), submesh, shape, options = CASES[case]
    graph, ops = _layer(path, microbatch, layers)
    mesh = NODE.logical_mesh(submesh, shape)
    model = intra.build(graph, mesh, ops, **options)
    again = intra.build(graph, mesh, ops, **options)  # from the kept tables
    with monkeypatch.context() as patch:
        patch.setattr(sharding, "_reshard_steps", sharding._reshard_steps.__wrapped__)
        patch.setattr(sharding, "_PAIR_PRICES", {})
        patch.setattr(intra, "_TABLES", {})
        fresh = intra.build(graph, mesh, ops, **options)
        edges, transients = reference(model)
    assert model.uses
    for built in (model, again):
        costs = built.costs
        assert costs.names == fresh.costs.names
        assert all(np.array_equal(a, b) for a, b in zip(costs.costs, fresh.costs.costs))
        assert all(np.array_equal(a, b) for a, b in zip(costs.memory, fresh.costs.memory))
        assert costs.node_transients.keys() == fresh.costs.node_transients.keys()
        for n, tables in costs.node_transients.items():
            assert {k: list(t) for k, t in tables.items()} == {k: list(t) for k, t in fresh.costs.node_transients[n].items()}
        assert costs.edges.keys() == edges.keys()
        for key, table in edges.items():
            assert np.array_equal(costs.edges[key], table), (case, costs.names[key[0]], costs.names[key[1]])
        assert costs.edge_transients.keys() == transients.keys()
        for key, tables in transients.items():
            assert costs.edge_transients[key].keys() == tables.keys()
            for group, table in tables.items():
                assert np.array_equal(costs.edge_transients[key][group], table), (case, key, group)


def test_step_tables_sum_to_the_resharding_time_of_every_pair_exactly(unmemoised):
    """On a 2 × 8 mesh across two nodes (the two orders of a two-axis reshard differ), every pair of
    the placements of an [a, b] tensor with Partial: rows summed in order give `reshard_time`. The tables
    at other sizes come from the first's layout (`PairPrices._layout`): at a few bytes, where latency rules
    and the cheaper order may be the other one, they are still the pair-by-pair prices."""
    graph, _ = _layer("gpt-350m.json", 8, (3,))
    mesh = NODE.logical_mesh((2, 8), (2, 8))
    tensor = next(t for t, x in graph.tensors.items() if len(x.dims) == 2 and x.role == "param")
    placements = tensor_placements(graph, tensor, mesh, partial=True)
    assert (P, P) in placements and (Shard(graph.tensors[tensor].dims[0]), R) in placements
    prices = sharding.PairPrices.on(mesh)
    for nbytes in (graph.nbytes(tensor), graph.nbytes(tensor) / 3, 96.0):
        rows = prices.reshard_seconds(placements, placements, nbytes)
        assert rows.shape == (2, len(placements), len(placements))
        copies = prices.copy_table(placements, placements, nbytes)
        for a, src in enumerate(placements):
            for b, dst in enumerate(placements):
                assert rows[0, a, b] + rows[1, a, b] == reshard_time(src, dst, nbytes, mesh)
                assert copies[a, b] == reshard_copy_bytes(src, dst, nbytes, mesh)
                assert prices.reshard(src, dst, nbytes) == tuple(reshard_collectives(src, dst, nbytes, mesh))
    assert len(prices._layouts) == 1


def test_pair_table_prices_each_distinct_key_pair_once():
    calls = []

    def price(s, d):
        calls.append((s, d))
        return 10 * s + d

    table = sharding.pair_table(price, [1, 2, 1, 3], [5, 5, 6], src_key=lambda s: s % 2)
    # keys: rows 1, 0, 1, 1 (first seen: 1 then 2); columns 5, 5, 6 — four distinct pairs
    assert sorted(calls) == [(1, 5), (1, 6), (2, 5), (2, 6)]
    assert table.tolist() == [[15, 15, 16], [25, 25, 26], [15, 15, 16], [15, 15, 16]]
