"""icl_files: the one writer through which the project's tools put files into a folder the user names.

A tool (experiments.py, the reference-vectors writer) writes a set of files into an output folder
that may already hold the user's own files, an earlier run's results, a symbolic link or a FIFO
someone put there, or another run of the same tool. Every tool keeps the same promises, here:

1. It owns only what it wrote. A file is replaced or removed only when its bytes hash (SHA-256)
   to what a record of the tool says the tool wrote under that name; any other file is the user's:
   the call is refused (Refused), naming it and why, and touches nothing.
2. It never writes through a symbolic link: not into a folder named by a link (`LINK`, `LINK/`,
   `LINK/.`; a Windows junction likewise), not into a file whose name is a link.
3. It opens regular files only: a FIFO, device or folder under a file's name is seen (lstat)
   before anything opens it, so nothing blocks.
4. One run at a time writes into a folder: a lock.
5. It keeps a record. The run's record (a JSON file in the folder: experiments.py's config.json)
   lists every file the run wrote with its SHA-256, and carries the run's status (STATUSES). Before
   a file is written its name and the hash of the bytes about to be written are recorded as
   `writing`; once written it moves to `files`. After a SIGKILL or a crash the next run (with
   overwrite) therefore proves every file it finds by its hash, removes or replaces those, and names
   the rest (a file cut short as it was written) for the user to remove. A file whose write fails
   in this process is removed at once: the descriptor the run holds proves it its own. The record
   carries its own SHA-256 (SEAL, sealed_json): a record edited since it was written is the user's
   file like any other, and vouches for nothing.
6. A write the operating system refuses (disk full ENOSPC, the file-size limit EFBIG - Python
   ignores SIGXFSZ, so `ulimit -f` gives EFBIG -, no permission EACCES, read-only disk EROFS) is a
   WriteFailed naming the file and what to do; the tool then records that status if it still can.

Portable means. Where the operating system offers them (Linux, macOS, the BSDs) the folder is opened
once (O_DIRECTORY | O_NOFOLLOW) and every file is reached through that descriptor (dir_fd), so a
link swapped in for the folder later changes nothing; files are opened with O_NOFOLLOW, and the lock
is fcntl.flock on a lock file, which the kernel releases when a run dies however it dies. Where they
are missing (Windows) the same promises are kept by other means: every file is reached by its path,
the folder's and the file's identity (device and inode, from lstat) are checked before and after
each open, a file is created with O_CREAT | O_EXCL (which never follows a link), and the lock is a
file created with O_CREAT | O_EXCL holding the run's pid and host. Such a lock file outlives a run
killed by SIGKILL; a later run takes it over when its pid names no running process of this host (a
second file, `<lock>.break`, also created exclusively, makes the takeover one run's), and otherwise
refuses, naming the pid and the file to remove if no run is writing. A pid reused by an unrelated
process, or a lock of another host (a shared drive), is never taken over.

API
    Folder(path, tool, record, lock, trusted=None, vouchers=None)
                      the output folder `path` of one run of `tool`; `record` and `lock` name the
                      run's record and its lock file in the folder (see the class for the others)
    Folder.open(overwrite, keep_others, writes)
                      check the folder (created if new), lock it, check it again; Refused, touching
                      nothing, unless every file this run may write (`writes(name)`) is absent or
                      provably an earlier run's, and (unless keep_others) every file is
    Folder.earlier    the earlier run's trusted record (a dict), or None
    Folder.fields     the tool's own fields of the record (a dict the tool fills)
    Folder.owned      {name: sha256}: the files the record vouches for now
    Folder.save(status=None, **fields)
                      write the record (atomically: a temporary file renamed over it)
    Folder.write(files)
                      files {name: bytes}: record the intent, create each (an owned file of that
                      name replaced), record the result; WriteFailed or Refused on failure
    Folder.remove(names)
                      remove owned files (their bytes checked again first)
    Folder.discard_record()
                      remove the record, for a tool whose last file vouches for the rest
    Folder.close()    release the lock (`with folder:` closes it too)
    Folder.show(name) the path of `name` in the folder, for messages
    Means.detect()    what the operating system offers (fcntl, O_NOFOLLOW, dir_fd), read at each open
    write_file_set(path, files, tool, record, lock, vouchers, overwrite)
                      the whole of a run that writes a fixed set of files: the vectors writer's use
    sha256(data)      the hex SHA-256 of bytes, as records carry it
    sealed_json(value, **dumps), unseal(data)
                      a record's bytes carrying their own SHA-256 under SEAL; the record back, or
                      None when its bytes changed since
    replace_file(path, data)
                      one of the project's own tracked files (a document, a record under docs/),
                      written whole and renamed into place; never through a symbolic link
    source_state(files)
                      {commit, dirty}: the git commit a run's code comes from, and whether
                      any of `files` differs from it (a record's provenance)
    Refused           (a ValueError) the folder or a file in it refused by the rules above
    WriteFailed       (an OSError) the operating system refused a write; the message says what to do
    STATUSES          a record's statuses: running, complete, interrupted, broken pipe,
                      write error, crashed
    JOURNAL_FORMAT    the format marker of a record write_file_set keeps

The vectors writer (a fixed set of files and manifest.json, whose format is public: per case its
`file` and `sha256`) calls write_file_set: the manifest, written last, vouches for the case files
(a voucher), the run's own record is a hidden file present only while the run writes, so a complete
folder holds exactly the files and the manifest:

    def manifest_files(manifest):        # the files an earlier manifest vouches for, if it is ours
        if manifest.get("format") != "icl_ref reference vectors":
            return None
        return {case["file"]: case["sha256"] for case in manifest["cases"]}

    files = {f"{case['name']}.npz": npz_bytes(case) for case in cases}
    files["manifest.json"] = manifest_bytes                      # last: it vouches for the rest
    icl_files.write_file_set(out, files, tool="icl_ref vectors", record=".vectors-record.json",
                             lock=".vectors.lock", vouchers={"manifest.json": manifest_files},
                             overwrite=overwrite)

Refused is a ValueError and WriteFailed an OSError, the exceptions the vectors writer raises today.
"""
import dataclasses
import errno
import hashlib
import json
import os
import socket
import stat
import subprocess

