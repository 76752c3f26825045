"""Models by name: torchvision classifiers and Hugging Face architectures built offline from their config.

Names: a torchvision classification model (``resnet152``, ``vit_b_16``, ...) or a transformers model type
(``bert``, ``gpt2``, ``llama``, ...), optionally with a task suffix: ``-mlm`` (masked LM), ``-clm``
(causal LM) or ``-cls`` (sequence classification). No weights are downloaded: random init from the config.
"""

from __future__ import annotations

import difflib
import inspect
import json
import typing
from functools import cache

import torch
import torch.nn.functional as F

from acstudio.errors import ConfigError, UnknownModelError
from acstudio.workload.spec import Workload, WorkloadSpec

TASKS = {"mlm": "masked LM", "clm": "causal LM", "cls": "sequence classification"}
# transformers' auto class for each task; a name is offered only where transformers has that head for the type.
AUTO_CLASSES = {"mlm": "AutoModelForMaskedLM", "clm": "AutoModelForCausalLM",
                "cls": "AutoModelForSequenceClassification"}
# The model types we offer, with the task a bare name means. Every one builds from its default config.
HF_DEFAULT_TASK = {
    "bert": "mlm", "roberta": "mlm", "distilbert": "mlm", "albert": "mlm", "electra": "mlm",
    "gpt2": "clm", "llama": "clm", "mistral": "clm", "qwen2": "clm", "opt": "clm", "gpt_neo": "clm",
}
# Where a type's bare config differs from the checkpoints people train: RoBERTa's positions start after its
# padding index, so roberta-base has 514 position embeddings for 512 tokens (the bare config has 512).
HF_CONFIG_DEFAULTS = {"roberta": {"max_position_embeddings": 514}}
# torchvision models whose training-mode output is not plain logits: train their main head only.
TORCHVISION_DEFAULTS = {"googlenet": {"aux_logits": False}, "inception_v3": {"aux_logits": False}}


@cache
def torchvision_models() -> tuple[str, ...]:
    import torchvision

    return tuple(sorted(torchvision.models.list_models(module=torchvision.models)))


@cache
def hf_tasks(model_type: str) -> tuple[str, ...]:
    """The tasks transformers has a head for, for ``model_type`` (its default task first)."""
    from transformers.models.auto import modeling_auto

    mappings = {"mlm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                "clm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                "cls": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES}
    default = HF_DEFAULT_TASK[model_type]
    return (default, *(t for t in TASKS if t != default and model_type in mappings[t]))


def hf_names() -> list[str]:
    return [model_type if task == default else f"{model_type}-{task}"
            for model_type, default in HF_DEFAULT_TASK.items() for task in hf_tasks(model_type)]


def list_models() -> dict[str, list[str]]:
    return {"torchvision": list(torchvision_models()), "transformers": hf_names()}


def split_hf_name(name: str) -> tuple[str, str] | None:
    base, _, task = name.partition("-")
    if base not in HF_DEFAULT_TASK:
        return None
    task = task or HF_DEFAULT_TASK[base]
    return (base, task) if task in hf_tasks(base) else None


