"""Replay verdicts of a profile's nodes and activations: which may run twice, and which draw random numbers.

Torch-free unless the profile holds a random op: planning a profile (the app opening one, a slider step) needs
these verdicts, and importing torch to read op tags costs seconds. Only ops whose name is in
:data:`RANDOM_OP_NAMES` (every aten op with an overload tagged ``nondeterministic_seeded``; a test checks the list
against the installed torch) are resolved to their torch overload, to judge them by their tags and arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from acstudio.profile.model import NodeRecord, Profile

if TYPE_CHECKING:
    import torch

# aten ops (packet names) with an overload tagged ``nondeterministic_seeded`` in torch 2.11.
RANDOM_OP_NAMES = frozenset({
    "_cudnn_attention_backward", "_cudnn_attention_forward", "_cudnn_init_dropout_state", "_cudnn_rnn",
    "_efficient_attention_forward", "_fill_mem_eff_dropout_mask_", "_flash_attention_forward",
    "_flash_attention_forward_no_dropout_inplace", "_fused_dropout", "_fused_sdp_choice", "_lstm_mps",
    "_nested_tensor_softmax_with_shape", "_sample_dirichlet", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_attention_math_for_mps", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable",
    "_standard_gamma", "_triton_scaled_dot_attention", "alpha_dropout", "alpha_dropout_", "bernoulli", "bernoulli_",
    "binomial", "cauchy", "cauchy_", "dropout", "dropout_", "exponential", "exponential_", "feature_alpha_dropout",
    "feature_alpha_dropout_", "feature_dropout", "feature_dropout_", "geometric", "geometric_", "gru", "log_normal",
    "log_normal_", "lstm", "miopen_rnn", "multinomial", "native_dropout", "normal", "normal_", "normal_functional",
    "poisson", "rand", "rand_like", "randint", "randint_like", "randn", "randn_like", "random", "random_",
    "randperm", "rnn_relu", "rnn_tanh", "rrelu", "rrelu_", "rrelu_with_noise", "rrelu_with_noise_",
    "rrelu_with_noise_functional", "scaled_dot_product_attention", "uniform", "uniform_",
})

# Ops that update BatchNorm running statistics: replaying them is safe once the rewriter drops the update.
BATCH_NORM_OPS = {"aten.native_batch_norm.default", "aten.cudnn_batch_norm.default",
                  "aten._native_batch_norm_legit.default", "aten.miopen_batch_norm.default",
                  "aten._batch_norm_with_update.default"}
# Random ops (tagged ``nondeterministic_seeded``) that draw numbers are replayed with the generator state their
# forward drew with (see acstudio.rewrite.rng), so by default they are recomputable like any other op.
# ``keep_random`` (``--keep-random``) never repeats a random draw instead, for bitwise-exact randomness. Under it,
# native_dropout is still replayed as ``native_dropout_backward(input, mask, scale)`` on the mask it drew in
# forward (the same masked scale, no second draw), so the node is replayable while its mask output never is.
RANDOM_REASON = "random op (recomputing would draw new random numbers)"
NO_GENERATOR_REASON = "random op without a tensor input (the generator it draws from is not known)"
DROPOUT_OPS = {"aten.native_dropout.default"}
DROPOUT_MASK_REASON = "dropout mask (a random draw: kept; the dropout output is recomputed from it)"


def blocked_reason(sid: str, holders: list[tuple[str, str, str]], creator_target: str, keep_random: bool) -> str:
    """Why activation ``sid`` cannot be recomputed ("" if it can), from its alias nodes' ``(id, region, replay
    verdict)``, the creator first. Under ``keep_random`` a native_dropout mask (its second output) is kept."""
    creator = holders[0][0]
    if keep_random and creator_target in DROPOUT_OPS and sid != creator:
        return f"{creator}: {DROPOUT_MASK_REASON}"
    for node_id, region, verdict in holders:
        if verdict != "ok" and region in ("forward", "loss"):
            return f"{node_id}: {verdict}"
    return ""


def random_verdict(target, args, kwargs, has_input: bool, keep_random: bool) -> str | None:
    """The replay verdict of an op that draws random numbers (None if it draws none: an ordinary op); ``target`` is
    a torch op, so torch is imported already."""
    from acstudio.profile.ops import draws_random, target_name

    if not draws_random(target, args, kwargs):
        return None
    if keep_random:
        return "ok" if target_name(target) in DROPOUT_OPS else RANDOM_REASON
    return "ok" if has_input else NO_GENERATOR_REASON


@dataclass
class ReplayRules:
    """Replay verdicts of a profile's nodes and activations under one random-op rule (see :func:`replay_rules`)."""

    keep_random: bool
    node: list[str]  # per node: "ok" or why it must not run twice
    activation: dict[str, str]  # activation id -> why it cannot be recomputed ("" if it can)
    draws: list[bool]  # per node: whether it draws random numbers (replayed with its forward's generator state)


