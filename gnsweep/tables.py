"""The typed columns of every table gnsweep writes: a run's metrics (`METRICS_SCHEMA`), what
`gnsweep analyze` and `gnsweep compare` write (docs/storage.md, docs/analysis.md and
docs/compare.md say what each column means). The one place a table's columns are listed:
`gnsweep.store` writes with these types, the training loop and the trackers log these names,
and the analysis builds its frames from them. Pure; pyarrow only.
"""

from __future__ import annotations

import pyarrow as pa

from gnsweep.targets import KEY as DIRECTION_KEY

BEST_VALUE = "min_loss"
"""The steps table's column holding each run's best value in the targets' direction: the lowest
loss, or the highest value of a rising metric. Its name on disk stays `min_loss`, the one older
sweep folders and users' scripts read."""

# ---- a run's metrics.parquet: one row per logged step --------------------------------------

METRICS_SCHEMA = pa.schema([
    ("step", pa.int64()),             # optimizer steps taken
    ("examples", pa.int64()),         # training examples seen
    ("loss", pa.float64()),           # this step's training loss (batch mean)
    ("loss_smooth", pa.float64()),    # EMA of the training loss, bias-corrected
    ("eval_loss", pa.float64()),      # held-out loss (NaN when not evaluated)
    ("lr", pa.float64()),             # learning rate used by this step
    ("b_small", pa.float64()),        # small batch size of the two-batch estimate
    ("b_big", pa.float64()),          # big batch size
    ("sq_norm_small", pa.float64()),  # |G_small|^2 (mean over small batches)
    ("sq_norm_big", pa.float64()),    # |G_big|^2
    ("g2_step", pa.float64()),        # unbiased |G|^2 this step (eq. A.2)
    ("trace_sigma_step", pa.float64()),  # unbiased tr(Sigma) this step (eq. A.2)
    ("g2", pa.float64()),             # EMA of |G|^2
    ("trace_sigma", pa.float64()),    # EMA of tr(Sigma)
    ("b_simple", pa.float64()),       # EMA(tr Sigma) / EMA(|G|^2)
    ("g_h_g", pa.float64()),          # EMA of G^T H G (NaN unless measured)
    ("trace_h_sigma", pa.float64()),  # EMA of tr(H Sigma)
    ("b_noise", pa.float64()),        # EMA(tr H Sigma) / EMA(G^T H G)
    ("drift", pa.float64()),          # |G|^2 now / one EMA window ago (NaN: not resolvable)
    ("b_simple_se", pa.float64()),    # standard error of b_simple (delta method over the window)
    ("g2_precond", pa.float64()),     # EMA of G^T P G (P: the optimizer's preconditioner)
    ("trace_sigma_precond", pa.float64()),  # EMA of tr(P Sigma)
    ("b_simple_precond", pa.float64()),     # EMA(tr P Sigma) / EMA(G^T P G), NaN until determined
    ("probe_g2", pa.float64()),       # frozen-parameter probe: |G|^2 (NaN between probes)
    ("probe_trace_sigma", pa.float64()),    # probe: tr(Sigma)
    ("probe_g_h_g", pa.float64()),          # probe: G^T H G
    ("probe_trace_h_sigma", pa.float64()),  # probe: tr(H Sigma)
    ("b_simple_true", pa.float64()),  # exact B_simple at these parameters (closed-form tasks)
    ("b_noise_true", pa.float64()),   # exact B_noise at these parameters (closed-form tasks)
    ("wall_time", pa.float64()),      # seconds since the run started
    ("metric", pa.float64()),         # the task's own target metric (cartpole: mean return);
                                      # NaN for a task whose targets are losses
    ("batch_size", pa.float64()),     # samples drawn this step (varies in an adaptive run)
    ("grad_norm", pa.float64()),      # global gradient norm before clipping (unscaled)
    ("skipped_steps", pa.float64()),  # fp16: steps the gradient scaler skipped so far
    ("epoch", pa.float64()),          # passes over the task's dataset so far (1.5: half way
                                      # through the second); NaN for a task that samples
])
"""A run's metrics.parquet (and its metrics.parts/): the training loop, a script run and the
framework callbacks write these columns; the analysis, the trackers and the monitor's estimate
read them (docs/storage.md says what each means)."""
OPTIONAL_METRICS = ("metric", "batch_size", "grad_norm", "skipped_steps", "epoch")
"""Columns a run logs only when its task has them (metric, epoch), or that a writer other than
the training loop may leave out (batch_size, grad_norm, skipped_steps); NaN on every row
otherwise."""

