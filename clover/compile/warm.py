"""Compiling a server's new shapes away from its requests: in a child process, into inductor's
on-disk caches, from which the server then loads the finished graphs.

Why a process: a compile is dynamo tracing and inductor lowering, Python holding the GIL, so a
compile thread beside the scheduler slows its eager steps at every op; and tracing patches
module calls process-wide, which breaks a forward running in another thread. A child forked after
the model is loaded shares its weights (copy on write), runs at the lowest CPU priority (unless
$CLOVER_COMPILE_NICE says otherwise: a benchmark waiting for its graphs on a busy machine) on one
thread, is stopped while the server decodes but for a share of the time (`Background.pace`: a
lower priority does not keep a compile off the other core of a 2-core machine), compiles each shape (and fused-function layout) it is sent, the same graph the server would
make (`CompileState.compile_shape`, `Fused.compile`), and reports it.

Where the caches live: `cache_dir` (TORCHINDUCTOR_CACHE_DIR, else ~/.cache/clover/inductor), so
they outlive a reboot's /tmp and a restarted server loads its graphs instead of compiling them.
The child reports, with each shape it compiled, the cache key that loads its graph without a
trace and how its Replay fetches its inputs (`stored`), and notes both there (`Compiled`: one file
per shape, under a fingerprint of the model's structure and the torch version). The server loads
each reported graph by that key (milliseconds, no dynamo trace), between its decoding turns; a
restarted server loads the noted ones at start-up. A graph without a key (a note of an older
server) is compiled by the server itself, a cache hit (a trace and a load), only when it has had
nothing to decode for a while. Not in a thread beside the requests: a trace holds the GIL and sets
torch's process-wide "compiling" flag, which changes the ops an eager forward in another thread runs.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from pathlib import Path

import torch

from ..utils.files import atomic_write
from .shapes import ShapeKey

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
NICE_ENV = "CLOVER_COMPILE_NICE"  # the compiling child's niceness increment (default 19: the lowest priority)
SHARE_ENV = "CLOVER_COMPILE_SHARE"  # the share of the time the child runs while the server decodes (default 0.2)
SHARE_PERIOD_S = 2.0  # while the server decodes, the child runs the last share of every period this long


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

    def add(self, key, graph: dict | None = None) -> None:
        """Note `key`, with what loads its graph without a trace (`stored.shape_info`) when given."""
        self.folder.mkdir(parents=True, exist_ok=True)
        data = json.dumps(key_to_json(key), sort_keys=True).encode()
        name = hashlib.sha256(data).hexdigest()[:32]
        if graph is not None:  # before the key: a note found is whole with its graph
            atomic_write(self.folder / (name + ".graph"), json.dumps(graph, sort_keys=True).encode())
        atomic_write(self.folder / (name + ".key"), data)

    def keys(self) -> list:
        return list(self.graphs())

    def graphs(self) -> dict:
        """The noted keys, each with what loads its graph (None: noted without it, or unreadable)."""
        found = {}
        for path in sorted(self.folder.glob("*.key")) if self.folder.is_dir() else ():
            try:
                key = key_from_json(json.loads(path.read_bytes()))
            except (OSError, ValueError, TypeError, KeyError, AttributeError):
                continue  # unreadable (another version's note): that shape compiles as a new one
            try:
                graph = json.loads(path.with_suffix(".graph").read_bytes())
            except (OSError, ValueError):
                graph = None
            found[key] = graph if isinstance(graph, dict) else None
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
        self.paused = False
        self.asked: set = set()
        self.done: set = set()
        self.graphs: dict = {}  # finished key -> what loads its graph without a trace (`stored`), when the child had it

    def ask(self, key, fused=None) -> None:
        """Compile the model shape `key` (a ShapeKey), or with `fused` (a Fused) that function's layout `key`."""
        if key not in self.asked:
            self.asked.add(key)
            try:
                self.conn.send((key, None) if fused is None else (key, (fused.fn, fused.key, tuple(fused.shared))))
            except (OSError, TypeError, AttributeError, pickle.PicklingError):
                self.done.add(key)  # the child is gone, or the function cannot be sent: the server compiles it itself

    def poll(self) -> set:
        """The keys the child has finished so far (with `graphs` of theirs)."""
        try:
            while self.conn.poll():
                key, graph = self.conn.recv()
                self.done.add(key)
                if graph is not None:
                    self.graphs[key] = graph
        except (EOFError, OSError):
            self.done |= self.asked
        return self.done

    def busy(self) -> bool:
        return bool(self.asked - self.poll())

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue the child and whatever it started (its process group: the C++
        compiler), so that its compile leaves the CPU to the server's requests while it is stopped."""
        if paused != self.paused and hasattr(signal, "SIGSTOP"):
            try:
                os.killpg(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)
            except OSError:  # gone, or not (yet) a group of its own
                return
            self.paused = paused

    def close(self) -> None:
        self.pause(False)  # a stopped child cannot see its pipe close
        self.conn.close()  # the child ends at the end of its pipe
        self.proc.join(timeout=2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=2)


