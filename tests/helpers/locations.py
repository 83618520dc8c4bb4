"""Where the tests find the checkout: the repository root (docs/, conf/, gnsweep/) and this
folder of helper modules, which the tests put on the PYTHONPATH of the processes they start so
that those import the helper tasks by name, as pytest does (`pythonpath` in pyproject.toml)."""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
"""tests/helpers/: the tasks and scripts the tests start."""

ROOT = HELPERS.parents[1]
"""The repository root."""
