"""Timing shared by the probes (not a probe itself)."""

import time

import torch


def host_and_wall_ms(step, iterations: int) -> tuple[list[float], list[float]]:
    """Per call of ``step()``: the milliseconds until it returned (host issue time) and until the GPU finished
    (wall time), each call starting on an idle GPU. Their difference is how far the host ran ahead of the GPU."""
    host, wall = [], []
    for _ in range(iterations):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        host.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
    return host, wall


def runtime_call_rounds(runtime_class, size: int, n: int, dev: torch.device, rounds: int) -> list[dict[str, float]]:
    """Per round, the host seconds each of the offload runtime's four calls takes over ``n`` slots of ``size``
    bytes (``runtime_class``: an ``OffloadRuntime``), issued as the step issues them while the GPU spins, so that
    nothing waits for the device."""
    rt = runtime_class([f"a{j}" for j in range(n)], [size] * n)
    ts = [torch.empty(size // 4, device=dev) for _ in range(n)]
    rt.ensure_pool(dev)
    bufs = []
    calls = (("to_host", lambda j: rt.to_host(j, ts[j])), ("release", lambda j: rt.release(j, (ts[j],))),
             ("prefetch", lambda j: bufs.append(rt.prefetch(j))), ("wait", lambda j: rt.wait(j, bufs[j])))
    costs = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)
        bufs.clear()
        cost = {}
        for name, f in calls:
            t = time.perf_counter()
            for j in range(n):
                f(j)
            cost[name] = time.perf_counter() - t
        costs.append(cost)
        torch.cuda.synchronize()
    return costs
