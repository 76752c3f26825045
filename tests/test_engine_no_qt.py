"""The engine (everything but acstudio.gui) must import and work without Qt."""

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import acstudio
names = [m.name for m in pkgutil.walk_packages(acstudio.__path__, "acstudio.")
         if not m.name.startswith("acstudio.gui") and m.name != "acstudio.__main__"]
for name in names:
    importlib.import_module(name)
qt = sorted(m for m in sys.modules if m.split(".")[0] in ("PySide6", "pyqtgraph", "shiboken6"))
print(len(names), qt)
assert not qt, qt
"""


def test_engine_imports_without_qt():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    count = int(out.stdout.split()[0])
    assert count >= 10  # workload, capture, profile, plan, simulate, rewrite, export, bench, cli, ...
