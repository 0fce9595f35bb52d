"""Compiling a server's new shapes away from its requests: in a child process, into inductor's
on-disk caches, which the server then loads from when it has nothing to decode.

Why a process: a compile is dynamo tracing and inductor lowering, Python holding the GIL, so a
compile thread beside the scheduler slows its eager steps at every op; and tracing patches
module calls process-wide, which breaks a forward running in another thread. A child forked after
the model is loaded shares its weights (copy on write), runs at the lowest CPU priority (unless
$CLOVER_COMPILE_NICE says otherwise: a benchmark waiting for its graphs on a busy machine) on one
thread, compiles each shape (and fused-function layout) it is sent, the same graph the server would
make (`CompileState.compile_shape`, `Fused.compile`), and reports it. The server's own compile of it
is then a cache hit: a trace and the cached graph's load, no inductor lowering or C++ compile.

Where the caches live: `cache_dir` (TORCHINDUCTOR_CACHE_DIR, else ~/.cache/clover/inductor), so
they outlive a reboot's /tmp and a restarted server loads its graphs instead of compiling them.
The child also notes each shape it compiled there (`Compiled`: one file per shape, under a
fingerprint of the model's structure and the torch version). A restarted server opens its port
without loading those graphs: their shapes run eagerly, as new ones do, and the server loads their
graphs (cache hits: a trace and a load each, no inductor lowering) one at a time when it has
nothing to decode, without asking the child (`Background.noted`). Not in a thread beside the
requests: a trace holds the GIL and sets torch's process-wide "compiling" flag, which changes the
ops an eager forward in another thread runs.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import tempfile
import traceback
from pathlib import Path

import torch

from .shapes import ShapeKey

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
NICE_ENV = "CLOVER_COMPILE_NICE"  # the compiling child's niceness increment (default 19: the lowest priority)


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The on-disk compile cache this process uses from now on: `path`, else $TORCHINDUCTOR_CACHE_DIR,
    else ~/.cache/clover/inductor (set in the environment, so children and inductor's compile workers
    use it too)."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    chosen = path or os.environ.get(CACHE_ENV) or home / "clover" / "inductor"
    chosen = Path(chosen).expanduser().absolute()
    chosen.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(chosen)
    return chosen


class Compiled:
    """The shapes compiled into the disk cache for models built like `model` (`fingerprint`): one
    ShapeKey per file as JSON (never a pickle: the folder is read back at start-up), each written
    whole (temp file + rename), so servers sharing the cache never see half a note. None where no
    cache is set ($TORCHINDUCTOR_CACHE_DIR unset: the graphs go to a temporary folder)."""

    def __init__(self, folder: Path):
        self.folder = folder

    @classmethod
    def of(cls, model) -> "Compiled | None":
        root = os.environ.get(CACHE_ENV)
        return cls(Path(root) / "clover-shapes" / fingerprint(model)) if root else None

    def add(self, key) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        data = json.dumps(key_to_json(key), sort_keys=True).encode()
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.folder / (hashlib.sha256(data).hexdigest()[:32] + ".key"))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def keys(self) -> list:
        found = []
        for path in sorted(self.folder.glob("*.key")) if self.folder.is_dir() else ():
            try:
                found.append(key_from_json(json.loads(path.read_bytes())))
            except (OSError, ValueError, TypeError, KeyError, AttributeError):
                continue  # unreadable (another version's note): that shape compiles as a new one
        return found


def key_to_json(key: ShapeKey) -> dict:
    out = key._asdict()
    out.update(shape=list(key.shape), device=str(key.device), dtype=str(key.dtype).removeprefix("torch."))
    return out


def key_from_json(d: dict) -> ShapeKey:
    dtype = getattr(torch, d["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {d['dtype']!r}")
    return ShapeKey(**{**d, "shape": tuple(d["shape"]), "device": torch.device(d["device"]), "dtype": dtype})


def fingerprint(model) -> str:
    """What a graph of the model may specialise on besides the shape key: its modules, parameter
    shapes and dtypes (and a few values of each: other weights are another model), config and the
    torch version."""
    config = getattr(model, "config", None)
    parts = [torch.__version__, repr(config.to_dict() if hasattr(config, "to_dict") else config)]
    parts += [f"{name}:{type(m).__qualname__}" for name, m in model.named_modules()]
    parts += [f"{name}:{tuple(t.shape)}:{t.dtype}:{t.detach().flatten()[:4].tolist()}"
              for name, t in (*model.named_parameters(), *model.named_buffers())]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


class Warmer:
    """A forked child that compiles the shapes it is `ask`ed for into the disk caches; `poll()`
    gives the keys it has finished (compiled, or failed: the server's own compile then says why)."""

    def __init__(self, state):
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_start, args=(self.conn, state.model(), state.c_shims, child), daemon=True,
                                name="clover-compile")
        self.proc.start()
        child.close()
        self.asked: set = set()
        self.done: set = set()

    def ask(self, key, fused=None) -> None:
        """Compile the model shape `key` (a ShapeKey), or with `fused` (a Fused) that function's layout `key`."""
        if key not in self.asked:
            self.asked.add(key)
            try:
                self.conn.send((key, None) if fused is None else (key, (fused.fn, fused.key, tuple(fused.shared))))
            except (OSError, TypeError, AttributeError, pickle.PicklingError):
                self.done.add(key)  # the child is gone, or the function cannot be sent: the server compiles it itself

    def poll(self) -> set:
        """The keys the child has finished so far."""
        try:
            while self.conn.poll():
                self.done.add(self.conn.recv())
        except (EOFError, OSError):
            self.done |= self.asked
        return self.done

    def busy(self) -> bool:
        return bool(self.asked - self.poll())

    def close(self) -> None:
        self.conn.close()  # the child ends at the end of its pipe
        self.proc.join(timeout=2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=2)


