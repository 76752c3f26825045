"""What the user loads: a model, a batch, a loss and an optimizer (the "workload"), rebuilt from a spec."""

from acstudio.workload.build import build_workload, list_models
from acstudio.workload.spec import Workload, WorkloadSpec

__all__ = ["Workload", "WorkloadSpec", "build_workload", "list_models"]
