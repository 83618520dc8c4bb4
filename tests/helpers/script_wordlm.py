"""A training script shaped like PyTorch's word-language-model example (examples/word_language_model
main.py), for the task=script tests: it knows nothing of gnsweep and prints for a person.

- the data: a token stream cut into `--batch_size` columns (`batchify`), each step `--bptt`
  tokens of every column, so a batch is batch_size sequences of bptt tokens;
- the model: bigram logits (a softmax regression of the next token on the current one), on
  tokens from a fixed Markov chain (its entropy is the loss floor), in numpy to start fast;
- plain SGD by hand (`p -= lr * grad`) after clipping the gradient's norm at `--clip`;
- the log: every `--log-interval` batches of an epoch, the counter restarting each epoch and
  the loss averaged over the interval, as main.py prints it:
  `| epoch   2 |    10/  535 batches | lr 20.00 | ms/batch 1.00 | loss  6.10 | ppl   445.86`
  (`batch` counted from 0 within the epoch, so the first line is after log_interval + 1 steps).

    python script_wordlm.py --batch_size 20 --lr 20 --clip 0.25 --epochs 6 --seed 0
"""

import argparse
import math
import os
import sys
import time

import numpy as np

parser = argparse.ArgumentParser(description="bigram language model on a Markov chain")
parser.add_argument("--lr", type=float, default=20.0, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--epochs", type=int, default=6, help="upper epoch limit")
parser.add_argument("--batch_size", type=int, default=20, metavar="N", help="batch size")
parser.add_argument("--bptt", type=int, default=8, help="sequence length")
parser.add_argument("--seed", type=int, default=1111, help="random seed")
parser.add_argument("--log-interval", type=int, default=10, metavar="N", help="report interval")
parser.add_argument("--tokens", type=int, default=20000, help="training tokens")
parser.add_argument("--vocab", type=int, default=16)
parser.add_argument("--save", type=str, default="model.npy", help="path to save the model")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each line")
parser.add_argument("--sleep-while", type=str, default=None,
                    help="wait (--sleep) only while this file exists")
args = parser.parse_args()

# The corpus: one fixed chain for every run (the data), sampled once.
chain = np.random.default_rng(123)
transition = chain.dirichlet(np.full(args.vocab, 0.3), size=args.vocab)
cumulative = np.cumsum(transition, axis=1)
tokens = np.empty(args.tokens, dtype=np.int64)
tokens[0] = 0
draws = chain.random(args.tokens)
for i in range(1, args.tokens):
    tokens[i] = min(int(np.searchsorted(cumulative[tokens[i - 1]], draws[i])), args.vocab - 1)

# batchify: drop what does not fill the columns; column j is one contiguous stream.
columns = len(tokens) // args.batch_size
if columns < args.bptt + 1:
    print(f"error: --batch_size {args.batch_size} leaves {columns} tokens a column, fewer than "
          f"--bptt {args.bptt} + 1", file=sys.stderr)
    sys.exit(2)
train_data = tokens[: columns * args.batch_size].reshape(args.batch_size, columns).T

rng = np.random.default_rng(args.seed)
weights = 0.01 * rng.standard_normal((args.vocab, args.vocab))


def loss_and_grad(source: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    logits = weights[source]
    logits = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    n = len(source)
    loss = -float(np.mean(np.log(probs[np.arange(n), target] + 1e-12)))
    probs[np.arange(n), target] -= 1.0
    grad = np.zeros_like(weights)
    np.add.at(grad, source, probs / n)
    return loss, grad


lr = args.lr
batches = len(train_data) // args.bptt
for epoch in range(1, args.epochs + 1):
    total_loss = 0.0
    start_time = time.time()
    for batch, i in enumerate(range(0, len(train_data) - 1, args.bptt)):
        seq_len = min(args.bptt, len(train_data) - 1 - i)
        source = train_data[i:i + seq_len].reshape(-1)
        target = train_data[i + 1:i + 1 + seq_len].reshape(-1)
        loss, grad = loss_and_grad(source, target)
        norm = float(np.sqrt((grad ** 2).sum()))
        if norm > args.clip:  # torch.nn.utils.clip_grad_norm_
            grad *= args.clip / (norm + 1e-6)
        weights -= lr * grad
        total_loss += loss
        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            ms = elapsed * 1000 / args.log_interval
            print(f"| epoch {epoch:3d} | {batch:5d}/{batches:5d} batches | lr {lr:02.2f} | "
                  f"ms/batch {ms:5.2f} | loss {cur_loss:5.2f} | ppl {math.exp(cur_loss):8.2f}",
                  flush=True)
            total_loss = 0.0
            start_time = time.time()
            if args.sleep_while is None or os.path.exists(args.sleep_while):
                time.sleep(args.sleep)
    print("-" * 89)
    print(f"| end of epoch {epoch:3d} |")
    print("-" * 89)
np.save(args.save, weights)
