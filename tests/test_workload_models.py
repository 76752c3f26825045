"""The model list keeps its promises: every name `acstudio models` lists builds, takes a batch at its defaults and
profiles on the CPU; the memory estimate made before allocating is a lower bound of the measured peak."""

import json

import pytest
import torch

from acstudio.errors import OutOfMemoryError
from acstudio.profile.profiler import profile_workload
from acstudio.workload import WorkloadSpec, build_workload, list_models
from acstudio.workload import memory as workload_memory
from acstudio.workload.memory import meta_estimate, require_fits
from acstudio.workload.zoo import HF_DEFAULT_TASK, split_hf_name

# The smallest config of every transformers type we list, in each config's own key names.
_ENCODER = {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32,
            "vocab_size": 64}
_DECODER = {**_ENCODER, "num_key_value_heads": 1}
TINY = {
    "bert": _ENCODER, "roberta": _ENCODER, "electra": {**_ENCODER, "embedding_size": 16},
    "albert": {**_ENCODER, "embedding_size": 16},
    "distilbert": {"n_layers": 1, "dim": 16, "n_heads": 2, "hidden_dim": 32, "vocab_size": 64},
    "gpt2": {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 64},
    "llama": _DECODER, "mistral": _DECODER, "qwen2": _DECODER,
    "opt": {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "ffn_dim": 32, "vocab_size": 64,
            "word_embed_proj_dim": 16},
    # one layer: fewer than the default 24, and odd, so the global/local attention pattern must follow
    "gpt_neo": {"num_layers": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32, "vocab_size": 64},
}


def tiny(name: str, **kw) -> WorkloadSpec:
    config = {**TINY[split_hf_name(name)[0]], **kw.pop("config", {})}
    kw = {"batch_size": 2, "seq_len": 16, "optimizer": "sgd", **kw}
    return WorkloadSpec(name, config=tuple((k, json.dumps(v)) for k, v in config.items()), **kw)


def test_listed_transformers_names_are_exactly_those_with_a_head():
    names = list_models()["transformers"]
    assert set(HF_DEFAULT_TASK) <= set(names) <= {*HF_DEFAULT_TASK, *(f"{t}-{k}" for t in HF_DEFAULT_TASK
                                                                      for k in ("mlm", "clm", "cls"))}
    assert "distilbert-clm" not in names and "albert-clm" not in names
    assert {"bert-cls", "gpt2-cls", "roberta-clm"} <= set(names)


@pytest.mark.parametrize("name", list_models()["transformers"])
def test_every_listed_transformers_name_builds_and_profiles(name):
    spec = tiny(name)
    profile = profile_workload(spec, "cpu", warmup=0)
    assert profile.activations and any(a.recomputable for a in profile.activations)
    estimate = meta_estimate(spec)  # None where the head reads token values (gpt2-cls looks for padding)
    assert estimate is not None or name not in HF_DEFAULT_TASK
    assert estimate is None or 0 < estimate.total <= profile.peak_bytes


def test_the_estimate_stays_a_lower_bound_under_bf16_autocast():
    """Autocast does nothing on ``meta``; the estimate counts floats at bf16's size instead of fp32's."""
    spec = tiny("gpt2", precision="bf16", batch_size=4, seq_len=32)
    fp32 = meta_estimate(tiny("gpt2", batch_size=4, seq_len=32))
    estimate = meta_estimate(spec)
    assert estimate.activations < fp32.activations
    assert estimate.total <= profile_workload(spec, "cpu", warmup=0).peak_bytes


@pytest.mark.parametrize("model_type", list(HF_DEFAULT_TASK))
def test_every_listed_type_takes_a_batch_at_its_default_seq_len(model_type):
    """Tiny widths, but the type's own position limit and the default --seq-len 512 (RoBERTa's offset included)."""
    spec = tiny(model_type, batch_size=1, seq_len=WorkloadSpec.seq_len)  # the CLI's default
    workload = build_workload(spec)
    with torch.no_grad():
        loss = workload.loss_fn(workload.model, workload.batch)
    assert torch.isfinite(loss)


def test_roberta_uses_every_position_it_has():
    """RoBERTa numbers positions from padding_idx + 1: 18 embeddings take 16 tokens, not 17 (CLI test)."""
    workload = build_workload(tiny("roberta", seq_len=16, config={"max_position_embeddings": 18}))
    with torch.no_grad():
        assert torch.isfinite(workload.loss_fn(workload.model, workload.batch))


def test_every_listed_torchvision_model_builds_and_runs_its_forward_pass_on_meta():
    """All of them, at the default image size, on ``meta`` (shapes only: seconds, not the minutes a real profile
    of 80 models takes on the CPU). regnet computes its widths from tensor values, so it cannot build there; its
    real build is counted instead (and it profiles like any CNN)."""
    failed = [name for name in list_models()["torchvision"]
              if meta_estimate(WorkloadSpec(name, 2)) is None and not name.startswith("regnet")]
    assert not failed


@pytest.mark.parametrize(("name", "image_size"), [("googlenet", 32), ("inception_v3", 75)])
def test_models_with_auxiliary_heads_train_on_their_main_logits(name, image_size):
    workload = build_workload(WorkloadSpec(name, 2, image_size=image_size))
    loss = workload.loss_fn(workload.model, workload.batch)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in workload.model.parameters())


def test_a_workload_that_cannot_fit_is_refused_with_the_numbers(monkeypatch):
    spec = tiny("gpt2", batch_size=64)
    need = meta_estimate(spec).total
    monkeypatch.setattr(workload_memory, "available_bytes", lambda dev: (need // 2, "available RAM"))
    with pytest.raises(OutOfMemoryError, match=r"needs at least .* \(parameters .*saved activations.*"
                                               r"--batch-size \d+ might fit") as info:
        require_fits(spec, torch.device("cpu"), meta_estimate(spec))
    fits = int(info.value.args[0].split("--batch-size ")[1].split()[0])
    assert 1 <= fits < 64 and meta_estimate(tiny("gpt2", batch_size=fits)).total <= need // 2
    monkeypatch.setattr(workload_memory, "available_bytes", lambda dev: (need, "available RAM"))
    require_fits(spec, torch.device("cpu"), meta_estimate(spec))  # exactly enough: accepted
