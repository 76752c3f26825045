"""The model list keeps its promises: every transformers name `acstudio models` lists builds, takes a batch at its
defaults and profiles on the CPU, and every torchvision module builds and computes its loss; the memory estimate
made before allocating is a lower bound of the measured peak."""

import json

import pytest
import torch

from acstudio.errors import CaptureError, OutOfMemoryError
from acstudio.profiler import profile_workload
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
    try:
        profile = profile_workload(spec, "cpu", warmup=0)
    except CaptureError as e:
        # transformers 5.17 (the H200 image's) draws OPT's layerdrop on every training step, layerdrop 0 or not:
        # a branch on a random value, which no graph captures; 5.24 draws it only where layerdrop is set
        if name.startswith("opt") and "layerdrop" in str(e):
            pytest.skip(f"this transformers' OPT branches on a random value in training: {e}")
        raise
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


# One torchvision model per builder module and block type (building all 80 costs minutes of CI on 2 cores; the
# variants of a module differ in depth and width only). regnet computes its widths from tensor values, so it
# cannot build on ``meta``; its real build is counted instead.
TORCHVISION_SAMPLES = {
    "alexnet": ["alexnet"], "convnext": ["convnext_tiny"], "densenet": ["densenet121"],
    "efficientnet": ["efficientnet_b0", "efficientnet_v2_s"], "googlenet": ["googlenet"],
    "inception": ["inception_v3"], "maxvit": ["maxvit_t"], "mnasnet": ["mnasnet0_5"],
    "mobilenetv2": ["mobilenet_v2"], "mobilenetv3": ["mobilenet_v3_small"], "regnet": [],
    "resnet": ["resnet18", "resnet50", "wide_resnet50_2"], "shufflenetv2": ["shufflenet_v2_x0_5"],
    "squeezenet": ["squeezenet1_1"], "swin_transformer": ["swin_t", "swin_v2_t"], "vgg": ["vgg11_bn"],
    "vision_transformer": ["vit_b_32"],
}


def test_the_torchvision_samples_cover_every_listed_module():
    import torchvision

    listed = list_models()["torchvision"]
    modules = {torchvision.models.get_model_builder(n).__module__.rsplit(".", 1)[-1] for n in listed}
    assert modules == set(TORCHVISION_SAMPLES)
    assert {n for names in TORCHVISION_SAMPLES.values() for n in names} <= set(listed)


@pytest.mark.parametrize("name", [n for names in TORCHVISION_SAMPLES.values() for n in names])
def test_torchvision_models_build_and_compute_their_loss_at_the_default_image_size(name):
    """On ``meta``: shapes only, so the default 224² costs nothing; googlenet and inception_v3 train their main
    logits (their auxiliary heads would return a tuple)."""
    assert meta_estimate(WorkloadSpec(name, 2)) is not None


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
