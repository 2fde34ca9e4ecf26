"""Make ``import streaming`` (mosaicml-streaming 0.13) work beside CPU torch without torchvision.

streaming's package ``__init__`` eagerly imports its ``vision``, ``text`` and ``multimodal``
sub-packages. ``streaming.vision`` imports ``torchvision`` at module level, and PyPI's torchvision
wheels do not import beside CPU torch 2.13 ("operator torchvision::nms does not exist");
``streaming.text`` imports transformers (~3 s). megaloop uses none of the three.

This module is the one place that handles it. ``install_import_hook()`` puts a meta-path finder
in front of the others that turns exactly those three sub-packages into *deferred* modules: a
module object with the real ``__spec__``/``__file__``/``__path__`` whose code runs on the first
access of a public attribute (``streaming.vision.StreamingCIFAR10``). Dunder look-ups (as done by
``inspect``/``pickle`` walking ``sys.modules``) never trigger it, and a failing deferred import
surfaces as an ``AttributeError`` naming the cause. No fake torchvision is ever installed: with a
working torchvision the vision datasets work on first use; without one they say why not.
``import megaloop.data`` installs the hook, after which ``import streaming`` works everywhere.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Any, Sequence

DEFERRED = frozenset({"streaming.vision", "streaming.text", "streaming.multimodal"})
_LOCK = threading.RLock()


class _DeferredModule(types.ModuleType):
    """Placeholder for a sub-package; loads the real one on first public attribute access."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        real = _load_real(self)
        return getattr(real, attr)


def _load_real(proxy: _DeferredModule) -> types.ModuleType:
    """Execute the real module behind ``proxy`` once and swap it into ``sys.modules``."""
    name = proxy.__name__
    with _LOCK:
        current = sys.modules.get(name)
        if current is not None and current is not proxy:
            return current
        spec: importlib.machinery.ModuleSpec = proxy.__dict__["__real_spec__"]
        real = importlib.util.module_from_spec(spec)
        sys.modules[name] = real
        try:
            assert spec.loader is not None
            spec.loader.exec_module(real)
        except Exception as err:
            sys.modules[name] = proxy
            raise AttributeError(f"{name} is unavailable: {type(err).__name__}: {err} "
                                 "(megaloop does not use it)") from err
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, real)
        return real


class _DeferredLoader(importlib.abc.Loader):
    def __init__(self, real_spec: importlib.machinery.ModuleSpec) -> None:
        self.real_spec = real_spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _DeferredModule(spec.name)
        mod.__dict__["__real_spec__"] = self.real_spec
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing runs now; see ``_DeferredModule.__getattr__``."""


class _DeferStreamingExtras(importlib.abc.MetaPathFinder):
    """Meta-path finder handing out deferred modules for streaming's optional sub-packages."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in DEFERRED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            real = finder.find_spec(fullname, path, target)
            if real is not None:
                break
        else:
            return None
        if real.loader is None or not hasattr(real.loader, "exec_module"):
            return real
        spec = importlib.machinery.ModuleSpec(fullname, _DeferredLoader(real),
                                              origin=real.origin,
                                              is_package=real.submodule_search_locations is not None)
        spec.submodule_search_locations = real.submodule_search_locations
        spec.has_location = real.has_location
        return spec


def install_import_hook() -> None:
    """Idempotently install the finder (cheap; imports nothing)."""
    with _LOCK:
        if not any(isinstance(f, _DeferStreamingExtras) for f in sys.meta_path):
            sys.meta_path.insert(0, _DeferStreamingExtras())


def ensure_streaming_importable() -> types.ModuleType:
    """Install the hook and return the imported ``streaming`` package."""
    install_import_hook()
    import streaming

    return streaming
