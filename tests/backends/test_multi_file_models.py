"""Models made of several files, as Triton's python backend allows: a ``model.py`` that
imports modules beside it (``import helper`` from its version folder or its model's folder,
``from . import helper``, a package of helpers), two models whose helpers share a name,
and a helper that is missing or fails. Also a BLS call outside ``execute``, in Triton's
words."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import pickle
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio

import orchestrion
from orchestrion import ModelLoadError

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 2 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 2 ] }} ]
"""

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

import helper                      # the version folder: {name}/1/helper.py
from model_common import OFFSET    # the model's folder: {name}/model_common.py
from . import relative             # from . : {name}/1/relative.py
from tools.scale import SCALE      # a package of helpers: {name}/1/tools/


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            y = (x * helper.FACTOR + OFFSET + relative.EXTRA) * SCALE
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y.astype(np.float32))]))
        return answers
"""


def _model(root: Path, name: str, factor: int, offset: int, extra: int, scale: int) -> None:
    version = root / name / "1"
    (version / "tools").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (version / "model.py").write_text(MODEL.format(name=name))
    (version / "helper.py").write_text(f"FACTOR = {factor}\n")
    (root / name / "model_common.py").write_text(f"OFFSET = {offset}\n")
    (version / "relative.py").write_text(f"EXTRA = {extra}\n")
    (version / "tools" / "__init__.py").write_text("")
    (version / "tools" / "scale.py").write_text(f"SCALE = {scale}\n")


async def test_each_model_imports_its_own_helpers(tmp_path: Path) -> None:
    """Two models whose helper files have the same names and other contents: each computes
    with its own, and none of their helpers stays in sys.modules (nor on the import path)
    to be found by the other, or by later code."""
    _model(tmp_path, "first", factor=2, offset=1, extra=0, scale=1)
    _model(tmp_path, "second", factor=10, offset=0, extra=5, scale=3)
    path_before = list(sys.path)
    async with orchestrion.open_server(model_repository=tmp_path) as server:
        x = np.array([1.0, 2.0], np.float32)
        first = (await server.infer("first", {"X": x})).outputs["Y"]
        second = (await server.infer("second", {"X": x})).outputs["Y"]
    assert first.tolist() == [3.0, 5.0]  # x * 2 + 1
    assert second.tolist() == [45.0, 75.0]  # (x * 10 + 5) * 3
    for name in ("helper", "model_common", "relative", "tools", "tools.scale"):
        assert name not in sys.modules
    assert sys.path == path_before


async def test_a_reload_reads_the_helpers_again(tmp_path: Path) -> None:
    """A helper changed on disk is read again when its model reloads (it is not cached
    from the first load)."""
    _model(tmp_path, "first", factor=2, offset=1, extra=0, scale=1)
    async with orchestrion.open_server(model_repository=tmp_path, load_models=["first"]) as server:
        x = np.array([1.0, 2.0], np.float32)
        assert (await server.infer("first", {"X": x})).outputs["Y"].tolist() == [3.0, 5.0]
        (tmp_path / "first" / "1" / "helper.py").write_text("FACTOR = 100\n")
        await server.load_model("first")
        assert (await server.infer("first", {"X": x})).outputs["Y"].tolist() == [101.0, 201.0]


@pytest.mark.parametrize(
    ("helper", "said"),
    [
        (None, "ModuleNotFoundError: No module named 'helper'"),
        ("raise RuntimeError('helper broke')\n", "RuntimeError: helper broke"),
    ],
)
async def test_a_missing_or_failing_helper_is_a_load_error_naming_the_file(
    tmp_path: Path, helper: str | None, said: str
) -> None:
    """The model's load fails with the file and the helper's own error; nothing of it is
    left in sys.modules."""
    _model(tmp_path, "broken", factor=2, offset=1, extra=0, scale=1)
    target = tmp_path / "broken" / "1" / "helper.py"
    if helper is None:
        target.unlink()
    else:
        target.write_text(helper)
    with pytest.raises(ModelLoadError) as caught:
        async with orchestrion.open_server(model_repository=tmp_path):
            pass
    assert said in str(caught.value)
    assert "broken/1/model.py" in str(caught.value)
    assert "model_common" not in sys.modules


async def test_a_bls_call_outside_execute_is_refused_in_tritons_words(tmp_path: Path) -> None:
    """A BLS call from initialize fails the load, and one from finalize is logged, each
    with Triton's sentence ("BLS is only supported during the 'execute' function."), which
    Triton's QA looks for."""
    code = """
import numpy as np
import triton_python_backend_utils as pb_utils


def _call():
    x = pb_utils.Tensor("X", np.ones(2, np.float32))
    pb_utils.InferenceRequest(model_name="x", inputs=[x], requested_output_names=["Y"]).exec()


class TritonPythonModel:
    def initialize(self, args):
        if "{when}" == "initialize":
            _call()

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)])]

    def finalize(self):
        if "{when}" == "finalize":
            _call()
"""
    said = "BLS is only supported during the 'execute' function."
    for when in ("initialize", "finalize"):
        (tmp_path / when / "1").mkdir(parents=True)
        (tmp_path / when / "config.pbtxt").write_text(CONFIG.format(name=when))
        (tmp_path / when / "1" / "model.py").write_text(code.replace("{when}", when))
    with pytest.raises(ModelLoadError, match=re.escape(said)):
        async with orchestrion.open_server(model_repository=tmp_path, load_models=["initialize"]):
            pass
    with _captured() as records:
        async with orchestrion.open_server(model_repository=tmp_path, load_models=["finalize"]):
            pass
    assert any(said in record for record in records), records


