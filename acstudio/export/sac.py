"""The ``sac`` export format: a plan as per-op selective-checkpointing decisions (``sac_policy.json``).

Each block the SAC form wraps (see :mod:`acstudio.simulate.sac`) lists the ops of its forward in the order the
captured graph ran them, each with the module that ran it and ``save`` or ``recompute``. An op is addressed by
a key recorded at capture, never guessed: its block, its aten overload and its occurrence among the calls of
that overload in the block's forward. :func:`acstudio.apply_plan` reads this file.

A decision is ``save``, ``recompute`` or ``update``: an op that updates module state (BatchNorm's
``num_batches_tracked += 1``), saved under the policy so that the replay does not update it twice. A block whose
only saved ops are updates can run a plain checkpoint instead, which puts the block's buffers back after the replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from acstudio.export.formats import ExportFormat, ExportJob, register_format
from acstudio.fileio import read_document, write_document
from acstudio.profile.model import Profile
from acstudio.simulate.sac import SAVE, is_op, simulate_sac

POLICY_FILE = "sac_policy.json"
POLICY_SCHEMA = "acstudio.sac_policy"
POLICY_VERSION = 1
# torch's CheckpointPolicy.MUST_CPU_OFFLOAD could carry the decision, but the SAC replay is not priced with offload.
OFFLOAD_NOT_CARRIED = ("the plan offloads activations to host memory, which the SAC policy does not carry — export "
                       "the step format and run it with acstudio.load_step")


@dataclass(frozen=True)
class OpDecision:
    op: str  # aten overload, e.g. "aten.addmm.default"
    module: str  # innermost module that ran it (for messages)
    save: bool
    updates_state: bool = False  # saved because it updates module state, not for the plan


@dataclass
class SacPolicy:
    """Per wrapped block, its forward's ops in order with their decisions.

    ``containers`` holds, for the module around each numbered block (``transformer.h``), the numbers of its
    children that ran in the profiled model (``0``, ``1``): a model with more or fewer blocks there is another
    model, even where every wrapped block exists (empty in policies written before it was recorded).
    """

    profile_fingerprint: str
    blocks: dict[str, list[OpDecision]]
    freed: list[str]  # activation ids the SAC form frees
    predicted_peak_bytes: int
    predicted_extra_ms: float
    containers: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_plan(cls, profile: Profile, recomputed: list[str]) -> SacPolicy:
        form = simulate_sac(profile, recomputed)
        by_id = profile.node_by_id
        blocks = {b: [OpDecision(by_id[i].target, by_id[i].module, how == SAVE, i in form.state_updates)
                      for i, how in ops if is_op(by_id[i])] for b, ops in form.decisions.items()}
        return cls(profile.fingerprint, blocks, form.freed, form.result.peak_bytes, form.result.extra_ms,
                   containers(profile, blocks))

    def to_dict(self) -> dict:
        return {"profile_fingerprint": self.profile_fingerprint,
                "blocks": {b: [[d.op, d.module, _decision(d)] for d in ops] for b, ops in self.blocks.items()},
                "freed": self.freed, "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_extra_ms": self.predicted_extra_ms, "containers": self.containers}

    @classmethod
    def from_dict(cls, d: dict) -> SacPolicy:
        blocks = {b: [OpDecision(op, module, how in ("save", "update"), how == "update") for op, module, how in ops]
                  for b, ops in d["blocks"].items()}
        return cls(d["profile_fingerprint"], blocks, d["freed"], d["predicted_peak_bytes"], d["predicted_extra_ms"],
                   {k: list(v) for k, v in d.get("containers", {}).items()})

    def save(self, directory: Path) -> str:
        path = Path(directory) / POLICY_FILE
        write_document(path, POLICY_SCHEMA, POLICY_VERSION, self.to_dict())
        return str(path)

    @classmethod
    def load(cls, directory: str | Path) -> SacPolicy:
        return cls.from_dict(read_document(Path(directory) / POLICY_FILE, POLICY_SCHEMA, POLICY_VERSION))


def containers(profile: Profile, blocks) -> dict[str, list[str]]:
    """For the parent module of every numbered block (``transformer.h`` of ``transformer.h.3``), the numbers of its
    children that ran ops in the profiled model."""
    parents = {parent for parent, _, index in (b.rpartition(".") for b in blocks) if parent and index.isdigit()}
    ran = {r.module for r in profile.nodes if r.module}
    out = {}
    for parent in sorted(parents):
        children = {m[len(parent) + 1:].partition(".")[0] for m in ran if m.startswith(parent + ".")}
        out[parent] = sorted((c for c in children if c.isdigit()), key=int)
    return out


def _decision(d: OpDecision) -> str:
    return ("update" if d.updates_state else "save") if d.save else "recompute"


def policy(job: ExportJob) -> SacPolicy:
    """The job's SAC policy, made once per export."""
    return job.once("sac", lambda: SacPolicy.from_plan(job.profile, job.recomputed))


def write(job: ExportJob, directory: Path) -> list[str]:
    return [Path(policy(job).save(directory)).name]


def unavailable(job: ExportJob) -> str:
    if getattr(job.recomputed, "offloaded", ()):
        return OFFLOAD_NOT_CARRIED
    if policy(job).blocks:
        return ""
    return ("the plan frees nothing inside a block SAC can wrap (a repeated block or a module around them), so "
            "SAC would change nothing")


register_format(ExportFormat("sac", f"{POLICY_FILE}: per-op save/recompute decisions for acstudio.apply_plan "
                             "(torch's selective activation checkpointing; works under torch.compile, FSDP2, DDP)",
                             write, unavailable))
