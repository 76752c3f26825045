"""What ``torch.compile`` keeps for backward: the saved set AOTAutograd's partitioner produces for a model.

Under a SAC policy the partitioner honours the ``MUST_*`` tags inside the blocks, but it decides for every
other op itself (and fuses, and functionalizes in-place and random ops), so the compiled step keeps a different
set of tensors than eager SAC does. :func:`compiled_saved_bytes` compiles the model once with the partitioner
Inductor uses (min-cut rematerialization) and a recording ``partition_fn``, without generating code, and returns
the bytes each compiled graph saves for backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def saved_storage_bytes(values) -> int:
    """Bytes of the distinct storages among ``values`` (fake or real tensors; anything else is skipped)."""
    seen = {}
    for v in values:
        if isinstance(v, torch.Tensor):
            s = v.untyped_storage()
            seen[StorageWeakRef(s)] = s.nbytes()
    return sum(seen.values())


def compiled_saved_bytes(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                         batch) -> list[int]:
    """Run one forward and backward of ``torch.compile(model)`` (no code generation, static shapes so that the
    sizes are the batch's, not symbols) and return, per compiled graph, the bytes of the tensors its forward
    saves for backward, as Inductor's partitioner chooses them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    saved: list[int] = []

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        outputs = fw.graph.find_nodes(op="output")[0].args[0][kwargs["num_fwd_outputs"]:]
        saved.append(saved_storage_bytes(n.meta.get("val") for n in outputs if isinstance(n, torch.fx.Node)))
        return fw, bw

    def nop(gm, _inputs):
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition)
    torch._dynamo.reset()
    try:
        loss_fn(torch.compile(model, backend=backend, dynamic=False), batch).backward()
    finally:
        torch._dynamo.reset()
    return saved
