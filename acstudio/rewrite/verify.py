"""The validation gate: the rewritten step must compute what the captured step computes, and use less memory.

Both steps run once from identical state (a fresh copy of the seeded workload, optimizer state materialised the
same way, ``torch.manual_seed`` before each), and everything one iteration produces is compared: loss, gradients,
updated parameters, buffers (BatchNorm running statistics catch a double update) and optimizer state. A replay
re-executes the same kernels on the same inputs, so results must be bitwise identical wherever the kernels are
deterministic: always on the CPU. On CUDA deterministic kernels are requested while verifying and the captured
step runs three times; if its runs still differ (atomics in some backward kernels), a tensor passes when it is within
an fp32 tolerance or no further from the reference than twice the largest run-to-run difference of its kind.

On CUDA each step's peak is measured after that warm-up run with only its inputs alive. The storage-accounted peak
(:mod:`acstudio.rewrite.memory`) is reported on every device, beside the plan's prediction.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from acstudio.capture.serialize import deserialize_step
from acstudio.capture.step import CapturedStep, prepare_optimizer
from acstudio.errors import DeviceError, OutOfMemoryError
from acstudio.jobs import CancelToken, ProgressFn, check, report
from acstudio.plan.model import Plan
from acstudio.profile.model import Profile
from acstudio.profiler import resolve_device
from acstudio.rewrite.memory import live_bytes
from acstudio.rewrite.rewriter import plan_activations, rewrite_step
from acstudio.units import format_bytes
from acstudio.workload import WorkloadSpec, build_workload
from acstudio.workload.spec import move_batch

KINDS = ("loss", "gradients", "parameters", "buffers", "optimizer_state")
# On CUDA the captured step runs this many more times. A tensor may differ from the reference by up to twice the
# largest run-to-run difference of its kind: the noise is the step's, not one tensor's (after Adam a parameter
# moves by up to the learning rate wherever atomics changed a near-zero gradient's last bits), and one rerun
# samples it thinly: on the GPU a per-tensor bound from one rerun failed correct plans.
REFERENCE_RERUNS = 2
# fp32 tolerance for devices with non-deterministic kernels; bf16 autocast rounds far more coarsely.
TOLERANCE = {"fp32": (1e-4, 1e-5), "bf16": (2e-2, 1e-3)}  # (rtol, atol)


@dataclass
class Comparison:
    """How far the rewritten step's tensors of one kind are from the original's."""

    kind: str
    tensors: int
    max_abs: float
    max_rel: float  # over elements whose reference value is non-zero
    worst: str  # the tensor with the largest absolute difference
    mismatched: list[str] = field(default_factory=list)  # tensors outside the tolerance (or not bitwise equal)

    @property
    def passed(self) -> bool:
        return not self.mismatched


@dataclass
class VerifyResult:
    device: str
    recomputed: int
    replayed_nodes: int
    replay_ms: float  # measured run time of the replayed nodes, from the profile
    exact: bool  # whether bitwise equality was required (deterministic device)
    rtol: float
    atol: float
    comparisons: list[Comparison]
    accounted_peak_bytes: int  # storage accounting of the rewritten graph
    accounted_baseline_peak_bytes: int  # the same for the captured graph
    predicted_peak_bytes: int | None = None  # the plan's
    measured_peak_bytes: int | None = None  # CUDA only: max_memory_allocated of the rewritten step
    measured_baseline_peak_bytes: int | None = None  # CUDA only: the same for the captured step
    run_to_run: list[Comparison] | None = None  # CUDA only: the captured step against its reruns (largest)
    offloaded: int = 0  # activations copied to host memory and back
    offloaded_bytes: int = 0  # bytes those copies move each way

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        for c, cd in zip(self.comparisons, d["comparisons"]):
            cd["passed"] = c.passed
        return d

    def summary(self) -> str:
        """A few lines for the CLI and the GUI."""
        rule = "bitwise equal" if self.exact else \
            f"rtol {self.rtol:g}, atol {self.atol:g} or within 2x the captured step's run-to-run difference"
        moved = (f", {self.offloaded} offloaded ({format_bytes(self.offloaded_bytes)} each way)"
                 if self.offloaded else "")
        lines = [f"{'PASSED' if self.passed else 'FAILED'}: rewritten step vs captured step on {self.device} "
                 f"({self.recomputed} activations recomputed, {self.replayed_nodes} nodes replayed{moved}; {rule})"]
        for c in self.comparisons:
            bad = f"  mismatched: {', '.join(c.mismatched[:3])}" if c.mismatched else ""
            lines.append(f"  {c.kind:<16} {c.tensors:>5} tensors  max abs {c.max_abs:.3g}  max rel {c.max_rel:.3g}"
                         f"{bad}")
        if self.run_to_run and not self.exact:
            noise = ", ".join(f"{c.kind} {c.max_abs:.3g}" for c in self.run_to_run)
            lines.append(f"  run-to-run max abs of the captured step: {noise}")
        peaks = [("accounted", self.accounted_baseline_peak_bytes, self.accounted_peak_bytes)]
        if self.measured_peak_bytes is not None:
            peaks.append(("measured", self.measured_baseline_peak_bytes, self.measured_peak_bytes))
        for what, before, after in peaks:
            lines.append(f"  {what} peak: {format_bytes(before)} -> {format_bytes(after)}")
        if self.predicted_peak_bytes is not None:
            lines.append(f"  predicted peak (plan): {format_bytes(self.predicted_peak_bytes)}")
        return "\n".join(lines)


def verify(profile: Profile, plan, device: str = "cpu", progress: ProgressFn | None = None,
           cancel: CancelToken | None = None, *, replay_mode: str | None = None) -> VerifyResult:
    """Rewrite ``profile``'s step with ``plan`` and check it against the captured step on ``device``."""
    recomputed = plan_activations(plan, profile)
    dev = resolve_device(device)
    if dev.type == "cuda" and profile.environment.get("device_type", "cpu") == "cpu":
        raise DeviceError("this profile was captured on the CPU, so its graph creates CPU tensors; verify it with "
                          "--device cpu (a GPU profile can be verified on either)")
    total = 6
    report(progress, 0, total, "rewriting the step")
    step = deserialize_step(profile.graph, device=str(dev))
    missing = ops_without_kernel(step.gm, dev)
    if missing:
        raise DeviceError(f"the captured graph uses {', '.join(missing)}, which {dev.type} cannot run (the profile "
                          f"was made on {profile.environment.get('device', 'another device')}); verify it there")
    rewritten = rewrite_step(step, profile, recomputed, replay_mode=replay_mode)
    check(cancel)
    spec = WorkloadSpec.from_dict(profile.workload)
    report(progress, 1, total, "building the workload")
    master = build_workload(spec)  # stays on the CPU; every run starts from a fresh copy
    check(cancel)
    noise = None
    try:
        with deterministic_kernels(dev):
            report(progress, 2, total, "running the captured step")
            reference, base_peak = _run(step, master, spec, dev)
            check(cancel)
            if dev.type != "cpu":
                report(progress, 3, total, "running the captured step again (run-to-run difference)")
                reruns = []
                for _ in range(REFERENCE_RERUNS):
                    reruns.append(_run(step, master, spec, dev, measure=False)[0])
                    check(cancel)
                noise = [max((compare(kind, reference[kind], again[kind], 0.0, 0.0) for again in reruns),
                             key=lambda c: c.max_abs) for kind in KINDS]
            report(progress, 4, total, "running the rewritten step")
            result, peak = _run(rewritten, master, spec, dev)
            check(cancel)
    except torch.OutOfMemoryError as exc:
        raise OutOfMemoryError(f"CUDA out of memory while verifying {spec.label}; GPU memory has been released")\
            from exc
    finally:
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report(progress, 5, total, "comparing")
    exact = noise is None or all(c.passed for c in noise)
    rtol, atol = (0.0, 0.0) if exact else TOLERANCE[spec.precision]
    floor = {} if exact else {c.kind: 2 * c.max_abs for c in noise}
    comparisons = [compare(kind, reference[kind], result[kind], rtol, atol, floor.get(kind, 0.0)) for kind in KINDS]
    report(progress, total, total, "verified")
    return VerifyResult(
        device=str(dev), recomputed=len(recomputed),
        replayed_nodes=sum(1 for n in rewritten.gm.graph.nodes if n.meta.get("ac_role") == "recompute"),
        replay_ms=rewritten.replay_ms, exact=exact, rtol=rtol, atol=atol,
        comparisons=comparisons, accounted_peak_bytes=max(live_bytes(rewritten.gm, profile)),
        accounted_baseline_peak_bytes=max(live_bytes(step.gm, profile)),
        predicted_peak_bytes=plan.predicted_peak_bytes if isinstance(plan, Plan) else None,
        measured_peak_bytes=peak, measured_baseline_peak_bytes=base_peak, run_to_run=noise,
        offloaded=len(rewritten.offloads), offloaded_bytes=sum(o.bytes for o in rewritten.offloads))


