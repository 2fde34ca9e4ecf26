"""Make ``import streaming`` (mosaicml-streaming 0.13) work beside CPU torch without torchvision.

streaming's package ``__init__`` imports ``streaming.vision``, which imports
``torchvision.datasets.VisionDataset`` and ``torchvision.transforms.functional.to_tensor`` at
module level. PyPI's torchvision wheels do not import beside CPU torch 2.13 ("operator
torchvision::nms does not exist"), and megaloop never uses streaming's vision datasets.

``ensure_streaming_importable()`` is the one place that deals with this: if a working torchvision
is importable it is used untouched; otherwise a minimal stub is placed in ``sys.modules`` only for
the duration of ``import streaming`` and removed afterwards, so other libraries (transformers,
lm-eval) still see torchvision as absent. Importing ``megaloop.data`` calls it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Any

_LOCK = threading.Lock()
_STUB_NAMES = ("torchvision", "torchvision.datasets", "torchvision.transforms",
               "torchvision.transforms.functional")


def _real_torchvision_works() -> bool:
    """True if a real torchvision is installed and imports cleanly (never leaves debris)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision.datasets  # noqa: F401
        import torchvision.transforms.functional  # noqa: F401
        return True
    except Exception:  # broken wheel: RuntimeError from the C++ op registry, ImportError, ...
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False


def _make_stub() -> dict[str, types.ModuleType]:
    """Build the four stub modules streaming touches at import."""
    import torch.utils.data

    class VisionDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
        """Stand-in base class; streaming's vision datasets are unusable without torchvision."""

        def __init__(self, root: Any = None, transforms: Any = None, transform: Any = None,
                     target_transform: Any = None) -> None:
            self.root = root
            self.transforms = transforms
            self.transform = transform
            self.target_transform = target_transform

    def to_tensor(pic: Any) -> Any:
        """PIL image / HWC uint8 array -> CHW float tensor in [0, 1] (torchvision semantics)."""
        import numpy as np

        arr = np.asarray(pic)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        out = torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
        return out.float().div(255.0) if out.dtype == torch.uint8 else out.float()

    mods: dict[str, types.ModuleType] = {}
    for name in _STUB_NAMES:
        mod = types.ModuleType(name, "megaloop stub: torchvision is absent or broken")
        # A spec keeps importlib.util.find_spec() from raising while the stub is installed.
        mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        mod.__path__ = []  # type: ignore[attr-defined]
        mods[name] = mod
    mods["torchvision"].__version__ = "0.0.0+megaloop.stub"  # type: ignore[attr-defined]
    mods["torchvision"].datasets = mods["torchvision.datasets"]  # type: ignore[attr-defined]
    mods["torchvision"].transforms = mods["torchvision.transforms"]  # type: ignore[attr-defined]
    mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]  # type: ignore[attr-defined]
    mods["torchvision.datasets"].VisionDataset = VisionDataset  # type: ignore[attr-defined]
    mods["torchvision.transforms.functional"].to_tensor = to_tensor  # type: ignore[attr-defined]
    return mods


def ensure_streaming_importable() -> types.ModuleType:
    """Import and return the ``streaming`` package, stubbing torchvision only if needed."""
    with _LOCK:
        if "streaming" in sys.modules and hasattr(sys.modules["streaming"], "StreamingDataset"):
            return sys.modules["streaming"]
        if _real_torchvision_works():
            import streaming

            return streaming
        stub = _make_stub()
        saved = {n: sys.modules.get(n) for n in _STUB_NAMES}
        sys.modules.update(stub)
        try:
            import streaming
        finally:
            for name, old in saved.items():
                if old is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = old
        return streaming
