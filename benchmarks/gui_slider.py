"""How fast the window answers the budget slider and how fast it launches, measured offscreen.

Usage::

    python benchmarks/gui_slider.py [PROFILE] [--steps 40]

PROFILE defaults to the bundled sample (ResNet-152, batch 64, measured on an H200). For each of ``--steps``
slider positions from the baseline peak down to the floor it reports:

* ``quick``: the committed budget's immediate update, read off the μ-TWO trajectory: labels, Pareto point,
  graph colours and the activation table, including the repaint;
* ``full``: time until the complete plan (schedule) and its simulated timeline are drawn, when that step
  was never shown before (computed in the background, the window stays live meanwhile; ``stall`` is the
  longest the event loop went without running during that time);
* ``cached``: the same positions again: everything, timeline included, from the per-step cache.

``quick_cpu`` and ``cached_cpu`` are the GUI thread's own CPU time for those steps, a lower bound of the wall
times: the work without the waits for a core or for the interpreter that other work on a 2-core machine adds.

Launch is measured in fresh processes: interpreter start to an interactive window (profile loaded, graph
drawn, first plan complete), once with an empty layout cache and once with the cache the first run left; the
app process's CPU time until then is given too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


def load_average() -> str:
    """The machine's 1, 5 and 15 minute load averages: other work on a small machine inflates every time here."""
    return " / ".join(f"{v:.2f}" for v in os.getloadavg())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(name: str, values: list[float]) -> str:
    return (f"{name:10s} median {statistics.median(values):7.1f} ms   p95 {percentile(values, 0.95):7.1f} ms   "
            f"max {max(values):7.1f} ms   (n={len(values)})")


def open_window(profile: Path, cache_dir: str):
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from acstudio.gui.dialogs import Messages
    from acstudio.gui.main_window import MainWindow

    class Quiet(Messages):
        def error(self, title, message, details=""):
            raise SystemExit(f"{title}: {message}")

    app = QApplication.instance() or QApplication(["gui_slider"])
    settings = QSettings(os.path.join(cache_dir, "settings.ini"), QSettings.Format.IniFormat)
    window = MainWindow(settings=settings, cache_dir=cache_dir, messages=Quiet(None), data_dir=cache_dir)
    window.resize(1600, 1000)
    window.show()
    window.open_path(str(profile))
    wait(app, lambda: window.session.state is not None and window.session.state.complete
         and window.graph.view is not None and not window.graph.runner.busy)
    return app, window


def wait(app, done, timeout_s: float = 300.0) -> float:
    """Process events until ``done()``; returns the longest gap between two passes of the loop (ms)."""
    deadline = time.monotonic() + timeout_s
    last, stall = time.perf_counter(), 0.0
    while not done():
        app.processEvents()
        now = time.perf_counter()
        stall, last = max(stall, now - last), now
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.001)
    app.processEvents()
    return stall * 1e3


def launch_child(profile: str, cache_dir: str) -> None:
    """Child of ``--launch``: open the window and print when it is interactive."""
    app, window = open_window(Path(profile), cache_dir)
    print(json.dumps({"interactive": True, "engine": window.graph.layout.engine, "cpu_s": time.process_time()}),
          flush=True)
    window.close()
    app.processEvents()


def measure_launch(profile: Path) -> list[tuple[str, float, str, float, float]]:
    """Wall time from starting the child to its "interactive" line (closing the window and the process exit,
    which wait for background jobs, are not part of the launch), the child's CPU time until then, and the wall
    time until it has exited."""
    out = []
    with tempfile.TemporaryDirectory() as cache:
        for label in ("first run (empty layout cache)", "second run (cached layout)"):
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, __file__, "--launch-child", str(profile), cache],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            line = next((ln for ln in proc.stdout if ln.startswith("{")), "")
            wall = time.perf_counter() - t0
            proc.stdout.read()
            if proc.wait() != 0 or not line:
                raise SystemExit(f"the launch child failed (exit code {proc.returncode})")
            child = json.loads(line)
            out.append((label, wall, child["engine"], child["cpu_s"], time.perf_counter() - t0))
    return out


def measure_slider(profile: Path, steps: int) -> dict[str, list[float]]:
    from PySide6.QtCore import QTimer

    with tempfile.TemporaryDirectory() as cache:
        app, window = open_window(profile, cache)
        session, slider = window.session, window.budget.slider
        positions = [round(slider.maximum() * (1 - k / (steps - 1))) for k in range(steps)]
        quick, full, stalls, cached, quick_cpu, cached_cpu = [], [], [], [], [], []
        ticks = QTimer()
        ticks.start(5)
        for value in positions:
            slider.blockSignals(True)
            slider.setValue(value)
            slider.blockSignals(False)
            t0, c0 = time.perf_counter(), time.thread_time()
            session.set_budget(window.budget.slider_bytes())  # what the debounced commit does
            app.processEvents()  # repaint
            quick.append((time.perf_counter() - t0) * 1e3)
            quick_cpu.append((time.thread_time() - c0) * 1e3)
            stalls.append(wait(app, lambda: session.state.complete))
            full.append((time.perf_counter() - t0) * 1e3)
        for value in positions:
            slider.blockSignals(True)
            slider.setValue(value)
            slider.blockSignals(False)
            t0, c0 = time.perf_counter(), time.thread_time()
            session.set_budget(window.budget.slider_bytes())
            app.processEvents()
            if not session.state.complete:
                raise SystemExit("a revisited step was not cached")
            cached.append((time.perf_counter() - t0) * 1e3)
            cached_cpu.append((time.thread_time() - c0) * 1e3)
        ticks.stop()
        window.close()
        return {"quick": quick, "quick_cpu": quick_cpu, "full": full, "stall": stalls, "cached": cached,
                "cached_cpu": cached_cpu,
                "recomputed": [len(session.loaded.trajectory.steps) - 1]}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--launch-child"]:
        launch_child(args[1], args[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile", nargs="?")
    parser.add_argument("--steps", type=int, default=40)
    opts = parser.parse_args(args)
    from acstudio.gui.app import default_profile_path
    from acstudio.gui.qtcompat import make_singletons_immortal

    make_singletons_immortal()
    profile = Path(opts.profile) if opts.profile else default_profile_path()
    if profile is None:
        raise SystemExit("no profile given and no sample bundled")
    print(f"profile: {profile}  ({os.cpu_count()} CPUs, load average {load_average()} at the start)")
    for label, wall, engine, cpu, ended in measure_launch(profile):
        print(f"launch {label}: {wall:.2f} s to an interactive window, {cpu:.2f} s CPU in the app (layout: "
              f"{engine}); closed and exited at {ended:.2f} s")
    res = measure_slider(profile, opts.steps)
    print(f"slider: {opts.steps} positions from the baseline peak to the floor "
          f"(trajectory of {res['recomputed'][0]} steps)")
    for name in ("quick", "quick_cpu", "full", "stall", "cached", "cached_cpu"):
        print(summary(name, res[name]))
    print(f"load average {load_average()} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
