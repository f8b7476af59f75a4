"""The `partopt` command line: one click command per function, sharing file loading and error
printing. Any PartoptError a command raises becomes one `error: …` line on stderr, exit code 2;
Ctrl-C becomes one line and exit code 130. Output files are checked before the work and written
atomically (partopt.io.write_atomic), so neither leaves a partial file."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import click
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from partopt import baselines, check, costmodel, io, models, validate
from partopt.cluster import AUTO_ALPA_NODES, MAX_NODES, PRESETS, SUBMESH_FAMILIES, Cluster, Link, preset, preset_calibration
from partopt.costmodel import training_flops
from partopt.evaluate import evaluate as evaluate_plan, uniform
from partopt.errors import InfeasibleError, InstanceError, PartoptError
from partopt.explain import OpTime, explain, op_times
from partopt.export import TARGETS, export, megatron_warnings
from partopt.graph import MATMUL_DTYPES, OPTIMIZERS, Graph
from partopt.inter import DEFAULT_MAX_LAYERS, optimize
from partopt.intra import RECOMPUTE_MODES
from partopt.ops import KINDS, is_matmul
from partopt.models.transformer import ATTENTION_KERNELS, LOSS_KERNELS
from partopt.plan import Plan, plan_text, read_plan, write_plan
from partopt.pricing import prepare_workers
from partopt.profiled import read_profile
from partopt.schedules import SCHEDULES
from partopt.solvers import BACKENDS, TIME_LIMIT_S
from partopt.units import fmt_bytes, fmt_scaled, fmt_seconds

if TYPE_CHECKING:  # pragma: no cover
    from partopt import sweep as sweep_module  # matplotlib: imported by the commands that draw, not at start-up

RECOMPUTE_CHOICES = ("auto", *RECOMPUTE_MODES)
EXIT_USER_ERROR = 2  # bad input: a file, a preset name or an impossible request
EXIT_INCONSISTENT = 1  # `check` and `solve`'s self-check: a plan whose figures do not re-derive
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT (128 + 2)
PIPE_WIDTH = 1000  # columns of tables written to a pipe or file: wide enough that no cell is cut
PEAK_DTYPES_SHOWN = ("fp16", "fp32")


class PartoptGroup(click.Group):
    """A click group that reports PartoptError as one line, without a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PartoptError as err:
            click.echo(f"error: {_at_flag(err, ctx).line()}", err=True)
            ctx.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            _end_workers()
            click.echo("error: interrupted (Ctrl-C); nothing was written", err=True)
            ctx.exit(EXIT_INTERRUPTED)


def _at_flag(err: PartoptError, ctx: click.Context) -> PartoptError:
    """`err` placed at the command's flag when the library placed it at that option's keyword
    ("ray_address" -> "--ray-address")."""
    command = ctx.command.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None
    flags = {p.name: _flag(p) for p in (command.params if command else []) if isinstance(p, click.Option)}
    return type(err)(err.cause, flags[err.where], err.hint) if err.where in flags else err


def _flag(option: click.Parameter) -> str:
    """How messages name an option: its first long flag (--zero of --zero/--distributed-optimizer, --output of -o)."""
    return next((o for o in option.opts if o.startswith("--")), option.opts[0])


def _end_workers() -> None:
    """After Ctrl-C: end the ILP worker processes now, not after their running solves, and keep the process
    pool's bookkeeping thread quiet (on Python 3.11 it raises InvalidStateError for the jobs Ctrl-C cancelled)."""
    threading.excepthook = lambda args: None
    for child in multiprocessing.active_children():
        child.terminate()


@click.group(cls=PartoptGroup)
@click.version_option(package_name="partopt")
def main() -> None:
    """Plan inter- and intra-operator parallel training of a neural network on a cluster."""


# ---------------------------------------------------------------- shared helpers

def console(stderr: bool = False) -> Console:
    """A rich Console; when not writing to a terminal its width is PIPE_WIDTH, so piped tables keep
    whole cells instead of being folded to 80 columns ("parto…")."""
    stream = sys.stderr if stderr else sys.stdout
    terminal = Console(stderr=stderr).is_terminal
    return Console(file=stream, width=None if terminal else PIPE_WIDTH)


def warn(lines: list[str]) -> None:
    """Print each warning (an absurd but valid magnitude) as one line on stderr."""
    for line in lines:
        click.echo(f"warning: {line}", err=True)


class FiniteFloat(click.ParamType):
    """A float that is finite and positive (`--time-limit nan` or `inf` is refused, not planned with), in `unit`:
    the metavar and the refusal name what it counts (seconds, or a count of tokens), not always seconds."""

    def __init__(self, unit: str = "seconds", quantity: str = "number") -> None:
        self.name = unit
        self.quantity = quantity

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not (math.isfinite(number) and number > 0):
            self.fail(f"{value!r} is not a finite positive {self.quantity} of {self.name}", param, ctx)
        return number


# `solve` and `evaluate`: both solve layer ILPs, and warn of those the limit stopped (`validate.solver_warnings`)
TIME_LIMIT = click.option("--time-limit", type=FiniteFloat(), default=TIME_LIMIT_S, show_default=True,
                          help="Wall-clock seconds per ILP, a safety net: each ILP stops first at its solver's "
                          "deterministic work limit.")


def load_instance(source: str, nodes: int | None = None) -> Graph | Cluster:
    """A graph or cluster file, or else a cluster preset by name; `nodes` resizes a cluster."""
    if Path(source).exists():
        instance = io.read(source)
    elif source in PRESETS:
        instance = preset(source)
    else:
        raise InstanceError(f"no such file or cluster preset {source!r} (presets: {', '.join(PRESETS)})",
                            hint="give the path of a graph or cluster file, or a preset name")
    if nodes is None:
        return instance
    if isinstance(instance, Graph):
        raise InstanceError("--nodes resizes a cluster, but this is a graph", source, "drop --nodes")
    return instance.resized(nodes)


def print_json(facts: dict[str, Any]) -> None:
    """The facts as one JSON object on stdout (keys in a fixed order, numbers unformatted)."""
    click.echo(json.dumps(facts, indent=2))


def _facts_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in rows:
        table.add_row(Text(label), Text(value))  # Text: no markup, tensor dims print as [b, s]
    return table


# ---------------------------------------------------------------- inspect

def graph_facts(graph: Graph) -> dict[str, Any]:
    """What `inspect` reports about a graph, in SI units (FLOP, bytes)."""
    batch = graph.dims[graph.batch_dim] if graph.batch_dim else None
    forward = graph.forward_flops
    training = sum(training_flops(graph.flops(op), is_matmul(op)) for op in graph.ops)
    by_kind = {}
    for kind in KINDS:
        flops = [graph.flops(op) for op in graph.ops if op.kind == kind]
        if flops:
            by_kind[kind] = {"count": len(flops), "forward_flops": sum(flops),
                             "forward_flops_share": sum(flops) / forward if forward else 0.0}
    activations = [t for t in graph.tensors.values() if t.role in ("activation", "output")]
    largest = max(activations, key=lambda t: graph.nbytes(t.name), default=None)
    return {
        "kind": "graph",
        "name": graph.name,
        "dtype": graph.dtype,
        "batch_dim": graph.batch_dim,
        "batch_size": batch,
        "ops": len(graph.ops),
        "ops_by_kind": by_kind,
        "layers": sum(1 for layer in graph.layers if layer is not None),
        "params": graph.num_params,
        "params_billions": graph.num_params / 1e9,
        "param_bytes": sum(graph.nbytes(t.name) for t in graph.params),
        "forward_flops": forward,
        "forward_flops_per_sample": forward / batch if batch else None,
        "training_flops": training,
        "training_flops_per_sample": training / batch if batch else None,
        "largest_activation": None if largest is None else {
            "name": largest.name, "dims": list(largest.dims), "bytes": graph.nbytes(largest.name)},
    }


def calibration_facts(calibration: dict[str, Any] | None) -> dict[str, Any] | None:
    """Where a cluster's fitted values come from (a `calibration` record, docs/FORMAT.md): the points
    file, the values, and the leave-one-out |error| over its points; None: nothing was fitted."""
    if calibration is None:
        return None
    loo = [abs(e["loo_error"]) for e in calibration["errors"] if e["loo_error"] is not None]
    return {"points": calibration["points"], "fitted": calibration["fitted"], "measured_runs": len(calibration["errors"]),
            "loo_error_median": statistics.median(loo) if loo else None, "loo_error_max": max(loo, default=None)}