def _start(parent_end, *args) -> None:
    """The child: without its copy of the server's end of the pipe, so that the server's end closing
    (or the server dying) ends it, and the listening socket it inherited with it."""
    parent_end.close()
    _child(*args)


def _child(model, c_shims: bool, conn) -> None:
    from .fused import Fused
    from .state import CompileState

    os.nice(int(os.environ.get(NICE_ENV, "19")))
    torch.set_num_threads(1)
    state, noted = CompileState(model, c_shims=c_shims), Compiled.of(model)
    while True:
        try:
            key, fused = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if fused is None:
                state.compile_shape(key)
                if noted is not None and key in state.replays:  # compiled (not past dynamo's limit)
                    noted.add(key)
            else:
                Fused(fused[0], fused[1], state, fused[2]).compile(key)
        except Exception:  # noqa: BLE001 - the server's own compile of the shape meets it again
            traceback.print_exc()
        conn.send(key)


class Background:
    """A server's compile policy for one model's deferring runners: every shape they ran eagerly is
    (and every fused-function layout) sent to a `Warmer` child (CPU models; `child=False`, or another
    device: none); with nothing to decode, the server compiles one graph the child has finished (a
    cache hit: `compile_one`). No request waits on a graph the child is still compiling. The shapes
    an earlier server's child noted in the disk cache (`noted`) wait like the others, ready to load
    from the start: none is loaded before the server answers, none is sent to the child."""

    def __init__(self, model, child: bool = True):
        from .state import state_of

        self.state = state_of(model)
        self.noted = self.note_ready(model) if model.device.type == "cpu" else frozenset()
        self.warmer = Warmer(self.state) if child and model.device.type == "cpu" else None

    def note_ready(self, model) -> frozenset:
        """The shapes noted in the disk cache for this model that have no graph here yet, queued for
        `compile_one` (each a cache hit there: a trace and a load)."""
        noted = Compiled.of(model)
        ready = [k for k in (noted.keys() if noted is not None else ()) if k not in self.state.replays]
        for key in ready:
            self.state.deferred.setdefault(key, None)
        return frozenset(ready)

    def sync(self) -> None:
        """Send the shapes queued since the last call to the child."""
        if self.warmer is not None:
            for key, fused in list(self.state.fused_deferred.items()):
                self.warmer.ask(key, fused)
            for key in list(self.state.deferred):
                if key not in self.noted:
                    self.warmer.ask(key)

    def ready(self) -> set | None:
        """The queued keys whose graphs are in the disk cache (None: all of them, no child)."""
        return self.warmer.poll() | self.noted if self.warmer is not None else None

    def can_compile(self) -> bool:
        """Whether `compile_one` has something to do now."""
        ready = self.ready()
        return any(ready is None or k in ready for k in (*self.state.fused_deferred, *self.state.deferred))

    def compile_one(self) -> bool:
        """Load one graph the disk cache holds (a fused-function layout first, then the oldest shape)."""
        return self.state.compile_next(self.ready())

    def in_flight(self) -> bool:
        """Whether the child is compiling shapes the server will load when they are done."""
        return self.warmer is not None and self.warmer.busy()

    def waiting(self) -> int:
        return self.state.waiting()

    def close(self) -> None:
        if self.warmer is not None:
            self.warmer.close()
