"""The PyTorch commands of the CLI: `partopt import torch|hf` and `partopt verify --against torch`.

cli.py registers them with `register(main)`; torch is imported only when one of them runs, so
`partopt --help` stays fast.
"""

from __future__ import annotations

import json

import click

from partopt import io
from partopt.graph import Graph


def _wrote(output: str, graph: Graph) -> None:
    io.write_graph(graph, output)
    click.echo(f"wrote {output}: {graph.name}, {len(graph.ops)} ops, {graph.num_params:,} parameters, "
               f"{len(set(op.layer for op in graph.ops))} layers")


@click.command("torch")
@click.argument("source")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Graph file to write.")
@click.option("--name", help="Name of the graph (default: the module's class).")
@click.option("--dtype", help="Element type of the graph (default: the parameters').")
@click.option("--loss", is_flag=True, help="Add a cross entropy of the output against labels shaped like the first input.")
@click.option("--opaque", is_flag=True, help="Map unmapped ops to opaque ops (the IR has none yet: an error says so).")
def import_torch(source: str, output: str, name: str | None, dtype: str | None, loss: bool, opaque: bool) -> None:
    """Import SOURCE (pkg.mod:make or file.py:make, returning (module, example_inputs), called on the meta device)."""
    from partopt.frontends.torch import from_module, load_source

    module, inputs = load_source(source)
    _wrote(output, from_module(module, inputs, name=name, dtype=dtype, loss=loss, opaque=opaque))


@click.command("hf")
@click.argument("config", metavar="CONFIG.json", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Graph file to write.")
@click.option("--batch", type=click.IntRange(min=2), required=True, help="Global batch size (sequences).")
@click.option("--seq", type=click.IntRange(min=2), required=True, help="Sequence length.")
@click.option("--name", help="Name of the graph (default: the config's model_type).")
@click.option("--dtype", help="Element type of the graph (default: the parameters', fp32 from a config).")
@click.option("--opaque", is_flag=True, help="Map unmapped ops to opaque ops (the IR has none yet: an error says so).")
def import_hf(config: str, output: str, batch: int, seq: int, name: str | None, dtype: str | None, opaque: bool) -> None:
    """Import a Hugging Face causal LM from its CONFIG.json (no weights, nothing downloaded) with its loss."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from partopt.frontends.torch import from_hf_config, read_hf_config

    _wrote(output, from_hf_config(read_hf_config(config), batch=batch, seq=seq, dtype=dtype, name=name, opaque=opaque))


@click.command("verify")
@click.argument("plan_file", metavar="PLAN", type=click.Path(exists=True, dir_okay=False))
@click.option("--against", type=click.Choice(["torch"]), required=True, help="The framework to run the plan in.")
@click.option("--model", "source", required=True,
              help="The model: a Hugging Face CONFIG.json, or pkg.mod:make / file.py:make returning (module, inputs).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def verify(plan_file: str, against: str, source: str, as_json: bool) -> None:
    """Run one training step of PLAN's shardings with DTensor on gloo CPU processes and compare loss,
    gradients and collectives with the unsharded step; exit code 1 on a mismatch."""
    from partopt.plan import read_plan
    from partopt.verify_torch import verify_plan

    report = verify_plan(read_plan(plan_file), source)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for line in report.lines():
            click.echo(line)
    if not report.ok:
        raise SystemExit(1)


def register(main: click.Group) -> None:
    """Add `import torch`, `import hf` (to the `import` group, made here if cli.py has none) and `verify`."""
    group = main.commands.get("import")
    if not isinstance(group, click.Group):
        group = click.Group("import", help="Import a model from a framework as a partopt graph file.")
        main.add_command(group)
    group.add_command(import_torch)
    group.add_command(import_hf)
    main.add_command(verify)