def cluster_facts(cluster: Cluster, calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """What `inspect` reports about a cluster, in SI units (FLOP/s, bytes, bytes/s, seconds), with the
    provenance of its fitted values (`calibration_facts`) when it has any."""
    device, n = cluster.device, cluster.num_devices

    def link(l: Link) -> dict[str, Any]:
        return {"bandwidth_bytes_per_s": l.bandwidth, "latency_s": l.latency_s}

    return {
        "kind": "cluster",
        "name": cluster.name,
        "nodes": cluster.nodes,
        "devices_per_node": cluster.devices_per_node,
        "devices": n,
        "device": device.name,
        "peak_flops_per_s": {dtype: device.peak(dtype) * n for dtype in PEAK_DTYPES_SHOWN},
        "memory_bytes_per_device": device.memory_bytes,
        "memory_bytes_total": device.memory_bytes * n,
        "memory_bandwidth_bytes_per_s": device.memory_bandwidth,
        "matmul_efficiency": device.matmul_efficiency,
        "fp8_matmul_efficiency": device.large_kernel_efficiency("fp8"),
        "attention_efficiency": device.large_kernel_efficiency("bf16", attention=True),
        "matmul_half_flops": device.matmul_half_flops,
        "memory_efficiency": device.memory_efficiency,
        "intra_node": {**link(cluster.intra_node), **({"lanes": [list(row) for row in cluster.intra_node.lanes],
                                                        "lane_bandwidth_bytes_per_s": cluster.intra_node.lane_bandwidth}
                                                       if cluster.intra_node.lanes else {})},
        "inter_node": {**link(cluster.inter_node), "shared_by_node": cluster.inter_node.shared_by_node},
        "calibration": calibration_facts(calibration),
    }


def _per_sample(total: float, per_sample: float | None) -> str:
    text = fmt_scaled(total, "FLOP")
    return text if per_sample is None else f"{fmt_scaled(per_sample, 'FLOP')} per sample ({text} per batch)"


def _render_graph(f: dict[str, Any]) -> list[Table]:
    largest = f["largest_activation"]
    summary = _facts_table(f"graph {f['name']}", [
        ("dtype", f["dtype"]),
        ("batch", f"{f['batch_dim']} = {f['batch_size']}" if f["batch_dim"] else "none"),
        ("ops", str(f["ops"])),
        ("layers", str(f["layers"])),
        ("parameters", f"{f['params']:,} ({f['params_billions']:.4g} B)"),
        ("parameter bytes", fmt_bytes(f["param_bytes"])),
        ("forward", _per_sample(f["forward_flops"], f["forward_flops_per_sample"])),
        ("training (fwd + bwd)", _per_sample(f["training_flops"], f["training_flops_per_sample"])),
        ("largest activation", "none" if largest is None else
         f"{largest['name']} [{', '.join(largest['dims'])}] {fmt_bytes(largest['bytes'])}"),
    ])
    kinds = Table(title="ops by kind", title_justify="left")
    for column in ("kind", "ops", "forward GFLOP", "share"):
        kinds.add_column(column, justify="left" if column == "kind" else "right")
    for kind, row in f["ops_by_kind"].items():
        kinds.add_row(kind, str(row["count"]), f"{row['forward_flops'] / 1e9:,.3f}",
                      f"{100 * row['forward_flops_share']:.1f} %")
    return [summary, kinds]


def _render_cluster(f: dict[str, Any]) -> list[Table]:
    def link(l: dict[str, Any]) -> str:
        return f"{l['bandwidth_bytes_per_s'] / 1e9:.4g} GB/s per direction, {l['latency_s'] * 1e6:.3g} µs"

    peaks = ", ".join(f"{v / 1e15:.4g} ({dtype})" for dtype, v in f["peak_flops_per_s"].items())
    nic = (f"shared by the node's {f['devices_per_node']} devices" if f["inter_node"]["shared_by_node"]
           else "one per device")
    return [_facts_table(f"cluster {f['name']}", [
        ("devices", f"{f['nodes']} nodes × {f['devices_per_node']} = {f['devices']} × {f['device']}"),
        ("peak PFLOP/s (cluster)", peaks),
        ("memory", f"{fmt_bytes(f['memory_bytes_per_device'])} per device, "
                   f"{fmt_bytes(f['memory_bytes_total'])} total"),
        ("HBM bandwidth", f"{f['memory_bandwidth_bytes_per_s'] / 1e9:.4g} GB/s per device"),
        ("efficiency", f"matmul {f['matmul_efficiency']:.0%} of peak"
                       + (f" ({f['fp8_matmul_efficiency']:.0%} in fp8)"
                          if f["fp8_matmul_efficiency"] != f["matmul_efficiency"] else "")
                       + (f", fused attention {f['attention_efficiency']:.0%}"
                          if f["attention_efficiency"] != f["matmul_efficiency"] else "")
                       + (f" for large GEMMs, half that at {f['matmul_half_flops'] / 1e9:.4g} GFLOP per call"
                          if f["matmul_half_flops"] else "")
                       + f", memory {f['memory_efficiency']:.0%} of HBM"),
        ("intra-node link", link(f["intra_node"]) + (
            f"; point-to-point lanes of {f['intra_node']['lane_bandwidth_bytes_per_s'] / 1e9:.4g} GB/s, a group "
            "sees one lane's times the rings its lanes carry" if "lanes" in f["intra_node"] else "")),
        ("inter-node link", link(f["inter_node"])),
        ("inter-node NIC", nic),
        ("calibration", _calibration_text(f["calibration"])),
    ])]


def calibration_record(source: str) -> dict[str, Any] | None:
    """The `calibration` record behind a cluster SOURCE (`load_instance`'s): its file's, else its preset's data file's."""
    return io.load_json(source).get("calibration") if Path(source).exists() else preset_calibration(source)


def _megatron_text(m: dict[str, Any]) -> str:
    """What a Megatron-style plan prices, in Megatron-LM's terms (docs/COSTMODEL.md §5b "Megatron's layout")."""
    text = f"Megatron-LM's: tp {m['tp']} × pp {m['pp']} × dp {m['dp']}"
    if m["tp"] > 1:
        text += ("; norms and residual adds split along the sequence (--sequence-parallel)" if m["sequence_parallel"]
                 else "; norms and residual adds on every tensor-parallel rank (no --sequence-parallel)")
    if m.get("tp_comm_overlap"):
        text += "; its collectives hidden under the GEMMs (--tp-comm-overlap)"
    if m.get("expert_parallel"):
        text += f"; experts split over the {m['expert_parallel']} data-parallel ranks (--expert-model-parallel-size)"
    if m.get("shard_weights"):
        text += "; every weight split over the data-parallel ranks (ZeRO-3, FSDP)"
    elif m["zero"]:
        text += "; optimizer state split over the data-parallel ranks (--use-distributed-optimizer)"
    return text


def _calibration_text(c: dict[str, Any] | None) -> str:
    if c is None:
        return "none recorded: placeholder or hand-set efficiencies (`partopt calibrate` fits them, docs/COSTMODEL.md §7)"
    text = f"{', '.join(c['fitted'])} fitted to {c['measured_runs']} measured runs ({c['points']})"
    if c["loo_error_median"] is not None:
        text += f"; leave-one-out |error| median {c['loo_error_median']:.1%}, max {c['loo_error_max']:.1%}"
    return text


@main.command()
@click.argument("source", metavar="FILE")
@click.option("--nodes", type=click.IntRange(min=1, max=MAX_NODES), help="Resize a cluster to this many nodes.")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as one JSON object.")
def inspect(source: str, nodes: int | None, as_json: bool) -> None:
    """Summarise a graph or cluster FILE (or a cluster preset by name)."""
    instance = load_instance(source, nodes)
    if isinstance(instance, Cluster):
        warn(validate.cluster_warnings(instance))
    if isinstance(instance, Graph):
        facts = graph_facts(instance)
    else:
        facts = cluster_facts(instance, calibration_record(source))
    if as_json:
        print_json(facts)
        return
    out = console()
    for table in (_render_graph if isinstance(instance, Graph) else _render_cluster)(facts):
        out.print(table)


# ---------------------------------------------------------------- generate

@main.command()
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(), help="Graph file to write.")
@click.option("--name", help="Name of the graph (default: the named model, or one made from the sizes).")
@click.option("--hidden", type=int, help="Hidden size h (gpt, llama, bert, moe, moe-layer).")
@click.option("--layers", type=int, help="Transformer blocks (gpt, llama, bert, moe).")
@click.option("--heads", type=int, help="Attention heads (gpt, llama, bert, moe).")
@click.option("--kv-heads", type=int, help="Key/value heads for grouped-query attention (llama).")
@click.option("--head-dim", type=int, help="Head size (llama; default hidden / heads).")
@click.option("--ffn", type=int, help="Feed-forward width (llama; moe and moe-layer, default 8h and 4h).")
@click.option("--seq", type=int, help="Sequence length.")
@click.option("--vocab", type=int, help="Vocabulary size (gpt, llama, moe).")
@click.option("--batch", type=int, help="Global batch size (sequences or images).")
@click.option("--experts", type=int, help="Experts per MoE layer (moe, moe-layer).")
@click.option("--group-size", type=int, help="Tokens per routing group (moe, moe-layer; default 2048).")
@click.option("--tied/--untied", default=None, help="Tie the LM head to the embedding table (gpt; default tied).")
@click.option("--depth", type=int, help="50 or 101 (wresnet).")
@click.option("--base-channels", type=int, help="Channels of the first stage (wresnet).")
@click.option("--width-factor", type=int, help="Widening of the 3x3 convolutions (wresnet).")
@click.option("--image", type=int, help="Image height and width (wresnet; default 224).")
@click.option("--classes", type=int, help="Output classes (wresnet; default 1024).")
@click.option("--dtype", help="Element type (default per model: fp16, bf16 for llama, fp32 for wresnet).")
@click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)),
              help="How the parameters are trained (default per model: adam; adafactor for moe; sgd for wresnet).")
