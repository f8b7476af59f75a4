"""Exact bounds that let the default search skip work: memory a microbatch count needs at least, stages
that cannot fit beside the rest of the model, and the memory-free optimum a recomputing mode cannot beat.

Each bound is checked by hand on a small case and against what the search or the ILP then does."""

import dataclasses
import itertools
import math
import random

import pytest

from partopt import costmodel, ilp, intra
from partopt.cluster import preset
from partopt.graph import Graph, Op, Tensor
from partopt.bounds import footprints, least_rerun_s, op_work, roofline_work
from partopt.inter import optimize
from partopt.layering import build_layers
from partopt.pricing import longest_stage, stage_lengths
from partopt.sharding import forward_share
from test_ilp import brute_force, random_graph
from test_intra import mlp, mlp_gelu
from test_recompute import best_forced, block_graph, tight_cluster

B, H = 8, 64
A = B * H * 4  # one fp32 activation [b, h]


def two_layers() -> Graph:
    """Layer 0: y0 = x · w0, g = gelu(y0); layer 1: y1 = g · w1 (fp32): `mlp_gelu` with fc1 in a layer of its own."""
    graph = mlp_gelu(B, H)
    ops = [*graph.ops[:2], dataclasses.replace(graph.ops[2], layer=1)]
    return Graph("two-layers", graph.dims, graph.tensors, ops, "b", "fp32")


def prints(graph, modes, device=None):
    device = device or preset("p3.16xlarge", 1).device
    return footprints(graph, build_layers(graph, 64).base, modes, device)


def least_bytes(layers) -> float:
    """Brute force: the least kept bytes plus largest working set over every choice of one mode per layer."""
    return min(sum(f.kept_bytes for f in choice) + max(f.working_bytes for f in choice)
               for choice in itertools.product(*layers))


def fits_exactly_from(layers, least: float) -> bool:
    """`least_rerun_s` finds a fitting choice with `least` bytes of room and none with a byte less."""
    return least_rerun_s(layers, least) < math.inf and least_rerun_s(layers, least - 1) == math.inf


def test_least_activation_bytes_by_hand():
    graph = two_layers()
    # none: layer 0 keeps y0 and g, layer 1 keeps y1; nothing is recomputed: 3A, no working set.
    assert least_bytes(prints(graph, ("none",))) == 3 * A and fits_exactly_from(prints(graph, ("none",)), 3 * A)
    # full: layer 0 keeps only g (read by layer 1) and reruns y0 and g (working set 2A); layer 1 keeps
    # y1 (read by nobody) and reruns it (A): kept A + A, largest working set 2A.
    assert least_bytes(prints(graph, ("full",))) == 4 * A and fits_exactly_from(prints(graph, ("full",)), 4 * A)
    # both: layer 0 under none (2A, 0) and layer 1 under none (A, 0) is the least: 3A
    both = prints(graph, ("none", "full"))
    assert least_bytes(both) == 3 * A and fits_exactly_from(both, 3 * A)


def chain(layers: int) -> Graph:
    """`layers` alike layers, each y_i = x_i · w_i then x_{i+1} = gelu(y_i) (fp32)."""
    dims = {"b": B, **{f"h{i}": H for i in range(layers + 1)}}
    tensors = {"x0": Tensor("x0", ("b", "h0"), "input")}
    ops = []
    for i in range(layers):
        tensors[f"w{i}"] = Tensor(f"w{i}", (f"h{i}", f"h{i + 1}"), "param")
        tensors[f"y{i}"] = Tensor(f"y{i}", ("b", f"h{i + 1}"))
        tensors[f"x{i + 1}"] = Tensor(f"x{i + 1}", ("b", f"h{i + 1}"))
        ops += [Op(f"fc{i}", "einsum", (f"x{i}", f"w{i}"), f"y{i}", i),
                Op(f"gelu{i}", "elementwise", (f"y{i}",), f"x{i + 1}", i, {"fn": "gelu"})]
    return Graph(f"chain{layers}", dims, tensors, ops, "b", "fp32")


