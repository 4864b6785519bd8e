"""The grade table fits a 100-column terminal, names dependent failures, and --json writes one
record per student."""

import io
import json

from rich.console import Console

from collectives.course.catalog import ROOT
from collectives.course.grading import grade
from collectives.course.grading.tasks.world import Verdict


def _score(task, verdict):
    return grade.TaskScore(6, task, "a long task title that goes on and on about buckets", 10, verdict)


def test_the_table_fits_100_columns_and_names_the_task_a_failure_needs():
    tasks = [_score(1, Verdict(not_written="Lesson 6, task 1: BucketedReducer.__init__")),
             _score(2, Verdict(not_written="Lesson 6, task 1: BucketedReducer.__init__")),
             _score(3, Verdict(problems=["bucket 2 was all-reduced before it was full " * 3])),
             _score(4, Verdict())]
    assert tasks[0].needs is None and tasks[1].needs == 1 and tasks[2].needs is None
    buf = io.StringIO()
    earned, total = grade.render(tasks, console=Console(file=buf, width=grade.WIDTH))
    lines = buf.getvalue().splitlines()
    assert (earned, total) == (10, 40)
    assert max(len(line) for line in lines) <= grade.WIDTH, buf.getvalue()
    rows = [line for line in lines if line.strip().startswith("06")]
    assert len(rows) == 4, lines                      # one line per task, none wrapped
    assert "needs task 1" in rows[1] and "needs task" not in rows[0]


def test_json_writes_one_record_per_student(tmp_path, capsys):
    out = tmp_path / "class.json"
    lessons = str(ROOT / "lessons")
    code = grade.main(["--lesson", "01", "--task", "2", "--world", "2", "--exercises", lessons,
                       "--exercises", lessons, "--json", str(out)])
    records = json.loads(out.read_text())
    assert code == 1 and len(records) == 2         # the stubs score nothing
    for record in records:
        assert record["exercises"] == lessons and record["earned"] == 0 and record["total"] > 0
        assert [(t["lesson"], t["task"], t["passed"]) for t in record["tasks"]] == [(1, 2, False)]
