"""Write the model-zoo instance files instances/<name>.json, one per named model of
partopt.models.PRESETS (run from anywhere); `--check` only reports stale or missing files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from partopt.io import graph_to_dict, write_graph
from partopt.models import PRESETS, preset

OUT = Path(__file__).resolve().parent.parent / "instances"


def is_current(path: Path, data: dict) -> bool:
    """True when `path` holds exactly the graph `data`."""
    if not path.exists():
        return False
    with open(path, encoding="utf-8") as f:
        return json.load(f) == data


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, verify) every named model; prints one line per file."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help="named models to write (default: all)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in PRESETS]
    if unknown:
        parser.error(f"unknown named models {unknown}; known: {', '.join(PRESETS)}")
    stale = []
    if not args.check:
        print(f"{'file':24s} {'ops':>5s} {'params':>16s} {'KB':>8s}")
    for name in args.names or PRESETS:
        graph, path = preset(name), OUT / f"{name}.json"
        if args.check:
            if not is_current(path, graph_to_dict(graph)):
                stale.append(path.name)
            continue
        write_graph(graph, path)
        print(f"{path.name:24s} {len(graph.ops):5d} {graph.num_params:16,d} {path.stat().st_size / 1e3:8.1f}")
    if stale:
        print(f"stale or missing: {', '.join(stale)} (run scripts/make_instances.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
