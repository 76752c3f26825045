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
Its output: results/probes/compiled_form_peak_gpt2-s512_offload-margin-1pct_h200.txt. Generated code that several
blocks share is one file, so sites alone cannot say which block made what: an offloading plan's blocks (with
regions, the model's loop runs eagerly and every block compiles alone) are therefore also run once more with their
copies off (``sac+compile, no copies``) and once with no regions at all, the model compiled whole
(``sac+compile, whole``), and each run's memory at its peak is split by the segment of the step that allocated it
(a marker allocation at the start of every block's and the head's forward, and of the backward through each).
Its output: results/probes/compiled_form_peak_gpt2-s512_split_h200.txt. Set it beside the planner's prediction,
block by block, on a CPU:
  PYTHONPATH=. PROBE_OFFLOAD_MARGIN=0.01 python3 benchmarks/probes/compiled_form_peak.py --predicted RESULT_JSON PROFILE
The bench's plan is made from the run's calibration rows as the grid made it, ``compile+per-op+regions`` included
(its time, and whether its blocks were handed the mask's bias). GPT-2 seq 2048's first plan in the bias form (H200,
2026-11-29, nineteenth session), 281 MiB over its prediction: results/probes/compiled_form_peak_gpt2-s2048_bias_h200.txt
(from results/probes/gpt2-s2048.compiled-bias.json and .profile.json.gz), its prediction beside it in
..._predicted_cpu.txt.
"""

import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

MiB = 2**20
CONFIGS = ["compile+per-op", "sac+compile@compile+per-op"]  # the peer, then our form of its set
NO_COPIES = "sac+compile, no copies"  # the offloading plan with its regions' copies off (PROBE_OFFLOAD_MARGIN)
WHOLE = "sac+compile, whole"  # its decisions with no regions: the model compiled whole, nothing offloaded
BLOCK = re.compile(r"\.(h|layer|layers)\.(\d+)$")  # GPT-2's, BERT's and LLaMA's repeated blocks
HEADS = ("lm_head", "cls")  # what runs after the last block (GPT-2 and LLaMA, BERT)
MARK_BYTES = 512 * 1000  # a marker allocation is MARK_BYTES + 512 * its segment's number


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


def live_at_peak(trace: list[dict], live: dict[int, tuple[int, str]]) -> tuple[int, dict[int, tuple[int, str]], int]:
    """Replay ``trace`` (one device's allocator events) from ``live`` (address -> bytes, site); the most bytes
    allocated at once, what was live then, and the index in ``trace`` where that was."""
    now = sum(b for b, _ in live.values())
    best, at, where = now, dict(live), -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], site(e.get("frames", [])))
            now += e["size"]
            if now > best:
                best, at, where = now, dict(live), i
        elif e["action"] == "free_requested" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    return best, at, where


def mark_segments(model: torch.nn.Module) -> list[str]:
    """Make every block's and the head's forward, and the backward through each of them, start with a marker
    allocation, kept until the next step's: the trace then says which segment of the step allocated what, and in
    which the peak fell. Returns the segments' names, by marker number."""
    names = ["before the first block"]
    markers = {}

    def segment(name: str):
        names.append(name)
        number = len(names) - 1

        def mark(device, number=number):
            markers[number] = torch.empty(MARK_BYTES + 512 * number, dtype=torch.uint8, device=device)
        return mark

    for name, module in model.named_modules():
        if BLOCK.search(name) or name.split(".")[-1] in HEADS:
            forward, backward = segment(f"forward {name}"), segment(f"backward {name}")

            @torch.compiler.disable
            def before(module, args, forward=forward):
                forward(next(module.parameters()).device)

            @torch.compiler.disable
            def after(module, args, output, backward=backward):
                out = output if isinstance(output, torch.Tensor) else output[0]
                if out.requires_grad:
                    out.register_hook(lambda grad: backward(grad.device))

            module.register_forward_pre_hook(before)
            module.register_forward_hook(after)
    return names


def by_segment(trace: list[dict], at: dict[int, tuple[int, str]], names: list[str],
               peak: int) -> tuple[collections.Counter, str]:
    """The bytes of ``at`` (live at the peak) by the segment whose marker last preceded their allocation, and the
    segment of the peak (the event ``peak`` of ``trace``)."""
    made_in, segment = {}, 0
    for e in trace[:peak + 1]:  # an address reused after the peak is not what was live there
        if e["action"] != "alloc":
            continue
        n = (e["size"] - MARK_BYTES) // 512
        if e["size"] >= MARK_BYTES and (e["size"] - MARK_BYTES) % 512 == 0 and 0 < n < len(names):
            segment = n
        made_in[e["addr"]] = segment
    peak_in = names[segment] if peak >= 0 else "before the step"
    sizes = collections.Counter()
    for addr, (size, _) in at.items():
        sizes[names[made_in[addr]] if addr in made_in else "resident before the step"] += size
    return sizes, peak_in


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
    names = []
    if "offload_margin" in cfg:  # the bench's own plan, offloading past this margin
        import acstudio
        from acstudio.export import apply
        from acstudio.plan import compiled

        compiled.OFFLOAD_MARGIN = cfg["offload_margin"]
        worker.plan_ahead_of(cfg)
        if cfg.get("no_copies"):
            apply._RegionCall.pack = lambda self, t: t
        if cfg.get("whole"):  # the same decisions, the model compiled whole: no block runs as a region
            apply.run_as_region = lambda *a, **k: None
        else:  # compiled whole, the markers (graph breaks) would cut the model into graphs per block
            applied = acstudio.apply_plan
            acstudio.apply_plan = lambda model, *a, **k: names.extend(mark_segments(model)) or applied(model, *a, **k)
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
        trace = after["device_traces"][0][start:]
        best, at, peak = live_at_peak(trace, dict(live))
        found.update(resident=by_site(live), at_peak=by_site(at), replayed_peak=best, measured=result[:2])
        if names:
            found["by_segment"], found["peak_in"] = by_segment(trace, at, names, peak)
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
    # the calibration rows as the grid run's planner had them: the regions form's time, and whether it ran handed
    # the mask's bias, where the run measured it
    timed = [c for c in ("compile", "compile+per-block", "compile+per-op", "compile+per-op+regions") if c in rows]
    times = [rows[c]["time_ms_median"] for c in timed]
    bias = bool(rows.get("compile+per-op+regions", {}).get("details", {}).get("mask_bias"))
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
                    "compiled_step_ms": ",".join(repr(t) for t in times), "regions_bias": bias}
            if margin:  # each in its own profile folder: the bench exports each plan beside its profile
                for label, change in ((NO_COPIES, {"no_copies": True}), (WHOLE, {"whole": True})):
                    own_profile = tmp / label.replace(" ", "_").replace(",", "") / profile.name
                    own_profile.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(profile, own_profile)
                    out.append(cfg | change | {"label": label, "profile_path": str(own_profile)})
        out.append(cfg)
    return out


def predicted(result: dict, profile_path: Path) -> str:
    """The plan the bench makes at compile+per-op's peak with ``PROBE_OFFLOAD_MARGIN`` (on a CPU, from the run's
    profile and rows, as ``benchmarks/grid_replan.py`` makes it): its activations in memory at its predicted peak,
    by block, with and without its copies."""
    import numpy as np

    from acstudio.plan import compiled
    from acstudio.plan.peak import activations_at
    from acstudio.plan.schedule import PlanContext
    from acstudio.profile.model import Profile
    from acstudio.simulate.modes import get_mode
    from acstudio.simulate.sac import sac_blocks
    from benchmarks.grid_replan import compiled_plan_of

    compiled.OFFLOAD_MARGIN = float(os.environ.get("PROBE_OFFLOAD_MARGIN", compiled.OFFLOAD_MARGIN))
    profile = Profile.load(profile_path)
    plan = compiled_plan_of({r["config"]: r for r in result["rows"]}, profile)
    ctx = PlanContext(profile, offload=True)
    result_sim = ctx.simulation(plan)
    rg, pos = ctx.rg, profile.node_index[result_sim.peak_node]
    alive, on_host = activations_at(ctx, plan, result_sim, pos)
    block_of = np.array([str(b) for b in sac_blocks(ctx.sim).act_block], dtype=object)
    no_copies = get_mode(plan.replay_mode).peak(ctx.sim, ctx.sim.indices(plan.recomputed))[0]
    lines = [f"== predicted (CPU): compiled peak {plan.compiled_peak_bytes / MiB:.2f} MiB (its {plan.replay_mode} "
             f"simulation's {plan.predicted_peak_bytes / MiB:.2f} less the calibrated "
             f"{plan.compiled_offset_bytes / MiB:.2f}), {plan.offload_bytes / MiB:.2f} MiB offloaded; with its "
             f"copies off ({NO_COPIES}) {(no_copies - plan.compiled_offset_bytes) / MiB:.2f} MiB. Activations "
             f"at the simulation's peak node {result_sim.peak_node} by block, MiB on the device / on the host"]
    for block in sorted(set(block_of[alive]), key=lambda b: (len(b), b)):
        mine = alive & (block_of == block)
        lines.append(f"  {block or '(no block)':28s} {rg.bytes[mine & ~on_host].sum() / MiB:10.2f} "
                     f"{rg.bytes[mine & on_host].sum() / MiB:10.2f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1] == "--one":
        print(json.dumps(measure_one(json.loads(sys.argv[2]))))
        return
    if sys.argv[1] == "--predicted":
        print(predicted(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])))
        return
    out, result, profile = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    tmp = out / "probe_tmp"
    found = {}
    for cfg in configs(result, profile, tmp):
        run = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)], capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"{cfg['config']} failed:\n{run.stderr[-3000:]}")
        found[cfg.get("label", cfg["config"])] = json.loads(run.stdout.strip().splitlines()[-1])
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
    for name, f in found.items():
        if "by_segment" in f:
            lines.append(f"\n== {name}: its peak falls in the {f['peak_in']}; bytes live there by the segment "
                         "that allocated them")
            lines += [f"  {segment:36s} {size / MiB:10.2f}" for segment, size in f["by_segment"].items()]
    text = "\n".join(lines) + "\n"
    (out / "compiled_form_peak.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
