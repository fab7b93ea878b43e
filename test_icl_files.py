"""Tests for icl_files, the one writer of the project's output folders, through a vectors-like use:
a fixed set of files and a manifest that lists each with its SHA-256 (write_set below), the way the
reference-vectors writer uses it. Every promise is tested with the operating system's means and with
the portable ones (fcntl, O_NOFOLLOW, O_DIRECTORY and dir_fd hidden, as on Windows): the `means`
fixture runs a test both ways."""
import errno
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

import icl_files

HERE = os.path.dirname(os.path.abspath(__file__))
# the startup code of a process without fcntl, O_NOFOLLOW, O_DIRECTORY and dir_fd (the way
# Means.detect asks for them), before the project is imported
HIDE = ("import os, sys\nsys.modules['fcntl'] = None\ndel os.O_NOFOLLOW, os.O_DIRECTORY\n"
        "os.supports_dir_fd.clear()\nsys.path.insert(0, {here!r})\n").format(here=HERE)
TOOL, RECORD, LOCK = "fake vectors", ".fake-record.json", ".fake.lock"


# ---------------------------------------------------------------------------------------------
# A vectors-like writer: case files and manifest.json, which vouches for them by their SHA-256
# ---------------------------------------------------------------------------------------------

def manifest_files(manifest):
    """The files an earlier manifest of this fake tool vouches for, or None when it is not one."""
    if manifest.get("format") != "fake vectors":
        return None
    return {case["file"]: case["sha256"] for case in manifest["cases"]}


def fake_files(version=1, big=0):
    """Three case files (the second `big` bytes longer) and the manifest listing them, manifest last."""
    files = {f"case{k}.npz": (f"case {k} of version {version} ".encode() + b"x" * (big if k == 2 else 0))
             for k in (1, 2, 3)}
    manifest = dict(format="fake vectors", cases=[dict(file=f, sha256=icl_files.sha256(b)) for f, b in files.items()])
    files["manifest.json"] = icl_files.sealed_json(manifest)
    return files


def write_set(out, files=None, overwrite=False):
    icl_files.write_file_set(out, files or fake_files(), tool=TOOL, record=RECORD, lock=LOCK,
                             vouchers={"manifest.json": manifest_files}, overwrite=overwrite)


def folder(out):
    """The same folder as write_set's, to hold it or inspect it."""
    return icl_files.Folder(out, TOOL, RECORD, LOCK, vouchers={"manifest.json": manifest_files})


def snapshot(root):
    """Every entry under root: a file's bytes, a link's target (not followed), a FIFO or folder's mark."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                seen[os.path.relpath(p, root)] = ("link", os.readlink(p))
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    seen[os.path.relpath(p, root)] = ("file", f.read())
            else:
                seen[os.path.relpath(p, root)] = ("other",)
    return seen


def contents(out):
    return {name: (out / name).read_bytes() for name in sorted(os.listdir(out))}


@pytest.fixture(params=["native", "portable"])
def means(request, monkeypatch):
    """The operating system's means, or the portable ones (what Means.detect finds without fcntl,
    O_NOFOLLOW, O_DIRECTORY and dir_fd)."""
    if request.param == "portable":
        monkeypatch.setitem(sys.modules, "fcntl", None)
        monkeypatch.delattr(os, "O_NOFOLLOW")
        monkeypatch.delattr(os, "O_DIRECTORY")
        monkeypatch.setattr(os, "supports_dir_fd", set())
        assert icl_files.Means.detect() == icl_files.Means(None, 0, False)
    else:
        assert icl_files.Means.detect().dir_fd and icl_files.Means.detect().fcntl is not None
    return request.param


def returns_within(fn, seconds=10.0, unblock=None):
    """fn() in a thread: its exception or result, failing the test if it has not returned in time
    (`unblock()` then frees the thread: a FIFO opened for writing releases a reader)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:          # handed to the test
            box["error"] = e
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if unblock:
            unblock()
        pytest.fail(f"blocked for more than {seconds} s")
    return box


# ---------------------------------------------------------------------------------------------
# Writing and replacing: only the files a record proves this tool's
# ---------------------------------------------------------------------------------------------

