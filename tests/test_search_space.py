"""The plan says where the search's space is narrower than every plan (issue 16: restrictions that
are not exact pruning are recorded in `solver.search` and printed by `partopt solve`)."""

from test_intra import mlp

from partopt import optimize
from partopt.bench import alpa
from partopt.options import Options, restrictions


def test_auto_microbatches_of_a_huge_batch_are_described_without_listing_its_divisors():
    # listing the divisors of 3 · 2^61 one by one never ended, whatever --deadline said
    found = restrictions(Options(), batch=3 * 2**61, layers=4, dp_layers=4, family="alpa")
    assert any(f"the 62 powers of two dividing the batch of {3 * 2**61} (not its other divisors)" in r for r in found)
    assert not any("microbatch" in r for r in restrictions(Options(), batch=2**62, layers=4, dp_layers=4, family="alpa"))
    # a prime up to COUNTED_BATCH still has its divisors counted (in pairs, up to its square root)
    assert any("(of its 2 divisors)" in r for r in restrictions(Options(), 1099511627689, 4, 4, family="alpa"))


def test_auto_microbatches_name_the_divisors_left_out():
    # 12 = 2² · 3 has six divisors (1, 2, 3, 4, 6, 12), of which 1, 2 and 4 are powers of two
    found = restrictions(Options(), batch=12, layers=4, dp_layers=4, family="alpa")
    assert any("the 3 powers of two dividing the batch of 12 (of its 6 divisors)" in r for r in found)
    # 16 has only powers of two as divisors: nothing left out
    assert not any("microbatch" in r for r in restrictions(Options(), batch=16, layers=4, dp_layers=4, family="alpa"))
    assert not any("microbatch" in r
                   for r in restrictions(Options(microbatches=3), batch=12, layers=4, dp_layers=4, family="alpa"))


def test_grouped_layers_and_forced_choices_are_recorded():
    found = restrictions(Options(layers=4), batch=16, layers=8, dp_layers=4, family="alpa")
    assert "stages cut between 4 groups of the 8 layers (--layers 4)" in found
    assert not any("groups" in r for r in restrictions(Options(), batch=16, layers=8, dp_layers=8, family="alpa"))
    assert any("recomputation" in r for r in found)  # auto: one mode per stage
    assert not any("recomputation" in r for r in restrictions(Options(recompute="none"), 16, 8, 8, family="alpa"))
    assert not any("logical meshes" in r for r in restrictions(Options(logical_shapes="all"), 16, 8, 8, family="alpa"))


def test_the_auto_submesh_family_says_when_it_narrows_the_search():
    alpa_family = restrictions(Options(), 16, 8, 8, family="alpa")
    assert "submeshes: whole nodes and powers of two within a node" in alpa_family
    narrowed = [r for r in restrictions(Options(), 16, 8, 8, family="power_of_two") if r.startswith("submeshes")]
    assert narrowed and "--submeshes alpa" in narrowed[0]
    asked = [r for r in restrictions(Options(submesh_family="power_of_two"), 16, 8, 8, family="power_of_two")
             if r.startswith("submeshes")]
    assert asked == ["submeshes: powers of two of nodes and of devices within a node"]


def test_a_plan_carries_its_search_space():
    graph = mlp(8, 1024, 256)
    plan = optimize(graph, alpa.cluster_for(4), options=Options(layers=4, workers=1))
    assert plan.solver["search"] == restrictions(Options(layers=4), 1024, 8, 4, family="alpa")
    assert "stages cut between 4 groups of the 8 layers (--layers 4)" in plan.solver["search"]
