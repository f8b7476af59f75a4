"""partopt.units: prefixes and significant digits by hand."""

from __future__ import annotations

from partopt.units import fmt_bytes, fmt_scaled, fmt_seconds


def test_fmt_scaled_si_and_binary():
    assert fmt_scaled(3.2e12, "FLOP") == "3.2 TFLOP"
    assert fmt_scaled(999, "FLOP") == "999 FLOP"
    assert fmt_scaled(123456, "FLOP") == "123 kFLOP"  # three significant digits
    assert fmt_scaled(2 * 1024**2, "B", binary=True) == "2 MiB"
    assert fmt_scaled(5 * 1024**6, "B", binary=True) == "5.12e+03 PiB"  # past the last prefix: no more division


def test_fmt_bytes_is_the_binary_scale():
    assert fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(16 * 1024**3) == "16 GiB"
    assert fmt_bytes(-2048) == "-2 KiB"


def test_fmt_seconds():
    assert fmt_seconds(0.00021) == "210 µs"
    assert fmt_seconds(0.021) == "21 ms"
    assert fmt_seconds(2.5) == "2.5 s"
