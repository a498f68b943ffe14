"""A model's code file (``model.py``) imported as a module of its own, with the modules beside
it, as Triton's python backend has them.

In Triton each model's code runs in a process of its own (its stub) whose import path holds
the model's version folder and folder, after the installed packages: ``import helper`` finds
``helper.py`` beside ``model.py`` at the top of the file and inside ``initialize`` or
``execute`` alike, and ``from . import helper`` finds it in the version folder. Here many
models share one interpreter, so each model's files live under packages of its own:

- ``_orchestrion_models.m<N>_<label>`` (the version folder): ``model.py`` is its module
  ``model``, and ``from . import helper`` is ``…m<N>_<label>.helper``;
- ``_orchestrion_models.m<N>_<label>.__imports__`` (the version folder, then the model's
  folder): what ``import helper`` names. The model's code imports through an ``__import__``
  of its own (its modules' ``__builtins__``) that turns ``helper``, ``helper.sub`` into
  names under that package when ``helper`` is not an installed module and is a file or
  folder beside the model; everything else is imported as usual.

Nothing is added to ``sys.path`` and no helper is entered in ``sys.modules`` under its plain
name, so two models' ``helper.py`` never clash, a model serving while another loads never
sees the other's files, and the import system's own rules (packages, namespace folders,
circular imports, ``importlib.resources``, ``reload``) apply within each model.
``sys.modules["model"]`` answers for the running model's ``model.py`` (`CallersModel`).
`forget_code` drops a model's packages from ``sys.modules`` once it is unloaded.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ..protocols import Function, Model, ModelLoadError, TritonClass

_module_ids = itertools.count()

_MODELS = "_orchestrion_models"
"""The parent package of every model's code (empty)."""
_HELPERS = "__imports__"
"""The package, under a model's own, of the modules its plain imports find beside it."""
_ROOT_LOCK = threading.Lock()
_NOT_NAME = re.compile(r"\W")
"""What a package name may not hold (a model's folder name may: ``bert.v2``)."""


