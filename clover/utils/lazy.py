"""Run a callback once a module has been imported, without importing it ourselves.

`after_import("transformers", f)` calls `f()` at once when transformers is already loaded, or else
right after the first `import transformers` finishes (a one-shot finder on `sys.meta_path` wraps
that module's loader). This is how `import clover` stays cheap and still registers the Auto classes
for anyone who goes on to use transformers.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_call(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_then_call  # this spec's own loader object: nothing else sees it
        return spec


def after_import(name: str, callback: Callable[[], None]) -> None:
    if name in sys.modules:
        callback()
        return
    if not any(isinstance(f, _AfterImport) and f.name == name and f.callback is callback for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))