STATUSES = ("running", "complete", "interrupted", "broken pipe", "write error", "crashed")
JOURNAL_FORMAT = "icl_files record"
SEAL = "self_sha256"                  # a record's own hash (sealed_json): a record edited since is not trusted
_UNSEALED = "0" * 64
MAX_RECORD_BYTES = 64 << 20          # a larger file under a record's name is not read: no record is that big
_CHUNK = 1 << 20


class Refused(ValueError):
    """The folder, or a file in it, is not this run's to write: the message names it, says why and
    what to do. Nothing was touched by the call that raised it."""


class WriteFailed(OSError):
    """The operating system refused a write into the folder (errno kept); the message names the
    file and says what to do."""

    ADVICE = {errno.ENOSPC: "the disk is full: free some space and run again",
              getattr(errno, "EDQUOT", errno.ENOSPC): "your disk quota is used up: free some space and run again",
              errno.EFBIG: "the file is larger than the file-size limit (ulimit -f): raise it and run again",
              errno.EACCES: "no permission to write there: make the folder writable or name another",
              errno.EPERM: "no permission to write there: make the folder writable or name another",
              errno.EROFS: "the disk is read-only: name a folder on a writable disk"}

    def __init__(self, path, error):
        super().__init__(error.errno, error.strerror, path)
        advice = self.ADVICE.get(error.errno, "check the folder and run again")
        self.message = f"cannot write {path!r}: {error.strerror or error}; {advice}"

    def __str__(self):
        return self.message


def sha256(data):
    """The hex SHA-256 of `data` (bytes), the form a record keeps."""
    return hashlib.sha256(data).hexdigest()


def sealed_json(value, **dumps):
    """`value` (a dict) as JSON bytes (json.dumps(value, **dumps) and a newline) that carry their own
    SHA-256 under SEAL: the hash of these very bytes with SEAL's value written as 64 zeros. A record
    so sealed proves itself as its tool wrote it: any change (a user's edit) breaks the seal (unseal),
    and the file is then the user's."""
    if SEAL in value:
        raise ValueError(f"value must not carry {SEAL!r} already: it is added here")
    data = (json.dumps({**value, SEAL: _UNSEALED}, **dumps) + "\n").encode()
    placeholder = f'"{_UNSEALED}"'.encode()
    if data.count(placeholder) != 1:               # a value of 64 zeros elsewhere would make the seal ambiguous
        raise ValueError(f"value must not hold the string {_UNSEALED!r}: it marks where the seal goes")
    return data.replace(placeholder, f'"{sha256(data)}"'.encode())


