"""The CUDA copy path of the SAC export's offload (``acstudio.export.apply.SacOffload``), driven through plain
saved-tensors hooks.

A torch whose selective checkpointing cannot route its cache through saved-tensors hooks (torch 2.11) cannot run
the SAC offload path itself; its copies (two side streams, events, ``record_stream``, a pool of pinned buffers
reused across steps) can still be checked on a GPU by packing and unpacking every saved activation with the same
runtime calls. GPT-2 (4 layers, bs8 seq 1024 fp32, eager attention, no dropout, deterministic algorithms), three
steps each of: eager; ``SacOffload`` offloading every saved activation of 1 MiB or more (not parameters); and
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` for reference. Per variant: peak over the base memory,
median step time, MiB copied per step, the pinned buffers made in each step (the pool should stop growing after
the first) and whether loss and gradients are bitwise equal to eager's.

Run: cd <repo> && PYTHONPATH=. python3 benchmarks/probes/sac_offload_hooks.py > results/probes/sac_offload_hooks.txt
Needs one CUDA GPU (about a minute).
"""

import contextlib
import os
import statistics
import time
import weakref

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, so that bitwise means something
import torch
from transformers import GPT2Config, GPT2Model

from acstudio.export.apply import SacOffload

BS, SEQ = 8, 1024


def make_step(model, ids):
    def step(hooks):
        with hooks():
            out = model(ids).last_hidden_state
            loss = out.float().pow(2).mean()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        return loss.detach(), grads
    return step


def ours_factory(params):
    """Saved-tensors hooks that offload through a ``SacOffload``, what to call after backward, the sizes of the
    pinned buffers it made and the bytes it copied."""
    runtime = SacOffload(0)
    made = []
    buffer = runtime._buffer

    def counting_buffer(nbytes, device):
        if not runtime.pool.get(nbytes):
            made.append(nbytes)
        return buffer(nbytes, device)

    runtime._buffer = counting_buffer
    state = {"call": None, "copied": 0}

    def pack(t):
        call = state["call"]
        storage = t.untyped_storage()
        if storage.nbytes() >= 2**20 and storage.data_ptr() not in params and t.device.type == "cuda":
            if storage.data_ptr() not in call.wanted or call.wanted[storage.data_ptr()]() is not storage:
                call.wanted[storage.data_ptr()] = weakref.ref(storage)
                state["copied"] += storage.nbytes()
        return call.pack(t)

    @contextlib.contextmanager
    def hooks():
        state["call"] = runtime.call()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def unpack(packed):
        out = state["call"].unpack(packed)
        if not isinstance(packed, torch.Tensor):
            packed[0].fetched = None  # as a SAC replay's end does: the device copy lives as long as autograd uses it
        return out

    def after_backward():  # what the replay's end does for a SAC call: buffers back to the pool
        with runtime.replaying(state["call"], contextlib.nullcontext()):
            pass

    return hooks, after_backward, made, state


def measure(step, ref, name, hooks, after=lambda: None, made=None, state=None, steps=3):
    ref_loss, ref_grads = ref
    times, peaks, made_per_step, copied = [], [], [], []
    equal = True
    for _ in range(steps):
        n_made = len(made) if made is not None else 0
        if state is not None:
            state["copied"] = 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        loss, grads = step(hooks)
        after()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**30)
        made_per_step.append(len(made) - n_made if made is not None else None)
        copied.append(state["copied"] / 2**20 if state is not None else None)
        equal &= torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    print(f"{name:28s} peak {peaks[-1]:6.3f} GiB  step {statistics.median(times[1:]):7.1f} ms (first {times[0]:.0f})"
          f"  copied MiB/step {copied[-1]}  pinned buffers made per step {made_per_step}  bitwise {equal}")


def main():
    print("torch", torch.__version__, torch.cuda.get_device_name(0))
    torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = GPT2Config(n_layer=4, use_cache=False, attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2Model(cfg).to("cuda").train()
    ids = torch.randint(0, cfg.vocab_size, (BS, SEQ), device="cuda")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    step = make_step(model, ids)

    nothing = contextlib.nullcontext
    step(nothing)
    ref = step(nothing)
    measure(step, ref, "eager", nothing)
    hooks, after, made, state = ours_factory(params)
    measure(step, ref, "SacOffload hooks (>=1MiB)", hooks, after, made, state)
    measure(step, ref, "save_on_cpu(pin_memory)", lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))


if __name__ == "__main__":
    main()
