"""A throwaway PgBouncer in transaction mode in front of a PostgreSQL server (issue 12: the API
replicas behind a connection pooler, benchmarks/README.md "What 10,000 nodes would need").

Used by ``tests/integration/test_pgbouncer.py`` and ``api_load.py --only ... pgbouncer``. Debian's
``pgbouncer`` package (1.18 in Debian 12); trust authentication, 127.0.0.1 only, a spare port, its
files in a directory of its own; run as the ``postgres`` user when started by root (PgBouncer
refuses to run as root). Only the process started here is stopped, by its id.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgBouncer:
    """PgBouncer in transaction mode in front of ``server_url``'s server: ``url`` is
    ``server_url`` (any database on that server) through it, with at most ``pool_size`` server
    connections per database."""

    def __init__(self, server_url: str, *, pool_size: int) -> None:
        binary = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")
        if binary is None:
            raise RuntimeError("PgBouncer is not installed (apt-get install pgbouncer; .ci/run installs it)")
        server = make_url(server_url)
        self.port = _free_port()
        self.url = server.set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)
        self.database = server.database
        self._user = server.username
        # a directory of its own that the postgres user can read and write (pytest's is root's only)
        self.dir = Path(tempfile.mkdtemp(prefix="hai-pgbouncer-"))
        self.dir.chmod(0o777)
        (self.dir / "users.txt").write_text(f'"{server.username}" ""\n')
        ini = self.dir / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host={server.host or '127.0.0.1'} port={server.port or 5432}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir / 'users.txt'}\n"
            f"pool_mode = transaction\ndefault_pool_size = {pool_size}\nmax_client_conn = 2000\n"
            f"admin_users = {server.username}\nignore_startup_parameters = extra_float_digits\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        for f in self.dir.iterdir():
            f.chmod(0o644)
        as_user: dict = {}
        if os.geteuid() == 0:
            pg = pwd.getpwnam("postgres")
            as_user = {"user": pg.pw_uid, "group": pg.pw_gid, "extra_groups": []}
        self.proc = subprocess.Popen([binary, str(ini)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, **as_user)
        deadline = time.monotonic() + 30
        while not self._answers():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("PgBouncer did not accept connections within 30 s")
            time.sleep(0.05)

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            log = self.dir / "pgbouncer.log"
            raise RuntimeError(f"PgBouncer exited: {log.read_text() if log.exists() else ''}")
        try:
            self.show("VERSION", database=None)
            return True
        except psycopg.OperationalError:
            return False

    def show(self, what: str, database: str | None = "") -> dict:
        """One row of ``SHOW <what>`` on PgBouncer's admin console: the one of ``database``
        (default: this URL's), or the first when ``database`` is None."""
        dsn = f"host=127.0.0.1 port={self.port} dbname=pgbouncer user={self._user}"
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as c:
            cur = c.execute(f"SHOW {what}")
            names = [d.name for d in cur.description]
            rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
        if database is None:
            return rows[0]
        want = database or self.database
        return next(r for r in rows if r["database"] == want)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
