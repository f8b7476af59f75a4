"""The Alpa benchmark results as tables (header and rows of strings, for rich and markdown alike),
where partopt's plan differs from the paper's, and the writer of a marked section of a markdown file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from partopt.bench.alpa import ABLATION_METHODS, ABLATION_TITLES, BASELINE, PLANNER_TITLES, format_meshes, summarize
from partopt.bench.harness import AblationResult, CaseResult, fmt_tflops, median_error


def _cell(result: CaseResult, planner: str) -> str:
    """'61.23 (61.61)': predicted, then the paper's figure when it reports one."""
    cell = result.cells[planner]
    text = fmt_tflops(cell.tflops)
    if planner in result.case.reported:
        reported = result.case.reported[planner]
        text += f" ({'OOM' if reported is None else f'{reported:.2f}'})"
    return text


def results_rows(model: str, results: list[CaseResult]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one model's table (strings, for rich and markdown alike)."""
    planners = ("partopt", "inter_only", "intra_only", BASELINE[model])
    header = ["GPUs", "model"] + [PLANNER_TITLES[p] for p in planners] + ["error vs Alpa", "partopt planning s", "all planners s"]
    rows = []
    for r in results:
        if r.case.model != model:
            continue
        error = "—" if r.error is None else f"{r.error:+.1%}" + (" (in-sample)" if r.case.in_sample else "")
        rows.append([str(r.case.gpus), r.case.instance] + [_cell(r, p) for p in planners]
                    + [error, f"{r.cells['partopt'].seconds:.1f}", f"{sum(c.seconds for c in r.cells.values()):.1f}"])
    return header, rows


def median_sentence(lead: str, results: Sequence[CaseResult]) -> str:
    """'<lead>: 9.9%.', with the median over the out-of-sample rows beside it when some rows are calibration points."""
    def fmt(value: float | None) -> str:
        return "—" if value is None else f"{value:.1%}"

    sentence = f"{lead}: {fmt(median_error(results))}"
    fitted = [r for r in results if r.case.in_sample and r.error is not None]
    if fitted:
        rest = [r for r in results if not r.case.in_sample]
        sentence += (f"; out of sample (the {len(rest)} rows that are not calibration points): "
                     f"{fmt(median_error(rest))}")
    return sentence + "."


def plan_rows(model: str, results: list[CaseResult]) -> tuple[list[str], list[list[str]]]:
    """partopt's plan of each case beside Alpa's reported one (GPT), and the baseline's configuration."""
    header = ["GPUs", "partopt B", "stages", "submeshes", "logical meshes", "Alpa B", "stages", "submeshes", "logical meshes",
              f"{PLANNER_TITLES[BASELINE[model]]} plan"]
    rows = []
    for r in results:
        if r.case.model != model:
            continue
        plan = r.cells["partopt"].plan
        ours = summarize(plan) if plan else None
        alpa = r.case.alpa_plan
        base = r.cells[BASELINE[model]]
        base_text = base.detail if base.detail and base.plan else (
            f"B {base.plan.num_microbatches}, {format_meshes(summarize(base.plan).logical_meshes)}" if base.plan else "out of memory")
        rows.append([str(r.case.gpus)]
                    + ([str(ours.microbatches), str(ours.stages), format_meshes(ours.submeshes),
                        format_meshes(ours.logical_meshes)] if ours else [r.cells["partopt"].detail or "out of memory", "", "", ""])
                    + ([str(alpa.microbatches), str(alpa.stages), format_meshes(alpa.submeshes),
                        format_meshes(alpa.logical_meshes)] if alpa else ["—", "—", "—", "—"])
                    + [base_text])
    return header, rows


def ablation_rows(ablations: list[AblationResult]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the ablation table: predicted TFLOP/s per method (paper's in parentheses)."""
    header = ["case", "GPUs"] + [ABLATION_TITLES[m] for m in ABLATION_METHODS] + ["best even splits", "s"]
    rows = [[a.instance, str(a.gpus)] + [f"{fmt_tflops(a.tflops[m])} ({a.reported[m]:g})" for m in ABLATION_METHODS]
            + ["; ".join(f"{ABLATION_TITLES[m]}: {a.detail[m]}" for m in ABLATION_METHODS[1:]), f"{a.seconds:.0f}"]
            for a in ablations]
    return header, rows


def plan_difference(result: CaseResult) -> str | None:
    """Where partopt's plan differs from Alpa's reported one ('same plan' when it does not; None when
    either is missing)."""
    plan, alpa = result.cells["partopt"].plan, result.case.alpa_plan
    if plan is None or alpa is None:
        return None
    ours = summarize(plan)
    parts = []
    if ours.microbatches != alpa.microbatches:
        parts.append(f"B {ours.microbatches} vs {alpa.microbatches}")
    if ours.stages != alpa.stages:
        parts.append(f"{ours.stages} stages vs {alpa.stages}")
    if sorted(ours.submeshes) != sorted(alpa.submeshes):
        parts.append(f"submeshes {format_meshes(ours.submeshes)} vs {format_meshes(alpa.submeshes)}")
    elif ours.submeshes != alpa.submeshes:
        parts.append("the same submeshes in another order")
    if sorted(ours.logical_meshes) != sorted(alpa.logical_meshes):
        parts.append(f"logical meshes {format_meshes(ours.logical_meshes)} vs {format_meshes(alpa.logical_meshes)}")
    return "; ".join(parts) or "same plan"


def replace_marked(path: Path, begin: str, end: str, section: str) -> None:
    """Replace the text between the `begin` and `end` markers of `path` with `section` (append the
    marked block when the markers are absent); the rest of the file stays as it is."""
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
