"""Files as users expect them: written whole or not at all (temp file + rename), with the mode the
user's umask gives a new file (0644 under umask 0022). safetensors writes its files 0600; every
writer of model files here (convert, quantize, train, save_pretrained) passes them through
`keep_umask_mode`, so a converted or trained model is readable by whoever may read its folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path


def umask() -> int:
    """The process umask, read without changing it where /proc tells (Linux), else set-and-restore."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def file_mode() -> int:
    return 0o666 & ~umask()


def keep_umask_mode(*paths: str | Path) -> None:
    """chmod each file to the mode a new file gets under the umask (0644 under 0022)."""
    mode = file_mode()
    for path in paths:
        os.chmod(path, mode)


@contextlib.contextmanager
def written_whole(path: str | Path):
    """Yield a temp path beside `path` for a writer that needs a file name (a streaming writer, a C
    library); when the block succeeds the temp file gets the umask's mode and replaces `path` (one
    rename), on any error or Ctrl-C it is removed and `path` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        keep_umask_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` through a temp file beside it and a rename: never a half-written file;
    the mode is the umask's (an existing file's mode is not kept)."""
    with written_whole(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


@contextlib.contextmanager
def staged_folder(dst: str | Path, tag: str = "writing"):
    """Build a folder in a fresh temp folder beside `dst` (yielded) and put it in place only when the
    block succeeds: every file gets the umask's mode, then the temp folder replaces `dst` (an existing
    `dst` is swapped out and removed after). On any error or Ctrl-C the temp folder goes and `dst`
    is left as it was: never a half-written model folder."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.{tag}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        keep_umask_mode(*(p for p in tmp.rglob("*") if p.is_file()))
        if dst.exists():
            old = dst.parent / f".{dst.name}.old-{os.getpid()}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
