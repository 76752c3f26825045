"""Benchmark configuration names, registered in one place (:data:`KINDS`).

A name is ``[PARALLEL+]KIND[@ARG]``:

* ``KIND``: ``eager``, ``captured``, ``rewritten@B``, ``per-block`` (every block under non-reentrant
  ``torch.utils.checkpoint``; Hugging Face's ``gradient_checkpointing_enable``), ``per-op`` (torchtitan's
  op-level selective checkpointing per block), ``compile``, ``compile@R`` (``activation_memory_budget=R``),
  ``compile+per-block``, ``compile+per-op``, ``compile+per-op+regions`` (compile+per-op as an offloading
  compiled plan runs: its blocks compiled one by one), ``sac@B`` and ``sac+compile@B`` (our plan at budget B, exported
  as selective-checkpoint policies and applied with :func:`acstudio.apply_plan`, eager or compiled),
  ``per-block+offload`` and ``offload`` (the offload peers: saved tensors on the host);
* ``PARALLEL``: ``fsdp`` (FSDP2, ``fully_shard`` per block and on the root) or ``ddp``, run under
  ``torchrun`` (``acstudio bench --nproc N``); ``fsdp`` alone is FSDP2 without checkpointing;
* ``B``: a budget (``6GiB``, ``60%``) or another configuration, whose measured peak in the same run is the
  budget: ``rewritten@per-block``, ``sac+compile@compile+per-block``, ``fsdp+sac@fsdp+per-block`` (the largest
  rank's peak), optionally scaled: ``rewritten@per-block*1.15``.

Each configuration is compared against the one a user would otherwise run (:attr:`BenchConfig.baseline`):
checkpointing and compile against eager, a rewritten graph against the captured graph it came from, a compiled
checkpointing or budgeted compile against plain compile, and under ``fsdp``/``ddp`` against the same
parallelism without checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass

from acstudio.errors import ACStudioError


@dataclass(frozen=True)
class Kind:
    """One configuration kind: what it runs (``builder``, a function of :mod:`acstudio.bench.steps`), what its
    ``@`` argument means (``"budget"``, ``"ratio"`` or ``None``) and what its time is compared against.

    ``planner`` (a function of :mod:`acstudio.bench.steps`) profiles (and for ``sac``, plans and exports) in a
    process of its own before the measuring one, which then only loads the result, as a user's training process
    loads an export: the process that had captured and profiled the model ran the compiled step measurably slower
    than one that only loaded the plan (``results/bench/resnet152/bs64_plan_in_process_check.txt``)."""

    name: str
    summary: str
    builder: str
    baseline: str | None
    arg: str | None = None
    arg_required: bool = False
    parallel_ok: bool = True
    compiled: bool = False
    planner: str | None = None


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("eager", "no activation checkpointing", "prepare_eager", None),
    Kind("captured", "the captured whole-step graph, unmodified", "prepare_captured", "eager", parallel_ok=False),
    Kind("rewritten", "the captured graph rewritten by the plan at budget B", "prepare_rewritten", "captured",
         arg="budget", parallel_ok=False, planner="profile_once"),
    Kind("per-block", "every block under non-reentrant torch.utils.checkpoint (HF gradient checkpointing)",
         "prepare_per_block", "eager"),
    Kind("per-op", "torchtitan's op-level selective checkpointing of every block", "prepare_per_op", "eager"),
    Kind("compile", "torch.compile of the model (activation_memory_budget=R with @R)", "prepare_compile", "compile",
         arg="ratio", compiled=True),
    Kind("compile+per-block", "torch.compile of the per-block checkpointed model", "prepare_per_block", "compile",
         compiled=True),
    Kind("compile+per-op", "torch.compile of the op-level selective checkpointed model", "prepare_per_op",
         "compile", compiled=True),
    Kind("compile+per-op+regions", "compile+per-op with its first block compiled on its own inside offload hooks "
         "that copy nothing: the form an offloading compiled plan runs in (the loop over the blocks eager, each "
         "block compiled alone), which calibrates sac+compile's price of it", "prepare_per_op_regions", "compile",
         parallel_ok=False, compiled=True),
    Kind("sac", "the plan at budget B applied as selective checkpointing (acstudio.apply_plan)", "prepare_sac",
         "eager", arg="budget", arg_required=True, planner="export_sac_plan"),
    Kind("sac+compile", "the SAC-applied plan at budget B, under torch.compile", "prepare_sac", "compile",
         arg="budget", arg_required=True, compiled=True, planner="export_sac_plan"),
    Kind("per-block+offload", "per-block with the checkpoint inputs saved on the host "
         "(torch.autograd.graph.save_on_cpu(pin_memory=True) around the checkpointed model)",
         "prepare_per_block_offload", "eager", parallel_ok=False),
    Kind("offload", "every tensor autograd saves in forward kept on the host (saved_tensors_hooks, copies on a "
         "side stream; torchtune's and TransformerEngine's practice)", "prepare_offload", "eager", parallel_ok=False),
)}
# How the model is spread over several processes (``acstudio bench --nproc N``).
PARALLELS = {"fsdp": "FSDP2: fully_shard per block and on the root", "ddp": "DistributedDataParallel"}


@dataclass(frozen=True)
class BudgetReference:
    """``B`` naming another configuration: plan for ``factor`` times that configuration's measured peak."""

    config: BenchConfig
    factor: float = 1.0


