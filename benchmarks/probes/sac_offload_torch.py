"""What ``CheckpointPolicy.MUST_CPU_OFFLOAD`` does in the installed torch, eager and compiled.

A SAC policy export could mark the activations a plan offloads ``MUST_CPU_OFFLOAD`` and leave the copies to
torch, if torch carried them out; this checks whether it does. First the source facts: how SAC's caching
dispatch mode treats each policy, whether ``checkpoint()`` can respect saved-tensors hooks, the functorch
activation-offloading flags and which files handle ``CPU_OFFLOAD``. Then GPT-2 small's shape (4 layers to keep
compile time short), bs8 seq 1024 fp32, every block under a SAC checkpoint whose policy puts the linear layers'
outputs (``aten.addmm``) at X and everything else at ``PREFER_RECOMPUTE``, X in {MUST_SAVE, MUST_CPU_OFFLOAD,
PREFER_CPU_OFFLOAD, MUST_RECOMPUTE}, eager and under torch.compile; compiled variants also try torch's
partitioner offload (functorch ``enable_activation_offloading`` with a ``joint_custom_pass`` that turns the
offload tags into ``MUST_SAVE`` + ``should_offload``), on a side stream and synchronously, whole-model and per
block. Per variant: peak memory over the base (GiB), median step time (ms) of 5, and where torch has its async
offload ops, the host bytes they allocate per step.

Run: cd <repo> && PYTHONPATH=. python3 benchmarks/probes/sac_offload_torch.py \\
         > results/probes/sac_offload_torch.txt 2>&1
Needs one CUDA GPU (under 5 minutes; compiled variants past 230 s are skipped).
"""

import functools
import importlib
import inspect
import pathlib
import statistics
import time

import torch
import torch._functorch.config as fconf
import torch._functorch.partitioners as partitioners
import torch._inductor.config as iconf
import torch.utils.checkpoint as ckpt
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers import GPT2Config, GPT2Model

T0 = time.time()
DEVICE = "cuda"
CONFIG = GPT2Config(n_layer=4, use_cache=False, attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0)
BS, SEQ = 8, 1024
TARGET = {torch.ops.aten.addmm.default}
OFFLOAD_FLAGS = ("enable_activation_offloading", "activation_offload_separate_stream", "activation_offload_sink_wait",
                 "activation_reload_prefetch", "activation_offload_cpu_gpu_bw", "joint_custom_pass")
host_bytes = [0]  # host bytes torch's async offload ops allocated since the last reset (where they exist)


def source_facts():
    """Print what the installed torch's source says about CPU offload; return its activation-offloading module
    (None where it has none)."""
    src = inspect.getsource(ckpt._CachingTorchDispatchMode.__torch_dispatch__)
    for line in src.splitlines():
        if "MUST_SAVE" in line or "CPU_OFFLOAD" in line or "_RECOMPUTE" in line:
            print("checkpoint.py SAC caching:", line.strip())
    print("CheckpointPolicy members:", [p.name for p in CheckpointPolicy])
    print("checkpoint() has respect_saved_tensors_hooks:",
          "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters)
    for flag in OFFLOAD_FLAGS:
        print(f"functorch.config.{flag}:", getattr(fconf, flag, "<absent>"))
    psrc = inspect.getsource(partitioners)
    print("partitioners mentions CPU_OFFLOAD:", psrc.count("CPU_OFFLOAD"), "should_offload:",
          psrc.count("should_offload"), "enable_activation_offloading:", psrc.count("enable_activation_offloading"))
    try:
        ao = importlib.import_module("torch._functorch._activation_offloading.activation_offloading")
        asrc = inspect.getsource(ao)
        print("_activation_offloading present; funcs:",
              [n for n in dir(ao) if n.startswith(("offload", "reload", "enable", "activation", "choose"))])
        print("  async ops (ao.offload):", "torch.ops.ao.offload" in asrc, "should_offload read:",
              asrc.count("should_offload"))
    except Exception as e:
        ao = None
        print("_activation_offloading absent:", type(e).__name__, e)
    print("MUST_CPU_OFFLOAD handled anywhere in torch/_functorch or torch/_inductor:")
    root = pathlib.Path(torch.__file__).parent
    for sub in ("_functorch", "_inductor", "utils", "distributed/algorithms/_checkpoint"):
        for f in (root / sub).rglob("*.py"):
            t = f.read_text(errors="ignore")
            if "CPU_OFFLOAD" in t and f.name != "checkpoint.py":
                print("  ", f.relative_to(root), t.count("CPU_OFFLOAD"))
    return ao


def count_async_offload_bytes():
    """Count the host bytes torch's async offload ops allocate, where the installed torch has them."""
    try:
        ops_mod = importlib.import_module("torch._functorch._activation_offloading.offload_ops")
        original = ops_mod._maybe_pool_alloc

        def counting_alloc(numel, dtype):
            host_bytes[0] += numel * torch.empty((), dtype=dtype).element_size()
            return original(numel, dtype)
        ops_mod._maybe_pool_alloc = counting_alloc
    except Exception as e:
        print("cannot count async offload bytes:", e)


def policy_for(choice):
    def policy(ctx, func, *a, **k):
        return choice if func in TARGET else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def build(choice):
    torch.manual_seed(0)
    m = GPT2Model(CONFIG).to(DEVICE).train()
    if choice is None:
        return m
    for blk in m.h:
        inner = blk.forward
        cf = functools.partial(create_selective_checkpoint_contexts, policy_for(choice))

        def fwd(*a, _inner=inner, _cf=cf, **k):
            return checkpoint(_inner, *a, use_reentrant=False, context_fn=_cf, **k)
        blk.forward = fwd
    return m


def measure(name, m, ids, steps=5):
    def step():
        out = m(ids).last_hidden_state
        out.float().pow(2).mean().backward()
        for p in m.parameters():
            p.grad = None
    t = time.time()
    try:
        step()
        step()
    except Exception as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        print(f"{name:42s} FAILED: {type(e).__name__}: {' | '.join(lines[:1] + lines[-2:])[:400]}")
        return
    warm = time.time() - t
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    host_bytes[0] = 0
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"{name:42s} peak-over-base {peak:6.3f} GiB  step {statistics.median(times):7.1f} ms"
          f"  (iqr-ish {min(times):.1f}-{max(times):.1f}; warmup {warm:.0f}s; async host MB/step "
          f"{host_bytes[0] / steps / 2**20:.0f})")


