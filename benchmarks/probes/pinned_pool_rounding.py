"""How much host memory a pinned pool just over 1 GiB costs, and what an exact-size alternative costs.

The offload runtime keeps its host copies in one pool made with ``torch.empty(n, pin_memory=True)``. That goes
through torch's caching host allocator, which rounds each allocation up to a power of two and keeps it locked,
so a pool just over a power of two can lock twice its size; the host-memory check before an offloading step has
to count what is locked, not what is asked for. This allocates a pool of the size that
``offload_health_50_steps.py``'s plan offloads, both ways, and prints for each the allocation time,
``is_pinned``, process RSS, torch's host allocator stats, how long a non_blocking ``copy_`` call takes to return,
and D2H/H2D GB/s (best of 3, CUDA events); for the torch pool also its stats after ``del`` and after emptying the
allocator's cache. The alternative is a pageable buffer registered with ``cudaHostRegister`` (page-locked at its
exact size).

Run: cd <repo> && PYTHONPATH=. python3 benchmarks/probes/pinned_pool_rounding.py \\
         > results/probes/pinned_pool_rounding.txt
Needs one CUDA GPU and about 3 GiB of free host memory (seconds).
"""

import os
import time

import torch

GiB = 2**30
PAGE = os.sysconf("SC_PAGE_SIZE")
N = int(1.001 * GiB)


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def stats():
    s = torch.cuda.host_memory_stats()
    return {k: s[k] for k in ("allocated_bytes.current", "reserved_bytes.current", "active_bytes.current")
            if k in s} or {k: v for k, v in s.items() if "bytes" in k and "current" in k}


def rates(host, name):
    dev = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    for to_host in (True, False):
        best, call = 1e9, 1e9
        for _ in range(3):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                start.record(s)
                t = time.perf_counter()
                (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))
                call = min(call, time.perf_counter() - t)
                end.record(s)
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        print(f"  {name} {'d2h' if to_host else 'h2d'}: {host.numel() / best / 1e9:.1f} GB/s, copy_ call returned "
              f"after {call * 1e3:.3f} ms", flush=True)
    del dev


def main():
    print(f"torch {torch.__version__}; buffer {N} B ({N / GiB:.3f} GiB); start rss {rss() / GiB:.2f} GiB, host stats "
          f"{stats()}", flush=True)
    t = time.perf_counter()
    pinned = torch.empty(N, dtype=torch.uint8, pin_memory=True)
    print(f"pin_memory=True: {time.perf_counter() - t:.3f}s, is_pinned {pinned.is_pinned()}, "
          f"rss {rss() / GiB:.2f} GiB, host stats {stats()}", flush=True)
    rates(pinned, "pin_memory=True")
    del pinned
    print(f"after del: host stats {stats()}", flush=True)
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
        print(f"after torch._C._host_emptyCache(): host stats {stats()}, rss {rss() / GiB:.2f} GiB", flush=True)

    cudart = torch.cuda.cudart()
    t = time.perf_counter()
    base = torch.empty(N + 2 * PAGE, dtype=torch.uint8)
    offset = -base.data_ptr() % PAGE
    exact = base[offset:offset + N]
    size = -(-N // PAGE) * PAGE
    err = cudart.cudaHostRegister(exact.data_ptr(), size, 0)
    print(f"cudaHostRegister: {time.perf_counter() - t:.3f}s, error {int(err) if not isinstance(err, int) else err}, "
          f"is_pinned {exact.is_pinned()}, rss {rss() / GiB:.2f} GiB, host stats {stats()}", flush=True)
    rates(exact, "registered")
    t = time.perf_counter()
    err = cudart.cudaHostUnregister(exact.data_ptr())
    print(f"cudaHostUnregister: {time.perf_counter() - t:.3f}s, error {err}", flush=True)


if __name__ == "__main__":
    main()
