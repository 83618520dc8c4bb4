"""The end of a process group, without the abort that an unclean teardown causes."""

from __future__ import annotations

import gc

import torch.distributed as dist

__all__ = ["close_process_group"]


def close_process_group(clean: bool = True) -> None:
    """Destroy this process's group, if any.

    After a clean finish every rank first meets at a barrier, once the DDP models (reference
    cycles through their hooks) are collected: a process that destroys its group while another
    still talks to it aborts in gloo's threads ("terminate called without an active exception",
    SIGABRT). After an error there is no barrier: the other ranks may never come."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean:
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()
