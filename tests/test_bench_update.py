"""bench/update.py: sections are replaced by rerunning their command, long tables move to
bench/details/, and the headline table (BENCHMARKS.md) and figures table (README.md) are read out of
the sections, never typed by hand."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_update", ROOT / "bench" / "update.py")
update = importlib.util.module_from_spec(spec)
sys.modules["bench_update"] = update  # dataclasses look their module up
spec.loader.exec_module(update)

SECTION = """<!-- bench:speed -->
### speed

`$ python bench/speed.py` (generated 2026-01-01)

| mode | tokens/s | TPF |
|---|---:|---:|
| ar | 100.5 | 1.00 |
| **low_confidence** | 250.25 (2.5x) | 2.50 |
<!-- /bench:speed -->
"""
ROWS = [update.Row("decode", "speed", "lc {a} ({b})", "ar {c}",
                   {"a": ({"mode": "low_confidence"}, "tokens/s"), "b": ({"mode": "low_confidence"}, "TPF"),
                    "c": ({"mode": "ar"}, "tokens/s")}, readme=True)]


def test_tables_and_lookup_read_the_leading_figure_of_a_cell():
    rows = update.tables(SECTION)[0]
    assert rows[1] == {"mode": "low_confidence", "tokens/s": "250.25 (2.5x)", "TPF": "2.50"}
    assert update.lookup(SECTION, {"mode": "low_confidence"}, "tokens/s") == "250.25"
    with pytest.raises(update.HeadlineError, match="self_spec"):
        update.lookup(SECTION, {"mode": "self_spec"}, "tokens/s")
    with pytest.raises(update.HeadlineError, match="accuracy"):
        update.lookup(SECTION, {"mode": "ar"}, "accuracy")


def test_lookup_can_name_the_table_of_a_section_with_several():
    text = ("| clients | server | tok/s |\n|---:|---|---:|\n| 1 | a | 10.5 |\n\n"
            "| clients | server | tok/s |\n|---:|---|---:|\n| 1 | a | 7.25 |\n")
    assert update.lookup(text, {"clients": "1", "server": "a"}, "tok/s") == "10.5"
    assert update.lookup(text, {"#table": "1", "clients": "1", "server": "a"}, "tok/s") == "7.25"
    with pytest.raises(update.HeadlineError):
        update.lookup(text, {"#table": "2", "clients": "1"}, "tok/s")


def test_headline_cites_the_section_and_its_command(tmp_path):
    table = update.headline(SECTION, tmp_path, ROWS)
    assert "| decode | lc 250.25 (2.50) | ar 100.5 | [speed](#speed) |" in table
    assert "- speed: `python bench/speed.py`" in table
    assert update.readme_table(SECTION, tmp_path, ROWS).splitlines()[-1] == "| decode | lc 250.25 (2.50) | ar 100.5 |"
    with pytest.raises(update.HeadlineError, match="no section 'speed'"):
        update.headline(SECTION.replace("bench:speed", "bench:other"), tmp_path, ROWS)
    changed = SECTION.replace("| ar |", "| AR |")
    with pytest.raises(update.HeadlineError, match="decode.*speed.*'ar'"):
        update.headline(changed, tmp_path, ROWS)


def test_long_tables_move_to_details_and_the_headline_still_reads_them(tmp_path):
    output = "intro\n\n| n | ms |\n|---:|---:|\n" + "".join(f"| {n} | {n / 10} |\n" for n in range(30)) + "\nafter"
    short, full = update.fold("long", output)
    assert full == output
    assert short == "intro\n\n(30-row table: [bench/details/long.md](bench/details/long.md))\n\nafter"
    assert update.fold("short", SECTION) == (SECTION.rstrip("\n"), None)
    (tmp_path / "long.md").write_text(output)
    text = f"<!-- bench:long -->\n{short}\n<!-- /bench:long -->"
    row = update.Row("step", "long", "{a} ms", "-", {"a": ({"n": "29"}, "ms")})
    assert "| step | 2.9 ms | - |" in update.headline(text, tmp_path, [row])


def test_a_rerun_replaces_its_section_and_refreshes_both_tables(tmp_path, monkeypatch):
    bench, readme = tmp_path / "BENCHMARKS.md", tmp_path / "README.md"
    bench.write_text("# Clover benchmarks\n\nintro\n\n" + SECTION)
    readme.write_text("# Clover\n\n<!-- bench:figures -->\nold\n<!-- /bench:figures -->\n\nend\n")
    monkeypatch.setattr(update, "FILE", bench)
    monkeypatch.setattr(update, "README", readme)
    monkeypatch.setattr(update, "DETAILS", tmp_path / "details")
    monkeypatch.setattr(update, "HEADLINE", ROWS)
    table = "| mode | tokens/s | TPF |\n|---|---:|---:|\n| ar | 90 | 1.00 |\n| low_confidence | 300 | 3.00 |"
    assert update.main(["speed", "--", sys.executable, "-c", f"print({table!r})"]) == 0
    text = bench.read_text()
    assert text.index("<!-- bench:headline -->") < text.index("intro") < text.index("<!-- bench:speed -->")
    assert "| decode | lc 300 (3.00) | ar 90 |" in text and "250.25" not in text
    assert re.search(r"`\$ .+ -c .+` \(generated \d{4}-\d\d-\d\d\)", text)
    assert "| decode | lc 300 (3.00) | ar 90 |" in readme.read_text() and "old" not in readme.read_text()
    assert readme.read_text().endswith("end\n")
    assert update.main(["speed", "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert bench.read_text() == text


def test_the_committed_tables_are_what_the_command_writes():
    text = update.FILE.read_text()
    assert update.sections(text)["headline"].strip() == update.headline(text).strip(), \
        "BENCHMARKS.md's headline is stale: run python bench/update.py --headline"
    assert update.sections(update.README.read_text())["figures"].strip() == update.readme_table(text).strip(), \
        "README.md's figures are stale: run python bench/update.py --headline"


def test_benchmarks_and_readme_stay_short_with_the_headline_first():
    text = update.FILE.read_text()
    assert len(text.splitlines()) <= 500
    assert re.match(r"# Clover benchmarks\n\n<!-- bench:headline -->", text)
    readme = update.README.read_text()
    assert len(readme.splitlines()) <= 150
    assert "make demo" in readme and "make test" in readme


def test_a_long_section_keeps_its_first_table_and_refold_rerenders_stored_output(tmp_path, monkeypatch):
    table = "| n | ms |\n|---:|---:|\n" + "".join(f"| {n} | {n / 10} |\n" for n in range(3))
    output = "\n".join(["intro", "", "more words", "", table, "second:", "", table.replace("ms", "s"), "end"])
    short, full = update.fold("two", output)
    assert full == output and "second:" not in short and short.count("| n |") == 1
    assert short.endswith("(more: [bench/details/two.md](bench/details/two.md))")
    bench, details = tmp_path / "BENCHMARKS.md", tmp_path / "details"
    head = update.section_head("two", "python two.py", "2026-01-01")
    bench.write_text(f"# Clover benchmarks\n\nintro\n\n<!-- bench:two -->\n{head}{output}\n<!-- /bench:two -->\n")
    monkeypatch.setattr(update, "FILE", bench)
    monkeypatch.setattr(update, "README", tmp_path / "README.md")
    monkeypatch.setattr(update, "DETAILS", details)
    monkeypatch.setattr(update, "HEADLINE", [update.Row("step", "two", "{a} s", "-", {"a": ({"n": "2"}, "s")})])
    assert update.main(["--refold"]) == 0
    text = bench.read_text()
    assert "second:" not in text and (details / "two.md").read_text() == f"{head}{output}\n"
    assert "| step | 0.2 s | - |" in text  # the headline reads the table that moved to details
    assert update.main(["--refold"]) == 0 and bench.read_text() == text  # idempotent


def test_a_cut_right_after_a_moved_table_adds_no_second_link():
    big = "| n |\n|---:|\n" + "".join(f"| {n} |\n" for n in range(update.MAX_ROWS + 2))
    output = "intro\n" * (update.MAX_LINES - 1) + "\n" + big + "\ntail\n" * 3
    short, full = update.fold("cut", output)
    assert full == output
    assert "(more:" not in short
    assert short.rstrip().endswith(f"({update.MAX_ROWS + 2}-row table: [bench/details/cut.md](bench/details/cut.md))")