@contextlib.contextmanager
def _captured() -> Iterator[list[str]]:
    """The orchestrion log's records (message and traceback) while the block runs."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Keep()
    logger = logging.getLogger("orchestrion")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


SELF_TESTING = """
import sys
import unittest

import numpy as np
import triton_python_backend_utils as pb_utils

VALUE = {value}


class Checks(unittest.TestCase):
    def test_value(self):
        self.assertEqual(VALUE, {value})


class TritonPythonModel:
    def execute(self, requests):
        import model  # this model.py, as in Triton's stub

        result = unittest.main("model", exit=False, verbosity=0).result
        passed = float(result.wasSuccessful() and result.testsRun == 1)
        out = np.array([model.VALUE, passed], np.float32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", out)]) for _ in requests]
"""


async def test_a_models_code_reads_itself_as_module_model(tmp_path: Path) -> None:
    """Triton's QA models run ``unittest.main("model")`` in ``execute``: ``import model``
    gives the model.py of the model whose code runs (two models, each its own), and the
    server's own flags are not what unittest reads (``orchestrion serve`` leaves the
    program's name alone in ``sys.argv``)."""
    for name, value in (("first", 1), ("second", 2)):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(CONFIG.format(name=name))
        (tmp_path / name / "1" / "model.py").write_text(SELF_TESTING.format(value=value))
    saved = sys.argv[1:]
    sys.argv[1:] = []
    try:
        async with orchestrion.open_server(tmp_path) as server:
            x = {"X": np.zeros(2, np.float32)}
            first = await server.infer("first", x)
            second = await server.infer("second", x)
    finally:
        sys.argv[1:] = saved
    assert first.outputs["Y"].tolist() == [1.0, 1.0]
    assert second.outputs["Y"].tolist() == [2.0, 1.0]


async def test_a_model_raising_system_exit_fails_its_request_only(tmp_path: Path) -> None:
    """``sys.exit()`` in a model's ``execute`` (unittest.main with its default exit=True)
    is the request's error; the server goes on serving."""
    (tmp_path / "leaves" / "1").mkdir(parents=True)
    (tmp_path / "leaves" / "config.pbtxt").write_text(CONFIG.format(name="leaves"))
    (tmp_path / "leaves" / "1" / "model.py").write_text(
        "import sys\n\n\nclass TritonPythonModel:\n"
        "    def execute(self, requests):\n        sys.exit(3)\n"
    )
    async with orchestrion.open_server(tmp_path) as server:
        for _ in range(2):
            with pytest.raises(orchestrion.InferenceError, match=r"SystemExit\(3\)"):
                await server.infer("leaves", {"X": np.zeros(2, np.float32)})


LATE_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

import helper                      # imported with the file


class TritonPythonModel:
    def initialize(self, args):
        import helper as again     # the same module, not a second copy
        import late                # first imported here: {name}/1/late.py
        from late import BASE

        assert again is helper, (again, helper)
        self.base = BASE + late.BONUS
        helper.STATE.append("initialized")

    def execute(self, requests):
        import helper as again
        assert again.STATE == ["initialized"], again.STATE
        answers = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            y = helper.scaled(x) + self.base   # helper.scaled imports `scaler` itself
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y.astype(np.float32))]))
        if {missing}:
            import not_beside_any_model
        return answers
