"""Analysis of a sweep: steps-to-target, best learning rates, Pareto fronts, fits, comparison.

Everything here is pure pandas/scipy on tables except `load` (reads a sweep folder) and
`report.analyze_sweep` (writes the outputs); nothing imports torch.
"""
