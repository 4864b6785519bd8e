"""Every hand-written number on the site from a record: ``python -m collectives claims``.

The scan reads pages, snippets and labs as text (no world, no build): it takes well under a
second. The planted pages below show what it fails on."""

import json
import re
import shutil

import pytest

from collectives.course.catalog import ROOT
from collectives.course.site import numbers

pytestmark = pytest.mark.timeout(60)

RECORD = {"meta": {"device": "16-core host", "torch": "2.13.0", "date": "2026-11-24", "command": "x"},
          "comparisons": [{"id": "one-link", "kind": "times",
                           "values": {"gloo": 0.8631, "hier": 0.5644}, "baseline": "gloo"}]}


def _site(tmp_path, page: str, claims: list[dict], definitions=(), name="lessons/07-notes.md"):
    docs = tmp_path / "docs"
    (docs / "lessons").mkdir(parents=True)
    (docs / "data").mkdir()
    (tmp_path / "notebooks").mkdir()
    record = docs / "data" / "rec.json"
    record.write_text(json.dumps(RECORD))
    (docs / name).write_text(page)
    for c in claims:
        c.setdefault("record", str(record))
    hand = docs / "data" / "hand-claims.json"
    hand.write_text(json.dumps({"claims": claims, "definitions": list(definitions), "generated": []}))
    return numbers.problems(docs, tmp_path / "notebooks", hand)


def test_the_course_agrees_with_its_records():
    problems = numbers.problems()
    assert not problems, "\n".join(problems)


