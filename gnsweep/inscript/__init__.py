"""The noise scale measured inside a training script's own process, with no line of it changed.

gnsweep starts a script run (`task=script`) with `boot/` first on PYTHONPATH and the probe's
settings in `GNSWEEP_NOISE_PROBE`. Python imports `boot/sitecustomize.py` at startup; it waits
for `torch.optim` to be imported, then `probe.install()` hooks every optimizer's parameters:
each backward pass's gradient is read as it arrives (before it is accumulated into `.grad` or
all-reduced by DDP), each optimizer step closes a pair of eq. A.2 (b_small: a micro-batch of
gradient accumulation or a DDP rank's share; b_big: the whole batch), and B_simple's rows are
appended to a file in the run folder that the runner joins to the script's rows by step.
Nothing here imports more of gnsweep than the pure estimators (`gnsweep.noise`).
"""
