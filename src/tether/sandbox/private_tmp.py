"""Each session's own /tmp: one directory per session, which that session's sandboxed commands see at /tmp
and its file tools reach through /tmp paths (`PrivateTmp.map`: the one place that decides the mapping).

The sessions' directories lie in one base directory inside the machine's temp directory
(`<tmp>/.tether-tmp-<uid>-<random>`, mode 0700, made with `mkdtemp` so no other user can have made it
first, owned by the sandbox's `run_as` user where there is one); its name is recorded in the device's state
directory (`private-tmp-base`), so a restarted device — or the next local `tether exec` of a named session —
finds it again, and two devices of one user (each its own state directory) never share or overwrite each
other's record or base. The record is read and written only through the state directory's descriptor, never
through a link, and only when the directory and the record are this process's user's and nobody else may
write them; it is only ever taken to name a base-shaped directory of this user right in the temp dir. With
no state directory, nothing is recorded: each run makes its own base. Inside, a session's directory is named
by a hash of the session id (any string is a valid session id; a name is not).

A session's directory is removed when the session ends: the server tells the device with the `end_session`
meta tool (a task that finished, failed or was cancelled; a one-off `tether exec` call) and `remove` runs.
A device that was away then (or one the server does not tell: a session named by hand) expires the
directory itself once the session has been idle (no command, no file tool through /tmp) for `idle_s`.
Idle is the directory's mtime, touched at each use, so the expiry survives a device restart too:
leftovers of an earlier run are removed when the device starts (`sweep`), and every time a session's
directory is made.

The base itself: a process that uses it holds a shared `flock` on it (taken before first use, checked to
still be the directory at that name and held by no other process, kept until `close`), so a base nobody
holds belongs to no living device, and a living device's base is never taken by another. When a device
stops cleanly (`close`) it removes its base if it is empty and no other process holds it. When a sandbox
starts (`sweep_bases`), the bases of this user that no living process holds — left by a device that was
killed, or one whose state directory was thrown away — lose their sessions' directories idle past `idle_s`,
and go when that leaves them empty. Only real directories named
`.tether-tmp-<uid>-…`, owned by the user bases are given to and of mode 0700, are touched, through file
descriptors that never follow a link; nothing is ever adopted from the temp dir but through the record.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
import time

from tether.sandbox.tmp_record import TmpRecord

PREFIX = ".tether-tmp-"  # a base's name in the temp dir: PREFIX, this process's uid, "-", random
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAKE_TRIES = 8  # a fresh base swept away by another device's start before it was held: make another
IDLE_S = 24 * 3600.0  # a session idle this long has ended: its /tmp goes


def session_key(session: str) -> str:
    """The name of `session`'s directory: 32 hex digits of its sha256 (a session id may hold any text)."""
    return hashlib.sha256(session.encode("utf-8", "surrogateescape")).hexdigest()[:32]


