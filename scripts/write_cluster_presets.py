"""Write every cluster preset to instances/clusters/<name>.json (run from anywhere)."""

from __future__ import annotations

from pathlib import Path

from partopt.cluster import PRESETS, preset
from partopt.io import write_cluster

OUT = Path(__file__).resolve().parent.parent / "instances" / "clusters"


def main() -> None:
    """Write one canonical cluster file per preset."""
    OUT.mkdir(parents=True, exist_ok=True)
    for name in PRESETS:
        write_cluster(preset(name), OUT / f"{name}.json")


if __name__ == "__main__":
    main()