def test_the_least_recomputation_that_memory_forces():
    """Three alike layers: none keeps 2A each (6A); full keeps A each and recomputes 2A at a time (5A)."""
    graph = chain(3)
    device = preset("p3.16xlarge", 1).device
    layers = prints(graph, ("none", "full"), device)
    e = sum(op_work(graph, op, device) * forward_share(graph, op, device) for op in graph.ops if op.layer == 0)
    assert layers[0][1].rerun_s == pytest.approx(e) and layers[0][0].rerun_s == 0
    assert least_rerun_s(layers, 6 * A) == 0  # no recomputation needed
    assert least_rerun_s(layers, 4.9 * A) == math.inf  # not even all full fits
    # room 5.5A: within the working set 2A the kept bytes may be 3.5A, so at least 2.5 layers recompute:
    # the Lagrangian bound at λ = e / A is 3 · 2e − 3.5e = 2.5e (all three recompute: 3e)
    assert least_rerun_s(layers, 5.5 * A) == pytest.approx(2.5 * e)
    assert least_bytes(layers) == 5 * A and fits_exactly_from(layers, 5 * A)


def test_no_plan_holds_less_than_the_least_activation_bytes():
    """The bound against real plans: the summed memory of a plan's devices covers state and the bound."""
    graph = block_graph(layers=2, batch=16)
    for memory_gib in (16.0, 0.007):
        cluster = tight_cluster(graph, memory_gib)
        plan = optimize(graph, cluster, microbatches=4)
        view = intra.with_batch(graph, graph.dims[graph.batch_dim] // plan.num_microbatches)
        base = [[view.op_index[op.name] for op in ops] for ops in build_layers(graph, 64).base]
        layers = footprints(view, base, ("none", "selective", "full"), cluster.device)
        held = sum(s.memory_bytes * len(s.devices) for s in plan.stages)
        state = sum(costmodel.param_memory(graph.numel(t.name), graph.dtype_of(t.name), graph.optimizer).total
                    for t in graph.params)
        assert held >= state + least_bytes(layers)
        assert least_rerun_s(layers, held - state) < math.inf  # the search's gate lets this count through


def test_the_iteration_bound_holds_on_real_plans_with_forced_recomputation():
    """B · (work + least rerun) / N never exceeds a plan's iteration time, memory binding or not."""
    graph = block_graph(layers=2, batch=16)
    for memory_gib in (16.0, 0.007):
        cluster = tight_cluster(graph, memory_gib)
        budget = costmodel.memory_budget(cluster.device)
        state = sum(costmodel.param_memory(graph.numel(t.name), graph.dtype_of(t.name), graph.optimizer).total
                    for t in graph.params)
        for count in (4, 8):
            plan = optimize(graph, cluster, microbatches=count)
            view = intra.with_batch(graph, graph.dims[graph.batch_dim] // count)
            base = [[view.op_index[op.name] for op in ops] for ops in build_layers(graph, 64).base]
            rerun = least_rerun_s(footprints(view, base, ("none", "selective", "full"), cluster.device),
                                  cluster.num_devices * budget - state)
            work = sum(roofline_work(view, base, cluster.device))
            assert count * (work + rerun) / cluster.num_devices <= plan.iteration_time_s * (1 + 1e-12)


def test_longest_stage_leaves_the_rest_of_the_model_room():
    costs, work = [3.0, 3.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]
    # no device spare: only the whole model, 12, which must be under the limit
    assert longest_stage(costs, 1, 13.0, work, spare=0) == 4
    assert longest_stage(costs, 1, 12.0, work, spare=0) == 0
    # two layers cost 6 < 7; the other two need 4 device-seconds on 2 spare devices: 2 < 7
    assert longest_stage(costs, 1, 7.0, work, spare=2) == 2
    heavy = [4.0, 4.0, 4.0, 4.0]
    # on one spare device the other two layers take 8 ≥ 7, one layer leaves 12: nothing fits
    assert longest_stage(costs, 1, 7.0, heavy, spare=1) == 0
    assert longest_stage(costs, 1, 7.0, heavy, spare=2) == 2  # 8 / 2 = 4 < 7
    # the count multiplies the rest's work: B = 2 makes it 2 · 8 / 2 = 8 ≥ 7
    assert longest_stage(costs, 2, 7.0, heavy, spare=2) == 0
    assert longest_stage(costs, 1, 7.0) == 2  # without work: today's rule


def test_stage_lengths_are_the_runs_that_cost_under_the_limit_and_leave_the_rest_room():
    """Every run of layers counted by brute force on small rows: a run is a length when it costs under the limit
    and the layers outside it run under the limit on the spare devices (none outside when none spare)."""
    rng = random.Random(20261202)
    for _ in range(300):
        n = rng.randint(1, 7)
        costs = [None if rng.random() < 0.15 else float(rng.randint(1, 6)) for _ in range(n)]
        work = [float(rng.randint(1, 6)) for _ in range(n)]
        limit, count, spare = float(rng.randint(1, 25)), rng.randint(1, 3), rng.randint(0, 3)
        expected = set()
        for first in range(n):
            for last in range(first, n):
                run = costs[first:last + 1]
                if None in run or sum(run) >= limit:
                    continue
                outside = sum(work) - sum(work[first:last + 1])
                fits = (first == 0 and last == n - 1) if spare == 0 else count * outside / spare < limit
                if fits:
                    expected.add(last - first + 1)
        assert stage_lengths(costs, count, limit, work, spare) == expected
        assert longest_stage(costs, count, limit, work, spare) == max(expected, default=0)
        free = {last - first + 1 for first in range(n) for last in range(first, n)
                if None not in costs[first:last + 1] and sum(costs[first:last + 1]) < limit}
        assert stage_lengths(costs, count, limit) == free  # without work, the cost alone


def test_the_free_bound_is_the_optimum_with_memory_ignored():
    rng = random.Random(20261201)
    checked = 0
    for _ in range(80):
        graph = random_graph(rng)
        budget = sum(float(m.max()) for m in graph.memory) * rng.uniform(0.3, 0.8)
        if brute_force(graph, budget) is None:
            continue
        solution = ilp.solve(graph, budget)
        free = brute_force(graph, None)
        assert solution.free_bound == pytest.approx(free, abs=1e-9)
        assert solution.free_bound <= solution.objective + 1e-9
        checked += 1
    assert checked > 20


def test_a_known_free_optimum_is_not_solved_again_and_the_answer_stays():
    """`ilp.solve(free=...)`, as a capped layer job gets its memory-free optimum from the layer priced at another
    cap: with a budget that optimum does not fit, the elimination does not run and the answer, its free bound and
    free assignment are those of the solve that finds them itself; with one it fits, the solve runs as before."""
    from unittest import mock

    rng = random.Random(20261205)
    skipped = kept = 0
    for _ in range(80):
        graph = random_graph(rng)
        loose = ilp.solve(graph, sum(float(m.max()) for m in graph.memory))  # every assignment fits
        assert loose.objective == pytest.approx(brute_force(graph, None), abs=1e-9)
        budget = sum(float(m.max()) for m in graph.memory) * rng.uniform(0.3, 1.0)
        if brute_force(graph, budget) is None:
            continue
        alone = ilp.solve(graph, budget)
        fits = graph.peak_memory(list(loose.free_choice)) <= budget
        with mock.patch.object(ilp, "_eliminate", wraps=ilp._eliminate) as eliminate:
            known = ilp.solve(graph, budget, free=(loose.free_choice, loose.free_bound))
        assert eliminate.called == fits
        assert known.objective == pytest.approx(brute_force(graph, budget), abs=1e-9)
        assert (known.choice, known.free_bound, known.free_choice) == (alone.choice, alone.free_bound, alone.free_choice)
        skipped += not fits
        kept += fits
    assert skipped > 20 and kept > 5


@pytest.mark.parametrize("memory_gib", [16.0, 0.007])
def test_auto_with_skipped_modes_still_equals_the_best_forced_mode_or_beats_it(memory_gib):
    """Modes priced only on meshes where they may win: the plan is still no worse than any forced mode."""
    graph = block_graph(layers=2, batch=16)
    cluster = tight_cluster(graph, memory_gib)
    forced = best_forced(graph, cluster, microbatches=[4, 8, 16])
    auto = optimize(graph, cluster, microbatches=[4, 8, 16])
    assert auto.iteration_time_s <= min(forced.values()) * (1 + 1e-9)


def test_longest_stage_under_overlap_counts_what_the_backward_cannot_hide():
    costs = [3.0, 3.0, 3.0, 3.0]
    assert longest_stage(costs, 4, 7.0) == 2  # 9 ≥ 7
    # with overlap at most one microbatch's time of sync hides: (1 − 1/4) · 9 = 6.75 < 7, 0.75 · 12 = 9 ≥ 7
    assert longest_stage(costs, 4, 7.0, overlap=True) == 3
    assert longest_stage(costs, 1, 0.5, overlap=True) == 4  # one microbatch: its backward may hide all the sync


@pytest.mark.parametrize("count", [1, 2, 8])
def test_an_overlapped_plan_pays_at_least_its_stages_share_the_bound_assumes(count):
    """The premise of the overlap bound on real plans: iteration ≥ (1 − 1/B)(B · t + sync before overlap)."""
    graph = block_graph(layers=2, batch=16)
    cluster = tight_cluster(graph, 16.0)
    for data_parallel in (True, False):
        plan = optimize(graph, cluster, microbatches=count, data_parallel_only=data_parallel)
        for stage in plan.stages:
            additive = count * stage.stage_time_s + stage.sync_time_s + stage.breakdown["overlapped_s"]
            assert plan.iteration_time_s >= (1 - 1 / count) * additive * (1 - 1e-12)
        if data_parallel:
            assert plan.stages[0].breakdown["overlapped_s"] > 0  # the case the bound is for


def test_counts_whose_bound_exceeds_the_plan_are_never_priced_when_memory_does_not_bind():
    """Memory-free plans are priced the least roofline bound first, so when every count fits, a count
    whose bound (count · work / devices, `roofline_work`) exceeds the plan's iteration is skipped unpriced;
    the plan is the best of the counts priced, each solved alone."""
    graph, cluster = mlp(8, 512, 1024), preset("p3.16xlarge", 1)
    plan = optimize(graph, cluster, workers=1)
    priced = plan.solver["microbatch_counts"]
    assert all(modes == ["none"] for modes in plan.solver["recompute_modes"].values())  # memory never bound
    base = build_layers(graph, 64).base
    bound = {}
    for count in (2**e for e in range(10)):
        view = intra.with_batch(graph, 512 // count)
        bound[count] = count * sum(roofline_work(view, [[view.op_index[op.name] for op in ops] for ops in base],
                                                 cluster.device)) / cluster.num_devices
    skipped = set(bound) - set(priced)
    assert skipped and all(bound[c] > plan.iteration_time_s for c in skipped)
    assert all(bound[c] <= plan.iteration_time_s for c in priced)
    alone = {c: optimize(graph, cluster, microbatches=c, workers=1).iteration_time_s for c in priced}
    assert plan.iteration_time_s == pytest.approx(min(alone.values()), rel=1e-12)


def test_a_layer_costs_no_less_with_more_microbatches():
    """`inter._floors`' claim, on real layer ILPs: at k times the microbatches a layer's optimum count · time + sync
    on a mesh is at least the optimum with memory ignored it had at the count it divides (per strategy the
    per-microbatch time falls at most k-fold and the per-iteration work stays)."""
    from partopt.inter import _floors
    from partopt.options import Options
    from partopt.pricing import Job, objectives, price
    graph, cluster = block_graph(layers=1, batch=64), preset("p3.16xlarge", 1)
    base = build_layers(graph, 64).base
    checked = 0
    for submesh in [(1, 2), (1, 8)]:
        for shape in cluster.logical_shapes(submesh):
            mesh = cluster.logical_mesh(submesh, shape)
            for ops in base:
                names = tuple(op.name for op in ops)
                row = {}
                for count in (1, 2, 8):
                    view = intra.with_batch(graph, 64 // count)
                    row[count] = price(view, Job(64 // count, count, names, mesh, "none", None), Options())
                for more in (2, 8):
                    floor = _floors([row[1]], 1, more, None, submesh[0] * submesh[1])[0]
                    assert objectives([row[more]], more)[0] >= floor * (1 - 1e-12)
                    checked += floor < objectives([row[more]], more)[0] * (1 - 1e-6)  # not a tie: latencies stay
    assert checked >= 6


def test_alike_layers_share_their_bounds_in_every_microbatch_view():
    """A GPT's blocks hash alike; its embedding and its head differ from them and from each other.
    The bounds computed once per kind equal the bounds computed layer by layer, in every microbatch view
    (the hash marks the batch dim, so one view's classes hold in all)."""
    from partopt.bounds import alike_layers
    from partopt.inter import _microbatch_views

    graph = block_graph(layers=5, batch=16)
    base = build_layers(graph, 64).base
    alike = alike_layers(graph, base)
    assert [ops[0].name for ops in base] == ["embed.tokens", *(f"l{i}.ln1" for i in range(5)), "head.ln"]
    assert alike == [0, 1, 1, 1, 1, 1, 6]
    device = preset("p3.16xlarge", 1).device
    modes = intra.RECOMPUTE_MODES
    for view in _microbatch_views(graph, [1, 2, 4, 16]).values():
        ops = [[view.op_index[op.name] for op in layer] for layer in base]
        assert roofline_work(view, ops, device, alike) == roofline_work(view, ops, device)
        assert footprints(view, ops, modes, device, alike) == footprints(view, ops, modes, device)


def reachable_by_brute_force(limit, objectives, resident, kept, sizes, devices, budget, count, overlap, stacks):
    """`options_in_reach` by enumeration over one base layer per DP layer: the option of every stage of every plan,
    each stage costing at most `limit` and fitting `budget` with its state and kept activations spread
    over its devices, min(stages to the end, count) microbatches in flight, with every cut and an option per stage;
    or, per interleaved shape in `stacks`, an option per stage holding its layers with its microbatches in flight."""
    paid = 1 - 1 / count if overlap else 1.0
    options = list(objectives)

    def fits(layers, option, inflight):
        n = sizes[option[0]]
        if any(objectives[option][b] is None for b in layers):
            return False
        cost = paid * sum(objectives[option][b] for b in layers)
        memory = sum(resident[b] + inflight * kept[option[2]][b] for b in layers) / n
        return cost <= limit and memory <= budget

    found = set()
    L = len(resident)
    for cut in cuts(L):
        S = len(cut)
        for picked in itertools.product(options, repeat=S):
            if sum(sizes[o[0]] for o in picked) <= devices and all(
                    fits(range(a, b + 1), o, min(S - i, count)) for i, ((a, b), o) in enumerate(zip(cut, picked))):
                found |= set(picked)
    for stages in stacks:
        for picked in itertools.product(options, repeat=len(stages)):
            if sum(sizes[o[0]] for o in picked) <= devices and all(
                    fits(held, o, held_inflight) for (held, held_inflight), o in zip(stages, picked)):
                found |= set(picked)
    return found


def cuts(layers):
    """Every cut of `layers` consecutive layers into stages: lists of (first, last)."""
    for k in range(layers):
        for ends in itertools.combinations(range(layers - 1), k):
            bounds_ = [-1, *ends, layers - 1]
            yield [(bounds_[i] + 1, bounds_[i + 1]) for i in range(len(bounds_) - 1)]


def test_options_in_reach_equal_brute_force_on_random_instances():
    """`options_in_reach` finds exactly the options of the stages of the plans that enumeration finds."""
    from partopt.bounds import options_in_reach

    rng = random.Random(20261204)
    submeshes, sizes = [(1, 1), (1, 2), (1, 4)], [1, 2, 4]
    outcomes = set()
    for _ in range(300):
        L, count, devices = rng.randint(1, 4), rng.choice([1, 2, 3, 8]), rng.choice([2, 4, 6])
        objectives = {}
        for s in range(3):
            for mode in rng.sample(["none", "full"], rng.randint(1, 2)):
                objectives[(submeshes[s], (1, sizes[s]), mode)] = [
                    None if rng.random() < 0.1 else rng.uniform(1, 10) / sizes[s] ** rng.uniform(0.3, 1) for _ in range(L)]
        resident = [rng.uniform(0, 4) for _ in range(L)]
        kept = {"none": [rng.uniform(0, 3) for _ in range(L)]}
        kept["full"] = [k * rng.uniform(0.1, 0.5) for k in kept["none"]]
        stacks = [[([0, 2], rng.uniform(1, 3)), ([1, 3], rng.uniform(1, 2))]] if L == 4 and rng.random() < 0.5 else []
        budget, limit, overlap = rng.uniform(1, 8), rng.uniform(2, 20), rng.random() < 0.5
        index = {key: (submeshes.index(key[0]), *key[1:]) for key in objectives}
        expected = reachable_by_brute_force(limit, {index[k]: v for k, v in objectives.items()}, resident, kept, sizes,
                                            devices, budget, count, overlap, stacks)
        args = (limit, objectives, resident, kept, [(b, b) for b in range(L)], submeshes, devices, budget, count, overlap)
        assert {index[key] for key in options_in_reach(*args, interleaved=stacks)} == expected
        outcomes.add(bool(expected))
    assert outcomes == {True, False}


def may_reach(*args, **kwargs) -> bool:
    """Whether any plan of the count can reach the limit: some option in reach."""
    from partopt.bounds import options_in_reach

    return bool(options_in_reach(*args, **kwargs))


def test_a_dp_layers_base_layers_add_up_in_reach():
    """Two base layers in one DP layer: a stage holds both, so their objectives and bytes add."""
    objectives = {((1, 1), (1, 1), "none"): [2.0, 3.0]}
    args = dict(resident=[1.0, 1.0], kept={"none": [0.5, 0.5]}, groups=[(0, 1)], submeshes=[(1, 1)], devices=1,
                count=2, overlap=False)
    assert may_reach(5.0, objectives, budget=2.0 + 2 * 1.0, **args)  # 5 s; 2 + min(1, 2) · 1 bytes: fits
    assert not may_reach(4.9, objectives, budget=10.0, **args)  # 5 s > 4.9 s
    assert not may_reach(5.0, objectives, budget=2.9, **args)  # 2 + 1 = 3 bytes > 2.9


def test_a_tied_embedding_is_held_once_by_a_stage_that_holds_any_of_its_readers():
    """A GPT's token embedding is read by its first and last base layers: `shared_state` lists it with them, and
    `resident_bytes` counts every other parameter in the one layer that reads it, so the two add up to the model's
    state, each parameter once. `options_in_reach` charges the embedding once to a stage holding either reader or both:
    on one device a stage of every layer fits a budget of the whole state, and of a byte less does not."""
    from partopt.bounds import resident_bytes, shared_state
    from partopt.shared import shared_params

    graph = block_graph(layers=3, batch=16)
    base = build_layers(graph, 64).base
    (tied, readers), = shared_params(graph, base).items()
    state = {t.name: costmodel.param_memory(graph.numel(t.name), graph.dtype_of(t.name), graph.optimizer).total
             for t in graph.params}
    resident = resident_bytes(graph, base)
    for b, ops in enumerate(base):
        assert resident[b] == pytest.approx(sum(state[t] for t in {t for op in ops for t in op.inputs} - {tied}
                                                if t in state))
    assert shared_state(graph, base) == [(state[tied], list(readers))] and len(readers) == 2
    total = sum(state.values())
    assert sum(resident) + state[tied] == pytest.approx(total)
    L = len(base)
    args = dict(objectives={((1, 1), (1, 1), "none"): [0.0] * L}, resident=resident, kept={"none": [0.0] * L},
                groups=[(b, b) for b in range(L)], submeshes=[(1, 1)], devices=1, count=1, overlap=False,
                shared=shared_state(graph, base))
    assert may_reach(1.0, budget=total, **args)
    assert not may_reach(1.0, budget=total * (1 - 1e-6), **args)
    # on two devices, two stages: the one holding the first layer and the one holding the last each hold it
    least = min(max(sum(resident[:c]), sum(resident[c:])) + state[tied] for c in range(1, L))
    assert least < total
    assert may_reach(1.0, budget=least, **dict(args, devices=2))
    assert not may_reach(1.0, budget=least * (1 - 1e-6), **dict(args, devices=2))


def test_a_layer_holds_at_least_its_share_of_the_state_and_kept_activations():
    """The premise of `options_in_reach` on real layer ILPs: on every mesh and mode, each layer's parameter bytes per
    device are at least its parameters' training state over the mesh's devices, and its kept activation bytes
    at least its footprint's kept bytes over them, with memory free and under a tight cap."""
    from partopt.bounds import resident_bytes
    from partopt.options import Options
    from partopt.pricing import Job, Pricer, Stats

    graph = block_graph(layers=2, batch=16)
    cluster, count = preset("p3.16xlarge", 1), 4
    view = intra.with_batch(graph, 16 // count)
    base = [[view.op_index[op.name] for op in ops] for ops in build_layers(graph, 64).base]
    state = resident_bytes(view, base)
    modes = intra.RECOMPUTE_MODES
    prints = footprints(view, base, modes, cluster.device)
    checked = 0
    with Pricer(graph, Options(workers=1)) as pricer:
        for sub, shape in [((1, 1), (1, 1)), ((1, 2), (1, 2)), ((1, 2), (2, 1)), ((1, 4), (2, 2)), ((1, 8), (1, 8))]:
            mesh, n = cluster.logical_mesh(sub, shape), sub[0] * sub[1]
            for m, mode in enumerate(modes):
                for b, ops in enumerate(base):
                    job = Job(16 // count, count, tuple(op.name for op in ops), mesh, mode, None)
                    free = pricer.one(job, Stats())
                    capped = pricer.one(Job(job.mb, count, job.ops, mesh, mode, free.memory_bytes(2) * 0.8, 2), Stats())
                    for cost in (free, capped):
                        if cost is None:  # cannot fit the cap
                            continue
                        assert cost.param_bytes >= state[b] / n * (1 - 1e-12)
                        assert cost.activation_bytes >= prints[b][m].kept_bytes / n * (1 - 1e-12)
                        checked += cost is capped
    assert checked > 5 and min(state) > 0  # some capped layers fitted, every layer holds parameters


def test_a_layer_under_a_mode_costs_at_least_its_roofline_work_and_rerun_over_its_devices():
    """The premise of `inter._reachable` on a mode not priced yet: on every mesh and mode, each layer's ILP optimum
    costs count · time + sync ≥ count · (roofline work + the mode's rerun forward) / devices, memory free."""
    from partopt.bounds import roofline_work
    from partopt.options import Options
    from partopt.pricing import Job, Pricer, Stats, objectives

    graph = block_graph(layers=2, batch=16)
    cluster, count = preset("p3.16xlarge", 1), 4
    view = intra.with_batch(graph, 16 // count)
    base = [[view.op_index[op.name] for op in ops] for ops in build_layers(graph, 64).base]
    work = roofline_work(view, base, cluster.device)
    modes = intra.RECOMPUTE_MODES
    prints = footprints(view, base, modes, cluster.device)
    margins = []
    with Pricer(graph, Options(workers=1)) as pricer:
        for sub, shape in [((1, 1), (1, 1)), ((1, 2), (2, 1)), ((1, 4), (2, 2)), ((1, 8), (1, 8))]:
            mesh, n = cluster.logical_mesh(sub, shape), sub[0] * sub[1]
            for m, mode in enumerate(modes):
                row = [pricer.one(Job(16 // count, count, tuple(op.name for op in ops), mesh, mode, None), Stats())
                       for ops in base]
                for cost, w, per_mode in zip(objectives(row, count), work, prints):
                    floor = count * (w + per_mode[m].rerun_s) / n
                    assert cost >= floor * (1 - 1e-12)
                    margins.append(cost / floor)
    assert max(p[2].rerun_s for p in prints) > 0 and min(margins) < 1.5  # full recomputation reruns; a floor is near