class PrivateTmp:
    """The sessions' private /tmp directories of one device's sandbox.

    `tmp`: the real temp directory the sandbox gives each session privately (a captured write root);
    `state_dir`: the device's state directory, where the base's name is recorded for its next run (None:
    not recorded, each run makes its own base); `owner`: (uid, gid) the directories are given to
    (a root device's sandbox user), None for this process's user; `keep`: paths below `tmp` that stay
    the machine's own (the write roots and sockets the policy names there): neither mapped nor hidden;
    `captured`: those of `keep` that are captured write roots (a command sees them through the temp dir's
    overlay, so its writes there are captured as before).
    """

    def __init__(self, tmp: str, state_dir: str | os.PathLike[str] | None, *, owner: tuple[int, int] | None = None,
                 keep: tuple[str, ...] = (), captured: tuple[str, ...] = (), idle_s: float = IDLE_S) -> None:
        self.tmp = os.path.realpath(tmp)
        self.keep = tuple(k.rstrip("/") for k in keep)
        self.captured = tuple(k.rstrip("/") for k in captured)
        self.idle_s = idle_s
        self._record = None if state_dir is None else TmpRecord(os.fspath(state_dir))
        self._owner = owner
        self._base: str | None = None
        self._held: int | None = None  # the base's fd, under this process's shared flock
        self._known: set[str] = set()  # sessions whose directory this run has made or found

    @property
    def base(self) -> str:
        """The base directory (found again from the record, or made), checked to be ours: a directory, not
        a link, mode 0700, owned by the owner. OSError when it cannot be made."""
        if self._base is None:
            self._base = self._found() or self._make()
        return self._base

    def _found(self) -> str | None:
        """The base this run holds, else the recorded one if it can be held now (then this run's), else None."""
        if self._base is None:
            found = self._find()
            if found is not None and self._hold(found):
                self._base = found
        return self._base

    @property
    def made(self) -> str | None:
        """The base directory once this run has made or found it (`base`), else None."""
        return self._base

    def _find(self) -> str | None:
        record = self._record
        recorded = None if record is None else record.read()
        if record is None or recorded is None:
            return None
        if os.path.dirname(recorded) != self.tmp or os.path.normpath(recorded) != recorded \
                or not os.path.basename(recorded).startswith(f"{PREFIX}{os.getuid()}-"):
            record.warn(f"{record} does not name a private /tmp base of this device: a new one is made")
            return None
        try:
            st = os.lstat(recorded)
        except OSError:
            return None
        if not self._ours(st):
            record.warn(f"{recorded} is not the device's own private /tmp base: a new one is made")
            return None
        return recorded

    def _ours(self, st: os.stat_result) -> bool:
        uid = os.getuid() if self._owner is None else self._owner[0]
        return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700

    def _hold(self, path: str) -> bool:
        """Take the shared flock on the base at `path` for this run: True once held and checked to still be
        that directory, ours, and held by no other process (a sweep that emptied and removed it first leaves
        nothing to hold, another living device holds its own: False)."""
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while another device's start removes it (sweep_bases)
            # no other living process may hold it: a base is one device's (a record naming another's is not
            # followed into it); then shared again, so that its holder's `close` sees a later holder too
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_SH)
            st, now = os.fstat(fd), os.lstat(path)
        except OSError:
            os.close(fd)
            return False
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino) or st.st_nlink == 0 or not self._ours(st):
            os.close(fd)
            return False
        self._held = fd
        return True

    def _make(self) -> str:
        for _ in range(_MAKE_TRIES):
            base = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getuid()}-", dir=self.tmp)  # 0700, never pre-made
            self._own(base)
            if self._hold(base):
                break
        else:
            raise OSError(errno.EAGAIN, f"a private /tmp base in {self.tmp} was removed as soon as it was made")
        if self._record is not None:
            self._record.write(base)
        return base

    def _own(self, path: str) -> None:
        if self._owner is not None:
            os.chown(path, *self._owner, follow_symlinks=False)

    def dir_of(self, session: str) -> str:
        """`session`'s directory (made, mode 0700, on first use), its mtime touched: it is in use now.
        OSError when it cannot be made."""
        path = os.path.join(self.base, session_key(session))
        if session in self._known:
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)
                return path
        self._known.add(session)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:  # left by an earlier run: its session goes on, unless it was idle long enough to have ended
            if stat.S_ISDIR(st.st_mode) and time.time() - st.st_mtime <= self.idle_s:
                os.utime(path, follow_symlinks=False)
                return path
            _remove_tree(path)
        os.mkdir(path, 0o700)
        self._own(path)
        return path

    def knows(self, session: str) -> bool:
        """Whether this run has made or found `session`'s directory already."""
        return session in self._known

    def is_kept(self, path: str) -> bool:
        """Whether `path` (absolute) is one of the machine's own paths below the temp dir (`keep`)."""
        return any(path == k or path.startswith(k + "/") for k in self.keep)

    def map(self, session: str | None, path: str) -> str:
        """Where `path` leads for `session`: a path at or below the temp dir (but for the kept ones) leads
        into the session's own directory; any other path, a path already inside the sessions' base (mapped
        before, or another session's, which `foreign` refuses), or any path without a session, is itself.
        Lexical (no link is followed): the caller's jail resolves the result."""
        if not session:
            return path
        absolute = os.path.normpath(os.path.expanduser(path))
        if not os.path.isabs(absolute) or self.is_kept(absolute):
            return path
        if absolute != self.tmp and not absolute.startswith(self.tmp + "/"):
            return path
        if absolute == self.base or absolute.startswith(self.base + "/"):
            return path
        rest = absolute[len(self.tmp):].lstrip("/")
        own = self.dir_of(session)
        return os.path.join(own, rest) if rest else own

    def unmap(self, session: str | None, resolved: str) -> str:
        """The inverse of `map` for a real path: inside `session`'s own directory, the /tmp path its commands
        see it at; any other path is itself."""
        base = self._base or self._find()
        if not session or base is None:
            return resolved
        own = os.path.join(base, session_key(session))
        if resolved != own and not resolved.startswith(own + "/"):
            return resolved
        return self.tmp + resolved[len(own):]

    def foreign(self, session: str | None, resolved: str) -> bool:
        """Whether `resolved` (a real path) lies in the sessions' base but outside `session`'s own directory:
        another session's /tmp (or the base itself), which no tool may reach."""
        base = self._base or self._find()
        if base is None or (resolved != base and not resolved.startswith(base + "/")):
            return False
        if not session:
            return True
        own = os.path.join(base, session_key(session))
        return resolved != own and not resolved.startswith(own + "/")

    def remove(self, session: str) -> bool:
        """Remove `session`'s directory now (its session has ended); whether there was one."""
        self._known.discard(session)
        base = self._found()
        if base is None:
            return False
        path = os.path.join(base, session_key(session))
        there = os.path.lexists(path)
        _remove_tree(path)
        return there

    def sweep(self, now: float | None = None) -> list[str]:
        """Remove the directories of sessions idle past `idle_s` (and any stray entry of the base); the
        names removed. Leftovers of an earlier run go the same way; a session that comes back later
        starts with an empty /tmp (`dir_of`)."""
        base = self._found()
        if base is None:
            return []
        now = time.time() if now is None else now
        gone = []
        try:
            entries = list(os.scandir(base))
        except OSError:
            return []
        for entry in entries:
            try:
                idle = now - entry.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            if idle > self.idle_s:
                _remove_tree(entry.path)
                gone.append(entry.name)
        return gone


    def close(self) -> bool:
        """The device stops: let go of the base, removing it (and its record) when it is empty and no other
        process holds it. Whether it was removed. Blocking file I/O; idempotent."""
        fd, base = self._held, self._base
        self._held = self._base = None
        self._known.clear()
        if fd is None or base is None:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process uses it too: it stays
                os.rmdir(base)  # only when empty: a session that outlives this run keeps it
            except OSError:
                return False
            if self._record is not None:
                self._record.drop(base)
            return True
        finally:
            os.close(fd)

    def sweep_bases(self, now: float | None = None) -> list[str]:
        """Clear away the other bases of this user in the temp dir that no living process holds: their sessions'
        directories idle past `idle_s` go, then the base itself if that leaves it empty. The names of the
        bases removed. Entries that are links, not directories, not owned by the user bases are given to, or
        not of mode 0700 are left alone, and nothing is followed through a link."""
        now = time.time() if now is None else now
        prefix = f"{PREFIX}{os.getuid()}-"
        try:
            tmp_fd = os.open(self.tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return []
        gone = []
        try:
            names = [n for n in os.listdir(tmp_fd) if n.startswith(prefix)]
            own = os.path.basename(self._base) if self._base else None
            for name in names:
                if name != own and self._sweep_base(tmp_fd, name, now):
                    gone.append(name)
        except OSError:
            pass
        finally:
            os.close(tmp_fd)
        return gone

    def _sweep_base(self, tmp_fd: int, name: str, now: float) -> bool:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=tmp_fd)  # a link fails here (O_NOFOLLOW)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not self._ours(st):
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # a living device holds it
            at = os.stat(name, dir_fd=tmp_fd, follow_symlinks=False)
            if (at.st_dev, at.st_ino) != (st.st_dev, st.st_ino):
                return False  # removed and remade meanwhile: not the directory checked
            for entry in os.scandir(fd):
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > self.idle_s:
                        _remove_entry(fd, entry.name)
            try:
                os.rmdir(name, dir_fd=tmp_fd)
            except OSError:
                return False  # sessions of a stopped device that may come back: it stays
            return True
        finally:
            os.close(fd)


def _remove_tree(path: str) -> None:
    """Remove a session's directory whatever its commands left there (read-only directories included)."""
    parent, name = os.path.split(path)
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        _remove_entry(parent_fd, name)
    finally:
        os.close(parent_fd)


def _remove_entry(dir_fd: int, name: str) -> None:
    """Remove `name` in the directory `dir_fd`, whatever is below it, never following a link: a link or file is
    unlinked; a directory's subdirectories are made writable (through descriptors, so a link swapped in
    meanwhile is never chmod-ed through) and the tree removed."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        return
    _writable(dir_fd, name)
    try:
        top = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return
    try:
        for _, dirs, _, root_fd in os.fwalk(dir_fd=top):  # never into a link
            for inner in dirs:
                _writable(root_fd, inner)
    finally:
        os.close(top)
    shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)


def _writable(dir_fd: int, name: str) -> None:
    """Mode 0700 on the directory `name` in `dir_fd`, only if it is one (not a link to one)."""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.chmod(f"/proc/self/fd/{fd}", 0o700)
    except OSError:
        pass
    finally:
        os.close(fd)
