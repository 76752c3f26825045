"""Block search: per-block checkpointing first, then keep back what saves the most shared-replay time per byte."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from test_rewrite import captured, check_accounting, run_from

from acstudio.plan import baselines
from acstudio.plan.schedule import PlanContext
from acstudio.plan.solvers import plan
from acstudio.plan.solvers.blocks import block_search
from acstudio.rewrite import rewrite


@pytest.mark.parametrize("model", ["bert", "gpt2"])
def test_block_search_walks_from_per_block_to_keeping_and_runs_bitwise(model):
    spec, w, opt, step, profile = captured(model)
    ctx = PlanContext(profile)
    search = block_search(ctx)
    assert block_search(ctx) is search  # built once per profile
    per_module = set(baselines.per_module(ctx))
    assert per_module and per_module <= set(search.recomputed(0))  # state 0: every block checkpointed
    sets = [set(search.recomputed(j)) for j in range(len(search.moves) + 1)]
    assert all(b <= a for a, b in itertools.pairwise(sets))  # each move keeps more back
    # Identical layers share one solution: every layer's moves keep the same positions.
    members = baselines.block_members(ctx)
    kept_positions = {b: sorted(ks.index(k) for m in search.moves for k in m.keep if k in ks)
                      for b, ks in members.items()}
    assert len({tuple(v) for v in kept_positions.values()}) == 1
    peaks = [search.evaluate(j)[0] for j in range(len(search.moves) + 1)]
    for budget in np.linspace(min(peaks), max(peaks), 5).astype(int):
        p = plan(profile, int(budget), "blocks", ctx=ctx)
        assert p.feasible and p.predicted_peak_bytes <= budget
        assert p.replay_mode == "shared" or not p.recomputed
        new = rewrite(step, profile, p)
        check_accounting(new.gm, profile, p.predicted_peak_bytes, ctx.sim.replay)
        assert new.replay_ms == pytest.approx(p.predicted_extra_ms)
    for a, b in zip(run_from(new, w.model, opt, spec.optimizer, w.batch),
                    run_from(step, w.model, opt, spec.optimizer, w.batch)):
        assert torch.equal(a, b)
