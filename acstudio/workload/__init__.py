"""What the user loads: a model, a batch, a loss and an optimizer (the "workload"), rebuilt from a spec."""

from acstudio.workload.spec import Workload, WorkloadSpec, build_workload, list_models

__all__ = ["Workload", "WorkloadSpec", "build_workload", "list_models"]
