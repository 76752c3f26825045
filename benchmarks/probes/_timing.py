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
