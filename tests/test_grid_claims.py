"""The README's transformer-grid claims, held to the committed result files they quote
(``benchmarks/grid_summary.py`` recomputes the ratios): a rerun that breaks a claim fails here until the README
says what the new files show."""

from pathlib import Path

import pytest
from conftest import benchmark_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def grid_summary():
    """``benchmarks/grid_summary.py``, imported."""
    return benchmark_script("grid_summary")


@pytest.fixture(scope="module")
def grid(grid_summary):
    return {shape: ratios for shape, (ratios, _) in grid_summary.summary(ROOT / "results" / "grid").items()}


def readme_words() -> str:
    """The README with every run of whitespace one space, so that a claim holds across its line breaks."""
    return " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())


def test_the_grid_has_nine_shapes_each_with_every_ratio(grid):
    assert sorted(grid) == sorted(f"{m}-s{s}" for m in ("bert", "gpt2", "decoder1b") for s in (512, 1024, 2048))
    assert all(r is not None for ratios in grid.values() for r in ratios.values())


def test_every_plan_fits_and_none_is_slower_than_its_peer_beyond_the_iqr(grid):
    """README: no row is slower than its peer beyond the run's IQR; GPT-2 seq 2048 compiled, which ran the peer's own
    policy 0.9 ms slower (1.002, seventeenth session), offloads since its form is handed the mask's bias (0.988).
    The decoder at seq 1024 compiled is slower inside the IQRs (1.003); a first run of its plan, kept as a probe, its
    host slow, was slower beyond them (1.101), which the README quotes beside it."""
    for shape, ratios in grid.items():
        for column, r in ratios.items():
            assert r.fits, f"{shape} at {column}: OVER its budget"
            assert not r.slower, f"{shape} at {column}: slower than its peer beyond the IQR"
    assert round(grid["decoder1b-s1024"]["compile+per-op's peak"].value, 3) == 1.003
    worst = ("| 1.003 (the 953M decoder at seq 1024, H200, its first 2 blocks offloaded: 120.6 / 120.2 ms, inside the "
             "IQRs of 0.4 / 2.2; a first run of the same plan 1.101, its host slow) |")
    assert worst in readme_words()


def test_the_readmes_best_and_worst_shapes_are_the_grids(grid):
    """README and docs/results.md: at HF GC's peak 0.13x (BERT seq 2048) to 0.43x (the decoder at seq 512; at seq
    1024 0.41x) of its overhead, every shape on the H200; compiled at compile+per-op's peak 0.900 (BERT seq 512, its
    first blocks offloaded) and 0.918 (BERT seq 1024) to 1.003 (the decoder at seq 1024, its first blocks offloaded,
    slower inside the IQRs), BERT seq 2048 0.928 and GPT-2's 0.989 / 0.987 / 0.986 (their first blocks offloaded,
    the form they run in priced; BERT seq 2048 and GPT-2 seq 1024 and 2048 handed the mask's bias), the decoder's
    seq 512 and 2048 0.968 and 0.983 (their fetches as priced); every peak, on every row and
    column, within 1% of the prediction it ran with but BERT seq 2048's compiled one (1.36% under, which counted a
    kept block's bias twice)."""
    readme = readme_words()
    at_hf = {s: r["HF GC's peak"].value for s, r in grid.items()}
    assert min(at_hf, key=at_hf.get) == "bert-s2048" and round(at_hf["bert-s2048"], 2) == 0.13
    assert "BERT seq 2048: 0.13x, H200" in readme
    assert max(at_hf, key=at_hf.get) == "decoder1b-s512" and round(at_hf["decoder1b-s512"], 2) == 0.43
    assert "transformers: 0.43x (the 953M decoder at seq 512, grid, H200" in readme
    compiled = {s: r["compile+per-op's peak"].value for s, r in grid.items()}
    best = sorted(compiled, key=compiled.get)[:2]
    assert best == ["bert-s512", "bert-s1024"] and [round(compiled[s], 3) for s in best] == [0.900, 0.918]
    assert round(compiled["bert-s2048"], 3) == 0.928
    assert max(compiled, key=compiled.get) == "decoder1b-s1024" and round(compiled["decoder1b-s1024"], 3) == 1.003
    gpt2 = [round(compiled[f"gpt2-s{s}"], 3) for s in (512, 1024, 2048)]
    assert gpt2 == [0.989, 0.987, 0.986] and "(**0.989**, **0.987**, **0.986**, H200, 2026-11-29)" in readme
    decoder = [round(compiled[f"decoder1b-s{s}"], 3) for s in (512, 1024, 2048)]
    assert decoder == [0.968, 1.003, 0.983] and "decoder at seq 512 and 2048 (**0.968**: 112.7 / 116.5 ms" in readme
    assert "ran **1.003** (120.6 / 120.2 ms, inside the IQRs of 0.4 / 2.2" in readme
    assert "a first run of it 1.101" in readme
    assert "0.900 (BERT seq 512, H200" in readme and "seq 1024 0.918, seq 2048 0.928" in readme
    assert "0.981 (GPT-2 seq 512" not in readme and "4.4-5.8% under the prediction" not in readme
    missed = {(s, c): round(r.peak_error_pct, 2) for s, ratios in grid.items() for c, r in ratios.items()
              if abs(r.peak_error_pct) >= 1}
    assert missed == {("bert-s2048", "compile+per-op's peak"): -1.36} and "(1.36% under, above)" in readme


def test_every_grid_rows_step_is_predicted_within_3_percent(grid_summary):
    """Issue 27: time predicted within 3% on every grid row, eager and compiled (``step_errors`` says how each row
    is predicted), but one: the decoder at seq 1024's compiled row, 3.2% fast (the activations its plan keeps back
    saved less than priced; README). The eager worst, 2.3% fast: the decoder at seq 512's row at 1.15x HF GC's peak
    (H200). The decoder at seq 1024's eager rows missed by up to 3.6% on the H200 until the simulator laid copies
    out with a slack (:data:`acstudio.simulate.offload.LINK_SLACK`); rerun with it, they land within 0.9%."""
    errors = grid_summary.step_errors(ROOT / "results" / "grid")
    assert len(errors) >= 35
    missed = {k: round(e, 3) for k, e in errors.items() if abs(e) >= 0.03}
    assert missed == {"decoder1b-s1024.compiled: sac+compile@compile+per-op": -0.032}, missed
    assert max(abs(e) for k, e in errors.items() if k not in missed) < 0.023
    assert ("within 2.3% on 35 of the 36 grid rows (the eager worst, the decoder at seq 512's row at 1.15x HF GC's "
            "peak, 2.3% fast). The 36th MISSES: the decoder at seq 1024's compiled row, predicted 3.2% fast"
            ) in readme_words()
