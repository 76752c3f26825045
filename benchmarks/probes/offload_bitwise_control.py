"""Is an offloading rewritten step bitwise equal to the same step without offload on CUDA, and is the step
without offload bitwise equal to itself (the control)?

An offload only copies bytes out and back, so any difference it makes is a bug, unless the step is not
deterministic in the first place: ``offload_health_50_steps.py`` found GPT-2 small at seq 512 not bitwise equal
with and without offload. This runs a small GPT-2 (2 layers, 256 wide, bs8) at seq 64 and seq 512 with every
offloadable activation offloaded, 3 steps each from the same start, and compares per step loss, gradients and
parameters (equal, and the largest difference): plain against plain, offload against plain, and offload against
plain under ``torch.use_deterministic_algorithms(True, warn_only=True)``. It prints the attention ops the capture
chose, since the memory-efficient attention backward is the suspect.

Run: cd <repo> && PYTHONPATH=. python3 benchmarks/probes/offload_bitwise_control.py \\
         > results/probes/offload_bitwise_control.txt 2>&1
Needs one CUDA GPU (about a minute) and the tests folder, whose ``quick_profile`` makes a static profile (no
timing runs): the rewrite only needs the graph and the activations' sizes.
"""

import copy
import pathlib
import sys

import numpy as np
import torch

from acstudio.capture import capture_step
from acstudio.rewrite import rewrite_step
from acstudio.simulate.simulator import Simulator
from acstudio.workload import WorkloadSpec, build_workload
from acstudio.workload.spec import make_optimizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
from test_rewrite import quick_profile


def run(step, w, opt, spec, steps=3):
    model = copy.deepcopy(w.model)
    optimizer = make_optimizer(spec.optimizer, model.parameters())
    optimizer.load_state_dict(copy.deepcopy(opt.state_dict()))
    out = []
    for i in range(steps):
        torch.manual_seed(i)
        loss = step.run(model, optimizer, w.batch)
        out.append((loss.detach().clone(), [p.detach().clone() for p in model.parameters()],
                    [p.grad.detach().clone() for p in model.parameters()]))
    return out


def compare(name, a, b):
    for i, ((la, pa, ga), (lb, pb, gb)) in enumerate(zip(a, b)):
        gd = max(float((x - y).abs().max()) for x, y in zip(ga, gb))
        pd = max(float((x - y).abs().max()) for x, y in zip(pa, pb))
        print(f"  {name} step {i}: loss equal {torch.equal(la, lb)} ({float(la):.6f} vs {float(lb):.6f}), grads "
              f"equal {all(torch.equal(x, y) for x, y in zip(ga, gb))} (max diff {gd:.3g}), params equal "
              f"{all(torch.equal(x, y) for x, y in zip(pa, pb))} (max diff {pd:.3g})", flush=True)


def main():
    config = (("n_layer", "2"), ("n_embd", "256"), ("n_head", "4"), ("vocab_size", "1000"), ("n_positions", "512"))
    for seq in (64, 512):
        spec = WorkloadSpec("gpt2", batch_size=8, seq_len=seq, config=config)
        w = build_workload(spec).to(torch.device("cuda"))
        opt = w.make_optimizer()
        step = capture_step(w.model, opt, w.batch, w.loss_fn)
        ops = sorted({str(n.target) for n in step.gm.graph.nodes if "attention" in str(n.target)})
        print(f"seq {seq}: attention ops {ops}", flush=True)
        profile = quick_profile(spec, step)
        sim = Simulator(profile)
        offloaded = [sim.replay.act_ids[k] for k in np.flatnonzero(sim.offload_facts.offloadable)]
        off = rewrite_step(step, profile, [], offloaded=offloaded)
        plain = rewrite_step(step, profile, [])
        a, b, c = run(plain, w, opt, spec), run(plain, w, opt, spec), run(off, w, opt, spec)
        compare("plain vs plain (control)", a, b)
        compare("offload vs plain", c, a)
        torch.use_deterministic_algorithms(True, warn_only=True)
        d, e = run(plain, w, opt, spec), run(off, w, opt, spec)
        torch.use_deterministic_algorithms(False)
        compare("deterministic algorithms: offload vs plain", e, d)


if __name__ == "__main__":
    main()
