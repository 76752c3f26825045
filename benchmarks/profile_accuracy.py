"""Profile a workload and measure the eager step's peak in separate fresh processes; compare the two.

Usage: python benchmarks/profile_accuracy.py OUT_DIR MODEL:BATCH [MODEL:BATCH ...] [-- extra profile args]
Writes OUT_DIR/<device>_<model>_bs<batch>_adam.json.gz (the profile) and OUT_DIR/profile_accuracy.json
(measured profile peak vs eager max_memory_allocated, capture+profile wall time). The targets: peak
within 2% of eager, ResNet-152 bs64 capture+profile within 30 s on an H200.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

EAGER = """
import json, sys, torch
from acstudio.workload import WorkloadSpec, build_workload
spec = WorkloadSpec.from_dict(json.loads(sys.argv[1]))
w = build_workload(spec).to("cuda")
opt = w.make_optimizer()
def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=spec.precision == "bf16"):
        loss = w.loss_fn(w.model, w.batch)
    loss.backward()
    opt.step()
for _ in range(3):
    step()
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
step(); torch.cuda.synchronize()
print(json.dumps({"eager_peak_bytes": torch.cuda.max_memory_allocated()}))
"""


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    jobs = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    rows = []
    for job in jobs:
        model, bs = job.split(":")
        name = f"h200_{model}_bs{bs}_adam.json.gz"
        path = out / name
        cmd = [sys.executable, "-m", "acstudio", "profile", model, "--batch-size", bs, "--device", "cuda",
               "--out", str(path), *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        row = {"model": model, "batch_size": int(bs), "command": " ".join(["acstudio", *cmd[3:]]),
               "wall_s": round(wall, 2), "rc": proc.returncode, "stdout": proc.stdout[-2000:],
               "stderr": proc.stderr.replace("\r", "\n")[-1500:]}
        if proc.returncode == 0:
            from acstudio.profile.model import Profile

            prof = Profile.load(path)
            spec = prof.workload
            eager = subprocess.run([sys.executable, "-c", EAGER, json.dumps(spec)], capture_output=True, text=True)
            row.update(profile_peak_bytes=prof.peak_bytes, step_peak_bytes=prof.environment["step_peak_bytes"],
                       capture_s=prof.environment["capture_s"], nodes=len(prof.nodes),
                       activations=len(prof.activations), iteration_ms=prof.iteration_ms)
            if eager.returncode == 0:
                e = json.loads(eager.stdout.strip().splitlines()[-1])["eager_peak_bytes"]
                row.update(eager_peak_bytes=e, peak_error_pct=round(100 * (prof.peak_bytes - e) / e, 3))
            else:
                row["eager_error"] = eager.stderr[-1500:]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("stdout", "stderr")}), flush=True)
    (out / "profile_accuracy.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
