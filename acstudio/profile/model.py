"""``Profile``: the one data model shared by planner, simulator, rewriter, exports, CLI and GUI.

Everything refers to graph nodes by their capture-time id (``"n00042"``), never by name or rank. Memory is in
bytes, time in milliseconds. Tensors are tracked per *storage*, so views and in-place results are never
counted twice: a storage is identified by the id of the node that allocated it.

The profile also carries the captured graph itself (``graph``, see :mod:`acstudio.capture.serialize`), so the
rewriter works on exactly the graph that was measured, with the same ids, without re-tracing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from acstudio.fileio import read_document, write_document, write_text
from acstudio.profile.vocabulary import CATEGORIES

if TYPE_CHECKING:
    import pandas as pd

SCHEMA = "acstudio.profile"
SCHEMA_VERSION = 1


def graph_fingerprint(graph: dict[str, Any]) -> str:
    """Hash of a serialized graph (:func:`acstudio.capture.serialize.serialize_step` output)."""
    blob = json.dumps(graph, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class NodeRecord:
    """One node of the captured graph with its measurements.

    ``replay`` is ``"ok"`` when the node may be re-executed in backward to recompute an activation, otherwise
    the reason it may not (``"random"``, ``"mutates graph state"``, ``"placeholder"``, ``"optimizer"``, ...).
    ``storage`` is the id of the storage the node's (first) tensor output lives in: the node's own id when it
    allocates, its base's id when it is a view or an in-place op, ``""`` when it outputs no tensor.
    ``mem_after`` / ``mem_peak`` are the device's allocated bytes right after the node ran (before the values
    whose last use it was are freed) and the high-water mark during it (CUDA allocator statistics on GPU,
    storage accounting on CPU).
    """

    id: str
    name: str
    op: str
    target: str
    region: str
    module: str
    inputs: list[str]
    shape: str
    dtype: str
    storage: str
    new_bytes: int
    replay: str
    run_time_ms: float = 0.0
    mem_after: int = 0
    mem_peak: int = 0


@dataclass
class TensorRecord:
    """One storage: who allocated it, its size, category, and the node range over which it is alive."""

    id: str
    bytes: int
    category: str
    created_at: str
    freed_after: str  # last node that needs it ("" = lives past the end of the iteration)
    aliases: list[str] = field(default_factory=list)


@dataclass
class ActivationRecord:
    """A storage created in forward (or loss) and still needed in backward.

    ``recomputable`` tells whether μ-TWO may free it and recompute it before ``first_bw_use``; ``reason``
    says why not otherwise. ``inactive_time_ms`` is the run time between its last forward and first backward
    use (the paper's definition).
    """

    id: str
    bytes: int
    created_at: str
    last_fw_use: str
    first_bw_use: str
    last_bw_use: str
    inactive_time_ms: float
    recomputable: bool
    reason: str = ""


# Host link defaults for a profile that did not measure one (a CPU run, or a file from before it was measured):
# pinned copies over PCIe 3.0 x16 reach about 12 GB/s each way, and every server GPU link since is faster, so a
# plan priced with them never counts on more hidden copying than the hardware gives. Host memory: 8 GiB, less
# than nearly any training host has free, so such a plan cannot ask a host for memory it does not have.
DEFAULT_LINK_GB_S = 12.0
DEFAULT_HOST_FREE_BYTES = 8 * 2**30
# Each copy also costs a fixed time on its copy stream beside its bytes: the copy engine's start and the events that
# order it against the compute stream. A few microseconds on a bare copy; the default allows for the waits between
# streams the rewritten step adds to each one, so that a plan priced with it does not count on many small copies
# being free.
DEFAULT_COPY_LATENCY_US = 10.0
# The host's side of one offloaded activation: the rewritten step's four Python calls that issue its two copies and
# the compute stream's two waits, about ten torch calls with their events made once; and, for scale, one small
# op's. Measured alone, both run faster than inside a step, where the host is busy with the whole graph; their ratio
# carries over (an offload's calls cost as much host time as that many of the step's nodes).
DEFAULT_OFFLOAD_ISSUE_US = 40.0
DEFAULT_OP_ISSUE_US = 5.0
# Host time to issue one executed node of the captured step, for a profile that did not measure its step's (a CPU
# run, or a file from before it was measured): a Python call of one aten op from the graph on a training server.
DEFAULT_NODE_ISSUE_US = 20.0
# Nodes the step's generated code does not execute as calls: its arguments, attribute reads and return.
UNISSUED_OPS = ("placeholder", "get_attr", "output")


@dataclass
class HostLink:
    """The link between device and host memory, as profiling measured it (pinned buffers, one direction alone
    and both at once), and the host memory that was available; ``None`` where it was not measured.

    The ``*_rate`` properties give what a plan is priced with: the measurement, else the stated default.
    """

    d2h_gb_s: float | None = None
    h2d_gb_s: float | None = None
    duplex_gb_s: float | None = None  # each way, both directions copying at once
    host_free_bytes: int | None = None
    copy_latency_us: float | None = None  # fixed time of one copy on its stream, besides its bytes at the rate
    offload_issue_us: float | None = None  # host time to issue one offloaded activation's copies and waits, alone
    op_issue_us: float | None = None  # host time to issue one small op, alone (the scale for the above)

    @property
    def measured(self) -> bool:
        return None not in (self.d2h_gb_s, self.h2d_gb_s, self.duplex_gb_s)

    @property
    def d2h_rate(self) -> float:
        return self.d2h_gb_s or DEFAULT_LINK_GB_S

    @property
    def h2d_rate(self) -> float:
        return self.h2d_gb_s or DEFAULT_LINK_GB_S

    @property
    def duplex_rate(self) -> float:
        """Each way with both directions copying; never above either direction alone."""
        return min(self.duplex_gb_s or DEFAULT_LINK_GB_S, self.d2h_rate, self.h2d_rate)

    @property
    def host_bytes(self) -> int:
        return DEFAULT_HOST_FREE_BYTES if self.host_free_bytes is None else self.host_free_bytes

    @property
    def copy_latency_ms(self) -> float:
        return (DEFAULT_COPY_LATENCY_US if self.copy_latency_us is None else self.copy_latency_us) / 1e3

    @property
    def offload_issue_nodes(self) -> float:
        """An offloaded activation's calls in host time, as a number of ops issued, both measured alone (a stated
        default for what was not measured)."""
        offload = DEFAULT_OFFLOAD_ISSUE_US if self.offload_issue_us is None else self.offload_issue_us
        return offload / (self.op_issue_us or DEFAULT_OP_ISSUE_US)

    def copy_ms(self, nbytes):
        """Time one copy of ``nbytes`` (a number or an array) takes on its stream with both directions copying:
        the fixed cost of a copy plus its bytes at the duplex rate."""
        return self.copy_latency_ms + nbytes / (self.duplex_rate * 1e6)  # GB/s is 1e6 bytes per ms


@dataclass
class Profile:
    workload: dict[str, Any]
    environment: dict[str, Any]
    graph: dict[str, Any]
    nodes: list[NodeRecord]
    tensors: list[TensorRecord]
    activations: list[ActivationRecord]
    peak_bytes: int
    peak_node: str
    peak_breakdown: dict[str, int]
    iteration_ms: float
    iterations: dict[str, int] = field(default_factory=dict)
    host_link: HostLink | None = None  # absent in files from before the link was measured
    host_issue_ms: float | None = None  # host time to issue the whole step (GPU only; absent in older files)
    # per node, the device's own time, the host's launch excluded (GPU only; absent in older files)
    node_device_ms: list[float] | None = None

    @property
    def link(self) -> HostLink:
        """The host link offload is priced with: the measured one, or the defaults (:class:`HostLink`)."""
        return self.host_link or HostLink()

    # -- identity --------------------------------------------------------------------------------------
    @cached_property
    def fingerprint(self) -> str:
        """Hash of the captured graph (ops, wiring, shapes): plans and exports are refused on any other."""
        return graph_fingerprint(self.graph)

    @cached_property
    def node_issue_ms(self) -> float:
        """Host time to issue one executed node of the step, on average: the measured step's over its executed
        nodes, else the stated default. Against the nodes' run times it says where the host limits the step."""
        executed = sum(n.op not in UNISSUED_OPS for n in self.nodes)
        if self.host_issue_ms is None or not executed:
            return DEFAULT_NODE_ISSUE_US / 1e3
        return self.host_issue_ms / executed

    @cached_property
    def time_scale(self) -> float:
        """Factor from node-by-node run times to the compiled step's time, for pricing recomputation.

        ``run_time_ms`` is measured one node at a time, so on a GPU it includes the gaps in which the device
        waits for the interpreter to launch the next node; their sum exceeds the whole step's measured
        ``iteration_ms``, on a large model by more than twice. Recomputations run inside the compiled
        step, so the planner scales node times by ``iteration_ms / sum(run_time_ms)`` (never above 1).
        """
        total = sum(n.run_time_ms for n in self.nodes)
        if total <= 0 or self.iteration_ms <= 0:
            return 1.0
        return min(1.0, self.iteration_ms / total)

    @cached_property
    def node_step_ms(self) -> np.ndarray:
        """Each node's time inside the whole step, as replays, the timeline and copy overlap are priced: its
        node-by-node time scaled by :attr:`time_scale`."""
        times = np.array([n.run_time_ms for n in self.nodes], dtype=np.float64) * self.time_scale
        times.flags.writeable = False  # shared by every simulator of this profile
        return times

    @cached_property
    def node_index(self) -> dict[str, int]:
        return {n.id: i for i, n in enumerate(self.nodes)}

    @cached_property
    def node_by_id(self) -> dict[str, NodeRecord]:
        return {n.id: n for n in self.nodes}

    @cached_property
    def tensor_bytes(self) -> dict[str, int]:
        """Bytes of each storage, by its id (what a node's ``storage`` names)."""
        return {t.id: t.bytes for t in self.tensors}

    @cached_property
    def activation_by_id(self) -> dict[str, ActivationRecord]:
        return {a.id: a for a in self.activations}

    @property
    def label(self) -> str:
        w = self.workload
        return f"{w['model']} bs{w['batch_size']} {w['optimizer']} {w['precision']} on {self.environment['device']}"

    def category_bytes(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for t in self.tensors:
            out[t.category] += t.bytes
        return out

    # -- persistence -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "environment": self.environment,
            "graph": self.graph,
            "nodes": [dataclasses.astuple(n) for n in self.nodes],
            "tensors": [dataclasses.asdict(t) for t in self.tensors],
            "activations": [dataclasses.astuple(a) for a in self.activations],
            "peak_bytes": self.peak_bytes,
            "peak_node": self.peak_node,
            "peak_breakdown": self.peak_breakdown,
            "iteration_ms": self.iteration_ms,
            "iterations": self.iterations,
            **({"host_link": dataclasses.asdict(self.host_link)} if self.host_link is not None else {}),
            **({"host_issue_ms": self.host_issue_ms} if self.host_issue_ms is not None else {}),
            **({"node_device_ms": self.node_device_ms} if self.node_device_ms is not None else {}),
            "fingerprint": self.fingerprint,  # lets loading prove the graph was not changed since
        }

    def save(self, path: str | os.PathLike) -> None:
        """Atomically write the profile as schema-versioned JSON (gzipped if the name ends in ``.gz``)."""
        write_document(path, SCHEMA, SCHEMA_VERSION, self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | os.PathLike = "profile") -> Profile:
        """Build a profile from its document, validated first (:mod:`acstudio.profile.schema`).

        Raises :class:`~acstudio.errors.CorruptFileError` naming ``source``, the field and the problem.
        """
        from acstudio.profile.schema import validate_profile

        hashed: list[str] = []

        def fingerprint_of(graph: dict[str, Any]) -> str:
            hashed.append(graph_fingerprint(graph))
            return hashed[-1]

        doc = validate_profile(d, source, fingerprint_of)
        profile = cls(
            workload=d["workload"],
            environment=d["environment"],
            graph=d["graph"],
            nodes=[NodeRecord(*row) for row in doc.nodes],
            tensors=[TensorRecord(**t) for t in doc.tensors],
            activations=[ActivationRecord(*row) for row in doc.activations],
            peak_bytes=doc.peak_bytes,
            peak_node=doc.peak_node,
            peak_breakdown=doc.peak_breakdown,
            iteration_ms=doc.iteration_ms,
            iterations=doc.iterations,
            host_link=HostLink(**doc.host_link.model_dump()) if doc.host_link is not None else None,
            host_issue_ms=doc.host_issue_ms,
            node_device_ms=doc.node_device_ms,
        )
        if hashed:
            profile.__dict__["fingerprint"] = hashed[0]  # already computed to check it: keep it (cached_property)
        return profile

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        return cls.from_dict(read_document(path, SCHEMA, SCHEMA_VERSION), path)

    # -- tables -----------------------------------------------------------------------------------------
    def nodes_df(self) -> pd.DataFrame:
        import pandas as pd

        df = pd.DataFrame([dataclasses.asdict(n) for n in self.nodes])
        df["inputs"] = df["inputs"].map(" ".join)
        if self.node_device_ms is not None:
            df.insert(df.columns.get_loc("run_time_ms") + 1, "device_time_ms", self.node_device_ms)
        return df.set_index("id")

    def activations_df(self) -> pd.DataFrame:
        import pandas as pd

        cols = [f.name for f in dataclasses.fields(ActivationRecord)]
        df = pd.DataFrame([dataclasses.astuple(a) for a in self.activations], columns=cols)
        return df.set_index("id")

    def export_csv(self, directory: str | os.PathLike) -> list[str]:
        """Write ``nodes.csv`` and ``activations.csv`` (atomically) and return their paths."""
        paths = []
        for name, df in (("nodes.csv", self.nodes_df()), ("activations.csv", self.activations_df())):
            path = os.path.join(directory, name)
            write_text(path, df.to_csv())
            paths.append(path)
        return paths
