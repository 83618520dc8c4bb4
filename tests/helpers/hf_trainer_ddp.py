"""A Hugging Face Trainer run with `NoiseScaleCallback`, started by the tests under torchrun
(2 CPU processes, gloo) or as one process: linreg at fixed parameters (learning rate 0), the
pooled B_simple printed as JSON by rank 0. Argument: the global batch, the batches, the output
folder."""

from __future__ import annotations

import json
import math
import os
import sys

import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"

import transformers

from gnsweep.integrations.transformers import NoiseScaleCallback
from gnsweep.tasks import linreg


class LinRegModel(nn.Module):
    def __init__(self, task: linreg.LinReg) -> None:
        super().__init__()
        self.task = task
        self.linear = task.model()

    def forward(self, x, labels=None):
        out = self.linear(x)
        return {"loss": self.task.output_loss(out, labels), "logits": out}


def main(batch: int, batches: int, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    task = linreg.make(linreg.Options(dim=64, condition=4.0), seed=0)
    model = LinRegModel(task)
    x, y = task.sample(batch * batches, torch.Generator().manual_seed(0))
    rows = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    args = transformers.TrainingArguments(
        output_dir=out, num_train_epochs=1, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, logging_steps=batches, dataloader_num_workers=0, seed=0,
        learning_rate=0.0, per_device_train_batch_size=batch // world // 2,
        gradient_accumulation_steps=2, bf16=True)
    callback = NoiseScaleCallback(ema_steps=math.inf)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   callbacks=[callback])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        logged = [e for e in trainer.state.log_history if "b_simple" in e]
        truth = task.truth(model.linear)
        print(json.dumps({"b_simple": logged[-1]["b_simple"], "truth": truth.b_simple,
                          "unavailable": callback.unavailable}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
