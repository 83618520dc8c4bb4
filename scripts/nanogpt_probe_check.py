"""nanoGPT's train.py, unmodified, swept with gradient accumulation: the in-script probe's
B_simple against gnsweep's per-example monitor on the same runs (docs/scripts.md).

    python scripts/nanogpt_probe_check.py /tmp/nanogpt    # a checkout of karpathy/nanoGPT

1. Writes data/shakespeare_char/{train,val}.bin and meta.pkl from local text (the Python
   standard library's sources: its prepare.py downloads), if they are not there.
2. Sweeps the unmodified train.py (2 layers, 64 wide, 32-token windows, 4 micro-batches a step,
   batch 16 and 64 sequences, 300 steps): every row of metrics.parquet gets b_simple.
3. Sweeps a copy, train_ref.py, with gnsweep's per-example monitor added (4 lines, the
   reference only; it changes no number of the training), the probe measuring it too: the same
   runs, the same steps; prints probe / per-example at steps 50-300.
"""

from __future__ import annotations

import glob
import os
import pickle
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

COMMAND = ("python {script} config/train_shakespeare_char.py --device=cpu --compile=False "
           "--dtype=float32 --n_layer=2 --n_head=2 --n_embd=64 --block_size=32 --dropout=0.0 "
           "--batch_size={{microbatch_size}} --gradient_accumulation_steps={{accumulation}} "
           "--learning_rate={{learning_rate}} --max_iters={{max_steps}} --eval_interval=100 "
           "--eval_iters=2 --log_interval=1 --decay_lr=False --always_save_checkpoint=True "
           "--out_dir={{run_dir}}")


def prepare(root: Path) -> None:
    folder = root / "data" / "shakespeare_char"
    if (folder / "train.bin").exists():
        return
    text = ""
    for name in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        text += Path(name).read_text(encoding="utf-8", errors="ignore")
        if len(text) > 1_200_000:
            break
    text = "".join(c for c in text if ord(c) < 128)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(len(ids) * 0.9)
    ids[:n].tofile(folder / "train.bin")
    ids[n:].tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as handle:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi},
                    handle)


def reference_copy(root: Path) -> None:
    source = (root / "train.py").read_text()
    for old, new in (
            ("# compile the model\nif compile:",
             "import gnsweep  # the reference: gnsweep's per-example monitor\n"
             "pe_monitor = gnsweep.NoiseScaleMonitor(model, method='per_example')\n"
             "pe_estimate = None\n# compile the model\nif compile:"),
            ("        scaler.scale(loss).backward()\n",
             "        scaler.scale(loss).backward()\n        pe_monitor.accumulate()\n"),
            ("    # clip the gradient\n",
             "    pe_estimate = pe_monitor.step()\n    # clip the gradient\n"),
            ('mfu {running_mfu*100:.2f}%")\n',
             'mfu {running_mfu*100:.2f}%")\n        print(f"pe iter {iter_num}: b_simple '
             '{pe_estimate.b_simple * block_size if pe_estimate else float(\'nan\')}")\n')):
        if source.count(old) != 1:
            sys.exit(f"train.py changed: {old.strip()!r} not found once")
        source = source.replace(old, new)
    (root / "train_ref.py").write_text(source)


def sweep(root: Path, script: str, folder: Path) -> None:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([sys.executable, "-m", "gnsweep", "launch", "--sweep-dir", str(folder), "-q",
                    "task=script", f"task.command={COMMAND.format(script=script)}",
                    r"task.log_pattern=iter (?P<step>\d+): loss (?P<loss>\S+),",
                    "task.step_offset=1", "task.examples_per_sample=32", "task.unit=tokens",
                    "task.accumulation=4", "sweep.batch_sizes=[16,64]",
                    "sweep.learning_rates=[0.003]", "sweep.targets=[0.5]",
                    "sweep.max_steps=300", "executor.workers=2"],
                   cwd=root, env=env, check=True)


def compare(folder: Path) -> None:
    for run in sorted((folder / "runs").iterdir()):
        pe = {}
        for line in (run / "stdout.log").read_text().splitlines():
            found = re.match(r"pe iter (\d+): b_simple (\S+)", line)
            if found:
                pe[int(found.group(1)) + 1] = float(found.group(2))
        rows = pq.read_table(run / "metrics.parquet").to_pandas().set_index("step")
        steps = [s for s in rows.index if s >= 50 and s in pe]
        ratio = np.array([rows.loc[s, "b_simple"] / pe[s] for s in steps])
        # The last steps the per-example line was printed for (the run may stop first).
        shown = "; ".join(f"{s}: {rows.loc[s, 'b_simple']:.0f} / {pe[s]:.0f}"
                          for s in (steps[len(steps) // 3], steps[2 * len(steps) // 3],
                                    steps[-1]))
        print(f"{run.name}: probe / per-example (tokens) {shown}; "
              f"steps {steps[0]}-{steps[-1]}: median "
              f"{np.median(ratio):.2f}, range {ratio.min():.2f}-{ratio.max():.2f}, within 25% "
              f"at {np.mean(abs(ratio - 1) <= 0.25):.0%} of the steps")


def main() -> None:
    root = Path(sys.argv[1]).resolve()
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/nanogpt_probe_check").resolve()
    prepare(root)
    reference_copy(root)
    sweep(root, "train.py", out / "plain")
    plain = [pq.read_table(r / "metrics.parquet").column("b_simple").to_numpy()
             for r in sorted((out / "plain" / "runs").iterdir())]
    print("unmodified train.py: rows with b_simple",
          [f"{np.isfinite(b).sum()}/{len(b)}" for b in plain])
    sweep(root, "train_ref.py", out / "reference")
    compare(out / "reference")


if __name__ == "__main__":
    main()
