"""Benchmark configuration names (``eager``, ``captured``, ``rewritten@60%``, ``per-block``, ``compile@0.5``).

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