def replay_rules(profile: Profile, keep_random: bool = False) -> ReplayRules:
    """Node and activation replay verdicts of ``profile`` under the random-op rule ``keep_random``.

    Random ops are judged again from the stored graph (their targets and scalar arguments), so a profile file that
    recorded every op tagged ``nondeterministic_seeded`` as never replayable (SDPA at ``dropout_p == 0`` included)
    plans by the current rule without profiling again. Every other verdict is the recorded one.
    """
    records = profile.graph.get("nodes") or [None] * len(profile.nodes)  # synthetic profiles store no graph
    node, draws = [], []
    for rec, nd in zip(records, profile.nodes):
        verdict, draw = nd.replay, False
        target = _random_op(rec["target"]) if rec and rec["op"] == "call_function" else None
        if target is not None and nd.region in ("forward", "loss"):
            args = rec["args"]["$t"]  # a node's args are stored as a tuple
            has_input = any(isinstance(v, dict) and "$n" in v for v in _flat(args, rec["kwargs"]))
            random = random_verdict(target, args, rec["kwargs"], has_input, keep_random)
            if random is not None and random != "ok":
                verdict = random
            elif verdict.startswith("random op"):  # recorded as never replayable: judged by the current rule
                verdict = _state_write_reason(profile, nd) or "ok"
            draw = random is not None and verdict == "ok" and not keep_random
        node.append(verdict)
        draws.append(draw)
    index = profile.node_index
    holders = {t.id: [t.created_at, *t.aliases] for t in profile.tensors}
    activation = {}
    for a in profile.activations:
        hs = [(h, profile.nodes[index[h]].region, node[index[h]]) for h in holders[a.id]]
        activation[a.id] = blocked_reason(a.id, hs, profile.nodes[index[a.created_at]].target, keep_random)
    return ReplayRules(keep_random=keep_random, node=node, activation=activation, draws=draws)


def _flat(args, kwargs) -> list:
    out, stack = [], [*args, *kwargs.values()]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict) and "$t" in v:
            stack.extend(v["$t"])
        else:
            out.append(v)
    return out


def _state_write_reason(profile: Profile, nd: NodeRecord) -> str:
    """For an in-place random op recorded as never replayable: whether it writes a parameter, buffer or input."""
    if not nd.target.split(".")[1].endswith("_") or not nd.storage:
        return ""
    created = profile.node_by_id[next(t.created_at for t in profile.tensors if t.id == nd.storage)]
    return "mutates graph state (parameter, buffer or input)" if created.op == "placeholder" else ""


def _random_op(name: str) -> torch._ops.OpOverload | None:
    """The torch overload of stored target ``name`` if it is tagged ``nondeterministic_seeded`` (imports torch only
    for names in :data:`RANDOM_OP_NAMES`)."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten" or parts[1] not in RANDOM_OP_NAMES:
        return None
    import torch

    from acstudio.profile.ops import aten_op

    op = aten_op(name)
    return op if op is not None and torch.Tag.nondeterministic_seeded in op.tags else None