"""


def _late_model(root: Path, name: str, base: int, scale: int, missing: bool = False) -> None:
    version = root / name / "1"
    version.mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (version / "model.py").write_text(LATE_MODEL.format(name=name, missing=missing))
    (version / "helper.py").write_text(
        "STATE = []\n\ndef scaled(x):\n    import scaler\n    return x * scaler.SCALE\n"
    )
    (version / "late.py").write_text(f"BASE = {base}\nBONUS = 1\n")
    (root / name / "scaler.py").write_text(f"SCALE = {scale}\n")  # the model's folder


async def test_imports_inside_initialize_and_execute_find_the_models_own_files(
    tmp_path: Path,
) -> None:
    """Triton's stub keeps the model's folders on its import path, so an import inside
    ``initialize`` or ``execute`` (or inside a helper's function) finds the files beside
    ``model.py`` too. Two models with files of the same names each get their own, a module
    imported with the file is the same module later, nothing stays in sys.modules under
    the plain names, and what a model imported later is dropped when it is unloaded."""
    _late_model(tmp_path, "first", base=10, scale=2)
    _late_model(tmp_path, "second", base=100, scale=3)
    x = np.array([1.0, 2.0], np.float32)
    async with orchestrion.open_server(model_repository=tmp_path) as server:
        for _ in range(2):  # the second time, the imports find what the first imported
            first = (await server.infer("first", {"X": x})).outputs["Y"]
            second = (await server.infer("second", {"X": x})).outputs["Y"]
            assert first.tolist() == [13.0, 15.0]  # x * 2 + 10 + 1
            assert second.tolist() == [104.0, 107.0]  # x * 3 + 100 + 1
        for name in ("helper", "late", "scaler"):  # no model's module under its plain name
            assert getattr(sys.modules.get(name), "__file__", None) is None
        kept = [n for n in sys.modules if n.startswith("_orchestrion_models.") and "late" in n]
        assert kept != []  # under names of the model's own while it is loaded
    assert [n for n in sys.modules if n.startswith("_orchestrion_models.") and "late" in n] == []
    for name in ("helper", "late", "scaler"):
        assert name not in sys.modules


async def test_an_import_that_nothing_finds_fails_the_request_only(tmp_path: Path) -> None:
    """An import in ``execute`` that is neither installed nor beside the model is the
    request's error (ModuleNotFoundError, named), and the model serves on."""
    _late_model(tmp_path, "broken", base=0, scale=1, missing=True)
    x = np.array([1.0, 2.0], np.float32)
    async with orchestrion.open_server(model_repository=tmp_path) as server:
        for _ in range(2):
            with pytest.raises(orchestrion.InferenceError, match="not_beside_any_model"):
                await server.infer("broken", {"X": x})


async def test_a_missing_model_py_is_refused_in_tritons_words(tmp_path: Path) -> None:
    """A version folder without its ``model.py``: Triton's line, which its QA looks for in
    the server's log (the file's full path in it)."""
    (tmp_path / "absent" / "1").mkdir(parents=True)
    (tmp_path / "absent" / "config.pbtxt").write_text(CONFIG.format(name="absent"))
    with pytest.raises(orchestrion.ConfigError) as info:
        async with orchestrion.open_server(model_repository=tmp_path):
            pass
    assert (
        "failed to load 'absent' version 1: Failed to preinitialize Python stub: Python model "
        f"file not found in '{tmp_path}/absent/1/model.py'"
    ) in str(info.value)


DEEP_MODEL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils

import helper

time.sleep({pause})  # a slow import: other models serve meanwhile


class TritonPythonModel:
    def execute(self, requests):
        import importlib
        import importlib.resources

        import ring_a                    # two late helpers importing each other
        import tools                     # a package beside the model
        import utils.tool                # a folder without __init__.py, and its module
        from tools.scale import SCALE    # a package's module, first imported here
        from . import relative           # the version folder, relatively

        again = importlib.import_module("helper")  # around the import statement
        assert again.FACTOR == helper.FACTOR, (again, helper)
        note = importlib.resources.files(tools).joinpath("note.txt").read_text()
        value = (helper.FACTOR * SCALE + relative.EXTRA + ring_a.total() + utils.tool.TOOL
                 + len(note))
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", np.full(2, value, np.float32))]
            )
            for _ in requests
        ]