def test_a_new_folder_gets_exactly_the_files_and_an_earlier_set_is_replaced(tmp_path, means):
    out = tmp_path / "a" / "v"                      # parents created too
    write_set(out)
    assert contents(out) == fake_files()            # no record, no lock left behind
    (out / "case9.npz").write_bytes(b"x")           # not ours: refused below, then gone
    (out / "case9.npz").unlink()
    write_set(out, fake_files(version=2), overwrite=True)
    assert contents(out) == fake_files(version=2)
    with pytest.raises(icl_files.Refused, match="--overwrite"):
        write_set(out)                              # not empty, no overwrite
    assert contents(out) == fake_files(version=2)


def test_earlier_files_the_new_set_no_longer_has_are_removed(tmp_path, means):
    out = tmp_path / "v"
    files = fake_files()
    files["old.npz"] = b"an earlier version's case"
    manifest = icl_files.unseal(files.pop("manifest.json"))
    manifest["cases"].append(dict(file="old.npz", sha256=icl_files.sha256(files["old.npz"])))
    files["manifest.json"] = icl_files.sealed_json(manifest)
    write_set(out, files)
    write_set(out, overwrite=True)
    assert contents(out) == fake_files()


@pytest.mark.parametrize("change", ["changed", "foreign", "link", "their manifest", "edited manifest", "not json",
                                    "nested json"])
def test_a_file_not_provably_ours_is_refused_by_name_and_nothing_is_touched(tmp_path, means, change):
    out, elsewhere = tmp_path / "v", tmp_path / "elsewhere.txt"
    elsewhere.write_bytes(b"the user's own file")
    write_set(out)
    if change == "changed":                         # a listed file whose bytes the user changed
        (out / "case2.npz").write_bytes(b"my own case 2")
    elif change == "foreign":
        (out / "notes.md").write_text("mine")
    elif change == "link":
        (out / "case2.npz").unlink()
        (out / "case2.npz").symlink_to(elsewhere)
    elif change == "their manifest":                # another program's manifest.json vouches for nothing
        (out / "manifest.json").write_text(json.dumps(dict(format="my vectors", cases=[])))
    elif change == "edited manifest":               # ours, with a note the user added: now theirs
        manifest = json.loads((out / "manifest.json").read_bytes())
        (out / "manifest.json").write_text(json.dumps(dict(manifest, note="checked against my kernel")))
    elif change == "not json":
        (out / "manifest.json").write_text("{not json")
    else:                                           # deeper than Python's recursion limit: no record, not a crash
        (out / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    before = snapshot(tmp_path)
    with pytest.raises(icl_files.Refused) as refused:
        write_set(out, fake_files(version=2), overwrite=True)
    named = {"changed": "case2.npz' is not the file fake vectors wrote", "foreign": "notes.md' was not written by any run of fake vectors): not touching them; name a new directory",
             "link": "case2.npz' is a symbolic link", "their manifest": "no record written by fake vectors",
             "edited manifest": "manifest.json is not a record this version of fake vectors wrote",
             "not json": "no record written by fake vectors", "nested json": "no record written by fake vectors"}[change]
    assert named in str(refused.value)
    assert snapshot(tmp_path) == before


def test_a_file_that_appears_while_the_set_is_written_is_left_alone(tmp_path, means, monkeypatch):
    out = tmp_path / "v"
    real = icl_files._write_fd

    def intruder(fd, data):                         # someone's file appears under a later name
        if data.startswith(b"case 1"):
            (out / "case3.npz").write_bytes(b"theirs")
        real(fd, data)
    monkeypatch.setattr(icl_files, "_write_fd", intruder)
    with pytest.raises(icl_files.Refused, match="case3.npz' appeared"):
        write_set(out)
    monkeypatch.undo()
    assert (out / "case3.npz").read_bytes() == b"theirs"
    record = json.loads((out / RECORD).read_text())
    assert record["status"] == "write error" and "case3.npz" in record["error"]


# ---------------------------------------------------------------------------------------------
# Links, FIFOs: never followed, never opened
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["", "/", "//", "/.", "/./", "/./."])
def test_a_folder_named_by_a_symbolic_link_is_refused_however_it_is_spelled(tmp_path, means, spelling):
    # `vectors --out LINK/` wrote into the link's target: a trailing separator makes the system follow it
    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target, target_is_directory=True)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere", target_is_directory=True)
    before = snapshot(tmp_path)
    for named in (link, dangling):
        with pytest.raises(icl_files.Refused, match="symbolic link"):
            write_set(str(named) + spelling)
    assert snapshot(tmp_path) == before and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("name", ["..", ".", "", "sub/x", "a\0b", RECORD, LOCK])
