"""llama.cpp back end: the build `make llamacpp` makes (llama-cpp-python 0.3.36's sdist from PyPI,
its vendored llama.cpp built with cmake) and a thin runner over llama-cpp-python's low-level API.

Layout of a build folder (`build/llamacpp` by default, or $CLOVER_LLAMACPP):

    llama_cpp_python-0.3.36/          the unpacked sdist (its `llama_cpp` Python package is used as is)
    stock/bin/                        libllama.so, libggml*.so, llama-simple (stock, unpatched)

`LlamaCppContext` runs an exported GGUF (clover export-gguf) with one llama.cpp sequence per batch
row: `decode` evaluates a token list per row at the row's next positions and returns every
column's logits, so AR steps and all-logits batches of 8/16/32 tokens are the same call.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

from ...utils.files import written_whole

SDIST = "llama_cpp_python-0.3.36"
REPO = Path(__file__).resolve().parents[3]


class LlamaCppError(RuntimeError):
    """The build is missing or llama.cpp refused something (a one-line message)."""


VARIANTS = ("stock", "clover")  # build sub-folders: unpatched llama.cpp, and with patches/clover-block-diffusion.patch


def find_build(path: str | Path | None = None, variant: str = "stock") -> Path | None:
    """The build folder holding `variant`, or None: the argument, else $CLOVER_LLAMACPP, else
    <repo>/build/llamacpp. A folder the user named is the only one looked at (a wrong one is an error
    in `require_build`, never a silent fall-back to another build)."""
    given = path or os.environ.get("CLOVER_LLAMACPP")
    cand = Path(given) if given else REPO / "build" / "llamacpp"
    return cand if _is_build(cand, variant) else None


def _is_build(folder: Path, variant: str) -> bool:
    return (folder / variant / "bin" / "libllama.so").is_file() and (folder / SDIST / "llama_cpp").is_dir()


def require_build(path: str | Path | None = None, variant: str = "stock") -> Path:
    """The build folder `find_build` finds, or a LlamaCppError that says what is wrong: a folder given
    (argument or $CLOVER_LLAMACPP) that does not exist or is not a build, or no build at all."""
    build = find_build(path, variant)
    if build is not None:
        return build
    what = "" if variant == "stock" else f" with the {variant} variant"
    for given, name in ((path, "--llamacpp"), (os.environ.get("CLOVER_LLAMACPP"), "CLOVER_LLAMACPP")):
        if given and not Path(given).is_dir():
            raise LlamaCppError(f"{name} {given}: no such folder (a llama.cpp build folder is needed; "
                                "`make llamacpp` makes build/llamacpp)")
        if given:
            raise LlamaCppError(f"{name} {given}: not a llama.cpp build{what} (no {variant}/bin/libllama.so or "
                                f"{SDIST}/ in it); `make llamacpp` makes one")
    raise LlamaCppError(f"no llama.cpp build{what}: run `make llamacpp` (or set CLOVER_LLAMACPP to a build folder)")


_LIBS: dict[str, object] = {}
_SILENT = None


def _silent(level, text, user_data):  # llama.cpp's log: dropped (errors come back as return codes)
    return None


def bindings(path: str | Path | None = None, variant: str = "stock"):
    """llama-cpp-python's ctypes module bound to the build's libllama of `variant` (once per process
    and variant: the module file is loaded once per library, so stock and patched run side by side)."""
    if variant in _LIBS:
        return _LIBS[variant]
    build = require_build(path, variant)
    os.environ["LLAMA_CPP_LIB_PATH"] = str(build / variant / "bin")
    if str(build / SDIST) not in sys.path:
        sys.path.insert(0, str(build / SDIST))
    try:
        import llama_cpp  # noqa: F401  (the package its module imports helpers from)
    except ModuleNotFoundError as e:
        raise LlamaCppError(f"llama-cpp-python's Python layer needs {e.name}: pip install -e '.[llamacpp]'") from None
    spec = importlib.util.spec_from_file_location(f"_clover_llama_cpp_{variant}", build / SDIST / "llama_cpp" / "llama_cpp.py")
    lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lib)
    global _SILENT
    if _SILENT is None:
        _SILENT = lib.llama_log_callback(_silent)  # kept referenced: llama.cpp calls it for as long as it runs
    lib.llama_log_set(_SILENT, ctypes.c_void_p())
    lib.llama_backend_init()
    if variant == "clover":
        lib._lib.llama_clover_set_block_size.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib._lib.llama_clover_set_block_size.restype = None
    _LIBS[variant] = lib
    return lib


KV_TYPES = {"f32": 0, "f16": 1}  # enum ggml_type


class LlamaCppContext:
    """One GGUF in llama.cpp: `rows` sequences (seq ids 0..rows-1), f32 logits for any column.
    `variant="clover"` loads the patched library, whose `set_block` turns on block diffusion."""

    def __init__(self, gguf_path: str | Path, rows: int = 1, n_ctx: int = 2048, threads: int = 1,
                 n_batch: int = 512, kv_type: str = "f16", flash_attn: bool | None = None,
                 kv_unified: bool = False, variant: str = "stock", build: str | Path | None = None):
        lib = bindings(build, variant)
        self.lib, self.variant = lib, variant
        mparams = lib.llama_model_default_params()
        mparams.use_mmap = True
        self.model = lib.llama_model_load_from_file(str(gguf_path).encode(), mparams)
        if not self.model:
            raise LlamaCppError(f"{gguf_path}: llama.cpp could not load it")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx * rows
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = rows
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        cparams.kv_unified = kv_unified  # one K/V pool: a copied sequence shares its cells (no copy)
        if kv_type not in KV_TYPES:
            raise LlamaCppError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        cparams.type_k = cparams.type_v = KV_TYPES[kv_type]  # llama.cpp's default K/V cache is f16
        if flash_attn is not None:  # None: llama.cpp's default (auto)
            cparams.flash_attn_type = 1 if flash_attn else 0
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise LlamaCppError(f"{gguf_path}: llama.cpp could not create a context")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.rows = rows
        self.lens = [0] * rows  # tokens in each sequence
        self.memory = lib.llama_get_memory(self.ctx)
        self._batch = lib.llama_batch_init(n_batch, 0, 1)
        self.n_batch = n_batch
        self.block = 0

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the ctypes functions may already be gone
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def set_threads(self, threads: int) -> None:
        self.lib.llama_set_n_threads(self.ctx, threads, threads)

    def set_block(self, block_size: int) -> None:
        """Block diffusion (patched library): with block_size > 1 every sequence's tokens in one
        decode are one block of that size (block-causal attention, in-block GDN softmax branch
        scaled by c(block_size), right conv inside the block); <= 1: the causal LM."""
        block = block_size if block_size > 1 else 0
        if block == self.block:
            return
        if block and self.variant != "clover":
            raise LlamaCppError("block diffusion needs the patched llama.cpp (variant='clover', make llamacpp)")
        if self.variant == "clover":
            self.lib._lib.llama_clover_set_block_size(self.ctx, block)
        self.lib.llama_set_causal_attn(self.ctx, not block)
        self.block = block

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)
        self.lens = [0] * self.rows

    def fork(self, src: int, dst: int) -> None:
        """Sequence dst becomes a copy of src (K/V and GDN state), e.g. a scratch row for a draft."""
        self.lib.llama_memory_seq_rm(self.memory, dst, -1, -1)
        self.lib.llama_memory_seq_cp(self.memory, src, dst, -1, -1)
        self.lens[dst] = self.lens[src]

    def drop(self, seq: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self.lens[seq] = 0

    def decode(self, tokens: list[list[int]], logits: str | list = "all", seq_ids: list[int] | None = None) -> list[np.ndarray]:
        """Append tokens[i] to sequence seq_ids[i] (default i) in one llama_decode; returns per entry
        the logits of the columns it asks for [k, V]: all of them ("all"), the last one ("last"), or per
        entry logits[i]: an int k (its last k columns) or a list of column indices (ascending). llama.cpp
        computes the head only for those columns."""
        lib, batch = self.lib, self._batch
        seq_ids = list(range(len(tokens))) if seq_ids is None else seq_ids
        if logits == "all":
            wanted = [range(len(t)) for t in tokens]
        elif logits == "last":
            wanted = [range(max(len(t) - 1, 0), len(t)) for t in tokens]
        else:
            wanted = [k if isinstance(k, (list, tuple, range)) else range(len(t) - min(k, len(t)), len(t))
                      for t, k in zip(tokens, logits)]
        total = sum(len(t) for t in tokens)
        if total > self.n_batch:
            raise LlamaCppError(f"{total} tokens in one decode exceed n_batch={self.n_batch}")
        n = 0
        for seq, toks, want in zip(seq_ids, tokens, wanted):
            flags = [False] * len(toks)
            for j in want:
                flags[j] = True
            base = self.lens[seq]
            for j, tok in enumerate(toks):
                batch.token[n] = int(tok)
                batch.pos[n] = base + j
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq
                batch.logits[n] = flags[j]
                n += 1
        batch.n_tokens = n
        rc = lib.llama_decode(self.ctx, batch)
        if rc != 0:
            raise LlamaCppError(f"llama_decode returned {rc}")
        n_out = sum(len(w) for w in wanted)
        flat = (np.ctypeslib.as_array(lib.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab)).copy()
                if n_out else np.zeros((0, self.n_vocab), np.float32))
        out, at = [], 0
        for seq, toks, want in zip(seq_ids, tokens, wanted):
            self.lens[seq] += len(toks)
            out.append(flat[at : at + len(want)])
            at += len(want)
        return out

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        raw = text.encode("utf-8")
        buf = (self.lib.llama_token * (len(raw) + 8))()
        n = self.lib.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, special)
        if n < 0:
            raise LlamaCppError(f"llama_tokenize needs {-n} slots")
        return list(buf[:n])


def greedy_ar(model: LlamaCppContext, prompt_ids: list[int], max_new_tokens: int, eos: tuple[int, ...] = ()) -> list[int]:
    """Greedy AR decoding of one row in llama.cpp (prefill, then one token per decode)."""
    model.reset()
    out: list[int] = []
    step = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model.decode([step], logits="last")[0][-1]
        tok = int(np.argmax(logits))
        out.append(tok)
        if tok in eos:
            break
        step = [tok]
    return out


# Prompts for parity / agreement checks and the benchmark (plain text, as `clover generate` takes them).
SAMPLE_PROMPTS = [
    "Shall I compare thee", "Sort: 41 7 93 28 65 12 80\n", "The capital of France is", "Once upon a time",
    "def add(a, b):\n", "Question: what is 17 + 25?\nAnswer:", "The quick brown fox", "In 1492, Columbus",
    "Translate to French: good morning\n", "List three colours:", "Water boils at", "My favourite food is",
    "import numpy as np\n", "Dear Sir or Madam,\n", "The meaning of life", "Reverse: a b c d\n",
    "Count: 1 2 3 4", "Roses are red,", "Once more unto the breach", "Q: Who wrote Hamlet?\nA:",
]


def teacher_forced_agreement(reference: str | Path, candidate: str | Path, prompts: list[str], new_tokens: int,
                             build: str | Path | None = None) -> float:
    """Share of positions where `candidate`'s greedy token equals `reference`'s, both reading the
    reference's greedy continuation of each prompt (one mismatch does not derail the rest)."""
    hits = total = 0
    with LlamaCppContext(reference, build=build) as ref, LlamaCppContext(candidate, build=build) as cand:
        for prompt in prompts:
            ids = ref.tokenize(prompt)
            cont = greedy_ar(ref, ids, new_tokens)
            cand.reset()
            logits = cand.decode([ids + cont[:-1]])[0][len(ids) - 1 :]
            hits += int((logits.argmax(-1) == np.asarray(cont)).sum())
            total += len(cont)
    return hits / total


QUANT_FTYPES = {"q4_k": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def quantize_file(src: str | Path, dst: str | Path, kind: str, lib_dir: str | Path | None = None, threads: int = 2) -> dict:
    """llama.cpp's own quantizer (llama_model_quantize) on an exported file; dst via temp + rename."""
    lib = bindings(lib_dir)
    dst = Path(dst)
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, QUANT_FTYPES[kind])
    params.nthread = threads
    with written_whole(dst) as tmp:
        rc = lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise LlamaCppError(f"llama_model_quantize({kind}) returned {rc}")
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(dst)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return {"path": str(dst), "outtype": kind, "arch": "qwen3next", "bytes": dst.stat().st_size, "tensor_types": counts}