def unseal(data):
    """The dict that sealed JSON bytes hold (without SEAL), or None: not JSON, not a dict, no seal, or
    a seal that does not match the bytes (changed since they were written)."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):     # nested deeper than Python's stack: no record
        return None
    seal = value.pop(SEAL, None) if isinstance(value, dict) else None
    if not (isinstance(seal, str) and len(seal) == 64 and set(seal) <= set("0123456789abcdef")):
        return None
    quoted = f'"{seal}"'.encode()
    if data.count(quoted) != 1 or sha256(data.replace(quoted, f'"{_UNSEALED}"'.encode())) != seal:
        return None
    return value


def _write_fd(fd, data):
    """All of `data` to the descriptor fd (os.write may write less than it is given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@dataclasses.dataclass(frozen=True)
class Means:
    """What this operating system offers the writer: fcntl (for flock) or None; O_NOFOLLOW or 0;
    whether files can be reached through the folder's descriptor (O_DIRECTORY, O_NOFOLLOW, dir_fd
    for open, stat, unlink and rename, and listdir of a descriptor). Read at each Folder.open, so
    a process that hides them (the tests do) gets the portable means."""
    fcntl: object
    nofollow: int
    dir_fd: bool

    @classmethod
    def detect(cls):
        try:
            import fcntl
        except ImportError:
            fcntl = None
        nofollow = getattr(os, "O_NOFOLLOW", 0)
        dir_fd = (hasattr(os, "O_DIRECTORY") and nofollow != 0 and os.listdir in os.supports_fd
                  and {os.open, os.stat, os.unlink, os.rename} <= os.supports_dir_fd)
        return cls(fcntl, nofollow, dir_fd)


def _folder_path(path):
    """`path` as the folder it names, for lstat and O_NOFOLLOW to see its last component: trailing
    separators and "/." dropped (`LINK/` and `LINK/.` are LINK itself; a trailing separator would
    make the system follow a link). A path ending in ".." is refused: the folder it reaches is not
    the one its name says."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path) or not isinstance(os.fspath(path), str):
        raise Refused(f"the output folder must be named by a non-empty path, got {path!r}")
    text = os.fspath(path)
    seps = os.sep + (os.altsep or "")
    while True:
        stripped = text.rstrip(seps)
        if not os.path.splitdrive(stripped)[1]:                # the root ("/", "C:\\") stays the root
            stripped = text[:len(stripped) + 1]
        head, tail = os.path.split(stripped)
        if tail == "." and head:
            text = head
            continue
        break
    if tail == "..":
        raise Refused(f"{path!r} ends in '..': name the folder by its own name")
    return stripped


def _is_link(st):
    """A symbolic link, or on Windows any reparse point (a junction too)."""
    return stat.S_ISLNK(st.st_mode) or bool(getattr(st, "st_reparse_tag", 0))


def _kind(st):
    """What a directory entry is, for messages."""
    if _is_link(st):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    if stat.S_ISFIFO(st.st_mode):
        return "a FIFO"
    return "a regular file" if stat.S_ISREG(st.st_mode) else "a device or socket"


def _same(a, b):
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _plain(name):
    """Whether `name` names a file in the folder itself: no separator, not '.' or '..', no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
            and not any(s and s in name for s in (os.sep, os.altsep)))


def _hashes(value):
    """`value` as {plain name: sha256} when it is one, else None (a record that is not one is not trusted)."""
    if not isinstance(value, dict):
        return None
    for name, digest in value.items():
        if not (_plain(name) and isinstance(digest, str) and len(digest) == 64
                and all(c in "0123456789abcdef" for c in digest)):
            return None
    return value


def _running(pid):
    """Whether process `pid` of this host runs: True, False, or None where that cannot be asked
    (os.kill(pid, 0) asks on POSIX; on Windows signal 0 is CTRL_C_EVENT, not a question)."""
    if os.name != "posix":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                 # another user's process: it runs
        return True
    return True


