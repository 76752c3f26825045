"""Schemas of the profile and plan files: every document is checked before anything believes it.

Two layers. pydantic checks the shape of the document (types, required keys, row lengths, enumerations,
non-negative sizes and finite, plausible times) in one pass over the rows; then plain Python checks what a
type cannot say: every id that is referenced exists, node order is topological, lifetimes run forward, the
node table describes the stored graph, and the graph hashes to the fingerprint stored beside it. Either
layer reports the first problem as ONE line that names the file, the field path and what is wrong, e.g.
``profile.json: corrupt profile: nodes[17].inputs[0] = 'n99999' names no node — profile the model again``;
the planner, simulator, rewriter and GUI can then index by id without guarding every lookup. A plan loaded
with its profile is also simulated again (:func:`acstudio.plan.loading.check_plan_derivation`).

Bounds: sizes are whole bytes in ``[0, 2**53]`` (exact in float64, 8 PiB; no device has more), times
milliseconds in ``[0, 1e9]`` (11 days per node: larger is a broken file, and sums of such values overflow).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from typing_extensions import NotRequired, TypedDict

from acstudio.errors import CorruptFileError
from acstudio.profile.vocabulary import CATEGORIES, REGIONS

MAX_BYTES = 2**53
MAX_MS = 1e9

Bytes = Annotated[int, Field(strict=True, ge=0, le=MAX_BYTES)]
Ms = Annotated[float, Field(strict=True, ge=0, le=MAX_MS, allow_inf_nan=False)]
Id = Annotated[str, Field(strict=True, min_length=1)]
Region = Literal[REGIONS]
Category = Literal[CATEGORIES]


def _not_nan(value: float) -> float:
    if math.isnan(value):
        raise ValueError("is not a number")
    return value


# A recompute ratio is bytes per millisecond: +inf when the recomputation is free, never NaN.
Ratio = Annotated[float, Field(strict=True, ge=0), AfterValidator(_not_nan)]

# Rows are stored as lists (compact files); their column names come from the record dataclasses.
NODE_COLUMNS = ("id", "name", "op", "target", "region", "module", "inputs", "shape", "dtype", "storage", "new_bytes",
                "replay", "run_time_ms", "mem_after", "mem_peak")
NodeRow = tuple[Id, StrictStr, StrictStr, StrictStr, Region, StrictStr, list[Id], StrictStr, StrictStr, StrictStr,
                Bytes, StrictStr, Ms, Bytes, Bytes]
ACTIVATION_COLUMNS = ("id", "bytes", "created_at", "last_fw_use", "first_bw_use", "last_bw_use", "inactive_time_ms",
                      "recomputable", "reason")
ActivationRow = tuple[Id, Bytes, Id, Id, Id, Id, Ms, StrictBool, StrictStr]
SCHEDULE_COLUMNS = ("activation", "bytes", "freed_after", "recompute_before", "sources", "replay", "recompute_ms",
                    "ratio")
ScheduleRow = tuple[Id, Bytes, Id, Id, list[Id], list[Id], Ms, Ratio]
ROW_COLUMNS = {"nodes": NODE_COLUMNS, "activations": ACTIVATION_COLUMNS, "schedule": SCHEDULE_COLUMNS}


class _Doc(BaseModel):
    # Unknown keys are ignored (a newer writer may add some). Scalars are strict (no "12" for 12, no true
    # for 1); rows stay lax only so that JSON lists validate as the tuples they describe.
    model_config = ConfigDict(extra="ignore")


# The thousands of tensors and graph nodes validate into plain dicts (TypedDict): building a model object per
# row would double the load time of a large profile.
class TensorDoc(TypedDict):
    id: Id
    bytes: Bytes
    category: Category
    created_at: Id
    freed_after: StrictStr
    aliases: NotRequired[list[Id]]


class GraphNodeDoc(TypedDict):
    id: Id
    name: StrictStr
    op: Literal["placeholder", "call_function", "get_attr", "output"]
    target: StrictStr
    args: Any
    kwargs: dict[str, Any]
    region: Region
    module: StrictStr
    shape: StrictStr
    dtype: StrictStr


class ConstantDoc(_Doc):
    dtype: StrictStr
    shape: list[Annotated[int, Field(strict=True, ge=0)]]
    device: StrictStr
    data: list[StrictBool | StrictInt | StrictFloat]


class GraphDoc(_Doc):
    nodes: list[GraphNodeDoc]
    inputs: list[tuple[StrictStr, StrictStr]]
    grad_params: list[StrictStr]
    constants: dict[str, ConstantDoc] = {}


class WorkloadDoc(_Doc):
    # Further keys are checked by WorkloadSpec where it is rebuilt (verify, export): importing it here would
    # import torch into every `acstudio plan`, and new workload options then need no edit here.
    model_config = ConfigDict(extra="allow")
    model: Id
    batch_size: Annotated[int, Field(strict=True, ge=1)]
    optimizer: StrictStr
    precision: StrictStr
    image_size: Annotated[int, Field(strict=True, ge=1)] = 224
    seq_len: Annotated[int, Field(strict=True, ge=1)] = 512
    config: list[tuple[StrictStr, StrictStr]] = []
    seed: StrictInt = 0


class EnvironmentDoc(_Doc):
    model_config = ConfigDict(extra="allow")
    device: StrictStr
    device_type: StrictStr = "cpu"


GbPerS = Annotated[float, Field(strict=True, gt=0, le=1e6, allow_inf_nan=False)]
Us = Annotated[float, Field(strict=True, ge=0, le=1e6, allow_inf_nan=False)]


class HostLinkDoc(_Doc):
    d2h_gb_s: GbPerS | None = None
    h2d_gb_s: GbPerS | None = None
    duplex_gb_s: GbPerS | None = None
    host_free_bytes: Bytes | None = None
    copy_latency_us: Us | None = None
    offload_issue_us: Us | None = None
    op_issue_us: Us | None = None


class ProfileDoc(_Doc):
    workload: WorkloadDoc
    environment: EnvironmentDoc
    graph: GraphDoc
    nodes: list[NodeRow]
    tensors: list[TensorDoc]
    activations: list[ActivationRow]
    peak_bytes: Bytes
    peak_node: Id
    peak_breakdown: dict[str, Bytes]
    iteration_ms: Ms
    iterations: dict[str, Annotated[int, Field(strict=True, ge=0)]] = {}
    fingerprint: Id = ""  # absent in files written before it was stored (then not checked)
    host_link: HostLinkDoc | None = None  # absent in files written before the link was measured
    host_issue_ms: Ms | None = None  # absent in files written before it was measured, and for a CPU device
    node_device_ms: list[Ms] | None = None  # likewise

    @model_validator(mode="after")
    def _one_device_time_per_node(self) -> ProfileDoc:
        if self.node_device_ms is not None and len(self.node_device_ms) != len(self.nodes):
            raise ValueError(f"node_device_ms has {len(self.node_device_ms)} times for {len(self.nodes)} nodes")
        return self


class PlanDoc(_Doc):
    profile_fingerprint: StrictStr
    solver: StrictStr
    budget_bytes: Bytes
    recomputed: list[Id]
    schedule: list[ScheduleRow]
    predicted_peak_bytes: Bytes
    predicted_peak_node: StrictStr
    predicted_extra_ms: Ms
    feasible: StrictBool
    stop_reason: StrictStr
    floor_bytes: Bytes
    baseline_peak_bytes: Bytes
    activation_bytes: dict[str, Bytes] = {}
    excluded: dict[str, StrictStr] = {}
    replay_mode: StrictStr = "again"  # checked against the registered modes in validate_plan
    keep_random: StrictBool = False
    compiled_offset_bytes: StrictInt | None = None
    compiled_extra_ms: Ms | None = None
    offloaded: list[Id] = []  # absent in files from before offload: nothing offloaded
    offload_bytes: Bytes = 0
    offload_stall_ms: Ms = 0.0
    host_bytes: Bytes = 0
    region_fetches: dict[str, StrictStr] = {}  # absent in files from before 2026-11-29's twenty-first session

    @model_validator(mode="before")
    @classmethod
    def _legacy_share_chains(cls, d: Any) -> Any:
        """Files from before replay modes had names carry a bool ``share_chains``: true is "shared"."""
        if isinstance(d, dict) and "replay_mode" not in d and "share_chains" in d:
            if not isinstance(d["share_chains"], bool):
                raise ValueError(f"share_chains = {_short(d['share_chains'])} is not true or false")
            d = {**d, "replay_mode": "shared" if d["share_chains"] else "again"}
        return d


_PROFILE = TypeAdapter(ProfileDoc)
_PLAN = TypeAdapter(PlanDoc)


# -- one-line errors -------------------------------------------------------------------------------------------
def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def field_path(loc: Sequence[str | int]) -> str:
    """``('nodes', 17, 6, 0)`` -> ``nodes[17].inputs[0]`` (row columns named after the record's fields)."""
    out = ""
    for depth, part in enumerate(loc):
        if isinstance(part, int):
            columns = ROW_COLUMNS.get(str(loc[depth - 2])) if depth >= 2 and isinstance(loc[depth - 1], int) else None
            out += f".{columns[part]}" if columns and part < len(columns) else f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def corrupt(source: str, kind: str, path: str, what: str) -> CorruptFileError:
    """The one-line error every check raises: file, field path, what is wrong, what to do."""
    remedy = "plan again" if kind == "plan" else "profile the model again"
    where = f"{path} " if path else ""
    return CorruptFileError(f"{source}: corrupt {kind}: {where}{what} — {remedy}")


def _first_problem(exc: ValidationError, source: str, kind: str) -> CorruptFileError:
    errors = exc.errors(include_url=False)
    err = errors[0]
    path = field_path(err["loc"])
    if err["type"] == "missing":
        what = "is missing"
    else:
        msg = err["msg"]
        msg = msg[0].lower() + msg[1:] if msg else "is invalid"
        msg = msg.removeprefix("value error, ")
        what = f"= {_short(err['input'])}: {msg}" if path else msg
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return corrupt(source, kind, path, what + more)


def validate_document(adapter: TypeAdapter, doc: Any, source: str, kind: str) -> Any:
    try:
        return adapter.validate_python(doc)
    except ValidationError as exc:
        raise _first_problem(exc, source, kind) from None


# -- profiles ----------------------------------------------------------------------------------------------------
def graph_refs(value: Any) -> list[str]:
    """Node ids an encoded graph argument reads (``{"$n": id}``), in order of appearance."""
    out, todo = [], [value]
    while todo:  # iterative: this runs over every argument of every node on each load
        v = todo.pop()
        if type(v) is list:
            todo.extend(reversed(v))
        elif type(v) is dict:
            if "$n" in v:
                out.append(v["$n"])
            else:
                todo.extend(reversed(list(v.values())))
    return out


class _Checker:
    """Cross-reference checks on a document that already has the right types."""

    def __init__(self, source: str, kind: str) -> None:
        self.source, self.kind = source, kind

    def fail(self, path: str, value: Any, what: str) -> CorruptFileError:
        return corrupt(self.source, self.kind, f"{path} = {_short(value)}", what)

    def unique(self, field: str, ids: Iterable[str], column: str = ".id") -> dict[str, int]:
        """Position of each id in ``field``; a repeated id is an error (``column``: where rows keep it)."""
        index: dict[str, int] = {}
        for i, key in enumerate(ids):
            if key in index:
                raise self.fail(f"{field}[{i}]{column}", key, f"repeats {field}[{index[key]}]")
            index[key] = i
        return index

    def exists(self, path: str, key: str, index: dict[str, Any] | set[str], what: str) -> None:
        if key not in index:
            raise self.fail(path, key, f"names no {what}")


def check_profile(doc: ProfileDoc, source: str, fingerprint: str) -> None:
    """Ids, order, lifetimes, graph/table agreement and fingerprint of a type-checked profile document."""
    c = _Checker(source, "profile")
    node_index = c.unique("nodes", (row[0] for row in doc.nodes))
    tensor_index = c.unique("tensors", (t["id"] for t in doc.tensors))
    for i, row in enumerate(doc.nodes):
        for j, src in enumerate(row[6]):
            if node_index.get(src, i) >= i:  # unknown, or not before its user
                c.exists(f"nodes[{i}].inputs[{j}]", src, node_index, "node")
                raise c.fail(f"nodes[{i}].inputs[{j}]", src, "comes after its user: nodes are not in topological order")
        if row[9] and row[9] not in tensor_index:
            c.exists(f"nodes[{i}].storage", row[9], tensor_index, "tensor")
        if row[14] < row[13]:
            raise c.fail(f"nodes[{i}].mem_peak", row[14], f"is below mem_after ({row[13]})")
    for i, t in enumerate(doc.tensors):
        c.exists(f"tensors[{i}].created_at", t["created_at"], node_index, "node")
        if t["freed_after"]:
            c.exists(f"tensors[{i}].freed_after", t["freed_after"], node_index, "node")
            if node_index[t["freed_after"]] < node_index[t["created_at"]]:
                raise c.fail(f"tensors[{i}].freed_after", t["freed_after"], "comes before created_at")
        for j, alias in enumerate(t.get("aliases", ())):
            c.exists(f"tensors[{i}].aliases[{j}]", alias, node_index, "node")
    _check_activations(c, doc, node_index, tensor_index)
    c.exists("peak_node", doc.peak_node, node_index, "node")
    _check_graph(c, doc)
    if doc.fingerprint and doc.fingerprint != fingerprint:
        raise c.fail("fingerprint", doc.fingerprint, f"does not match the stored graph (it hashes to {fingerprint!r})")


def _check_activations(c: _Checker, doc: ProfileDoc, node_index: dict[str, int], tensor_index: dict[str, int]) -> None:
    """Activations are tensors, listed in creation order (planners break ties by it), with a forward lifetime."""
    c.unique("activations", (row[0] for row in doc.activations))
    previous = (-1, -1)
    for i, row in enumerate(doc.activations):
        c.exists(f"activations[{i}].id", row[0], tensor_index, "tensor")
        at = []
        for col in range(2, 6):
            path = f"activations[{i}].{ACTIVATION_COLUMNS[col]}"
            c.exists(path, row[col], node_index, "node")
            at.append(node_index[row[col]])
            if len(at) > 1 and at[-1] < at[-2]:
                raise c.fail(path, row[col], f"comes before {ACTIVATION_COLUMNS[col - 1]}")
        order = (at[0], tensor_index[row[0]])
        if order < previous:
            raise c.fail(f"activations[{i}].id", row[0], "is out of creation order")
        previous = order


def _check_graph(c: _Checker, doc: ProfileDoc) -> None:
    """The stored graph is the graph the node table measured: same nodes, same order, same wiring."""
    graph = doc.graph.nodes
    if len(graph) != len(doc.nodes):
        raise c.fail("graph.nodes", f"{len(graph)} nodes", f"but the node table has {len(doc.nodes)}")
    for i, (g, row) in enumerate(zip(graph, doc.nodes)):
        stored = (g["id"], g["name"], g["op"], g["target"], g["region"], g["module"], g["shape"], g["dtype"])
        for col, value, expected in zip((0, 1, 2, 3, 4, 5, 7, 8), stored, row[:6] + row[7:9]):
            if value != expected:
                raise c.fail(f"graph.nodes[{i}].{NODE_COLUMNS[col]}", value, f"but nodes[{i}] says {expected!r}")
        reads = list(dict.fromkeys(graph_refs([g["args"], g["kwargs"]])))
        if reads != row[6]:
            raise c.fail(f"nodes[{i}].inputs", row[6], f"but the graph node reads {_short(reads)}")
    placeholders = sum(g["op"] == "placeholder" for g in graph)
    if len(doc.graph.inputs) != placeholders:
        raise c.fail("graph.inputs", f"{len(doc.graph.inputs)} slots", f"but the graph has {placeholders} inputs")


def validate_profile(doc: dict[str, Any], source: str | os.PathLike, fingerprint_of) -> ProfileDoc:
    """Type-check and cross-check a profile document; ``fingerprint_of(graph)`` hashes its stored graph."""
    source = str(source)
    parsed = validate_document(_PROFILE, doc, source, "profile")
    check_profile(parsed, source, fingerprint_of(doc["graph"]) if parsed.fingerprint else "")
    return parsed
