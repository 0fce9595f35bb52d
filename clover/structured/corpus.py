"""The structured-output corpus: real-world-shaped JSON schemas, by source (docs/structured.md, "Corpus").

* `schemastore`: the SchemaStore schemas check-jsonschema vendors (GitHub workflows and actions,
  dependabot, readthedocs, renovate, GitLab CI, compose, ...): each document's root and up to
  `per_file` of its `definitions` (all of them with `per_file=None`), read from the installed
  package (a test dependency; the source is empty without it);
* `metaschema`: the JSON Schema meta-schemas jsonschema-specifications ships (drafts 3 to 2020-12);
* `pydantic`: `model_json_schema()` of the models below (Optional, nested, list, enum, Literal, union);
* `bfcl`: BFCL-style function definitions (`corpus/bfcl.json`: floats with `format: "float"`, arrays
  without maxItems), one schema per function, grouped into requests of several tools;
* `openapi`: OpenAPI 3.0-style payloads and Kubernetes-shaped objects (`corpus/openapi.json`).

Each entry: {"id", "source", "schema", "root"} (root: the document its `$ref`s point into, or None),
for `normalize(schema, root)`.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from ..settings import INFILL_THRESHOLD

HERE = Path(__file__).parent / "corpus"
SOURCES = ("schemastore", "metaschema", "pydantic", "bfcl", "openapi")


# ---- pydantic models, as clients pass them to chat.completions.parse ---------------------------------
class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Priority(enum.IntEnum):
    low = 1
    medium = 2
    high = 3


class Person(BaseModel):
    name: str
    age: int


class MaybeAge(BaseModel):
    name: str
    age: Optional[int] = None


class Address(BaseModel):
    street: str
    city: str
    zip_code: Optional[str] = None


class PersonWithAddress(BaseModel):
    name: str
    address: Address


class Tags(BaseModel):
    tags: list[str]


class Scores(BaseModel):
    scores: list[int] = Field(max_length=5)
    mean: float


class Paint(BaseModel):
    color: Color
    coats: int = Field(ge=1, le=3)


class Task(BaseModel):
    title: str = Field(max_length=40)
    priority: Priority
    done: bool = False


class TodoList(BaseModel):
    owner: str
    tasks: list[Task]


class Mood(BaseModel):
    mood: Literal["happy", "sad", "neutral"]
    intensity: float = Field(ge=0, le=1)


class IdOrName(BaseModel):
    key: Union[int, str]


class Cat(BaseModel):
    kind: Literal["cat"]
    indoor: bool


class Dog(BaseModel):
    kind: Literal["dog"]
    breed: str


class PetOwner(BaseModel):
    owner: str
    pet: Union[Cat, Dog] = Field(discriminator="kind")


class Coordinates(BaseModel):
    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)


class Place(BaseModel):
    name: str
    coords: Coordinates
    aliases: list[str] = []


class Trip(BaseModel):
    traveller: PersonWithAddress
    stops: list[Place]
    budget: Optional[float] = None


class Node(BaseModel):
    value: int
    children: list["Node"] = []


class Matrix(BaseModel):
    rows: list[list[int]]


class Inventory(BaseModel):
    counts: dict[str, int]


class Event(BaseModel):
    name: str
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    attendees: Optional[list[str]] = None


class Review(BaseModel):
    rating: int = Field(ge=1, le=5)
    summary: str = Field(max_length=80)
    pros: list[str]
    cons: list[str]
    recommend: Optional[bool] = None


class Answer(BaseModel):
    answer: Union[int, float, None]
    confidence: Literal["low", "medium", "high"]


class Step(BaseModel):
    explanation: str
    output: str


class MathReasoning(BaseModel):
    steps: list[Step]
    final_answer: str


class Entity(BaseModel):
    text: str
    label: Literal["PERSON", "ORG", "LOC", "DATE"]


class Extraction(BaseModel):
    entities: list[Entity]
    language: Optional[Literal["en", "de", "fr"]] = None


class Product(BaseModel):
    sku: str = Field(min_length=3, max_length=12)
    price: float = Field(gt=0)
    color: Optional[Color] = None
    sizes: list[Literal["S", "M", "L", "XL"]] = []


class Order(BaseModel):
    id: int
    products: list[Product]
    shipping: Optional[Address] = None
    status: Literal["new", "paid", "shipped"] = "new"


PYDANTIC = [Person, MaybeAge, Address, PersonWithAddress, Tags, Scores, Paint, Task, TodoList, Mood, IdOrName,
            PetOwner, Coordinates, Place, Trip, Node, Matrix, Inventory, Event, Review, Answer, MathReasoning,
            Extraction, Product, Order]


# ---- the sources ---------------------------------------------------------------------------------------
def _schemastore(per_file: int | None) -> list[dict]:
    try:
        import check_jsonschema
    except ImportError:
        return []
    folder = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor"
    out = []
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        name = path.stem
        out.append({"id": f"{name}", "source": "schemastore", "schema": doc, "root": None})
        for key in ("definitions", "$defs"):
            defs = sorted(doc.get(key) or {})
            if per_file is not None and len(defs) > per_file:  # evenly spread, deterministic
                defs = [defs[round(i * (len(defs) - 1) / max(per_file - 1, 1))] for i in range(per_file)]
            out += [{"id": f"{name}#/{key}/{d}", "source": "schemastore", "root": doc,
                     "schema": {"$ref": f"#/{key}/{d.replace('~', '~0').replace('/', '~1')}"}} for d in defs]
    return out


def _metaschemas() -> list[dict]:
    from jsonschema_specifications import REGISTRY

    return [{"id": uri, "source": "metaschema", "schema": REGISTRY.contents(uri), "root": None}
            for uri in sorted(REGISTRY)]


def _pydantic() -> list[dict]:
    return [{"id": m.__name__, "source": "pydantic", "schema": m.model_json_schema(), "root": None} for m in PYDANTIC]


def bfcl_requests() -> list[list[dict]]:
    """The BFCL-style requests: each a list of OpenAI tools ({"type": "function", "function": ...})."""
    data = json.loads((HERE / "bfcl.json").read_text())
    return [[{"type": "function", "function": f} for f in request] for request in data["requests"]]


def _bfcl() -> list[dict]:
    return [{"id": t["function"]["name"], "source": "bfcl", "schema": t["function"]["parameters"], "root": None}
            for request in bfcl_requests() for t in request]


def _openapi() -> list[dict]:
    doc = json.loads((HERE / "openapi.json").read_text())
    return [{"id": name, "source": "openapi", "schema": {"$ref": f"#/components/schemas/{name}"}, "root": doc}
            for name in doc["components"]["schemas"]]


def load(per_file: int | None = 6, sources=SOURCES, only: str | None = None) -> list[dict]:
    """The corpus entries of `sources`, in SOURCES order; `only`: just those whose id contains one of
    its comma-separated substrings (e.g. "Trip,github-issue-forms"), to rerun the failing ones."""
    make = {"schemastore": lambda: _schemastore(per_file), "metaschema": _metaschemas, "pydantic": _pydantic,
            "bfcl": _bfcl, "openapi": _openapi}
    unknown = [s for s in sources if s not in make]
    if unknown:
        raise ValueError(f"unknown corpus source {unknown[0]!r} (known: {', '.join(SOURCES)})")
    entries = [e for s in SOURCES if s in sources for e in make[s]()]
    if only:
        words = [w for w in only.split(",") if w]
        entries = [e for e in entries if any(w in e["id"] for w in words)]
    return entries


# ---- coverage: every entry answered ---------------------------------------------------------------------
def prompt_for(entry: dict, chars: int = 160) -> list[dict]:
    """The chat request of an entry: the schema (normalised, cut to `chars`) in the prompt."""
    return [{"role": "user", "content": f"Reply with a JSON document for the schema {entry['id']}: "
             + json.dumps(entry.get("normalized", entry["schema"]))[:chars]}]


def answer(model, tokenizer, entry: dict, max_new_tokens: int = 512, threshold: float = INFILL_THRESHOLD,
           block_size: int = 32) -> dict:
    """One entry as the server answers a json_schema response_format: normalised, then infilled or
    decoded under its grammar, or refused (a 400 naming the keyword and path). The record: id, source,
    method ("infill", "grammar" or "refused"), valid (json.loads + jsonschema on the returned text),
    forwards, seconds, error."""
    import time

    from jsonschema import FormatChecker, validators

    from .generate import generate_json
    from .normalize import normalize

    start = time.perf_counter()
    rec = {"id": entry["id"], "source": entry["source"]}
    from ..chat import encode

    try:
        schema = entry["normalized"] = normalize(entry["schema"], entry["root"])
        room = model.config.max_position_embeddings - len(encode(tokenizer, prompt_for(entry), True)) - 1
        out = generate_json(model, tokenizer, prompt_for(entry), schema, chat=True, threshold=threshold,
                            block_size=block_size, max_new_tokens=min(max_new_tokens, room))
    except ValueError as e:  # Refused, or a schema that is not valid (both a 400 in the server)
        wall = time.perf_counter() - start
        return rec | {"method": "refused", "valid": False, "forward_passes": 0, "seconds": wall, "wall_seconds": wall,
                      "error": str(e), "keyword": getattr(e, "keyword", "schema")}
    except Exception as e:  # a failure of ours (a 500 in the server): counted against coverage, not hidden
        wall = time.perf_counter() - start
        return rec | {"method": "error", "valid": False, "forward_passes": 0, "seconds": wall, "wall_seconds": wall,
                      "error": f"{type(e).__name__}: {e}"}
    # the verdict again, from the returned text alone
    valid = out.complete
    if valid:
        try:
            value = json.loads(out.text)
            valid = next(validators.validator_for(schema)(schema, format_checker=FormatChecker()).iter_errors(value),
                         None) is None
        except json.JSONDecodeError:
            valid = False
    return rec | {"method": out.method, "valid": valid, "claimed_valid": out.valid, "complete": out.complete,
                  "forward_passes": out.forward_passes, "seconds": out.seconds, "error": out.error,
                  "tokens": len(out.token_ids), "wall_seconds": time.perf_counter() - start,
                  **({"note": out.note} if out.note else {})}


DEADLINE_S = 60  # every request answered (or refused) within this many seconds


def summarize(records: list[dict]) -> dict:
    """Coverage (valid / total), refused, invalid and error counts, forwards and seconds per reply, the
    slowest answer (wall time, refusals included) and how many missed the issue's answer deadline
    (`DEADLINE_S`): overall, per source and per method."""
    def stats(rs):
        n = len(rs)
        answered = [r for r in rs if r["method"] in ("infill", "grammar")]
        return {"total": n, "valid": sum(r["valid"] for r in rs), "coverage": sum(r["valid"] for r in rs) / max(n, 1),
                "refused": n - len(answered), "invalid": sum(not r["valid"] for r in answered),
                "incomplete": sum(not r.get("complete", True) for r in answered),
                "forward_passes_per_reply": sum(r["forward_passes"] for r in answered) / max(len(answered), 1),
                "seconds_per_reply": sum(r["seconds"] for r in answered) / max(len(answered), 1),
                "errors": sum(r["method"] == "error" for r in rs),  # a 500 in the server
                "slowest_seconds": max((r.get("wall_seconds", r["seconds"]) for r in rs), default=0.0),
                "over_60s": sum(r.get("wall_seconds", r["seconds"]) > DEADLINE_S for r in rs)}

    sources = list(dict.fromkeys(r["source"] for r in records))
    methods = [m for m in ("infill", "grammar", "refused", "error") if any(r["method"] == m for r in records)]
    return {"overall": stats(records), "per_source": {s: stats([r for r in records if r["source"] == s]) for s in sources},
            "per_method": {m: stats([r for r in records if r["method"] == m]) for m in methods}}
