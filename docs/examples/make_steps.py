"""Write docs/examples/steps.csv: steps-to-target from known laws, with 3% noise.

S(B) = S_min + E_min/B (eq. 2.11) at the best learning rate eps_opt(B) = eps_max/(1 + B_noise/B)
(section 2), and a bowl exp(0.5 ln(lr/eps_opt)^2) around it. Truth per target:
loss 2.0: S_min 500, E_min 20000 (B_crit 40); loss 1.5: S_min 1000, E_min 64000 (B_crit 64);
eps_max 2.0 and B_noise 50 at both. Run: python docs/examples/make_steps.py
"""

import csv
from pathlib import Path

import numpy as np

rng = np.random.default_rng(0)
rows = []
for target, s_min, e_min, b_simple in ((2.0, 500, 20000, 35.0), (1.5, 1000, 64000, 55.0)):
    for b in (8, 16, 32, 64, 128, 256, 512, 1024):
        eps_opt = 2.0 / (1 + 50 / b)
        for lr in (0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0):
            bowl = np.exp(0.5 * np.log(lr / eps_opt) ** 2)
            steps = (s_min + e_min / b) * bowl * np.exp(rng.normal(0, 0.03))
            rows.append([b, lr, target, round(float(steps)), round(b_simple * (1 + rng.normal(
                0, 0.1)), 1)])
with open(Path(__file__).with_name("steps.csv"), "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["batch_size", "learning_rate", "target", "steps", "b_simple"])
    writer.writerows(rows)
