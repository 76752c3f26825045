"""Where a traced step's compute stream waits, and where its copies to and from the host run: a Chrome trace of one
step (torch.profiler, e.g. ``compiled_offload_health.py``'s ``PROBE_TRACE``) summarized on any machine.

Prints the compute stream's span and busy time (kernels and memsets on the stream that runs the most kernels), each
copy direction's count, bytes, first start, last end and bandwidth, the compute stream's idle time per 10 ms of the
step, and every idle stretch over ``--gap`` ms (a wait for a copy shows as one just before a block's backward).
With ``--host``, each stretch also says when the host launched the kernel after it and what the host ran in the
stretch (the longest host events): a stretch that ends as its kernel is launched is one where the device waited
for the host.

Run: python3 benchmarks/probes/step_trace_summary.py TRACE.json.gz [--gap 1.0] [--host]
"""

import argparse
import collections
import gzip
import json


def summarize(path: str, gap_ms: float, host: bool = False) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memset")]
    streams = collections.Counter(e.get("tid") for e in gpu if e["cat"] == "kernel").most_common(1)
    if not streams:
        print(f"{path}: no GPU kernels in this trace (a CPU run's?)")
        return
    compute = streams[0][0]
    ops = sorted((e for e in gpu if e.get("tid") == compute), key=lambda e: e["ts"])
    t0 = ops[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in ops)
    print(f"{path}: compute stream span {(end - t0) / 1e3:.1f} ms, busy {sum(e['dur'] for e in ops) / 1e3:.1f} ms")
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    host_events = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    for name, tag in (("device-to-host", "DtoH"), ("host-to-device", "HtoD")):
        lane = sorted((e for e in copies if tag in e["name"]), key=lambda e: e["ts"])
        if lane:
            nbytes = sum(e["args"].get("bytes", 0) for e in lane)
            print(f"  {name}: {len(lane)} copies, {nbytes / 2**20:.0f} MiB, {(lane[0]['ts'] - t0) / 1e3:.1f} to "
                  f"{(lane[-1]['ts'] + lane[-1]['dur'] - t0) / 1e3:.1f} ms, "
                  f"{nbytes / sum(e['dur'] for e in lane) / 1e3:.1f} GB/s")
    per_10ms = [0.0] * (int((end - t0) / 1e4) + 1)
    long_gaps = []
    reached = ops[0]["ts"] + ops[0]["dur"]
    for e in ops[1:]:
        idle = max(e["ts"] - reached, 0)
        per_10ms[int((reached - t0) / 1e4)] += idle / 1e3
        if idle > gap_ms * 1e3:
            line = f"{(reached - t0) / 1e3:.1f} ms: {idle / 1e3:.2f} ms before {e['name'][:50]}"
            launch = launches.get(e["args"].get("correlation"))
            if host and launch is not None:
                ran = sorted((x for x in host_events if reached <= x["ts"] <= launch["ts"]), key=lambda x: -x["dur"])
                line += (f"; launched by the host at {(launch['ts'] - t0) / 1e3:.1f} ms, after "
                         + ", ".join(f"{x['name'][:40]} {x['dur'] / 1e3:.2f} ms" for x in ran[:3]))
            long_gaps.append(line)
        reached = max(reached, e["ts"] + e["dur"])
    print(f"  compute idle {sum(per_10ms):.1f} ms; per 10 ms of the step: {' '.join(f'{v:.1f}' for v in per_10ms)}")
    for line in long_gaps:
        print(f"  idle over {gap_ms:g} ms at {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--gap", type=float, default=1.0, help="list idle stretches longer than this (ms)")
    parser.add_argument("--host", action="store_true", help="say what the host ran in each idle stretch")
    args = parser.parse_args()
    for path in args.traces:
        summarize(path, args.gap, args.host)


if __name__ == "__main__":
    main()
