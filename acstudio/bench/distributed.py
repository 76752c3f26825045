"""One rank of an ``acstudio bench --nproc N`` job: process group, FSDP2/DDP wrapping, the rank's batch slice.

The runner starts every ``fsdp+...``/``ddp+...`` configuration as ``torchrun --nproc-per-node N -m
acstudio.bench.worker CONFIG.json``. Every rank builds the same model (same seed) and the same global batch
(``N`` times the configured per-rank batch), keeps its own slice, and trains it; the gradients are averaged
across ranks by FSDP2's reduce-scatter or DDP's all-reduce, so the losses are those of one process training
the global batch. NCCL on CUDA (one GPU per rank), gloo on the CPU (tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from acstudio.bench.configs import PARALLELS
from acstudio.errors import ACStudioError
from acstudio.workload import Workload, WorkloadSpec


@dataclass
class Ranks:
    """This process's place in the job and the parallelism it runs (``"fsdp"`` or ``"ddp"``)."""

    kind: str
    world: int
    rank: int
    device: torch.device

    @classmethod
    def start(cls, kind: str, device_type: str) -> Ranks:
        """Join the job torchrun started (its environment names rank and world size)."""
        if kind not in PARALLELS:
            raise ACStudioError(f"unknown parallelism {kind!r}; choose from {', '.join(PARALLELS)}")
        if "RANK" not in os.environ:
            raise ACStudioError(f"{kind} configurations run under torchrun: use acstudio bench --nproc N")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo", device_id=device
                                    if device_type == "cuda" else None)
        return cls(kind, dist.get_world_size(), dist.get_rank(), device)

    def global_spec(self, spec: WorkloadSpec) -> WorkloadSpec:
        return spec.with_batch_size(spec.batch_size * self.world)

    def local_batch(self, batch: Any) -> Any:
        """This rank's rows of every tensor in the global batch."""
        if isinstance(batch, torch.Tensor):
            rows = batch.shape[0] // self.world
            return batch[self.rank * rows:(self.rank + 1) * rows].clone()
        if isinstance(batch, dict):
            return {k: self.local_batch(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.local_batch(v) for v in batch)
        return batch

    def wrap(self, workload: Workload, blocks: list[torch.nn.Module]) -> torch.nn.Module:
        """Move the model to this rank's device and spread it: ``fully_shard`` per block then the root, or DDP.

        Returns the module to call (DDP's wrapper; FSDP2 shards in place). ``workload.batch`` becomes this
        rank's slice, on the device.
        """
        workload.batch = self.local_batch(workload.batch)
        workload.to(self.device)
        if self.kind == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in blocks:
                fully_shard(block)
            fully_shard(workload.model)
            return workload.model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(workload.model, device_ids=ids)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def stop(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (FSDP2's shards: their local part),
    each storage counted once."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            storage = local.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"parameter": size(params), "gradient": size(p.grad for p in params if p.grad is not None),
            "optimizer_state": size(state)}