class Folder:
    """The output folder of one run of a tool.

    path      the folder (created if new; refused if it is a symbolic link or not a folder)
    tool      the tool's name, for messages ("experiments.py")
    record    the name of the run's record, a JSON file in the folder: the tool's `fields`, then
              "status", "files" {name: sha256} (written) and "writing" {name: sha256} (about to be)
    lock      the name of the lock file, present while a run holds the folder
    trusted   trusted(record dict) -> bool: whether an earlier record is this tool's (its format
              marker, its version); by default a record of JOURNAL_FORMAT for `tool`
    vouchers  {name: claims}: other records of the tool that vouch for files, claims(parsed JSON)
              -> {file: sha256}, or None when the file is not such a record (the vectors' manifest)

    open() must succeed before anything is written; close() (or leaving `with folder:`) releases
    the lock whatever happened."""

    def __init__(self, path, tool, record, lock, trusted=None, vouchers=None):
        self.given, self.tool, self.record, self.lock = path, tool, record, lock
        self.path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
        self.temp = f".{record}.tmp"                  # the record is written here, then renamed over itself
        self.breaker = f"{lock}.break"
        self.trusted = trusted or (lambda r: r.get("format") == JOURNAL_FORMAT and r.get("tool") == tool)
        self.vouchers = dict(vouchers or {})
        self.fields, self.status = {}, "running"
        self.owned, self.writing = {}, {}
        self.earlier = None
        self.means = self.dfd = self.identity = None
        self.lock_fd = self.lock_id = self.record_id = None
        self.stale_temp = False

    # ---- the folder: opened once, refused when it is a link; every name reached inside it ----

    def show(self, name):
        return os.path.join(self.path, name)

    def open(self, overwrite, keep_others, writes):
        """Check, lock and check again. `writes(name)`: whether this run may write a file of that name
        (the record and its temporary file always). keep_others: leave files that are not provably
        ours and that this run does not write (None: not an option of this tool). Refused, touching
        nothing, when the folder cannot be used as it is."""
        self.means = Means.detect()
        self.path = _folder_path(self.given)
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise Refused(f"{self.path!r} cannot be used: {e.strerror}") from None
        if st is not None and _is_link(st):
            raise Refused(f"{self.path!r} is a symbolic link: not writing through it; name the folder itself")
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise Refused(f"{self.path!r} exists and is not a directory: name a new or an earlier output folder")
        if st is None:
            try:
                os.makedirs(self.path)
            except OSError as e:
                raise Refused(f"{self.path!r} cannot be created: {e.strerror}") from None
        self._attach()
        try:
            self._survey(overwrite, keep_others, writes)      # refuse before writing even the lock
        except Refused:
            if self._held():                                 # what was seen is another run's work in progress
                raise self._in_use() from None
            raise
        self._acquire()
        self._survey(overwrite, keep_others, writes)          # again, now that no other run can write

    def _attach(self):
        """Fix which folder this run writes into: its descriptor (dir_fd means) or its identity (others)."""
        try:
            st = os.lstat(self.path)
            if self.means.dir_fd:
                self.dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                if not _same(st, os.fstat(self.dfd)):
                    raise OSError(errno.ELOOP, "replaced while being opened")
        except OSError as e:                          # ELOOP: a link put there since the check
            raise Refused(f"{self.path!r} cannot be opened as a folder ({e.strerror}): not writing "
                          "through a symbolic link; name the folder itself") from None
        if _is_link(st) or not stat.S_ISDIR(st.st_mode):
            raise Refused(f"{self.path!r} was replaced while being opened: not writing into it")
        self.identity = st

    def _check_folder(self):
        """Portable means: the folder is still the one opened (no link or other folder swapped in)."""
        if self.dfd is None:
            try:
                st = os.lstat(self.path)
            except OSError:
                st = None
            if st is None or _is_link(st) or not _same(st, self.identity):
                raise Refused(f"{self.path!r} was replaced (by a link or another folder) while this run "
                              "wrote into it: stopping; not writing anywhere else")

    def _lstat(self, name):
        """The entry `name` in the folder, not followed; None when there is none."""
        self._check_folder()
        try:
            if self.dfd is not None:
                return os.stat(name, dir_fd=self.dfd, follow_symlinks=False)
            return os.lstat(self.show(name))
        except FileNotFoundError:
            return None

    def _listdir(self):
        self._check_folder()
        return set(os.listdir(self.dfd if self.dfd is not None else self.path))

    def _open(self, name, flags, before=None):
        """A descriptor of `name` in the folder, never through a link and only of a regular file.
        `before`: the entry's lstat when it exists (it must still be that file); creating with
        O_EXCL, no entry may exist. Portable means: the entry after the open must be the file opened."""
        flags |= self.means.nofollow | getattr(os, "O_BINARY", 0)
        if self.dfd is not None:
            fd = os.open(name, flags, 0o644, dir_fd=self.dfd)
        else:
            self._check_folder()
            fd = os.open(self.show(name), flags, 0o644)
        try:
            opened = os.fstat(fd)
            now = self._lstat(name)
            if (not stat.S_ISREG(opened.st_mode) or now is None or not _same(opened, now)
                    or (before is not None and not _same(before, opened))):
                raise Refused(f"{self.show(name)!r} changed while being opened (a link or another file put "
                              "there): not using it")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _read(self, name, st, limit=None):
        """The bytes of the regular file `name` (lstat `st`), read without following a link or
        blocking on a FIFO; None when it is larger than `limit`."""
        if limit is not None and st.st_size > limit:
            return None
        fd = self._open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0), before=st)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def _digest(self, name, st):
        """The SHA-256 of the regular file `name`, read in chunks."""
        h = hashlib.sha256()
        fd = self._open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0), before=st)
        with os.fdopen(fd, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
        return h.hexdigest()

    def _unlink(self, name):
        if self.dfd is not None:
            os.unlink(name, dir_fd=self.dfd)
        else:
            self._check_folder()
            os.unlink(self.show(name))

    def _rename(self, src, dst):
        if self.dfd is not None:
            os.replace(src, dst, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
        else:
            self._check_folder()
            os.replace(self.show(src), self.show(dst))

    # ---- what is in the folder, and whose ----

    def _json_at(self, name, st):
        """The record (a dict) in the regular file `name` (lstat `st`), or None: not a regular file,
        too large to be a record, unreadable, or not sealed JSON as its tool wrote it (unseal)."""
        if st is None or not stat.S_ISREG(st.st_mode):
            return None
        try:
            return unseal(self._read(name, st, MAX_RECORD_BYTES) or b"")
        except (OSError, Refused):
            return None

    def _claims(self, entries):
        """What the trusted records in the folder vouch for: ({file: {sha256}} written, {file:
        {sha256}} being written, the names of the trusted records, the run's record or None). The
        temporary record (a run killed as it renamed it) counts when it is whole; the record itself
        is the earlier run's record when both are."""
        claims, writing, records, earlier = {}, {}, set(), None
        for name in (self.temp, self.record):
            found = self._json_at(name, entries.get(name))
            if (isinstance(found, dict) and self.trusted(found) and _hashes(found.get("files")) is not None
                    and _hashes(found.get("writing")) is not None):
                records.add(name)
                earlier = found
                for key, into in (("files", claims), ("writing", writing)):
                    for f, h in found[key].items():
                        into.setdefault(f, set()).add(h)
        for name, vouch in self.vouchers.items():
            found = self._json_at(name, entries.get(name))
            try:
                vouched = _hashes(vouch(found)) if isinstance(found, dict) else None
            except (KeyError, TypeError, ValueError, AttributeError):      # a malformed record vouches for nothing
                vouched = None
            if vouched is not None:
                records.add(name)
                for f, h in vouched.items():
                    claims.setdefault(f, set()).add(h)
        return claims, writing, records, earlier

    def _survey(self, overwrite, keep_others, writes):
        """Classify every entry of the folder; Refused when this run must not go on (see open)."""
        present = self._listdir() - {self.lock, self.breaker}
        self.owned, self.writing, self.earlier, self.record_id, self.stale_temp = {}, {}, None, None, False
        if not present:
            return
        if not overwrite:
            raise Refused(f"{self.path!r} is not empty: pass --overwrite to replace an earlier run's results, "
                          "or name a new directory")
        entries = {name: self._lstat(name) for name in present}
        entries = {name: st for name, st in entries.items() if st is not None}     # gone since the listing
        claims, writing, records, earlier = self._claims(entries)
        if not records:
            odd = [f"{n} is {_kind(entries[n])}" if not stat.S_ISREG(entries[n].st_mode) else
                   f"{n} is not a record this version of {self.tool} wrote, unchanged"
                   for n in (self.record, *self.vouchers) if n in entries]
            if self.temp in entries:                       # hidden: named, or the user would not find it
                odd.append(f"{self.show(self.temp)!r} is the temporary record of a run of {self.tool} stopped before "
                           "it wrote a record: remove it")
            raise Refused(f"{self.path!r} holds files but no record written by {self.tool}"
                          f"{': ' + '; '.join(odd) if odd else ''}. A record is "
                          f"{' or '.join((*self.vouchers, self.record))} in the format this version of {self.tool} "
                          "writes, with each file's SHA-256. Not touching the files; name a new directory")
        digests, why = {}, {}
        for name in sorted(set(entries) - records):
            st = entries[name]
            known = claims.get(name, set()) | writing.get(name, set())
            if not stat.S_ISREG(st.st_mode):
                why[name] = f"is {_kind(st)}: not opened, not replaced"
            elif name == self.temp:
                why[name] = f"is the temporary record of a run of {self.tool} stopped while writing it, cut short"
            elif not known:
                why[name] = f"was not written by any run of {self.tool}"
            elif (digest := self._digest(name, st)) in known:
                digests[name] = digest
            elif name in writing:
                why[name] = (f"was being written when a run of {self.tool} stopped, and its bytes are not what "
                             "that run meant to write (cut short, or yours)")
            else:
                why[name] = f"is not the file {self.tool} wrote under that name (changed since, or yours)"
        self._refuse_theirs(why, writes, keep_others)
        self.earlier = earlier
        self.record_id = entries.get(self.record) if self.record in records else None
        self.stale_temp = self.temp in records
        vouchers = {name: self._digest(name, entries[name]) for name in records - {self.record, self.temp}}
        self.owned = dict(sorted({**digests, **vouchers}.items()))

    def _refuse_theirs(self, why, writes, keep_others):
        """Refused when a file that is not provably ours has a name this run writes, or (unless
        keep_others) is there at all."""
        def listed(names):
            return "; ".join(f"{self.show(n)!r} {why[n]}" for n in names)
        mine = [n for n in why if n in (self.record, self.temp) or writes(n)]
        if mine:
            it, names = ("it", "a name") if len(mine) == 1 else ("them", "names")
            raise Refused(f"{self.path!r}: {listed(mine)}: {names} this run may write, so not replacing {it}; move "
                          f"{it} away (or remove {it}, if you do not need {it}), or name a new directory")
        if why and not keep_others:
            hint = "pass --keep-others to leave them there, or" if keep_others is not None else "not touching them;"
            raise Refused(f"{self.path!r} holds files that are not provably {self.tool}'s ({listed(sorted(why))}): "
                          f"{hint} name a new directory")

    # ---- the lock ----

    def _acquire(self):
        """Hold the folder: flock on the lock file where fcntl exists, else create it exclusively;
        the lock file then names this run (pid and host)."""
        try:
            if self.means.fcntl is not None:
                self._flock()
            else:
                self._lock_file()
            os.ftruncate(self.lock_fd, 0)
            _write_fd(self.lock_fd, json.dumps(dict(pid=os.getpid(), host=socket.gethostname())).encode())
        except OSError as e:
            raise Refused(f"{self.path!r}: cannot create the lock file {self.show(self.lock)!r} ({e.strerror}): "
                          "name a folder you can write into") from None

    def _held(self):
        """Whether another run holds the folder now, asked without writing anything."""
        try:
            st = self._lstat(self.lock)
            if st is None or not stat.S_ISREG(st.st_mode):
                return False
            if self.means.fcntl is None:
                owner = self._lock_owner(st)
                return owner is None or owner["host"] != socket.gethostname() or _running(owner["pid"]) is not False
            fd = self._open(self.lock, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0), before=st)
        except (OSError, Refused):
            return False
        try:
            self.means.fcntl.flock(fd, self.means.fcntl.LOCK_EX | self.means.fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)                                   # releases the probe's lock, if it got it

    def _in_use(self, holder=""):
        return Refused(f"{self.path!r} is in use by another {self.tool} run (it holds the lock "
                       f"{self.show(self.lock)!r}{holder}): wait for it to finish, or name another directory")

    def _lock_owner(self, st):
        """The pid and host a lock file names, or None when it names none (cut short, or not ours)."""
        try:
            owner = json.loads(self._read(self.lock, st, 4096) or b"null")
        except (OSError, ValueError, RecursionError, Refused):
            return None
        ok = isinstance(owner, dict) and isinstance(owner.get("pid"), int) and isinstance(owner.get("host"), str)
        return owner if ok else None

    def _lock_entry(self):
        """The lock file's lstat, or None; Refused when a file of that name cannot be a lock of this
        tool: not a regular file, linked elsewhere too (a hard link: truncating it would change the
        other name's file), or holding anything but nothing or a pid and host (a file of the user's)."""
        st = self._lstat(self.lock)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise Refused(f"{self.path!r}: the lock file {self.show(self.lock)!r} is {_kind(st)}: not using it; "
                          "remove it if no run is writing there")
        if st is not None and (st.st_nlink != 1 or st.st_size > 0 and self._lock_owner(st) is None):
            why = "has other names (hard links)" if st.st_nlink != 1 else "holds something other than a lock's pid and host"
            raise Refused(f"{self.path!r}: {self.show(self.lock)!r} {why}: not a lock of {self.tool}, not touching it; "
                          "move it away if it is yours, or name another directory")
        return st

    def _flock(self):
        """fcntl.flock on the lock file; a file its holder removed just before we locked it is not
        the lock any more: open the new one (a few tries)."""
        fcntl = self.means.fcntl
        for _ in range(5):
            before = self._lock_entry()
            flags = os.O_RDWR | (0 if before else os.O_CREAT | os.O_EXCL)
            try:
                fd = self._open(self.lock, flags, before=before)
            except (FileExistsError, FileNotFoundError):
                continue                                   # created or removed by another run meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise self._in_use() from None
            now = self._lstat(self.lock)
            if now is not None and _same(now, os.fstat(fd)):
                self.lock_fd, self.lock_id = fd, now
                return
            os.close(fd)
        raise self._in_use()

    def _lock_file(self):
        """Portable means: the lock file created exclusively; one left by a dead run of this host taken over."""
        for _ in range(2):
            try:
                self.lock_fd = self._open(self.lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                self.lock_id = os.fstat(self.lock_fd)
                return
            except FileExistsError:
                st = self._lock_entry()
                if st is None:
                    continue                               # its holder finished meanwhile
                owner = self._lock_owner(st)
                if not self._take_over(owner, st):
                    break
        st = self._lock_entry()
        owner = self._lock_owner(st) if st else None
        who = (f", pid {owner['pid']} on {owner['host']}; if no {self.tool} run is writing there, remove it"
               if owner else "; if no run is writing there, remove it")
        raise self._in_use(who)

    def _take_over(self, owner, st):
        """Remove a lock file whose run is dead (its pid runs no process on this host). The exclusive
        `<lock>.break` file makes this one run's act: no other run can remove the lock meanwhile, so
        the file removed is the one read. Returns whether it was removed."""
        if owner is None or owner["host"] != socket.gethostname() or _running(owner["pid"]) is not False:
            return False
        try:
            breaker = self._open(self.breaker, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            raise Refused(f"{self.path!r}: another run is taking over the lock of a stopped run "
                          f"({self.show(self.breaker)!r}); if none is, remove that file") from None
        try:
            now = self._lstat(self.lock)
            if now is not None and _same(now, st) and self._lock_owner(now) == owner:
                self._unlink(self.lock)
                return True
            return now is None
        finally:
            os.close(breaker)
            self._unlink(self.breaker)

    def close(self):
        """Release the lock (removing the lock file, still ours) and the folder's descriptor."""
        if self.lock_fd is not None:
            try:
                now = self._lstat(self.lock)
                if now is not None and _same(now, self.lock_id):
                    self._unlink(self.lock)                # while still held: no run can take it meanwhile
            except (OSError, Refused):
                pass                                       # a lock left behind is taken over or relocked later
            os.close(self.lock_fd)                         # closing releases a flock
            self.lock_fd = None
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- writing ----

    def save(self, status=None, **fields):
        """Write the record: the tool's fields (updated by **fields), the status, the files written
        and those being written, with their SHA-256. Atomic: a new temporary file renamed over the
        record, which must still be the one this run wrote (or the earlier run's it trusted)."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        status = self.status if status is None else status
        self.fields.update(fields)
        record = dict(self.fields, status=status, files=dict(sorted(self.owned.items())),
                      writing=dict(sorted(self.writing.items())))
        data = sealed_json(record, indent=2)
        now = self._lstat(self.record)
        if (now is None) != (self.record_id is None) or (now is not None and not _same(now, self.record_id)):
            raise Refused(f"{self.show(self.record)!r} was replaced or removed by someone else while this run "
                          "wrote: not replacing it")
        if self.stale_temp:                                # an earlier run's temporary record, proven ours
            self._unlink_if_absent_ok(self.temp)
            self.stale_temp = False
        made = self._create(self.temp, data)
        try:
            self._rename(self.temp, self.record)
        except OSError as e:
            self._remove_made(self.temp, made)
            raise WriteFailed(self.show(self.record), e) from None
        self.record_id, self.status = made, status         # `status`: what the record on disk says

    def _unlink_if_absent_ok(self, name):
        try:
            self._unlink(name)
        except FileNotFoundError:
            pass

    def write(self, files):
        """Write `files` ({name: bytes}, in order): their names and hashes recorded first as being
        written, then each file created new (an owned file of that name removed first, its bytes
        checked), then recorded as written. Refused when a file not this run's is in the way."""
        files = dict(files)
        for name in files:
            self._check_name(name)
        self.writing.update({name: sha256(data) for name, data in files.items()})
        self.save()                          # the intent: a run killed from here on left provable files
        for name, data in files.items():
            self._clear(name)
            self._create(name, data)
            self.owned[name] = self.writing.pop(name)
        self.save()

    def _check_name(self, name):
        if not _plain(name) or name in (self.record, self.temp, self.lock, self.breaker):
            raise ValueError(f"{name!r} is not a name a run may write in {self.path!r}")

    def _ours(self, name, st):
        """Whether the regular file `name` (lstat st) has bytes the record vouches for."""
        known = {self.owned.get(name), self.writing.get(name)} - {None}
        return st is not None and stat.S_ISREG(st.st_mode) and bool(known) and self._digest(name, st) in known

    def _clear(self, name):
        """Remove the file `name` if there is one, provably ours; Refused if it is not."""
        st = self._lstat(name)
        if st is None:
            return
        if not self._ours(name, st):
            raise Refused(f"{self.show(name)!r} appeared while this run was writing and is not this run's: "
                          "not replacing it; move it away and run again")
        self._unlink(name)
        self.owned.pop(name, None)

    def _create(self, name, data):
        """Create `name` (no file of that name may exist), write `data`, return its lstat. A write that
        fails or is interrupted removes the file it began (this run's: the descriptor proves it)."""
        try:
            fd = self._open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            raise Refused(f"{self.show(name)!r} appeared while this run was writing and is not this run's: "
                          "not replacing it; move it away and run again") from None
        except OSError as e:
            raise WriteFailed(self.show(name), e) from None
        made = os.fstat(fd)
        try:
            try:
                _write_fd(fd, data)
            finally:
                os.close(fd)
        except BaseException as e:
            self._remove_made(name, made)
            if isinstance(e, OSError):
                raise WriteFailed(self.show(name), e) from None
            raise
        now = self._lstat(name)
        if now is None or not _same(now, made):
            raise Refused(f"{self.show(name)!r} was replaced by someone else as this run wrote it")
        return now

    def _remove_made(self, name, made):
        """Remove the file this run created as `name` (still the same file), best effort; a file not
        removed stays listed as being written, so the next run names it."""
        try:
            now = self._lstat(name)
            if now is not None and _same(now, made):
                self._unlink(name)
                self.writing.pop(name, None)
        except (OSError, Refused):
            pass

    def remove(self, names):
        """Remove the owned files `names` (an absent one is dropped from the record), then save."""
        for name in names:
            st = self._lstat(name)
            if st is not None:
                if not self._ours(name, st):
                    raise Refused(f"{self.show(name)!r} changed since this run's record listed it: not removing it")
                self._unlink(name)
            self.owned.pop(name, None)
        self.save()

    def discard_record(self):
        """Remove the record (still the one this run wrote): for a tool whose last file vouches for the rest."""
        now = self._lstat(self.record)
        if now is not None and self.record_id is not None and _same(now, self.record_id):
            self._unlink(self.record)
        self.record_id = None


def _record_ending(folder, error):
    """Record why a run of write_file_set stopped, when the record can still be written."""
    status = ("write error" if isinstance(error, (WriteFailed, Refused)) else
              "interrupted" if isinstance(error, KeyboardInterrupt) else "crashed")
    try:
        folder.save(status, error=str(error) or type(error).__name__)
    except (OSError, Refused):
        pass                                # the error that stopped the run is the one to report


def write_file_set(path, files, tool, record, lock, vouchers, overwrite):
    """Write `files` ({name: bytes}, in this order; the tool's own record, which vouches for the
    others, last) into the folder `path` as one run of `tool`, with the promises of this module:
    refused (Refused) unless the folder is new or empty, or with overwrite=True holds only files an
    earlier run provably wrote (their hashes in a voucher or in a record this function left); the
    earlier run's files this set no longer has are removed. While it writes, its record (`record`,
    JOURNAL_FORMAT) says what it is writing; it is removed once every file is written, so a complete
    folder holds exactly `files`. A failure or interruption is recorded there (write error,
    interrupted, crashed) before the exception goes on. The vectors writer's use: see the module."""
    folder = Folder(path, tool, record, lock, vouchers=vouchers)
    folder.fields = dict(format=JOURNAL_FORMAT, tool=tool)
    try:
        folder.open(overwrite=overwrite, keep_others=None, writes=files.__contains__)
        try:
            folder.save("running")
            folder.remove(sorted(set(folder.owned) - set(files)))
            folder.write(files)
        except BaseException as e:
            _record_ending(folder, e)
            raise
        folder.discard_record()
    finally:
        folder.close()


def replace_file(path, data):
    """Write `data` (bytes) whole to `path`, one of the project's own tracked files (a document, a
    record under docs/), which no record vouches for: refused (Refused, nothing touched) when `path`
    or its folder is a symbolic link or `path` is there but not a regular file. The bytes go to a new
    file beside it, created exclusively (so never through a link), which is then renamed over `path`:
    a reader sees the old file or the new one, and a link put there meanwhile is replaced, never
    followed. WriteFailed when the operating system refuses the write."""
    folder = os.path.dirname(os.path.abspath(path))
    mode = None                       # a new file: 0o666 less the umask, as any file a program creates
    for where in (folder, path):
        try:
            st = os.lstat(where)
        except FileNotFoundError:
            if where == folder:
                raise Refused(f"{folder!r} does not exist") from None
            continue
        if _is_link(st):
            raise Refused(f"{where!r} is a symbolic link: not writing through it (remove it, or write elsewhere)")
        if where == path and not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path!r} is {_kind(st)}, not a regular file: not replacing it")
        if where == path:             # the file replaced keeps its permission bits (not its folder's)
            mode = stat.S_IMODE(st.st_mode)
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise WriteFailed(path, e) from None
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            _write_fd(fd, data)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError as e:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise WriteFailed(path, e) from None


def source_state(files, root=None):
    """Which code a record of a run comes from: {"commit": the git commit checked out in `root`
    (default: this module's folder), "dirty": whether any of `files` (paths from `root`) differs from
    that commit (edited, or not committed)}; both None where git or the checkout is missing (an
    installed copy)."""
    root = root or os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout
    try:
        return dict(commit=git("rev-parse", "HEAD").strip(), dirty=bool(git("status", "--porcelain", "--", *files)))
    except (OSError, subprocess.CalledProcessError):
        return dict(commit=None, dirty=None)
