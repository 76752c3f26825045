"""``Plan``: which activations to free after forward and recompute in backward, which to offload to host memory
and bring back, and what that is predicted to cost.

A plan is tied to one captured graph by ``profile_fingerprint``; loading it against another profile raises
:class:`~acstudio.errors.PlanMismatchError`. The schedule lists the recomputations in the order they run
(by first backward use, then forward creation order), which is the order the rewriter inserts them in.

``replay_mode`` names how the recomputations run and were priced: a mode registered in
:mod:`acstudio.simulate.modes` (``"again"``: each recomputation replays its chain from kept tensors, μ-TWO's model;
``"shared"``: one replay also produces the recomputed activations it passes and keeps them until their last
backward use). Files written before modes were named carry a bool ``share_chains`` instead; it is read as
``"shared"`` / ``"again"``. ``keep_random`` says whether random ops were left out (True, ``--keep-random``) or
are replayed with the generator state their forward drew with (False, the default); the rewriter follows it, so
verify and export rewrite what was planned.

``offloaded`` lists activations copied to host memory after their last forward write and copied back before their
first backward use (:mod:`acstudio.simulate.offload` schedules and prices the copies); the rest are kept unless
recomputed. Files from before offload have no such list and read as offloading nothing. ``offload_bytes`` is what
crosses the link each way, ``host_bytes`` the pinned host memory the step holds for it, ``offload_stall_ms`` the
time the step waits for copies that do not hide behind compute (included in ``predicted_extra_ms``). A plan for
torch.compile that offloads what whole blocks save records in ``region_fetches`` where each block's copies come
back, as it was priced (the export follows it; files from before it re-place them on the profile's eager times).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from acstudio.errors import PlanMismatchError
from acstudio.fileio import read_document, write_document, write_text
from acstudio.plan.validation import validate_plan

if TYPE_CHECKING:
    import pandas as pd

    from acstudio.profile.model import Profile
    from acstudio.simulate.simulator import SimResult

SCHEMA = "acstudio.plan"
SCHEMA_VERSION = 1


@dataclass
class ScheduleEntry:
    """One recomputation.

    ``activation`` (a storage id) is freed after node ``freed_after`` (its last forward use) and recomputed
    right before node ``recompute_before`` (its first backward use) by replaying the nodes in ``replay`` (ids,
    topological order; it includes the chains of recomputed activations that are not back in memory yet).
    Inputs of replayed nodes that are not replayed themselves hold ``sources``: activation ids in memory at
    that point (retained ones; recomputed ones are then already back, so read their recomputed copy) and
    parameter/buffer/input storage ids. Replayed nodes are forward nodes whose ``replay`` is ``"ok"``;
    BatchNorm among them must run without updating running statistics. ``ratio`` is bytes per millisecond of
    recompute time as the solver saw it when choosing (μ-TWO's recompute ratio). In a shared-chain plan an
    activation produced by an earlier entry's replay has an empty ``replay`` and ``recompute_ms`` 0, and its
    ``recompute_before`` is where that replay runs.
    """

    activation: str
    bytes: int
    freed_after: str
    recompute_before: str
    sources: list[str]
    replay: list[str]
    recompute_ms: float
    ratio: float


@dataclass
class Plan:
    profile_fingerprint: str
    solver: str
    budget_bytes: int
    recomputed: list[str]  # activation ids in the order the solver chose them
    schedule: list[ScheduleEntry]
    predicted_peak_bytes: int
    predicted_peak_node: str
    predicted_extra_ms: float
    feasible: bool
    stop_reason: str
    floor_bytes: int
    baseline_peak_bytes: int
    activation_bytes: dict[str, int] = field(default_factory=dict)  # every activation of the profile
    excluded: dict[str, str] = field(default_factory=dict)  # activations that are not candidates, and why
    replay_mode: str = "again"  # a registered replay mode (see the module docstring)
    keep_random: bool = False  # planned with random ops never recomputed (``--keep-random``); absent in old files
    # Planned for torch.compile (acstudio.plan.compiled): bytes the compiled step holds less than the replay mode
    # predicts, calibrated on a measured compiled step; None for an eager plan.
    compiled_offset_bytes: int | None = None
    # The compiled step's predicted time over plain compile, where the planner was given compiled step times to
    # calibrate on (acstudio.plan.compiled.CompiledTimes); they are not in the profile, so it is not re-derived.
    compiled_extra_ms: float | None = None
    offloaded: list[str] = field(default_factory=list)  # activation ids copied to the host and back
    offload_bytes: int = 0
    offload_stall_ms: float = 0.0
    host_bytes: int = 0
    # A compiled plan that offloads by region (blocks compiled one by one): per offloaded block, the block at whose
    # backward start its copies come back, placed on the step the plan was priced on (compiled times, where given).
    # Empty where the plan does not so offload, and in files from before it was recorded: the export then places
    # the fetches on the profile's eager times.
    region_fetches: dict[str, str] = field(default_factory=dict)
    # The simulated step (timeline and all), kept once something simulated it (PlanContext.simulation), so that a
    # plan is simulated once however many views read it. Derived and large: never saved, never compared.
    simulation: SimResult | None = field(default=None, repr=False, compare=False)

    @property
    def copies_hidden(self) -> bool:
        """Whether every copy to and from the host runs behind compute (no stall predicted)."""
        return self.offload_stall_ms <= 0.0

    @property
    def compiled_peak_bytes(self) -> int | None:
        """The predicted peak under torch.compile, for a plan made for it."""
        if self.compiled_offset_bytes is None:
            return None
        return self.predicted_peak_bytes - self.compiled_offset_bytes

    @property
    def run_peak_bytes(self) -> int:
        """The predicted peak of the step the plan was made for: compiled or eager."""
        compiled = self.compiled_peak_bytes
        return self.predicted_peak_bytes if compiled is None else compiled

    # -- identity ------------------------------------------------------------------------------------------
    def check_profile(self, profile: Profile) -> None:
        if profile.fingerprint != self.profile_fingerprint:
            raise PlanMismatchError(
                f"this plan was made for graph {self.profile_fingerprint}, but the profile's graph is "
                f"{profile.fingerprint} ({profile.label}); plan again for this profile")

    def decisions(self, profile: Profile) -> dict[str, str]:
        """Activation id -> ``"recompute"``, ``"offload"``, ``"retain"`` or ``"not a candidate: <why>"``."""
        self.check_profile(profile)
        chosen = set(self.recomputed)
        moved = set(self.offloaded)
        out = {}
        for a in profile.activations:
            if a.id in chosen:
                out[a.id] = "recompute"
            elif a.id in moved:
                out[a.id] = "offload"
            elif a.id in self.excluded:
                out[a.id] = f"not a candidate: {self.excluded[a.id]}"
            else:
                out[a.id] = "retain"
        return out

    # -- persistence -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(dataclasses.replace(self, simulation=None))
        del d["simulation"]
        d["schedule"] = [dataclasses.astuple(e) for e in self.schedule]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | os.PathLike = "plan") -> Plan:
        """Build a plan from its document, validated first (:mod:`acstudio.profile.schema`).

        Raises :class:`~acstudio.errors.CorruptFileError` naming ``source``, the field and the problem.
        """
        doc = validate_plan(d, source)
        fields = {f.name for f in dataclasses.fields(cls)} - {"simulation"}
        body = {k: v for k, v in d.items() if k in fields}  # a field the schema does not know yet passes as is
        body.update((k, v) for k, v in doc.model_dump().items() if k in fields)
        body["schedule"] = [ScheduleEntry(*row) for row in doc.schedule]
        return cls(**body)

    def save(self, path: str | os.PathLike) -> None:
        """Atomically write the plan as schema-versioned JSON (gzipped if the name ends in ``.gz``)."""
        write_document(path, SCHEMA, SCHEMA_VERSION, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan, checked against its schema and itself; :func:`acstudio.plan.loading.load_plan` also checks
        it against the profile it is for."""
        return cls.from_dict(read_document(path, SCHEMA, SCHEMA_VERSION), path)

    # -- tables ---------------------------------------------------------------------------------------------
    def schedule_df(self) -> pd.DataFrame:
        """One row per activation of the profile: decision (recompute, offload, retain), bytes, and for recomputed
        ones where and how."""
        import pandas as pd

        entries = {e.activation: e for e in self.schedule}
        moved = set(self.offloaded)
        rows = []
        for a, nbytes in self.activation_bytes.items():
            e = entries.get(a)
            if a in moved:
                rows.append({"activation": a, "decision": "offload", "bytes": nbytes})
            elif e is not None:
                rows.append({"activation": a, "decision": "recompute", "bytes": nbytes,
                             "freed_after": e.freed_after, "recompute_before": e.recompute_before,
                             "sources": " ".join(e.sources), "replay_nodes": len(e.replay),
                             "recompute_ms": e.recompute_ms, "ratio": e.ratio})
            else:
                why = self.excluded.get(a)
                rows.append({"activation": a, "decision": f"not a candidate: {why}" if why else "retain",
                             "bytes": nbytes})
        cols = ["activation", "decision", "bytes", "freed_after", "recompute_before", "sources", "replay_nodes",
                "recompute_ms", "ratio"]
        return pd.DataFrame(rows, columns=cols).set_index("activation")

    def export_schedule(self, directory: str | os.PathLike) -> list[str]:
        """Write ``schedule.json`` (plan summary and every recomputation) and ``schedule.csv`` (one row per
        activation) into ``directory``, each atomically. Returns the two paths."""
        summary = {k: v for k, v in self.to_dict().items() if k not in ("schedule", "activation_bytes")}
        summary["schedule"] = [dataclasses.asdict(e) for e in self.schedule]
        paths = [os.path.join(directory, "schedule.json"), os.path.join(directory, "schedule.csv")]
        write_text(paths[0], json.dumps(summary, indent=1))
        write_text(paths[1], self.schedule_df().to_csv())
        return paths
