"""`gnsweep plan`: find B_crit at a fraction of the grid's compute.

`rules` decides (pure: pilot, batch sizes, learning rates, step budgets); `gnsweep.commands.plan`
reads the finished runs, records each decision in the sweep folder's plan.json and hands the runs
to the executors, exactly as `gnsweep launch` does.
"""
