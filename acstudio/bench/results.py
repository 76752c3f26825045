"""Benchmark results: the measured rows, the max-batch searches, comparisons, and their JSON/CSV files.

Raw worker rows are what the JSON stores; every derived number (overhead against the configuration's own
baseline, memory saving against eager, loss parity against eager) is recomputed from them by :func:`compare`, so a
results file can be re-analysed or re-plotted without re-running anything. A row trains what its reference trains
when its per-step losses are the reference's: bitwise for uncompiled single-process rows on the CPU, else within
:data:`PARITY_TOLERANCE`; the table, the CSV and ``bench.json``'s ``loss_checks`` mark a row that diverges.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acstudio.bench.configs import BenchConfig
from acstudio.errors import ACStudioError
from acstudio.fileio import atomic_path, read_document, write_document, write_text

if TYPE_CHECKING:
    import pandas as pd

SCHEMA = "acstudio.bench"
SCHEMA_VERSION = 1
JSON_NAME = "bench.json"
CSV_NAME = "bench.csv"
SUMMARY_NAME = "summary.md"
MiB = 2**20

# Columns of the CSV, in this order; ``details.*`` columns (configuration-specific) follow.
CSV_COLUMNS = ("model", "batch_size", "config", "kind", "arg", "baseline", "parallel", "nproc", "phase", "device",
               "status", "message", "peak_bytes", "rank_peak_bytes", "peak_mib", "resident_bytes", "time_ms_median",
               "time_ms_q1", "time_ms_q3", "time_ms_iqr", "overhead_pct", "time_vs_eager_pct", "memory_saving_pct",
               "budget_mib", "predicted_peak_mib", "peak_error_pct", "fits_budget", "overhead_ms",
               "predicted_overhead_ms", "loss", "loss_parity", "loss_max_rel_diff", "warmup", "iters",
               "setup_s", "wall_s", "gpu", "torch", "cuda", "command")


def parse_size(text: str) -> int:
    """An absolute memory size such as ``16GiB``, ``8000MiB`` or ``12GB`` (the planner's budget syntax)."""
    from acstudio.units import parse_budget

    if str(text).strip().endswith("%"):
        raise ACStudioError(f"{text!r}: a memory budget for the batch-size search must be absolute, e.g. 16GiB")
    return parse_budget(text, 0)


def base_row(cfg: dict[str, Any]) -> dict[str, Any]:
    """The identifying fields of a result row, before (or without) any measurement."""
    config = BenchConfig.parse(cfg["config"])
    spec = cfg["spec"]
    return {
        "config": config.name, "kind": config.kind, "arg": config.arg, "baseline": config.baseline,
        "parallel": config.parallel, "nproc": int(cfg.get("nproc", 1)) if config.parallel else 1,
        "model": spec["model"], "batch_size": spec["batch_size"], "device": cfg["device"],
        "iters": int(cfg["iters"]), "status": "ok", "message": "", "command": cfg.get("command", ""),
        "spec": spec,
    }


def _pct(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return 100.0 * (value / base - 1.0)


def plain_compile(row: dict[str, Any]) -> str:
    """The compiled configuration without checkpointing that a compiled plan's predicted time is over."""
    return f"{row['parallel']}+compile" if row.get("parallel") else "compile"


def prediction_base(row: dict[str, Any]) -> str:
    """The configuration a plan's predicted extra time is over: plain compile for a compiled plan, the row's own
    baseline (the captured step, for a rewritten one) otherwise."""
    return plain_compile(row) if "compile" in row["kind"] else row.get("baseline") or ""


# Loss parity against the reference row at the same batch size: eager for an uncompiled row, plain compile for a
# compiled one (compiled dropout draws from inductor's generator, not eager's, so only another compiled row can
# reproduce its losses), each under the same parallelism (the plain fsdp/ddp row). Relative bounds on the first
# step's loss and on the later ones: every row starts from the same seeded weights and draws the same random
# stream, so the first loss differs only by kernel rounding: another algorithm, atomics or compiled fusions move an
# fp32 loss by far less than 1e-3 of itself, bf16 autocast's coarser rounding by less than 1e-2. Later losses also
# carry the updates that rounding made, which Adam amplifies, so they get a looser bound, still below what training
# something else does (an optimizer state that is not a fresh optimizer's moves the second loss by percents). Past
# the first few steps that amplification is chaotic (two peers computing the same step drift apart by more than any
# fixed bound), so a rounded comparison covers :data:`PARITY_STEPS` steps. On the CPU, uncompiled rows of one
# process run the same deterministic kernels as eager: bitwise, every step.
PARITY_TOLERANCE = {"fp32": (1e-3, 1e-2), "bf16": (1e-2, 5e-2)}  # (first step, later steps), relative
PARITY_STEPS = 4


def parity_reference(row: dict[str, Any]) -> str | None:
    """The configuration whose losses ``row`` must reproduce (None for the reference itself)."""
    parallel = row.get("parallel")
    if BenchConfig.parse(row["config"]).spec.compiled:
        reference = f"{parallel}+compile" if parallel else "compile"
    else:
        reference = parallel or "eager"
    return None if row["config"] == reference else reference


def parity_rule(row: dict[str, Any]) -> tuple[float, float] | None:
    """``None`` where the row must match bitwise, else its (first step, later steps) relative tolerance."""
    compiled = BenchConfig.parse(row["config"]).spec.compiled
    if row.get("device", "").startswith("cpu") and not compiled and not row.get("parallel"):
        return None
    return PARITY_TOLERANCE[(row.get("spec") or {}).get("precision", "fp32")]


def describe_rule(rule: tuple[float, float] | None) -> str:
    if rule is None:
        return "bitwise"
    return f"relative {rule[0]:g} on the first step, {rule[1]:g} on the next {PARITY_STEPS - 1}"


def loss_parity(row: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Whether ``row``'s per-step losses are ``reference``'s, step by step over the steps both ran (a compiled row
    warms up longer; :data:`PARITY_STEPS` at most where rounding is allowed), under :func:`parity_rule`."""
    mine, theirs = row.get("losses") or [], reference.get("losses") or []
    rule = parity_rule(row)
    steps = min(len(mine), len(theirs), PARITY_STEPS if rule is not None else len(mine))
    worst, diverged = 0.0, None
    for k in range(steps):
        a, b = float(mine[k]), float(theirs[k])
        rel = 0.0 if a == b else abs(a - b) / max(abs(b), 1e-12)
        worst = max(worst, rel)
        bound = 0.0 if rule is None else rule[k > 0]
        if diverged is None and (a != b if rule is None else not rel <= bound):
            diverged = {"step": k, "loss": a, "reference_loss": b}
    return {"reference": reference["config"], "steps": steps, "rule": describe_rule(rule),
            "passed": steps > 0 and diverged is None, "max_rel_diff": worst, "first_divergence": diverged}


def parity_text(check: dict[str, Any] | None) -> str:
    """``bitwise``, ``ok (rel 2e-05)`` or ``DIVERGES at step 2: 6.078 vs 5.793``; empty without a reference."""
    if not check:
        return ""
    if check["passed"]:
        return "bitwise" if check["max_rel_diff"] == 0.0 else f"ok (rel {check['max_rel_diff']:.1g})"
    if not check["steps"]:
        return "no losses to compare"
    d = check["first_divergence"]
    return f"DIVERGES at step {d['step'] + 1}: {d['loss']:.6g} vs {d['reference_loss']:.6g}"


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with ``overhead_pct`` (time against the configuration's own baseline at the same batch size),
    ``time_vs_eager_pct`` and ``memory_saving_pct`` (peak below eager's, in percent) added, and for rewritten
    steps the plan's budget and predicted peak beside the measured one, and ``loss_check`` (:func:`loss_parity`
    against :func:`parity_reference`); ``None`` where the row or its reference did not run successfully."""
    ok = {(r["batch_size"], r["config"]): r for r in rows if r.get("status") == "ok"}
    out = []
    for r in rows:
        r = dict(r)
        base = ok.get((r["batch_size"], r["baseline"])) if r.get("baseline") else None
        eager = ok.get((r["batch_size"], "eager")) if r["config"] != "eager" else None
        mine = r.get("time_ms_median") if r.get("status") == "ok" else None
        peak = r.get("peak_bytes") if r.get("status") == "ok" else None
        r["overhead_pct"] = _pct(mine, base["time_ms_median"]) if base else None
        r["time_vs_eager_pct"] = _pct(mine, eager["time_ms_median"]) if eager else None
        saving = _pct(peak, eager.get("peak_bytes")) if eager else None
        r["memory_saving_pct"] = None if saving is None else 0.0 - saving
        r["peak_mib"] = None if peak is None else peak / MiB
        plan = (r.get("details") or {}).get("plan") or {}
        # the budget the row must fit (the plan aimed slightly below it: steps.HEADROOM)
        budget = (r.get("details") or {}).get("budget_bytes", plan.get("budget_bytes"))
        predicted = plan.get("compiled_peak_bytes") or plan.get("predicted_peak_bytes")  # compiled: calibrated
        r["budget_mib"] = None if budget is None else budget / MiB
        r["predicted_peak_mib"] = None if predicted is None else predicted / MiB
        r["peak_error_pct"] = _pct(peak, predicted) if peak is not None and predicted else None
        r["fits_budget"] = None if peak is None or budget is None else peak <= budget
        r["offload_bytes"] = plan.get("offload_bytes") or None  # the plan's copies, each way
        # a SAC row's runtime counts what it copied per timed step (rows of older files: None)
        r["offload_bytes_measured"] = (r.get("details") or {}).get("offload_bytes_measured")
        r["offload_stall_ms"] = plan.get("offload_stall_ms") if r["offload_bytes"] else None
        # a plan's predicted time is over the step it changes: plain compile's for a compiled plan (priced at
        # calibrated compiled replay times), the captured step's for a rewritten one
        predicted_ms, over = plan.get("compiled_extra_ms"), prediction_base(r)
        if predicted_ms is None and r["kind"] == "rewritten":
            predicted_ms = plan.get("predicted_extra_ms")
        base_row = ok.get((r["batch_size"], over))
        r["predicted_overhead_ms"] = predicted_ms
        r["overhead_ms"] = mine - base_row["time_ms_median"] if predicted_ms is not None and base_row and mine else None
        reference = ok.get((r["batch_size"], parity_reference(r))) if r.get("status") == "ok" else None
        r["loss_check"] = loss_parity(r, reference) if reference else None
        r["loss_parity"] = parity_text(r["loss_check"]) or None
        r["loss_max_rel_diff"] = r["loss_check"]["max_rel_diff"] if reference else None
        out.append(r)
    return out


def flat_row(row: dict[str, Any]) -> dict[str, Any]:
    """One CSV line: the fixed columns, then configuration details flattened to ``details.a.b`` columns."""
    env = row.get("environment") or {}
    flat = {c: row.get(c, env.get(c)) for c in CSV_COLUMNS}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = json.dumps(value) if isinstance(value, (list, tuple)) else value

    walk("details", row.get("details") or {})
    return flat


@dataclass
class BenchResults:
    """What :func:`~acstudio.bench.runner.run_bench` measured. ``to_frame()`` gives one row per measurement."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    fits: list[dict[str, Any]] = field(default_factory=list)

    def compared(self) -> list[dict[str, Any]]:
        return compare(self.rows)

    def to_frame(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame([flat_row(r) for r in self.compared()])

    def loss_checks(self) -> list[dict[str, Any]]:
        """Every compared row's loss parity (:func:`loss_parity`), for readers of ``bench.json``."""
        return [{"config": r["config"], "batch_size": r["batch_size"], "phase": r.get("phase"), **r["loss_check"]}
                for r in self.compared() if r.get("loss_check")]

    def to_dict(self) -> dict[str, Any]:
        """The raw rows (what :meth:`load` reads back) and, derived from them, each row's loss parity."""
        return {"meta": self.meta, "rows": self.rows, "fits": self.fits, "loss_checks": self.loss_checks()}

    def save(self, out_dir: str | os.PathLike) -> tuple[Path, Path]:
        """Write ``bench.json`` (everything, re-loadable), ``bench.csv`` (flat table) and ``summary.md``."""
        out = Path(out_dir)
        write_document(out / JSON_NAME, SCHEMA, SCHEMA_VERSION, self.to_dict())
        with atomic_path(out / CSV_NAME) as tmp:
            self.to_frame().to_csv(tmp, index=False)
        write_text(out / SUMMARY_NAME, f"`{self.meta.get('command', '')}`\n\n{self.summary()}\n")
        return out / JSON_NAME, out / CSV_NAME

    @classmethod
    def load(cls, path: str | os.PathLike) -> BenchResults:
        """Read a ``bench.json`` (or the folder holding one)."""
        p = Path(path)
        doc = read_document(p / JSON_NAME if p.is_dir() else p, SCHEMA, SCHEMA_VERSION)
        return cls(meta=doc["meta"], rows=doc["rows"], fits=doc.get("fits", []))

    def summary(self) -> str:
        """A Markdown table of the results (and the max-batch searches), for a terminal or a report."""
        lines = ["| batch | configuration | status | peak MiB | step ms (IQR) | overhead | vs eager mem | budget "
                 "| losses |", "|---|---|---|---|---|---|---|---|---|"]
        compared = self.compared()
        for r in sorted(compared, key=lambda r: (r["batch_size"], r.get("phase") != "sweep")):
            if r["status"] != "ok":
                lines.append(f"| {r['batch_size']} | {r['config']} | {r['status']}: {r['message'][:60]} | | | | | | |")
                continue
            peak = f"{r['peak_mib']:.1f}" if r["peak_mib"] is not None else "n/a"
            over = f"{r['overhead_pct']:+.1f}% vs {r['baseline']}" if r["overhead_pct"] is not None else ""
            mem = f"{-r['memory_saving_pct']:+.1f}%" if r["memory_saving_pct"] is not None else ""
            plan = ""
            if r["budget_mib"] is not None:
                plan = (f"{r['budget_mib']:.0f} MiB ({'fits' if r['fits_budget'] else 'OVER'}), "
                        f"predicted {r['predicted_peak_mib']:.0f} MiB")
            if r["overhead_ms"] is not None:
                plan += (f"; {r['overhead_ms']:+.1f} ms vs {prediction_base(r)}, "
                         f"predicted {r['predicted_overhead_ms']:+.1f}")
            if r.get("offload_bytes"):
                stall = r["offload_stall_ms"] or 0.0
                measured = r["offload_bytes_measured"]
                plan += (f"; {r['offload_bytes'] / 2**30:.2f} GiB offloaded each way, "
                         f"{'copies hidden' if stall <= 0 else f'copies stall {stall:.1f} ms'} (predicted)"
                         + ("" if measured is None else f", {measured / 2**30:.2f} GiB copied"))
            lines.append(f"| {r['batch_size']} | {r['config']} | ok | {peak} | {r['time_ms_median']:.1f} "
                         f"({r['time_ms_iqr']:.1f}) | {over} | {mem} | {plan} | {r['loss_parity'] or ''} |")
        rules = sorted({(r["loss_check"]["reference"], r["loss_check"]["rule"]) for r in compared
                        if r.get("loss_check")})
        if rules:
            lines.append("\nlosses: every step's loss against " + "; ".join(f"{ref}'s, {rule}" for ref, rule in rules)
                         + "; a row marked DIVERGES does not train like its reference")
        for f in self.fits:
            capped = f" (search limit {f['limit']})" if f["capped"] else ""
            lines.append(f"\nlargest batch within {f['budget']}: {f['config']} {f['max_batch']}{capped}")
        return "\n".join(lines)
