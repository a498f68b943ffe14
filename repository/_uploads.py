"""The model folders that load requests send (Triton's ``file:`` parameters), on disk.

How this works: the first upload creates the server's own folder under the temporary
directory (``orchestrion-uploads-*``, mode 0700, a name nobody can guess), and each load
request with files gets a fresh folder in it, ``<random>/<model>/``, that nothing else ever
writes to. The paths were checked already (`orchestrion.protocols._model_load`): relative,
no ``..``, no backslash or NUL. Writing goes one folder at a time through directory file
descriptors opened with ``O_NOFOLLOW``, and every file is created with ``O_EXCL``, so even a
symbolic link planted in the folder (by a loaded model's own code, say) is refused rather
than followed: nothing is ever written outside the request's folder. Model control removes
a folder when its model is unloaded or replaced, or when the load fails; `remove_all` removes
everything when the server stops. (A server killed with SIGKILL leaves its folder behind.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import attrs

from ..protocols import LoadRequestError, UploadLimits

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@attrs.define(eq=False)
class UploadFolders:
    """The server's own folders for the model files that load requests send.

    Its methods block (they write and remove files): call them from a worker thread.
    """

    limits: UploadLimits = attrs.field(factory=UploadLimits)
    _root: Path | None = attrs.field(default=None, init=False)

    @property
    def root(self) -> Path | None:
        """The folder every upload is written under (None until the first one)."""
        return self._root

    def write(self, model: str, config_text: str, files: Mapping[str, bytes]) -> Path:
        """A fresh model folder named ``model`` holding ``files`` (paths checked already)
        and ``config.pbtxt`` (``config_text``); returns its path.

        Raises:
            LoadRequestError: a file could not be written (nothing is left behind).
        """
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="orchestrion-uploads-"))
        holder = Path(tempfile.mkdtemp(dir=self._root))
        folder = holder / model
        try:
            os.mkdir(folder, 0o700)
            base = os.open(folder, _DIRECTORY)
            try:
                for path, data in [*files.items(), ("config.pbtxt", config_text.encode())]:
                    _write_file(base, path.split("/"), data)
            finally:
                os.close(base)
        except OSError as exc:
            shutil.rmtree(holder, ignore_errors=True)
            raise LoadRequestError(
                model, f"the files sent could not be written: {exc.strerror or exc}"
            ) from None
        return folder

    def remove(self, folder: Path) -> None:
        """Remove a folder that `write` returned (and nothing else)."""
        if self._root is not None and folder.parent.parent == self._root:
            shutil.rmtree(folder.parent, ignore_errors=True)

    def remove_all(self) -> None:
        """Remove every folder written (when the server stops)."""
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


@contextlib.asynccontextmanager
async def open_upload_folders(limits: UploadLimits) -> AsyncIterator[UploadFolders]:
    """`UploadFolders` within ``limits``, every folder removed when the block ends."""
    uploads = UploadFolders(limits)
    try:
        yield uploads
    finally:
        uploads.remove_all()


def _write_file(base: int, parts: Sequence[str], data: bytes) -> None:
    """Write ``data`` at ``parts`` below the folder open as ``base``: each folder opened
    without following links, the file created new (never an existing one)."""
    folder = base
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=folder)
            inner = os.open(part, _DIRECTORY, dir_fd=folder)
            if folder != base:
                os.close(folder)
            folder = inner
        handle = os.open(parts[-1], _NEW_FILE, 0o600, dir_fd=folder)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(handle, view) :]
        finally:
            os.close(handle)
    finally:
        if folder != base:
            os.close(folder)
