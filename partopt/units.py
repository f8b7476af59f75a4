"""Human-readable quantities for messages and tables."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary prefixes, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_seconds(t: float) -> str:
    """0.00021 -> '0.21 ms'."""
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"