def test_a_file_name_that_is_not_a_plain_name_of_the_folder_is_refused_before_anything_is_written(tmp_path, name):
    # the names a run may write are plain names in the folder itself: not '..' or '.', no separator, no
    # NUL, not the record's or the lock's; a ValueError naming it, and the folder and its parent untouched
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=re.escape(f"{name!r} is not a name a run may write")):
        write_set(str(out), {**fake_files(), name: b"x"})
    assert not out.exists() or not [f for f in os.listdir(out) if f.endswith((".npz", ".json")) and f != RECORD]
    assert sorted(os.listdir(tmp_path)) in ([], ["out"])


def test_a_folder_named_through_dot_dot_is_refused(tmp_path, means):
    (tmp_path / "a").mkdir()
    with pytest.raises(icl_files.Refused, match=r"'\.\.'"):
        write_set(str(tmp_path / "a" / ".."))
    assert sorted(os.listdir(tmp_path)) == ["a"]


@pytest.mark.parametrize("name", ["manifest.json", "case2.npz", RECORD, LOCK])
def test_a_fifo_in_the_folder_is_named_never_opened(tmp_path, means, name):
    # a FIFO named manifest.json blocked the vectors writer forever (it opened it to read it)
    out = tmp_path / "v"
    write_set(out)
    if (out / name).exists():
        (out / name).unlink()
    os.mkfifo(out / name)
    before = snapshot(tmp_path)

    def unblock():                          # a writer at the other end releases a blocked reader
        os.close(os.open(out / name, os.O_RDWR))
    box = returns_within(lambda: write_set(out, overwrite=True), unblock=unblock)
    assert isinstance(box.get("error"), icl_files.Refused) and name in str(box["error"]), box
    assert "a FIFO" in str(box["error"]) or "no record" in str(box["error"])
    assert snapshot(tmp_path) == before


def test_a_link_planted_under_a_name_being_written_is_not_followed(tmp_path, means, monkeypatch):
    # the check at open is not enough: a link put in place between the check and the write
    out, theirs = tmp_path / "v", tmp_path / "theirs.txt"
    theirs.write_bytes(b"the user's own file")
    real = icl_files.Folder._clear

    def plant(self, name):
        real(self, name)
        if name == "case2.npz":
            (out / name).symlink_to(theirs)
    monkeypatch.setattr(icl_files.Folder, "_clear", plant)
    with pytest.raises(icl_files.Refused, match="case2.npz' appeared"):
        write_set(out)
    assert theirs.read_bytes() == b"the user's own file" and os.path.islink(out / "case2.npz")


def test_a_folder_swapped_for_a_link_while_it_is_written_is_not_written_through(tmp_path, means, monkeypatch):
    out, elsewhere = tmp_path / "v", tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = icl_files.Folder._clear

    def swap(self, name):                           # after the intent is recorded, before the first file
        if not out.is_symlink():
            os.rename(out, tmp_path / "moved")
            out.symlink_to(elsewhere, target_is_directory=True)
        real(self, name)
    monkeypatch.setattr(icl_files.Folder, "_clear", swap)
    # dir_fd means: the files land in the folder opened (now "moved"), never through the link;
    # portable means: the swap is seen before the next file is created, and the run stops
    try:
        write_set(out)
        assert means == "native" and contents(tmp_path / "moved") == fake_files()
    except icl_files.Refused as e:
        assert means == "portable" and "was replaced" in str(e)
    assert os.listdir(elsewhere) == []


# ---------------------------------------------------------------------------------------------
# The lock: one run at a time; a dead run's lock file taken over (portable means)
# ---------------------------------------------------------------------------------------------

