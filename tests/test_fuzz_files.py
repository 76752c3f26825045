"""Fuzzed profiles and plans: each gets a one-line domain error or a provably unaffected result, never a crash.

Mutations (fixed seed): deleted keys and list items, wrong types, nulls, huge, negative and NaN numbers,
shuffled lists, anywhere in the document. "Unaffected" means planning the mutated profile gives exactly the
original plan, and a mutated plan that loads is the original plan (up to the order of lists that nothing
reads in order). Profiles also go through ``acstudio plan`` in-process for a subset.
"""

import json
import math
import random
from pathlib import Path

import pytest

from acstudio.cli import main
from acstudio.errors import ACStudioError
from acstudio.fileio import read_document
from acstudio.plan.loading import load_plan
from acstudio.plan.model import SCHEMA as PLAN_SCHEMA
from acstudio.plan.model import SCHEMA_VERSION as PLAN_VERSION
from acstudio.plan.model import Plan
from acstudio.plan.solvers import plan
from acstudio.profile.model import SCHEMA, SCHEMA_VERSION, Profile
from acstudio.simulate.simulator import Simulator

SAMPLE = Path(__file__).resolve().parent.parent / "sample_profiles" / "cpu_resnet18_bs16_sgd.json.gz"
SEED = 13
PROFILES, PLANS, CLI_PROFILES = 200, 100, 24
BUDGET = 0.85
SOLVER = "mutwo"  # in-process: one solver keeps 200 cases fast; the CLI cases run the default "auto"

HUGE = (10**30, 2**64, 1e308, math.inf, -math.inf)
WRONG = {str: (12345, 1.5, True, [], {}), int: ("12", 1.5, True, [1], {}), float: ("1.5", True, [], {}),
         bool: (1, "true", [], None), list: ("x", 7, {}, True), dict: ("x", 7, [], True)}


def _pick(rng: random.Random, doc: dict, sections: list[str]) -> tuple[object, object]:
    """A random (container, key) inside ``doc``: a random section, then a random walk down."""
    container: object = doc
    key: object = rng.choice(sections)
    if "." in str(key):
        head, key = str(key).split(".")
        container = doc[head]
    while True:
        value = container[key]
        children = list(value) if isinstance(value, dict) else range(len(value)) if isinstance(value, list) else []
        if not children or rng.random() < 0.25:
            return container, key
        container, key = value, rng.choice(list(children))


def _mutate(rng: random.Random, text: str, sections: list[str]) -> tuple[dict, str]:
    """A changed copy of the JSON document ``text`` and a description of the change."""
    while True:
        out = json.loads(text)  # a deep copy, several times faster than copy.deepcopy here
        container, key = _pick(rng, out, sections)
        old = container[key]
        op = rng.choice(["delete", "wrong type", "null", "huge", "negative", "nan", "shuffle"])
        if op == "delete":
            del container[key]
            return out, f"{op} at {key!r} ({type(old).__name__})"
        if op == "shuffle" and not isinstance(old, list):  # shuffle the list the value sits in, if any
            if not isinstance(container, list):
                continue
            shuffled = rng.sample(container, len(container))
            if json.dumps(shuffled) == json.dumps(container):
                continue
            container[:] = shuffled
            return out, f"shuffle around {key!r} ({type(old).__name__})"
        if op == "shuffle":
            new = rng.sample(old, len(old))
        elif op == "wrong type":
            new = rng.choice(WRONG.get(type(old), (None,)))
        elif op == "null":
            new = None
        elif op == "huge":
            new = rng.choice(HUGE)
        elif op == "negative":
            new = -abs(old) - 1 if isinstance(old, (int, float)) and not isinstance(old, bool) else -1
        else:
            new = math.nan
        if type(new) is not type(old) or json.dumps(new) != json.dumps(old):  # a real change (NaN != NaN)
            container[key] = new
            return out, f"{op} at {key!r} ({type(old).__name__})"


