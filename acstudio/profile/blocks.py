"""A model's repeated blocks, read off the module paths the profile records (no model needed).

Checkpointing policies, the SAC export and the per-rank (FSDP2) model all wrap or shard these blocks.
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