@click.option("--attention-kernel", type=click.Choice(list(ATTENTION_KERNELS)),
              help="Attention as scores, softmax and context ops (math, the default) or one fused FlashAttention op "
              "(flash) (gpt, llama, bert, moe).")
@click.option("--matmul-dtype", type=click.Choice(list(MATMUL_DTYPES)),
              help="Run the GEMMs at this precision over the --dtype tensors (fp8 with bf16: FP8 training as "
              "Transformer Engine runs it; default: each op at its tensors' dtype).")
@click.option("--loss-kernel", type=click.Choice(list(LOSS_KERNELS)),
              help="The cross entropy as one pass over the logits each way (fused, the default) or as Megatron-LM "
              "runs it: cast to fp32, five kernels forward and one backward (unfused) (gpt, llama).")
@click.option("--attention-dropout", type=float,
              help="Drop attention probabilities with this probability, a kernel of its own on the math path "
              "(gpt; Megatron-LM's --attention-dropout, 0.1 there; default 0: no dropout op).")
def generate(model: str, output: str, **params: Any) -> None:
    """Write the graph of MODEL to a file: a generator (gpt, llama, bert, moe, moe-layer, wresnet) with
    its sizes, or a named model of the corpus (gpt-39b, moe-70b, …) whose sizes the options override."""
    io.check_output(output)
    given = {key: value for key, value in params.items() if value is not None}
    graph = models.preset(model, **given) if model in models.PRESETS else models.generate(model, **given)
    io.write_graph(graph, output)
    click.echo(f"wrote {output}: {graph.name}, {len(graph.ops)} ops, {graph.num_params:,} parameters")


# ---------------------------------------------------------------- import (frontends load their framework lazily)

@main.group("import")
def import_group() -> None:
    """Import a model from a framework (JAX, ONNX, PyTorch, a Hugging Face config) as a partopt graph file."""


def _wrote(graph: Graph, output: str) -> None:
    io.write_graph(graph, output)
    click.echo(f"wrote {output}: {graph.name}, {graph.dtype}, {len(graph.ops)} ops, {len(graph.layers)} layers, "
               f"{graph.num_params:,} parameters, {fmt_scaled(graph.forward_flops, 'FLOP')} forward")


@import_group.command("jax")
@click.argument("source")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Graph file to write.")
@click.option("--opaque", is_flag=True, help="Keep primitives with no mapping as opaque ops (never sharded).")
@click.option("--name", help="Name of the graph (default: the function's name).")
def import_jax(source: str, output: str, opaque: bool, name: str | None) -> None:
    """Trace SOURCE, `pkg.mod:make_model` or `file.py:make_model`, to a graph file. make_model() returns
    (fn, args): the loss (or forward) and its arguments, params first, as arrays or jax.ShapeDtypeStruct."""
    from partopt.frontends import jax as jax_frontend

    fn, args = jax_frontend.load_model(source)
    _wrote(jax_frontend.from_function(fn, *args, opaque=opaque, name=name), output)


@import_group.command("onnx")
@click.argument("source", metavar="MODEL.onnx")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Graph file to write.")
@click.option("--opaque", is_flag=True, help="Keep ops with no mapping as opaque ops (never sharded).")
@click.option("--name", help="Name of the graph (default: the model's graph name).")
def import_onnx(source: str, output: str, opaque: bool, name: str | None) -> None:
    """Read an ONNX model (shapes inferred; dynamic dims must be fixed in the file) into a graph file."""
    from partopt.frontends import onnx as onnx_frontend

    _wrote(onnx_frontend.from_model(source, opaque=opaque, name=name), output)


@import_group.command("torch")
@click.argument("source")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Graph file to write.")
@click.option("--name", help="Name of the graph (default: the module's class).")
@click.option("--dtype", help="Element type of the graph (default: the parameters').")
@click.option("--loss", is_flag=True, help="Add a cross entropy of the output against labels shaped like the first input.")
@click.option("--opaque", is_flag=True, help="Keep ops with no mapping as opaque ops (never sharded).")
@click.option("--attention-kernel", type=click.Choice(list(ATTENTION_KERNELS)), default="flash", show_default=True,
              help="Each scaled_dot_product_attention as one fused attention op (flash: the kernel PyTorch runs "
              "on GPUs; docs/COSTMODEL.md §3) or as scores, softmax and context ops (math).")
def import_torch(source: str, output: str, name: str | None, dtype: str | None, loss: bool, opaque: bool,
                 attention_kernel: str) -> None:
    """Import SOURCE (pkg.mod:make or file.py:make, returning (module, example_inputs), called on the meta device)."""
    from partopt.frontends.torch import from_module, load_source

    module, inputs = load_source(source)
    _wrote(from_module(module, inputs, name=name, dtype=dtype, loss=loss, opaque=opaque,
                       attention_kernel=attention_kernel), output)


