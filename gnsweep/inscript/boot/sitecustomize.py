"""gnsweep's startup hook for a script run (this folder is put first on PYTHONPATH by gnsweep).

It does nothing unless GNSWEEP_NOISE_PROBE is set; then it arranges for the noise probe
(`gnsweep.inscript.probe`) to install itself once `torch.optim` is imported (a script that
never imports torch pays nothing). It then runs the `sitecustomize` this one hides, if any,
so that the interpreter's own startup hook still runs. It never raises: any error turns the
probe off, said once on stderr.
"""

import os
import sys


def _chain() -> None:
    """Run the next `sitecustomize` on sys.path (the one this module shadows), if any."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _watch() -> None:
    settings = os.environ.get("GNSWEEP_NOISE_PROBE")
    if not settings:
        return
    home = os.environ.get("GNSWEEP_NOISE_PROBE_HOME", "")
    try:
        import gnsweep.inscript.probe as probe
    except ImportError:
        if not home:
            raise
        sys.path.append(home)  # a script run by another interpreter than gnsweep's
        import gnsweep.inscript.probe as probe
    probe.when_torch_optim(settings)


try:
    _watch()
except Exception as err:  # never into the script
    sys.stderr.write(f"gnsweep: noise scale not measured: the probe could not start ({err!r})\n")
try:
    _chain()
except Exception as err:
    sys.stderr.write(f"gnsweep: the interpreter's own sitecustomize failed: {err!r}\n")
