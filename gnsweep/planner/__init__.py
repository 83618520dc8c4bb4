"""`gnsweep plan`: the runs that find B_crit at a fraction of the grid's compute, pure.

`pilot` decides a planned sweep's rounds (pilot, batch sizes, learning rates, step budgets);
`next_grid` the runs that settle a recommendation's bound. `gnsweep.commands.plan` reads the
finished runs, records each decision in the sweep folder and hands the runs to the executors,
exactly as `gnsweep launch` does.
"""
