"""Jobs run as the submitter (issue 13): the Unix account each platform user's ranks run under.

An agent started with ``--user-map FILE`` (or ``HAI_AGENT_USER_MAP``) — in production, an agent
running as root — starts every rank under the Unix account the admin mapped to the submitting
user, and gives that account the job's checkpoint and log folders (mode 0700). A user with no
mapping, or one mapped to root, is refused with a clear reason: the attempt fails to launch and
the job fails with that reason. Nothing is ever run as root on a user's behalf.

Without a user map (development: ``hai dev``, a laptop) ranks run as the agent's own user. An
agent running as root without a user map would run every user's ranks as root, so ``hai agent``
refuses to start that way (``root_without_user_map``) unless told ``--ranks-as-agent-user``
(development only; ``hai dev`` passes it).

The file, one mapping a line (``#`` starts a comment)::

    # platform user    Unix account
    alice              alice
    bob                bsmith
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path


class UnmappedUser(Exception):
    """The submitting user may not run jobs on this node (no account, or a forbidden one)."""


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


def parse_user_map(text: str, *, source: str = "the user map") -> dict[str, str]:
    mapping: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{source}, line {n}: expected 'platform-user unix-account', got {raw.strip()!r}")
        mapping[parts[0]] = parts[1]
    return mapping


class UserMap:
    """The admin's mapping, re-read when the file changes (an admin adds a user without
    restarting agents)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._mtime: float | None = None
        self._map: dict[str, str] = {}
        self._load()

    def _load(self) -> None:
        st = self.path.stat()
        if st.st_mtime != self._mtime:
            self._map = parse_user_map(self.path.read_text(), source=str(self.path))
            self._mtime = st.st_mtime

    def account(self, user: str) -> Account:
        try:
            self._load()
        except (OSError, ValueError) as e:
            raise UnmappedUser(f"the user map {self.path} cannot be read ({e}); not running {user}'s job") from e
        name = self._map.get(user)
        if name is None:
            raise UnmappedUser(
                f"user {user!r} has no Unix account on this node: the admin maps platform users to "
                f"accounts in {self.path} (HAI_AGENT_USER_MAP); jobs never run as root"
            )
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise UnmappedUser(f"user {user!r} is mapped to Unix account {name!r}, which does not exist on this node") from None
        if pw.pw_uid == 0:
            raise UnmappedUser(f"user {user!r} is mapped to {name!r}, a root account; jobs never run as root")
        groups = tuple(sorted({g for g in os.getgrouplist(name, pw.pw_gid) if g != 0}))
        return Account(name=name, uid=pw.pw_uid, gid=pw.pw_gid, groups=groups, home=pw.pw_dir)


def root_without_user_map(euid: int, user_map: str | None, ranks_as_agent_user: bool) -> str | None:
    """Why an agent must not start this way (None: it may): as root, with no user map, every
    user's ranks would run as root."""
    if euid != 0 or user_map or ranks_as_agent_user:
        return None
    return (
        "the agent runs as root and has no user map, so every user's ranks would run as root. "
        "Give --user-map FILE (HAI_AGENT_USER_MAP: one 'platform-user unix-account' a line), "
        "or, for development only, --ranks-as-agent-user (HAI_AGENT_RANKS_AS_AGENT_USER=1)"
    )


def own_private(path: Path, account: Account | None) -> None:
    """``path`` (a folder) readable by its owner only: mode 0700, owned by ``account`` when the
    ranks run under one (the agent, as root, keeps access)."""
    if account is not None:
        os.chown(path, account.uid, account.gid)
    os.chmod(path, 0o700)
