"""Benchmark configuration names (``eager``, ``captured``, ``rewritten@60%``, ``per-block``, ``compile@0.5``).

``rewritten@per-block`` (or ``rewritten@compile@0.5``) plans for the measured peak of that other configuration
at the same batch size in the same run: the side-by-side comparison "fit where it fits, and be faster".

Each configuration is compared against the one a user would otherwise run: per-block checkpointing,
the captured graph and ``torch.compile`` against eager; a rewritten graph against the captured graph it
came from; ``torch.compile`` with a memory budget against ``torch.compile`` without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from acstudio.errors import ACStudioError

KINDS = ("eager", "captured", "rewritten", "per-block", "compile")


@dataclass(frozen=True)
class BenchConfig:
    """``kind`` plus its argument: the plan budget for ``rewritten``, the activation memory ratio for ``compile``."""

    kind: str
    arg: str | None = None

    @property
    def name(self) -> str:
        return self.kind if self.arg is None else f"{self.kind}@{self.arg}"

    @property
    def baseline(self) -> str | None:
        """Name of the configuration this one's time overhead is measured against."""
        if self.kind == "eager":
            return None
        if self.kind == "rewritten":
            return "captured"
        if self.kind == "compile" and self.arg is not None:
            return "compile"
        return "eager"

    @property
    def budget_reference(self) -> BenchConfig | None:
        """For ``rewritten@per-block`` and the like: the configuration whose measured peak is the budget."""
        if self.kind != "rewritten" or self.arg is None or self.arg.partition("@")[0] not in KINDS:
            return None
        return BenchConfig.parse(self.arg)

    @property
    def memory_ratio(self) -> float | None:
        return float(self.arg) if self.kind == "compile" and self.arg is not None else None

    @classmethod
    def parse(cls, text: str) -> BenchConfig:
        kind, at, arg = text.strip().partition("@")
        if kind not in KINDS:
            raise ACStudioError(f"unknown benchmark configuration {text!r}; choose from {', '.join(KINDS)} "
                                "(rewritten@BUDGET, compile@RATIO)")
        if not at:
            return cls(kind)
        if not arg:
            raise ACStudioError(f"{text!r}: nothing after '@'")
        if kind == "compile":
            try:
                ratio = float(arg)
            except ValueError:
                ratio = -1.0
            if not 0.0 < ratio <= 1.0:
                raise ACStudioError(f"{text!r}: compile@R needs an activation memory ratio 0 < R <= 1, "
                                    "e.g. compile@0.5")
            return cls(kind, arg)
        if kind == "rewritten":
            if arg.partition("@")[0] in KINDS:
                if BenchConfig.parse(arg).kind == "rewritten":
                    raise ACStudioError(f"{text!r}: a rewritten step's budget cannot be another rewritten step's "
                                        "peak")
            else:  # a typo fails here, not after a worker has profiled the model
                from acstudio.plan.budget import parse_budget

                parse_budget(arg, 2**40)  # any baseline: only the syntax is checked
            return cls(kind, arg)
        raise ACStudioError(f"{text!r}: only rewritten and compile take an '@' argument")


def expand_configs(configs: list[str], budgets: list[str]) -> list[BenchConfig]:
    """Parse names; a bare ``rewritten`` stands for one ``rewritten@B`` per budget B. Order kept, duplicates dropped."""
    out: list[BenchConfig] = []
    for text in configs:
        config = BenchConfig.parse(text)
        if config.kind == "rewritten" and config.arg is None:
            if not budgets:
                raise ACStudioError("the rewritten configuration needs at least one budget (e.g. --budgets 60%,8GiB)")
            expanded = [BenchConfig("rewritten", b.strip()) for b in budgets]
        else:
            expanded = [config]
        for c in expanded:
            if c not in out:
                out.append(c)
    if not out:
        raise ACStudioError("no benchmark configuration given")
    return out
