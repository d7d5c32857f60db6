"""Issue 30, items 1-3 and 14: nothing from the file system runs as code. File names reach generated code only
sanitised (`origin_name`); cache entries are imported only when their HMAC sidecar authenticates them and the cache
is private to the user; the op id follows the compiler's own sources; concurrent and failing caches behave."""

from __future__ import annotations

import ast
import errno
import hashlib
import hmac
import os
import sys
import threading
import uuid
from pathlib import Path

import pytest

import ncd
from ncd import backend, cache
from ncd.pipeline import load_spec
from ncd.settings import settings
from ncd.source import display_name, origin_name

ROOT = Path(__file__).resolve().parent.parent
GROUP_RATIONAL = (ROOT / "specs" / "group_rational.ncd").read_text(encoding="utf-8")
MARKER = "PWNED"


@pytest.fixture(autouse=True)
def private_key_root(tmp_path_factory, monkeypatch):
    """The cache key lives in the per-user cache root: a fresh one per test, so no test touches ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))


def fresh_spec(directory: Path, name: str = "group_rational.ncd") -> Path:
    """group_rational with a unique comment: a spec this process has not loaded yet (a new op id)."""
    path = directory / name
    path.write_text(f"# {uuid.uuid4().hex}\n{GROUP_RATIONAL}", encoding="utf-8")
    return path


def fresh_ident() -> str:
    return f"t_{uuid.uuid4().hex}"


def foreign_owner(path: Path, monkeypatch) -> None:
    """Make `path` belong to someone else: chown as root, else pretend to be another user."""
    if os.geteuid() == 0:
        os.chown(path, 54321, 54321)
    else:
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)


# --- 1. file names ----------------------------------------------------------------------------------------------

HOSTILE_NAMES = [
    "x\"\"\";open('PWNED','w');\"\"\"y.ncd",  # ends the op's docstring
    "a\nopen('PWNED','w')\n#.ncd",  # ends an origin comment
    "back\\slash\\\"\"\"\\.ncd",
    "hash#{braces}{{x}}.ncd",
    "n\u00e9on\u2028\u00fc\u4e2d.ncd",
    "'" * 200 + ".ncd",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=["quotes", "newline", "backslash", "hash-braces", "non-ascii",
                                                     "long"])
def test_hostile_file_name_never_runs_and_never_poisons_the_genuine_file(name, tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NCD_CACHE_DIR", str(tmp_path / "cache"))
    spec = fresh_spec(tmp_path, name)
    code, out, err = run_cli("compile", str(spec))
    assert code == 0, err
    ast.parse(out)
    shown = origin_name(display_name(name))  # the name spans carry (escaped for messages), then sanitised
    assert f"({shown})" in out and shown.isascii()
    op = ncd.load(spec)
    hostile_text = op.path.read_text(encoding="utf-8")
    ast.parse(hostile_text)
    assert f"from {shown}:" in op.fn.__doc__
    genuine = ncd.load(spec.rename(tmp_path / "group_rational.ncd"))
    text = genuine.path.read_text(encoding="utf-8")
    assert genuine.module is not op.module and "# group_rational.ncd:5" not in hostile_text
    assert "from group_rational.ncd:" in genuine.fn.__doc__ and "(group_rational.ncd:" not in hostile_text
    assert "group_rational.ncd:" in text and shown not in text
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("stem", ["sigmoid_attention", "cheby_kan", "gka"])
def test_every_family_shows_file_names_only_sanitised(stem):
    """Each family builds its own origin comments and docstrings: all of them carry only `origin_name`."""
    import io
    import tokenize

    from ncd.pipeline import front_end

    hostile = f"dir/{stem}\"\"\"\n#{{x}}\u00e9\\.ncd"
    code = backend.generate(front_end((ROOT / "specs" / f"{stem}.ncd").read_text(encoding="utf-8"), hostile))
    ast.parse(code)
    mentions = [tok.string for tok in tokenize.generate_tokens(io.StringIO(code).readline)
                if tok.type in (tokenize.COMMENT, tokenize.STRING) and ".ncd" in tok.string]
    assert mentions and all(origin_name(display_name(hostile)) in m for m in mentions), mentions[:5]


def test_origin_name_keeps_only_safe_characters():
    assert origin_name("dir/sub/my-spec_2.ncd") == "my-spec_2.ncd"
    for name in HOSTILE_NAMES:
        safe = origin_name(name)
        assert safe.replace(".", "").replace("-", "").replace("_", "").isalnum() and safe.isascii()
        assert 0 < len(safe) <= 64 and safe.endswith(".ncd")


# --- 2. what the cache imports ----------------------------------------------------------------------------------


PLANTED = f"open({MARKER!r}, 'w').close()\nimport torch\n\n\ndef group_rational(*a, **k):\n    return torch.zeros(1)\n"


def test_a_planted_entry_is_regenerated_not_imported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = fresh_spec(tmp_path)
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    target = directory / f"{backend.op_id(load_spec(spec))}.py"
    target.write_text(PLANTED, encoding="utf-8")
    op = ncd.load(spec, cache_dir=directory)
    assert op.path == target and not (tmp_path / MARKER).exists()
    assert hasattr(op.module, "Module") and "Generated by ncd" in target.read_text(encoding="utf-8")


@pytest.mark.parametrize("sidecar", ["sha256", "foreign-key"])
def test_a_planted_entry_with_a_planted_sidecar_is_not_imported(sidecar, tmp_path, monkeypatch):
    """A cloned repository used as NCD_CACHE_DIR: entry and sidecar both planted, by someone without the key."""
    monkeypatch.chdir(tmp_path)
    ident = fresh_ident()
    data = f"{PLANTED}VALUE = 'planted'\n".encode()
    mac = (hashlib.sha256(data).hexdigest() if sidecar == "sha256" else
           hmac.new(os.urandom(32), b"ncd-cache-entry\0" + ident.encode() + b"\0" + data, hashlib.sha256).hexdigest())
    (tmp_path / f"{ident}.py").write_bytes(data)
    (tmp_path / f"{ident}.py{cache.MAC_SUFFIX}").write_text(mac + "\n")
    module, _ = cache.import_generated(ident, lambda: "VALUE = 'genuine'\n", tmp_path)
    assert module.VALUE == "genuine" and not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "sidecar-missing", "symlink"])
def test_a_damaged_entry_is_regenerated(damage, tmp_path):
    ident = fresh_ident()
    text = "VALUE = 41\n" + "# padding\n" * 50 + "VALUE += 1\n"
    target = tmp_path / f"{ident}.py"
    cache._store(target, ident, text, cache.cache_key())  # a valid entry, as an earlier process wrote it
    if damage == "truncated":
        target.write_text(text[: len(text) // 2])
    elif damage == "empty":
        target.write_text("")
    elif damage == "garbage":
        target.write_bytes(b"\xff\xfe\x00garbage(")
    elif damage == "sidecar-missing":
        target.with_name(target.name + cache.MAC_SUFFIX).unlink()
    else:
        elsewhere = tmp_path / "elsewhere.py"
        elsewhere.write_text(text)
        target.unlink()
        target.symlink_to(elsewhere)
    module, _ = cache.import_generated(ident, lambda: text, tmp_path)
    assert module.VALUE == 42 and target.read_text() == text and not target.is_symlink()


def test_a_valid_entry_is_reused_by_the_next_process(tmp_path):
    ident = fresh_ident()
    first, path = cache.import_generated(ident, lambda: "VALUE = 1\n", tmp_path)
    del cache._LOADED[ident], sys.modules[first.__name__]  # as a new process would start

    def render() -> str:
        raise AssertionError("a valid entry must not be regenerated")

    second, again = cache.import_generated(ident, render, tmp_path)
    assert second is not first and second.VALUE == 1 and again == path


def test_generated_spec_text_is_never_written_through_a_planted_link(tmp_path):
    """GroupRational keeps its spec text under <cache>/specs: a link planted there must not redirect the write."""
    from ncd.kan import GroupRational, spec_text

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    specs = tmp_path / "cache" / "specs"
    specs.mkdir(parents=True, mode=0o700)
    (tmp_path / "cache").chmod(0o700)
    (specs / "group_rational_paper_m2_n1_g3_shared.ncd").symlink_to(victim)
    module = GroupRational(3, 2, 1, form="paper", cache_dir=tmp_path / "cache")
    assert victim.read_text() == "precious\n"
    assert module.op.front.source.text == spec_text(3, 2, 1, "paper") and not module.op.path.is_symlink()


def test_new_cache_directory_and_key_are_private(tmp_path, monkeypatch):
    directory = tmp_path / "new" / "cache"
    cache.import_generated(fresh_ident(), lambda: "VALUE = 1\n", directory)
    assert directory.stat().st_mode & 0o777 == 0o700
    key = Path(os.environ["XDG_CACHE_HOME"]) / "ncd" / cache.KEY_NAME
    assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == cache.KEY_BYTES
    assert not list(directory.glob(f"*{cache.KEY_NAME}*"))  # never beside the entries
    key.chmod(0o644)  # a key others could read is replaced by a fresh one
    cache._KEYS.clear()
    old = key.read_bytes()
    assert cache.cache_key() != old and key.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("what", ["directory", "entry"])
def test_a_foreign_cache_is_refused(what, tmp_path, monkeypatch):
    ident = fresh_ident()
    directory = tmp_path / "shared"
    directory.mkdir(mode=0o700)
    if what == "entry":
        cache.import_generated(ident, lambda: "VALUE = 1\n", directory)
        cache._LOADED.pop(ident)
    foreign_owner(directory / f"{ident}.py" if what == "entry" else directory, monkeypatch)
    with pytest.raises(ncd.CacheError, match=r"belongs to uid .* not to you.*NCD_CACHE_DIR") as err:
        cache.import_generated(ident, lambda: "VALUE = 1\n", directory)
    assert str(directory) in str(err.value)


def test_an_unusable_key_root_costs_reuse_not_safety(tmp_path, monkeypatch):
    """No place for the key (read-only home, say): a key for this process only, with a warning; loads still work
    and entries written by other processes are regenerated, not trusted."""
    (tmp_path / "home-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-file"))
    ident = fresh_ident()
    target = tmp_path / "cache" / f"{ident}.py"
    target.parent.mkdir(mode=0o700)
    cache._store(target, ident, "VALUE = 'other process'\n", os.urandom(32))
    with pytest.warns(RuntimeWarning, match="cannot keep the cache key at .*home-file"):
        module, _ = cache.import_generated(ident, lambda: "VALUE = 'this process'\n", target.parent)
    assert module.VALUE == "this process"


@pytest.mark.parametrize(("what", "mode", "who"), [("directory", 0o777, "group and others"),
                                                   ("directory", 0o1733, "group and others"),
                                                   ("entry", 0o620, "group")])
def test_a_cache_others_can_write_is_refused(what, mode, who, tmp_path):
    ident = fresh_ident()
    directory = tmp_path / "cache"
    cache.import_generated(ident, lambda: "VALUE = 1\n", directory)
    cache._LOADED.pop(ident)
    (directory / f"{ident}.py" if what == "entry" else directory).chmod(mode)
    with pytest.raises(ncd.CacheError, match=f"is writable by {who}.*chmod go-w"):
        cache.import_generated(ident, lambda: "VALUE = 1\n", directory)


def test_a_key_root_others_can_write_is_refused(tmp_path):
    root = Path(os.environ["XDG_CACHE_HOME"]) / "ncd"
    root.mkdir(mode=0o700)
    root.chmod(0o777)  # others could plant a key of their own choosing
    with pytest.raises(ncd.CacheError, match=r"cache root .* writable by group and others.*XDG_CACHE_HOME"):
        cache.import_generated(fresh_ident(), lambda: "VALUE = 1\n", tmp_path)


def test_a_foreign_cache_directory_gives_exit_2(tmp_path, monkeypatch, run_cli):
    directory = tmp_path / "theirs"
    directory.mkdir()
    directory.chmod(0o777)
    monkeypatch.setenv("NCD_CACHE_DIR", str(directory))
    code, _, err = run_cli("check", str(fresh_spec(tmp_path)))
    assert code == 2 and str(directory) in err and "writable by group and others" in err


def test_a_relative_cache_dir_is_resolved_once(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    name = f"rel-{uuid.uuid4().hex}"
    monkeypatch.setenv("NCD_CACHE_DIR", name)
    assert settings().cache_dir == tmp_path / "a" / name
    monkeypatch.chdir(tmp_path / "b")  # e.g. into a cloned repository holding a directory of that name
    assert settings().cache_dir == tmp_path / "a" / name
    _, path = cache.import_generated(fresh_ident(), lambda: "VALUE = 1\n")
    assert path.parent == tmp_path / "a" / name and not (tmp_path / "b" / name).exists()


# --- 3. stale entries -------------------------------------------------------------------------------------------


def test_op_id_follows_every_generating_source(monkeypatch):
    front = load_spec(ROOT / "specs" / "group_rational.ncd")
    sources = backend._generating_sources()
    names = {name for name, _ in sources}
    assert {"ncd/backend.py", "ncd/lower.py", "ncd/families/rational/render.py", "ncd.templates/rational_op.py.jinja",
            "ncd.grammar/ncd.lark"} <= names
    calls = []
    monkeypatch.setattr(backend, "_generating_sources", lambda: calls.append(1) or sources)
    backend.compiler_digest.cache_clear()
    before = backend.op_id(front)
    assert backend.op_id(front) == before and len(calls) == 1  # hashed once per process
    for i in (0, len(sources) // 2, len(sources) - 1):  # one byte of one file changed: another op id
        name, data = sources[i]
        changed = [*sources[:i], (name, data + b" "), *sources[i + 1:]]
        monkeypatch.setattr(backend, "_generating_sources", lambda changed=changed: changed)
        backend.compiler_digest.cache_clear()
        assert backend.op_id(front) != before, name
    monkeypatch.undo()
    backend.compiler_digest.cache_clear()


# --- 14. concurrency and unusable directories -------------------------------------------------------------------


def test_eight_threads_load_one_new_spec(tmp_path):
    spec = fresh_spec(tmp_path)
    barrier = threading.Barrier(8)
    results: list[object] = [None] * 8

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = ncd.load(spec, cache_dir=tmp_path / "cache")
        except Exception as err:  # recorded, asserted below
            results[i] = err

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(r, ncd.ops.Op) for r in results), results
    assert len({id(r.module) for r in results if isinstance(r, ncd.ops.Op)}) == 1


def _file_as_dir(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "file").write_text("")
    return tmp_path / "file"


def _under_a_file(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "cache"


def _disk_full(tmp_path: Path, monkeypatch) -> Path:
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    return tmp_path / "cache"


def _read_only(tmp_path: Path, monkeypatch) -> Path:
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(cache.tempfile, "mkstemp", read_only)  # root writes through chmod: fail as EROFS does
    return tmp_path / "cache"


@pytest.mark.filterwarnings("ignore:ncd. cannot keep the cache key")  # read-only: the key cannot be made either
@pytest.mark.parametrize(("make", "reason"), [(_file_as_dir, "it is a file, not a directory"),
                                              (_under_a_file, "it is a file, not a directory"),
                                              (_disk_full, os.strerror(errno.ENOSPC)),
                                              (_read_only, os.strerror(errno.EROFS))],
                         ids=["file", "under-a-file", "disk-full", "read-only"])
def test_an_unusable_cache_directory_gives_exit_2(make, reason, tmp_path, monkeypatch, run_cli):
    spec = fresh_spec(tmp_path)
    directory = make(tmp_path, monkeypatch)
    monkeypatch.setenv("NCD_CACHE_DIR", str(directory))
    code, _, err = run_cli("check", str(spec))
    assert code == 2, err
    assert "cache" in err and reason in err and "NCD_CACHE_DIR" in err
    code, out, err = run_cli("compile", str(spec))  # prints the module: needs no cache, so it still works
    assert code == 0 and "def group_rational(" in out, err
    with pytest.raises(ncd.CacheError, match="NCD_CACHE_DIR"):
        ncd.load(spec)
    assert not list(tmp_path.rglob("*.tmp"))
