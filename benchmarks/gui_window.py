"""The app as a user sees it, in a real window (run it under X or Xvfb), measured.

Usage::

    python benchmarks/gui_window.py [PROFILE] [--no-dot] [--wait 5] [--screenshot OUT.png]

Opens PROFILE (default: the bundled ResNet-152 sample) in a 1600x1000 window and prints one JSON line:

* ``engine``: the graph layout used (``dot`` or ``layered``; ``--no-dot`` hides graphviz);
* ``graph_paint_s``: from the background load finishing (profile read, plan and graph prepared) to the graph's
  first paint on screen, wall clock, and ``graph_paint_cpu_s``, the CPU time the process spent meanwhile (what
  the wall clock would be on an idle machine);
* ``readable``: the boxes wholly inside the graph's viewport whose labels read at 9 pt or more, ``--wait``
  seconds after launch;
* ``expand``, ``expand_ms``: the biggest module shown, opened by the same call a click makes, and the time
  until it is drawn;
* ``lifetime``: the marks the timeline shows after the biggest recomputed activation is selected in the table.

``--screenshot`` saves the window (back at the launch view, or with the module still open with ``--keep-open``;
the activation still selected) as a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def hide_dot() -> None:
    """Drop every PATH entry that holds graphviz ``dot``."""
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "dot").exists()]
    os.environ["PATH"] = os.pathsep.join(keep)


def wait(app, done, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        app.processEvents()
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.001)
    app.processEvents()


def measure(profile: Path, wait_s: float, screenshot: str | None, keep_open: bool = False) -> dict:
    from PySide6.QtCore import QEvent, QObject, QSettings
    from PySide6.QtWidgets import QApplication

    from acstudio.gui import main_window
    from acstudio.gui.dialogs import Messages
    from acstudio.gui.main_window import MainWindow
    from acstudio.gui.qtcompat import make_singletons_immortal

    loaded_at: list[float] = []
    painted_at: list[float] = []
    open_document = main_window.open_document

    def timed_open(*args, **kwargs):
        result = open_document(*args, **kwargs)
        loaded_at.append((time.monotonic(), time.process_time()))
        return result

    main_window.open_document = timed_open

    class FirstPaint(QObject):
        def eventFilter(self, watched, event):
            if event.type() == QEvent.Type.Paint and graph.view is not None and not painted_at:
                painted_at.append((time.monotonic(), time.process_time()))
            return False

    class Quiet(Messages):
        def error(self, title, message, details=""):
            raise SystemExit(f"{title}: {message}")

    launched = time.monotonic()
    make_singletons_immortal()
    app = QApplication.instance() or QApplication(["acstudio"])
    with tempfile.TemporaryDirectory() as tmp:
        settings = QSettings(os.path.join(tmp, "settings.ini"), QSettings.Format.IniFormat)
        window = MainWindow(settings=settings, cache_dir=tmp, messages=Quiet(None), data_dir=tmp)
        window.resize(1600, 1000)
        window.show()
        graph = window.graph
        spy = FirstPaint()
        graph.canvas.viewport().installEventFilter(spy)
        window.open_path(str(profile))
        wait(app, lambda: bool(painted_at))
        painted, painted_cpu = (b - a for a, b in zip(loaded_at[0], painted_at[0]))
        wait(app, lambda: window.session.state is not None and window.session.state.complete)
        while time.monotonic() - launched < wait_s:
            app.processEvents()
            time.sleep(0.01)
        readable = [it.label.split("\n")[0] for it in graph.view.items if it.key in set(graph.readable_boxes())]
        groups = [it for it in graph.view.items if it.is_group]
        biggest = max(groups, key=lambda it: len(it.nodes)).key
        ready = (graph.expanded | {biggest}, graph.regions) in graph._layouts
        t0 = time.perf_counter()
        graph.expand(biggest)
        wait(app, lambda: biggest in graph.expanded and not graph.runner.busy)
        expand_ms = (time.perf_counter() - t0) * 1e3
        inside = sum(1 for it in graph.view.items if it.key.startswith(biggest + "/"))
        table = window.table_model
        row = max(range(table.rowCount()), key=lambda r: (table.value(r, "decision") == "recompute",
                                                          table.value(r, "bytes")))
        window.table.selectRow(window.table_proxy.mapFromSource(table.index(row, 0)).row())
        app.processEvents()
        lifetime = [what for what, _i in window.timeline.lifetime]
        if not keep_open:
            graph.set_expanded(graph.tree.default_expansion())  # back to what the window opened on
            wait(app, lambda: not graph.runner.busy)
            graph.fit_readable()
        app.processEvents()
        if screenshot:  # with the other solvers on the Pareto chart
            wait(app, lambda: not window.runners["sweep"].busy, timeout_s=300)
            window.grab().save(screenshot)
        result = {"profile": profile.name, "engine": graph.layout.engine, "graph_paint_s": round(painted, 3),
                  "graph_paint_cpu_s": round(painted_cpu, 3),
                  "readable": readable, "expand": biggest, "expand_ms": round(expand_ms, 1), "laid_out_ahead": ready,
                  "expanded_boxes": inside, "lifetime": lifetime, "notice": graph.notice}
        window.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile", nargs="?")
    parser.add_argument("--no-dot", action="store_true", help="lay the graph out without graphviz")
    parser.add_argument("--wait", type=float, default=5.0, help="seconds after launch before looking")
    parser.add_argument("--screenshot", help="save the window to this PNG")
    parser.add_argument("--keep-open", action="store_true", help="leave the biggest module open in the screenshot")
    opts = parser.parse_args(argv)
    if opts.no_dot:
        hide_dot()
    from acstudio.gui.app import default_profile_path

    profile = Path(opts.profile) if opts.profile else default_profile_path()
    if profile is None:
        raise SystemExit("no profile given and no sample bundled")
    print(json.dumps(measure(profile, opts.wait, opts.screenshot, opts.keep_open)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
