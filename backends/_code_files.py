"""A model's code file (``model.py``) imported as a module of its own, with the modules beside
it, as Triton's python backend has them: in Triton each model's code runs in a process of its
own (its stub) whose import path holds the model's folders, so ``import helper`` finds
``helper.py`` beside ``model.py`` at the top of the file and inside ``initialize`` or
``execute`` alike. Here many models share one interpreter, so each model's helpers are its
own:

- at the file's import, its folders are on ``sys.path`` and the helpers it imports are
  entered in ``sys.modules`` only while it imports; they are then kept with the model;
- later, an import that nothing else finds (an import inside ``initialize`` or ``execute``)
  is looked up by `_ModelImports` among the folders of the model whose code is running (the
  innermost model's frame among the caller's frames): the helper already imported, or the
  file, imported then for that model alone under a name of its own;
- ``sys.modules["model"]`` answers for the running model's own ``model.py`` (`CallersModel`).

Two models' ``helper.py`` never clash, and an installed package of the same name wins, as it
does in Triton (the model's folders come after the installed packages on its path).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import attrs

from ..protocols import ModelLoadError

_module_ids = itertools.count()

_MODELS = "_orchestrion_models"
"""The parent package of every model's code (empty)."""
_RECORD = "__orchestrion_imports__"
"""The name, in a model's module (and its helpers), of its `_CodeImports`."""
_IMPORTING = threading.Lock()
"""One model's code is imported at a time: the import path is changed while it is."""


@attrs.define
class _CodeImports:
    """One model's code: its package name, folders and the helpers it has imported."""

    package: str
    folders: list[str]
    helpers: dict[str, ModuleType] = attrs.Factory(dict)


class CallersModel(ModuleType):
    """``sys.modules["model"]``: the ``model.py`` of the model whose code is running, as
    Triton's stub has it (each model's code is the top-level module ``model`` of its own
    process): Triton's QA models run ``unittest.main("model")`` in ``execute``. Each
    attribute read finds the innermost model ``model.py`` among the callers' frames."""

    def _callers(self) -> dict[str, Any]:
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if name.startswith(f"{_MODELS}.") and name.endswith(".model"):
                return frame.f_globals
            frame = frame.f_back  # type: ignore[assignment]
        raise AttributeError(
            "module 'model' is a model's own model.py, read from that model's code only"
        )

    def __getattr__(self, name: str) -> Any:
        try:
            return self._callers()[name]
        except KeyError:
            raise AttributeError(f"module 'model' has no attribute {name!r}") from None

    def __dir__(self) -> list[str]:
        return list(self._callers())


class _Existing(importlib.abc.Loader):
    """Gives a module already imported for this model (its helper) to an import again."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._module

    def exec_module(self, module: ModuleType) -> None:
        pass


class _Helper(importlib.abc.Loader):
    """Imports a helper file for one model: the module knows its model, and is kept with it."""

    def __init__(self, record: _CodeImports, name: str, file: importlib.abc.Loader) -> None:
        self._record = record
        self._name = name
        self._file = file  # the file's own loader (source, bytecode or extension)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._file.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        setattr(module, _RECORD, self._record)
        self._file.exec_module(module)
        self._record.helpers[self._name] = module


class _ModelImports(importlib.abc.MetaPathFinder):
    """The last finder of ``sys.meta_path``: a top-level import that no other finder found,
    made by a model's code, is looked up among that model's folders."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or "." in fullname:
            return None  # a submodule: its package's own path finds it
        record = _running_model(sys._getframe(1))
        if record is None:
            return None
        # A name of this model's own: never ``sys.modules[fullname]``, so that another
        # model's module of the same name stays its own.
        qualified = f"{record.package}.__imports__.{fullname}"
        known = record.helpers.get(fullname)
        if known is not None:
            return importlib.util.spec_from_loader(qualified, _Existing(known))
        found = importlib.machinery.PathFinder.find_spec(fullname, record.folders)
        if found is None or found.origin is None or found.loader is None:
            return None
        # The file's loader again, for the name of the model's own (it checks the name).
        file = type(found.loader)(qualified, found.origin)  # type: ignore[call-arg]
        return importlib.util.spec_from_file_location(
            qualified,
            found.origin,
            loader=_Helper(record, fullname, file),
            submodule_search_locations=found.submodule_search_locations,
        )


_FINDER = _ModelImports()


def _running_model(frame: FrameType | None) -> _CodeImports | None:
    """The imports of the innermost model whose code is among ``frame`` and its callers."""
    while frame is not None:
        record = frame.f_globals.get(_RECORD)
        if isinstance(record, _CodeImports):
            return record
        frame = frame.f_back
    return None


def import_code_file(path: Path, label: str) -> ModuleType:
    """Import a model's code file (a ``model.py``) as a module of its own, never entered in
    ``sys.modules`` (two versions of one model, or two models' helpers, never clash).

    A model may import modules that sit beside it, as Triton's python backend lets it
    (it puts the version folder and the model's folder on the import path of the model's
    own process): ``import helper`` finds ``helper.py`` in the version folder, then in the
    model's folder (after the installed packages, as in Triton), at the top of the file or
    later (in ``initialize`` or ``execute``); ``from . import helper`` finds it in the
    version folder at the top of the file.

    Raises:
        ModelLoadError: the file cannot be imported, or importing it raised (the message
            names the file and keeps the original error).
    """
    package = f"{_MODELS}.m{next(_module_ids)}_{label}"
    module_name = f"{package}.{path.stem}"
    folders = [str(path.parent), str(path.parent.parent)]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    record = _CodeImports(package, folders)
    setattr(module, _RECORD, record)
    holder = ModuleType(package)
    holder.__path__ = [str(path.parent)]  # `from . import helper`: the version folder
    with _IMPORTING:
        if _MODELS not in sys.modules:
            root = sys.modules[_MODELS] = ModuleType(_MODELS)
            root.__path__ = []
        if path.stem == "model" and "model" not in sys.modules:  # no module of that name
            sys.modules["model"] = CallersModel("model")
        if _FINDER not in sys.meta_path:
            sys.meta_path.append(_FINDER)
        before = set(sys.modules)
        added = [f for f in folders if f not in sys.path]
        sys.path.extend(added)
        sys.modules[package] = holder
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise ModelLoadError(f"{path}: import failed: {type(exc).__name__}: {exc}") from exc
        finally:
            for folder in added:
                sys.path.remove(folder)
            for name in set(sys.modules) - before:
                helper = sys.modules[name]
                if name.startswith(package) or _beside(helper, folders):
                    del sys.modules[name]
                    if "." not in name and not name.startswith(_MODELS):
                        record.helpers[name] = helper  # `import helper` again, later
                        setattr(helper, _RECORD, record)
    return module


def forget_code(code: object) -> None:
    """Drop what a model's later imports entered in ``sys.modules`` (its helpers, under
    names of its own): called once the model whose code defines ``code`` (its class, or its
    ``execute`` function) is unloaded. The model keeps its helpers: an import after this
    finds them again."""
    execute = getattr(code, "execute", code)
    record = getattr(execute, "__globals__", {}).get(_RECORD)
    if not isinstance(record, _CodeImports):
        return
    with _IMPORTING:
        for name in [n for n in sys.modules if n.startswith(f"{record.package}.")]:
            del sys.modules[name]
        sys.modules.pop(record.package, None)


def _beside(module: ModuleType, folders: list[str]) -> bool:
    """Whether ``module`` was imported from a model's folders (its helpers, packages of
    helpers included)."""
    file = getattr(module, "__file__", None)
    return file is not None and any(Path(file).is_relative_to(f) for f in folders)
