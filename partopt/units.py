"""Human-readable quantities for messages and tables."""

from __future__ import annotations

SI_PREFIXES = ("", "k", "M", "G", "T", "P", "E")
BINARY_PREFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi")


def fmt_scaled(value: float, unit: str, binary: bool = False) -> str:
    """`value` with an SI (or binary) prefix, three significant digits: 3.2e12 FLOP -> '3.2 TFLOP'."""
    base, prefixes = (1024, BINARY_PREFIXES) if binary else (1000, SI_PREFIXES)
    i = 0
    while abs(value) >= base and i < len(prefixes) - 1:
        value /= base
        i += 1
    return f"{value:.3g} {prefixes[i]}{unit}"


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary prefixes, three significant digits."""
    return fmt_scaled(n, "B", binary=True)


def fmt_seconds(t: float) -> str:
    """0.00021 -> '210 µs'."""
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"
