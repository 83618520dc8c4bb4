"""The results in, text, figures and HTML out; no file is written here (gnsweep.commands writes).

- `views`: what the figures and the report show, decided from the results' tables (pure pandas).
- `answers`: the answer per target in plain words (bounds, poorly determined intervals).
- `console`: the fits as `gnsweep analyze` prints them.
- `figures`: a sweep's figures (matplotlib), and one as PNG bytes.
- `compare_figures`: the figures of `gnsweep compare` across sweeps.
- `html`: the one-page report as an HTML string.
"""
