"""The strategy-selection ILP on an abstract cost graph (DESIGN §5).

A `CostGraph` has nodes (one strategy each to choose, a cost and a memory per strategy) and
edges (a cost per pair of endpoint strategies), and transient buffers (bytes per strategy of one
node or per pair of two, each owned by a node and counted in a pool). `solve` picks one strategy
per node so that the total cost is least and the memory fits a budget: the summed node memory
plus, per pool, the largest sum of transients of one owner (`transient_peak`). Before solving it removes dominated
strategies and fixes nodes left with one choice — both exact: the optimum never changes.
Edge pairs are linearised over classes of equal rows/columns (Alpa's `e` variables, fewer).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from partopt import minsum, solvers
from partopt.errors import InfeasibleError, SolverError


Group = tuple[str, int]  # (pool, owner node) of a transient buffer


@dataclass
class CostGraph:
    """Nodes with per-strategy cost and memory; edges with a cost matrix over strategy pairs;
    transient bytes per (pool, owner) on one node (a vector) or on a pair of nodes (a matrix).

    `peak_shared_by` is n when the graph is one of n layers of a stage that holds one transient
    peak for all of them: a memory budget (the layer's share of the stage's) is charged 1/n of the
    peak. 1 for a layer alone."""

    names: list[str] = field(default_factory=list)
    costs: list[np.ndarray] = field(default_factory=list)
    memory: list[np.ndarray] = field(default_factory=list)
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    node_transients: dict[int, dict[Group, np.ndarray]] = field(default_factory=dict)
    edge_transients: dict[tuple[int, int], dict[Group, np.ndarray]] = field(default_factory=dict)
    peak_shared_by: int = 1

    def add_node(self, name: str, cost, memory=None) -> int:
        cost = np.asarray(cost, dtype=float)
        self.names.append(name)
        self.costs.append(cost)
        self.memory.append(np.zeros_like(cost) if memory is None else np.asarray(memory, dtype=float))
        return len(self.names) - 1

    def add_edge(self, u: int, v: int, cost) -> None:
        """Add (or accumulate onto) the edge u-v; stored with u < v."""
        cost = np.asarray(cost, dtype=float)
        if u > v:
            u, v, cost = v, u, cost.T
        if (u, v) in self.edges:
            self.edges[(u, v)] = self.edges[(u, v)] + cost
        else:
            self.edges[(u, v)] = cost

    def add_transient(self, pool: str, owner: int, u: int, table, v: int | None = None) -> None:
        """Add (or accumulate onto) transient bytes of `owner` in `pool`: per strategy of node u, or,
        with `v`, per pair of strategies of u and v (rows u). Buffers of one owner coexist (they add up)."""
        table = np.asarray(table, dtype=float)
        if v is None:
            store = self.node_transients.setdefault(u, {})
        else:
            if u > v:
                u, v, table = v, u, table.T
            store = self.edge_transients.setdefault((u, v), {})
            if (u, v) not in self.edges:  # the pair's strategies meet in the ILP through its edge
                self.edges[(u, v)] = np.zeros(table.shape)
        key = (pool, owner)
        store[key] = store[key] + table if key in store else table

    def transient_peak(self, choice: list[int]) -> float:
        """Bytes of transient buffers at their peak: per pool the largest owner's sum, summed over pools."""
        groups: dict[Group, float] = {}
        for n, tables in self.node_transients.items():
            for key, t in tables.items():
                groups[key] = groups.get(key, 0.0) + float(t[choice[n]])
        for (u, v), tables in self.edge_transients.items():
            for key, t in tables.items():
                groups[key] = groups.get(key, 0.0) + float(t[choice[u], choice[v]])
        return _pool_peak(groups)

    def least_transient_peak(self) -> float:
        """A lower bound of `transient_peak` over all assignments: each table at its least."""
        groups: dict[Group, float] = {}
        for tables in [*self.node_transients.values(), *self.edge_transients.values()]:
            for key, t in tables.items():
                groups[key] = groups.get(key, 0.0) + float(t.min())
        return _pool_peak(groups)

    def __len__(self) -> int:
        return len(self.names)

    def total(self, choice: list[int]) -> float:
        """Objective of a full assignment (one strategy index per node)."""
        value = sum(float(c[k]) for c, k in zip(self.costs, choice))
        return value + sum(float(m[choice[u], choice[v]]) for (u, v), m in self.edges.items())

    def peak_memory(self, choice: list[int]) -> float:
        """Memory of an assignment against a budget: node memory summed, plus its share of the transient peak."""
        return sum(float(m[k]) for m, k in zip(self.memory, choice)) + self.transient_peak(choice) / self.peak_shared_by