def mark_offload(gm, joint_inputs):
    """A joint graph pass: nodes SAC tagged for CPU offload become saved and marked for the partitioner's offload."""
    n = 0
    for node in gm.graph.nodes:
        if node.meta.get("recompute") in (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            node.meta["should_offload"] = True
            n += 1
    print(f"   joint_custom_pass marked {n} nodes should_offload")
    return gm


def compiled(name, choice, flags, ids, regional=False):
    if time.time() - T0 > 230:
        print(f"compiled {name}: skipped (time)")
        return
    torch._dynamo.reset()
    old = {k: getattr(fconf, k) for k in flags if hasattr(fconf, k)}
    missing = [k for k in flags if not hasattr(fconf, k)]
    if missing:
        print(f"compiled {name}: config flags absent {missing}")
        return
    try:
        for k, v in flags.items():
            setattr(fconf, k, v)
        m = build(choice)
        if regional:  # each block compiled alone (torchtitan's regional compilation), the rest eager
            for blk in m.h:
                blk.forward = torch.compile(blk.forward)
        else:
            m = torch.compile(m)
        measure(f"compiled {name}", m, ids)
    finally:
        for k, v in old.items():
            setattr(fconf, k, v)
        torch.cuda.empty_cache()


def main():
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
    iconf.fx_graph_cache = False  # every variant compiles afresh (the joint pass is not in the cache key)
    fconf.enable_autograd_cache = False
    if source_facts() is not None:
        count_async_offload_bytes()
    ids = torch.randint(0, CONFIG.vocab_size, (BS, SEQ), device=DEVICE)

    print("== eager (addmm outputs at X, rest PREFER_RECOMPUTE) ==")
    for name, choice in (("none", None), ("save", CheckpointPolicy.MUST_SAVE),
                         ("offload", CheckpointPolicy.MUST_CPU_OFFLOAD),
                         ("prefer_offload", CheckpointPolicy.PREFER_CPU_OFFLOAD),
                         ("recompute", CheckpointPolicy.MUST_RECOMPUTE)):
        measure(f"eager {name}", build(choice), ids)
        torch.cuda.empty_cache()

    print("== torch.compile (inductor); most telling first, later ones skipped past 230 s ==")
    torch._dynamo.config.cache_size_limit = 64
    stream = {"enable_activation_offloading": True, "joint_custom_pass": mark_offload,
              "activation_offload_separate_stream": True, "activation_reload_prefetch": True}
    offload = CheckpointPolicy.MUST_CPU_OFFLOAD
    compiled("save", CheckpointPolicy.MUST_SAVE, {}, ids)
    compiled("offload tag only", offload, {}, ids)
    compiled("offload pass, stream+sink+prefetch", offload, {**stream, "activation_offload_sink_wait": True}, ids)
    compiled("regional save", CheckpointPolicy.MUST_SAVE, {}, ids, regional=True)
    compiled("regional offload stream+sink+prefetch", offload, {**stream, "activation_offload_sink_wait": True}, ids,
             regional=True)
    compiled("offload pass, stream+prefetch", offload, stream, ids)
    compiled("offload pass, sync device_put", offload,
             {"enable_activation_offloading": True, "joint_custom_pass": mark_offload}, ids)
    compiled("recompute", CheckpointPolicy.MUST_RECOMPUTE, {}, ids)
    compiled("none", None, {}, ids)
    print(f"total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