"""


def _deep_model(root: Path, name: str, n: int, pause: float = 0.0) -> None:
    version = root / name / "1"
    (version / "tools").mkdir(parents=True)
    (version / "utils").mkdir()
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (version / "model.py").write_text(DEEP_MODEL.format(pause=pause))
    (version / "helper.py").write_text(f"FACTOR = {n}\n")
    (version / "relative.py").write_text(f"EXTRA = {10 * n}\n")
    (version / "ring_a.py").write_text(
        f"import ring_b\nA = {100 * n}\n\ndef total():\n    return A + ring_b.B\n"
    )
    (version / "ring_b.py").write_text(f"import ring_a\nB = {1000 * n}\n")
    (version / "tools" / "__init__.py").write_text("")
    (version / "tools" / "scale.py").write_text("SCALE = 2\n")
    (version / "tools" / "note.txt").write_text("x" * n)
    (version / "utils" / "tool.py").write_text(f"TOOL = {10000 * n}\n")


def _deep_answer(n: int) -> float:
    return n * 2 + 10 * n + 100 * n + 1000 * n + 10000 * n + n


async def test_later_imports_follow_pythons_rules_within_each_model(tmp_path: Path) -> None:
    """Inside ``execute``: a package's module first imported there, a helper package's data
    through importlib.resources, a pair of helpers that import each other, a folder
    without ``__init__.py``, ``from . import``, and importlib.import_module, each model with
    its own files of the same names; and a model that serves while another one's code is
    being imported never sees the other's files."""
    _deep_model(tmp_path, "one", 1)
    _deep_model(tmp_path, "two", 2, pause=1.0)
    x = np.array([1.0, 2.0], np.float32)
    async with orchestrion.open_server(model_repository=tmp_path, load_models=["one"]) as server:
        assert (await server.infer("one", {"X": x})).outputs["Y"].tolist() == [_deep_answer(1)] * 2
        answers: list[float] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.load_model, "two")  # its import takes a second
            for _ in range(20):
                await trio.sleep(0.05)
                answers.append((await server.infer("one", {"X": x})).outputs["Y"][0])
        assert answers == [_deep_answer(1)] * 20
        assert (await server.infer("two", {"X": x})).outputs["Y"].tolist() == [_deep_answer(2)] * 2
        for name in ("helper", "ring_a", "ring_b", "tools", "utils", "utils.tool", "relative"):
            assert getattr(sys.modules.get(name), "__file__", None) is None
    mine = [n for n in sys.modules if n.startswith("_orchestrion_models.") and "_one_" in n]
    assert [*mine, *(n for n in sys.modules if "_two_v" in n)] == []
    for name in ("helper", "ring_a", "ring_b", "tools", "utils", "utils.tool", "relative"):
        assert name not in sys.modules


PICKLING_MODEL = """
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(__file__))  # common in Triton models: harmless here

import numpy as np
import triton_python_backend_utils as pb_utils

import shapes


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(os.path.dirname(__file__), "shape.pkl"), "rb") as file:
            self.shape = pickle.load(file)  # of a class beside the model, pickled as shapes.Square
        assert isinstance(self.shape, shapes.Square), type(self.shape)
        with open(os.path.join(os.path.dirname(__file__), "part.pkl"), "rb") as file:
            self.part = pickle.load(file)  # of a class in a package beside it: kit.parts.Part
        import kit.parts

        assert isinstance(self.part, kit.parts.Part), type(self.part)

    def execute(self, requests):
        import importlib

        import utils  # beside the model; a folder of that name elsewhere on the path is not it

        extra = importlib.import_module("kit.extra")  # a package's module by its plain name
        value = self.shape.area() + utils.BONUS + self.part.size + extra.VALUE
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.full(2, value, np.float32))])
            for _ in requests
        ]
"""

