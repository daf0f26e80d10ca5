"""A private PostgreSQL primary and its streaming replica, for failover tests.

``replicated_postgres()`` starts both on free ports of 127.0.0.1 in a temporary directory and
always stops and removes them at exit. A test writes on the primary through ``pair.url``
(libpq's multi-host form, ``target_session_attrs=read-write``: a client follows a failover
by itself), lets the replica fall behind (``stop_replica``), kills the primary
(``crash_primary``) and promotes the replica (``promote_replica``): the commits the replica
never received are lost, as in a failover to an async replica that lagged. The replica is
stopped rather than its replay paused: a promotion ends a pause and first replays all the WAL
the replica had received, so nothing would be lost.

The clusters are the test's own (the shared server at ``LEASES_TEST_POSTGRES_URL`` is never
touched): its data directories are owned by the ``postgres`` user when the tests run as root,
since PostgreSQL refuses to run as root. The server binaries are found beside ``pg_ctl`` on
the ``PATH``, under ``/usr/lib/postgresql/<version>/bin``, or in ``LEASES_TEST_PG_BINDIR``.
Missing binaries skip the test; binaries that are there but cannot start a cluster skip it too,
or fail it when ``CI=true``.

Setup takes about a second and teardown a fifth of one: the files go to ``/dev/shm`` when it has
room (initdb and pg_basebackup write thousands of small files, three times slower on a virtual
disk), WAL segments are 1 MB, and nothing is synced to disk.

The chaos driver's ``--database postgres-failover`` (``start_pair``) runs the pair with
``synchronous=True``: a commit on the primary returns once the standby has flushed it, so a
failover loses no committed transaction. Its ``failover`` fault is
:meth:`ReplicatedPostgres.fail_over`: the primary crashes, the standby is promoted, and a new
standby is built from it (pg_basebackup) on the old primary's port and directory, so that
:attr:`ReplicatedPostgres.url`, which lists both ports, stays valid and the next failover can
happen. The promoted server commits alone (no
``synchronous_standby_names``) until the new standby streams; then it waits for it again.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import psycopg
import pytest
import sqlalchemy as sa

from tests.support.service import in_ci

#: The binaries a replicated pair needs, all from one PostgreSQL version.
BINARIES = ("initdb", "pg_ctl", "pg_basebackup", "postgres")
#: The database the test's tables go in, on both clusters.
DATABASE = "test"
#: A memory file system for the clusters' files, and the room they need there (bytes): two
#: data directories of about 40 MB each, and the WAL written while a test runs.
RAM_DIR = "/dev/shm"
RAM_NEEDED = 512 * 1024 * 1024
#: Seconds a start, stop, promotion or catching up may take before the harness gives up.
TIMEOUT = 30.0

# Settings for speed (nothing here must survive a power cut) and for a streaming replica; no
# synchronous_standby_names, so the replica is asynchronous: a commit never waits for it (a
# synchronous pair sets it with ALTER SYSTEM: ReplicatedPostgres._make_synchronous).
_SETTINGS = """
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{sockets}'
fsync = off
synchronous_commit = on
full_page_writes = on
wal_level = replica
max_wal_senders = 4
hot_standby = on
shared_buffers = 16MB
max_connections = {max_connections}
logging_collector = off
"""
# Trust for everyone on this machine, replication included (the replica's own connection).
_HBA = """
local all all trust
host all all 127.0.0.1/32 trust
host replication all 127.0.0.1/32 trust
local replication all trust
"""


class ClusterError(RuntimeError):
    """A PostgreSQL binary failed, or a cluster did not reach the state asked for in time."""


def find_bindir() -> Path | None:
    """The directory holding every one of ``BINARIES`` of one PostgreSQL version, or None.

    ``/usr/bin/pg_basebackup`` is often Debian's version-picking wrapper: the binaries are
    taken from the real directory of ``pg_ctl`` instead, so all of them match."""
    candidates = [os.environ.get("LEASES_TEST_PG_BINDIR", "")]
    found = shutil.which("pg_ctl")
    if found:
        candidates.append(os.path.dirname(os.path.realpath(found)))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for candidate in filter(None, candidates):
        if all(os.access(os.path.join(candidate, b), os.X_OK) for b in BINARIES):
            return Path(candidate)
    return None


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scratch_dir() -> str | None:
    """Where the clusters' files go: ``/dev/shm`` when it is a memory file system with room
    (initdb and pg_basebackup write thousands of small files: three times faster there than
    on a virtual disk), else the system's temporary directory (None)."""
    try:
        if shutil.disk_usage(RAM_DIR).free >= RAM_NEEDED and os.access(RAM_DIR, os.W_OK):
            return RAM_DIR
    except OSError:
        pass
    return None


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a server log, to say why a cluster did not start."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Cluster:
    """One PostgreSQL cluster of the pair: its data directory, port and server log."""

    name: str
    data: Path
    port: int
    log: Path
    running: bool = False

    def url(self, database: str = DATABASE) -> str:
        """A SQLAlchemy (psycopg 3) URL of this cluster alone."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def connect(self, database: str = DATABASE) -> psycopg.Connection[tuple[object, ...]]:
        """A psycopg connection of the harness's own (autocommit), failing fast."""
        return psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname=database,
            autocommit=True,
            connect_timeout=2,
        )

    def query(self, sql: str, database: str = DATABASE) -> object:
        """The first column of the first row of ``sql`` on this cluster."""
        with self.connect(database) as connection:
            row = connection.execute(sql).fetchone()
            return None if row is None else row[0]

    def execute(self, sql: str, database: str = DATABASE) -> None:
        """Run ``sql`` (autocommit: ``CREATE DATABASE`` too) on this cluster."""
        with self.connect(database) as connection:
            connection.execute(sql)


