"""A guard against PySide6 reference-counting bugs on the singletons ``None``, ``True`` and ``False``.

PySide6 6.12.0 returns ``None`` from every void method and ``True`` from ``Signal.emit()`` without taking a
reference to them, and 6.11.2 still drops one reference to ``None`` per ``QTimer.singleShot`` functor call.
On Python 3.12+ those objects are immortal and nothing happens; on Python 3.11 each call drops one
reference, and after some thousands (seconds of hovering over a pyqtgraph plot) the interpreter aborts with
"Fatal Python error: none_dealloc" or "bool_dealloc". :func:`make_singletons_immortal` gives the three
objects enough spare references to outlive any session, which is what Python 3.12 does for them.
"""

from __future__ import annotations

import ctypes
import sys

SPARE_REFERENCES = 1 << 40
_done = False


def make_singletons_immortal() -> None:
    """Once per process on CPython < 3.12: spare references for ``None``, ``True`` and ``False``."""
    global _done
    if _done or sys.version_info >= (3, 12) or sys.implementation.name != "cpython":
        return
    _done = True
    for obj in (None, True, False):
        # ob_refcnt is the first field of every CPython object; these three are never freed anyway.
        ctypes.c_ssize_t.from_address(id(obj)).value += SPARE_REFERENCES