def test_a_folder_another_run_holds_is_refused(tmp_path, means):
    out = tmp_path / "v"
    write_set(out)
    before = snapshot(tmp_path)
    with folder(out) as holder:
        holder.open(overwrite=True, keep_others=None, writes=lambda f: False)
        with pytest.raises(icl_files.Refused, match="in use by another fake vectors run"):
            write_set(out, overwrite=True)
        assert (out / LOCK).exists()
    assert snapshot(tmp_path) == before                 # the lock file goes with its run
    write_set(out, overwrite=True)


def test_what_another_run_wrote_before_the_lock_was_taken_is_looked_at_again(tmp_path, monkeypatch):
    # Folder.open: "Check, lock and check again": a file written into an empty folder between the first
    # check and this run's lock (another run's, or the user's) is refused like any other, never replaced
    out = tmp_path / "v"
    out.mkdir()
    acquire = icl_files.Folder._acquire

    def acquire_after_another_write(self):
        (out / "case1.npz").write_bytes(b"written meanwhile")
        acquire(self)
    monkeypatch.setattr(icl_files.Folder, "_acquire", acquire_after_another_write)
    with pytest.raises(icl_files.Refused, match="not empty"):
        write_set(out)
    assert os.listdir(out) == ["case1.npz"] and (out / "case1.npz").read_bytes() == b"written meanwhile"


@pytest.mark.parametrize("planted", ["a file of the user's", "a hard link to a file elsewhere",
                                     "a hard link to an empty file elsewhere", "JSON nested too deep to read"])
def test_a_users_file_under_the_lock_name_is_neither_written_nor_removed(tmp_path, means, planted):
    # the lock's name is not counted as a file of the folder's (a run's lock comes and goes), so a file
    # of that name that is no lock - the user's notes, or a second name of a file outside - must be
    # refused, not truncated to hold a pid and then removed (both happened, exit 0)
    out = tmp_path / "v"
    out.mkdir()
    mine = tmp_path / "precious.txt"
    mine.write_text("" if "empty" in planted else "notes")      # empty: only its other name tells
    if planted == "a file of the user's":
        (out / LOCK).write_text("notes")
    elif "nested" in planted:                       # 4096 bytes, the most a lock's pid and host is read to
        (out / LOCK).write_text("[" * 2048 + "]" * 2048)
    else:
        os.link(mine, out / LOCK)
    before = snapshot(tmp_path)
    with pytest.raises(icl_files.Refused, match="not a lock of fake vectors, not touching it"):
        write_set(out)
    assert snapshot(tmp_path) == before


