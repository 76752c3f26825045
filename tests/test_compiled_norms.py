"""A saved layer norm under torch.compile: its backward reads the normalized input, which Inductor saves.

Measured on GPT-2 seq 512 bs32 on an H200 (``results/probes/compiled_saved_bytes_gpt2-s512_offload-set_h200.txt``):
the recompute set of an offloading plan that keeps every ``ln_1`` peaked 2112.0 MiB above torchtitan's set
compiled whole, exactly the bytes Inductor saved more, where the compiled model held 1587 MiB more: it had every
layer's output recomputed at its first backward use, which the next ``ln_1``'s normalized input holds in its place.
"""

from pathlib import Path

import numpy as np
import pytest

from acstudio.plan.compiled import TIMED_MODE, torchtitan_held
from acstudio.plan.loading import load_plan
from acstudio.plan.schedule import PlanContext
from acstudio.profile.model import Profile
from acstudio.simulate.modes import get_mode
from acstudio.simulate.sac import LAYER_NORM_OPS, SAVE, sac_blocks

MiB = 2**20
PROBES = Path(__file__).resolve().parents[1] / "results" / "probes"
PROFILE = PROBES / "gpt2-s512.compiled-offload-margin-1pct.profile.json.gz"
PLAN = PROBES / "gpt2-s512.compiled-offload-margin-1pct.recompute-set.plan.json"
MEASURED_ABOVE_TORCHTITAN_MIB = 15144.9 - 13032.9  # the two compiled steps' measured peaks, from the probe


@pytest.fixture(scope="module")
def gpt2():
    ctx = PlanContext(Profile.load(PROFILE))
    return ctx, ctx.sim.indices(load_plan(PLAN, ctx.profile).recomputed)


def test_a_layers_output_read_by_a_saved_norm_is_held_compiled(gpt2):
    ctx, recomputed = gpt2
    blocks, nodes = sac_blocks(ctx.sim), ctx.profile.nodes
    schedule = blocks.schedule(recomputed, compiled=True)
    forms = {b: blocks._block(b, asked, True) for b, asked in blocks._asked(recomputed).items()}

    def saved_norm(i: int) -> bool:
        b = blocks.block[i]
        return nodes[i].target in LAYER_NORM_OPS and b in forms and forms[b].decision[i] == SAVE

    read_by_saved_norm = [k for k, readers in blocks.outside_readers.items()
                          if blocks.act_block[k] and any(map(saved_norm, readers))]
    assert len(read_by_saved_norm) == len(blocks.blocks) - 1  # every layer's but the last, read by the final norm
    assert np.all(schedule.back[read_by_saved_norm] == -1)
    assert list(schedule.late) == [blocks.blocks[-1]]


def test_the_compiled_peak_above_torchtitans_set_is_what_inductor_saved_more(gpt2):
    ctx, recomputed = gpt2
    mode = get_mode(TIMED_MODE)
    above = (mode.peak(ctx.sim, recomputed)[0] - mode.peak(ctx.sim, torchtitan_held(ctx))[0]) / MiB
    assert above == pytest.approx(MEASURED_ABOVE_TORCHTITAN_MIB, abs=8)
