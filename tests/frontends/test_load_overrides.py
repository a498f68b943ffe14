"""Load requests as Triton takes them, through tritonclient against ``orchestrion serve
--model-control-mode=explicit``: a ``config`` override, model files sent in the request
(written only into a folder of the server's own, removed on unload, on replacement and at
exit), Triton's "failed to load" answers, and every refusal leaving the server serving and
nothing written anywhere else."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from orchestrion.frontends._control import ModelControlMode
from orchestrion.frontends._serve import ServeOptions, serve
from orchestrion.protocols import LoadRequestError
from orchestrion.repository._uploads import UploadFolders, _write_file
from orchestrion.testing import Served, post
from support.served import start_server

SIMPLE_CONFIG = """
name: "simple"
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
"""
# Triton's "simple" (sum and difference), as a python-backend model whose
# auto_complete_config declares the tensors a config override may leave out.
SIMPLE_CODE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        for kind, names in (("input", ("INPUT0", "INPUT1")), ("output", ("OUTPUT0", "OUTPUT1"))):
            have = {t["name"] for t in config.as_dict()[kind]}
            add = config.add_input if kind == "input" else config.add_output
            for name in names:
                if name not in have:
                    add({"name": name, "data_type": "TYPE_INT32", "dims": [16]})
        return config

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
"""
# Sent in load requests: the product and the sum, so that answers tell which code runs.
PRODUCT_CODE = SIMPLE_CODE.replace('"OUTPUT0", a + b', '"OUTPUT0", a * b')
BROKEN_CODE = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("no weights in this folder")

    def execute(self, requests):
        return []
"""
LIMIT = 64 * 1024


def _config(name: str = "", **fields: Any) -> str:
    """A config override's JSON: the simple model's tensors (python backend, batching)."""
    tensors = [{"name": n, "data_type": "TYPE_INT32", "dims": [16]} for n in ("INPUT0", "INPUT1")]
    document: dict[str, Any] = {
        "backend": "python",
        "max_batch_size": 8,
        "input": tensors,
        "output": [{**t, "name": t["name"].replace("INPUT", "OUTPUT")} for t in tensors],
        **fields,
    }
    if name:
        document["name"] = name
    return json.dumps(document)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    for name, code in (("simple", SIMPLE_CODE), ("broken", BROKEN_CODE)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(code)
        (root / name / "config.pbtxt").write_text(SIMPLE_CONFIG.replace('"simple"', f'"{name}"'))
    return root


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's temporary directory (TMPDIR): its upload folders live here."""
    return tmp_path_factory.mktemp("scratch")


@pytest.fixture(scope="module")
def served(repository: Path, scratch: Path) -> Iterator[Served]:
    served = start_server(
        "--model-control-mode=explicit",
        "--load-model=simple",
        f"--model-upload-max-size={LIMIT}",
        repository=repository,
        env={"TMPDIR": str(scratch)},
    )
    yield served
    assert served.stop() == 0, served.text()
    assert list(scratch.glob("orchestrion-uploads-*")) == []


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, served: Served) -> Iterator[Any]:
    """A tritonclient client of either protocol (its module as ``client.module``)."""
    module = httpclient if request.param == "http" else grpcclient
    made = module.InferenceServerClient(served.http if module is httpclient else served.grpc)
    made.module = module
    yield made
    made.close()


