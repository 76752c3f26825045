"""The captured graph as JSON and back, ids included: the profile file carries the exact graph it measured.

Loading rebuilds the same nodes in the same order with the same ``ac_id``/region/module metadata; it does not
trace anything. Device arguments can be remapped (a GPU profile verified on the CPU).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from acstudio.capture.step import CapturedStep, InputSlot, OptimizerRecord
from acstudio.errors import ProfileFileError
from acstudio.profile.ops import resolve_target, target_name


def _encode(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return {"$n": value.meta["ac_id"]}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$f": repr(value)}
    if isinstance(value, tuple):
        return {"$t": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.layout):
        return {"$layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"$mf": str(value).removeprefix("torch.")}
    raise ProfileFileError(f"cannot serialize graph argument {value!r} ({type(value).__name__})")


def _decode(value: Any, env: dict[str, fx.Node], device: str | None) -> Any:
    if isinstance(value, list):
        return [_decode(v, env, device) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, v), = value.items()
    if tag == "$n":
        return env[v]
    if tag == "$t":
        return tuple(_decode(x, env, device) for x in v)
    if tag == "$f":
        return float(v)
    if tag == "$dtype":
        return getattr(torch, v)
    if tag == "$device":
        return torch.device(device if device is not None and v != "cpu" else v)
    if tag == "$layout":
        return getattr(torch, v)
    if tag == "$mf":
        return getattr(torch, v)
    raise ProfileFileError(f"unknown graph argument tag {tag}")


def tensor_summary(val: Any) -> tuple[str, str]:
    """(shape, dtype) strings of a node's output, for tables and fingerprints."""
    if isinstance(val, torch.Tensor):
        return "x".join(map(str, val.shape)) or "scalar", str(val.dtype).removeprefix("torch.")
    if isinstance(val, (tuple, list)):
        parts = [tensor_summary(v) for v in val if isinstance(v, torch.Tensor)]
        return ",".join(p[0] for p in parts), ",".join(p[1] for p in parts)
    return "", ""


MAX_CONSTANT_ELEMENTS = 65536


def _encode_constant(gm: fx.GraphModule, target: str) -> dict[str, Any]:
    """Constants that tracing lifted into attributes (small tensors made inside model code)."""
    value = gm
    for name in target.split("."):
        value = getattr(value, name)
    if not isinstance(value, torch.Tensor) or value.numel() > MAX_CONSTANT_ELEMENTS:
        raise ProfileFileError(f"cannot serialize graph constant {target} ({type(value).__name__})")
    return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
            "device": value.device.type, "data": value.detach().cpu().flatten().tolist()}


def _decode_constant(rec: dict[str, Any], device: str | None) -> torch.Tensor:
    dev = rec["device"] if device is None or rec["device"] == "cpu" else device
    t = torch.tensor(rec["data"], dtype=getattr(torch, rec["dtype"]))
    return t.reshape(rec["shape"]).to(dev)


def serialize_step(step: CapturedStep) -> dict[str, Any]:
    nodes = []
    constants = {}
    for node in step.gm.graph.nodes:
        if node.op == "get_attr":
            constants[node.target] = _encode_constant(step.gm, node.target)
        nodes.append({
            "id": node.meta["ac_id"],
            "name": node.name,
            "op": node.op,
            "target": target_name(node.target),
            "args": _encode(node.args),
            "kwargs": {k: _encode(v) for k, v in node.kwargs.items()},
            "region": node.meta["ac_region"],
            "module": node.meta.get("ac_module", ""),
            "shape": node.meta["ac_shape"],
            "dtype": node.meta["ac_dtype"],
        })
    out = {
        "nodes": nodes,
        "inputs": [[s.kind, s.key] for s in step.inputs],
        "grad_params": list(step.grad_params),
        "constants": constants,
    }
    if step.optimizer is not None:
        out["optimizer"] = step.optimizer.to_dict()
    return out


def deserialize_step(graph: dict[str, Any], device: str | None = None) -> CapturedStep:
    """Rebuild the captured step (same nodes, same ids) from :func:`serialize_step` output."""
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    root = torch.nn.Module()
    try:
        for name, rec in graph.get("constants", {}).items():
            root.register_buffer(name, _decode_constant(rec, device))
        for rec in graph["nodes"]:
            args = _decode(rec["args"], env, device)
            kwargs = {k: _decode(v, env, device) for k, v in rec["kwargs"].items()}
            if rec["op"] == "placeholder":
                node = g.placeholder(rec["name"])
            elif rec["op"] == "output":
                node = g.output(args[0])
            elif rec["op"] == "get_attr":
                node = g.get_attr(rec["target"])
            else:
                node = g.create_node(rec["op"], resolve_target(rec["target"]), args, kwargs, name=rec["name"])
            node.meta.update(ac_id=rec["id"], ac_region=rec["region"], ac_module=rec["module"],
                             ac_shape=rec["shape"], ac_dtype=rec["dtype"])
            env[rec["id"]] = node
        gm = fx.GraphModule(root, g)
        # Profiles from before hyperparameters were graph inputs have none: their values are graph constants.
        optimizer = OptimizerRecord.from_dict(graph["optimizer"]) if "optimizer" in graph else None
    except (KeyError, IndexError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
        # Profiles are validated on load, but files older than the stored fingerprint can carry edited arguments.
        raise ProfileFileError(f"corrupt graph in profile ({type(exc).__name__}: {exc})") from exc
    return CapturedStep(gm=gm, inputs=[InputSlot(k, key) for k, key in graph["inputs"]],
                        grad_params=list(graph["grad_params"]), optimizer=optimizer)
