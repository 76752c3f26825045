"""Trace forward + loss + backward + ``optimizer.step()`` into one aten graph with ``make_fx`` (fake mode).

Recipe: parameters and buffers are swapped for graph inputs with
``torch.nn.utils.stateless`` (tied weights stay tied), the optimizer is pointed at those inputs and at its
lifted state, and gradients come from ``torch.autograd.grad`` (no accumulation into ``.grad``). Regions and
module paths are recorded while tracing from the graph's length at phase boundaries and module hooks, so no
marker ops enter the graph.

Optimizer hyperparameters are graph inputs, not constants. torch.optim takes them as Python numbers and passes
them (and numbers computed from them, such as ``lr / bias_correction1``) to aten ops as scalar arguments. They
are traced as symbolic floats (``SymFloat``) of the fake mode's ``ShapeEnv``, placed in the param groups while
``optimizer.step()`` runs: make_fx then records torch.optim's own scalar arithmetic as Python-level graph nodes
(``lr / (1 - beta1 ** step)``) feeding the same aten ops with the same scalar values as eager, so a CPU step is
bitwise the eager ``optimizer.step()`` at any learning rate. Making them 0-dim tensors instead would send
torch.optim down its tensor-hyperparameter formulas (different rounding, and a host sync per ``.item()``), and
passing them outside the graph would leave the exported module unable to run by itself. A branch torch.optim
takes on a value (``if weight_decay != 0``) becomes a ShapeEnv guard, recorded as a condition that
``load_step`` checks at every call.

The update traced is the one the optimizer runs eagerly, on every device: torch.optim's default
(non-capturable) code, ``.item()`` of its CPU step counter included (an unbacked float in the graph, no device
sync), so a CUDA step is bitwise the eager ``optimizer.step()`` too. Capturable formulas round differently
(``beta1 ** step`` and ``lr / bias_correction`` in fp32 on the device), and Adam turns that rounding into
visible training differences within a few steps, so they are traced only for groups the user made capturable
(then with ``torch.compiler.is_compiling()`` patched to True, as torch.compile does); whether a group was
capturable is recorded and must match at ``load_step``.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import defaultdict
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.utils import stateless
from torch.utils import _pytree as pytree

from acstudio.capture.serialize import tensor_summary
from acstudio.capture.step import (
    HYPERPARAMETERS,
    CapturedStep,
    InputSlot,
    OptimizerRecord,
    group_value,
    hyper_key,
    prepare_optimizer,
    set_group_value,
    switches,
)
from acstudio.errors import CaptureError
from acstudio.jobs import CancelToken, ProgressFn, check, report


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Switch CUDA groups to ``capturable=True`` with their step counters on the GPU.

    Only for exports made before the capturable flag was recorded: their CUDA Adam/AdamW graphs were traced with
    the capturable formulas and read device step counters.
    """
    for group in optimizer.param_groups:
        if group.get("capturable", True) or not any(p.is_cuda for p in group["params"]):
            continue
        group["capturable"] = True
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                optimizer.state[p]["step"] = step.to(p.device)


def resolve_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Pin ``foreach`` to what torch.optim would pick for the real tensors.

    Under fake tensors torch.optim's default heuristic sees a non-native tensor type and would fall back to
    the per-tensor loop, which allocates differently from the eager step that we are modelling.
    """
    from torch.optim.optimizer import _default_to_fused_or_foreach

    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None:
            _, foreach = _default_to_fused_or_foreach(group["params"], differentiable=False, use_fused=False)
            group["foreach"] = bool(foreach)


class _PhaseRecorder:
    """Remembers graph length at phase boundaries and module entries/exits during ``make_fx`` tracing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {id(m): name for name, m in model.named_modules()}
        self.phases: list[tuple[int, str]] = []
        self.module_events: list[tuple[int, str]] = []
        self._stack: list[str] = []

    @staticmethod
    def graph_len() -> int:
        mode = get_proxy_mode()
        return len(mode.tracer.graph.nodes) if mode is not None else 0

    def phase(self, region: str) -> None:
        self.phases.append((self.graph_len(), region))

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        def pre(module, args):
            name = self.names.get(id(module))
            if name is not None:
                self._stack.append(name)
                self.module_events.append((self.graph_len(), name))

        def post(module, args, output):
            if self.names.get(id(module)) is not None and self._stack:
                self._stack.pop()
                self.module_events.append((self.graph_len(), self._stack[-1] if self._stack else ""))

        from torch.nn.modules import module as nn_module

        h1 = nn_module.register_module_forward_pre_hook(pre)
        h2 = nn_module.register_module_forward_hook(post)
        try:
            yield
        finally:
            h1.remove()
            h2.remove()