PROBE_COLUMNS = ("probe_g2", "probe_trace_sigma", "probe_g_h_g", "probe_trace_h_sigma")
"""The frozen-parameter probe's columns (NaN between probes)."""
TRUTH_COLUMNS = ("b_simple_true", "b_noise_true")
"""The exact noise scales of a closed-form task (NaN for any other)."""
CORE_METRICS = ("step", "examples", "loss", "loss_smooth", "eval_loss", "b_simple", "b_noise")
"""The columns every run's metrics have held since the first version of the folder."""
CURVE_COLUMNS = (*CORE_METRICS, "drift", *PROBE_COLUMNS, *TRUTH_COLUMNS, "metric",
                 "b_simple_precond", "lr")
"""The metrics columns the analysis reads from every run (NaN where a run lacks one)."""
TRACKED_METRICS = ("loss", "loss_smooth", "eval_loss", "b_simple", "b_noise", "lr", "batch_size",
                   "examples")
"""The metrics columns a run sends to an experiment tracker each logged step."""

# Column types of the analysis's tables (docs/analysis.md says what each column means). A
# table written from elsewhere (`gnsweep analyze --table`) may hold a subset of the columns.
RESULT_SCHEMAS: dict[str, pa.Schema] = {
    "steps": pa.schema([
        ("run_id", pa.large_string()), ("batch_size", pa.int64()), ("learning_rate", pa.float64()),
        ("seed", pa.int64()), ("target", pa.float64()), ("state", pa.large_string()),
        ("reached", pa.bool_()), ("steps", pa.float64()), ("examples", pa.float64()),
        ("b_simple_at_target", pa.float64()), ("b_simple_mean", pa.float64()),
        ("outcome", pa.large_string()), ("b_noise_at_target", pa.float64()),
        ("b_noise_mean", pa.float64()), (BEST_VALUE, pa.float64()), ("last_step", pa.float64()),
        ("b_simple_true_mean", pa.float64()), ("b_noise_true_mean", pa.float64()),
        ("drift_share", pa.float64()), ("b_simple_precond_at_target", pa.float64()),
        ("b_simple_precond_mean", pa.float64()), ("lr_share", pa.float64()),
    ]),
    "front": pa.schema([
        ("target", pa.float64()), ("batch_size", pa.int64()), ("learning_rate", pa.float64()),
        ("steps", pa.float64()), ("examples", pa.float64()), ("n_lr_reached", pa.int64()),
        ("lr_on_edge", pa.bool_()), ("b_simple_at_target", pa.float64()),
        ("b_simple_mean", pa.float64()), ("on_front", pa.bool_()), ("n_lr", pa.int64()),
        ("lr_edge", pa.large_string()), ("lr_opt", pa.float64()), ("n_seeds", pa.int64()),
        ("b_noise_at_target", pa.float64()), ("b_noise_mean", pa.float64()),
        ("b_simple_true_mean", pa.float64()), ("b_noise_true_mean", pa.float64()),
        ("drift_share", pa.float64()), ("b_simple_precond_at_target", pa.float64()),
        ("b_simple_precond_mean", pa.float64()), ("budget_share", pa.float64()),
        ("lr_share", pa.float64()), ("late", pa.bool_()), ("b_simple_lr", pa.float64()),
        ("steps_fit", pa.float64()),
        ("resid_log", pa.float64()), ("in_fit", pa.bool_()), ("left_out", pa.large_string()),
    ]),
    "fits": pa.schema([
        ("target", pa.float64()), ("n_batch_sizes", pa.int64()), ("s_min", pa.float64()),
        ("s_min_se", pa.float64()), ("e_min", pa.float64()), ("e_min_se", pa.float64()),
        ("b_crit", pa.float64()), ("b_crit_se", pa.float64()), ("rmse_log", pa.float64()),
        ("b_simple_at_target", pa.float64()), ("b_simple_mean", pa.float64()),
        ("ratio", pa.float64()), ("refused", pa.large_string()), ("dof", pa.int64()),
        ("max_abs_resid_log", pa.float64()), ("n_bootstrap", pa.int64()),
        ("s_min_lo", pa.float64()), ("s_min_hi", pa.float64()), ("e_min_lo", pa.float64()),
        ("e_min_hi", pa.float64()), ("b_crit_lo", pa.float64()), ("b_crit_hi", pa.float64()),
        ("b_simple_at_target_se", pa.float64()), ("b_simple_mean_se", pa.float64()),
        ("ratio_se", pa.float64()), ("ratio_at_target", pa.float64()),
        ("ratio_at_target_se", pa.float64()), ("b_noise_at_target", pa.float64()),
        ("b_noise_at_target_se", pa.float64()), ("b_noise_mean", pa.float64()),
        ("b_noise_mean_se", pa.float64()), ("ratio_noise", pa.float64()),
        ("ratio_noise_se", pa.float64()), ("lr_model", pa.large_string()),
        ("eps_max", pa.float64()), ("eps_max_se", pa.float64()), ("b_noise_lr", pa.float64()),
        ("b_noise_lr_se", pa.float64()), ("lr_alpha", pa.float64()), ("lr_alpha_se", pa.float64()),
        ("lr_refused", pa.large_string()), ("quality", pa.large_string()),
        ("b_simple_true_mean", pa.float64()), ("b_noise_true_mean", pa.float64()),
        ("drift_share", pa.float64()), ("b_crit_window_lo", pa.float64()),
        ("b_crit_window_hi", pa.float64()), ("b_crit_window_spread", pa.float64()),
        ("b_simple_precond_at_target", pa.float64()),
        ("b_simple_precond_at_target_se", pa.float64()), ("b_simple_precond_mean", pa.float64()),
        ("b_simple_precond_mean_se", pa.float64()), ("ratio_precond", pa.float64()),
        ("ratio_precond_se", pa.float64()),
        ("bcrit_status", pa.large_string()), ("bcrit_reason", pa.large_string()),
        ("b_crit_bound", pa.float64()), ("n_left_out", pa.int64()),
        ("censored", pa.large_string()), ("lr_status", pa.large_string()),
    ]),
    "lr_fits": pa.schema([
        ("target", pa.float64()), ("model", pa.large_string()), ("n_points", pa.int64()),
        ("eps_max", pa.float64()), ("eps_max_se", pa.float64()), ("b_noise", pa.float64()),
        ("b_noise_se", pa.float64()), ("alpha", pa.float64()), ("alpha_se", pa.float64()),
        ("rmse_log", pa.float64()), ("refused", pa.large_string()), ("aic", pa.float64()),
        ("form", pa.large_string()),
        ("status", pa.large_string()), ("b_noise_bound", pa.float64()),
    ]),
    "loss_scaling": pa.schema([
        ("n_targets", pa.int64()), ("b_star", pa.float64()), ("b_star_se", pa.float64()),
        ("alpha_b", pa.float64()), ("alpha_b_se", pa.float64()), ("rmse_log", pa.float64()),
        ("refused", pa.large_string()),
    ]),
    "adaptive": pa.schema([
        ("run_id", pa.large_string()), ("exchange_rate", pa.float64()), ("eps_max", pa.float64()),
        ("seed", pa.int64()), ("target", pa.float64()), ("state", pa.large_string()),
        ("reached", pa.bool_()), ("steps", pa.float64()), ("examples", pa.float64()),
        ("mean_batch", pa.float64()), ("noise_source", pa.large_string()),
        ("b_noise_mean", pa.float64()), ("gamma", pa.float64()), ("s_min", pa.float64()),
        ("e_min", pa.float64()), ("e_fixed", pa.float64()), ("e_predicted", pa.float64()),
        ("gain_predicted", pa.float64()), ("gain_measured", pa.float64()),
        ("front_product", pa.float64()),
    ]),
    "along": pa.schema([
        ("at_examples", pa.int64()), ("at_step", pa.int64()), ("at_loss", pa.float64()),
        ("target", pa.float64()), ("target_value", pa.float64()), ("n_runs", pa.int64()),
        ("n_batch_sizes", pa.int64()), ("s_min", pa.float64()), ("s_min_se", pa.float64()),
        ("e_min", pa.float64()), ("e_min_se", pa.float64()), ("b_crit", pa.float64()),
        ("b_crit_se", pa.float64()), ("rmse_log", pa.float64()), ("b_simple", pa.float64()),
        ("b_noise", pa.float64()), ("ratio", pa.float64()), ("ratio_se", pa.float64()),
        ("ratio_noise", pa.float64()), ("ratio_noise_se", pa.float64()),
        ("b_simple_mean", pa.float64()), ("b_noise_mean", pa.float64()),
        ("quality", pa.large_string()), ("refused", pa.large_string()),
        ("b_simple_precond", pa.float64()), ("ratio_precond", pa.float64()),
        ("ratio_precond_se", pa.float64()), ("b_simple_precond_mean", pa.float64()),
        ("target_source", pa.large_string()), ("window", pa.float64()),
        ("b_crit_tol", pa.float64()), ("b_crit_tol_lo", pa.float64()),
        ("b_crit_tol_hi", pa.float64()), ("tolerance", pa.float64()),
        ("tol_refused", pa.large_string()),
        ("bcrit_status", pa.large_string()), ("bcrit_reason", pa.large_string()),
        ("b_crit_bound", pa.float64()),
    ]),
    "along_schedule": pa.schema([
        ("run_id", pa.large_string()), ("seed", pa.int64()), ("target", pa.float64()),
        ("state", pa.large_string()), ("reached", pa.bool_()), ("steps", pa.float64()),
        ("examples", pa.float64()), ("mean_batch", pa.float64()), ("best_batch", pa.float64()),
        ("best_lr", pa.float64()), ("best_steps", pa.float64()),
        ("best_examples", pa.float64()), ("steps_ratio", pa.float64()),
        ("examples_ratio", pa.float64()), ("front_steps", pa.float64()),
        ("front_ratio", pa.float64()),
    ]),
    "along_base": pa.schema([
        ("step", pa.float64()), ("examples", pa.float64()), ("loss", pa.float64()),
        ("b_simple", pa.float64()), ("b_noise", pa.float64()),
        ("b_simple_precond", pa.float64()),
    ]),
    "temperature": pa.schema([
        ("target", pa.float64()), ("exponent", pa.float64()), ("exponent_se", pa.float64()),
        ("n_runs", pa.int64()), ("n_temperatures", pa.int64()), ("rmse_log", pa.float64()),
        ("refused", pa.large_string()), ("exponent_precond", pa.float64()),
        ("exponent_precond_se", pa.float64()), ("n_runs_precond", pa.int64()),
    ]),
}
OPTIONAL_RESULTS = ("adaptive", "along", "along_schedule", "along_base")
"""Results tables written only when not empty (a sweep with adaptive runs, a branch sweep)."""
COMPARE_SCHEMA = pa.schema([
    ("task", pa.large_string()), ("sweep", pa.large_string()), ("sweep_dir", pa.large_string()),
    ("metric", pa.large_string()), (DIRECTION_KEY, pa.bool_()), ("unit", pa.large_string()),
    ("target", pa.float64()), ("n_batch_sizes", pa.int64()), ("b_crit", pa.float64()),
    ("b_crit_se", pa.float64()), ("b_simple_mean", pa.float64()),
    ("b_simple_mean_se", pa.float64()), ("b_simple_at_target", pa.float64()),
    ("b_simple_at_target_se", pa.float64()), ("b_noise_mean", pa.float64()),
    ("b_noise_mean_se", pa.float64()), ("ratio", pa.float64()), ("ratio_se", pa.float64()),
    ("ratio_noise", pa.float64()), ("refused", pa.large_string()),
    ("quality", pa.large_string()), ("b_simple_precond_mean", pa.float64()),
    ("ratio_precond", pa.float64()), ("ratio_precond_se", pa.float64()),
    ("bcrit_status", pa.large_string()), ("b_crit_bound", pa.float64()),
    ("at_examples", pa.float64()),
])
"""compare.parquet, written by `gnsweep compare` (docs/compare.md)."""
LAWS_SCHEMAS: dict[str, pa.Schema] = {
    "law_cells": pa.schema([
        ("N", pa.float64()), ("D", pa.float64()), ("target", pa.float64()),
        ("batch_size", pa.float64()), ("learning_rate", pa.float64()), ("loss", pa.float64()),
        ("edge", pa.bool_()), ("edge_reason", pa.large_string()), ("method", pa.large_string()),
        ("best_loss", pa.float64()), ("batch_size_low", pa.float64()),
        ("batch_size_high", pa.float64()), ("learning_rate_low", pa.float64()),
        ("learning_rate_high", pa.float64()), ("n_runs", pa.int64()), ("n_configs", pa.int64()),
        ("n_diverged", pa.int64()), ("n_near", pa.int64()), ("near_batch_low", pa.float64()),
        ("near_batch_high", pa.float64()), ("near_lr_low", pa.float64()),
        ("near_lr_high", pa.float64()), ("b_crit", pa.float64()),
        ("b_crit_status", pa.large_string()), ("batch_size_usable", pa.bool_()),
        ("learning_rate_usable", pa.bool_()), ("b_crit_usable", pa.bool_()),
        ("widened", pa.large_string()), ("seeds", pa.float64()), ("seed_sd", pa.float64()),
    ]),
    "laws": pa.schema([
        ("quantity", pa.large_string()), ("form", pa.large_string()), ("target", pa.float64()),
        ("n_points", pa.int64()), ("rmse_log", pa.float64()), ("c", pa.float64()),
        ("c_low", pa.float64()), ("c_high", pa.float64()), ("a", pa.float64()),
        ("a_low", pa.float64()), ("a_high", pa.float64()), ("b", pa.float64()),
        ("b_low", pa.float64()), ("b_high", pa.float64()), ("g", pa.float64()),
        ("g_low", pa.float64()), ("g_high", pa.float64()), ("scope", pa.large_string()),
        ("held_out_N", pa.float64()),
        ("held_out_D", pa.float64()), ("held_out_predicted", pa.float64()),
        ("held_out_low", pa.float64()), ("held_out_high", pa.float64()),
        ("held_out_measured", pa.float64()), ("held_out_ratio", pa.float64()),
        ("refused", pa.large_string()),
    ]),
}
"""`gnsweep laws` (docs/laws.md): law_cells.parquet, one row per (N, D) cell (and target for
steps-to-target input), and laws.parquet, one row per law (coefficients c, a for N, b for D,
g for the target loss L, each with its 95% interval, NaN where the law lacks it; `scope` says
when the cells are each at their own target; a refused law has its reason)."""
RESULT_TABLES = tuple(RESULT_SCHEMAS)
"""Results fields written as <name>.parquet; fits.json holds the rest (warnings, meta)."""


def columns(table: str) -> list[str]:
    """The columns of a results table (`RESULT_SCHEMAS`), "compare" (`COMPARE_SCHEMA`) or a
    laws table (`LAWS_SCHEMAS`), in their order."""
    schema = (COMPARE_SCHEMA if table == "compare" else LAWS_SCHEMAS[table]
              if table in LAWS_SCHEMAS else RESULT_SCHEMAS[table])
    return list(schema.names)


RESULT_KEYS: dict[str, tuple[str, ...]] = {
    "steps": ("run_id", "batch_size", "learning_rate", "target", "reached", "steps",
              "examples"),
    "front": ("target", "batch_size"),
    "fits": ("target",),
}
"""The columns a results table must have to be read at all (older versions wrote all of
them); `store.read_result_tables` refuses a table without them, or whose `target` or
`batch_size` is not a finite number in every row."""
