"""What the app opens: a profile prepared for display, or a plan or benchmark results for the open profile.

Opening a profile is the slow part of starting the app (the simulator, μ-TWO's trajectory, the module tree and
the graph's first layout), so it runs as one background job whose result, :class:`Loaded`, the session keeps.
No Qt in here: the CLI's tests and benchmarks open documents the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from acstudio.errors import ACStudioError, WrongSchemaError
from acstudio.fileio import BENCH_FOLDER, Outputs
from acstudio.jobs import CancelToken, ProgressFn, check, report
from acstudio.plan.loading import load_plan
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import trajectory
from acstudio.plan.solvers.mutwo import Trajectory
from acstudio.profile.model import Profile
from acstudio.simulate.simulator import SimResult, Simulator
from acstudio.units import format_bytes
from acstudio.views.child import profile_in_child
from acstudio.views.graph_layout import DEFAULT_PASS, SHOWN_REGIONS, ModuleTree, laid_out
from acstudio.views.offload import link_note
from acstudio.views.tables import ActivationIndex, activation_table

if TYPE_CHECKING:  # acstudio.bench imports torch (seconds): only a benchmark file the user opens loads it
    from acstudio.bench.results import BenchResults


@dataclass
class Loaded:
    """Everything derived once per profile, computed in a background job."""

    path: str
    profile: Profile
    simulator: Simulator
    ctx: PlanContext  # caches what the solvers share for this profile
    trajectory: Trajectory
    tree: ModuleTree
    baseline: SimResult
    template: Plan  # the trajectory's step-0 plan: which activations are candidates and why the others are not
    table: pd.DataFrame  # activation table, static columns (plan columns are filled per plan)
    acts: ActivationIndex  # node positions of each activation (table row)
    first_graph: tuple  # the graph's launch view, laid out (see acstudio.views.graph_layout.laid_out)
    floor_note: str = ""  # what sets the AC floor, in a sentence: worked out in the sweep's child process


def prepare(profile: Profile, path: str, progress: ProgressFn | None = None,
            cancel: CancelToken | None = None, *, cache_dir: str | None = None) -> Loaded:
    """Simulator, μ-TWO trajectory, module tree and tables of ``profile`` (the slow part of opening a file)."""
    report(progress, 0, 3, "simulating the iteration")
    simulator = Simulator(profile)
    baseline = simulator.simulate([])
    check(cancel)
    ctx = PlanContext(profile, simulator, offload=True)  # offloads where the device has a host link (a GPU)
    traj = trajectory(ctx, progress=progress, cancel=cancel)
    report(progress, 2, 3, "grouping the graph")
    template = traj.plan_for_budget(simulator.baseline_peak)
    tree = ModuleTree(profile)
    # the graph's first picture is made here, off the GUI thread, so it is drawn the moment the file opens
    first_graph = laid_out(tree, tree.default_expansion(), SHOWN_REGIONS[DEFAULT_PASS], cache_dir)
    report(progress, 3, 3, "ready")
    return Loaded(path=path, profile=profile, simulator=simulator, ctx=ctx, trajectory=traj,
                  tree=tree, baseline=baseline, template=template, table=activation_table(profile),
                  acts=ActivationIndex.of(profile), first_graph=first_graph)


def open_document(path: str, current: Loaded | None, progress: ProgressFn | None = None,
                  cancel: CancelToken | None = None, *, cache_dir: str | None = None) -> Loaded | Plan | BenchResults:
    """A profile (prepared; ``cache_dir`` keeps graph layouts) or, if a profile is open, a plan made for it or
    benchmark results of its workload."""
    try:
        profile = Profile.load(path)
    except WrongSchemaError as profile_error:  # another kind of document: its own loader says what is wrong
        try:
            found = load_plan(path, *((current.profile, current.ctx) if current is not None else ()))
        except WrongSchemaError:
            from acstudio.bench.results import BenchResults  # imports torch: only for a benchmark file

            try:
                found = BenchResults.load(path)
            except WrongSchemaError:
                raise profile_error from None
        what = "a plan" if isinstance(found, Plan) else "a benchmark"
        if current is None:
            raise ACStudioError(f"{path} is {what}; open the profile of its workload first") from None
        if not isinstance(found, Plan):
            check_same_workload(found, current.profile)
        return found
    return prepare(profile, path, progress, cancel, cache_dir=cache_dir)


def check_same_workload(results: BenchResults, profile: Profile) -> None:
    """Measured points belong on a profile's chart only if they ran its workload (any batch size). A setting left
    unset (None) is the same as one a file from before that setting existed does not name."""
    def key(spec: dict) -> dict:
        return {k: v for k, v in spec.items() if k not in ("batch_size", "seed") and v is not None}

    if key(results.meta.get("spec", {})) != key(profile.workload):
        raise ACStudioError(f"this benchmark ran {results.meta.get('spec', {}).get('model')!r} with other settings "
                            f"than the open profile ({profile.workload['model']!r}); open its profile first")


def profile_and_prepare(spec: dict, device: str, path: str, progress=None, cancel=None, on_memory=None) -> Loaded:
    """Profile in a child process (saving the profile to ``path``), then prepare it for display."""
    profile_in_child(spec, device, path, progress, cancel, on_memory)
    return prepare(Profile.load(path), path, progress, cancel)


def run_benchmark(workload: dict, out_dir: str, settings: dict, progress=None, cancel=None) -> BenchResults:
    """The benchmark job: every configuration in its own process (see :mod:`acstudio.bench`). A run that fails or
    is cancelled removes what it wrote, as ``acstudio bench`` does: no half-written results folder is left."""
    from acstudio.bench import run_bench
    from acstudio.workload import WorkloadSpec

    with Outputs().add(out_dir, BENCH_FOLDER).writing():
        return run_bench(WorkloadSpec.from_dict(workload), settings["batch_sizes"], settings["configs"],
                         device=settings["device"], out_dir=out_dir, progress=progress, cancel=cancel,
                         fit_budget=settings["fit_budget"], warmup=settings["warmup"], iters=settings["iters"])


def loaded_message(loaded: Loaded, floor_bytes: int) -> str:
    """The status bar's line on opening a profile: its size, peak and floor, and, once, that its host link is the
    stated default where it has none (the inspector keeps saying so)."""
    profile = loaded.profile
    note = link_note(profile)
    return (f"Loaded {profile.label}: {len(profile.nodes)} nodes, {len(profile.activations)} activations; peak "
            f"{format_bytes(loaded.simulator.baseline_peak)}, floor {format_bytes(floor_bytes)}"
            + (f"; {note}" if note else ""))


def new_profile_name(spec: dict, device: str, stamp: str) -> str:
    """A file name for a new profile of ``spec`` (``WorkloadSpec.to_dict()``) on ``device``, made at ``stamp``."""
    label = f"{Path(spec['model'].rpartition(':')[0] or spec['model']).stem}_bs{spec['batch_size']}"
    return f"{label}_{spec['optimizer']}_{spec['precision']}-{device.replace(':', '')}-{stamp}.json.gz"


def export_name(profile: Profile, plan: Plan) -> str:
    """A folder name for ``plan``'s export, e.g. ``bert_bs16_plan_4603MiB``."""
    workload = profile.workload
    model = re.sub(r"[^\w.-]+", "_", str(workload["model"]).rpartition(":")[2] or "model")
    return f"{model}_bs{workload['batch_size']}_plan_{plan.budget_bytes // 2**20}MiB"
