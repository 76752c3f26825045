"""Memory budgets as people type them ("6GiB", "1.5GB", "60%") and byte counts as people read them."""

from __future__ import annotations

import math
import re

from acstudio.errors import ACStudioError

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
MAX_BUDGET_BYTES = 2**53  # 8192 TiB: past any device, and the most a plan file holds exactly
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*|%)\s*$", re.IGNORECASE)


def parse_budget(text: str, baseline_peak_bytes: int) -> int:
    """Bytes for ``text``: a number with a unit, or a percentage of the baseline (no-AC) peak.

    Units: B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB and the short K, M, G, T (powers of 1024).
    A bare number is refused: "85" meant as 85% or 85 GiB would silently be 85 bytes.
    """
    m = _PATTERN.match(str(text))
    if not m:
        raise ACStudioError(
            f"cannot read the memory budget {text!r} — give a size such as 6GiB, 5000MiB or 1.5GB, or a "
            "percentage of the peak without checkpointing such as 60%")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not unit:
        raise ACStudioError(f"the memory budget {text!r} has no unit — write {m.group(1)}% (of the peak without "
                            f"checkpointing), {m.group(1)}MiB or {m.group(1)}GiB ({m.group(1)}B for bytes)")
    if unit == "%":
        nbytes = value / 100 * baseline_peak_bytes
    elif unit in _UNITS:
        nbytes = value * _UNITS[unit]
    else:
        raise ACStudioError(f"unknown unit {m.group(2)!r} in the memory budget {text!r} — use B, KB, MB, GB, "
                            "KiB, MiB, GiB (or K, M, G) or %")
    if not math.isfinite(nbytes) or nbytes < 1:
        raise ACStudioError(f"the memory budget must be at least one byte, got {text!r} — give a positive size")
    if nbytes > MAX_BUDGET_BYTES:
        raise ACStudioError(f"the memory budget {text!r} is more than 8192TiB — give a size from 1B to 8192TiB")
    return round(nbytes)


def format_bytes(n: int) -> str:
    """``"5.91 GiB"``: binary units, two decimals; plain bytes below 1 KiB."""
    size = abs(n)
    if size < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{'-' if n < 0 else ''}{size:.2f} {unit}"
