"""Run under torchrun with 2 processes (tests/training/test_recipe.py): the same digits run with
whole per-rank batches and with train.microbatch_size = B/4 (no_sync until the last piece);
rank 0 writes both runs' logged losses to the JSON file named by argv[1]."""

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from gnsweep.config import Config, SweepConfig, TaskConfig, TrainConfig
from gnsweep.distributed import close_process_group
from gnsweep.runs import RunSpec
from gnsweep.training import build_run, run


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=2))
    try:
        losses = {}
        for name, size in (("whole", 0), ("pieces", 16)):
            config = Config(task=TaskConfig("digits"),
                            sweep=SweepConfig(batch_sizes=[128], learning_rates=[0.4],
                                              targets=[1e-9], max_steps=50),
                            train=TrainConfig(microbatch_size=size))
            state = build_run(config, RunSpec(batch_size=128, learning_rate=0.4))
            run(state)
            losses[name] = state.rows["loss"]
        if dist.get_rank() == 0:
            with open(out, "w") as handle:
                json.dump(losses, handle)
    finally:
        close_process_group(clean=sys.exc_info()[0] is None)


if __name__ == "__main__":
    main(sys.argv[1])
