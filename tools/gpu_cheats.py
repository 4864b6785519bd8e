"""Every cheat fixture of ``tests/test_grader.py`` judged on GPUs: the exercise runner with
``--backend nccl`` (fenced worlds, the cases on the rank's device), each fixture's target tasks
expected to FAIL and its control task to PASS, as ``tests/test_grader.py`` expects on CPUs.

    python3 tools/gpu_cheats.py OUT [NAME,NAME...]      # the lane's part ``cheats`` (make gpu)

Ranks share the GPUs when a world has more of them than the machine (one GPU is enough).
The fixtures that write into the course's tree run alone, after the others. One
line per fixture (OK or BAD, the verdicts, seconds); each runner's output in ``OUT/NAME.log``;
exit 1 when any fixture is BAD. ``PAR`` fixtures at once (default 6), ``LIM`` seconds each.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collectives.course.catalog import lesson  # noqa: E402
from tests.grading_fixtures import with_exercise  # noqa: E402
from tests.test_grader import CHEAT_TARGETS, CHEATS, OWN_TREE, QUICK  # noqa: E402

LINE = re.compile(r"^task (\d+) .*?: (PASS|FAIL)(?:: (.*))?$", re.M)


def judge(name: str, out: Path, backend: str = "nccl") -> tuple[bool, str]:
    """Run fixture ``name``'s tasks through the runner; (as expected, its line)."""
    number, targets, control = CHEAT_TARGETS[name]
    tasks = sorted(set(targets) | ({control} if control else set()))
    args = [a for t in tasks for a in ("--task", str(t))] + (["--world", "4"] if name in QUICK else [])
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        student = with_exercise(number, CHEATS / f"{name}.py", Path(folder) / name)
        script = student / lesson(number).exercise.parent.name / "exercise.py"
        try:
            done = subprocess.run([sys.executable, "-m", "collectives.course.grading.runner", "--check-lesson",
                                   str(number), "--exercise", str(script), "--backend", backend, *args],
                                  capture_output=True, text=True, timeout=float(os.environ.get("LIM", "240")),
                                  env={**os.environ, "COLLECTIVES_TIMEOUT": "30"})
            text = done.stdout + done.stderr[-2000:]
        except subprocess.TimeoutExpired as exc:
            text = f"timed out: {exc}"
    (out / f"{name}.log").write_text(text)
    return verdict(name, text, time.time() - started)


def verdict(name: str, text: str, seconds: float = 0.0) -> tuple[bool, str]:
    """The runner's lines ``text`` for fixture ``name`` held to ``CHEAT_TARGETS``: every target
    task FAILs, the control task (if any) PASSes; (as expected, one line)."""
    number, targets, control = CHEAT_TARGETS[name]
    got = {int(m[1]): m[2] == "PASS" for m in LINE.finditer(text)}
    ok = all(got.get(t) is False for t in targets) and (control is None or got.get(control) is True)
    return ok, f"{'OK ' if ok else 'BAD'} {name} (lesson {number}) {got} ({seconds:.0f} s)"


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    names = argv[1].split(",") if len(argv) > 1 else list(CHEAT_TARGETS)
    backend = os.environ.get("BACKEND", "nccl")       # gloo: the same sweep on CPUs
    bad = 0
    alone = [n for n in names if n in OWN_TREE]     # they write into the course's tree: no world beside them
    with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("PAR", "6"))) as pool:
        for ok, line in pool.map(lambda n: judge(n, out, backend), [n for n in names if n not in alone]):
            bad += not ok
            print(line, flush=True)
    for ok, line in (judge(n, out, backend) for n in alone):
        bad += not ok
        print(line, flush=True)
    print(f"{len(names) - bad} of {len(names)} cheat fixtures score nothing on their tasks ({backend})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
