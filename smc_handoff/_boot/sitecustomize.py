"""smc-run's bootstrap: upgrade this interpreter's TCP sockets, then run the real sitecustomize.

``smc-run`` puts this directory first on ``PYTHONPATH`` (inherited by child interpreters, as
``LD_PRELOAD`` is by smc_run's children). It must never break the program: any failure is
reported on stderr and the program runs on plain TCP.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _install() -> None:
    try:
        import smc_handoff.run as run
    except ImportError:  # a child interpreter without smcd installed: use smc-run's copy
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        import smc_handoff.run as run
    run.install_from_env()


def _chain() -> None:
    """Run the sitecustomize this one shadows (Debian's, a venv's...), if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    _install()
except Exception as e:  # pragma: no cover - reported, never fatal
    print(f"smc-run: not upgrading sockets: {e!r}", file=sys.stderr)
finally:
    _chain()
