"""BatchNorm in replays: a training-mode BatchNorm is replayed without its running statistics, which were updated
once, in forward (a second update would count the batch twice)."""

from __future__ import annotations

import torch
import torch.fx as fx

from acstudio.profile.ops import target_name
from acstudio.profile.replay_rules import BATCH_NORM_OPS
from acstudio.rewrite.passes import RewriteContext


def is_batch_norm(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
        and target_name(n.target) in BATCH_NORM_OPS


def _arg_index(target: torch._ops.OpOverload, name: str) -> int | None:
    for i, a in enumerate(target._schema.arguments):
        if a.name == name:
            return i
    return None


def op_arg(n: fx.Node, name: str):
    i = _arg_index(n.target, name)
    if i is None:
        return None
    return n.args[i] if i < len(n.args) else n.kwargs.get(name)


def running_stats(n: fx.Node) -> set:
    """The running-statistics arguments of BatchNorm node ``n``."""
    return {op_arg(n, "running_mean"), op_arg(n, "running_var")}


def _training(n: fx.Node) -> bool:
    """``_batch_norm_with_update`` has no flag: it always trains."""
    return _arg_index(n.target, "training") is None or bool(op_arg(n, "training"))


def updates_running_stats(n: fx.Node) -> bool:
    """Whether ``n`` is a training-mode BatchNorm (one whose replay must leave the running statistics alone)."""
    return is_batch_norm(n) and _training(n)


def drop_running_stats(n: fx.Node) -> None:
    """Make a replayed training-mode BatchNorm leave running statistics alone (same output, no second update).

    Ops whose schema allows it get ``None``; ``_native_batch_norm_legit`` switches to its ``no_stats`` overload;
    ``_batch_norm_with_update`` (no optional form) updates throw-away clones.
    """
    schema = n.target._schema.arguments
    args = [n.args[i] if i < len(n.args) else n.kwargs.get(a.name, a.default_value) for i, a in enumerate(schema)]
    stats = [_arg_index(n.target, "running_mean"), _arg_index(n.target, "running_var")]
    if n.target is torch.ops.aten._native_batch_norm_legit.default:
        n.target = torch.ops.aten._native_batch_norm_legit.no_stats
        n.args, n.kwargs = tuple(a for i, a in enumerate(args) if i not in stats), {}
        return
    for j, i in enumerate(stats):
        if schema[i].type.kind() == "OptionalType":
            args[i] = None
            continue
        with n.graph.inserting_before(n):
            clone = n.graph.call_function(torch.ops.aten.clone.default, (args[i],))
        clone.meta.update({k: v for k, v in args[i].meta.items() if k in ("ac_shape", "ac_dtype", "val")})
        clone.meta.update(ac_id=f"{n.meta['ac_id']}.stats{j}", ac_role="recompute", ac_of=n.meta["ac_of"],
                          ac_region="backward", ac_module=n.meta.get("ac_module", ""))
        args[i] = clone
    n.args, n.kwargs = tuple(args), {}


class DropRunningStats:
    """Every replayed training-mode BatchNorm (in the order the replays made them) stops updating running stats."""

    name = "drop_running_stats"

    def requires(self, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        pass

    def call(self, gm: fx.GraphModule, ctx: RewriteContext) -> bool:
        replayed = [c for c in ctx.copies if updates_running_stats(c)]
        for c in replayed:
            drop_running_stats(c)
        return bool(replayed)

    def ensures(self, gm: fx.GraphModule, ctx: RewriteContext) -> None:
        """Nothing to check here: a replay that still updated the statistics computes the same step with other
        buffers, which is what verification compares (and how such a fault is caught)."""
