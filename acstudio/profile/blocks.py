"""A model's blocks, read off the module paths the profile records (no model needed).

Checkpointing policies and the per-rank (FSDP2) model wrap or shard the repeated blocks. For one rank under
FSDP2/DDP the SAC export also wraps the modules around them (:func:`sac_blocks`): a decoder's final norm and LM head
hold activations at the loss, where a language model's peak usually is.
"""

from __future__ import annotations

import re
from collections import defaultdict

_INDEX = re.compile(r"^\d+$")


def repeated_blocks(modules: list[str]) -> dict[str, str]:
    """Module path -> outermost repeated block containing it (``layer1.0``, ``bert.encoder.layer.3``).

    A block is ``<prefix>.<n>`` where ``<prefix>`` has at least two numbered children (an ``nn.Sequential``
    or ``nn.ModuleList`` of blocks).
    """
    children: dict[str, set[str]] = defaultdict(set)
    for m in modules:
        parts = m.split(".")
        for i, p in enumerate(parts):
            if _INDEX.match(p):
                children[".".join(parts[:i])].add(p)
    out = {}
    for m in modules:
        parts = m.split(".")
        for i, p in enumerate(parts):
            if _INDEX.match(p) and len(children[".".join(parts[:i])]) >= 2:
                out[m] = ".".join(parts[:i + 1])
                break
    return out


def sac_blocks(op_modules: list[str], around: bool) -> dict[str, str]:
    """Module path -> the block SAC wraps it in, given the module of each forward op in order: its repeated block;
    with ``around``, else its outermost module that contains no repeated block (``model.norm``, ``lm_head``,
    ``cls``: BERT's whole MLM head), never the root nor a pseudo module of the capture (``(loss)``), and never a
    module whose ops do not run as one stretch of forward (called twice): that is not one checkpoint."""
    modules = sorted(set(op_modules))
    out = repeated_blocks(modules)
    if not around:
        return out
    ancestors = {".".join(b.split(".")[:i]) for b in set(out.values()) for i in range(len(b.split(".")))}
    outer = {}
    for m in modules:
        if m in out or not m or m.startswith("("):
            continue
        parts = m.split(".")
        block = next((p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p not in ancestors), "")
        if block:  # else the module holds repeated blocks (``model``): its own ops stay unwrapped
            outer[m] = block
    runs = [outer.get(m, "") for m in op_modules]
    for block in set(outer.values()):
        at = [j for j, b in enumerate(runs) if b == block]
        if at[-1] - at[0] + 1 == len(at):
            out.update({m: b for m, b in outer.items() if b == block})
    return out
