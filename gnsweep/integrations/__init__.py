"""Noise-scale callbacks for training frameworks.

`gnsweep.integrations.lightning.NoiseScaleCallback` (PyTorch Lightning, extra `gnsweep[lightning]`)
and `gnsweep.integrations.transformers.NoiseScaleCallback` (Hugging Face Trainer, extra
`gnsweep[transformers]`). Each submodule imports its framework; this package imports neither.
"""
