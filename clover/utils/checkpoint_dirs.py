"""The checkpoint folders of a training run, `<out_dir>/checkpoints/`, kept so that a run killed at
any instant (kill -9, power loss) resumes from the newest complete checkpoint, and never from a
half-written or half-deleted one.

The rules every writer follows:
* a checkpoint is built in a dot folder (`.step_NNNNNN.tmp`) and renamed into place whole
  (`step_NNNNNN`), so a folder named `step_*` is always complete;
* one that replaces a folder of the same step first moves the old one aside whole
  (`.step_NNNNNN.replaced`, still a checkpoint), renames the new one in, then removes the old;
* a folder is removed by renaming it to a `.deleting` name first, then deleting that, so a
  half-deleted folder never carries a checkpoint's name;
* `latest` names the newest checkpoint (written after the rename, atomically); it is a hint for
  people and tools: `find_checkpoint` does not trust it, as a kill between the rename and its
  update leaves it one checkpoint behind.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

NAME = re.compile(r"^(\.)?step_(\d+)(\.replaced)?$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(path: Path) -> int:
    """The step of a checkpoint folder, from its name."""
    return int(NAME.match(path.name).group(2))


def is_complete(path: Path) -> bool:
    """A plain checkpoint (model + trainer state) or a distributed one (its DCP metadata + state)."""
    plain = all((path / f).is_file() for f in ("trainer_state.pt", "config.json"))
    plain = plain and any(path.glob("*.safetensors"))
    sharded = (path / "trainer_state.json").is_file() and (path / "dcp" / ".metadata").is_file()
    return plain or sharded


def checkpoints(ckdir: Path) -> list[tuple[int, bool, Path]]:
    """Every complete checkpoint in `ckdir` as (step, in place, path), oldest first; at one step a
    folder in place sorts after one moved aside."""
    found = []
    if not ckdir.is_dir():
        return found
    for path in ckdir.iterdir():
        m = NAME.match(path.name)
        if m and bool(m.group(1)) == bool(m.group(3)) and path.is_dir() and is_complete(path):
            found.append((int(m.group(2)), not m.group(1), path))
    return sorted(found)


def find_checkpoint(ckdir: str | Path) -> Path | None:
    """The newest complete checkpoint in `ckdir`, wherever the last save was interrupted; None if none."""
    found = checkpoints(Path(ckdir))
    return found[-1][2] if found else None


def discard(path: Path) -> None:
    """Remove a folder: renamed to a `.deleting` name first (atomic), then deleted."""
    gone = path.with_name(f".{path.name.lstrip('.')}.deleting-{os.getpid()}")
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def put_in_place(tmp: Path, final: Path) -> None:
    """Rename the finished folder `tmp` to `final`; an existing `final` is moved aside whole first and
    removed once the new one is in place."""
    aside = final.with_name(f".{final.name}.replaced")
    if aside.exists():
        discard(aside)
    if final.exists():
        os.replace(final, aside)
    os.replace(tmp, final)
    if aside.exists():
        discard(aside)


def prune(ckdir: Path, keep: int, current: Path) -> None:
    """Keep the newest `keep` checkpoints (at least `current`); remove the rest and the leftovers of
    interrupted saves and removals."""
    found = [path for _, _, path in checkpoints(ckdir) if path != current]
    for path in found[: max(0, len(found) - (keep - 1))]:
        discard(path)
    for path in ckdir.glob(".step_*"):
        if path.is_dir() and (path.name.endswith(".tmp") or ".deleting-" in path.name):
            shutil.rmtree(path, ignore_errors=True)