def compile_share() -> float:
    """$CLOVER_COMPILE_SHARE as a share in [0, 1] (a bad value: the default)."""
    try:
        share = float(os.environ.get(SHARE_ENV, "0.2"))
    except ValueError:
        return 0.2
    return min(max(share, 0.0), 1.0)


def _start(parent_end, *args) -> None:
    """The child: without its copy of the server's end of the pipe, so that the server's end closing
    (or the server dying) ends it, and the listening socket it inherited with it."""
    parent_end.close()
    os.setpgid(0, 0)  # a group of its own, with the compilers it starts: `Warmer.pause` stops them all
    _child(*args)


def _child(model, c_shims: bool, conn) -> None:
    from .state import CompileState

    os.nice(int(os.environ.get(NICE_ENV, "19")))
    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # no pool of compile workers: one process group, one core
    state, noted = CompileState(model, c_shims=c_shims), Compiled.of(model)
    while True:
        try:
            key, fused = conn.recv()
        except (EOFError, OSError):
            return
        graph = None
        try:
            graph = _compile(state, key, fused)
            if fused is None and noted is not None and key in state.replays:  # compiled (not past dynamo's limit)
                noted.add(key, graph)
        except Exception:  # noqa: BLE001 - the server's own compile of the shape meets it again
            traceback.print_exc()
        conn.send((key, graph))


def _compile(state, key, fused) -> dict | None:
    """(In the child) compile a model shape (`fused` None) or a fused-function layout; what loads
    its graph without a trace (`stored`), or None."""
    from .fused import Fused
    from .stored import recording, shape_info

    with recording() as aot:
        if fused is None:
            state.compile_shape(key)
        else:
            Fused(fused[0], fused[1], state, fused[2]).compile(key)
    if fused is None:
        return shape_info(state.replays.get(key), aot)
    return {"aot": aot[0]} if len(aot) == 1 else None


