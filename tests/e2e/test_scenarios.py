"""The scenario table, in every mode: the drop-in proof (see scenarios.yaml)."""

import pytest

from tests.e2e.scenario_runner import load_scenarios, run_scenario

SCENARIOS = load_scenarios()

pytestmark = [pytest.mark.root, pytest.mark.e2e]


def test_table_covers_every_semantics_rule():
    covered = {s["rule"] for s in SCENARIOS}
    assert set(range(1, 15)) <= covered, f"rules without a scenario: {sorted(set(range(1, 15)) - covered)}"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_scenario(e2e_lab, scenario):
    run_scenario(e2e_lab, scenario)
