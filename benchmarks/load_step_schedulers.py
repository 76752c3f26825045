"""``load_step`` under LR schedulers against the eager loop, on a real device: every step must train bitwise like it.

Usage: PYTHONPATH=. python3 benchmarks/load_step_schedulers.py OUT_DIR [--device cuda] [MODEL:BATCH ...]
(default models: resnet18:32 and a 2-layer bert:8 at seq 128). For SGD, Adam and AdamW each workload is profiled
ONCE at lr 0.3, half its memory planned away and exported; then, for StepLR and OneCycleLR, the exported step
and the eager loop train identically seeded copies for 5 steps at lr 0.02 with the scheduler. The eager loop
runs twice to measure its own run-to-run difference (non-deterministic kernels). A run passes when every loss,
parameter and optimizer-state tensor is within fp32 tolerance (rtol 1e-4, atol 1e-5) of the first eager run, or
no further from it than twice the eager run-to-run difference. Writes OUT_DIR/load_step_schedulers.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from acstudio import load_step
from acstudio.export import export
from acstudio.plan import plan
from acstudio.profiler import profile_workload
from acstudio.rewrite.verify import compare, deterministic_kernels
from acstudio.workload import WorkloadSpec, build_workload

CAPTURED_LR, LR = 0.3, 0.02
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=LR),
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.05),
}
SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6),
}
BERT = (("num_hidden_layers", "2"), ("hidden_size", "128"), ("num_attention_heads", "2"))


def train(spec: WorkloadSpec, device: str, optimizer: str, scheduler: str, export_dir: Path | None) -> dict:
    """Five scheduled steps, through the export (``export_dir``) or the eager loop; everything they produced."""
    w = build_workload(spec).to(device)
    opt = OPTIMIZERS[optimizer](w.model.parameters())
    sched = SCHEDULERS[scheduler](opt)
    if export_dir is not None:
        step = load_step(export_dir, w.model, opt)
    losses = []
    for i in range(5):
        torch.manual_seed(i)
        if export_dir is not None:
            loss = step(w.batch)
        else:
            opt.zero_grad(set_to_none=True)
            loss = w.loss_fn(w.model, w.batch)
            loss.backward()
            opt.step()
        losses.append(loss.detach().cpu())
        sched.step()
    params = dict(w.model.named_parameters())
    return {"loss": {str(i): t for i, t in enumerate(losses)},
            "parameters": {n: p.detach().cpu() for n, p in params.items()},
            "optimizer_state": {f"{n}/{k}": v.detach().cpu() for n, p in params.items()
                                for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}}


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    device = argv[argv.index("--device") + 1] if "--device" in argv else "cuda"
    names = [a for a in argv[1:] if ":" in a] or ["resnet18:32", "bert:8"]
    rows = []
    for name in names:
        model, _, batch = name.partition(":")
        for optimizer in OPTIMIZERS:
            spec = WorkloadSpec(model, int(batch), optimizer=optimizer, lr=CAPTURED_LR, seq_len=128,
                                config=BERT if model == "bert" else ())
            profile = profile_workload(spec, device)
            folder = out / f"{model}_bs{batch}_{optimizer}"
            export(profile, plan(profile, int(profile.peak_bytes * 0.5)), folder)
            for scheduler in SCHEDULERS:
                with deterministic_kernels(torch.device(device)):
                    ref = train(spec, device, optimizer, scheduler, None)
                    again = train(spec, device, optimizer, scheduler, None)
                    ours = train(spec, device, optimizer, scheduler, folder)
                kinds = {}
                for kind in ref:
                    noise = compare(kind, ref[kind], again[kind], 0.0, 0.0)
                    result = compare(kind, ref[kind], ours[kind], 1e-4, 1e-5, again[kind])
                    kinds[kind] = {"max_abs": result.max_abs, "max_rel": result.max_rel, "worst": result.worst,
                                   "mismatched": result.mismatched[:5], "eager_run_to_run_max_abs": noise.max_abs}
                row = {"model": model, "batch_size": int(batch), "optimizer": optimizer, "scheduler": scheduler,
                       "device": device, "passed": all(not k["mismatched"] for k in kinds.values()), "kinds": kinds}
                rows.append(row)
                diffs = ", ".join(f"{k} {v['max_abs']:.3g}" for k, v in kinds.items())
                print(f"{name} {optimizer} {scheduler}: {'PASSED' if row['passed'] else 'FAILED'} (max abs: {diffs})",
                      flush=True)
    meta = {"command": "python3 benchmarks/load_step_schedulers.py " + " ".join(argv), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    (out / "load_step_schedulers.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
