"""Can a compiled step offload? Each transformer block compiled alone (regional compilation, as torchtitan does),
its selective-checkpoint policy inside the compiled region, and saved-tensors hooks around the compiled call: the
compiled region is an autograd Function whose ``save_for_backward`` runs plain (not inlineable) hooks at runtime, at
the end of that block's forward, so a block's saved tensors can cross the host link while later blocks compute, and
come back one block ahead in backward. Measured against whole-model ``compile`` with torchtitan's policy (the
grid's ``compile+per-op``): peak and step time of each form, with the first K blocks offloaded.

Usage: PYTHONPATH=. python3 benchmarks/probes/compiled_block_offload.py [OUT_DIR] [gpt2|decoder] [SECONDS]
Output: OUT_DIR/compiled_block_offload.txt (one line per configuration, written as it is measured; configurations
past SECONDS are skipped); results/probes/compiled_block_offload_h100.txt (GPT-2 seq 512 bs32, H100, torch 2.11).
Its first version fetched an offloaded block's tensors only when that block's backward unpacked them: the first
offloaded block (in backward order) then stalled ~10 ms on its copy back, whatever the number offloaded; the hooks
of the blocks that offload nothing now prefetch the block before them.
"""

import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo.config as dynamo_config
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from acstudio.bench.measure import time_steps
from acstudio.bench.steps import PER_OP_ATTENTION, PER_OP_MATMULS, enable_per_block, find_blocks, load, per_op_context
from acstudio.hostcopy import storage_bytes
from acstudio.workload import WorkloadSpec

MiB = 2**20
DECODER = (("hidden_size", "2048"), ("intermediate_size", "5632"), ("num_hidden_layers", "16"),
           ("num_attention_heads", "16"), ("num_key_value_heads", "16"), ("vocab_size", "32000"),
           ("max_position_embeddings", "2048"))
SPECS = {"gpt2": WorkloadSpec("gpt2", 32, optimizer="adam", seq_len=512),
         "decoder": WorkloadSpec("llama", 8, optimizer="adamw", precision="bf16", seq_len=1024, config=DECODER)}
dev = torch.device("cuda")


def allow_a_graph_per_block() -> None:
    """Room in Dynamo's caches for one compiled graph per block call site (and per block, where they guard)."""
    dynamo_config.cache_size_limit = 256
    dynamo_config.accumulated_cache_size_limit = 1024