@contextlib.contextmanager
def _optimizer_on(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], state: dict,
                  hyper: dict[tuple[int, str], Any]) -> Iterator[None]:
    """Temporarily point the optimizer's param groups, state and hyperparameters at traced values."""
    saved_groups = [dict(g) for g in optimizer.param_groups]
    saved_state = optimizer.state
    it = iter(params)
    for g in optimizer.param_groups:
        g["params"] = [next(it) for _ in g["params"]]
    for (g, name), value in hyper.items():
        set_group_value(optimizer.param_groups[g], name, value)
    optimizer.state = defaultdict(dict, state)
    try:
        yield
    finally:
        for g, saved in zip(optimizer.param_groups, saved_groups):
            g.update(saved)
        optimizer.state = saved_state


def hyperparameter_slots(optimizer: torch.optim.Optimizer) -> list[InputSlot]:
    """One graph input per numeric hyperparameter of every param group, e.g. ``hyper 0/lr``."""
    kind = type(optimizer).__name__
    if kind not in HYPERPARAMETERS:
        raise CaptureError(f"cannot capture torch.optim.{kind}: AC Studio traces "
                           f"{', '.join(f'torch.optim.{k}' for k in HYPERPARAMETERS)} — use one of those")
    return [InputSlot("hyper", f"{g}/{name}") for g in range(len(optimizer.param_groups))
            for name in HYPERPARAMETERS[kind]]


class SymbolicHyperparameters:
    """A fake mode whose ShapeEnv gives each hyperparameter a symbolic float, hinted with its current value.

    Symbols are never merged by value (no duck sizing) and 0 or 1 is not specialised, so two settings that happen
    to be equal stay two inputs. After tracing, the guards torch.optim's branches left on them become
    :class:`OptimizerRecord` conditions.
    """

    def __init__(self) -> None:
        import torch._functorch.config as functorch_config
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.shape_env = ShapeEnv(duck_shape=False)
        # The same fake mode make_fx(tracing_mode="fake") would make, with our ShapeEnv.
        with functorch_config.patch(fake_tensor_allow_unsafe_data_ptr_access=False):
            self.fake_mode = FakeTensorMode(allow_fallback_kernels=True, shape_env=self.shape_env,
                                            static_shapes=True)
        self.key_of: dict[Any, str] = {}  # symbol -> input key
        self.value_of: dict[Any, float] = {}  # symbol -> traced value

    def fake(self, t: torch.Tensor) -> torch.Tensor:
        return self.fake_mode.from_tensor(t, static_shapes=True)

    def symbol(self, key: str, value: float):
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic

        source = ConstantSource(f"hyper_{key.replace('/', '_')}")
        expr = self.shape_env.create_unspecified_symbol(value, source, dynamic_dim=DimDynamic.DYNAMIC)
        self.key_of[expr], self.value_of[expr] = key, value
        return self.shape_env.create_symfloatnode(expr, hint=value, source=source)

    def conditions(self) -> list[tuple[str, str, float]]:
        """The guards as ``(input key, op, value)``. A guard of another form (none seen for SGD, Adam, AdamW)
        pins each hyperparameter it involves to its traced value: sound, only less permissive."""
        import sympy

        ops = {sympy.Eq: "==", sympy.Ne: "!=", sympy.Ge: ">=", sympy.Gt: ">", sympy.Le: "<=", sympy.Lt: "<"}
        flipped = {">=": "<=", ">": "<", "<=": ">=", "<": ">", "==": "==", "!=": "!="}
        out = []
        for guard in self.shape_env.guards:
            expr = guard.expr
            op = ops.get(type(expr))
            if op and expr.lhs.is_number and expr.rhs in self.key_of:
                out.append((self.key_of[expr.rhs], flipped[op], float(expr.lhs)))
            elif op and expr.lhs in self.key_of and expr.rhs.is_number:
                out.append((self.key_of[expr.lhs], op, float(expr.rhs)))
            else:
                pinned = sorted((sym for sym in expr.free_symbols if sym in self.key_of), key=self.key_of.get)
                out += [(self.key_of[sym], "==", self.value_of[sym]) for sym in pinned]
        return list(dict.fromkeys(out))