def _pool_peak(groups: dict[Group, float]) -> float:
    """Sum over pools of the largest owner's bytes (transients of different owners do not coexist)."""
    peaks: dict[str, float] = {}
    for (pool, _), size in groups.items():
        peaks[pool] = max(peaks.get(pool, 0.0), size)
    return sum(peaks.values())


@dataclass(frozen=True)
class Solution:
    choice: list[int]  # strategy index per node of the original graph
    objective: float
    bound: float | None  # best proven lower bound on the objective
    result: solvers.Result  # the backend's report (status, bound, gap, time)
    kept: int  # strategies left after reduction
    total: int  # strategies before reduction
    variables: int  # ILP variables
    free_bound: float | None = None  # a proven lower bound on the optimum with no memory row (None: not solved)
    free_choice: tuple[int, ...] | None = None  # the assignment of that optimum (None: not solved)

    @property
    def lower_bound(self) -> float | None:
        """A proven lower bound on the objective: the solver's bound, or the objective when proven optimal."""
        return self.bound if self.bound is not None else (self.objective if self.result.status == "optimal" else None)


# ---------------------------------------------------------------- exact reduction


def _incident(graph: CostGraph) -> list[list[tuple[tuple[int, int], bool]]]:
    incident: list[list[tuple[tuple[int, int], bool]]] = [[] for _ in graph.names]
    for key in graph.edges:
        u, v = key
        incident[u].append((key, True))
        incident[v].append((key, False))
    return incident


@dataclass(frozen=True)
class _Profile:
    """What dominance compares of a node's strategies, one row each: its cost, memory and own transients
    (`own` columns), then per table of an incident edge one column per strategy of the neighbour
    (`neighbours`: whose, block by block). Built once per `reduce`; a check selects the alive rows and columns."""

    table: np.ndarray
    own: int
    neighbours: tuple[int, ...]


def _profile(graph: CostGraph, n: int, incident: list[tuple[tuple[int, int], bool]]) -> _Profile:
    """Node n's `_Profile`, the columns in a fixed order: cost, memory, transients, then the incident tables."""
    columns = [graph.costs[n][:, None], graph.memory[n][:, None]]
    columns += [t[:, None] for t in graph.node_transients.get(n, {}).values()]
    own = len(columns)
    neighbours = []
    for (u, v), is_row in incident:
        for m in [graph.edges[(u, v)], *graph.edge_transients.get((u, v), {}).values()]:
            columns.append(m if is_row else m.T)
            neighbours.append(v if is_row else u)
    return _Profile(np.hstack(columns), own, tuple(neighbours))


def _dominated(f: np.ndarray) -> np.ndarray:
    """Per row of f, whether another row beats it: no worse in every column (within 1e-15) and strictly
    better in one, or equal and earlier. Strictness is compared only for the few pairs that need it."""
    leq = np.all(f[:, None, :] <= (f + 1e-15)[None, :, :], axis=2)  # leq[a, b]: a no worse than b
    np.fill_diagonal(leq, False)
    better, worse = np.nonzero(leq)
    dead = np.zeros(len(f), dtype=bool)
    earlier = better < worse
    dead[worse[earlier]] = True
    later, beaten = better[~earlier], worse[~earlier]
    if len(later):
        strictly = np.any(f[later] < f[beaten] - 1e-15, axis=1)
        dead[beaten[strictly]] = True
    return dead


def _prune(profile: _Profile, alive: list[np.ndarray], n: int, pruned: set[int]) -> bool:
    """Drop node n's strategies dominated in cost, memory and every edge; True when any went.
    `pruned`: the nodes that have lost strategies (the others' columns are all alive)."""
    idx = np.flatnonzero(alive[n])
    if len(idx) <= 1:
        return False
    f = profile.table if len(idx) == len(alive[n]) else profile.table[idx]
    if not pruned.isdisjoint(profile.neighbours):
        f = f[:, np.concatenate([np.ones(profile.own, dtype=bool), *(alive[v] for v in profile.neighbours)])]
    dead = _dominated(f)
    if not dead.any():
        return False
    alive[n][idx[dead]] = False
    pruned.add(n)
    return True


