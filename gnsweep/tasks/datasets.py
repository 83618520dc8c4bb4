"""What a task's `dataset()` must return: a map-style torch Dataset with a length. Checked here,
once, for both the launch pre-flight (`tasks.launch_check`) and the training loop's data
(`training.data`).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset, IterableDataset


def as_dataset(dataset: Any, what: str) -> Dataset:
    """`dataset` if it is a map-style Dataset with a length of at least one; else ValueError
    saying what it is."""
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Dataset):
        kind = ("an IterableDataset" if isinstance(dataset, IterableDataset)
                else f"a {type(dataset).__name__}")
        raise ValueError(f"{what} returned {kind}, not a map-style torch.utils.data.Dataset "
                         "(__getitem__(index) and __len__); for endless data write sample() "
                         "instead")
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{what} returned a Dataset without __len__; gnsweep draws its indices "
                         "without replacement and needs its length") from None
    if length < 1:
        raise ValueError(f"{what} returned an empty Dataset")
    return dataset