def optimizer_record(optimizer: torch.optim.Optimizer, fqn_of: dict[int, str],
                     conditions: list[tuple[str, str, float]]) -> OptimizerRecord:
    kind = type(optimizer).__name__
    groups = [{"params": [fqn_of[id(p)] for p in g["params"]], "switches": switches(g),
               "capturable": bool(g.get("capturable", False)),
               "hyperparameters": {name: group_value(g, name) for name in HYPERPARAMETERS[kind]}}
              for g in optimizer.param_groups]
    return OptimizerRecord(type=kind, groups=groups, conditions=conditions)


def capture_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn,
    *,
    autocast_dtype: torch.dtype | None = None,
    progress: ProgressFn | None = None,
    cancel: CancelToken | None = None,
) -> CapturedStep:
    """Trace one whole training iteration of ``model`` (already on its device) into a ``CapturedStep``."""
    hyper_slots = hyperparameter_slots(optimizer)
    report(progress, 0, 3, "preparing optimizer state")
    prepare_optimizer(model, optimizer)
    resolve_foreach(optimizer)
    check(cancel)

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    group_params = [p for g in optimizer.param_groups for p in g["params"]]
    fqn_of = {id(p): n for n, p in params.items()}
    missing = [p for p in group_params if id(p) not in fqn_of]
    if missing:
        raise CaptureError("the optimizer holds tensors that are not parameters of the model")
    slots: list[InputSlot] = [InputSlot("param", n) for n in params]
    slots += [InputSlot("buffer", n) for n in buffers]
    for p in group_params:
        for name, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                slots.append(InputSlot("opt_state", f"{fqn_of[id(p)]}/{name}"))
    batch_leaves, batch_spec = pytree.tree_flatten(batch)
    slots += [InputSlot("batch", str(i)) for i in range(len(batch_leaves))]
    slots += hyper_slots

    grad_params = [n for n, p in params.items() if p.requires_grad]
    device_type = next(iter(params.values())).device.type if params else "cpu"
    recorder = _PhaseRecorder(model)
    n_params, n_buffers, n_hyper = len(params), len(buffers), len(hyper_slots)
    # Groups the user made capturable keep torch.optim's compiled-mode formulas (see the module docstring).
    compiling = (mock.patch("torch.compiler.is_compiling", lambda: True)
                 if any(g.get("capturable") for g in optimizer.param_groups) else contextlib.nullcontext())

    def step(flat: list):
        flat, hyper_values = flat[:len(flat) - n_hyper], flat[len(flat) - n_hyper:]
        p_t = dict(zip(params, flat[:n_params]))
        b_t = dict(zip(buffers, flat[n_params:n_params + n_buffers]))
        for name in grad_params:
            p_t[name].requires_grad_(True)
        state: dict = defaultdict(dict)
        for slot, t in zip(slots, flat):
            if slot.kind == "opt_state":
                fqn, _, key = slot.key.rpartition("/")
                state[p_t[fqn]][key] = t
        for p in group_params:  # non-tensor state (rare) is carried as is
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    state[p_t[fqn_of[id(p)]]][key] = value
        traced_batch = pytree.tree_unflatten(flat[len(flat) - len(batch_leaves):], batch_spec)

        with stateless._reparametrize_module(model, {**p_t, **b_t}, tie_weights=True):
            recorder.phase("forward")
            autocast = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype
                        else contextlib.nullcontext())
            with autocast, recorder.hooks(), _loss_boundary(model, recorder):
                loss = loss_fn(model, traced_batch)
            recorder.phase("backward")
            grads = torch.autograd.grad(loss, [p_t[n] for n in grad_params])
            recorder.phase("optimizer")
            for name, g in zip(grad_params, grads):
                p_t[name].grad = g
            traced_params = [p_t[fqn_of[id(p)]] for p in group_params]
            hyper = {hyper_key(slot.key): value for slot, value in zip(hyper_slots, hyper_values)}
            with _optimizer_on(optimizer, traced_params, state, hyper), compiling:
                optimizer.step()
            for name in grad_params:
                p_t[name].grad = None
        return [loss.detach(), *grads]

    flat = [params[n].detach() for n in params] + [buffers[n] for n in buffers]
    for p in group_params:
        flat += [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    flat += batch_leaves
    symbolic = SymbolicHyperparameters()
    flat = [symbolic.fake(t) if isinstance(t, torch.Tensor) else t for t in flat]
    for slot in hyper_slots:
        g, name = hyper_key(slot.key)
        flat.append(symbolic.symbol(slot.key, group_value(optimizer.param_groups[g], name)))
    report(progress, 1, 3, "tracing forward, backward and optimizer")
    try:
        gm = make_fx(step, tracing_mode="fake")(flat)
    except CaptureError:
        raise
    except Exception as exc:
        raise CaptureError(describe_trace_failure(exc)) from exc
    record = optimizer_record(optimizer, fqn_of, symbolic.conditions())
    check(cancel)
    report(progress, 2, 3, "labelling nodes")
    # Plain positional calling convention (``gm(*flat)``), the same as a graph rebuilt from a profile file.
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()
    label_graph(gm, recorder)
    report(progress, 3, 3, "captured")
    return CapturedStep(gm=gm, inputs=slots, grad_params=grad_params, optimizer=record)


@contextlib.contextmanager
def _loss_boundary(model: torch.nn.Module, recorder: _PhaseRecorder) -> Iterator[None]:
    """Mark the start of the "loss" region when the root module's forward returns."""
    handle = model.register_forward_hook(lambda *_: recorder.phase("loss"))
    try:
        yield
    finally:
        handle.remove()


def describe_trace_failure(exc: Exception) -> str:
    """Name the failing op and the user's source line, e.g. for data-dependent control flow."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "/torch/" not in f.filename and "/acstudio/" not in f.filename
            and "/site-packages/" not in f.filename]
    model_frames = [f for f in frames if "/torch/" not in f.filename and "/acstudio/" not in f.filename]
    where = (user or model_frames or frames[-1:])[-1] if frames else None
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    kind = "data-dependent control flow or value" if "data-dependent" in str(exc).lower() or \
        "DataDependent" in type(exc).__name__ else type(exc).__name__
    loc = f" at {where.filename}:{where.lineno} ({where.line})" if where else ""
    return f"cannot capture the training step as one graph: {kind}{loc}: {text}"


def label_graph(gm: fx.GraphModule, recorder: _PhaseRecorder) -> None:
    """Stamp every node with its stable id, region and module path (forward nodes from hooks, others inherited)."""
    phases = recorder.phases  # chronological; a later phase that starts at the same index wins
    events = sorted(recorder.module_events, key=lambda e: e[0])
    for idx, node in enumerate(gm.graph.nodes):
        node.meta["ac_id"] = f"n{idx:05d}"
        node.meta["ac_shape"], node.meta["ac_dtype"] = tensor_summary(node.meta.get("val"))
        if node.op == "placeholder":
            region = "input"
        elif node.op == "output":
            region = "output"
        else:
            region = "forward"
            for start, name in phases:
                if idx >= start:
                    region = name
        node.meta["ac_region"] = region
    # Module path of forward nodes: the innermost module active when the node was recorded.
    current, e = "", 0
    for idx, node in enumerate(gm.graph.nodes):
        while e < len(events) and events[e][0] <= idx:
            current = events[e][1]
            e += 1
        region = node.meta["ac_region"]
        if region in ("forward", "loss"):
            node.meta["ac_module"] = current if region == "forward" else "(loss)"
        elif region == "backward":
            # Backward ops inherit the module of the forward values they read, else of their backward inputs.
            mods = [a.meta.get("ac_module", "") for a in node.all_input_nodes
                    if a.meta.get("ac_region") in ("forward", "loss")]
            mods = mods or [a.meta.get("ac_module", "") for a in node.all_input_nodes]
            node.meta["ac_module"] = next((m for m in mods if m), "")
        elif region == "optimizer":
            node.meta["ac_module"] = "(optimizer)"
        else:
            node.meta["ac_module"] = ""
