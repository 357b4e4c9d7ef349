"""The caller's ``__main__`` in a spawned worker, as ``torch.multiprocessing.spawn`` has it.

A function defined in the launching script pickles as ``__main__.fn``. In a spawned
interpreter ``__main__`` is rallypoint's entry point, so the worker first loads the
launcher's main script (or module) under the name ``__mp_main__`` (its
``if __name__ == "__main__":`` block does not run) and makes it ``__main__``: what
multiprocessing's spawn start method does.
"""

from __future__ import annotations

import os
import runpy
import sys
import types

__all__ = ["describe_main", "load_main"]

MainRef = tuple[str, str]
"""``("path", script)`` or ``("module", name)``."""


def describe_main() -> MainRef | None:
    """How a spawned worker finds this process's ``__main__``; None when it has no file
    (an interactive session, ``python -c``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and getattr(spec, "name", None):
        name = str(spec.name)
        # a package's __main__ (``python -m pkg``, pytest) is not re-run, as in multiprocessing
        return None if name == "__main__" or name.endswith(".__main__") else ("module", name)
    path = getattr(main, "__file__", None)
    if isinstance(path, str) and path.endswith(".py") and os.path.exists(path):
        return ("path", os.path.abspath(path))
    return None


def load_main(ref: MainRef) -> None:
    """Run the main script or module as ``__mp_main__`` and install it as ``__main__``."""
    kind, name = ref
    module = types.ModuleType("__mp_main__")
    sys.modules["__mp_main__"] = module
    if kind == "path":
        namespace = runpy.run_path(name, run_name="__mp_main__")
    else:
        namespace = runpy.run_module(name, run_name="__mp_main__", alter_sys=False)
    module.__dict__.update(namespace)
    sys.modules["__main__"] = module
