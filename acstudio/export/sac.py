"""The ``sac`` export format: a plan as per-op selective-checkpointing decisions (``sac_policy.json``).

Each block the SAC form wraps (see :mod:`acstudio.simulate.sac`) lists the ops of its forward in the order the
captured graph ran them, each with the module that ran it and its decision. An op is addressed by a key recorded
at capture, never guessed: its block, its aten overload and its occurrence among the calls of that overload in the
block's forward. :func:`acstudio.apply_plan` reads this file.

A decision is ``save``, ``recompute``, ``update`` (an op that updates module state, BatchNorm's
``num_batches_tracked += 1``, saved under the policy so that the replay does not update it twice), ``offload``
(saved, its output copied to host memory after forward and back for the replay) or ``save-eager`` (saved in eager
only because the block's other random ops are: eager replays draw from the generator state the block started with;
under torch.compile each recomputed random op keeps its own, so it is recomputed, as the compiled plan priced it).
A block whose only saved ops are updates can run a plain checkpoint instead, which puts the block's buffers back
after the replay.

Version 2 adds ``offload`` and the bytes the policy offloads, version 3 ``save-eager``, version 4 ``regions``: for a
plan made for torch.compile that offloads (replay mode "sac-compiled"), the blocks that run compiled one by one with
everything they save copied to the host, each with the block at whose backward start its copies come back
(:meth:`~acstudio.simulate.sac.ReplaySacCompiled.offload`); version 5 ``mask_bias``: those blocks and every other
block of the loop they run in are handed SDPA's bias of their boolean attention mask, made once, in place of the
mask (replay mode "sac-compiled-bias", :func:`acstudio.export.apply.hand_blocks_mask_bias`). Each policy is written
at the lowest version that holds its decisions (one without any is version 1, which earlier versions of AC Studio
read too), and all are read.
Per-op offload runs only where the installed torch passes SAC's cache through saved-tensors hooks
(:func:`offload_unsupported`); elsewhere a plan that offloads so is refused here, naming the form that runs it.
Regions need no such support: a compiled block saves through plain saved-tensors hooks.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from acstudio.errors import ProfileFileError
from acstudio.export.formats import ExportFormat, ExportJob, register_format
from acstudio.fileio import read_document, write_document
from acstudio.profile.model import Profile
from acstudio.simulate.modes import REPLAY_MODES, get_mode
from acstudio.simulate.sac import OFFLOAD, SAVE, is_op, sac_blocks, simulate_sac
from acstudio.simulate.simulator import Simulator

POLICY_FILE = "sac_policy.json"
POLICY_SCHEMA = "acstudio.sac_policy"
VERSIONS = (5, 4, 3, 2, 1)  # read; written: 5 with the mask's bias, 4 with regions, 3 with a save-eager decision,
# 2 when it offloads, else 1
OFFLOAD_FORM = "export the step format and run it with acstudio.load_step"


def offloads_by_region(replay_mode: str) -> bool:
    """Whether a plan made in ``replay_mode`` offloads what whole blocks save (a compiled mode: the policy's
    regions) rather than per op."""
    mode = REPLAY_MODES.get(replay_mode)
    return mode is not None and mode.offloads_by_region


@dataclass(frozen=True)
class OpDecision:
    op: str  # aten overload, e.g. "aten.addmm.default"
    module: str  # innermost module that ran it (for messages)
    save: bool
    updates_state: bool = False  # saved because it updates module state, not for the plan
    offload: bool = False  # saved, its output copied to host memory and back
    eager_only: bool = False  # saved in eager for the block's random ops; recomputed under torch.compile


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
    offload_bytes: int = 0  # bytes the offload decisions copy to the host each step (its pinned memory)
    # blocks compiled one by one whose saved tensors go to the host -> the block at whose backward start they come
    # back (a plan for torch.compile that offloads; see the module)
    regions: dict[str, str] = field(default_factory=dict)
    mask_bias: bool = False  # the blocks run one by one for the regions are handed the mask's bias (see the module)

    @classmethod
    def from_plan(cls, profile: Profile, recomputed: list[str], offloaded: Collection[str] = (),
                  replay_mode: str = "sac", region_fetches: dict[str, str] | None = None) -> SacPolicy:
        """The SAC form of ``recomputed``, offloading what it can of ``offloaded`` (activation ids): per op, or,
        for a plan made in a compiled mode that offloads by region (:func:`offloads_by_region`), what whole blocks
        save, each block's copies fetched where ``region_fetches`` (the plan's: placed on the times it was priced
        at) says, else where the profile's times place them."""
        regions = offloads_by_region(replay_mode) and bool(offloaded)
        sim = Simulator(profile)
        form = simulate_sac(sim, recomputed, () if regions else offloaded)
        by_id = profile.node_by_id
        blocks = {b: [OpDecision(by_id[i].target, by_id[i].module, how in (SAVE, OFFLOAD), i in form.state_updates,
                                 how == OFFLOAD, i in form.eager_only)
                      for i, how in ops if is_op(by_id[i])] for b, ops in form.decisions.items()}
        if regions:
            result = get_mode(replay_mode).simulate(sim, recomputed, offloaded)
            bias = get_mode(replay_mode).hands_mask_bias and bool(sac_blocks(sim).mask_biases)
            return cls(profile.fingerprint, blocks, form.freed, result.peak_bytes, result.extra_ms,
                       containers(profile, blocks), result.offload.moved_bytes,
                       region_fetches or sac_blocks(sim).fetched_by(result.offload), bias)
        moved = form.result.offload.moved_bytes if form.result.offload is not None else 0
        return cls(profile.fingerprint, blocks, form.freed, form.result.peak_bytes, form.result.extra_ms,
                   containers(profile, blocks), moved)

    @property
    def offloads(self) -> bool:
        """Whether a block's op offloads its output (eager SAC's cache through saved-tensors hooks)."""
        return any(d.offload for ops in self.blocks.values() for d in ops)

    @property
    def version(self) -> int:
        """The lowest file version that holds its decisions (see the module)."""
        if self.mask_bias:
            return 5
        if self.regions:
            return 4
        decisions = [d for ops in self.blocks.values() for d in ops]
        return 3 if any(d.eager_only and not d.offload for d in decisions) else 2 if self.offloads else 1

    def to_dict(self) -> dict:
        d = {"profile_fingerprint": self.profile_fingerprint,
             "blocks": {b: [[d.op, d.module, _decision(d)] for d in ops] for b, ops in self.blocks.items()},
             "freed": self.freed, "predicted_peak_bytes": self.predicted_peak_bytes,
             "predicted_extra_ms": self.predicted_extra_ms, "containers": self.containers}
        if self.regions:
            d["regions"] = self.regions
        if self.mask_bias:
            d["mask_bias"] = True
        return {**d, "offload_bytes": self.offload_bytes} if self.offloads or self.regions else d

    @classmethod
    def from_dict(cls, d: dict) -> SacPolicy:
        blocks = {b: [OpDecision(op, module, how in ("save", "update", "offload", "save-eager"), how == "update",
                                 how == "offload", how == "save-eager")
                      for op, module, how in ops] for b, ops in d["blocks"].items()}
        return cls(d["profile_fingerprint"], blocks, d["freed"], d["predicted_peak_bytes"], d["predicted_extra_ms"],
                   {k: list(v) for k, v in d.get("containers", {}).items()}, int(d.get("offload_bytes", 0)),
                   {str(k): str(v) for k, v in d.get("regions", {}).items()}, bool(d.get("mask_bias", False)))

    def save(self, directory: Path) -> str:
        path = Path(directory) / POLICY_FILE
        write_document(path, POLICY_SCHEMA, self.version, self.to_dict())
        return str(path)

    @classmethod
    def load(cls, directory: str | Path) -> SacPolicy:
        path = Path(directory) / POLICY_FILE
        newest = None
        for version in VERSIONS:
            try:
                document = read_document(path, POLICY_SCHEMA, version)
            except ProfileFileError as exc:
                newest = newest or exc
                continue
            try:
                return cls.from_dict(document)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a field of the wrong shape
                raise ProfileFileError(f"{path}: corrupt sac_policy: {type(exc).__name__}: {str(exc)[:80]} — export "
                                       "it again") from exc
        raise newest


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
    if not d.save:
        return "recompute"
    return "update" if d.updates_state else OFFLOAD if d.offload else "save-eager" if d.eager_only else "save"


