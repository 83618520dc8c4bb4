"""gnsweep: sweep orchestrator and Pareto analyzer for the critical batch size.

Implements McCandlish et al., "An Empirical Model of Large-Batch Training" (2018).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["FsdpNoiseScale", "NoiseScaleMonitor", "__version__", "current_run",
           "measure_noise_scale"]


def __getattr__(name: str) -> Any:
    # torch is imported only when the measurement API is used: analysis runs without it.
    if name == "NoiseScaleMonitor":
        from gnsweep.measure import NoiseScaleMonitor

        return NoiseScaleMonitor
    if name == "FsdpNoiseScale":
        from gnsweep.measure import FsdpNoiseScale

        return FsdpNoiseScale
    if name == "current_run":  # a script's handle on its sweep run (task=script)
        from gnsweep.run_handle import current_run

        return current_run
    if name == "measure_noise_scale":
        from gnsweep import measure

        return measure.measure_noise_scale
    raise AttributeError(name)
