"""A Hugging Face Trainer script as a user has it, plus the one line that makes it a sweep's
run: `callbacks=[NoiseScaleCallback()]`. Linear regression (gnsweep's linreg task as the data),
a plain torch model with the loss in its output.

    python script_hf.py --bs 32 --lr 0.05 --out DIR
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from gnsweep.integrations.transformers import NoiseScaleCallback
from gnsweep.tasks import linreg

parser = argparse.ArgumentParser()
parser.add_argument("--bs", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--out", default="out")
args = parser.parse_args()
torch.set_num_threads(1)
task = linreg.make(linreg.Options(dim=16), seed=0)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = task.model()

    def forward(self, x, labels=None):
        out = self.linear(x)
        return {"loss": task.output_loss(out, labels), "logits": out}


x, y = task.sample(args.bs * 200, torch.Generator().manual_seed(1))
data = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
training = TrainingArguments(output_dir=args.out, per_device_train_batch_size=args.bs,
                             learning_rate=args.lr, lr_scheduler_type="constant",
                             optim="sgd", weight_decay=0.0, num_train_epochs=1, logging_steps=1,
                             report_to="none", save_strategy="no", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, seed=0)
trainer = Trainer(model=Model(), args=training, train_dataset=data,
                  callbacks=[NoiseScaleCallback()])  # the one added line
trainer.train()
