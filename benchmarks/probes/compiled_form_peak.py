"""Where the memory of our SAC form and of a peer differ, compiled: the device allocations live before a measured
step and at its peak, by the code that made them, for ``compile+per-op`` and ``sac+compile@compile+per-op``, each
built and measured by the bench's own worker in a process of its own. The sac configuration runs torchtitan's own
set as it runs compiled (:func:`acstudio.plan.compiled.torchtitan_held`), planned at compile+per-op's measured
peak without the bench's planning headroom, so the two run the same decisions: one as torchtitan's policy, one as
our SAC form.

Usage: PYTHONPATH=. python3 benchmarks/probes/compiled_form_peak.py OUT RESULT_JSON PROFILE
  RESULT_JSON: a grid shape's compiled part, whose rows give the workload and the calibration; PROFILE: the
  profile its plans came from (e.g. results/probes/gpt2-s512.compiled.torchtitan-at-measured-peak.json and
  results/probes/gpt2-s512.compiled.profile.json.gz). Writes OUT/compiled_form_peak.txt.
Output: results/probes/compiled_form_peak_h100.txt (GPT-2 seq 512 bs32, where our form of torchtitan's set peaked
6.7 MiB over the policy's in a grid run).

With ``PROBE_OFFLOAD_MARGIN`` (a share of the step, e.g. 0.01) the sac configuration runs the bench's own plan, as
the grid row ran it (the planning headroom kept), with ``acstudio.plan.compiled.OFFLOAD_MARGIN`` set so: where the
memory of an offloading plan (blocks compiled one by one, what they save on the host) sits at its peak. GPT-2 seq
512's such plan peaked 3.4% over its prediction (H200):
  PYTHONPATH=. PROBE_OFFLOAD_MARGIN=0.01 python3 benchmarks/probes/compiled_form_peak.py OUT \
      results/superseded/grid-gpt2-s512.compiled-offload-margin-1pct.json \
      results/probes/gpt2-s512.compiled-offload-margin-1pct.profile.json.gz
"""

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

MiB = 2**20
CONFIGS = ["compile+per-op", "sac+compile@compile+per-op"]  # the peer, then our form of its set


def site(frames: list[dict]) -> str:
    """The innermost frame outside torch's own Python (and outside this probe): what asked for the memory."""
    for f in frames:
        name = f.get("filename", "")
        if ("/torch/" in name and "torchinductor" not in name) or name.endswith("compiled_form_peak.py"):
            continue
        if "torchinductor" in name:  # generated code: its file is named by a hash of the graph, so by line only
            return f"compiled code, line {f.get('line')}"
        return f"{Path(name).name}:{f.get('line')} {f.get('name')}"
    return "(no Python frame)" if not frames else f"{Path(frames[0]['filename']).name}:{frames[0]['line']}"


def live_at_peak(trace: list[dict], live: dict[int, tuple[int, str]]) -> tuple[int, dict[int, tuple[int, str]]]:
    """Replay ``trace`` (one device's allocator events) from ``live`` (address -> bytes, site); the most bytes
    allocated at once and what was live then."""
    now = sum(b for b, _ in live.values())
    best, at = now, dict(live)
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], site(e.get("frames", [])))
            now += e["size"]
            if now > best:
                best, at = now, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    return best, at


def by_site(live: dict[int, tuple[int, str]]) -> collections.Counter:
    sizes = collections.Counter()
    for size, where in live.values():
        sizes[where] += size
    return sizes