def policy(job: ExportJob) -> SacPolicy:
    """The job's SAC policy, made once per export."""
    return job.once("sac", lambda: SacPolicy.from_plan(job.profile, job.recomputed,
                                                       getattr(job.recomputed, "offloaded", ()),
                                                       getattr(job.recomputed, "replay_mode", "sac"),
                                                       getattr(job.plan, "region_fetches", None)))


def write(job: ExportJob, directory: Path) -> list[str]:
    return [Path(policy(job).save(directory)).name]


_NO_OFFLOAD = ("torch {}'s selective checkpointing keeps what it saves on the device (it passes no saved tensor to "
               "saved-tensors hooks, and recomputes a CheckpointPolicy.MUST_CPU_OFFLOAD op)")



@functools.cache
def offload_unsupported() -> str:
    """Why this torch cannot run a SAC policy's offload decisions ("" where it can): tried, not read off the
    version. Offload needs SAC's cache to pass through saved-tensors hooks; a torch without checkpoint's
    ``respect_saved_tensors_hooks`` keeps what SAC saves on the device whatever hook is active, and eager SAC
    recomputes a ``MUST_CPU_OFFLOAD`` op instead of offloading it."""
    packed = set()

    def pack(t):
        packed.add(t.untyped_storage().data_ptr())
        return t

    x = torch.ones(2, requires_grad=True)
    saves = functools.partial(create_selective_checkpoint_contexts, lambda *args, **kwargs: CheckpointPolicy.MUST_SAVE)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            cached = checkpoint(torch.sin, x, use_reentrant=False, context_fn=saves, respect_saved_tensors_hooks=True)
    except TypeError:
        return _NO_OFFLOAD.format(torch.__version__)
    if cached.untyped_storage().data_ptr() in packed:  # SAC's cache of sin's output reached the hook
        return ""
    return _NO_OFFLOAD.format(torch.__version__)


def offload_refusal() -> str:
    """Why this torch cannot run a policy that offloads, naming the form that can ("" where it can)."""
    why = offload_unsupported()
    return f"the plan offloads activations to host memory, but {why} — {OFFLOAD_FORM}" if why else ""


def unavailable(job: ExportJob) -> str:
    regions = offloads_by_region(getattr(job.recomputed, "replay_mode", ""))
    if getattr(job.recomputed, "offloaded", ()) and not regions:
        refusal = offload_refusal()
        if refusal:
            return refusal
    if policy(job).blocks or policy(job).regions:
        return ""
    return ("the plan frees nothing inside a block SAC can wrap (a repeated block or a module around them), so "
            "SAC would change nothing")


register_format(ExportFormat("sac", f"{POLICY_FILE}: per-op save/recompute/offload decisions for acstudio.apply_plan "
                             "(torch's selective activation checkpointing; works under torch.compile, FSDP2, DDP)",
                             write, unavailable))