def ops_without_kernel(gm: torch.fx.GraphModule, dev: torch.device) -> list[str]:
    """Operators of the graph that have no kernel for ``dev`` (``cudnn_batch_norm`` in a GPU capture, on a CPU)."""
    key = "CUDA" if dev.type == "cuda" else "CPU"
    names = {n.target.name() for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)}
    return sorted(name for name in names if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(name, key))


@contextlib.contextmanager
def deterministic_kernels(dev: torch.device) -> Iterator[None]:
    """On CUDA, ask for deterministic kernels while verifying, so that a correct replay can match bit for bit.

    Ops without a deterministic CUDA kernel still run (``warn_only``); the run-to-run comparison then shows it.
    """
    if dev.type != "cuda":
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # only effective before cuBLAS starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def _run(step: CapturedStep, master, spec: WorkloadSpec, dev: torch.device,
         measure: bool = True) -> tuple[dict, int | None]:
    """One seeded iteration from a fresh copy of ``master``; returns everything it produced (on the CPU) and, on
    CUDA with ``measure``, the peak of a second iteration measured with only the step's inputs alive."""
    model = copy.deepcopy(master.model).to(dev)
    batch = move_batch(master.batch, dev)
    optimizer = master.make_optimizer(model)
    prepare_optimizer(model, optimizer)
    try:
        torch.manual_seed(spec.seed)
        loss = step.run(model, optimizer, batch)
        out = snapshot(model, optimizer, loss)
        del loss
        if dev.type != "cuda" or not measure:
            return out, None
        for p in model.parameters():
            p.grad = None
        gc.collect()
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step.run(model, optimizer, batch)
        torch.cuda.synchronize(dev)
        return out, torch.cuda.max_memory_allocated(dev)
    finally:
        del model, batch, optimizer  # an exception's traceback would otherwise keep them on the device


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> dict:
    """CPU copies of what one iteration produced, by kind and name."""
    cpu = lambda t: t.detach().to("cpu", copy=True)  # noqa: E731
    params = dict(model.named_parameters())
    fqn = {id(p): n for n, p in params.items()}
    return {
        "loss": {"loss": cpu(loss)},
        "gradients": {n: cpu(p.grad) for n, p in params.items() if p.grad is not None},
        "parameters": {n: cpu(p) for n, p in params.items()},
        "buffers": {n: cpu(b) for n, b in model.named_buffers()},
        "optimizer_state": {f"{fqn[id(p)]}/{k}": cpu(v) for p, state in optimizer.state.items()
                            for k, v in state.items() if isinstance(v, torch.Tensor)},
    }


def compare(kind: str, expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], rtol: float,
            atol: float, noise_floor: float = 0.0) -> Comparison:
    """Max absolute / relative difference over all tensors of one kind, and which are outside the tolerance.

    A tensor also passes if no element is further from the reference than ``noise_floor``.
    """
    out = Comparison(kind=kind, tensors=len(expected), max_abs=0.0, max_rel=0.0, worst="")
    for name in sorted(expected.keys() | actual.keys()):
        a, b = actual.get(name), expected.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            out.mismatched.append(name)
            continue
        if torch.equal(a, b) or not a.numel():
            continue
        a64, b64 = a.double(), b.double()  # exact for the dtypes a step holds (fp32, bf16, integers, bools)
        diff = (a64 - b64).abs().nan_to_num(0.0)
        if not torch.allclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True) and diff.max().item() > noise_floor:
            out.mismatched.append(name)
        ref = b64.abs()
        nonzero = ref > 0
        if diff.max().item() > out.max_abs:
            out.max_abs, out.worst = diff.max().item(), name
        if bool(nonzero.any()):
            out.max_rel = max(out.max_rel, (diff[nonzero] / ref[nonzero]).max().item())
    return out
