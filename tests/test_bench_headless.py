"""A headless GPU node has no Qt: plan, export and bench must import and run with every Qt import failing."""

import subprocess
import sys

BLOCK_QT = """
import importlib.abc, sys

class NoQt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("PySide6", "pyqtgraph", "shiboken6"):
            raise ImportError(f"{name} is not installed on this node")

sys.meta_path.insert(0, NoQt())
"""

CHECK = BLOCK_QT + """
import acstudio, acstudio.bench, acstudio.bench.worker, acstudio.bench.distributed, acstudio.plan, acstudio.export
import acstudio.simulate.sharding, acstudio.cli
from acstudio.cli import main
assert main(["plan", "sample_profiles/cpu_resnet18_bs16_sgd.json.gz", "--budget", "80%", "--fsdp", "2"]) == 0
assert main(["bench", "resources/custom_model_example.py:make", "-b", "2", "--configs", "eager", "--device", "cpu",
             "--warmup", "1", "--iters", "3", "--out", sys.argv[1]]) == 0
print("headless ok")
"""


def test_plan_export_and_bench_run_without_qt(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path / "bench")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "headless ok" in out.stdout and "predicting one of 2 ranks under fsdp" in out.stdout
    assert (tmp_path / "bench" / "bench.json").is_file()
