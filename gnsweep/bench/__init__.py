"""Benchmarks (`make bench`): ratios measured side by side in one run, printed as a table and
as JSON. One module per subject, each with `main(argv: list[str]) -> dict`."""

SUBJECTS = ("noise", "sweep_cost", "probe", "analysis", "executors", "planner", "recipe",
            "checkpoint", "script_probe")