def reduce(graph: CostGraph) -> list[np.ndarray]:
    """Masks of the strategies that survive exact dominance pruning, run to a fixed point in node order.

    A node is checked again only when a neighbour lost a strategy since its last check: a check is a
    function of the node's and its neighbours' alive strategies, and finds nothing more in what it left."""
    alive = [np.ones(len(c), dtype=bool) for c in graph.costs]
    incident = _incident(graph)
    profiles = [_profile(graph, n, incident[n]) for n in range(len(graph))]
    dirty = [True] * len(graph)
    pruned: set[int] = set()
    while any(dirty):
        for n in range(len(graph)):
            if dirty[n]:
                dirty[n] = False
                if _prune(profiles[n], alive, n, pruned):
                    for v in profiles[n].neighbours:
                        dirty[v] = True
    return alive


@dataclass(frozen=True)
class Folded:
    """A cost graph with its leaves merged into their neighbours (`fold_leaves`), and the way back: per node of
    the folded graph, its node in the original and, per strategy, the original strategy (`rows`) and each merged
    leaf's (`leaves`: leaf -> strategy per folded strategy)."""

    graph: CostGraph
    nodes: list[int]
    rows: list[np.ndarray]
    leaves: list[dict[int, np.ndarray]]

    def unfold(self, choice: list[int], size: int) -> list[int]:
        """The original graph's choice (of `size` nodes) for a choice on the folded graph."""
        out = [0] * size
        for n, k, rows, leaves in zip(self.nodes, choice, self.rows, self.leaves):
            out[n] = int(rows[k])
            for w, picks in leaves.items():
                out[w] = int(picks[k])
        return out


def fold_leaves(graph: CostGraph, alive: list[np.ndarray]) -> Folded:
    """`graph` on its `alive` strategies with each leaf (a node whose one edge joins a node of several edges) merged
    into that neighbour: one strategy per pair of theirs, less the pairs that another with the same neighbour strategy
    dominates in cost (the leaf's own and the edge's), memory and every transient table (exact: the leaf touches
    nothing else, so swapping it to the dominating strategy changes no other term).

    With a memory row a leaf cannot be minimised out (`_eliminate`): its memory counts. Merged, its choices need no
    pair variables, and a neighbour strategy usually leaves it few: a GPT block's parameters are leaves of their
    matmuls, and the capped block ILP loses a third of its columns (docs/benchmarks.md)."""
    neighbours: dict[int, list[int]] = {n: [] for n in range(len(graph))}
    for u, v in graph.edges:
        neighbours[u].append(v)
        neighbours[v].append(u)
    keep = [np.flatnonzero(a) for a in alive]
    leaves_of: dict[int, list[int]] = {}
    for w, ns in neighbours.items():
        if len(ns) == 1 and len(neighbours[ns[0]]) > 1 and len(keep[w]) > 1 and len(keep[ns[0]]) > 1:
            leaves_of.setdefault(ns[0], []).append(w)
    merged = {w for ws in leaves_of.values() for w in ws}

    def oriented(table: np.ndarray, q: int, w: int) -> np.ndarray:  # rows q, columns w
        return table if q < w else table.T

    nodes = [n for n in range(len(graph)) if n not in merged]
    position = {n: i for i, n in enumerate(nodes)}
    rows, leaves = [keep[n] for n in nodes], [{} for _ in nodes]
    for q, ws in leaves_of.items():  # per strategy of q, the undominated strategies of each leaf, in turn
        i = position[q]
        for w in ws:
            key = (min(q, w), max(q, w))
            tables = [oriented(graph.edges[key], q, w)]
            tables += [oriented(t, q, w) for t in graph.edge_transients.get(key, {}).values()]
            own = [graph.costs[w], graph.memory[w], *graph.node_transients.get(w, {}).values()]
            picks = []
            for s in rows[i].tolist():
                f = np.stack([own[0][keep[w]] + tables[0][s, keep[w]], *(o[keep[w]] for o in own[1:]),
                              *(t[s, keep[w]] for t in tables[1:])], axis=1)
                picks.append(keep[w][~_dominated(f)])
            repeat = np.array([len(p) for p in picks])
            rows[i] = np.repeat(rows[i], repeat)
            leaves[i] = {m: np.repeat(p, repeat) for m, p in leaves[i].items()}
            leaves[i][w] = np.concatenate(picks)

    folded = CostGraph(peak_shared_by=graph.peak_shared_by)
    for i, n in enumerate(nodes):
        cost, memory = graph.costs[n][rows[i]], graph.memory[n][rows[i]]
        for w, picks in leaves[i].items():
            cost = cost + graph.costs[w][picks] + oriented(graph.edges[(min(n, w), max(n, w))], n, w)[rows[i], picks]
            memory = memory + graph.memory[w][picks]
        folded.add_node(graph.names[n], cost, memory)
        for key, t in graph.node_transients.get(n, {}).items():
            folded.add_transient(*key, i, t[rows[i]])
        for w, picks in leaves[i].items():  # a leaf's transients and its edge's become the merged node's
            for key, t in graph.node_transients.get(w, {}).items():
                folded.add_transient(*key, i, t[picks])
            for key, t in graph.edge_transients.get((min(n, w), max(n, w)), {}).items():
                folded.add_transient(*key, i, oriented(t, n, w)[rows[i], picks])
    for (u, v), m in graph.edges.items():
        if u not in merged and v not in merged:
            a, b = position[u], position[v]
            folded.add_edge(a, b, m[np.ix_(rows[a], rows[b])])
            for key, t in graph.edge_transients.get((u, v), {}).items():
                folded.add_transient(*key, a, t[np.ix_(rows[a], rows[b])], b)
    return Folded(folded, nodes, rows, leaves)