@dataclass(frozen=True)
class Failover:
    """What :meth:`ReplicatedPostgres.fail_over` did: the ports of the crashed primary (now a
    new standby) and of the promoted one, when the crash and the promotion happened (epoch
    seconds), how long no server accepted writes, and how long the whole failover took
    (the new standby streaming)."""

    old_port: int
    new_port: int
    crashed_at: float
    promoted_at: float
    down_seconds: float
    seconds: float


class ReplicatedPostgres:
    """A primary and its streaming replica under ``root``, asynchronous unless ``synchronous``
    (see the module's docstring). Nothing is started until :meth:`start`; :meth:`close` stops
    both and removes ``root``, whatever state they are in."""

    def __init__(
        self, bindir: Path, root: Path, *, synchronous: bool = False, max_connections: int = 40
    ) -> None:
        self.bindir = bindir
        self.root = root
        #: Commits wait for the standby (see the module's docstring), once it streams.
        self.synchronous = synchronous
        self.max_connections = max_connections
        primary_port = free_port()
        replica_port = free_port()
        while replica_port == primary_port:
            replica_port = free_port()
        self.primary = Cluster("primary", root / "primary", primary_port, root / "primary.log")
        self.replica = Cluster("replica", root / "replica", replica_port, root / "replica.log")
        #: Both clusters, in the order :attr:`url` lists them (it never changes, whichever of
        #: them is the primary after a :meth:`fail_over`).
        self.clusters = (self.primary, self.replica)

    @property
    def url(self) -> str:
        """A SQLAlchemy URL listing both clusters: libpq connects to the first that is up and
        accepts writes, so clients reach the replica once it is promoted."""
        hosts = "&".join(f"host=127.0.0.1:{c.port}" for c in self.clusters)
        return f"postgresql+psycopg://postgres@/{DATABASE}?{hosts}&target_session_attrs=read-write"

    def serving_port(self) -> int:
        """The port of the cluster that :attr:`url` reaches now (a new connection)."""
        engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as connection:
                return int(connection.exec_driver_sql("SELECT inet_server_port()").scalar_one())
        finally:
            engine.dispose()

    # -- running the binaries ----------------------------------------------------------------

    def _run(self, binary: str, *args: str) -> None:
        """Run a PostgreSQL binary as the user owning the clusters; ClusterError if it fails."""
        argv = [str(self.bindir / binary), *args]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        try:
            done = subprocess.run(
                argv, cwd=self.root, capture_output=True, text=True, timeout=TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"{binary} {' '.join(args)}: no answer in {TIMEOUT} s") from exc
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip()
            raise ClusterError(f"{binary} {' '.join(args)} failed: {output}")

    def _pg_ctl(self, cluster: Cluster, action: str, *args: str) -> None:
        self._run("pg_ctl", action, "-D", str(cluster.data), "-w", "-t", str(int(TIMEOUT)), *args)

    def _configure(self, cluster: Cluster) -> None:
        """Append this cluster's settings (later lines win) and write its pg_hba.conf."""
        settings = _SETTINGS.format(
            port=cluster.port, sockets=self.root, max_connections=self.max_connections
        )
        with open(cluster.data / "postgresql.conf", "a") as conf:
            conf.write(settings)
        (cluster.data / "pg_hba.conf").write_text(_HBA)

    def _start(self, cluster: Cluster) -> None:
        try:
            self._pg_ctl(cluster, "start", "-l", str(cluster.log))
        except ClusterError as exc:
            raise ClusterError(f"{exc}\n{cluster.name} log:\n{tail(cluster.log)}") from None
        cluster.running = True

    def _stop(self, cluster: Cluster, mode: str) -> None:
        self._pg_ctl(cluster, "stop", "-m", mode)
        cluster.running = False

    # -- building the pair -------------------------------------------------------------------

    def start(self) -> None:
        """Create and start the primary with its ``test`` database, then the replica, and wait
        until the replica streams from the primary."""
        self._own_root()
        self._run(
            "initdb", "-D", str(self.primary.data), "-U", "postgres", "-A", "trust",
            "-E", "UTF8", "--locale=C", "--no-sync", "--wal-segsize=1",
        )  # fmt: skip
        self._configure(self.primary)
        self._start(self.primary)
        self.primary.execute(f"CREATE DATABASE {DATABASE}", database="postgres")
        self._run(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
            "-D", str(self.replica.data), "-R", "-X", "stream", "-c", "fast", "--no-sync",
        )  # fmt: skip
        self._configure(self.replica)
        self._start(self.replica)
        self._wait(self._streaming, "the replica to stream from the primary")
        if self.synchronous:
            self._make_synchronous()

    def _own_root(self) -> None:
        """Give ``root`` to the ``postgres`` user when running as root (PostgreSQL refuses to
        run as root, and initdb wants a directory it owns)."""
        if os.geteuid() != 0:
            return
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            raise ClusterError("running as root, and there is no postgres user") from None
        os.chown(self.root, user.pw_uid, user.pw_gid)

    def _streaming(self) -> bool:
        sql = "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
        return self.primary.query(sql) == 1

    def _make_synchronous(self) -> None:
        """Make the primary's commits wait for its standby (which streams), and wait until it
        does. Set with ALTER SYSTEM after the standby was copied, so no standby's copy has it:
        a promoted standby never waits for a standby that does not exist yet."""
        self.primary.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        self.primary.execute("SELECT pg_reload_conf()")
        sql = "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
        self._wait(lambda: self.primary.query(sql) == 1, "the standby to become synchronous")

    def synchronous_ready(self) -> bool:
        """True when the standby streams from the primary (synchronously, if the pair is)."""
        state = "sync_state = 'sync'" if self.synchronous else "state = 'streaming'"
        with contextlib.suppress(psycopg.OperationalError):
            sql = f"SELECT count(*) FROM pg_stat_replication WHERE {state}"
            return self.primary.query(sql) == 1
        return False

    @staticmethod
    def _wait(probe: Callable[[], bool], what: str) -> None:
        """Call ``probe`` until it returns True (a refused connection counts as False);
        ClusterError after ``TIMEOUT`` seconds."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            with contextlib.suppress(psycopg.OperationalError):
                if probe():
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {TIMEOUT} s waiting for {what}")
            time.sleep(0.02)

    # -- what a test does to it --------------------------------------------------------------

    def wait_replayed(self) -> None:
        """Wait until the replica has replayed everything the primary has written so far."""
        written = self.primary.query("SELECT pg_current_wal_lsn()::text")
        sql = f"SELECT pg_last_wal_replay_lsn() >= '{written}'::pg_lsn"
        self._wait(lambda: self.replica.query(sql) is True, f"the replica to replay {written}")

    def stop_replica(self) -> None:
        """Stop the replica (fast shutdown): from now on it falls behind the primary, and
        what the primary commits is lost at a failover (see the module's docstring: a paused
        replay would not lose it)."""
        self._stop(self.replica, "fast")

    def crash_primary(self) -> None:
        """Kill the primary as a crash would (immediate shutdown: no checkpoint, every client
        connection cut)."""
        self._stop(self.primary, "immediate")

    def promote_replica(self) -> None:
        """Start the replica again if it was stopped (it replays only the WAL it had
        received), promote it, and wait until it accepts read-write connections."""
        if not self.replica.running:
            self._start(self.replica)
        self._pg_ctl(self.replica, "promote")
        self._wait(
            lambda: self.replica.query("SELECT pg_is_in_recovery()") is False,
            "the promoted replica to accept writes",
        )

    def fail_over(self) -> Failover:
        """Crash the primary (immediate shutdown), promote the standby, then build a new
        standby from the promoted server on the old primary's port and directory (a fresh
        pg_basebackup), start it and wait until it streams (synchronously, if the pair is).
        :attr:`primary` and :attr:`replica` are swapped; :attr:`url` stays valid.
        ClusterError, before anything is done, if no standby streams now."""
        if not self.synchronous_ready():
            raise ClusterError("no standby streams from the primary: no failover possible")
        old, new = self.primary, self.replica
        started = time.monotonic()
        crashed_at = time.time()
        self.crash_primary()
        self.promote_replica()
        promoted_at = time.time()
        down = time.monotonic() - started
        self.primary, self.replica = new, old
        self._rebuild_standby()
        if self.synchronous:
            self._make_synchronous()
        return Failover(
            old_port=old.port,
            new_port=new.port,
            crashed_at=crashed_at,
            promoted_at=promoted_at,
            down_seconds=down,
            seconds=time.monotonic() - started,
        )

    def _rebuild_standby(self) -> None:
        """A new standby of :attr:`primary` in :attr:`replica`'s (stopped) directory."""
        standby = self.replica
        shutil.rmtree(standby.data, ignore_errors=True)
        self._run(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
            "-D", str(standby.data), "-R", "-X", "stream", "-c", "fast", "--no-sync",
        )  # fmt: skip
        # The copy must not wait for a standby when it is promoted in turn (see
        # _make_synchronous: the primary is not synchronous yet, this is a safeguard).
        auto = standby.data / "postgresql.auto.conf"
        kept = [
            line
            for line in auto.read_text().splitlines()
            if not line.startswith("synchronous_standby_names")
        ]
        auto.write_text("\n".join(kept) + "\n")
        self._configure(standby)
        self._start(standby)
        self._wait(self._streaming, "the new standby to stream from the promoted server")

    def close(self) -> None:
        """Stop both clusters (immediately: nothing in them is kept) and remove their files."""
        for cluster in (self.primary, self.replica):
            if cluster.data.exists():
                with contextlib.suppress(ClusterError):
                    self._stop(cluster, "immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def unavailable(reason: str) -> NoReturn:
    """Skip the test: a replicated pair cannot be started here; under ``CI=true`` (where the
    binaries are there) fail it instead."""
    message = f"cannot run a PostgreSQL primary and replica here: {reason}"
    if in_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def start_pair(*, synchronous: bool = False, max_connections: int = 40) -> ReplicatedPostgres:
    """A started pair (see :class:`ReplicatedPostgres`) outside pytest, in ``/dev/shm`` when
    it has room; the caller closes it. ClusterError saying why it cannot start here (no server
    binaries, or binaries that cannot start the pair: the files are removed then)."""
    bindir = find_bindir()
    if bindir is None:
        raise ClusterError(f"PostgreSQL server binaries ({', '.join(BINARIES)}) not found")
    root = Path(tempfile.mkdtemp(prefix="leases-replica-", dir=scratch_dir()))
    pair = ReplicatedPostgres(
        bindir, root, synchronous=synchronous, max_connections=max_connections
    )
    try:
        pair.start()
    except (ClusterError, OSError, psycopg.OperationalError) as exc:
        pair.close()
        raise ClusterError(f"{exc} (in {root})") from None
    return pair


@contextlib.contextmanager
def replicated_postgres(*, synchronous: bool = False) -> Iterator[ReplicatedPostgres]:
    """A started primary and replica (see :class:`ReplicatedPostgres`), stopped and removed
    at exit. Skips the test when PostgreSQL's server binaries are not installed, and when
    they are but cannot start the pair (fails it then under ``CI=true``)."""
    bindir = find_bindir()
    if bindir is None:
        pytest.skip(f"PostgreSQL server binaries ({', '.join(BINARIES)}) not found")
    root = Path(tempfile.mkdtemp(prefix="leases-replica-", dir=scratch_dir()))
    pair = ReplicatedPostgres(bindir, root, synchronous=synchronous)
    try:
        try:
            pair.start()
        except (ClusterError, OSError, psycopg.OperationalError) as exc:
            unavailable(str(exc))
        yield pair
    finally:
        pair.close()
