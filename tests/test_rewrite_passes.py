"""The rewrite pass runner: passes run in order, a broken graph or guarantee is reported with the pass that broke it
and the passes before it, and which passes run follows the replay mode and the plan."""

import operator

import pytest
import torch
import torch.fx as fx

from acstudio.errors import RewriteError
from acstudio.rewrite.passes import RewriteContext, run_passes
from acstudio.rewrite.rewriter import rewrite_passes
from acstudio.simulate.modes import get_mode


class Step:
    """A pass made of plain callables, for the runner's tests."""

    def __init__(self, name, call=None, ensures=None, requires=None):
        self.name = name
        self._call, self._ensures, self._requires = call, ensures, requires

    def requires(self, gm, ctx):
        if self._requires:
            self._requires(gm)

    def call(self, gm, ctx):
        return self._call(gm) if self._call else False

    def ensures(self, gm, ctx):
        if self._ensures:
            self._ensures(gm)


def graph_module():
    return fx.symbolic_trace(lambda x: torch.relu(x) + 1)


def context(recomputed=(), offloaded=(), mode="again", keep_random=False):
    """A plan's context; the passes these tests run read no profile."""
    return RewriteContext(profile=None, recomputed=list(recomputed), offloaded=list(offloaded), mode=get_mode(mode),
                          keep_random=keep_random)


def add_neg(gm):
    """Negate the output: a real change the runner must recompile into the generated code."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        neg = gm.graph.call_function(operator.neg, (out.args[0],))
    out.args = (neg,)
    return True


def test_passes_run_in_order_and_the_graph_is_recompiled_after_each():
    gm = graph_module()
    seen = []
    passes = [Step("negate", add_neg), Step("look", lambda g: seen.append(g(torch.tensor([-2.0, 3.0]))) or False)]
    assert run_passes(gm, context(), passes) == ["negate"]
    assert torch.equal(seen[0], torch.tensor([-1.0, -4.0]))  # the second pass already ran the recompiled graph


def test_a_failing_pass_is_named_with_the_passes_before_it():
    def boom(gm):
        raise ValueError("no such node")

    with pytest.raises(RewriteError, match=r"pass third failed \(passes run before it: first, second\): no such node"):
        run_passes(graph_module(), context(), [Step("first"), Step("second", add_neg), Step("third", boom)])


def test_a_pass_that_breaks_the_graph_is_caught_at_that_pass():
    def dangling(gm):
        x = next(iter(gm.graph.nodes))
        with gm.graph.inserting_before(x):  # reads a node defined after it: not a valid graph
            gm.graph.call_function(operator.neg, (next(n for n in gm.graph.nodes if n.op == "output").args[0],))
        return True

    with pytest.raises(RewriteError, match=r"pass dangle failed \(passes run before it: none\)"):
        run_passes(graph_module(), context(), [Step("dangle", dangling), Step("never", add_neg)])


def test_ensures_is_checked_after_the_pass():
    def promise(gm):
        if any(n.target is operator.neg for n in gm.graph.nodes):
            raise AssertionError("the output is negated")

    with pytest.raises(RewriteError, match=r"pass negate broke its guarantee \(passes run before it: first\): "
                                           r"the output is negated"):
        run_passes(graph_module(), context(), [Step("first"), Step("negate", add_neg, ensures=promise)])


def test_a_plan_refusal_keeps_its_own_message():
    def refuse(gm):
        raise RewriteError("activation a1 cannot be recomputed: it reads a graph input updated in place")

    with pytest.raises(RewriteError) as info:
        run_passes(graph_module(), context(), [Step("first"), Step("check", requires=refuse)])
    assert str(info.value) == "activation a1 cannot be recomputed: it reads a graph input updated in place"


@pytest.mark.parametrize("mode", ["again", "shared"])
def test_the_replay_mode_and_the_plan_choose_the_passes(mode):
    names = lambda ctx: [p.name for p in rewrite_passes(ctx)]  # noqa: E731
    every = ["insert_replays", "restore_rng_state", "drop_running_stats", "check_freed", "offload"]
    ctx = context(recomputed=["a1"], offloaded=["a2"], mode=mode)
    assert names(ctx) == every
    assert rewrite_passes(ctx)[0].shares_chains is get_mode(mode).shares_chains
    assert names(context(recomputed=["a1"], mode=mode, keep_random=True)) == [
        "insert_replays", "drop_running_stats", "check_freed"]
    assert names(context(offloaded=["a2"], mode=mode)) == ["offload"]
    assert names(context(mode=mode)) == []
