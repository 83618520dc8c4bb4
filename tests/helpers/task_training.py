"""A minimal training loop on the new task protocol, for the task tests (the sweep's own loop is
wired to these tasks later): Adam, one batch size, and the loss (or metric) after each step."""

from __future__ import annotations

import torch


def train(task, *, batch_size: int, lr: float, steps: int, seed: int = 0
          ) -> tuple[torch.nn.Module, list[float]]:
    """Train a fresh model; return it and the loss (or the task's metric, if any) per step."""
    torch.set_num_threads(1)
    model = task.model()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(steps):
        loss = task.loss(model, task.sample(batch_size, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append(task.metric(model) if hasattr(task, "metric") else float(loss.detach()))
    return model, history


def mean(values: list[float]) -> float:
    return sum(values) / len(values)
