"""Write every cluster preset to instances/clusters/<name>.json (run from anywhere), with the provenance
of its fitted values when it has a data file (partopt/presets/<name>.json)."""

from __future__ import annotations

from pathlib import Path

from partopt.cluster import PRESETS, cluster_to_dict, preset, preset_calibration
from partopt.io import write_json

OUT = Path(__file__).resolve().parent.parent / "instances" / "clusters"


def main() -> None:
    """Write one canonical cluster file per preset."""
    OUT.mkdir(parents=True, exist_ok=True)
    for name in PRESETS:
        data = cluster_to_dict(preset(name))
        calibration = preset_calibration(name)
        if calibration is not None:
            data["calibration"] = calibration
        write_json(data, OUT / f"{name}.json")


if __name__ == "__main__":
    main()