class _CodeImports:
    """One model's code: its packages, its folders, and its ``__import__``."""

    def __init__(self, package: str, folders: list[str]) -> None:
        self.package = package
        self.helpers = f"{package}.{_HELPERS}"
        self.folders = folders
        self.resolved = [Path(f).resolve() for f in folders]
        self.beside: set[str] = set()  # top-level names found to be the model's
        self._installed: set[str] = set()  # top-level names found to be installed modules
        self.builtins = {**vars(builtins), "__import__": self.import_}

    def is_beside(self, top: str) -> bool:
        """Whether ``import top`` names the model's own file or folder: not an installed
        module (those come first, as on the stub's path) and found in the model's folders.
        Both a yes and an installed module are remembered; a name found nowhere is looked
        for again (a file written later is found then)."""
        if top in self.beside:
            return True
        if top in self._installed:
            return False
        if _installed(top):
            self._installed.add(top)
            return False
        found = importlib.machinery.PathFinder.find_spec(top, self.folders) is not None
        if found:
            self.beside.add(top)
        return found

    def import_(
        self,
        name: str,
        globals: Mapping[str, Any] | None = None,
        locals: Mapping[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> ModuleType:
        """``__import__`` for the model's code: ``helper[.sub]`` beside the model is
        ``<package>.__imports__.helper[.sub]``."""
        top = name.partition(".")[0]
        if level != 0 or not top or not self.is_beside(top):
            if level == 0 and isinstance(sys.modules.get(top), CallersHelper):
                # Another model's file of that name: this model has none.
                raise ModuleNotFoundError(f"No module named {top!r}", name=top)
            return builtins.__import__(name, globals, locals, fromlist or (), level)
        module = builtins.__import__(f"{self.helpers}.{name}", globals, locals, fromlist or (), 0)
        _plain_names(name)
        if fromlist:
            return module
        return sys.modules[f"{self.helpers}.{top}"]  # ``import a.b`` binds ``a``


def _plain_names(name: str) -> None:
    """``sys.modules`` entries for ``name`` and its packages (``a``, ``a.b``): what code
    that finds modules by their plain names (C pickle) reads after importing them."""
    parts = name.split(".")
    for end in range(1, len(parts) + 1):
        plain = ".".join(parts[:end])
        sys.modules.setdefault(plain, CallersHelper(plain))


def _in_model_folders(origin: str) -> bool:
    file = Path(origin).resolve()
    return any(file.is_relative_to(f) for code in list(_LOADED.values()) for f in code.resolved)


def _installed(top: str) -> bool:
    """Whether the import system finds ``top`` without this module's finders, as a module
    or package of its own: not a folder without ``__init__.py``, and not a file of a loaded
    model (which a model may have put on ``sys.path``)."""
    present = sys.modules.get(top)
    if present is not None:
        if isinstance(present, CallersHelper):
            return False
        spec = getattr(present, "__spec__", None)
        origin = getattr(spec, "origin", None) if spec is not None else "unknown"
    elif top in sys.builtin_module_names:
        return True
    else:
        origin = _found_origin(top)
        if origin is None:
            return False
    if origin is None or origin == "namespace":
        return False  # a folder: a regular module beside the model comes first
    return origin in ("built-in", "frozen", "unknown") or not _in_model_folders(origin)


def _found_origin(top: str) -> str | None:
    """Where the import system's other finders find ``top`` ("namespace" for a folder)."""
    for finder in list(sys.meta_path):
        if finder is _FINDER or finder is _FALLBACK or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(top, None)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            return spec.origin or "namespace"
    return None


_LOADED: dict[str, _CodeImports] = {}
"""Each loaded model's code, by package; nothing in their folders is an installed module,
even where a model put one on ``sys.path``."""


def _record_of(name: str) -> _CodeImports | None:
    """The code of the model whose package holds module ``name``."""
    return _LOADED.get(".".join(name.split(".")[:2]))


class CallersHelper(ModuleType):
    """``sys.modules[name]`` for a module beside a model, found by its plain name where the
    model's ``__import__`` is not asked (unpickling an object whose class it defines,
    ``importlib.import_module``): each attribute read is that of the module of this name
    beside the innermost running model among the callers' frames."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def _target(self) -> ModuleType:
        record = _running(sys._getframe(2))
        if record is None or not record.is_beside(self.__name__.partition(".")[0]):
            raise AttributeError(
                f"module {self.__name__!r} is a model's own file, read from that model's code only"
            )
        return importlib.import_module(f"{record.helpers}.{self.__name__}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __dir__(self) -> list[str]:
        return dir(self._target())


def _running(frame: Any) -> _CodeImports | None:
    """The innermost model among ``frame`` and its callers."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if isinstance(name, str) and name.startswith(f"{_MODELS}."):
            record = _record_of(name)
            if record is not None:
                return record
        frame = frame.f_back
    return None


class CallersModel(ModuleType):
    """``sys.modules["model"]``: the ``model.py`` of the model whose code is running, as
    Triton's stub has it (each model's code is the top-level module ``model`` of its own
    process): Triton's QA models run ``unittest.main("model")`` in ``execute``. Each
    attribute read finds the innermost model ``model.py`` among the callers' frames."""

    def _callers(self) -> dict[str, Any]:
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if name.startswith(f"{_MODELS}.") and name.count(".") == 2 and name.endswith(".model"):
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


class _WithImports(importlib.abc.Loader):
    """A file's own loader, which first gives the module its model's ``__import__``. What
    else is asked of a loader (its source for tracebacks, resources) is the file loader's."""

    def __init__(self, loader: importlib.abc.Loader, record: _CodeImports) -> None:
        self._loader = loader
        self._record = record

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__dict__["__builtins__"] = self._record.builtins
        self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _ModelPackages(importlib.abc.MetaPathFinder):
    """The first finder of ``sys.meta_path``, for the modules under a model's packages only:
    the file as the path finder finds it, loaded with the model's ``__import__``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if "." in fullname and isinstance(sys.modules.get(fullname.split(".")[0]), CallersHelper):
            # A submodule of a model's module by its plain name (pickle, import_module):
            # never a module of its own under that name.
            return _FALLBACK.find_spec(fullname, path, target)
        if path is None or not fullname.startswith(f"{_MODELS}."):
            return None
        record = _record_of(fullname)
        if record is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None and spec.origin is not None:
            spec.loader = _WithImports(spec.loader, record)  # a file (not a namespace folder)
        return spec


class _Existing(importlib.abc.Loader):
    """Gives an import the module already made (its spec kept)."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module
        self._spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import set it to the spec it was given


class _PlainNames(importlib.abc.MetaPathFinder):
    """The last finder of ``sys.meta_path``: what goes around a model's ``__import__``
    (``importlib.import_module("helper")`` in its code) finds the model's own top-level
    modules too, through a `CallersHelper` of that name."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if path is not None and not isinstance(sys.modules.get(top), CallersHelper):
            return None  # a submodule of a real package
        record = _running(sys._getframe(1))
        if record is None or not record.is_beside(top):
            return None
        importlib.import_module(f"{record.helpers}.{fullname}")  # it exists: or an error
        if "." in fullname:
            _plain_names(fullname.rpartition(".")[0])  # its packages (the import enters it)
        return importlib.util.spec_from_loader(fullname, _Existing(CallersHelper(fullname)))


_FINDER = _ModelPackages()
_FALLBACK = _PlainNames()


def _package(name: str, path: list[str]) -> ModuleType:
    holder = ModuleType(name)
    holder.__path__ = path
    holder.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    holder.__spec__.submodule_search_locations = path
    return holder


def import_code_file(path: Path, label: str) -> ModuleType:
    """Import a model's code file (a ``model.py``) as a module of its own, under a package
    of its own (two versions of one model, or two models' helpers, never clash).

    A model may import modules that sit beside it, as Triton's python backend lets it:
    ``import helper`` finds ``helper.py`` (or a package ``helper/``) in the version folder,
    then in the model's folder, after the installed packages; ``from . import helper``
    finds it in the version folder; both at the top of the file and later (in
    ``initialize``, ``execute`` or a helper's functions).

    Raises:
        ModelLoadError: the file cannot be imported, or importing it raised (the message
            names the file and keeps the original error).
    """
    package = f"{_MODELS}.m{next(_module_ids)}_{_NOT_NAME.sub('_', label)}"
    module_name = f"{package}.{path.stem}"
    folders = [str(path.parent), str(path.parent.parent)]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{path}: cannot be imported as a Python module")
    record = _LOADED[package] = _CodeImports(package, folders)
    with _ROOT_LOCK:
        if _MODELS not in sys.modules:
            root = sys.modules[_MODELS] = ModuleType(_MODELS)
            root.__path__ = []
        if path.stem == "model" and "model" not in sys.modules:  # no module of that name
            sys.modules["model"] = CallersModel("model")
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
            sys.meta_path.append(_FALLBACK)
    sys.modules[package] = _package(package, [str(path.parent)])
    sys.modules[record.helpers] = _package(record.helpers, folders)
    module = importlib.util.module_from_spec(spec)
    module.__dict__["__builtins__"] = record.builtins
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        _forget(package)
        if not isinstance(exc, Exception):
            raise
        raise ModelLoadError(f"{path}: import failed: {type(exc).__name__}: {exc}") from exc
    return module


def forget_code(code: object) -> None:
    """Drop a model's packages (its ``model.py`` and the modules it imported beside it)
    from ``sys.modules``, once the model whose code is or defines ``code`` (its module, its
    class, or its ``execute`` function) is unloaded. Code still running keeps the modules
    it holds."""
    module = code.__name__ if isinstance(code, ModuleType) else getattr(code, "__module__", "")
    module = module if isinstance(module, str) else ""
    if module.startswith(f"{_MODELS}."):
        _forget(".".join(module.split(".")[:2]))


def forget_model(model: Model) -> None:
    """`forget_code` for a `Model` whose code came from a code file (others: nothing)."""
    code = model.code
    if isinstance(code, TritonClass):
        forget_code(code.model_class)
    elif isinstance(code, Function):
        forget_code(code.execute)


def _forget(package: str) -> None:
    record = _LOADED.pop(package, None)
    for name in [n for n in list(sys.modules) if n == package or n.startswith(f"{package}.")]:
        sys.modules.pop(name, None)
    if record is None:
        return
    # The plain names that no other loaded model has beside it (a proxy is made again by
    # the next import that needs it, in any case).
    still = {top for other in list(_LOADED.values()) for top in other.beside}
    for name in list(sys.modules):
        top = name.partition(".")[0]
        stale = top in record.beside and top not in still
        if stale and isinstance(sys.modules.get(name), CallersHelper):
            sys.modules.pop(name, None)
