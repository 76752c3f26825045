"""How good and how cheap the slider's offload preview is, on the CPU.

Usage::

    python benchmarks/offload_preview.py [PROFILE ...]

For each GPU profile (default: the bundled BERT bs16, GPT-2 and ResNet-152 bs64 H200 samples) it reports

* the time :func:`~acstudio.plan.solvers.mutwo.offload_preview` takes (a background job in the app) and the size of
  its Pareto front;
* at 12 budgets from just above the floor to just below the baseline peak, the predicted extra time of what the
  slider previews there (the faster of the recompute-only trajectory's plan and the preview's, among those that
  fit) against the plan the budget gets once it rests (``refine_and_simulate``'s);
* in the app (offscreen), the seconds from a budget's request to its resting plan while the preview is being
  made, and how long after that the preview is done.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

SAMPLES = Path(__file__).resolve().parents[1] / "sample_profiles"
DEFAULT_PROFILES = [SAMPLES / name for name in ("h200_bert_bs16_adam.json.gz", "h200_gpt2_bs16_adam.json.gz",
                                                "h200_resnet152_bs64_adam.json.gz")]


def quality(path: Path) -> None:
    from acstudio.plan.solvers.mutwo import offload_preview
    from acstudio.profile import Profile
    from acstudio.views.documents import prepare
    from acstudio.views.session import refine_and_simulate

    loaded = prepare(Profile.load(path), str(path))
    ctx = loaded.ctx
    start = time.perf_counter()
    preview = offload_preview(ctx)
    print(f"offload_preview: {time.perf_counter() - start:.1f} s, {len(preview.plans)} plans on its front")
    floor, top = ctx.floor_bytes, ctx.sim.baseline_peak
    print("share  budget GiB   preview ms (offloaded)   resting ms (offloaded)   preview / resting")
    for share in np.linspace(0.02, 0.95, 12):
        budget = int(floor + share * (top - floor))
        shown = [p for p in (loaded.trajectory.plan_for_budget(budget), preview.plan_for_budget(budget))
                 if p is not None and p.feasible]
        previewed = min(shown, key=lambda p: p.predicted_extra_ms)
        rested = refine_and_simulate(loaded, budget)[0]
        ratio = (f"{previewed.predicted_extra_ms / rested.predicted_extra_ms:.2f}"
                 if rested.predicted_extra_ms > 0.005 else "both ~0")
        shown_ms, rested_ms = previewed.predicted_extra_ms, rested.predicted_extra_ms
        print(f"{share:5.2f}  {budget / 2**30:10.2f}   {shown_ms:9.2f} ({len(previewed.offloaded):3d})"
              f"          {rested_ms:9.2f} ({len(rested.offloaded):3d})         {ratio}")


def resting_plan_beside_the_preview(path: Path) -> None:
    from PySide6.QtCore import QCoreApplication
    from PySide6.QtWidgets import QApplication

    from acstudio.gui.main_window import MainWindow

    app = QApplication.instance() or QApplication([])

    def until(condition, timeout_s: float = 300.0) -> float:
        start = time.perf_counter()
        while not condition():
            QCoreApplication.processEvents()
            time.sleep(0.005)
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError
        return time.perf_counter() - start

    window = MainWindow()
    window.open_path(str(path))
    until(lambda: window.session.state is not None and window.session.state.complete)
    session = window.session
    session.set_budget(int(session.floor_bytes + 0.3 * (session.baseline_bytes - session.floor_bytes)))
    rest = until(lambda: session.state.complete)
    done = until(lambda: session.offload_preview is not None)
    print(f"in the app: the resting plan 30% of the way from the floor came {rest:.1f} s after the request, "
          f"the offload preview {done:.1f} s after that")
    window.close()  # stops its jobs and waits for their threads
    app.processEvents()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profiles", nargs="*", type=Path, default=DEFAULT_PROFILES)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {' / '.join(f'{v:.2f}' for v in os.getloadavg())} at the start")
    for path in args.profiles:
        print(f"== {path.name}")
        quality(path)
        resting_plan_beside_the_preview(path)


if __name__ == "__main__":
    main()