def _infer(client: Any, model: str, batch: int = 1) -> np.ndarray:
    """OUTPUT0 of ``model`` for INPUT0 = 0..15 and INPUT1 = 2 (``batch`` rows)."""
    a = np.tile(np.arange(16, dtype=np.int32), (batch, 1))
    inputs = [client.module.InferInput(n, [batch, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.full_like(a, 2))
    result: np.ndarray = client.infer(model, inputs).as_numpy("OUTPUT0")
    return result


def _config_of(client: Any, model: str) -> dict[str, Any]:
    config = client.get_model_config(model)
    if client.module is grpcclient:
        return dict(json_format.MessageToDict(config.config, preserving_proto_field_name=True))
    return dict(config)


def _refused(client: Any, model: str, **load: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as refused:
        client.load_model(model, **load)
    return refused.value


def _status(error: InferenceServerException) -> str:
    return str(error.status()).removeprefix("StatusCode.")


def _held(scratch: Path) -> list[Path]:
    """Every file in the server's upload folders."""
    return sorted(p for p in scratch.glob("orchestrion-uploads-*/**/*") if p.is_file())


def _reset(client: Any) -> None:
    client.unload_model("simple")
    client.load_model("simple")


def test_a_config_override_is_served(client: Any) -> None:
    """The override replaces config.pbtxt: its max_batch_size and instance count are in the
    served config, and a batch the repository's config refuses is served."""
    client.load_model(
        "simple", config=json.dumps({"max_batch_size": "16", "instance_group": [{"count": 2}]})
    )
    try:
        config = _config_of(client, "simple")
        assert int(config["max_batch_size"]) == 16
        assert int(config["instance_group"][0]["count"]) == 2
        assert [t["name"] for t in config["input"]] == ["INPUT0", "INPUT1"]  # auto-completed
        assert _infer(client, "simple", batch=12).shape == (12, 16)
    finally:
        _reset(client)
    assert int(_config_of(client, "simple")["max_batch_size"]) == 8


def test_a_plain_load_keeps_the_override_until_the_folder_changes(
    served: Served, repository: Path
) -> None:
    """As in Triton: a later load without ``config`` keeps the override while the model's
    folder is unchanged, reloads from the repository once it changed, and an unload forgets
    the override."""
    client = httpclient.InferenceServerClient(served.http)
    try:
        client.load_model("simple", config='{"max_batch_size": 4}')
        client.load_model("simple")
        assert client.get_model_config("simple")["max_batch_size"] == 4
        config = repository / "simple" / "config.pbtxt"
        later = config.stat().st_mtime_ns + 5 * 10**9
        os.utime(config, ns=(later, later))
        client.load_model("simple")
        assert client.get_model_config("simple")["max_batch_size"] == 8
        client.load_model("simple", config='{"max_batch_size": 4}')
        client.unload_model("simple")
        client.load_model("simple")
        assert client.get_model_config("simple")["max_batch_size"] == 8
    finally:
        client.close()


def test_the_config_round_trips_from_get_config(served: Served) -> None:
    """The JSON ``GET /v2/models/<m>/config`` answers, edited, is a valid override."""
    client = httpclient.InferenceServerClient(served.http)
    try:
        config = client.get_model_config("simple")
        config["max_batch_size"] = 2
        client.load_model("simple", config=json.dumps(config))
        assert client.get_model_config("simple")["max_batch_size"] == 2
        client.unload_model("simple")
        client.load_model("simple")
    finally:
        client.close()


@pytest.mark.parametrize(
    ("model", "config", "says"),
    [
        ("nope", None, "the model repository has no model folder 'nope'"),
        ("simple", '"parameters": {"config": {{"max_batch_size": "16"}}}', "not valid JSON"),
        ("simple", '{"max_batch_size": "many"}', "max_batch_size"),
        ("simple", '{"dynamic_batching": {"wrong": 1}}', '"wrong"'),
        ("simple", '{"name": "other"}', "field name: 'other' does not match the model name"),
        ("nope", "{}", "the model repository has no model folder 'nope'"),
    ],
)
def test_a_failed_poll_says_failed_to_load(
    client: Any, repository: Path, model: str, config: str | None, says: str
) -> None:
    """Triton's text and code for a load that fails before any code runs (INTERNAL), the
    reason after it, the server's paths left out; the model loaded before serves on."""
    error = _refused(client, model, **({"config": config} if config else {}))
    assert error.message().startswith(
        f"failed to load '{model}', failed to poll from model repository: "
    )
    assert says in error.message()
    assert str(repository) not in error.message()
    assert _status(error) in ("500", "INTERNAL")
    assert _infer(client, "simple").tolist() == [list(range(2, 18))]


def test_a_model_that_fails_to_load_says_load_failed(client: Any) -> None:
    """Code that raises while loading: Triton's "load failed for model" (INVALID_ARGUMENT),
    with the model's own message."""
    error = _refused(client, "broken")
    assert error.message().startswith("load failed for model 'broken': ")
    assert "no weights in this folder" in error.message()
    assert _status(error) in ("400", "INVALID_ARGUMENT")
    assert not client.is_model_ready("broken")


def test_uploaded_files_load_serve_and_go_with_the_model(client: Any, scratch: Path) -> None:
    """A model sent as files (config plus ``file:1/model.py``) loads and serves from a
    folder of the server's own, which a replacement and an unload remove."""
    files = {"file:1/model.py": PRODUCT_CODE.encode(), "file:labels.txt": b"a\nb\n"}
    client.load_model("uploaded", config=_config("uploaded"), files=files)
    assert _infer(client, "uploaded").tolist() == [[2 * i for i in range(16)]]
    first = _held(scratch)
    assert ["/".join(p.relative_to(scratch).parts[2:]) for p in first] == [
        "uploaded/1/model.py",
        "uploaded/config.pbtxt",
        "uploaded/labels.txt",
    ]
    assert first[0].read_bytes() == PRODUCT_CODE.encode()
    client.load_model("uploaded", config=_config(max_batch_size=4), files=files)
    second = _held(scratch)
    assert len(second) == 3
    assert not any(p.exists() for p in first)
    client.unload_model("uploaded")
    assert _held(scratch) == []
    assert not client.is_model_ready("uploaded")


def test_files_replace_a_repository_model_until_a_plain_load(client: Any, scratch: Path) -> None:
    """Files sent for a repository model replace its folder; a plain load goes back to the
    repository (and removes the sent files), as in Triton."""
    client.load_model("simple", config=_config(), files={"file:1/model.py": PRODUCT_CODE.encode()})
    assert _infer(client, "simple").tolist() == [[2 * i for i in range(16)]]
    assert len(_held(scratch)) == 2
    client.load_model("simple")
    assert _infer(client, "simple").tolist() == [list(range(2, 18))]
    assert _held(scratch) == []


def test_a_failed_load_of_sent_files_keeps_what_serves(client: Any, scratch: Path) -> None:
    """Files whose model fails to load: the error says so, the model loaded before serves on,
    and the sent files are gone."""
    client.load_model(
        "kept", config=_config("kept"), files={"file:1/model.py": PRODUCT_CODE.encode()}
    )
    try:
        error = _refused(
            client, "kept", config=_config("kept"), files={"file:1/model.py": BROKEN_CODE.encode()}
        )
        assert error.message().startswith("load failed for model 'kept': ")
        assert "no weights in this folder" in error.message()
        assert str(scratch) not in error.message()
        assert _infer(client, "kept").tolist() == [[2 * i for i in range(16)]]
        assert len(_held(scratch)) == 2
        error = _refused(
            client, "kept", config=_config("kept"), files={"file:2/model.py": b"x = ("}
        )
        assert "load failed for model 'kept'" in error.message()
        assert len(_held(scratch)) == 2
    finally:
        client.unload_model("kept")
    assert _held(scratch) == []


def test_files_need_a_config(client: Any) -> None:
    """``file:`` parameters without ``config`` are refused (Triton requires it too)."""
    error = _refused(client, "simple", files={"file:1/model.py": PRODUCT_CODE.encode()})
    assert "failed to load 'simple', failed to poll from model repository" in error.message()
    assert "'config' must come with 'file:' parameters" in error.message()
    assert _infer(client, "simple").tolist() == [list(range(2, 18))]


ESCAPES = [
    "../escape.py",
    "1/../../escape.py",
    "../../../escape.py",
    "1/../../../../../../../../tmp/escape.py",
    "1\\..\\..\\escape.py",
    "1/escape\0.py",
    "1//escape.py",
    "./1/escape.py",
    "config.pbtxt",
    "1/" + "A" * 256,
    "A" * 256,  # Triton's simple_grpc_model_control.py sends this one
]


@pytest.mark.parametrize("path", ESCAPES)
def test_paths_out_of_the_folder_are_refused(
    client: Any, scratch: Path, repository: Path, path: str
) -> None:
    """A path that would leave the model folder (or that no folder can hold) is refused the
    way Triton refuses a bad file parameter (INTERNAL, "failed to poll"), nothing is
    written, and the server serves on."""
    error = _refused(
        client, "simple", config=_config(), files={f"file:{path}": b"raise SystemExit('escaped')\n"}
    )
    assert "failed to load 'simple', failed to poll from model repository" in error.message()
    assert _status(error) in ("500", "INTERNAL")
    assert _held(scratch) == []
    for root in (scratch, repository):
        assert not any(root.glob("**/escape*.py"))
    assert not Path("/tmp/escape.py").exists()
    assert client.is_server_live()
    assert _infer(client, "simple").tolist() == [list(range(2, 18))]


def test_an_absolute_path_writes_nothing_there(client: Any, scratch: Path) -> None:
    """``file:/abs/path`` names a path below the model folder, as Triton reads it (its QA
    sends ``file:/1/model.py``): the absolute file it seems to name is never created, and
    ``file://...`` is refused."""
    target = scratch / "absolute-escape.py"
    with contextlib.suppress(InferenceServerException):
        client.load_model("simple", config=_config(), files={f"file:{target}": b"x = 1\n"})
    assert not target.exists()
    error = _refused(client, "simple", config=_config(), files={f"file:/{target}": b"x = 1\n"})
    assert "the path is absolute" in error.message()
    assert not target.exists()


def test_sizes_and_counts_are_bounded(client: Any, scratch: Path) -> None:
    """More bytes than --model-upload-max-size, or more than 1024 files: refused, nothing
    written; within the limits the same model loads."""
    big = {"file:1/model.py": PRODUCT_CODE.encode(), "file:1/weights.bin": bytes(LIMIT)}
    error = _refused(client, "sized", config=_config("sized"), files=big)
    assert f"more than the {LIMIT} accepted (--model-upload-max-size)" in error.message()
    many = {f"file:1/part{i}.txt": b"" for i in range(1025)}
    error = _refused(client, "sized", config=_config("sized"), files=many)
    assert "1025 files sent; at most 1024 are accepted" in error.message()
    assert _held(scratch) == []
    small = {"file:1/model.py": PRODUCT_CODE.encode(), "file:1/weights.bin": bytes(LIMIT // 2)}
    client.load_model("sized", config=_config("sized"), files=small)
    client.unload_model("sized")
    assert _held(scratch) == []


def test_http_load_parameters_of_the_wrong_kind(served: Served) -> None:
    """Over HTTP: a config that is not text, a file that is not base64, an unknown
    parameter: 400, the parameter named."""
    for parameters, says in (
        ({"config": {"max_batch_size": 4}}, "'config' must be a string"),
        ({"config": "{}", "file:1/model.py": "%%%"}, "'file:1/model.py' is not base64"),
        ({"unload_dependents": True}, "unrecognized load parameter 'unload_dependents'"),
    ):
        body = json.dumps({"parameters": parameters}).encode()
        status, answer = post(served.http, "/v2/repository/models/simple/load", body)
        assert status == 400, answer
        assert says in json.loads(answer)["error"]


def test_the_uploads_folder_is_removed_at_exit(repository: Path, tmp_path: Path) -> None:
    """A server stopped with uploaded models loaded leaves no file behind."""
    served = start_server(
        "--model-control-mode=explicit", repository=repository, env={"TMPDIR": str(tmp_path)}
    )
    try:
        client = grpcclient.InferenceServerClient(served.grpc)
        client.load_model(
            "sent", config=_config("sent"), files={"file:1/model.py": PRODUCT_CODE.encode()}
        )
        assert len(_held(tmp_path)) == 2
        client.close()
    finally:
        assert served.stop() == 0, served.text()
    assert list(tmp_path.glob("orchestrion-uploads-*")) == []


async def test_uploads_can_be_turned_off(repository: Path, tmp_path: Path) -> None:
    """``--model-upload-max-size 0``: files in a load request are refused; config overrides
    still work."""
    shutil.copytree(repository / "simple", tmp_path / "simple")
    options = ServeOptions(
        model_repository=tmp_path,
        http_port=0,
        grpc_port=0,
        metrics_port=None,
        model_control_mode=ModelControlMode.EXPLICIT,
        model_upload_max_size=0,
    )
    async with trio.open_nursery() as nursery:
        endpoints = await nursery.start(functools.partial(serve, options))

        def calls() -> str:
            client = httpclient.InferenceServerClient(endpoints.http)
            try:
                client.load_model("simple", config='{"max_batch_size": 2}')
                error = _refused(client, "simple", config="{}", files={"file:1/model.py": b""})
                return error.message()
            finally:
                client.close()

        message = await trio.to_thread.run_sync(calls)
        nursery.cancel_scope.cancel()
    assert "'file:' parameters are turned off on this server" in message


def test_the_writer_never_follows_a_planted_link(tmp_path: Path) -> None:
    """Even with symbolic links planted in a request's folder (by a loaded model's code,
    say), a file is never written through one: the write fails and the target is untouched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.py").write_text("original")
    uploads = UploadFolders()
    try:
        folder = uploads.write("m", "", {"1/model.py": b"x = 1\n"})
        assert (folder / "1" / "model.py").read_bytes() == b"x = 1\n"
        assert oct((folder / "1" / "model.py").stat().st_mode & 0o777) == "0o600"
        shutil.rmtree(folder / "1")
        (folder / "1").symlink_to(outside)
        (folder / "labels.txt").symlink_to(outside / "model.py")
        for path in ("1/model.py", "1/new.py", "labels.txt"):
            base = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                with pytest.raises(OSError, match="symbolic links|exists|Not a directory"):
                    _write_file(base, path.split("/"), b"escaped")
            finally:
                os.close(base)
        assert sorted(p.name for p in outside.iterdir()) == ["model.py"]
        assert (outside / "model.py").read_text() == "original"
    finally:
        uploads.remove_all()
    assert uploads.root is None
    assert (outside / "model.py").read_text() == "original"


def test_a_write_that_fails_leaves_nothing(tmp_path: Path) -> None:
    """A file the file system refuses (a name too long for it): LoadRequestError, and the
    request's folder is gone."""
    uploads = UploadFolders()
    try:
        with pytest.raises(LoadRequestError, match="could not be written"):
            uploads.write("m", "", {"1/ok.py": b"", "1/" + "B" * 300: b""})
        assert uploads.root is not None
        assert list(uploads.root.iterdir()) == []
    finally:
        uploads.remove_all()


def test_a_python_model_named_with_characters_triton_refuses_is_refused_in_its_words(
    served: Served, scratch: Path
) -> None:
    """Python-backend models sent as files under names holding a character Triton's python
    backend refuses in a stub's name (``model;test``, ``model(test)``, ...): each load is
    refused with Triton's words, nothing is loaded and no upload is left; a name with
    hyphens and underscores loads."""
    client = httpclient.InferenceServerClient(served.http)
    client.module = httpclient
    for name in (
        "model;test",
        "model|test",
        "model$test",
        "model(test)",
        "model'test'",
        "model*test",
        "model~test",
        "model!test",
        'model"test"',
        "model<test>",
    ):
        error = _refused(
            client, name, config=_config(name), files={"file:1/model.py": PRODUCT_CODE.encode()}
        )
        assert "Invalid stub name: contains invalid characters" in error.message(), name
        assert not client.is_model_ready(name)
    assert _held(scratch) == []
    client.load_model(
        "model-with_hyphens",
        config=_config("model-with_hyphens"),
        files={"file:1/model.py": PRODUCT_CODE.encode()},
    )
    assert _infer(client, "model-with_hyphens").tolist() == [[2 * i for i in range(16)]]
    client.unload_model("model-with_hyphens")
    client.close()


def test_the_name_is_refused_before_the_models_code_is_read(served: Served, scratch: Path) -> None:
    """Triton refuses the stub's name before its code runs: code that would not even import
    (Triton's QA writes the name into the code, so a quote breaks it) is refused for its
    name; a name with a backslash is refused as a folder name, in Triton's words too."""
    client = httpclient.InferenceServerClient(served.http)
    for name in ("model'test'", "model\\test"):
        broken = f"print('Hello world from model {name}')\n"
        error = _refused(
            client, name, config=_config(name), files={"file:1/model.py": broken.encode()}
        )
        assert "Invalid stub name: contains invalid characters" in error.message(), name
        assert "SyntaxError" not in error.message()
    assert _held(scratch) == []
    client.close()