@import_group.command("hf")
@click.argument("config", metavar="CONFIG.json", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Graph file to write.")
@click.option("--batch", type=click.IntRange(min=2), required=True, help="Global batch size (sequences).")
@click.option("--seq", type=click.IntRange(min=2), required=True, help="Sequence length.")
@click.option("--name", help="Name of the graph (default: the config's model_type).")
@click.option("--dtype", help="Element type of the graph, trained in mixed precision when 16-bit (default: the config's "
              "torch_dtype, bf16 for most LLMs; fp32 when it names none).")
@click.option("--opaque", is_flag=True, help="Keep ops with no mapping as opaque ops (never sharded).")
@click.option("--attention-kernel", type=click.Choice(list(ATTENTION_KERNELS)), default="flash", show_default=True,
              help="Each scaled_dot_product_attention as one fused attention op (flash: the kernel PyTorch runs "
              "on GPUs; docs/COSTMODEL.md §3) or as scores, softmax and context ops (math).")
def import_hf(config: str, output: str, batch: int, seq: int, name: str | None, dtype: str | None, opaque: bool,
              attention_kernel: str) -> None:
    """Import a Hugging Face causal LM from its CONFIG.json (no weights, nothing downloaded) with its loss."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from partopt.frontends.torch import from_hf_config, read_hf_config

    _wrote(from_hf_config(read_hf_config(config), batch=batch, seq=seq, dtype=dtype, name=name, opaque=opaque,
                          attention_kernel=attention_kernel), output)


# ---------------------------------------------------------------- solve

def _render_plan(plan: Plan, calibration: dict[str, Any] | None) -> list[Table]:
    """The stage table and the totals; `calibration`: the cluster's record, which says how far to trust the times."""
    stages = Table(title=f"Plan for {plan.graph} on {plan.cluster} ({plan.nodes} × {plan.devices_per_node})",
                   box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False)
    for column in ("stage", "layers", "submesh", "mesh", "devices", "recompute", "µbatch", "sync", "memory",
                   "in flight"):
        stages.add_column(column, justify="right", no_wrap=True)
    for i, s in enumerate(plan.stages):
        devices = f"{s.devices[0]}–{s.devices[-1]}" if len(s.devices) > 1 else str(s.devices[0])
        stages.add_row(str(i), f"{s.layers[0]}–{s.layers[1]}", f"({s.submesh[0]}, {s.submesh[1]})",
                       f"({s.logical_mesh[0]}, {s.logical_mesh[1]})", devices, s.recompute, fmt_seconds(s.stage_time_s),
                       fmt_seconds(s.sync_time_s), fmt_bytes(s.memory_bytes), f"{s.inflight_microbatches:g}")
    totals = _facts_table("Totals", [
        ("iteration time", fmt_seconds(plan.iteration_time_s)),
        ("schedule", plan.schedule + (f", {plan.virtual_stages} virtual stages per stage (stage j runs on stage "
                                      f"j mod {len(plan.stages) // plan.virtual_stages}'s devices)"
                                      if plan.virtual_stages > 1 else "")),
        *([("layout", _megatron_text(plan.options["megatron"]))] if "megatron" in plan.options else []),
        ("microbatches", f"{plan.num_microbatches} × {plan.microbatch_size} samples"),
        ("throughput", f"{plan.throughput['samples_per_s']:.4g} samples/s, "
                       f"{plan.throughput['tflops_per_device']:.3g} TFLOP/s per device"),
        ("peak memory per device", fmt_bytes(plan.memory_peak_bytes)),
        ("efficiencies", _calibration_text(calibration_facts(calibration))),
        ("columns", "µbatch: a microbatch's forward + backward (sends included); sync: gradients and optimizer "
                    "per iteration; memory: per device, with its in-flight microbatches"),
        ("solver", f"{plan.solver['backend']}: {plan.solver['status']}, gap "
                   f"{'unknown' if plan.solver['gap'] is None else format(plan.solver['gap'], '.2g')}, "
                   f"{plan.solver['ilps']} ILPs"
                   + (f", planning {fmt_seconds(plan.solver['time_s'])}" if "time_s" in plan.solver else "")
                   + (f"; {plan.solver['dropped_options']} memory-capped options dropped (no solution within "
                      "their solver limits)" if plan.solver.get("dropped_options") else "")),
        *([("search space", "\n".join(plan.solver["search"]))] if plan.solver.get("search") else []),
        *([("stopped early", f"{'at the deadline' if plan.solver['stopped'] == 'deadline' else 'by Ctrl-C'}: the best "
                             f"plan found, at most {plan.solver['bound_gap']:.1%} slower than the best possible "
                             f"(lower bound {fmt_seconds(plan.solver['lower_bound_s'])} per iteration)")]
          if plan.solver.get("stopped") else []),
        *([("stage DP", f"a zero-bubble search stopped at its work limit: the plan is at most "
                        f"{plan.solver['bound_gap']:.2%} slower than the best possible (lower bound "
                        f"{fmt_seconds(plan.solver['lower_bound_s'])} per iteration); --schedule 1f1b or "
                        "interleaved searches exactly")]
          if "lower_bound_s" in plan.solver and not plan.solver.get("stopped") else []),
    ])
    return [stages, totals]


@main.command()
@click.argument("graph_file", metavar="GRAPH")
@click.option("--cluster", "cluster_source", required=True, help="Cluster file or preset name.")
@click.option("--nodes", type=click.IntRange(min=1, max=MAX_NODES), help="Resize the cluster to this many nodes.")
@click.option("--microbatches", default="auto", show_default=True,
              help="Microbatch count, counts to search (64,128,256), or auto (every power of two dividing the batch).")
@click.option("--layers", type=click.IntRange(min=1), default=DEFAULT_MAX_LAYERS, show_default=True,
              help="Most layers the stage DP cuts between (tagged layers are grouped by FLOPs).")
@click.option("--solver", type=click.Choice(BACKENDS), default="highs", show_default=True, help="ILP backend.")
@TIME_LIMIT
@click.option("--memory-reserve", type=click.FloatRange(0, 1, max_open=True), default=0.1, show_default=True,
              help="Fraction of device memory kept free.")
@click.option("--search", type=click.Choice(["full", "intra-only", "inter-only", "data-parallel-only", "pp-dp", "megatron"]),
              default="full", show_default=True,
              help="Restrict the search (baselines); megatron: the best uniform (tp, pp, dp, microbatches) grid point, "
              "each with and without sequence parallelism, the distributed optimizer and the interleaved schedule "
              "(--schedule 1f1b or interleaved: that one alone; it searches its own "
              "microbatches and stages in this process: --microbatches, --layers, --logical-shapes, --submeshes, "
              "--workers, --executor, --ray-address and --deadline do not apply, and giving one is an error).")
@click.option("--logical-shapes", type=click.Choice(["node_local", "all"]), default="node_local", show_default=True,
              help="Logical meshes per submesh: second axis inside a node (Alpa's space), or every factorisation.")
@click.option("--submeshes", type=click.Choice(SUBMESH_FAMILIES), default="auto", show_default=True,
              help="Submesh shapes: (1, 2^k) and (n, M) for every n (alpa), or only powers of two; auto: alpa up to "
              f"{AUTO_ALPA_NODES} nodes, powers of two beyond.")
@click.option("--workers", type=click.IntRange(min=1), help="Processes for the ILPs (default: one per core).")
@click.option("--recompute", type=click.Choice(RECOMPUTE_CHOICES), default="auto", show_default=True, is_flag=False,
              flag_value="full", help="Activation recomputation per stage: searched (auto), none, selective (the "
              "attention core) or full (each layer keeps only its input); --recompute alone means full.")
@click.option("--no-overlap", is_flag=True, help="Price every communication on the critical path: no gradient "
              "reduction hidden by the backward, no weight gather prefetched under compute, no interleaved send "
              "overlapped (docs/COSTMODEL.md §5b); every cost adds up, the model before overlap.")
@click.option("--schedule", type=click.Choice(["auto", *SCHEDULES]), default="auto", show_default=True,
              help="Pipeline schedule: auto (the best the search plans: 1f1b and zero-bubble (ZB-H1) with free cuts, "
              "interleaved with Megatron's uniform chunks) or one of them (docs/COSTMODEL.md §5b; --search megatron "
              "runs 1f1b and interleaved, or the one given).")
@click.option("--profile", "profile_file", type=click.Path(),
              help="Measured op times and collective bandwidths (a partopt.profile file); the analytical model prices the rest.")
@click.option("--state-layout", type=click.Choice(costmodel.STATE_LAYOUTS),
              help="How the training runtime lays out parameter state (docs/COSTMODEL.md §5): zero, 16 bytes per "
              "parameter with Adam (the default), or megatron, Megatron-LM's fp32 gradients (18 in bf16, 20 in fp16; "
              "the default of --search megatron). Plan for the runtime you export to.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where the layer ILPs run: this machine's processes, or a Ray cluster (pip install 'partopt[ray]').")
@click.option("--ray-address", help="With --executor ray: auto (the cluster this machine is in) or HOST:PORT; "
              "default: start a local Ray instance.")
@click.option("--deadline", type=FiniteFloat(), help="Seconds for the whole search: then the best plan found, "
              "marked as stopped early with its gap to a lower bound (Ctrl-C does the same).")
@click.option("-o", "--output", type=click.Path(), help="Write the plan file here.")
@click.option("--json", "as_json", is_flag=True, help="Print exactly the plan file to stdout.")
def solve(graph_file: str, cluster_source: str, nodes: int | None, microbatches: str, layers: int, solver: str,
          time_limit: float, memory_reserve: float, search: str, logical_shapes: str, submeshes: str,
          workers: int | None, recompute: str, no_overlap: bool, schedule: str, profile_file: str | None,
          state_layout: str | None, executor: str,
          ray_address: str | None, deadline: float | None, output: str | None, as_json: bool) -> None:
    """Plan GRAPH on a cluster: pipeline stages, submeshes, logical meshes and per-op shardings.
    The plan is re-derived (as `partopt check` does) before it is written or printed."""
    if output:
        io.check_output(output)
    if search != "megatron" and executor == "local":
        prepare_workers(workers)  # the pool's fork server imports partopt while the instance is read
    graph, cluster = _graph_and_cluster(graph_file, cluster_source, nodes)
    cost_model = read_profile(profile_file) if profile_file else None
    counts = None if microbatches == "auto" else _counts(microbatches, "--microbatches",
                                                         "auto, --microbatches 128 or --microbatches 64,128,256")
    if search == "megatron":
        _refuse_unused(GRID_IGNORES, "--search megatron prices its own grid of layouts in this process",
                       "drop it, or plan with the default search")
    if search == "megatron" and schedule not in ("auto", "1f1b", "interleaved"):
        raise InstanceError(f"--search megatron plans 1f1b and Megatron's interleaved schedule, not {schedule}",
                            "--schedule", "use --schedule auto (both), 1f1b or interleaved, or price one Megatron "
                            f"layout by `partopt evaluate --tp --pp --dp --schedule {schedule}`")
    restrict = {"intra-only": {"intra_only": True}, "inter-only": {"inter_only": True},
                "data-parallel-only": {"data_parallel_only": True},
                "pp-dp": {"stage_data_parallel": True}}.get(search, {})
    err = console(stderr=True)
    with Progress(TextColumn("pricing stage candidates"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("price", total=None)
        layout = {"state_layout": state_layout} if state_layout else {}
        plan = baselines.megatron(graph, cluster, schedule=schedule, backend=solver, time_limit_s=time_limit,
                                  memory_reserve=memory_reserve, recompute=recompute, cost_model=cost_model,
                                  overlap=not no_overlap, **layout) if search == "megatron" else optimize(graph, cluster, progress=lambda done, total: bar.update(task, completed=done, total=total),
                        microbatches=counts or "auto",
                        layers=layers, backend=solver, time_limit_s=time_limit, memory_reserve=memory_reserve,
                        logical_shapes=logical_shapes, submesh_family=submeshes, workers=workers,
                        recompute=recompute, cost_model=cost_model, deadline_s=deadline, overlap=not no_overlap,
                        executor=executor, ray_address=ray_address, schedule=schedule, **layout, **restrict)
    found = check.differences(plan, graph, cluster, "the solved plan", cost_model)
    if found:
        for difference in found:
            click.echo(f"error: {difference.line()}", err=True)
        click.echo("error: the solved plan does not re-derive (a bug in partopt: please report it); nothing written",
                   err=True)
        raise SystemExit(EXIT_INCONSISTENT)
    _emit(plan, output, as_json, cluster_source)


# the options of `solve` that Megatron-LM's grid (`--search megatron`) does not read: it searches its own microbatch
# counts and uniform stages, prices every layout in this process and runs to the end
GRID_IGNORES = ("microbatches", "layers", "logical_shapes", "submeshes", "workers", "executor", "ray_address",
                "deadline")


def _refuse_unused(names: Sequence[str], why: str, hint: str) -> None:
    """An option given on the command line that nothing will read is an error, not silently dropped."""
    ctx = click.get_current_context()
    for name in names:
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            flag = next(_flag(p) for p in ctx.command.params if p.name == name)
            raise InstanceError(f"{why}, and does not read {flag}", flag, hint)


def _graph_and_cluster(graph_file: str, cluster_source: str, nodes: int | None) -> tuple[Graph, Cluster]:
    graph = io.read_graph(graph_file)
    cluster = load_instance(cluster_source)
    if not isinstance(cluster, Cluster):
        raise InstanceError("--cluster must name a cluster file or preset, not a graph", cluster_source,
                            f"give a cluster file or one of the presets: {', '.join(PRESETS)}")
    cluster = cluster if nodes is None else cluster.resized(nodes)
    warn(validate.cluster_warnings(cluster))
    return graph, cluster


def _emit(plan: Plan, output: str | None, as_json: bool, cluster_source: str) -> None:
    """Write the plan file if asked, then print it as JSON or as the stage table and totals; warn first of
    absurd figures and of layer ILPs stopped at the time limit."""
    warn(validate.plan_warnings(plan) + validate.solver_warnings(plan))
    if output:
        write_plan(plan, output)
    if as_json:
        click.echo(plan_text(plan), nl=False)
        return
    out = console()
    for table in _render_plan(plan, calibration_record(cluster_source)):
        out.print(table)
    if output:
        out.print(f"plan written to {output}")


def _counts(text: str | None, flag: str, example: str) -> list[int] | None:
    """An option's comma-separated positive counts (None when not given)."""
    if text is None:
        return None
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise InstanceError(f"{flag} must be positive counts separated by commas, got {text!r}", flag,
                            f"e.g. {flag} {example}")
    return [int(part) for part in parts]


# ---------------------------------------------------------------- evaluate

@main.command("evaluate")
@click.argument("graph_file", metavar="GRAPH")
@click.option("--cluster", "cluster_source", required=True, help="Cluster file or preset name.")
@click.option("--nodes", type=click.IntRange(min=1, max=MAX_NODES), help="Resize the cluster to this many nodes.")
@click.option("--plan", "plan_file", type=click.Path(), help="A plan file to price as written.")
@click.option("--tp", type=click.IntRange(min=1), help="Tensor-parallel degree of a Megatron-style plan.")
@click.option("--pp", type=click.IntRange(min=1), help="Pipeline stages of a Megatron-style plan.")
@click.option("--dp", type=click.IntRange(min=1), help="Data-parallel degree of a Megatron-style plan (default: the "
              "devices / (tp × pp), as Megatron-LM derives it).")
@click.option("--microbatches", type=click.IntRange(min=1),
              help="Microbatch count of a Megatron-style plan (default: searched, the fastest that fits).")
@click.option("--microbatch-size", type=click.IntRange(min=1),
              help="Samples per microbatch per data-parallel rank, Megatron-LM's --micro-batch-size (instead of --microbatches).")
@click.option("--zero", "--distributed-optimizer", "zero", is_flag=True,
              help="Shard optimizer state over the data-parallel axis (Megatron-LM's distributed optimizer, ZeRO-1).")
@click.option("--sequence-parallel", is_flag=True, help="Megatron-LM's sequence parallelism: every norm of a "
              "Megatron-style plan splits its sequence over the tensor-parallel axis (otherwise it runs on every "
              "rank).")
@click.option("--shard-weights", is_flag=True, help="ZeRO-3 / FSDP: every parameter of a Megatron-style plan split "
              "over the data-parallel axis and gathered for each use.")
@click.option("--tp-comm-overlap", is_flag=True, help="Megatron-LM's --tp-comm-overlap (with --sequence-parallel): "
              "tensor-parallel all-gathers and reduce-scatters hidden under the weights' GEMMs "
              "(docs/COSTMODEL.md §5b).")
@click.option("--expert-parallel", type=click.IntRange(min=1), help="Megatron-LM's --expert-model-parallel-size: an "
              "MoE model's experts split over the data-parallel ranks, each rank holding its share whole (EP = dp).")
@click.option("--recompute", type=click.Choice(RECOMPUTE_CHOICES), is_flag=False, flag_value="full",
              help="Recomputation of a Megatron-style plan: auto (default: the fastest that fits), none, selective "
              "or full; --recompute alone means full. A plan file keeps its own.")
@click.option("--schedule", type=click.Choice(SCHEDULES),
              help="Pipeline schedule of a Megatron-style plan (default 1f1b; interleaved with --virtual-stages).")
@click.option("--virtual-stages", type=click.IntRange(min=1),
              help="Megatron-LM's interleaved schedule with V model chunks per stage (its "
              "--num-layers-per-virtual-pipeline-stage is layers / (pp × V)).")
@click.option("--stage-layers", help="Layers of each stage of a Megatron-style plan, first to last, comma-separated "
              "(e.g. 5,6,6,5), for an uneven split (Megatron-LM's --decoder-first/last-pipeline-num-layers, "
              "DeepSpeed's partition methods); default: pp equal stages.")
@click.option("--state-layout", type=click.Choice(costmodel.STATE_LAYOUTS),
              help="How the runtime of a Megatron-style plan lays out parameter state (docs/COSTMODEL.md §5): zero, 16 "
              "bytes per parameter with Adam (the default), or megatron, Megatron-LM's fp32 gradients (18 in bf16, "
              "20 in fp16). A plan file keeps its own.")
@click.option("--solver", type=click.Choice(BACKENDS), default="highs", show_default=True, help="ILP backend.")
@TIME_LIMIT
@click.option("--memory-reserve", type=click.FloatRange(0, 1, max_open=True), default=0.1, show_default=True,
              help="Fraction of device memory kept free.")
@click.option("--no-overlap", is_flag=True, help="Price every communication on the critical path: no gradient "
              "reduction hidden by the backward, no weight gather prefetched under compute, no interleaved send "
              "overlapped (docs/COSTMODEL.md §5b); every cost adds up, the model before overlap.")
@click.option("--profile", "profile_file", type=click.Path(),
              help="Measured op times and collective bandwidths (a partopt.profile file); the analytical model prices the rest.")
@click.option("-o", "--output", type=click.Path(), help="Write the priced plan file here.")
@click.option("--json", "as_json", is_flag=True, help="Print exactly the priced plan file to stdout.")
def evaluate_command(graph_file: str, cluster_source: str, nodes: int | None, plan_file: str | None,
                     tp: int | None, pp: int | None, dp: int | None, microbatches: int | None,
                     microbatch_size: int | None, zero: bool, sequence_parallel: bool, shard_weights: bool,
                     tp_comm_overlap: bool, expert_parallel: int | None, recompute: str | None,
                     schedule: str | None, virtual_stages: int | None, stage_layers: str | None,
                     state_layout: str | None, solver: str, time_limit: float,
                     memory_reserve: float, no_overlap: bool, profile_file: str | None,
                     output: str | None, as_json: bool) -> None:
    """Price a plan of GRAPH under the cost model: a plan file (--plan) or a Megatron-style uniform
    plan (--tp T --pp P [--dp D], D by default the devices / (T × P)): P equal stages, each on a (D, T) mesh, batch over D."""
    if output:
        io.check_output(output)
    graph, cluster = _graph_and_cluster(graph_file, cluster_source, nodes)
    degrees = (tp, pp, dp)
    if (plan_file is None) == all(d is None for d in degrees) or (plan_file is None and None in (tp, pp)):
        raise InstanceError("give either --plan FILE or --tp and --pp (and --dp, by default the devices / (tp × pp))",
                            "partopt evaluate", "for example --plan plan.json, or --tp 8 --pp 2")
    if plan_file is None and dp is None:
        dp = _data_parallel(cluster, tp, pp)
    if plan_file is not None:
        _refuse_unused(MEGATRON_LAYOUT, "--plan prices the plan file as written", "edit the plan file instead")
    if microbatches is not None and microbatch_size is not None:
        raise InstanceError("give --microbatches or --microbatch-size, not both", "partopt evaluate",
                            "--microbatch-size m means batch / (m × dp) microbatches")
    if microbatch_size is not None:
        batch, samples = graph.dims.get(graph.batch_dim or "", 0), microbatch_size * dp
        if not batch or batch % samples:
            raise InstanceError(f"a batch of {batch} does not split into microbatches of {microbatch_size} × {dp} "
                                f"data-parallel ranks", "--microbatch-size", f"choose m with m × {dp} dividing {batch}")
        microbatches = batch // samples
    options = {"backend": solver, "time_limit_s": time_limit, "memory_reserve": memory_reserve,
               "cost_model": read_profile(profile_file) if profile_file else None}
    if plan_file is not None:
        plan = evaluate_plan(graph, cluster, validate.read_checked(plan_file, graph, cluster), where=plan_file,
                                 **options)
    else:
        schedule = schedule or ("interleaved" if (virtual_stages or 1) > 1 else "1f1b")
        plan = uniform(graph, cluster, tp, pp, dp, microbatches, zero, sequence_parallel, schedule, virtual_stages or 1,
                       recompute=recompute or "auto", overlap=not no_overlap, shard_weights=shard_weights,
                       expert_parallel=expert_parallel or 1, tp_comm_overlap=tp_comm_overlap,
                       stage_layers=_counts(stage_layers, "--stage-layers", "5,6,6,5"),
                       state_layout=state_layout or "zero", **options)
    _emit(plan, output, as_json, cluster_source)


# the options of `evaluate` that describe a Megatron-style plan, which a plan file (--plan) holds itself
MEGATRON_LAYOUT = ("microbatches", "microbatch_size", "zero", "sequence_parallel", "shard_weights", "tp_comm_overlap",
                   "expert_parallel", "recompute", "state_layout", "schedule", "virtual_stages", "stage_layers",
                   "no_overlap")


def _data_parallel(cluster: Cluster, tp: int, pp: int) -> int:
    """The data-parallel degree Megatron-LM derives from the world size: the devices / (tp × pp)."""
    if cluster.num_devices % (tp * pp):
        raise InfeasibleError(f"tp × pp = {tp * pp} does not divide the cluster's {cluster.num_devices} devices",
                              "--dp", f"give --tp and --pp whose product divides {cluster.num_devices}: dp is the "
                              "devices / (tp × pp)")
    return cluster.num_devices // (tp * pp)


# ---------------------------------------------------------------- sweep

def _sweep_table(rows: list[sweep_module.Row]) -> Table:
    """The sweep's rows: one per grid point, with the plan's figures or why it has none."""
    table = Table(title="Sweep", box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False)
    varied = any(r.options for r in rows)
    trained = any(r.tokens is not None for r in rows)
    columns = ["model", "cluster", "GPUs", *(["options"] if varied else []), "plan", "recompute", "µbatches",
               "iteration", "TFLOP/s/GPU", "memory", *(["time to train", "GPU-hours"] if trained else []), "ILPs",
               "planning"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "cluster", "options", "plan", "recompute")
                         else "right")
    for r in rows:
        head = [r.model, r.cluster, f"{r.nodes} × {r.gpus // r.nodes}", *([r.options] if varied else [])]
        if r.no_plan:  # the reason is printed under the table: as a cell it would widen the plan column
            width = len(columns) - len(head) - 1
            table.add_row(*map(Text, head), Text("no plan (below)", style="red"), *[""] * (width - 1),
                          fmt_seconds(r.planning_s))
            continue
        train = [_fmt_days(r.time_to_train_s), f"{r.gpu_hours:,.0f}" if r.gpu_hours >= 100 else f"{r.gpu_hours:.3g}"] if trained else []
        table.add_row(*map(Text, [*head, r.plan, r.recompute]), str(r.microbatches), fmt_seconds(r.iteration_time_s),
                      f"{r.tflops_per_gpu:.3g}", fmt_bytes(r.peak_memory_bytes), *train, str(r.ilps_solved),
                      fmt_seconds(r.planning_s))
    return table


def _fmt_days(seconds: float) -> str:
    """A training time in days or hours when it is that long, else in the shared seconds format."""
    if seconds >= 86400:
        return f"{seconds / 86400:,.4g} days"
    return f"{seconds / 3600:.3g} h" if seconds >= 3600 else fmt_seconds(seconds)


@main.command("sweep")
@click.argument("spec_file", metavar="SPEC")
@click.option("-o", "--output", type=click.Path(), help="Write the table as CSV here.")
@click.option("--plot", "plot_file", type=click.Path(), help="Plot throughput per GPU and time to train (.png, .svg).")
@click.option("--tokens", type=FiniteFloat("tokens", "count"),
              help="Training tokens, a count (e.g. 3e11), for time to train and GPU-hours (overrides the spec's).")
def sweep_command(spec_file: str, output: str | None, plot_file: str | None, tokens: float | None) -> None:
    """Plan every model × cluster × node count (× varied option) of a sweep SPEC file and tabulate the best
    plans: throughput per GPU, memory, time to train and GPU-hours; a point with no plan says why."""
    from partopt import sweep as sweep_module

    if output:
        io.check_output(output)
    if plot_file:
        sweep_module.check_plot_path(plot_file)
    spec = sweep_module.read_spec(spec_file)
    if tokens is not None:
        spec = dataclasses.replace(spec, tokens=tokens)
    err = console(stderr=True)
    start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bar:
        grid = bar.add_task("grid points", total=None)
        ilps = bar.add_task("pricing", total=None)

        def point(k: int, total: int, label: str) -> None:
            bar.update(grid, completed=k, total=total)
            bar.update(ilps, description=f"pricing {label}", completed=0, total=None)

        rows = sweep_module.sweep(spec, point, lambda done, total: bar.update(ilps, completed=done, total=total))
    wall = time.perf_counter() - start
    if output:
        sweep_module.write_csv(rows, output)
    if plot_file:
        sweep_module.plot(rows, plot_file)
    out = console()
    out.print(_sweep_table(rows))
    for r in rows:
        if r.no_plan:
            out.print(Text(f"no plan for {r.model} on {r.nodes} × {r.cluster}"
                           f"{f' ({r.options})' if r.options else ''}: {r.no_plan}"))
    planned = sum(1 for r in rows if not r.no_plan)
    out.print(f"{len(rows)} grid points, {planned} planned, {len(rows) - planned} without a plan; "
              f"wall time {fmt_seconds(wall)}")
    for path in (output, plot_file):
        if path:
            out.print(f"wrote {path}")


# ---------------------------------------------------------------- explain, export, draw

@main.command("explain")
@click.argument("plan_file", metavar="PLAN")
@click.option("--ops/--no-ops", default=True, show_default=True, help="List each op's strategy line.")
@click.option("--graph", "graph_file", help="The graph file the plan was made for: with --cluster, each stage's "
              "costliest ops, priced again (compute, collectives, FLOP/s reached).")
@click.option("--cluster", "cluster_source", help="Cluster file or preset name the plan was made for (with --graph).")
@click.option("--nodes", type=click.IntRange(min=1, max=MAX_NODES), help="Resize the cluster to this many nodes.")
@click.option("--profile", "profile_file", type=click.Path(),
              help="The partopt.profile file the plan was priced with, if any.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Ops listed per stage with --graph and --cluster.")
def explain_command(plan_file: str, ops: bool, graph_file: str | None, cluster_source: str | None,
                    nodes: int | None, profile_file: str | None, top: int) -> None:
    """Where PLAN's time and memory go, per stage, and why each op is sharded as it is; with --graph and --cluster,
    which ops its compute goes to."""
    if (graph_file is None) != (cluster_source is None):
        raise InstanceError("--graph and --cluster go together: the ops are priced again on both",
                            "--graph" if graph_file is None else "--cluster", "give both, or neither")
    costliest = None
    if graph_file is not None:
        graph, cluster = _graph_and_cluster(graph_file, cluster_source, nodes)
        plan = validate.read_checked(plan_file, graph, cluster)
        costliest = op_times(plan, graph, cluster, read_profile(profile_file) if profile_file else None)
    else:
        plan = validate.read_checked(plan_file)
    warn(validate.plan_warnings(plan))
    out = console()
    for stage, account in zip(plan.stages, explain(plan)):
        title = (f"Stage {account.index}: layers {stage.layers[0]}–{stage.layers[1]}, submesh "
                 f"({stage.submesh[0]}, {stage.submesh[1]}), logical mesh ({stage.logical_mesh[0]}, {stage.logical_mesh[1]})")
        title += " — time per iteration"
        time_table = Table(title=title, min_width=len(title))  # the title on one line: it names the stage
        time_table.add_column("where")
        time_table.add_column("time", justify="right")
        time_table.add_column("share", justify="right")
        for cause, seconds in account.time_s.items():
            time_table.add_row(cause, fmt_seconds(seconds), _share(seconds, plan.iteration_time_s))
        time_table.add_row("total", fmt_seconds(sum(account.time_s.values())), "100 %", style="bold")
        memory_table = Table(title="memory per device")
        memory_table.add_column("what")
        memory_table.add_column("bytes", justify="right")
        for cause, size in account.memory_bytes.items():
            memory_table.add_row(cause, fmt_bytes(size))
        memory_table.add_row("total", fmt_bytes(sum(account.memory_bytes.values())), style="bold")
        out.print(time_table)
        out.print(memory_table)
        if costliest is not None:
            out.print(_kinds_table(costliest[account.index]))
            out.print(_costliest_table(costliest[account.index], top))
        if ops:
            for line in account.ops:
                out.print(Text(line))
        out.print()


def _kinds_table(times: list[OpTime]) -> Table:
    """A stage's compute per microbatch by op kind, costliest first, with the FLOP/s its kernels reach together."""
    compute = sum(t.compute_s for t in times)
    kinds: dict[str, list[OpTime]] = {}
    for t in times:
        kinds.setdefault(t.kind, []).append(t)
    table = Table(title="compute by op kind, per microbatch")
    for column in ("kind", "ops", "compute", "share", "FLOP", "FLOP/s"):
        table.add_column(column, justify="left" if column == "kind" else "right")
    for kind, ts in sorted(kinds.items(), key=lambda item: -sum(t.compute_s for t in item[1])):
        seconds, flops = sum(t.compute_s for t in ts), sum(t.flops for t in ts)
        table.add_row(kind, str(len(ts)), fmt_seconds(seconds), _share(seconds, compute),
                      fmt_scaled(flops, "FLOP"), fmt_scaled(flops / seconds, "FLOP/s") if seconds else "—")
    return table


def _costliest_table(times: list[OpTime], top: int) -> Table:
    """A stage's `top` costliest ops per microbatch, with their share of its compute and the FLOP/s they reach."""
    compute = sum(t.compute_s for t in times)
    table = Table(title=f"costliest {min(top, len(times))} of {len(times)} ops, per microbatch")
    for column in ("op", "kind", "compute", "share", "collectives", "FLOP", "FLOP/s"):
        table.add_column(column, justify="left" if column in ("op", "kind") else "right")
    for t in times[:top]:
        table.add_row(t.op, t.kind, fmt_seconds(t.compute_s), _share(t.compute_s, compute), fmt_seconds(t.comm_s),
                      fmt_scaled(t.flops, "FLOP"), fmt_scaled(t.flop_rate, "FLOP/s"))
    return table


def _share(part: float, whole: float) -> str:
    """`part` as a percentage of `whole` ("—" of nothing)."""
    return f"{100 * part / whole:.1f} %" if whole else "—"


@main.command("export")
@click.argument("plan_file", metavar="PLAN")
@click.option("--to", "target", required=True, type=click.Choice(TARGETS), help="The runtime to export for.")
@click.option("--model", "source", help="dtensor: the PyTorch model PLAN's graph was imported from (a Hugging Face "
                                        "CONFIG.json or `pkg.mod:make`): parameters' Shard(k) then index its torch axes.")
def export_command(plan_file: str, target: str, source: str | None) -> None:
    """Turn PLAN into Megatron-LM arguments, JAX PartitionSpecs or PyTorch DTensor placements."""
    shapes = None
    if source is not None and target != "dtensor":  # only DTensor placements index a torch model's axes
        raise InstanceError(f"--model maps parameters onto a PyTorch model's axes, which --to {target} does not use",
                            "--model", "drop --model, or export with --to dtensor")
    if source is not None:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from partopt.frontends.torch import param_shapes

        shapes = param_shapes(source)
    plan = validate.read_checked(plan_file)
    try:
        text = export(plan, target, shapes)
    except PartoptError as err:  # a refusal names the plan file before its place in it
        raise err.located(plan_file) from None
    if target == "megatron":
        warn(megatron_warnings(plan))
    click.echo(text)


VERIFY_TARGETS = ("jax", "torch")


@main.command("verify")
@click.argument("plan_file", metavar="PLAN")
@click.option("--against", required=True, type=click.Choice(VERIFY_TARGETS), help="The framework to run the plan in.")
@click.option("--model", "source", required=True,
              help="The model PLAN was solved for, as for import: `pkg.mod:make_model` or `file.py:make_model` "
                   "(torch: also a Hugging Face CONFIG.json).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object (torch).")
def verify_command(plan_file: str, against: str, source: str, as_json: bool) -> None:
    """Run PLAN's shardings in a framework on host CPU devices (JAX) or gloo CPU processes (PyTorch DTensor):
    per stage, loss and gradients against the unsharded run, and the collectives run against the plan's.
    Exit 1 on a mismatch."""
    if against == "torch":
        _verify_torch(plan_file, source, as_json)
        return
    import os
    import subprocess

    needed = max(math.prod(s.logical_mesh) for s in read_plan(plan_file).stages)
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                                     f"--xla_force_host_platform_device_count={needed}".strip())
    done = subprocess.run([sys.executable, "-m", "partopt.verify_jax", plan_file, source], env=env,
                          capture_output=True, text=True)
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise PartoptError(f"the verification process failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}",
                           "partopt verify", "run python -m partopt.verify_jax PLAN SOURCE to see it whole") from None
    if "error" in result:
        raise PartoptError(result["error"])
    out = console()
    for stage in result["stages"]:
        _render_verification(out, stage)
    out.print("verified: the plan runs as planned" if result["ok"] else "MISMATCH: see the stages above")
    if not result["ok"]:
        raise SystemExit(1)


def _verify_torch(plan_file: str, source: str, as_json: bool) -> None:
    from partopt.verify_torch import verify_plan

    report = verify_plan(validate.read_checked(plan_file), source)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for line in report.lines():
            click.echo(line)
    if not report.ok:
        raise SystemExit(1)


def _render_verification(out: Console, stage: dict[str, Any]) -> None:
    """One stage's verification: numerics, then compiled vs planned collectives per (kind, mesh axis)."""
    numerics = "match" if stage["numerics_ok"] else "DIFFER"
    out.print(f"stage {stage['stage']} on a {stage['mesh'][0]} x {stage['mesh'][1]} mesh: loss {stage['loss']:.6g} "
              f"(unsharded {stage['reference_loss']:.6g}), largest gradient difference {stage['max_grad_error']:.2g}: "
              f"{numerics}")
    totals: dict[tuple[str, str], list[float]] = {}
    for side, key in ((0, "compiled"), (1, "planned")):
        for c in stage[key]:
            totals.setdefault((c["kind"], c["axis"]), [0.0, 0.0])[side] += c["bytes"]
    table = Table(title=f"stage {stage['stage']}: collectives of one training step (one microbatch)", box=box.SIMPLE)
    for column in ("collective", "mesh axis", "compiled", "planned"):
        table.add_column(column, justify="right" if column in ("compiled", "planned") else "left")
    for (kind, axis), (got, want) in sorted(totals.items()):
        table.add_row(kind, axis, fmt_bytes(got), fmt_bytes(want))
    out.print(table)
    for line in stage["mismatches"]:
        out.print(Text(f"mismatch: {line}"))


@main.command("draw")
@click.argument("plan_file", metavar="PLAN")
@click.option("-o", "--output", required=True, type=click.Path(), help="Image file: .svg or .png.")
@click.option("--schedule", type=click.Choice(SCHEDULES), help="Pipeline schedule (default: the plan's).")
@click.option("--virtual-stages", type=click.IntRange(min=1),
              help="Model chunks per stage (v) of the interleaved schedule: 2 or more (default: the plan's).")
def draw_command(plan_file: str, output: str, schedule: str | None, virtual_stages: int | None) -> None:
    """Draw PLAN's pipeline schedule of one iteration and its memory per stage."""
    from partopt.draw import draw

    io.check_output(output)
    draw(validate.read_checked(plan_file), output, schedule, virtual_stages=virtual_stages)
    click.echo(f"wrote {output}")


@main.command("check")
@click.argument("plan_file", metavar="PLAN")
@click.option("--graph", "graph_file", required=True, help="The graph file the plan was made for.")
@click.option("--cluster", "cluster_source", required=True, help="Cluster file or preset name.")
@click.option("--nodes", type=click.IntRange(min=1, max=MAX_NODES), help="Resize the cluster to this many nodes.")
@click.option("--profile", "profile_file", type=click.Path(),
              help="Measured op times and collective bandwidths (a partopt.profile file); the analytical model prices the rest.")
def check_command(plan_file: str, graph_file: str, cluster_source: str, nodes: int | None,
                  profile_file: str | None) -> None:
    """Re-derive every figure of PLAN from scratch on its graph and cluster (devices, stage times, memory
    against the device budget, iteration time) and list those that differ; exit 0 when all agree, 1 if not."""
    graph, cluster = _graph_and_cluster(graph_file, cluster_source, nodes)
    found = check.differences(read_plan(plan_file), graph, cluster, plan_file,
                              read_profile(profile_file) if profile_file else None)
    for difference in found:
        click.echo(f"{plan_file}: {difference.line()}")
    if found:
        click.echo(f"{plan_file}: {len(found)} figures differ from their re-derivation", err=True)
        raise SystemExit(EXIT_INCONSISTENT)
    click.echo(f"{plan_file}: consistent (every figure re-derived within a relative {validate.TOLERANCE:g})")


# ---------------------------------------------------------------- calibrate

def _percent(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1%}"


@main.command("calibrate")
@click.argument("points_file", metavar="POINTS")
@click.option("--preset", "preset_name", required=True, type=click.Choice(PRESETS), help="The cluster preset to fit.")
@click.option("--fit", "fit_names", help="Comma-separated parameters to fit instead of the points file's `fit` "
              "(e.g. matmul_efficiency,intra_bus_efficiency: try a set without editing the file). Empty (--fit ''): "
              "fit nothing, price the points at the preset's values (an out-of-sample check).")
@click.option("-o", "--output", type=click.Path(),
              help="Write the preset's data file here: a cluster file with the fitted values and their provenance "
              "(partopt/presets/<preset>.json in the package makes it the preset).")
@click.option("--workers", type=click.IntRange(min=1),
              help="Processes pricing the points at once, each its own ILPs (default: one per core).")
def calibrate_command(points_file: str, preset_name: str, fit_names: str | None, output: str | None,
                      workers: int | None) -> None:
    """Fit a preset's physical parameters to the measured runs of POINTS (least squares on log error),
    printing each point's fitted and leave-one-out error (docs/COSTMODEL.md §7)."""
    from partopt import calibrate  # numpy-heavy fitting, needed by this command only

    names = None if fit_names is None else [n.strip() for n in fit_names.split(",")]
    if names is not None and "" in names:
        if fit_names.strip():  # '' alone fits nothing; an empty name beside others is a typo
            raise InstanceError(f"--fit {fit_names!r} names an empty parameter", "--fit",
                                "separate parameter names by single commas, or give --fit '' to fit nothing")
        names = []
    if output and names == []:
        raise click.UsageError("--fit '' fits nothing: there is no data file to write (drop -o)")
    if output:
        io.check_output(output)
    points = calibrate.read_points(points_file)
    with console(stderr=True).status(f"fitting {preset_name} to {len(points.points)} points …"):
        result = calibrate.fit(points, preset_name, names, where="--fit" if names is not None else None,
                               workers=workers)
    out = console()
    params = Table(title=f"{preset_name}: parameters", title_justify="left")
    for column in ("parameter", "unit", "start", "value", "", "meaning"):
        params.add_column(column)
    for name, value in result.values.items():
        fitted = name in result.fitted
        params.add_row(name, calibrate.PARAMETERS[name].unit, f"{result.start[name]:.4g}" if fitted else "",
                       f"{value:.4g}", "fitted" if fitted else "kept", calibrate.PARAMETERS[name].doc)
    out.print(params)
    checked = not result.fitted  # a check: every error is out of sample, at the preset's values
    table = Table(title=f"{preset_name}: predicted / measured throughput − 1", title_justify="left")
    for column in ("point", *(("error at the preset's values",) if checked else ("fitted error", "leave-one-out error")),
                   "source"):
        table.add_column(column)
    for r in result.results:
        table.add_row(Text(r.label), _percent(r.error), *(() if checked else (_percent(r.loo_error),)), Text(r.source))
    out.print(table)
    if checked:
        errors = sorted(abs(r.error) for r in result.results)
        out.print(f"|error| at the preset's values (nothing fitted): median {statistics.median(errors):.1%}, "
                  f"max {errors[-1]:.1%}; {result.evaluations} point predictions (plans priced)")
        return
    loo = sorted(abs(r.loo_error) for r in result.results if r.loo_error is not None)
    if loo:
        out.print(f"leave-one-out |error|: median {statistics.median(loo):.1%}, max {loo[-1]:.1%}; "
                  f"{result.evaluations} point predictions (plans priced)")
    if output:
        io.write_json(result.to_dict(points_file), output)
        out.print(f"wrote {output}")


@main.group("reproduce")
def reproduce_group() -> None:
    """Reproduce published benchmarks under partopt's cost model."""


@reproduce_group.command("alpa")
@click.option("--quick", is_flag=True, help="GPT only, up to 8 GPUs.")
def reproduce_alpa(quick: bool) -> None:
    """Alpa's Figure 7 cases with every planner, beside the paper's figures (scripts/reproduce_alpa.py also
    writes docs/benchmarks.md, the figure and the ablation)."""
    from partopt.bench import alpa, harness, report  # the benchmarks are not the planner: loaded only here

    out = console()
    selected = alpa.cases(["gpt"], alpa.QUICK_MAX_GPUS) if quick else alpa.cases()
    results = harness.run(selected, lambda case, planner: out.log(
        f"{case.instance} on {case.gpus} GPUs: {alpa.PLANNER_TITLES[planner]}"))
    for model in alpa.MODELS:
        for title, (header, rows) in ((f"{model}: per-GPU TFLOP/s, predicted (paper)", report.results_rows(model, results)),
                                      (f"{model}: plans", report.plan_rows(model, results))):
            if rows:
                table = Table(title=title)
                for column in header:
                    table.add_column(column)
                for row in rows:
                    table.add_row(*row)
                out.print(table)
    found = harness.checks(results)
    for claim in found:
        out.print(f"{'PASS' if claim.passed else 'FAIL'} {claim.name} — {claim.detail}")
    if not all(claim.passed for claim in found):
        raise SystemExit(1)  # a claim of the paper does not hold under the model: say so to scripts and CI


