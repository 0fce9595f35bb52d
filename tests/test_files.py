"""utils.files: a file or folder is written whole or not at all, with the umask's mode."""

import os

import pytest

from clover.utils.files import atomic_write, file_mode, staged_folder, written_whole


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_atomic_write_replaces_whole_with_umask_mode(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    os.chmod(path, 0o600)
    atomic_write(path, "new")
    assert path.read_text() == "new"
    assert path.stat().st_mode & 0o777 == file_mode()
    assert _leftovers(tmp_path) == []


def test_written_whole_failure_keeps_old_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with written_whole(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer died")
    assert path.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_written_whole_writer_by_name(tmp_path):
    path = tmp_path / "out.bin"
    with written_whole(path) as tmp:
        assert tmp.parent == tmp_path and not path.exists()
        with open(tmp, "wb") as f:  # a writer that opens the name itself
            f.write(b"x" * 1000)
    assert path.read_bytes() == b"x" * 1000
    assert path.stat().st_mode & 0o777 == file_mode()


def test_staged_folder_failure_keeps_old_folder(tmp_path):
    dst = tmp_path / "model"
    dst.mkdir()
    (dst / "config.json").write_text("{}")
    with pytest.raises(KeyboardInterrupt):
        with staged_folder(dst) as tmp:
            (tmp / "config.json").write_text('{"half": 1}')
            raise KeyboardInterrupt
    assert (dst / "config.json").read_text() == "{}"
    assert _leftovers(tmp_path) == []
    with staged_folder(dst) as tmp:
        (tmp / "config.json").write_text('{"new": 1}')
    assert (dst / "config.json").read_text() == '{"new": 1}'
    assert _leftovers(tmp_path) == []
