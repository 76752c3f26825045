"""The package's import structure: no import loops between modules, and a layers contract that names every part.

``lint-imports`` itself (the contracts in pyproject.toml) runs in ``test_gui_views.py``."""

import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_import_loops_between_modules():
    """Every acstudio module imports only modules that do not import it back, directly or through others, also
    from inside a function. Imports under ``typing.TYPE_CHECKING`` never run, so they may point back."""
    graph = grimp.build_graph("acstudio", exclude_type_checking_imports=True, cache_dir=None)
    sorter = TopologicalSorter({m: graph.find_modules_directly_imported_by(m) for m in graph.modules})
    try:
        sorter.prepare()
    except CycleError as exc:
        pytest.fail(f"import loop: {' -> '.join(exc.args[1])}")


def test_layers_contract_names_every_part_and_allows_no_exception():
    toml = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    config = toml.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")
    assert "ignore_imports" not in layers
    packages = {f"acstudio.{p.name}" for p in (ROOT / "acstudio").iterdir() if (p / "__init__.py").is_file()}
    assert packages <= set(layers["layers"])
