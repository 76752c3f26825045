"""``acstudio bench``: the rewritten step against eager, per-block checkpointing and torch.compile, on a GPU.

Every (batch size, configuration) runs in a fresh process (:mod:`acstudio.bench.worker`); the parent
(:func:`run_bench`) collects the rows, searches the largest batch within a memory budget, and writes JSON and
CSV. :func:`plot_results` draws them later, wherever matplotlib is installed.
"""

from acstudio.bench.configs import KINDS, BenchConfig, expand_configs
from acstudio.bench.plot import plot_results
from acstudio.bench.results import BenchResults, compare, parse_size
from acstudio.bench.runner import run_bench, search_max_batch

__all__ = ["KINDS", "BenchConfig", "BenchResults", "compare", "expand_configs", "parse_size", "plot_results",
           "run_bench", "search_max_batch"]
