import os

# Headless figures, and one torch thread per process: tests run beside each other on 2 cores.
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_NUM_THREADS", "1")