def dead_pid():
    """The pid of a process of this host that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("holder,taken", [("dead", True), ("alive", False), ("other host", False), ("garbled", False)])
def test_a_lock_file_of_a_dead_run_is_taken_over_and_any_other_refused(tmp_path, monkeypatch, holder, taken):
    monkeypatch.setitem(sys.modules, "fcntl", None)     # the portable lock: a file created exclusively
    out = tmp_path / "v"
    write_set(out)
    owner = {"dead": dict(pid=dead_pid(), host=socket.gethostname()),
             "alive": dict(pid=os.getpid(), host=socket.gethostname()),
             "other host": dict(pid=dead_pid(), host=socket.gethostname() + "-elsewhere"), "garbled": None}[holder]
    (out / LOCK).write_text(json.dumps(owner) if owner else "")      # a run killed (SIGKILL) left it
    if taken:
        write_set(out, fake_files(version=2), overwrite=True)
        assert contents(out) == fake_files(version=2)
    else:
        with pytest.raises(icl_files.Refused, match="in use by another") as refused:
            write_set(out, fake_files(version=2), overwrite=True)
        assert f"remove it" in str(refused.value) and (owner is None or str(owner["pid"]) in str(refused.value))
        assert (out / "case1.npz").read_bytes() == fake_files()["case1.npz"]


def test_the_portable_lock_is_exclusive_while_held(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "fcntl", None)
    out = tmp_path / "v"
    with folder(out) as holder:
        holder.open(overwrite=False, keep_others=None, writes=lambda f: False)
        assert json.loads((out / LOCK).read_text()) == dict(pid=os.getpid(), host=socket.gethostname())
        with pytest.raises(icl_files.Refused, match=f"pid {os.getpid()}"):   # alive: never taken over
            write_set(out)
    write_set(out)


# ---------------------------------------------------------------------------------------------
# The record: intent before each write, so a killed run's files are proven or named
# ---------------------------------------------------------------------------------------------

KILLED = """
import signal, icl_files, test_icl_files as t
real = icl_files._write_fd
def dying(fd, data):                 # SIGKILL in the middle of case2.npz, or just after it
    if data.startswith(b"case 2"):
        real(fd, data if sys.argv[2] == "after" else data[:len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    real(fd, data)
icl_files._write_fd = dying
t.write_set(sys.argv[1], t.fake_files(version=int(sys.argv[3]), big=1 << 16), overwrite=True)
"""


@pytest.mark.parametrize("hide", [False, True])
def test_after_a_sigkill_the_next_run_proves_its_files_and_names_the_one_cut_short(tmp_path, hide):
    # a SIGKILL mid-write left files no manifest listed: --overwrite refused them all, unnamed
    out = tmp_path / "v"
    script = (HIDE if hide else f"import os, sys\nsys.path.insert(0, {HERE!r})\n") + KILLED
    for when in ("during", "after"):
        proc = subprocess.run([sys.executable, "-c", script, str(out), when, "1" if when == "during" else "2"],
                              cwd=HERE, capture_output=True, text=True, timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        record = json.loads((out / RECORD).read_text())
        assert record["status"] == "running" and "case2.npz" in record["writing"]
        if when == "during":
            before = snapshot(tmp_path)
            with pytest.raises(icl_files.Refused) as refused:
                write_set(out, fake_files(version=2), overwrite=True)
            message = str(refused.value)
            assert "case2.npz' was being written when a run of fake vectors stopped" in message
            assert "case1.npz" not in message and snapshot(tmp_path) == before
            (out / "case2.npz").unlink()            # what the message asks the user to do
        else:                                       # every file proven by its hash: taken back, no question
            assert (out / "case2.npz").read_bytes() == fake_files(version=2, big=1 << 16)["case2.npz"]
    write_set(out, fake_files(version=3), overwrite=True)
    assert contents(out) == fake_files(version=3)


FIRST_RECORD_KILLED = """
import signal, icl_files, test_icl_files as t
real, calls = icl_files._write_fd, []
def dying(fd, data):                 # SIGKILL as the first record is written (the lock's pid is the 1st write)
    calls.append(fd)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(fd, data)
icl_files._write_fd = dying
t.write_set(sys.argv[1])
"""


@pytest.mark.parametrize("hide", [False, True])
def test_a_run_killed_as_it_wrote_its_first_record_names_the_hidden_file_it_left(tmp_path, hide):
    # module, promise 5: after a SIGKILL the next run names the files it cannot prove for the user to
    # remove; the empty temporary record is hidden (a dot file), and no record vouches for it, so
    # promise 1 keeps it: it is named, and once it is removed nothing else stands in the way (the
    # dead run's lock is taken over)
    out = tmp_path / "v"
    script = (HIDE if hide else f"import os, sys\nsys.path.insert(0, {HERE!r})\n") + FIRST_RECORD_KILLED
    proc = subprocess.run([sys.executable, "-c", script, str(out)], cwd=HERE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    temp = out / f".{RECORD}.tmp"
    assert sorted(os.listdir(out)) == sorted([LOCK, temp.name]) and temp.read_bytes() == b""
    before = snapshot(tmp_path)
    with pytest.raises(icl_files.Refused) as refused:
        write_set(out, overwrite=True)
    assert f"{str(temp)!r} is the temporary record of a run of fake vectors" in str(refused.value)
    assert snapshot(tmp_path) == before
    temp.unlink()                                   # what the message asks the user to do
    write_set(out, overwrite=True)
    assert contents(out) == fake_files()


def test_the_record_holds_each_hash_before_its_file_is_written(tmp_path, monkeypatch):
    out, seen = tmp_path / "v", []
    real = icl_files._write_fd

    def spy(fd, data):
        if data in fake_files().values():           # a file of the set (not the lock's or the record's text)
            record = json.loads((out / RECORD).read_text())
            seen.append(record["writing"].get(name_of[data]) == icl_files.sha256(data))
        real(fd, data)
    name_of = {data: name for name, data in fake_files().items()}
    monkeypatch.setattr(icl_files, "_write_fd", spy)
    write_set(out)
    assert seen == [True] * 4


def test_a_run_killed_as_it_renamed_its_record_is_read_from_the_record_itself(tmp_path, means):
    # a run killed between writing its temporary record and renaming it leaves both whole: each counts
    # for the files it lists, and the record itself (not the temporary one) is the earlier run's record
    out = tmp_path / "v"
    out.mkdir()
    data = {"case1.npz": b"listed by the record", "case2.npz": b"listed by the temporary record only"}
    for name, payload in data.items():
        (out / name).write_bytes(payload)
    f = folder(out)

    def record(which, files):
        return icl_files.sealed_json(dict(format=icl_files.JOURNAL_FORMAT, tool=TOOL, which=which, status="running",
                                          files={n: icl_files.sha256(data[n]) for n in files}, writing={}))
    (out / RECORD).write_bytes(record("the record", ["case1.npz"]))
    (out / f.temp).write_bytes(record("the temporary record", ["case1.npz", "case2.npz"]))
    with f:
        f.open(overwrite=True, keep_others=None, writes=lambda name: True)
        assert f.earlier["which"] == "the record"
        assert f.owned == {n: icl_files.sha256(b) for n, b in data.items()}
        f.save("complete")
    assert sorted(os.listdir(out)) == sorted([RECORD, *data])      # the temporary record, proven, is gone


def test_a_record_that_cannot_be_saved_keeps_saying_what_the_file_says(tmp_path, monkeypatch):
    # Folder.status is what the record on disk says: a save that fails leaves it, so a message quoting
    # it is true (it said "it says 'write error'" of a record that said "running")
    out = tmp_path / "v"
    with folder(out) as f:
        f.open(overwrite=False, keep_others=None, writes=lambda name: True)
        f.save("running")

        def full(src, dst):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(f, "_rename", full)
        with pytest.raises(icl_files.WriteFailed):
            f.save("write error")
        assert f.status == "running" == json.loads((out / RECORD).read_text())["status"]


# ---------------------------------------------------------------------------------------------
# Write errors: a message that says what to do, the record says so, no partial file
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code,advice", [(errno.ENOSPC, "disk is full"), (errno.EFBIG, "ulimit -f"),
                                         (errno.EACCES, "no permission")])
def test_a_write_error_names_the_file_and_what_to_do_and_the_record_says_so(tmp_path, means, monkeypatch,
                                                                            code, advice):
    out = tmp_path / "v"
    real = icl_files._write_fd

    def failing(fd, data):
        if data.startswith(b"case 2"):
            real(fd, data[:3])
            raise OSError(code, os.strerror(code))
        real(fd, data)
    monkeypatch.setattr(icl_files, "_write_fd", failing)
    with pytest.raises(icl_files.WriteFailed) as failed:
        write_set(out)
    monkeypatch.undo()
    assert failed.value.errno == code and "case2.npz" in str(failed.value) and advice in str(failed.value)
    assert isinstance(failed.value, OSError)            # what the vectors writer raises today
    record = json.loads((out / RECORD).read_text())
    assert record["status"] == "write error" and "case2.npz" in record["error"]
    assert not (out / "case2.npz").exists() and "case2.npz" not in record["writing"]    # removed, this run's
    assert list(record["files"]) == ["case1.npz"]
    write_set(out, overwrite=True)                      # all provably ours: the next run goes on
    assert contents(out) == fake_files()


def test_the_file_size_limit_is_a_write_error_not_a_crash(tmp_path):
    # `ulimit -f`: Python ignores SIGXFSZ, so the write fails with EFBIG
    out = tmp_path / "v"
    script = ("import resource, sys, test_icl_files as t\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))\n"
              "try:\n    t.write_set(sys.argv[1], t.fake_files(big=1 << 16))\n"
              "except OSError as e:\n    print(e, file=sys.stderr)\n    sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(out)], cwd=HERE, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3 and "case2.npz" in proc.stderr and "ulimit -f" in proc.stderr, proc.stderr
    assert json.loads((out / RECORD).read_text())["status"] == "write error"
    write_set(out, overwrite=True)
    assert contents(out) == fake_files()


# ---------------------------------------------------------------------------------------------
# On any laptop: the whole writer in a process without fcntl, O_NOFOLLOW, O_DIRECTORY, dir_fd
# ---------------------------------------------------------------------------------------------

def test_the_writer_keeps_its_promises_in_a_process_without_the_posix_means(tmp_path):
    out, link, theirs = tmp_path / "v", tmp_path / "link", tmp_path / "theirs"
    theirs.mkdir()
    link.symlink_to(theirs, target_is_directory=True)
    script = HIDE + """
import json, icl_files, test_icl_files as t
out, link = sys.argv[1], sys.argv[2]
assert icl_files.Means.detect() == icl_files.Means(None, 0, False)
t.write_set(out)
t.write_set(out, t.fake_files(version=2), overwrite=True)
for bad in (link, link + "/"):
    try:
        t.write_set(bad)
        raise SystemExit("wrote through " + bad)
    except icl_files.Refused:
        pass
open(out + "/case1.npz", "wb").write(b"mine")
try:
    t.write_set(out, overwrite=True)
    raise SystemExit("replaced the user's file")
except icl_files.Refused as e:
    assert "case1.npz' is not the file" in str(e)
print("OK")
"""
    proc = subprocess.run([sys.executable, "-c", script, str(out), str(link)], cwd=HERE, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    assert os.listdir(theirs) == [] and (out / "case1.npz").read_bytes() == b"mine"
    assert (out / "case3.npz").read_bytes() == fake_files(version=2)["case3.npz"]


def test_a_sealed_record_proves_its_bytes_and_nothing_else():
    # sealed_json's promise: the bytes carry the SHA-256 of themselves with the seal written as 64
    # zeros (recomputed here by hand), and unseal gives the record back only while every byte is as written
    record = {"format": "x", "files": {"a.csv": "0" * 63 + "1"}, "note": "ünïcode"}
    data = icl_files.sealed_json(record, indent=2)
    seal = json.loads(data)[icl_files.SEAL]
    assert hashlib.sha256(data.replace(seal.encode(), b"0" * 64)).hexdigest() == seal
    assert icl_files.unseal(data) == record
    for changed in (data.replace(b'"x"', b'"y"'), data.replace(b"\n", b"\r\n"), data + b" ",
                    data.replace(seal.encode(), b"f" * 64), json.dumps(record).encode(), b"[]", b"\xff"):
        assert icl_files.unseal(changed) is None
    with pytest.raises(ValueError, match="must not hold the string"):
        icl_files.sealed_json({"a": "0" * 64})
    with pytest.raises(ValueError, match="must not carry"):
        icl_files.sealed_json(json.loads(data))


# ---------------------------------------------------------------------------------------------
# replace_file: a document written whole through a new file beside it, never through a link
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["folder", "FIFO", "socket"])
def test_replace_file_refuses_a_path_that_is_not_a_regular_file(tmp_path, kind):
    # "refused (Refused, nothing touched) when ... `path` is there but not a regular file": each kind
    # of non-file at the path is refused by name, and stays what it was
    path = tmp_path / "a.md"
    if kind == "folder":
        path.mkdir()
    elif kind == "FIFO":
        os.mkfifo(path)
    else:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    before = os.lstat(path)
    with pytest.raises(icl_files.Refused, match="not a regular file"):
        icl_files.replace_file(str(path), b"new")
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert sorted(os.listdir(tmp_path)) == ["a.md"]
    if kind == "socket":
        server.close()


def test_replace_file_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path):
    # "The bytes go to a new file beside it, created exclusively (so never through a link)": a link
    # planted at the temporary name is a refusal of the write, the file it points to untouched
    document, victim = tmp_path / "a.md", tmp_path / "victim.txt"
    document.write_bytes(b"old")
    victim.write_bytes(b"the user's")
    (tmp_path / f".a.md.{os.getpid()}.tmp").symlink_to(victim)
    with pytest.raises(icl_files.WriteFailed):
        icl_files.replace_file(str(document), b"new")
    assert victim.read_bytes() == b"the user's" and document.read_bytes() == b"old" and not document.is_symlink()