class Background:
    """A server's compile policy for one model's deferring runners: every shape they ran eagerly is
    (and every fused-function layout) sent to a `Warmer` child (CPU models; `child=False`, or another
    device: none). A graph the child finished is loaded by its cache key (`load_one`: no trace,
    milliseconds); one the child could not describe so (`stored`) is compiled by the server, a
    cache hit (`compile_one`: a trace and a load, seconds holding the GIL), only with nothing to
    decode. No request waits on a graph the child is still compiling. The shapes an earlier
    server's child noted in the disk cache (`noted`) are loaded by key at start-up (`load_noted`),
    or, noted without their key, wait for `compile_one` like the others; none is sent to the child."""

    def __init__(self, model, child: bool = True):
        from .state import state_of

        self.state = state_of(model)
        self.graphs: dict = {}  # key -> what loads its graph without a trace (`stored`)
        self.noted = self.note_ready(model) if model.device.type == "cpu" else frozenset()
        self.warmer = Warmer(self.state) if child and model.device.type == "cpu" else None
        self.share = compile_share()
        self.decoding_since: float | None = None  # when the server began decoding (None: idle)

    def note_ready(self, model) -> frozenset:
        """The shapes noted in the disk cache for this model that have no graph here yet, queued for
        `load_one` / `compile_one`."""
        noted = Compiled.of(model)
        ready = {k: g for k, g in (noted.graphs() if noted is not None else {}).items() if k not in self.state.replays}
        for key, graph in ready.items():
            self.state.deferred.setdefault(key, None)
            if graph is not None:
                self.graphs[key] = graph
        return frozenset(ready)

    def load_noted(self) -> int:
        """Load every noted graph that loads without a trace (start-up); how many were loaded."""
        from .stored import import_ahead

        import_ahead()
        return sum(self.load_one(among=self.noted) for _ in range(len(self.noted.intersection(self.graphs))))

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
        if self.warmer is None:
            return None
        done = self.warmer.poll()
        self.graphs.update(self.warmer.graphs)
        self.warmer.graphs.clear()
        return done | self.noted

    def _queued(self) -> list:
        return [*self.state.fused_deferred, *self.state.deferred]

    def can_load(self) -> bool:
        """Whether `load_one` has a graph to load now (asked between every two turns of a decoding server:
        with nothing queued it answers without reading the child's pipe)."""
        queued = self._queued()
        if not queued:
            return False
        ready = self.ready()
        return any(k in self.graphs and (ready is None or k in ready) for k in queued)

    def load_one(self, among=None) -> bool:
        """Load one finished graph by its cache key (a fused-function layout first, then the oldest
        shape; among the keys `among` when given); whether one was loaded. A graph that does not
        load so is left to `compile_one`."""
        ready = self.ready()
        key = next((k for k in self._queued() if k in self.graphs and (ready is None or k in ready)
                    and (among is None or k in among)), None)
        if key is None:
            return False
        self.resume()
        return self.state.load(key, self.graphs.pop(key))  # False: it stays queued, for `compile_one`

    def can_compile(self) -> bool:
        """Whether `compile_one` has something to do now."""
        ready = self.ready()
        return any((ready is None or k in ready) and k not in self.graphs for k in self._queued())

    def compile_one(self) -> bool:
        """Compile one finished graph the server has no key of (a cache hit: a trace and a load)."""
        ready = self.ready()
        ready = {k for k in (self._queued() if ready is None else ready) if k not in self.graphs}
        self.resume()
        return self.state.compile_next(ready)

    def resume(self) -> None:
        """Let the child run while the server loads or compiles a graph: a stopped child must not hold
        a lock of the compile cache the load waits for (the next `pace` stops it again)."""
        if self.warmer is not None:
            self.warmer.pause(False)

    def pace(self, decoding: bool, now: float | None = None) -> None:
        """The child's turn: it runs while the server has nothing to decode; while it decodes, only
        the last $CLOVER_COMPILE_SHARE (default 0.2) of every SHARE_PERIOD_S since decoding began, so
        requests share the CPU with a compile at most that share of the time (the first
        (1 - share) x SHARE_PERIOD_S not at all) and a server that never idles still gets its graphs."""
        if self.warmer is None:
            return
        now = time.perf_counter() if now is None else now
        if not decoding:
            self.decoding_since = None
        elif self.decoding_since is None:
            self.decoding_since = now
        into = 0.0 if self.decoding_since is None else (now - self.decoding_since) % SHARE_PERIOD_S
        self.warmer.pause(decoding and into < (1 - self.share) * SHARE_PERIOD_S)

    def in_flight(self) -> bool:
        """Whether the child is compiling shapes the server will load when they are done."""
        return self.warmer is not None and self.warmer.busy()

    def waiting(self) -> int:
        return self.state.waiting()

    def close(self) -> None:
        if self.warmer is not None:
            self.warmer.close()