def measure_one(cfg: dict) -> dict:
    """This process: the bench worker's measurement of ``cfg`` with the allocator's history recorded, and the
    live allocations before the measured step and at its peak."""
    from acstudio.bench import worker

    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    if "offload_margin" in cfg:  # the bench's own plan, offloading past this margin
        from acstudio.plan import compiled

        compiled.OFFLOAD_MARGIN = cfg["offload_margin"]
        worker.plan_ahead_of(cfg)
    elif cfg.get("task_plan"):  # our SAC form of torchtitan's own set, planned at compile+per-op's peak itself
        from acstudio.bench import steps
        from acstudio.plan import compiled

        def torchtitans_set(ctx, budget, solver, cancel):
            return ctx.plan_for_set(solver, budget, compiled.torchtitan_held(ctx), mode=compiled.TIMED_MODE)

        steps.with_headroom = lambda budget, share=0.0: budget
        compiled.fastest_in_compiled_memory = torchtitans_set
        worker.plan_ahead_of(cfg)
    found = {}
    measured_step = worker.step_peak_bytes

    def recorded(step, dev, resident):
        torch.cuda.synchronize()
        before = torch.cuda.memory._snapshot()
        start = len(before["device_traces"][0])
        live = {b["address"]: (b["size"], site(b.get("frames", [])))
                for s in before["segments"] for b in s["blocks"] if b["state"] == "active_allocated"}
        result = measured_step(step, dev, resident)
        after = torch.cuda.memory._snapshot()
        best, at = live_at_peak(after["device_traces"][0][start:], dict(live))
        found.update(resident=by_site(live), at_peak=by_site(at), replayed_peak=best, measured=result[:2])
        return result

    worker.step_peak_bytes = recorded
    worker.measure(cfg)
    return {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in found.items()}


def configs(result: dict, profile: Path, tmp: Path) -> list[dict]:
    rows = {r["config"]: r for r in result["rows"]}
    ours = next(r for r in result["rows"] if r["kind"] == "sac+compile")
    plan_dir_profile = tmp / "profiles" / profile.name
    plan_dir_profile.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(profile, plan_dir_profile)
    times = [rows[c]["time_ms_median"] for c in ("compile", "compile+per-block", "compile+per-op")]
    out = []
    for name in CONFIGS:
        row = rows[name]
        cfg = {"spec": row["spec"], "config": name, "device": "cuda", "warmup": row["warmup"] - 5, "iters": 2,
               "profile_path": str(plan_dir_profile), "compile_backend": "inductor"}
        if row["kind"] == "sac+compile":
            margin = os.environ.get("PROBE_OFFLOAD_MARGIN")
            cfg |= {"offload_margin": float(margin)} if margin else {"task_plan": True}
            cfg |= {"budget": f"{ours['details']['budget_bytes']}B",
                    "compiled_per_block_peak": f"{rows['compile+per-block']['peak_bytes']}B",
                    "compiled_per_op_peak": f"{rows['compile+per-op']['peak_bytes']}B",
                    "compiled_step_ms": ",".join(repr(t) for t in times)}
        out.append(cfg)
    return out


def main() -> None:
    if sys.argv[1] == "--one":
        print(json.dumps(measure_one(json.loads(sys.argv[2]))))
        return
    out, result, profile = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    tmp = out / "probe_tmp"
    found = {}
    for cfg in configs(result, profile, tmp):
        run = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)], capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"{cfg['config']} failed:\n{run.stderr[-3000:]}")
        found[cfg["config"]] = json.loads(run.stdout.strip().splitlines()[-1])
    shutil.rmtree(tmp, ignore_errors=True)
    lines = []
    for name, f in found.items():
        lines.append(f"== {name}: measured peak {f['measured'][0] / MiB:.2f} MiB, resident before the step "
                     f"{f['measured'][1] / MiB:.2f} MiB; replayed from the history: peak "
                     f"{f['replayed_peak'] / MiB:.2f}")
    a, b = CONFIGS
    for part in ("resident", "at_peak"):
        lines.append(f"\n== {part}: bytes by site, {b} less {a} (|difference| >= 0.01 MiB), then each total")
        sites = set(found[a][part]) | set(found[b][part])
        diff = sorted(((found[b][part].get(s, 0) - found[a][part].get(s, 0), s) for s in sites),
                      key=lambda x: -abs(x[0]))
        for d, s in diff:
            if abs(d) >= 0.01 * MiB:
                lines.append(f"  {d / MiB:+10.2f} MiB  {s}  ({found[a][part].get(s, 0) / MiB:.2f} -> "
                             f"{found[b][part].get(s, 0) / MiB:.2f})")
        for name in CONFIGS:
            total = sum(found[name][part].values())
            lines.append(f"  {name}: {total / MiB:.2f} MiB over {len(found[name][part])} sites")
    text = "\n".join(lines) + "\n"
    (out / "compiled_form_peak.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