def parse_value(text: str):
    """``--config`` values: JSON literals (ints, floats, true/false, null, lists) or plain strings."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def check_keys(model: str, given, known, where: str) -> None:
    """Refuse a ``--config`` key the model does not have: a typo must not silently give the full-size model."""
    for key in given:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"{model}: unknown --config key {key!r}{hint} — the keys are the fields of {where}")


def check_name(name: str) -> None:
    """Refuse a name that is no zoo model, building nothing."""
    if split_hf_name(name) is not None or name in torchvision_models():  # Hugging Face first: listing
        return  # torchvision's models imports it (seconds)
    close = difflib.get_close_matches(name, list(torchvision_models()) + hf_names(), n=3, cutoff=0.6)
    hint = f" — did you mean {', '.join(close)}?" if close else " — `acstudio models` lists what can be loaded"
    raise UnknownModelError(f"unknown model {name!r}{hint}")


def build(spec: WorkloadSpec) -> Workload:
    hf = split_hf_name(spec.model)
    if hf is not None:
        return build_transformers(spec, *hf)
    check_name(spec.model)
    return build_torchvision(spec)


def torchvision_keys(name: str) -> set[str] | None:
    """The keyword arguments of the model class a torchvision builder returns (None if it is not annotated)."""
    import torchvision

    try:
        cls = typing.get_type_hints(torchvision.models.get_model_builder(name)).get("return")
    except (NameError, TypeError):
        return None
    return set(inspect.signature(cls.__init__).parameters) - {"self"} if isinstance(cls, type) else None


def build_torchvision(spec: WorkloadSpec) -> Workload:
    import torchvision

    kwargs = {k: parse_value(v) for k, v in spec.config}
    known = torchvision_keys(spec.model)
    if known is not None:
        check_keys(spec.model, kwargs, known, f"its torchvision class ({', '.join(sorted(known))})")
    kwargs = {**TORCHVISION_DEFAULTS.get(spec.model, {}), **kwargs}
    if spec.model.startswith("vit_"):
        kwargs.setdefault("image_size", spec.image_size)
    try:
        model = torchvision.models.get_model(spec.model, weights=None, **kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ConfigError(f"{spec.model}: cannot build it with --config {kwargs}: {exc} — change the "
                          "--config values") from exc
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

    config = transformers_config(spec, model_type)
    if getattr(config, "use_cache", False) and "use_cache" not in dict(spec.config):
        config.use_cache = False  # training keeps no KV cache (a checkpointed block must not update one)
    if getattr(config, "pad_token_id", None) is None and task == "cls":
        config.pad_token_id = 0
    auto = getattr(transformers, AUTO_CLASSES[task])
    # The default attention implementation (SDPA), as users (and the peers we compare with) run it: its fused
    # kernels trace to single aten ops whose saved outputs the profile sees like any other.
    model = auto.from_config(config)
    batch = make_text_batch(spec.batch_size, spec.seq_len, config.vocab_size, task,
                            getattr(config, "num_labels", 2))
    return Workload(spec=spec, model=model, batch=batch, loss_fn=transformers_loss, family="transformers")


def transformers_config(spec: WorkloadSpec, model_type: str):
    """The model's config with the user's overrides, checked so that the model builds and the batch fits it."""
    import transformers

    overrides = {k: parse_value(v) for k, v in spec.config}
    bare = transformers.AutoConfig.for_model(model_type)
    known = set(bare.to_dict()) | set(bare.attribute_map) | set(inspect.signature(type(bare).__init__).parameters)
    check_keys(spec.model, overrides, known - {"self", "kwargs"}, f"transformers' {type(bare).__name__}")
    overrides = {**HF_CONFIG_DEFAULTS.get(model_type, {}), **overrides}
    if model_type == "gpt_neo" and "attention_types" not in overrides:
        overrides["attention_types"] = gpt_neo_attention(overrides.get("num_layers", bare.num_layers))
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{spec.model}: cannot build its config: {exc} — change the --config values") from exc
    check_config(spec, config, overrides)
    return config


def gpt_neo_attention(num_layers: int) -> list:
    """GPT-Neo's alternating global/local attention for ``num_layers`` layers (its config lists one per layer)."""
    pattern = [[["global", "local"], num_layers // 2]]
    return [*pattern, [["global"], 1]] if num_layers % 2 else pattern


def check_config(spec: WorkloadSpec, config, overrides: dict) -> None:
    """The shape rules a config must meet, each refused in one line that names the key to change."""
    def key(attr: str) -> str:  # the name the user types: gpt2 calls hidden_size n_embd
        return config.attribute_map.get(attr, attr)

    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if hidden and heads and "head_dim" not in overrides and hidden % heads:
        fits = max(h for h in range(1, heads + 1) if hidden % h == 0)
        raise ConfigError(f"{spec.model}: {key('hidden_size')}={hidden} is not divisible by "
                          f"{key('num_attention_heads')}={heads} — use heads that divide the hidden size, "
                          f"e.g. --config {key('num_attention_heads')}={fits}")
    kv_heads = getattr(config, "num_key_value_heads", None)
    if heads and kv_heads and heads % kv_heads:
        raise ConfigError(f"{spec.model}: num_key_value_heads={kv_heads} does not divide "
                          f"{key('num_attention_heads')}={heads} — set --config num_key_value_heads to a divisor "
                          f"of {heads}, e.g. num_key_value_heads={heads}")
    limit = getattr(config, "max_position_embeddings", None)
    # RoBERTa numbers positions from padding_idx + 1, so two of its position embeddings are never used.
    offset = config.pad_token_id + 1 if config.model_type == "roberta" else 0
    if limit is not None and spec.seq_len > limit - offset:
        why = f" ({key('max_position_embeddings')}={limit} less {offset}: RoBERTa's padding offset)" if offset else ""
        raise ConfigError(f"{spec.model}: --seq-len {spec.seq_len} exceeds the model's {limit - offset} "
                          f"positions{why} — use --seq-len {limit - offset} or less, or --config "
                          f"{key('max_position_embeddings')}={spec.seq_len + offset}")


def make_text_batch(batch_size: int, seq_len: int, vocab_size: int, task: str, num_labels: int) -> dict:
    """Random tokens with an attention mask that pads the tail of every other sequence, like a real loader."""
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    attention_mask[1::2, seq_len - seq_len // 8:] = 0
    if task == "mlm":
        masked = torch.rand(batch_size, seq_len) < 0.15
        masked[:, 0] = True  # at least one target per sequence, even for tiny test sequences
        labels = torch.where(masked, input_ids, -100)  # no boolean indexing: the batch also builds on "meta"
    elif task == "clm":
        labels = input_ids.clone()
        labels[attention_mask == 0] = -100
    else:
        labels = torch.randint(0, num_labels, (batch_size,))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
