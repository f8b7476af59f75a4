"""Write every cluster preset to instances/clusters/<name>.json (run from anywhere)."""

from __future__ import annotations

import json
from pathlib import Path

from partopt.cluster import PRESETS, cluster_to_dict, preset

OUT = Path(__file__).resolve().parent.parent / "instances" / "clusters"


def main() -> None:
    """Write one JSON file per preset, indented, with a trailing newline."""
    OUT.mkdir(parents=True, exist_ok=True)
    for name in PRESETS:
        with open(OUT / f"{name}.json", "w") as f:
            json.dump(cluster_to_dict(preset(name)), f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
