"""gnsweep's default task (the digits MLP) trained by a plain script of its own: its own loop,
plain SGD, logging through `gnsweep.current_run()` with the handle's noise-scale monitor. The
same model and data as `task=digits`, for the test that both give the same answer."""

import torch

import gnsweep
from gnsweep.tasks import make_task

torch.set_num_threads(1)
run = gnsweep.current_run()
assert run is not None, "run me through gnsweep launch task=script"
task = make_task("digits", {}, run.seed)
torch.manual_seed(run.seed)
model = task.model()
optimizer = torch.optim.SGD(model.parameters(), lr=run.learning_rate)
monitor = run.monitor(model)  # B_simple (eq. 2.9), logged with every row
generator = torch.Generator().manual_seed(run.seed)
for step in range(1, run.max_steps + 1):
    batch = task.sample(run.batch_size, generator)
    loss = task.loss(model, batch)
    optimizer.zero_grad()
    loss.backward()
    monitor.step()
    optimizer.step()
    run.log(step, None, loss.item(), lr=run.learning_rate)
    if run.should_stop():
        break