# ---------------------------------------------------------------- the 0-1 program

def _classes(stack: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Group equal rows (axis 0) or columns (axis 1) of a stack of matrices (tables × rows × columns),
    equal in every table: (class id per index, one representative each)."""
    lines = stack.transpose((1, 0, 2) if axis == 0 else (2, 0, 1)).reshape(stack.shape[1 + axis], -1)
    return _unique_lines(lines)


def _unique_lines(lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(lines, axis=0, return_index=True, return_inverse=True)`'s (inverse, index), without its structured
    copy: classes in ascending lexicographic order of their values, each represented by its first line (stable sort)."""
    order = np.lexsort(lines.T[::-1])
    ordered = lines[order]
    new = np.empty(len(lines), dtype=bool)
    new[:1] = True
    new[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    inverse = np.empty(len(lines), dtype=np.intp)
    inverse[order] = np.cumsum(new) - 1
    return inverse, order[new]


def _members(classes: np.ndarray, variables: np.ndarray, count: int) -> list[list[int]]:
    """Per class id (0 … count-1), the variables of its members in index order (`classes`: one id per variable)."""
    groups: list[list[int]] = [[] for _ in range(count)]
    for c, x in zip(classes.tolist(), variables.tolist()):
        groups[c].append(x)
    return groups


COST_RESOLUTION = 1e4  # the largest objective coefficient, after scaling


@dataclass
class _Terms:
    """One (pool, owner) group of transients in the model: bytes per 0-1 variable (one entry per
    variable: solvers refuse a row naming a variable twice), constant and upper bound."""

    coef: dict[int, float] = field(default_factory=dict)
    const: float = 0.0
    upper: float = 0.0

    def add(self, variable: int, value: float) -> None:
        self.coef[variable] = self.coef.get(variable, 0.0) + value


def build_model(graph: CostGraph, alive: list[np.ndarray], budget: float | None,
                choice: list[int] | None = None) -> tuple[solvers.Model, list[np.ndarray]]:
    """The ILP over surviving strategies; returns it and, per node, its variable per strategy (-1 if fixed).
    `choice` (a surviving strategy per node, fitting the budget): the model's `start`, every variable set.

    Nodes left with one strategy get no variables; their costs are constants the objective omits.
    With a budget, the memory row holds the node memory and, per pool of transients, a continuous
    peak variable (charged 1/`peak_shared_by`); a row per owner keeps the peak at or above that owner's transients (peak ≥
    transient_i: the max is linear, and exact, since the memory row pushes the peak down). A continuous
    peak leaves nothing to branch on; encoding it in binaries made HiGHS branch on them (docs/benchmarks.md).
    """
    model = solvers.Model()
    keep = [np.flatnonzero(a) for a in alive]
    var = [np.full(len(c), -1) for c in graph.costs]
    start = model.start
    for n, idx in enumerate(keep):
        if len(idx) > 1:
            var[n][idx] = made = model.add_vars(graph.costs[n][idx])
            if choice is not None:
                start.update(zip(made.tolist(), (idx == choice[n]).astype(float).tolist()))
            model.add_row(made.tolist(), [1.0] * len(idx), 1, 1)

    groups: dict[Group, _Terms] = {}

    def node_term(key: Group, n: int, values: np.ndarray) -> None:
        """Transient bytes per kept strategy of node n (values follow keep[n])."""
        terms = groups.setdefault(key, _Terms())
        terms.upper += float(values.max())
        if len(keep[n]) == 1:
            terms.const += float(values[0])
            return
        for k in np.flatnonzero(values):
            terms.add(int(var[n][keep[n][k]]), float(values[k]))

    if budget is not None:
        for n, tables in graph.node_transients.items():
            for key, t in tables.items():
                node_term(key, n, t[keep[n]])

    extra_node_cost = [np.zeros(len(c)) for c in graph.costs]
    for (u, v), m in graph.edges.items():
        tables = graph.edge_transients.get((u, v), {}) if budget is not None else {}
        keys = list(tables)
        stack = np.stack([m[np.ix_(keep[u], keep[v])]] + [t[np.ix_(keep[u], keep[v])] for t in tables.values()])
        if len(keep[u]) == 1 or len(keep[v]) == 1 or not stack.any():
            # the cost depends on one endpoint only: fold it into that node's costs
            if len(keep[u]) == 1:
                extra_node_cost[v][keep[v]] += stack[0][0]
                for key, t in zip(keys, stack[1:]):
                    node_term(key, v, t[0])
            elif len(keep[v]) == 1:
                extra_node_cost[u][keep[u]] += stack[0][:, 0]
                for key, t in zip(keys, stack[1:]):
                    node_term(key, u, t[:, 0])
            continue
        row_class, row_rep = _classes(stack, 0)
        col_class, col_rep = _classes(stack, 1)
        reduced = stack[:, row_rep][:, :, col_rep]
        if np.all(reduced == reduced[:, :, :1]):  # depends on u only
            extra_node_cost[u][keep[u]] += stack[0][:, 0]
            for key, t in zip(keys, stack[1:]):
                node_term(key, u, t[:, 0])
            continue
        if np.all(reduced == reduced[:, :1, :]):  # depends on v only
            extra_node_cost[v][keep[v]] += stack[0][0]
            for key, t in zip(keys, stack[1:]):
                node_term(key, v, t[0])
            continue
        pair = model.add_vars(reduced[0])
        if choice is not None:  # the pair of the chosen strategies' classes is 1
            chosen = np.zeros(pair.shape)
            chosen[row_class[np.searchsorted(keep[u], choice[u])], col_class[np.searchsorted(keep[v], choice[v])]] = 1.0
            start.update(zip(pair.ravel().tolist(), chosen.ravel().tolist()))
        for pairs, members in zip(pair.tolist(), _members(row_class, var[u][keep[u]], reduced.shape[1])):
            model.add_row(pairs + members, [1.0] * len(pairs) + [-1.0] * len(members), 0, 0)
        for pairs, members in zip(pair.T.tolist(), _members(col_class, var[v][keep[v]], reduced.shape[2])):
            model.add_row(pairs + members, [1.0] * len(pairs) + [-1.0] * len(members), 0, 0)
        for key, t in zip(keys, reduced[1:]):
            terms = groups.setdefault(key, _Terms())
            terms.upper += float(t.max())
            nonzero = np.flatnonzero(t)
            for i, value in zip(pair.ravel()[nonzero].tolist(), t.ravel()[nonzero].tolist()):
                terms.add(i, value)

    for n, idx in enumerate(keep):
        if len(idx) > 1:
            for i, extra in zip(var[n][idx].tolist(), extra_node_cost[n][idx].tolist()):
                model.objective[i] += extra
        else:  # a fixed node's cost and the edges folded into it: constants the objective leaves out
            model.offset += float(graph.costs[n][idx[0]] + extra_node_cost[n][idx[0]])

    if budget is not None:
        # the memory row is stated times `shared`, so that a peak (charged 1/shared) keeps coefficient 1
        # and every coefficient stays a whole number of bytes (CP-SAT takes integers only)
        shared = graph.peak_shared_by
        base = sum(float(graph.memory[n][idx[0]]) for n, idx in enumerate(keep) if len(idx) == 1)
        constant_peaks = 0.0
        index, coef = [], []
        for n, idx in enumerate(keep):
            if len(idx) > 1:
                memory = graph.memory[n][idx].astype(float)
                low = float(memory.min())  # subtract each node's least memory (exact)
                base += low
                above = memory > low
                index.extend(var[n][idx][above].tolist())
                coef.extend(((memory[above] - low) * shared).tolist())
        for pool in dict.fromkeys(p for p, _ in groups):
            members = [t for (p, _), t in groups.items() if p == pool]
            if not any(t.coef for t in members):
                constant_peaks += max(t.const for t in members)
                continue
            peak = model.add_continuous(max(t.upper for t in members))
            if choice is not None:  # the largest owner's transients under the start
                start[peak] = max(sum(c * start[i] for i, c in t.coef.items()) + t.const for t in members)
            for t in members:  # this owner's transients <= the pool's peak
                model.add_row(list(t.coef) + [peak], list(t.coef.values()) + [-1.0], float("-inf"), -t.const)
            index.append(peak)
            coef.append(1.0)
        if index:
            model.add_row(index, coef, float("-inf"), (budget - base) * shared - constant_peaks)
    # seconds are tiny (1e-6 … 1e-2): solvers' absolute tolerances would blur them, so the
    # objective is stated in units of COST_RESOLUTION of its largest coefficient
    objective = np.array(model.objective, dtype=float)
    largest = float(np.abs(objective).max()) if len(objective) else 0.0
    model.scale = COST_RESOLUTION / largest if largest > 0 else 1.0
    model.objective = (objective * model.scale).tolist()
    return model, var


def min_memory(graph: CostGraph) -> float:
    """A lower bound of the memory any assignment is charged: each node's least memory plus the share of
    the transient peak of every table at its least (exact without transients: a single knapsack)."""
    return sum(float(m.min()) for m in graph.memory) + graph.least_transient_peak() / graph.peak_shared_by


# ---------------------------------------------------------------- exact elimination (no memory row)

MAX_TABLE = 2_000_000  # entries of the (u, w, v) table a degree-2 elimination may build


@dataclass(frozen=True)
class _Step:
    node: int
    neighbours: tuple[int, ...]
    best: np.ndarray  # the node's best strategy for each choice of its neighbours


def _eliminate(graph: CostGraph, alive: list[np.ndarray]) -> tuple[CostGraph, list[int], list[_Step]]:
    """Variable elimination of nodes with at most two neighbours, exact for the cost alone.

    A leaf folds min over its strategies of (its cost + the edge) into its neighbour's costs; a
    node between two others becomes one edge between them. The memory row is not carried: the
    result is the optimum without a budget. Returns the remaining graph (strategies restricted to
    `alive`), its nodes' original indices, and the steps to recover the eliminated choices.
    """
    idx = [np.flatnonzero(a) for a in alive]
    cost = {n: graph.costs[n][idx[n]].astype(float) for n in range(len(graph))}
    edges = {(u, v): m[np.ix_(idx[u], idx[v])] for (u, v), m in graph.edges.items()}
    adj: dict[int, set[int]] = {n: set() for n in cost}
    for u, v in edges:
        adj[u].add(v)
        adj[v].add(u)

    def oriented(a: int, b: int) -> np.ndarray:  # rows a, columns b
        return edges[(a, b)] if a < b else edges[(b, a)].T

    steps: list[_Step] = []
    while True:
        size = {n: len(cost[n]) * math.prod(len(cost[m]) for m in adj[n]) for n in cost if len(adj[n]) <= 2}
        candidates = [n for n in size if len(adj[n]) < 2 or size[n] <= MAX_TABLE]
        if not candidates:
            break
        v = min(candidates, key=lambda n: (len(adj[n]), size[n], n))
        nbrs = tuple(sorted(adj[v]))
        if not nbrs:
            best = np.asarray(int(np.argmin(cost[v])))
        elif len(nbrs) == 1:
            (u,) = nbrs
            total = oriented(u, v) + cost[v][None, :]
            best = total.argmin(axis=1)
            cost[u] = cost[u] + total.min(axis=1)
        else:
            u, w = nbrs
            total = oriented(u, v)[:, None, :] + oriented(w, v)[None, :, :] + cost[v][None, None, :]
            best = total.argmin(axis=2)
            merged = total.min(axis=2)
            edges[(u, w)] = edges[(u, w)] + merged if (u, w) in edges else merged
            adj[u].add(w)
            adj[w].add(u)
        for m in nbrs:
            edges.pop((min(m, v), max(m, v)))
            adj[m].discard(v)
        del cost[v], adj[v]
        steps.append(_Step(v, nbrs, best))
    remaining = sorted(cost)
    position = {n: i for i, n in enumerate(remaining)}
    reduced = CostGraph()
    for n in remaining:
        reduced.add_node(graph.names[n], cost[n])
    for (u, v), m in edges.items():
        reduced.add_edge(position[u], position[v], m)
    return reduced, remaining, steps


def least_cost(graph: CostGraph) -> float | None:
    """The least total of any assignment, memory aside, by exact elimination (dominated strategies first); None when
    the elimination's tables would be too large (`minsum.solve`)."""
    alive = reduce(graph)
    reduced, remaining, steps = _eliminate(graph, alive)
    picked = minsum.solve(reduced.costs, reduced.edges)
    return None if picked is None else graph.total(_recover(graph, alive, remaining, picked, steps))


def _recover(graph: CostGraph, alive: list[np.ndarray], remaining: list[int], picked: list[int],
             steps: list[_Step]) -> list[int]:
    """Original strategy indices from the remaining nodes' picks and the elimination steps, in reverse."""
    local = dict(zip(remaining, picked))
    for step in reversed(steps):
        local[step.node] = int(step.best[tuple(local[m] for m in step.neighbours)])
    return [int(np.flatnonzero(alive[n])[local[n]]) for n in range(len(graph))]


def _run(model: solvers.Model, backend: str, time_limit_s: float, seed: int, budget: float | None,
         cutoff: float | None = None) -> solvers.Result:
    """The solver's answer (an error when it has none). With no memory row (`budget` None) the program is a
    pairwise min-sum, whose LP relaxation is often integral: it is tried first (`solvers.solve`). `cutoff`:
    see `solve`."""
    scaled = None if cutoff is None else (cutoff - model.offset) * model.scale
    result = solvers.solve(model, backend, time_limit_s, seed, relaxation_first=budget is None, cutoff=scaled)
    if result.values is None:
        if result.status == "infeasible":
            raise InfeasibleError(f"no strategy assignment fits the memory budget of {budget:.4g} bytes",
                                  "memory", "use more devices or a larger budget")
        if result.status == "cutoff":
            raise _cut_off(budget, cutoff)
        raise SolverError(f"{backend} found no solution within {time_limit_s:g} s",
                          "solver", "raise --time-limit or try another --solver")
    return result


def _cut_off(budget: float, cutoff: float) -> InfeasibleError:
    """What a capped program with a cutoff raises when nothing fits under it."""
    return InfeasibleError(f"no strategy assignment fits the memory budget of {budget:.4g} bytes at a cost under "
                           f"{cutoff:.6g} s", "memory", "use more devices or a larger budget")


def _picks(alive: list[np.ndarray], var: list[np.ndarray], values: list[int]) -> list[int]:
    """Strategy index within each node's alive set, read from the solver's 0-1 values."""
    picks = []
    for n, a in enumerate(alive):
        idx = np.flatnonzero(a)
        picks.append(0 if len(idx) == 1 else next(i for i, k in enumerate(idx) if values[var[n][k]]))
    return picks


def _chosen(alive: list[np.ndarray], var: list[np.ndarray], values: list[int]) -> list[int]:
    """Each node's strategy index in the graph, read from the solver's 0-1 values."""
    return [int(np.flatnonzero(a)[k]) for a, k in zip(alive, _picks(alive, var, values))]


def solve(graph: CostGraph, budget: float | None = None, backend: str = "highs",
          time_limit_s: float = solvers.TIME_LIMIT_S, seed: int = 0, reduce_first: bool = True,
          cutoff: float | None = None, free: tuple[tuple[int, ...], float] | None = None) -> Solution:
    """Choose one strategy per node: least total cost with summed memory ≤ budget.

    `cutoff` (with a budget): the caller has no use for an assignment costing that much or more (`total`);
    when the capped optimum does, InfeasibleError is raised as for a budget nothing fits, and the solver
    may prune all that (`solvers.solve`), which is much faster than proving the optimum; a program with transient
    buffers first asks its relaxation without them whether any assignment is under the cutoff (`_under_cutoff`).

    With `reduce_first`, dominated strategies go first, then the graph is solved by exact
    elimination without the memory row; when that optimum fits the budget it is the answer
    (the relaxation's optimum is feasible), otherwise the full program with the memory row runs, on the graph
    with its leaves merged into their neighbours (`fold_leaves`). `free`: that optimum's assignment and bound
    (`Solution.free_choice`, `free_bound`), found by a solve of a graph with these costs (memory aside: the layer
    priced at another cap); when that assignment does not fit the budget here, it is not solved again.
    """
    if budget is not None and min_memory(graph) > budget:
        raise InfeasibleError(
            f"needs at least {min_memory(graph):.4g} bytes per device, budget is {budget:.4g}",
            "memory", "use more devices, fewer microbatches in flight, or a larger budget")
    alive = reduce(graph) if reduce_first else [np.ones(len(c), dtype=bool) for c in graph.costs]
    total = sum(len(c) for c in graph.costs)
    kept = int(sum(a.sum() for a in alive))
    free_choice, free_bound = free if free is not None and reduce_first else (None, None)
    if reduce_first and (free_choice is None or budget is None or graph.peak_memory(list(free_choice)) <= budget):
        reduced, remaining, steps = _eliminate(graph, alive)
        began = time.perf_counter()
        picked = minsum.solve(reduced.costs, reduced.edges)  # the rest eliminated too, when its tables are small
        if picked is not None:
            model = solvers.Model()
            result = solvers.Result("optimal", [], 0.0, 0.0, time.perf_counter() - began, "elimination")
        else:
            every = [np.ones(len(c), dtype=bool) for c in reduced.costs]
            model, var = build_model(reduced, every, None, _cheapest(reduced, every))  # no memory row: any choice fits
            result = (_run(model, backend, time_limit_s, seed, None) if model.num_vars
                      else solvers.Result("optimal", [], 0.0, 0.0, 0.0, backend))
            picked = _picks(every, var, result.values)
        choice = _recover(graph, alive, remaining, picked, steps)
        relaxed = _solution(graph, choice, result, model, kept, total)
        free_choice, free_bound = tuple(choice), relaxed.lower_bound
        if budget is None or graph.peak_memory(choice) <= budget:
            return replace(relaxed, free_bound=free_bound, free_choice=free_choice)
    if cutoff is not None and free_bound is not None and free_bound >= cutoff:
        raise InfeasibleError(f"no strategy assignment costs under {cutoff:.6g} s even with memory free",
                              "memory", "use more devices or a larger budget")  # the capped optimum costs more
    program = fold_leaves(graph, alive) if reduce_first and budget is not None else None  # leaves merged: exact
    solved, kept_here = (program.graph, reduce(program.graph)) if program is not None else (graph, alive)
    first = _cheapest(solved, kept_here) if budget is None else _leanest(solved, kept_here)
    fits = budget is None or solved.peak_memory(first) <= budget
    if (cutoff is not None and budget is not None and (solved.node_transients or solved.edge_transients)
            and not (fits and solved.total(first) < cutoff)):  # a start under the cutoff answers the question already
        began = time.perf_counter()
        first = _under_cutoff(solved, kept_here, budget, backend, time_limit_s, seed, cutoff) or first
        time_limit_s = max(time_limit_s - (time.perf_counter() - began), 1e-3)  # one limit for the question and the program
        fits = solved.peak_memory(first) <= budget
    model, var = build_model(solved, kept_here, budget, first if fits else None)
    result = (_run(model, backend, time_limit_s, seed, budget, cutoff) if model.num_vars
              else solvers.Result("optimal", [], 0.0, 0.0, 0.0, backend))
    choice = _chosen(kept_here, var, result.values)
    if program is not None:
        choice = program.unfold(choice, len(graph))
    return replace(_solution(graph, choice, result, model, kept, total), free_bound=free_bound, free_choice=free_choice)


def _under_cutoff(graph: CostGraph, alive: list[np.ndarray], budget: float, backend: str, time_limit_s: float,
                  seed: int, cutoff: float) -> list[int] | None:
    """A capped program with a cutoff, first asked only whether its relaxation without transient buffers (every
    assignment's memory only drops) has an assignment under the cutoff, which is cheaper to answer than the
    program: none there, none in the program (InfeasibleError, as the program's own solve raises). Otherwise the
    assignment found (the solve stops at the first), as the program's start, or None (no verdict: solve the program)."""
    lean = replace(graph, node_transients={}, edge_transients={})
    model, var = build_model(lean, alive, budget, None)
    if not model.num_vars:
        return None
    scaled = (cutoff - model.offset) * model.scale
    result = solvers.solve(model, backend, time_limit_s, seed, cutoff=scaled, first_under_cutoff=True)
    if result.status == "cutoff":
        raise _cut_off(budget, cutoff)
    if result.values is None:
        return None
    choice = _chosen(alive, var, result.values)
    return choice if graph.peak_memory(choice) <= budget else None


def _cheapest(graph: CostGraph, alive: list[np.ndarray]) -> list[int]:
    """Each node's least-cost surviving strategy, edges aside: a start for a program with no memory row."""
    return [int(np.flatnonzero(a)[np.argmin(c[a])]) for c, a in zip(graph.costs, alive)]


def _leanest(graph: CostGraph, alive: list[np.ndarray]) -> list[int]:
    """Each node's least-memory surviving strategy (the cheaper on ties): the start of a capped ILP when it fits,
    so that a solve stopped by a limit keeps an incumbent instead of finding nothing."""
    choice = []
    for n, a in enumerate(alive):
        idx = np.flatnonzero(a)
        choice.append(int(idx[np.lexsort((graph.costs[n][idx], graph.memory[n][idx]))[0]]))
    return choice


def _solution(graph: CostGraph, choice: list[int], result: solvers.Result, model: solvers.Model,
              kept: int, total: int) -> Solution:
    objective = graph.total(choice)
    # the model leaves out constant costs (fixed or eliminated nodes) and is scaled: undo both for the bound
    bound = None if result.bound is None else (result.bound - (result.objective or 0.0)) / model.scale + objective
    return Solution(choice, objective, bound, result, kept, total, model.num_vars)