def save_matmuls_policy():
    """Every matmul and attention output saved, the rest recomputed: torchtitan's set without its every-second-
    matmul replay."""

    def policy(ctx, func, *args, **kwargs):
        if func in PER_OP_MATMULS or func in PER_OP_ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class BlockOffload:
    """Saved-tensors hooks per block call: pack copies a saved CUDA tensor (not a parameter, 1 MiB or more) to
    pinned host memory on a copy-out stream, the allocator keeping the device block until that copy has read it;
    unpack (the block's backward) fetches its own tensors and those of the block before it on a copy-in stream."""

    def __init__(self) -> None:
        self.out_stream = torch.cuda.Stream(dev)
        self.in_stream = torch.cuda.Stream(dev)
        self.calls: list[list[dict]] = []
        self.moved = 0
        self.pool: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}  # pinned buffers by size

    def hooks(self, offload: bool = True, keep: frozenset[int] = frozenset()):
        """The hooks of one block call; without ``offload`` they keep what it saves and only prefetch, when its
        backward starts, what the call before it offloaded. Storages whose data pointer is in ``keep`` stay."""
        call: list[dict] = []
        self.calls.append(call)
        seen: dict[int, dict] = {}

        def pack(t):
            if (not offload or t.device.type != "cuda" or isinstance(t, torch.nn.Parameter)
                    or t.untyped_storage().nbytes() < MiB or t.untyped_storage().data_ptr() in keep):
                return "kept", t, call
            storage = t.untyped_storage()
            handle = seen.get(storage.data_ptr())
            if handle is None:
                data = storage_bytes(t)
                free = self.pool.get(data.numel())
                host, read = free.pop() if free else (torch.empty_like(data, device="cpu", pin_memory=True), None)
                self.out_stream.wait_stream(torch.cuda.current_stream(dev))
                if read is not None:  # its last copy back has read it
                    self.out_stream.wait_event(read)
                with torch.cuda.stream(self.out_stream):
                    host.copy_(data, non_blocking=True)
                data.record_stream(self.out_stream)
                self.moved += storage.nbytes()
                handle = {"host": host, "dev": None, "event": None, "call": call, "refs": 0}
                call.append(handle)
                seen[storage.data_ptr()] = handle
            handle["refs"] += 1
            return handle, t.dtype, t.size(), t.stride(), t.storage_offset()

        def unpack(packed):
            if packed[0] == "kept":
                self.prefetch_before(packed[2])
                return packed[1]
            h, dtype, size, stride, offset = packed
            for other in h["call"]:
                self.fetch(other)
            self.prefetch_before(h["call"])
            torch.cuda.current_stream(dev).wait_event(h["event"])
            buf = h["dev"]
            h["refs"] -= 1
            if h["refs"] == 0:  # the last saved slot of this storage: the device buffer goes with the tensors
                h["dev"] = None
                self.pool.setdefault(h["host"].numel(), []).append((h["host"], h["event"]))
            return torch.empty(0, dtype=dtype, device=dev).set_(buf.untyped_storage(), offset, size, stride)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def prefetch_before(self, call) -> None:
        at = next((i for i, c in enumerate(self.calls) if c is call), -1)
        if at > 0:
            for other in self.calls[at - 1]:
                self.fetch(other)

    def fetch(self, h) -> None:
        if h["dev"] is not None or h["refs"] == 0:
            return
        buf = torch.empty_like(h["host"], device=dev)
        self.in_stream.wait_stream(torch.cuda.current_stream(dev))
        self.in_stream.wait_stream(self.out_stream)
        with torch.cuda.stream(self.in_stream):
            buf.copy_(h["host"], non_blocking=True)
            h["event"] = torch.cuda.Event()
            h["event"].record(self.in_stream)
        h["dev"] = buf

    def new_step(self) -> None:
        self.calls.clear()
        self.moved = 0


class Region(torch.nn.Module):
    """One block under a non-reentrant checkpoint with ``context_fn`` (none: the block as is)."""

    def __init__(self, block, context_fn) -> None:
        super().__init__()
        self.block = block
        self.context_fn = context_fn

    def forward(self, *args, **kwargs):
        if self.context_fn is None:
            return self.block(*args, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)


class Offloaded(torch.nn.Module):
    """The compiled region, called eager inside the offload's hooks (a graph break when the model around it is
    compiled too)."""

    def __init__(self, region, offload: BlockOffload | None, offloads: bool, keep_shared: bool = False) -> None:
        super().__init__()
        self.region = region
        self.offload = offload
        self.offloads = offloads
        # keep the parameters' storages (views of them are saved as plain tensors) and those of every tensor
        # argument but the first positional one, the hidden state (a mask, rotary tables: other blocks read them)
        self.keep_shared = keep_shared

    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        if self.offload is None:
            return self.region(*args, **kwargs)
        keep = frozenset()
        if self.keep_shared:
            shared = list(self.region.parameters()) + [
                t for t in [*args[1:], *kwargs.values()] if isinstance(t, torch.Tensor)]
            keep = frozenset(t.untyped_storage().data_ptr() for t in shared)
        with self.offload.hooks(self.offloads, keep):
            return self.region(*args, **kwargs)


