"""kombu's filesystem broker, with messages that appear in the queue folder whole.

kombu's ``filesystem://`` transport creates a message file in the queue folder and only then
writes it, while consumers take files from that folder without a lock: a consumer can take a
file before its content is there, and the whole worker dies with ``Unrecoverable error:
JSONDecodeError`` (kombu issue 1551). The exchange tables in ``control_folder`` have the same
gap when they are created. Here every file is written under a temporary name and renamed into
place, which is atomic on one filesystem: a reader sees the whole file or none. A consumer
takes a message by renaming it into ``processed_folder`` (kept next to the queue folder, so
never a copy across filesystems), reads it, and deletes it unless ``store_processed`` is set.

``register()`` makes the URL ``atomicfs://`` mean this transport (in every process that imports
the app). Its transport options are kombu's filesystem ones; :func:`options` sets them all
under one folder. POSIX only (``fcntl``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem, virtual
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

ALIAS = "atomicfs"
#: Appended to a file's name while it is written; kombu only reads names ending in ``.msg``
#: or ``.exchange``.
PARTIAL = ".part"


def register() -> None:
    """Make ``atomicfs://`` resolve to :class:`Transport`."""
    TRANSPORT_ALIASES[ALIAS] = f"{__name__}:Transport"


def options(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Transport options that keep every folder under ``folder``.

    One queue folder for reading and writing, and the folder consumers take messages into next
    to it, so every move is a rename on one filesystem. The channel creates missing folders.
    """
    root = Path(folder)
    paths = {name: root / name for name in ("queue", "processed", "control")}
    return {
        "data_folder_in": str(paths["queue"]),
        "data_folder_out": str(paths["queue"]),
        "processed_folder": str(paths["processed"]),
        "control_folder": str(paths["control"]),
    }


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}{PARTIAL}")
    try:
        with open(partial, "wb") as file:
            file.write(data)
        os.replace(partial, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise ChannelError(f"cannot write {path}") from exc


class Channel(filesystem.Channel):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        folders = [self.data_folder_in, self.data_folder_out, self.processed_folder]
        for folder in [*folders, self.control_folder]:
            Path(folder).mkdir(parents=True, exist_ok=True)

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        _write_atomically(Path(self.data_folder_out) / name, str_to_bytes(dumps(payload)))

    def _get(self, queue: str) -> Any:
        wanted = f"{queue}.msg"
        for name in sorted(os.listdir(self.data_folder_in)):
            if name.partition(".")[2] != wanted:
                continue
            taken = Path(self.processed_folder) / name
            try:
                os.rename(Path(self.data_folder_in) / name, taken)
            except OSError:
                continue  # another consumer took it first
            try:
                payload = taken.read_bytes()
            except OSError as exc:
                raise ChannelError(f"cannot read {taken}") from exc
            if not self.store_processed:
                taken.unlink(missing_ok=True)
            return loads(bytes_to_str(payload))
        raise Empty()

    @contextlib.contextmanager
    def _tables_locked(self) -> Iterator[None]:
        """Serialize the read-modify-write of exchange tables between processes."""
        self.control_folder.mkdir(parents=True, exist_ok=True)
        with open(self.control_folder / ".tables.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_table(self, exchange: str, table: list[Any]) -> None:
        _write_atomically(self._exchange_file(exchange), str_to_bytes(dumps(table)))

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        entry = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._tables_locked():
            table = self.get_table(exchange)
            if entry not in table:
                self._write_table(exchange, [entry, *table])

    def _delete(
        self, queue: str, exchange: str, routing_key: str, pattern: str, *args: Any, **kwargs: Any
    ) -> None:
        virtual.Channel._delete(self, queue, exchange, routing_key, pattern, *args, **kwargs)
        entry = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._tables_locked():
            table = self.get_table(exchange)
            if entry in table:
                self._write_table(exchange, [e for e in table if e != entry])


class Transport(filesystem.Transport):  # type: ignore[misc]
    Channel = Channel
    driver_name = ALIAS

    @property
    def default_connection_params(self) -> dict[str, Any]:
        # No default host: a folder has none (kombu would log "No hostname was supplied").
        return {}