def test_the_command_exits_0_when_all_agree_and_1_with_each_disagreement(tmp_path, capsys):
    assert numbers.main([]) == 0
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("img", "*.svg", "*.png"))
    page = tmp_path / "docs" / "benchmarks.md"
    hand = tmp_path / "docs" / "data" / "hand-claims.json"
    # a wrong number planted on the page and in the reviewed list alike: the summary's lesson-7 speed-up,
    # 0.19 (or a little more) above what the record says
    listed = json.loads(hand.read_text(encoding="utf-8"))
    entry = next(e for e in listed["claims"]
                 if e["page"] == "benchmarks.md" and e["field"] == "comparisons[id=one-link].values.gloo")
    right = entry["text"]
    text = page.read_text(encoding="utf-8")
    wrong = next(w for w in (f"{float(right.rstrip('×')) + d:.2f}×" for d in (0.19, 0.23, 0.29, 0.31))
                 if w not in text)        # a number found nowhere else on the page: one disagreement
    page.write_text(page.read_text(encoding="utf-8").replace(f"{right} as fast", f"{wrong} as fast"), encoding="utf-8")
    entry["text"] = wrong                 # this entry only: the same number may be listed for another line
    hand.write_text(json.dumps(listed, ensure_ascii=False), encoding="utf-8")
    capsys.readouterr()
    assert numbers.main(["--docs", str(tmp_path / "docs"), "--hand-claims", str(hand)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("benchmarks.md:") and \
        f"'{wrong}' disagrees with docs/img/07-bench-sizes.json" in out[0], out


def test_a_planted_wrong_number_fails_and_the_right_one_passes(tmp_path):
    claim = {"page": "lessons/07-notes.md", "text": "564 ms", "field": "comparisons[id=one-link].values.hier"}
    assert _site(tmp_path / "a", "The hierarchy took 564 ms.\n", [dict(claim)]) == []
    wrong = _site(tmp_path / "b", "The hierarchy took 577 ms.\n", [dict(claim, text="577 ms")])
    assert len(wrong) == 1 and "lessons/07-notes.md:1: '577 ms' disagrees" in wrong[0] and "564.4" in wrong[0]
    orphan = _site(tmp_path / "c", "The hierarchy took 0.6 s.\n", [])
    assert any("'0.6 s' has no record behind it" in p for p in orphan)
    assert any("matches no number" in p for p in _site(tmp_path / "d", "Nothing.\n", [dict(claim)]))


def test_a_header_cannot_contradict_its_values(tmp_path):
    # the record's ratio is a speed-up: 0.8631 / 0.5644 = 1.53
    claim = {"page": "lessons/07-notes.md", "text": "1.53×", "field": "comparisons[id=one-link].values.gloo",
             "of": "comparisons[id=one-link].values.hier", "as": "speed-up"}
    table = "| algorithm | {} |\n|---|---|\n| hierarchy | 1.53× |\n"
    assert _site(tmp_path / "a", table.format("speed-up over `dist.all_reduce`"), [dict(claim)]) == []
    wrong = _site(tmp_path / "b", table.format("× `dist.all_reduce`"), [dict(claim)])
    assert len(wrong) == 1 and "0.6539 × read as a time-multiple" in wrong[0], wrong
    # in prose: "N× X's time" is a multiple of time, "N× as fast as X" a speed ratio
    assert _site(tmp_path / "c", "It ran 1.53× as fast as gloo.\n", [dict(claim)]) == []
    assert _site(tmp_path / "d", "It took 1.53× gloo's time.\n", [dict(claim)])


def test_settings_exercises_products_and_marked_history_are_not_measurements(tmp_path):
    page = ("# Notes\n\nTwo machines over 1 Gbit/s, 2 × 2 ranks.\n\n"
            "## Worked problems\n\n1. With α = 1 ms, how long does 4 KiB take?\n\n"
            "## Runs\n\n!!! unrecorded \"Unrecorded history\"\n\n    It took 812 ms once.\n\n"
            "## After\n\nIt took 3 ms.\n")
    problems = _site(tmp_path / "a", page, [], [{"pattern": r"\d+ Gbit/s", "why": "a link setting"}])
    assert [p.split(": ")[0] for p in problems] == ["lessons/07-notes.md:17"], problems   # only "3 ms"
    # history is marked only on a notes page
    problems = _site(tmp_path / "b", page.replace("It took 3 ms.", ""), [],
                     [{"pattern": r"\d+ Gbit/s", "why": "a link setting"}], name="lessons/07-hier.md")
    assert any("unrecorded block belongs on a notes page" in p for p in problems)


def test_the_scan_is_fast():
    import time
    start = time.perf_counter()
    numbers.problems()
    assert time.perf_counter() - start < 5


def test_gpu_records_show_when_their_files_exist_and_the_page_builds_without_them(tmp_path):
    from collectives.course.site import claim_pages, claims

    page = "## On GPUs\n\n{{ records: gpu }}\n"
    assert "No run of this kind is recorded in this build" in claim_pages.expand_records(page, tmp_path)
    (tmp_path / "gpu").mkdir()
    record = claims.Record("gpu-ring", names={"ring": "the ring", "nccl": "NCCL's all_reduce"},
                           title="The ring against NCCL, 256 MiB",
                           meta={"device": "4x NVIDIA H200", "torch": "2.11.0+cu130", "nccl": "2.28.9",
                                 "date": "2026-11-28", "command": "tools/gpu_suite.sh out", "commit": "abc123"})
    record.times("256M", {"ring": 0.0016, "nccl": 0.0012}, baseline="nccl", where="256 MiB, 4 ranks")
    record.table = {"head": ["size", "ring"], "rows": [["256 MiB", "1.6 ms"]]}
    record.save(tmp_path / "gpu" / "gpu-ring.json")
    shown = claim_pages.expand_records(page, tmp_path)
    assert "**The ring against NCCL, 256 MiB**" in shown and "ran 1.33× as fast as the ring" in shown
    assert "4x NVIDIA H200, torch 2.11.0+cu130, NCCL 2.28.9, 2026-11-28, commit abc123" in shown
    assert "| 256 MiB | 1.6 ms |" in shown
    # a flat record (meta at the top, rows of dicts) shows too
    (tmp_path / "gpu" / "gpu-tour.json").write_text(json.dumps(
        {"device": "2x NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "nccl": "2.28.9", "date": "2026-11-28",
         "command": "tools/gpu_suite.sh out tour", "rows": [{"algorithm": "ring", "speed": 0.771}]}))
    shown = claim_pages.expand_records(page, tmp_path)
    assert "2x NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, NCCL 2.28.9, 2026-11-28" in shown
    assert "| algorithm | speed |" in shown and "| ring | 0.771 |" in shown


def test_a_field_path_reads_keys_indices_matches_and_quoted_keys_with_dots():
    data = {"steps": [{"step": "a", "data": {"12-bench.json": {"runs": [1.5, 2.5]}}},
                      {"step": "b", "data": {}}]}
    assert numbers.field(data, 'steps[step=a].data."12-bench.json".runs[1]') == 2.5
    assert numbers.field(data, "steps[1].step") == "b"
    with pytest.raises(KeyError):           # unquoted, the dot splits the key
        numbers.field(data, "steps[step=a].data.12-bench.json.runs[1]")


def test_every_benchmark_record_names_its_hosts_cores_and_load():
    """Timings depend on the host: each benchmark that writes a JSON record puts
    ``claims.host()`` (cores, load average, torch) into it, and a page's source line names
    the load beside the device."""
    from collectives.course.site import claim_pages, claims

    made = claims.host()
    assert made["cpus"] >= 1 and len(made["load_average"]) == 3 and made["torch"]
    assert {"cpus", "load_average", "torch"} <= set(claims.environment())
    writers = [p for p in (ROOT / "collectives" / "course" / "benchmarks").glob("*.py")
               if "json.dump" in p.read_text(encoding="utf-8")]
    assert len(writers) >= 10
    silent = [p.name for p in writers if not any(call in p.read_text(encoding="utf-8")
                                                 for call in ("host()", "environment("))]
    assert not silent, f"records written without the host's cores and load: {silent}"
    line = claim_pages._source_line({"meta": {"device": "16-core x86_64 host", "torch": "2.11.0",
                                              "date": "2026-11-29", "command": "x", "load_average": [0.3, 1, 1]}})
    assert "16-core x86_64 host under a load average of 0.3, torch 2.11.0" in line


# --------------------------------------------------------------------------- targets and their status

def test_a_target_reads_its_status_from_the_record(tmp_path, monkeypatch):
    """``{{ target: }}`` on the benchmarks page: the bound, the measured range and met/missed,
    read from the record at every build; a record not yet made reads "not measured"; a field
    the record lacks fails the build."""
    from collectives.course.site import claim_pages, claims, targets

    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    monkeypatch.setattr(claim_pages, "IMG", tmp_path / "img")
    monkeypatch.setattr(claim_pages, "DATA", data)
    (data / "sub" / "x.json").write_text(json.dumps({
        "bench": "x", "speedup": 1.38,
        "rows": [{"name": "a", "r": 0.8, "t": 2.0, "u": 1.0}, {"name": "b", "r": 1.2, "t": 4.0, "u": 4.0}]}))

    def cells(rest: str, name: str = "sub/x") -> str:
        return targets.cells(name, rest, claim_pages.load)

    assert cells("rows[*].r <= 1.05") == "≤ 1.05× | 0.80–1.20× | **missed** (1 of 2 hold)"
    assert cells("rows[name=a].r <= 1.05") == "≤ 1.05× | 0.80× | **met**"
    assert cells("speedup >= 1.5") == "≥ 1.50× | 1.38× | **missed**"
    assert cells("rows[*].t / rows[*].u >= 1.5") == "≥ 1.50× | 1.00–2.00× | **missed** (1 of 2 hold)"
    assert (cells("rows[*].t / rows[name=a].t ~ 0.1")       # one schedule's over another's
            == "0.90–1.10× | 1.00–2.00× | **missed** (1 of 2 hold)")
    assert cells("rows[*].r / rows[*].r ~ 0.1").endswith("| **met**")
    assert cells("rows[*].t / rows[*].u") == "1.00–2.00×"          # no bound: the value alone
    assert cells("rows[*].r >= 1", "gone") == "≥ 1.00× | not measured | no record yet (`docs/data/gone.json`)"
    with pytest.raises(ValueError, match="no 'rows\\[\\*\\].missing'"):
        cells("rows[*].missing <= 1")
    page = "| what | target | measured | status |\n|---|---|---|---|\n| x | {{ target: sub/x speedup >= 1.5 }} |\n"
    assert "| x | ≥ 1.50× | 1.38× | **missed** |" in claims.expand(page)


def test_targets_stay_off_lesson_pages_and_every_one_on_the_benchmarks_page_reads(tmp_path):
    from collectives.course.site import claims, measured, targets

    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    found = targets.PLACEHOLDER.findall(page)
    assert len(found) >= 8
    expanded = claims.expand(page)
    assert "{{ target:" not in expanded and expanded.count("**met**") + expanded.count("**missed**") >= 5
    lesson = "## Measured\n\nIt ran.\n\n| x | {{ target: 13-tp-cpu times.sequential[*] >= 1 }} |\n"
    assert any("targets live on the benchmarks page" in p for p in measured.problems(lesson, tmp_path))


def test_a_gpu_target_reads_only_a_record_made_under_the_rule(tmp_path, monkeypatch):
    """A GPU record (backend nccl) without the rule's ``launch`` and ``inputs`` gives its row
    no value and no status; the same record naming them, at its top, in its meta or in its
    ``rule``, is read; a CPU record needs neither."""
    from collectives.course.site import claim_pages, targets

    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setattr(claim_pages, "IMG", tmp_path / "img")
    monkeypatch.setattr(claim_pages, "DATA", data)
    base = {"bench": "g", "speedup": 1.38, "meta": {"backend": "nccl", "device": "2x NVIDIA H200"}}
    variants = {"old": base, "top": dict(base, launch="eager", inputs="copied"),
                "meta": dict(base, meta=dict(base["meta"], launch="graph", inputs="resident")),
                "rule": dict(base, rule={"launch": "eager", "inputs": {"nccl": "copied"}}),
                "half": dict(base, launch="eager"), "cpu": dict(base, meta={"backend": "gloo"}),
                "named": {"speedup": 1.38, "meta": {"device": "4x NVIDIA H100 80GB HBM3"}}}
    for name, record in variants.items():
        (data / f"{name}.json").write_text(json.dumps(record))

    def cells(name: str, rest: str = "speedup >= 1.5") -> str:
        return targets.cells(name, rest, claim_pages.load)

    assert cells("old") == "≥ 1.50× | not measured under the rule | its record (`old`) predates the rule"
    assert cells("half").startswith("≥ 1.50× | not measured under the rule")
    assert cells("named").startswith("≥ 1.50× | not measured under the rule")     # no backend, a GPU named
    assert cells("old", "speedup") == "not measured under the rule"
    for name in ("top", "meta", "rule", "cpu"):
        assert cells(name) == "≥ 1.50× | 1.38× | **missed**", name
    assert cells("top", "speedup") == "1.38×"


def test_no_page_places_a_gpu_record_made_before_the_rule():
    """Every record a page of the site or a lab places ({{ figure }}, {{ table }}, {{ claim }},
    {{ value }}, {{ ratio }}, {{ target }}) is either not from GPUs or names the rule's launch
    and inputs; no page places the GPU records folder wholesale."""
    from collectives.course.site import claim_pages, claims, targets

    texts = [p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md")]
    texts += ["".join(c["source"]) for p in (ROOT / "notebooks").glob("*.ipynb")
              for c in json.loads(p.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "markdown"]
    # what the site expands: prose, not code (as tools/mkdocs_hooks.py does)
    texts = [re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", t, flags=re.S)) for t in texts]
    names = {name for text in texts for _, name, _ in claims.placeholders(text)}
    names |= {name for text in texts for name, _ in targets.PLACEHOLDER.findall(text)}
    assert len(names) > 20
    unfair = sorted(n for n in names if (r := claim_pages.load(n)) is not None and not targets.under_rule(r))
    assert not unfair, f"pages place GPU records made before the rule: {unfair}"
    assert not any("{{ records: gpu }}" in text for text in texts)
    hand = json.loads((ROOT / "docs" / "data" / "hand-claims.json").read_text(encoding="utf-8"))
    read = {c["record"] for c in hand["claims"]}
    unfair = sorted(r for r in read if not targets.under_rule(json.loads((ROOT / r).read_text(encoding="utf-8"))))
    assert not unfair, f"hand-written numbers read GPU records made before the rule: {unfair}"
    assert not targets.under_rule(claim_pages.load("12-bench-gpu"))     # the check can fail