def build(spec: WorkloadSpec, form: str, context_fn, offload_blocks: int):
    """``form`` whole: torch.compile of the model (torchtitan's policy via HF's own checkpointing when
    ``context_fn``); regions: every block a compiled region, the first ``offload_blocks`` under the hooks, inside
    the compiled model (its embeddings, head and loss compiled between the blocks)."""
    w, opt = load(spec, dev)
    offload = None
    if form == "whole":
        if context_fn is not None:
            enable_per_block(w, context_fn)
        model = torch.compile(w.model)
    else:
        blocks = find_blocks(w)
        offload = BlockOffload() if offload_blocks else None
        parents = {id(b): (p, n) for p in w.model.modules() for n, b in p.named_children()}
        for i, b in enumerate(blocks):
            parent, name = parents[id(b)]
            region = torch.compile(Region(b, context_fn))
            setattr(parent, name, Offloaded(region, offload, i < offload_blocks))
        model = torch.compile(w.model)
    return training_step(spec, w, opt, model, offload), offload


def training_step(spec: WorkloadSpec, w, opt, model, offload: BlockOffload | None):
    """One training step of ``model`` (``w.model`` as compiled) with ``w``'s loss and ``opt``."""

    def step():
        if offload is not None:
            offload.new_step()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=spec.precision == "bf16"):
            loss = w.loss_fn(model, w.batch)
        loss.backward()
        opt.step()
        return loss

    return step


def measure(out_file: Path, name: str, make) -> dict | None:
    """Build a step with ``make()`` (the step and its :class:`BlockOffload` or None), run three steps, one for the
    peak and ten timed; append one line to ``out_file`` and return peak and median (None where it failed)."""
    t0 = time.perf_counter()
    result = None
    try:
        step, offload = make()
        losses = [float(step()) for _ in range(3)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(dev)
        times = time_steps(step, 10, dev)
        q = statistics.quantiles(times, n=4)
        moved = offload.moved / 2**30 if offload else 0.0
        line = (f"{name:34s} peak {peak / MiB:9.0f} MiB (base {base / MiB:7.0f})"
                f"  step {statistics.median(times):7.1f} ms"
                f" (IQR {q[2] - q[0]:4.1f})  moved {moved:5.2f} GiB  losses {losses[0]:.5f} {losses[-1]:.5f}"
                f"  [{time.perf_counter() - t0:.0f} s]")
        result = {"peak": peak, "ms": statistics.median(times), "iqr": q[2] - q[0]}
    except Exception as exc:  # a probe: record the failure and go on
        line = f"{name:34s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    print(line, flush=True)
    with open(out_file, "a") as f:
        f.write(line + "\n")
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return result


if __name__ == "__main__":
    OUT = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    MODEL = sys.argv[2] if len(sys.argv) > 2 else "gpt2"
    SPEC = SPECS[MODEL]
    allow_a_graph_per_block()
    OUT.mkdir(parents=True, exist_ok=True)
    out_file = OUT / "compiled_block_offload.txt"
    with open(out_file, "a") as f:
        f.write(f"torch {torch.__version__} {torch.cuda.get_device_name(dev)} {MODEL} {SPEC}\n")
    deadline = time.perf_counter() + float(sys.argv[3] if len(sys.argv) > 3 else 520)
    configs = [("compile+per-op (whole)", "whole", per_op_context, 0),
               ("regions per-op", "regions", per_op_context, 0),
               ("regions save-matmuls", "regions", save_matmuls_policy, 0),
               ("regions save-matmuls, offload 2", "regions", save_matmuls_policy, 2),
               ("regions save-matmuls, offload 3", "regions", save_matmuls_policy, 3),
               ("regions save-matmuls, offload 4", "regions", save_matmuls_policy, 4),
               ("regions no AC, offload 5", "regions", None, 5),
               ("regions per-op, offload 2", "regions", per_op_context, 2)]
    for cfg in configs:
        if time.perf_counter() > deadline:
            print(f"{cfg[0]}: skipped (time)", flush=True)
            continue
        measure(out_file, cfg[0], functools.partial(build, SPEC, *cfg[1:]))
