"""Planning for ``torch.compile``: the compiled step's peak, calibrated on one measured compiled step.

The eager profile does not predict a compiled peak: Inductor fuses, so the forward and backward keep fewer
temporaries, and AOTAutograd's partitioner picks what the ops outside the blocks (embeddings, loss head) save.
Inside the blocks a SAC plan leaves it no choice: every op is ``MUST_SAVE`` or ``MUST_RECOMPUTE``, so the compiled
step saves exactly the op outputs that eager SAC saves. What compile changes therefore does not depend on the
plan, and one offset, measured once, carries the SAC mode's eager prediction of any plan over to the compiled step:

    compiled peak(plan) = SAC-mode peak(plan) - offset,
    offset = SAC-mode peak(recompute-all) - measured compiled peak of per-block checkpointing.

The compiled model under per-block checkpointing (``compile+per-block``: every block under a plain non-reentrant
checkpoint) saves what the recompute-all plan saves, the blocks' inputs. The model holds while the peak stays where
the saved activations all live (the end of forward, the loss head): the plans it compares keep the same
temporaries there and differ by the activations they save.
"""

from __future__ import annotations

import dataclasses

from acstudio.errors import ACStudioError
from acstudio.jobs import CancelToken
from acstudio.plan.baselines import recompute_all
from acstudio.plan.model import Plan
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import plan_for_mode
from acstudio.units import format_bytes

COMPILED_MODE = "sac"  # a compiled plan runs as torch's selective checkpointing (acstudio.apply_plan)


def compiled_offset(ctx: PlanContext, measured_per_block_peak: int) -> int:
    """Bytes the compiled step holds less than the SAC mode predicts for the same plan (see the module)."""
    if measured_per_block_peak <= 0:
        raise ACStudioError(f"the compiled per-block peak is {measured_per_block_peak} bytes — give the peak "
                            "measured for compile+per-block (e.g. 3870MiB)")
    eager = ctx.plan_for_set("recompute-all", 0, recompute_all(ctx), mode=COMPILED_MODE).predicted_peak_bytes
    return eager - measured_per_block_peak


def plan_compiled(ctx: PlanContext, budget: int, measured_per_block_peak: int, solver: str = "auto",
                  cancel: CancelToken | None = None) -> Plan:
    """The fastest plan whose compiled peak fits ``budget``: planned in the SAC mode at ``budget`` plus the
    offset. The plan records the offset (``compiled_offset_bytes``); its ``predicted_peak_bytes`` stays the SAC
    mode's eager prediction, and ``compiled_peak_bytes`` is the compiled one."""
    offset = compiled_offset(ctx, measured_per_block_peak)
    chosen = plan_for_mode(ctx, budget + offset, COMPILED_MODE, solver, cancel)
    chosen = dataclasses.replace(chosen, budget_bytes=budget, compiled_offset_bytes=offset)
    why = (f"{chosen.stop_reason}; compiled peak {format_bytes(chosen.compiled_peak_bytes)}, calibrated on "
           f"compile+per-block's measured {format_bytes(measured_per_block_peak)}")
    return dataclasses.replace(chosen, stop_reason=why)

