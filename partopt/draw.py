"""A picture of a plan: the simulated pipeline schedule of one iteration and memory per stage (SVG or PNG).

The schedule (GPipe, 1F1B, interleaved 1F1B with v chunks per stage, zero-bubble ZB-H1) comes from
`partopt.simulate` run on the plan's stage times (`stage_times`), so the drawing shows what the
simulator computes; the title also gives the plan's closed-form time.
Layout is fixed in inches (no pyplot, no automatic layout): rows keep their height however many
stages there are, and the output is byte-for-byte deterministic for a given matplotlib.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from partopt import io
from partopt.cluster import PRESETS, preset
from partopt.costmodel import DEFAULT_MEMORY_RESERVE, memory_budget
from partopt.errors import InstanceError
from partopt.plan import Plan, by_device
from partopt.schedules import check_schedule
from partopt.simulate import Simulation, StageTimes, simulate
from partopt.units import fmt_bytes, fmt_seconds
from partopt.validate import check_plan

FORMATS: tuple[str, ...] = (".svg", ".png")
GIB = 2.0**30
COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "weight": "#937860", "sync": "#55a868", "idle": "#ececec",
           "params": "#8172b3", "activations": "#ccb974", "budget": "#c44e52"}

# figure geometry, inches
_WIDTH, _LEFT, _TIMELINE, _GAP, _MEMORY = 13.0, 2.9, 7.2, 0.35, 2.25
_TOP, _BOTTOM, _ROW, _MIN_PANEL = 0.8, 0.9, 0.42, 1.0
_BAR = 0.7  # bar height, in rows
_FONT = 6.5  # microbatch numbers, points
_DPI = 150
# blocks of each pass per stage row, microbatches × virtual stages: more are not legible, and simulating them costs
# time and memory in proportion
MAX_MICROBATCHES = 4096
WEIGHT_SHARE = 0.5  # of a backward, the weight-gradient pass W that zero-bubble splits off (a matmul's dW GEMM)


def stage_times(plan: Plan) -> list[StageTimes]:
    """The plan's stages as simulator input, keeping each stage's latency t_i = stage_time_s.

    A plan's `send_time_s` is the round trip (activations out, gradients back: 2 × one p2p) and its
    `forward_s` is the forward's FLOP share of `stage_time_s`, sends included. So per stage:
    send_s = send_time_s / 2, compute = stage_time_s - send_time_s + the sends' part compute hides
    (`breakdown.send_hidden_s`, interleaved sends overlapping compute) split by the same share,
    activation_bytes and static_bytes (parameter state and recomputation's working set) from the breakdown.
    A plan does not split the backward: weight_s (zero-bubble's W pass) is `WEIGHT_SHARE` of it, exact
    for matmuls (dX and dW are GEMMs of equal FLOPs), an overestimate where other ops weigh in.
    """
    result = []
    for i, stage in enumerate(plan.stages):
        where = f"stages[{i}]"
        for name in ("param_bytes", "activation_bytes"):
            if name not in stage.breakdown:
                raise InstanceError(f"the breakdown has no {name}", f"{where}.breakdown", "write plans with `partopt solve -o`")
        slack = 1e-9 * stage.stage_time_s  # an interleaved plan's chunks, added up per device (`by_device`), round apart
        if not 0 <= stage.send_time_s <= stage.stage_time_s + slack:
            raise InstanceError(f"send_time_s {stage.send_time_s!r} is not within [0, stage_time_s = {stage.stage_time_s!r}]",
                                f"{where}.send_time_s", "stage_time_s includes the send; see docs/FORMAT.md")
        if not 0 <= stage.forward_s <= stage.stage_time_s + slack:
            raise InstanceError(f"forward_s {stage.forward_s!r} is not within [0, stage_time_s = {stage.stage_time_s!r}]",
                                f"{where}.forward_s", "forward_s is the forward's share of stage_time_s")
        compute = max(0.0, stage.stage_time_s - stage.send_time_s) + stage.breakdown.get("send_hidden_s", 0.0)
        share = min(1.0, stage.forward_s / stage.stage_time_s) if stage.stage_time_s > 0 else 0.0
        forward = compute * share
        weight = (compute - forward) * (WEIGHT_SHARE if stage.weight_s is None
                                        else stage.weight_s / max(stage.stage_time_s - stage.forward_s, 1e-300))
        result.append(StageTimes(forward_s=forward, backward_s=compute - forward,
                                 send_s=stage.send_time_s / (2 * plan.virtual_stages) if i < len(plan.stages) - 1 else 0.0,
                                 weight_s=min(weight, compute - forward),
                                 activation_bytes=float(stage.breakdown["activation_bytes"]),
                                 static_bytes=float(stage.breakdown["param_bytes"] + stage.breakdown.get("working_bytes", 0.0))))
    return result


def plan_budget(plan: Plan) -> float | None:
    """Per-device memory budget when the plan's cluster is a preset (its device and the plan's reserve), else None."""
    if plan.cluster not in PRESETS:
        return None
    return memory_budget(preset(plan.cluster).device, plan.options.get("memory_reserve", DEFAULT_MEMORY_RESERVE))


def draw(plan: Plan, path: str | Path, schedule: str | None = None, memory_budget_bytes: float | None = None,
         virtual_stages: int | None = None) -> None:
    """Write the plan's pipeline timeline and per-stage memory as SVG or PNG (format from the suffix).

    `memory_budget_bytes` draws the budget line; by default it is derived for preset clusters.
    `schedule` and `virtual_stages` (the interleaved schedule's v; later chunks drawn lighter) default to the
    plan's; an interleaved plan is drawn per device group (`by_device`), its layers from first to last chunk.
    The plan is validated first (`partopt.validate.check_plan`): no drawing of figures that disagree.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise InstanceError(f"cannot draw to {suffix or 'a file without suffix'!r}", str(path),
                            "name the output *.svg or *.png")
    check_plan(plan)
    if virtual_stages is None:
        virtual_stages = plan.virtual_stages if schedule is None else 1
    schedule = plan.schedule if schedule is None else schedule
    view = by_device(plan)
    v = _drawable_chunks(schedule, virtual_stages, len(view.stages), plan.num_microbatches)
    stages = stage_times(view)
    simulation = simulate(stages, plan.num_microbatches, schedule, v)
    budget = plan_budget(plan) if memory_budget_bytes is None else memory_budget_bytes
    figure = _figure(view, stages, simulation, budget)
    with matplotlib.rc_context({"svg.hashsalt": "partopt", "svg.fonttype": "path"}):
        metadata = {"Date": None} if suffix == ".svg" else {"Software": None}
        io.write_atomic(path, lambda temporary: figure.savefig(temporary, format=suffix[1:], dpi=_DPI, metadata=metadata))


def _drawable_chunks(schedule: str, virtual_stages: int, num_stages: int, microbatches: int) -> int:
    """v, the model chunks per stage, once the schedule takes it (`check_schedule`) and each stage row's B·v
    chunk-microbatches are at most MAX_MICROBATCHES (v = 10^6 never finished drawing).

    The drawing re-times each stage as v equal chunks of its time, a what-if that splits no layers (a plan of one
    layer per stage is drawn interleaved too), so a stage's layer count does not bound v; what it can simulate and
    show does."""
    if microbatches > MAX_MICROBATCHES:
        raise InstanceError(f"{microbatches} microbatches are too many to draw (at most {MAX_MICROBATCHES})",
                            "$.num_microbatches", "draw a plan with fewer microbatches")
    v = check_schedule(schedule, virtual_stages, num_stages, microbatches)
    if microbatches * v > MAX_MICROBATCHES:
        raise InstanceError(f"v = {v} virtual stages make B·v = {microbatches * v} chunk-microbatches per stage, "
                            f"too many to draw (at most {MAX_MICROBATCHES})", "virtual_stages",
                            f"draw with at most {MAX_MICROBATCHES // microbatches} virtual stages, or a plan of fewer "
                            "microbatches")
    return v


def _figure(plan: Plan, stages: list[StageTimes], simulation: Simulation, budget: float | None) -> Figure:
    """The two panels side by side, sharing one row per stage."""
    rows = len(plan.stages)
    panel = max(_MIN_PANEL, _ROW * rows)
    height = _TOP + panel + _BOTTOM
    figure = Figure(figsize=(_WIDTH, height))
    FigureCanvasAgg(figure)
    box = (_BOTTOM / height, panel / height)
    timeline = figure.add_axes((_LEFT / _WIDTH, box[0], _TIMELINE / _WIDTH, box[1]))
    memory = figure.add_axes(((_LEFT + _TIMELINE + _GAP) / _WIDTH, box[0], _MEMORY / _WIDTH, box[1]), sharey=timeline)
    end = _timeline(timeline, plan, simulation)
    handles = _memory(memory, stages, simulation, budget)
    schedule = simulation.schedule
    if simulation.virtual_stages > 1:
        schedule += f" (v = {simulation.virtual_stages}, later chunks lighter)"
    figure.suptitle(f"{plan.graph} on {plan.cluster} ({plan.nodes} × {plan.devices_per_node} devices) · "
                    f"{plan.num_microbatches} microbatches of {plan.microbatch_size} · {schedule}\n"
                    f"iteration {fmt_seconds(plan.iteration_time_s)} (plan, closed form) · "
                    f"{fmt_seconds(end)} ({simulation.schedule} simulation)",
                    y=1 - 0.12 / height, va="top", fontsize=10)
    passes = [Patch(color=COLOURS["forward"], label="forward")]
    if simulation.schedule == "zero-bubble":
        passes += [Patch(color=COLOURS["backward"], label="input gradient (B)"),
                   Patch(color=COLOURS["weight"], label="weight gradient (W)")]
    else:
        passes.append(Patch(color=COLOURS["backward"], label="backward"))
    handles = [*passes, Patch(color=COLOURS["sync"], label="gradient sync + optimizer"),
               Patch(color=COLOURS["idle"], label="idle (bubble)"), *handles]
    figure.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.02 / height),
                  ncols=len(handles) if len(handles) <= 7 else -(-len(handles) // 2), fontsize=8, frameon=False)
    return figure


def _timeline(ax: Axes, plan: Plan, simulation: Simulation) -> float:
    """Forward/backward blocks per stage row, the sync after each last backward; returns the iteration's end (s)."""
    rows = len(plan.stages)
    done = [0.0] * rows
    for event in simulation.events:
        done[event.stage] = max(done[event.stage], event.end_s)
    end = max(done[i] + stage.sync_time_s for i, stage in enumerate(plan.stages))
    scale, unit = (1e3, "ms") if end < 1 else (1.0, "s")
    span = end * scale * 1.01 if end > 0 else 1.0
    points_per_unit = _TIMELINE * 72 / span
    labels = []
    for i, stage in enumerate(plan.stages):
        y = (i - _BAR / 2, _BAR)
        ax.broken_barh([(0, (done[i] + stage.sync_time_s) * scale)], y, facecolors=COLOURS["idle"], gid=f"idle-{i}")
        for kind in ("forward", "backward", "weight"):
            events = [e for e in simulation.events if e.stage == i and e.kind == kind]
            if not events:
                continue
            blocks = [(e.start_s * scale, (e.end_s - e.start_s) * scale) for e in events]
            thin = any(w * points_per_unit < 3 for _, w in blocks)
            ax.broken_barh(blocks, y, facecolors=[_shade(COLOURS[kind], e.chunk, simulation.virtual_stages) for e in events],
                           edgecolors="white", linewidth=0 if thin else 0.4, gid=f"{kind}-{i}")
            for e, (x, w) in zip(events, blocks):
                text = str(e.microbatch)
                if w * points_per_unit >= 0.62 * _FONT * len(text) + 2:
                    chunk = f"-c{e.chunk}" if simulation.virtual_stages > 1 else ""
                    ax.text(x + w / 2, i, text, ha="center", va="center", fontsize=_FONT,
                            color="white" if kind == "forward" else "black",
                            gid=f"label-{kind}-{i}-{e.microbatch}{chunk}")
        if stage.sync_time_s > 0:
            ax.broken_barh([(done[i] * scale, stage.sync_time_s * scale)], y, facecolors=COLOURS["sync"], gid=f"sync-{i}")
        busy = sum(e.end_s - e.start_s for e in simulation.events if e.stage == i) + stage.sync_time_s
        first, last = stage.layers
        labels.append(f"stage {i} · layers {first}–{last} · mesh ({stage.logical_mesh[0]}, {stage.logical_mesh[1]})\n"
                      f"{stage.submesh[0]}×{stage.submesh[1]} devices · busy {100 * busy / end if end > 0 else 0:.0f} %")
    ax.set_yticks(range(rows), labels, fontsize=8)
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_title("pipeline schedule of one iteration", fontsize=9)
    return end


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """`colour` for model chunk `chunk` of `chunks`: the first as is, later ones mixed with up to 45 % white."""
    mix = 0.45 * chunk / (chunks - 1) if chunks > 1 else 0.0
    return tuple(c + (1 - c) * mix for c in to_rgb(colour))  # type: ignore[return-value]


def _memory(ax: Axes, stages: list[StageTimes], simulation: Simulation, budget: float | None) -> list[Artist]:
    """Stacked bars per stage: static bytes, activations × in-flight microbatches (GiB); legend handles."""
    params = [stage.static_bytes / GIB for stage in stages]
    acts = [stage.activation_bytes * inflight / GIB for stage, inflight in zip(stages, simulation.max_inflight)]
    rows = range(len(stages))
    ax.barh(rows, params, height=_BAR, color=COLOURS["params"], gid="memory-params")
    ax.barh(rows, acts, height=_BAR, left=params, color=COLOURS["activations"], gid="memory-activations")
    top = max(p + a for p, a in zip(params, acts))
    handles: list[Artist] = [Patch(color=COLOURS["params"], label="parameter state (+ recompute working set)"),
               Patch(color=COLOURS["activations"], label="activations × in-flight")]
    if budget is not None:
        handles.append(ax.axvline(budget / GIB, color=COLOURS["budget"], linestyle="--", linewidth=1,
                                  label=f"memory budget {fmt_bytes(budget)}", gid="memory-budget"))
        top = max(top, budget / GIB)
    for i, inflight in zip(rows, simulation.max_inflight):
        ax.text(params[i] + acts[i] + top * 0.02, i, f"{params[i] + acts[i]:.3g} (×{inflight:g})", va="center", fontsize=7,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    ax.set_xlim(0, top * 1.45 if top > 0 else 1.0)
    ax.tick_params(axis="y", labelleft=False)
    ax.set_xlabel("GiB (× in-flight microbatches)")
    ax.set_title("memory per device", fontsize=9)
    return handles
