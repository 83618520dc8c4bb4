"""Batch size and learning rate laws across model size N and data D (docs/laws.md).

cells    the optimum of one fixed-budget (N, D) cell, its near-optimal set, edge, bootstrap
power    a power law c * N^a * D^b in log space with bootstrap intervals
family   every cell, every law, the held-out check, the prediction at a new scale
inputs   tables made elsewhere (fixed budget or steps to target)
export   laws.parquet, law_cells.parquet and laws.json's content
"""