SHAPES = """
class Square:
    def __init__(self, side):
        self.side = side

    def area(self):
        return self.side * self.side * {scale}
"""


def _pickling_model(root: Path, name: str, side: int, scale: int, bonus: int) -> None:
    version = root / name / "1"
    version.mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (version / "model.py").write_text(PICKLING_MODEL)
    (version / "shapes.py").write_text(SHAPES.format(scale=scale))
    # In the model's folder, which no model puts on sys.path: only the namespace folder of
    # that name elsewhere on the path could be found there.
    (root / name / "utils.py").write_text(f"BONUS = {bonus}\n")
    (version / "kit").mkdir()
    (version / "kit" / "__init__.py").write_text("")
    (version / "kit" / "extra.py").write_text(f"VALUE = {side}\n")
    (version / "kit" / "parts.py").write_text(
        f"class Part:\n    def __init__(self):\n        self.size = {side * 10000}\n"
    )
    # Pickled where the files were the top-level modules shapes and kit.parts.
    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.syspath_prepend(str(version))
        shapes = importlib.import_module("shapes")
        (version / "shape.pkl").write_bytes(pickle.dumps(shapes.Square(side)))
        parts = importlib.import_module("kit.parts")
        (version / "part.pkl").write_bytes(pickle.dumps(parts.Part()))
    finally:
        for name in ("shapes", "kit", "kit.parts"):
            sys.modules.pop(name, None)
        monkeypatch.undo()


async def test_unpickling_and_sys_path_habits_of_triton_models_keep_models_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects pickled with a class beside the model unpickle in ``initialize``; a model
    that puts its own folder on ``sys.path`` (as many Triton models do), a folder name with
    a dot, and a folder without ``__init__.py`` of a helper's name elsewhere on the path
    change nothing: each model gets its own files."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "utils").mkdir(parents=True)  # a namespace folder, not a module
    sys.path.append(str(elsewhere))
    _pickling_model(tmp_path / "repository", "square.v2", side=3, scale=1, bonus=100)
    _pickling_model(tmp_path / "repository", "other", side=2, scale=10, bonus=1000)
    monkeypatch.chdir(tmp_path)  # the repository named relative to the working folder
    x = np.array([1.0, 2.0], np.float32)
    async with orchestrion.open_server(model_repository="repository") as server:
        for _ in range(2):
            square = (await server.infer("square.v2", {"X": x})).outputs["Y"].tolist()
            assert square == [30112.0] * 2  # 3 * 3 * 1 + 100 + 30000 + 3
            other = (await server.infer("other", {"X": x})).outputs["Y"].tolist()
            assert other == [21042.0] * 2  # 2 * 2 * 10 + 1000 + 20000 + 2
    for name in ("shapes", "utils", "kit", "kit.parts", "kit.extra"):
        assert name not in sys.modules


async def test_code_of_models_that_do_not_serve_leaves_sys_modules(tmp_path: Path) -> None:
    """A repository whose set of models is invalid (an ensemble naming a model that is not
    there) after the code files were imported, and ``orchestrion validate`` of it: what
    was imported leaves sys.modules."""
    _late_model(tmp_path, "fine", base=1, scale=1)
    (tmp_path / "ens" / "1").mkdir(parents=True)
    (tmp_path / "ens" / "config.pbtxt").write_text(
        'name: "ens"\nplatform: "ensemble"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "absent" '
        'input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } } ] }\n'
    )
    with pytest.raises(orchestrion.ConfigError, match="absent"):
        async with orchestrion.open_server(model_repository=tmp_path):
            pass
    assert [n for n in sys.modules if "_fine_v1" in n] == []
    with trio.fail_after(120):  # in a process of its own: this one imported code already
        validate = await trio.run_process(
            [sys.executable, "-c", VALIDATE_AND_LIST, str(tmp_path)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = validate.stdout.decode() + validate.stderr.decode()
    assert validate.stdout.decode().strip().splitlines()[-1] == "[]", out


VALIDATE_AND_LIST = """
import sys
from pathlib import Path
from rich.console import Console
from orchestrion.frontends._cli import _validate
assert _validate(Path(sys.argv[1]), Console(quiet=True)) == 1
print([n for n in sys.modules if n.startswith("_orchestrion_models.")])
"""
