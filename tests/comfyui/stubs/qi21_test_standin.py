"""Empty stand-ins for `torchvision` and `torchaudio`, for the ComfyUI test server only.

ComfyUI imports torchvision and torchaudio at start-up (e.g. `comfy/ldm/cosmos/model.py`:
`from torchvision import transforms`), but neither can be installed beside the local CPU build of torch used
here. Our pack uses neither. The test fixture (tests/comfyui/server.py) puts this folder on the server's
PYTHONPATH only when the ComfyUI interpreter cannot import the real packages; it is never part of the pack.

Any attribute or submodule resolves to a placeholder class: importing, subclassing, reading attributes and
using it in default arguments work; calling it raises, naming the missing package.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__qualname__} is an empty test stand-in: the real package is not installed.")

    def __or__(cls, other):  # used in type hints such as `Foo | None`
        return cls

    __ror__ = __or__


def _placeholder(qualname: str) -> type:
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


class _StandinModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        value = _placeholder(full)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        module.__version__ = "0.0.0+qi21-test-standin"


def install(package: types.ModuleType) -> None:
    """Turn the (empty) package `package` into a stand-in whose submodules are stand-ins too."""
    package.__class__ = _StandinModule
    package.__version__ = "0.0.0+qi21-test-standin"
    if not any(isinstance(f, _Finder) and f.root == package.__name__ for f in sys.meta_path):
        sys.meta_path.append(_Finder(package.__name__))
