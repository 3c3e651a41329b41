"""Patch a module when the program imports it, or now when it already has.

Importing ``ssl`` or ``asyncio`` up front to patch them would cost every smc-run process (and
every program that uses :mod:`smc_handoff`) milliseconds it may never need; a finder at the head
of ``sys.meta_path`` runs the patch right after the module's own code instead. Kept apart from
:mod:`smc_handoff.run` so that a library user's first SMC connection can ask for the ``ssl``
patch without loading smc-run's machinery.
"""

from __future__ import annotations

import importlib.util
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["PatchOnImport", "patch_on_import"]


class PatchOnImport:
    """Runs ``patch(module)`` once the module named ``name`` has been executed (a failing
    patch is reported, never raised: the program then runs on TCP). A finder and a loader by
    their methods, as the import system takes them: ``importlib.abc`` costs a clean
    interpreter ~7 ms to import (it pulls in ``importlib.resources`` and ``tempfile``)."""

    def __init__(self, name: str, patch: Any) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        patch = self.patch

        class Loader:
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                exec_module(module)
                try:
                    patch(module)
                except Exception as e:  # never break the program: it runs on TCP
                    print(f"smc-run: not upgrading {name}: {e!r}", file=sys.stderr)

        spec.loader = Loader()  # type: ignore[assignment]  # (a loader by its methods)
        return spec


def patch_on_import(name: str, patch: Any) -> None:
    """``patch`` the module ``name`` now if it is imported, else when it is (one finder per
    name: a second request for a name already waited for is dropped)."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(f, PatchOnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport(name, patch))
