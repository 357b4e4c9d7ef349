"""torchft's DiLoCo regression test, its recorded numbers made by torchft in the same test.

torchft 0.2.0's ``diloco_regression_test.py`` runs two replica groups of a mocked model
(fixed gradients, a plain ``p -= lr * grad`` optimizer) through ``DiLoCo`` with two
fragments, with and without a sync delay, at three mixing factors, and once with a group
failing at step 2; it records every parameter at every local step and compares the run
with a fixture file (``test_fixtures/<case id>.json``). Those files are not in torchft's
wheel. Here torchft itself writes them (``WRITE_FIXTURE=true``, in which mode the file
checks torchft's run against its own formulas), and the same file with the import swapped
is then compared with them: every parameter of every group at every step within torchft's
own tolerance (``1e-5``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_ft_local_sgd import _integ_files, _swap, _torchft_text
from test_ft_local_sgd import _run as run_child

CASES = {
    *(f"test_diloco_mocked_updates_{i}" for i in range(6)),
    "test_diloco_mocked_failure_recovery_0",
}
FILE = "diloco_regression_test.py"


def _run(root: Path, write: bool) -> tuple[set[str], str]:
    """The file under ``root/tests``; it finds its fixtures in ``root/test_fixtures``."""
    tests = root / "tests"
    return run_child(tests, tests / FILE, 280, env={"WRITE_FIXTURE": str(write).lower()})


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None
    or importlib.util.find_spec("parameterized") is None,
    reason="needs torchft==0.2.0 and parameterized",
)
def test_diloco_matches_the_numbers_torchft_records_for_its_own_regression_test(
    tmp_path: Path,
) -> None:
    theirs, ours = tmp_path / "torchft", tmp_path / "rallypoint"
    for root in (theirs, ours):
        (root / "tests").mkdir(parents=True)
        (root / "test_fixtures").mkdir()
    (theirs / "tests" / FILE).write_text(_torchft_text(FILE))
    passed, why = _run(theirs, write=True)
    assert passed == CASES, f"torchft itself did not pass its regression test here:\n{why}"
    recorded = sorted((theirs / "test_fixtures").glob("*.json"))
    assert len(recorded) == len(CASES), recorded
    for fixture in recorded:
        (ours / "test_fixtures" / fixture.name).write_bytes(fixture.read_bytes())

    _integ_files(ours / "tests")  # the swapped helpers its imports name
    (ours / "tests" / FILE).write_text(
        _swap(
            _torchft_text(FILE),
            {
                "from torchft._test.diloco_trainer import": "from diloco_trainer_swapped import",
                "from torchft.manager_integ_test import": "from manager_integ_swapped import",
            },
        )
    )
    passed, why = _run(ours, write=False)
    assert passed == CASES, why