@dataclass(frozen=True)
class BenchConfig:
    """A kind of :data:`KINDS` with its argument and, for several processes, its parallelism."""

    kind: str
    arg: str | None = None
    parallel: str | None = None

    @property
    def name(self) -> str:
        base = self.kind if self.arg is None else f"{self.kind}@{self.arg}"
        if self.parallel is None:
            return base
        return self.parallel if base == "eager" else f"{self.parallel}+{base}"

    @property
    def spec(self) -> Kind:
        return KINDS[self.kind]

    @property
    def baseline(self) -> str | None:
        """Name of the configuration this one's time overhead is measured against."""
        if self.parallel is not None:
            return None if self.kind == "eager" else self.parallel
        if self.kind == "compile" and self.arg is None:  # compile@R is compared with plain compile
            return "eager"
        return self.spec.baseline

    @property
    def budget_reference(self) -> BudgetReference | None:
        """For ``rewritten@per-block*1.15`` and the like: the configuration whose measured peak sets the budget."""
        if self.spec.arg != "budget" or self.arg is None:
            return None
        return _reference(self.arg)

    @property
    def memory_ratio(self) -> float | None:
        return float(self.arg) if self.spec.arg == "ratio" and self.arg is not None else None

    @classmethod
    def parse(cls, text: str) -> BenchConfig:
        text = text.strip()
        parallel = None
        head, plus, rest = text.partition("+")
        if plus and head in PARALLELS:
            parallel, text = head, rest
        elif text in PARALLELS:
            parallel, text = text, "eager"
        name, at, arg = text.partition("@")
        if name not in KINDS:
            raise ACStudioError(f"unknown benchmark configuration {text!r}; choose from {', '.join(KINDS)}, "
                                f"optionally after {'+ or '.join(PARALLELS)}+ (rewritten@BUDGET, sac@BUDGET, "
                                "compile@RATIO)")
        kind = KINDS[name]
        if parallel is not None and not kind.parallel_ok:
            raise ACStudioError(f"{parallel}+{text}: {name} runs our own single-device graph; under {parallel} "
                                f"use {parallel}+sac@BUDGET")
        if not at:
            if kind.arg_required:
                raise ACStudioError(f"{text!r} needs a budget, e.g. {name}@per-block or {name}@60%")
            return cls(name, None, parallel)
        if not arg:
            raise ACStudioError(f"{text!r}: nothing after '@'")
        if kind.arg == "ratio":
            try:
                ratio = float(arg)
            except ValueError:
                ratio = -1.0
            if not 0.0 < ratio <= 1.0:
                raise ACStudioError(f"{text!r}: {name}@R needs an activation memory ratio 0 < R <= 1, "
                                    f"e.g. {name}@0.5")
            return cls(name, arg, parallel)
        if kind.arg == "budget":
            ref = _reference(arg)
            if ref is None:  # a typo fails here, not after a worker has profiled the model
                from acstudio.units import parse_budget

                parse_budget(arg, 2**40)  # any baseline: only the syntax is checked
            elif ref.config.spec.arg == "budget":
                raise ACStudioError(f"{text!r}: a budget cannot be the peak of another planned configuration "
                                    f"({ref.config.name})")
            elif ref.config.parallel != parallel:
                raise ACStudioError(f"{text!r}: the budget must come from a configuration with the same "
                                    f"parallelism ({ref.config.name} runs {ref.config.parallel or 'one device'})")
            return cls(name, arg, parallel)
        raise ACStudioError(f"{text!r}: only {', '.join(k for k in KINDS if KINDS[k].arg)} take an '@' argument")


def _reference(arg: str) -> BudgetReference | None:
    """``per-block``, ``compile@0.5`` or ``per-block*1.15`` as a reference; ``None`` for a plain budget."""
    base, star, factor_text = arg.rpartition("*") if "*" in arg else (arg, "", "")
    head = base.partition("+")[0].partition("@")[0]
    if head not in KINDS and head not in PARALLELS:
        return None
    factor = 1.0
    if star:
        try:
            factor = float(factor_text)
        except ValueError:
            factor = -1.0
        if not 0.0 < factor < float("inf"):
            raise ACStudioError(f"{arg!r}: the factor after '*' must be a positive number — e.g. per-block*1.15")
    return BudgetReference(BenchConfig.parse(base), factor)


def expand_configs(configs: list[str], budgets: list[str]) -> list[BenchConfig]:
    """Parse names; a bare ``rewritten`` stands for one ``rewritten@B`` per budget B. Order kept, duplicates dropped."""
    out: list[BenchConfig] = []
    for text in configs:
        config = BenchConfig.parse(text)
        if config.kind == "rewritten" and config.arg is None:
            if not budgets:
                raise ACStudioError("the rewritten configuration needs at least one budget (e.g. --budgets 60%,8GiB)")
            expanded = [BenchConfig.parse(f"rewritten@{b.strip()}") for b in budgets]  # each budget checked now
        else:
            expanded = [config]
        for c in expanded:
            if c not in out:
                out.append(c)
    if not out:
        raise ACStudioError("no benchmark configuration given")
    return out