def _one_line_domain_error(exc: ACStudioError, source: str) -> None:
    message = str(exc)
    assert "\n" not in message and message.startswith(source), message


@pytest.fixture(scope="module")
def base():
    """The sample profile's document (with its stored fingerprint), its profile and its plan at 85%."""
    doc = read_document(SAMPLE, SCHEMA, SCHEMA_VERSION)
    profile = Profile.from_dict(doc)
    doc["fingerprint"] = profile.fingerprint
    sim = Simulator(profile)
    result = plan(profile, int(BUDGET * sim.baseline_peak), SOLVER, simulator=sim)
    return doc, profile, result


def test_fuzzed_profiles_fail_cleanly_or_plan_the_same(base):
    doc, _, expected = base
    rng = random.Random(SEED)
    sections = [k for k in doc if k not in ("schema", "version")] + ["graph.nodes", "graph.inputs"] * 2
    text = json.dumps(doc)
    outcomes = {"refused": 0, "unaffected": 0}
    for case in range(PROFILES):
        mutated, change = _mutate(rng, text, sections)
        source = f"fuzz{case}.json"
        try:
            profile = Profile.from_dict(mutated, source)
        except ACStudioError as exc:
            _one_line_domain_error(exc, source)
            outcomes["refused"] += 1
            continue
        sim = Simulator(profile)
        got = plan(profile, int(BUDGET * sim.baseline_peak), SOLVER, simulator=sim)
        assert got.to_dict() == expected.to_dict(), f"case {case}: {change} was accepted and changed the plan"
        outcomes["unaffected"] += 1
    assert outcomes["refused"] >= PROFILES // 2, outcomes


def _canonical(p: Plan) -> dict:
    """What a plan means: its recompute set (the rewriter sorts it) and everything it reports, except each
    entry's ``ratio``: the solver's score when it chose, which only the schedule table shows."""
    d = p.to_dict()
    d["recomputed"] = sorted(d["recomputed"])
    d["schedule"] = [row[:-1] for row in d["schedule"]]
    return d


def test_fuzzed_plans_fail_cleanly_or_load_unchanged(base, tmp_path):
    _, profile, expected = base
    doc = {"schema": PLAN_SCHEMA, "version": PLAN_VERSION, **expected.to_dict()}
    rng = random.Random(SEED + 1)
    sections = [k for k in doc if k not in ("schema", "version")] + ["schedule", "recomputed"] * 3
    text = json.dumps(doc)
    refused = 0
    for case in range(PLANS):
        mutated, change = _mutate(rng, text, sections)
        path = tmp_path / f"plan{case}.json"
        path.write_text(json.dumps(mutated))
        try:
            loaded = load_plan(path, profile)
        except ACStudioError as exc:
            _one_line_domain_error(exc, str(path))
            refused += 1
            continue
        assert _canonical(loaded) == _canonical(expected), f"case {case}: {change} was accepted and changed the plan"
    assert refused >= PLANS // 2


def test_fuzzed_profiles_from_the_command_line(base, tmp_path, capsys):
    doc = base[0]
    good = tmp_path / "good.json"
    good.write_text(json.dumps(doc))
    expected_rc = main(["plan", str(good), "--budget", f"{BUDGET:.0%}"])
    expected_out = capsys.readouterr().out
    rng = random.Random(SEED + 2)
    sections = [k for k in doc if k not in ("schema", "version")]
    text = json.dumps(doc)
    for case in range(CLI_PROFILES):
        mutated, change = _mutate(rng, text, sections)
        path = tmp_path / f"fuzz{case}.json"
        path.write_text(json.dumps(mutated))
        rc = main(["plan", str(path), "--budget", f"{BUDGET:.0%}"])
        out, err = capsys.readouterr()
        if rc == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"acstudio: error: {path}"), (change, err)
        else:
            assert (rc, out, err) == (expected_rc, expected_out, ""), change
