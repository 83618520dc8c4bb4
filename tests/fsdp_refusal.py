"""Run by tests/test_architectures.py under torchrun: a model sharded by FSDP
(`fully_shard`, gloo on CPU) is refused by the monitor, with the reason, on every rank."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from gnsweep import NoiseScaleMonitor

dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
fully_shard(model)
try:
    NoiseScaleMonitor(model)
except ValueError as err:
    print("refused:", err)
finally:
    dist.destroy_process_group()
