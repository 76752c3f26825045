"""Models by name: torchvision classifiers and Hugging Face architectures built offline from their config.

Names: a torchvision classification model (``resnet152``, ``vit_b_16``, ...) or a transformers model type
(``bert``, ``gpt2``, ``llama``, ...), optionally with a task suffix: ``-mlm`` (masked LM), ``-clm``
(causal LM) or ``-cls`` (sequence classification). No weights are downloaded: random init from the config.
"""

from __future__ import annotations

import difflib
import json
from functools import cache

import torch
import torch.nn.functional as F

from acstudio.errors import ACStudioError, UnknownModelError
from acstudio.workload.spec import Workload, WorkloadSpec

TASKS = {"mlm": "masked LM", "clm": "causal LM", "cls": "sequence classification"}
# The model types we offer, with the task a bare name means. Every one builds from its default config.
HF_DEFAULT_TASK = {
    "bert": "mlm", "roberta": "mlm", "distilbert": "mlm", "albert": "mlm", "electra": "mlm",
    "gpt2": "clm", "llama": "clm", "mistral": "clm", "qwen2": "clm", "opt": "clm", "gpt_neo": "clm",
}
CAUSAL_ONLY = {"gpt2", "llama", "mistral", "qwen2", "opt", "gpt_neo"}


@cache
def torchvision_models() -> tuple[str, ...]:
    import torchvision

    return tuple(sorted(torchvision.models.list_models(module=torchvision.models)))


def hf_names() -> list[str]:
    names = []
    for model_type, default in HF_DEFAULT_TASK.items():
        names.append(model_type)
        for task in TASKS:
            if task == "mlm" and model_type in CAUSAL_ONLY:
                continue
            if task != default:
                names.append(f"{model_type}-{task}")
    return names


def list_models() -> dict[str, list[str]]:
    return {"torchvision": list(torchvision_models()), "transformers": hf_names()}


def split_hf_name(name: str) -> tuple[str, str] | None:
    base, _, task = name.partition("-")
    if base not in HF_DEFAULT_TASK:
        return None
    task = task or HF_DEFAULT_TASK[base]
    if task not in TASKS or (task == "mlm" and base in CAUSAL_ONLY):
        return None
    return base, task


def parse_value(text: str):
    """``--config`` values: JSON literals (ints, floats, true/false, null, lists) or plain strings."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build(spec: WorkloadSpec) -> Workload:
    name = spec.model
    hf = split_hf_name(name)  # checked first: listing torchvision's models imports it (seconds)
    if hf is not None:
        return build_transformers(spec, *hf)
    if name in torchvision_models():
        return build_torchvision(spec)
    close = difflib.get_close_matches(name, list(torchvision_models()) + hf_names(), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; `acstudio models` lists what can be loaded"
    raise UnknownModelError(f"unknown model {name!r}{hint}")


def build_torchvision(spec: WorkloadSpec) -> Workload:
    import torchvision

    kwargs = {k: parse_value(v) for k, v in spec.config}
    if spec.model.startswith("vit_"):
        kwargs.setdefault("image_size", spec.image_size)
    try:
        model = torchvision.models.get_model(spec.model, weights=None, **kwargs)
    except TypeError as exc:
        raise ACStudioError(f"{spec.model}: bad --config override: {exc}") from exc
    num_classes = kwargs.get("num_classes", 1000)
    images = torch.randn(spec.batch_size, 3, spec.image_size, spec.image_size)
    labels = torch.randint(0, num_classes, (spec.batch_size,))
    return Workload(spec=spec, model=model, batch=(images, labels), loss_fn=classification_loss,
                    family="torchvision")


def classification_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def transformers_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    return model(**batch).loss


def build_transformers(spec: WorkloadSpec, model_type: str, task: str) -> Workload:
    import transformers

    overrides = {k: parse_value(v) for k, v in spec.config}
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    except (ValueError, TypeError) as exc:
        raise ACStudioError(f"{spec.model}: cannot build its config: {exc}") from exc
    if getattr(config, "use_cache", False) and "use_cache" not in overrides:
        config.use_cache = False  # training keeps no KV cache (a checkpointed block must not update one)
    if getattr(config, "pad_token_id", None) is None and task == "cls":
        config.pad_token_id = 0
    auto = {
        "mlm": transformers.AutoModelForMaskedLM,
        "clm": transformers.AutoModelForCausalLM,
        "cls": transformers.AutoModelForSequenceClassification,
    }[task]
    # The default attention implementation (SDPA), as users (and the peers we compare with) run it: its fused
    # kernels trace to single aten ops whose saved outputs the profile sees like any other.
    model = auto.from_config(config)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and spec.seq_len > limit:
        raise ACStudioError(f"{spec.model}: --seq-len {spec.seq_len} exceeds the model's {limit} positions")
    batch = make_text_batch(spec.batch_size, spec.seq_len, config.vocab_size, task,
                            getattr(config, "num_labels", 2))
    return Workload(spec=spec, model=model, batch=batch, loss_fn=transformers_loss, family="transformers")


def make_text_batch(batch_size: int, seq_len: int, vocab_size: int, task: str, num_labels: int) -> dict:
    """Random tokens with an attention mask that pads the tail of every other sequence, like a real loader."""
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    attention_mask[1::2, seq_len - seq_len // 8:] = 0
    if task == "mlm":
        labels = torch.full_like(input_ids, -100)
        masked = torch.rand(batch_size, seq_len) < 0.15
        masked[:, 0] = True  # at least one target per sequence, even for tiny test sequences
        labels[masked] = input_ids[masked]
    elif task == "clm":
        labels = input_ids.clone()
        labels[attention_mask == 0] = -100
    else:
        labels = torch.randint(0, num_labels, (batch_size,))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
