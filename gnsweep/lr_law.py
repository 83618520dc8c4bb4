"""Eq. 2.7, the optimal learning rate at batch size B: eps_opt(B) = eps_max / (1 + B_noise/B).

The one place the law is written. The planner's first learning rates, the adaptive and along
schedules' rate at each step and the analysis' fit of best learning rates all call it. The
saturating form (B_noise/B)^alpha is the fit's Adam-like model; alpha = 1 is SGD's law of
section 2. Pure: floats or numpy arrays in, the same out; no imports.
"""

from __future__ import annotations

from typing import Any


def eps_opt(batch_size: Any, eps_max: float, b_noise: float, alpha: float = 1.0) -> Any:
    """eps_opt(B) = eps_max / (1 + (B_noise/B)^alpha): eq. 2.7 for alpha = 1 (SGD). `batch_size`
    a number or a numpy array (then the answer is one per element)."""
    ratio = b_noise / batch_size
    return eps_max / (1.0 + (ratio if alpha == 1.0 else ratio ** alpha))


def eps_max_from(learning_rate: float, batch_size: float, b_noise: float) -> float:
    """eps_max for which `learning_rate` is optimal at `batch_size` (eq. 2.7 inverted)."""
    return learning_rate * (1.0 + b_noise / batch_size)
