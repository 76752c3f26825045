import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# `auto` may spend up to 10 s per budget in its shared-chain program; the tests of everything else plan without it
# (subprocesses inherit this), and tests/test_solvers.py turns it back on where it is the subject.
os.environ["ACSTUDIO_AUTO_MILP_SECONDS"] = "0"
# One intra-op thread for torch, here and in the processes the tests start (set before torch is imported): the
# tiny models' ops gain nothing from a second one, and OpenMP's threads wait for each other at every op, so
# whenever the two cores are shared (a GUI job's thread, a bench worker, anything else on the machine) each op
# waits for a thread that is not running and a test takes many times longer.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from transformers.utils import logging as hf_logging

# transformers' own stderr handler keeps the stream it first saw, which may be an earlier test's closed capsys
# buffer ("--- Logging error ---"); let its records go through the root logger that pytest manages instead.
hf_logging.disable_default_handler()
hf_logging.enable_propagation()

# Tiny configurations of the three kinds of model the issues name: CNN with BatchNorm, encoder with dropout
# and an attention mask, decoder LM with tied weights.
TINY_BERT = ("num_hidden_layers=2", "hidden_size=32", "num_attention_heads=2", "intermediate_size=64",
             "vocab_size=120", "max_position_embeddings=64")
TINY_GPT2 = ("n_layer=2", "n_embd=32", "n_head=2", "vocab_size=120", "n_positions=64")
TINY_LLAMA = ("num_hidden_layers=2", "hidden_size=32", "num_attention_heads=2", "num_key_value_heads=2",
              "intermediate_size=64", "vocab_size=120", "max_position_embeddings=64")

# A factory file's text: a small CNN whose activations outweigh its parameters, so checkpointing has something to
# do, and that a worker process builds without importing transformers.
TINY_CNN = """
import torch
import torch.nn.functional as F
from torch import nn


def make(batch_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    batch = (torch.randn(batch_size, 3, 24, 24), torch.randint(0, 10, (batch_size,)))

    def loss_fn(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    return model, batch, loss_fn
"""


def tiny_spec(model: str, **kw):
    from acstudio.workload import WorkloadSpec

    config = {"bert": TINY_BERT, "gpt2": TINY_GPT2, "llama": TINY_LLAMA}.get(model.split("-")[0], ())
    defaults = {"batch_size": 2, "image_size": 32, "seq_len": 16,
                    "config": tuple(tuple(c.split("=", 1)) for c in config)}
    defaults.update(kw)
    return WorkloadSpec(model, **defaults)


@pytest.fixture
def cpu_only_deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True, scope="session")
def ctrl_c_reaches_the_tests():
    """The Ctrl-C tests interrupt the main thread (`_thread.interrupt_main`), which does nothing where SIGINT is
    ignored, as in a suite started in the background of a non-interactive shell."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)


def benchmark_script(name: str):
    """``benchmarks/NAME.py``, imported: the benchmark scripts run as scripts, not as a package."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" /
                                                  f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass in it resolves its annotations through sys.modules
    spec.loader.exec_module(module)
    return module
