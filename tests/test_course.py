"""The course runs as written: every command of docs/course.md and docs/exercises.md, in order.

    python -m pytest tests/test_course.py

- docs/course.md keeps its shape: the fourteen lessons in the order of the map
  (split, block, vocabulary, SP, DP, pipeline, experts, inference, cost model,
  scaling, mixed precision, context parallelism, Hugging Face, distributed
  optimizer), each with its time, a ```bash block, a figure that exists and a
  question or exercise to check it.
- Every line of a ```bash block of the two pages runs from the repository root
  and exits 0, except a line marked `# expected to FAIL`: a broken exercise
  must exit 1 and say FAIL (so the shipped broken forms really are broken).
  Lines run in document order, so a command may use what an earlier one wrote.
- A prediction (an exercise with an `answer` in mpi_tp.course.registry) comes
  before what shows its answer: the course names the exercise before any
  command or link that shows it, and docs/learn.md keeps the count inside a
  <details> block that says so.
- Each line runs as a student's shell would run it: a fresh bash whose PATH
  does not hold the tests' own environment, which runs the `source` line of
  the course's set-up first (test_docs.student_shell). The set-up's install
  line is the README's, and it is the only line left out: the tests run from
  the `.venv` it makes.

These tests start their own MPI jobs, so they run in the one-rank pass only.
"""
import json
import re
import subprocess
from pathlib import Path

import pytest
from test_doc_links import LINK
from test_docs import (
    FENCE,
    LESSON,
    ROOT,
    VENV,
    bash_commands,
    course_setup,
    student_env,
    student_shell,
    students_folders,
    why_no_student_shell,
)

from mpi_tp.course import registry

COURSE, EXERCISES = ROOT / "docs" / "course.md", ROOT / "docs" / "exercises.md"
TOPICS = ["split", "block", "vocabulary", "sequence parallelism", "step", "pipeline", "experts",
          "inference", "cost model", "scaling", "mixed precision", "context parallelism", "hugging face",
          "distributed optimizer"]
TIMEOUT = 300
EXPECT_FAIL = "# expected to FAIL"


def lessons() -> list[str]:
    """The text of each numbered lesson ("## n. ...") of the course, in order."""
    return re.split(r"^## (?=\d+\. )", COURSE.read_text(), flags=re.M)[1:]


def test_the_course_has_its_lessons_in_order():
    found = lessons()
    assert len(found) == len(TOPICS), f"docs/course.md has {len(found)} lessons, the map has {len(TOPICS)}"
    for n, (text, topic) in enumerate(zip(found, TOPICS), 1):
        title = text.splitlines()[0]
        assert title.startswith(f"{n}. ") and topic in title.lower(), f"lesson {n} is '{title}', expected {topic}"
        assert re.search(r"^\*\d+ minutes\.\*", text, re.M), f"lesson {n} does not say how long it takes"
        assert "```bash" in text, f"lesson {n} has no commands"
        figures = re.findall(r"!\[[^\]]*\]\((figures/[^)]+)\)", text)
        assert figures, f"lesson {n} shows no figure"
        for fig in figures:
            assert (COURSE.parent / fig).exists(), f"lesson {n}: {fig} does not exist"
        assert "- Check:" in text, f"lesson {n} has nothing to check it with"


def test_the_exercises_page_has_commands():
    commands = bash_commands(EXERCISES)
    assert any(EXPECT_FAIL in c for c in commands), "docs/exercises.md runs no broken exercise"
    assert any("--solution" in c for c in commands), "docs/exercises.md checks no solution"


def first_shown(text: str, marker: str) -> int | None:
    """Where `text` first shows `marker`: in a ```bash block or a link's or an image's target (the map's
    table and the prose only name things); None if nowhere."""
    spots = [m.start() for m in FENCE.finditer(text) if m.group(2).strip() == "bash" and marker in m.group(3)]
    spots += [m.start() for m in LINK.finditer(text) if marker in m.group(1)]
    return min(spots, default=None)


@pytest.mark.parametrize("exercise", [e for e in registry.EXERCISES if e.answer], ids=lambda e: f"exercise {e.number}")
def test_a_prediction_comes_before_its_answer(exercise):
    text = COURSE.read_text()
    asked = re.search(rf"\bexercise {exercise.number}\b", text)
    assert asked, f"docs/course.md never asks for exercise {exercise.number}"
    for marker in exercise.answer:
        shown = first_shown(text, marker)
        assert shown is None or asked.start() < shown, (
            f"docs/course.md shows {marker} (exercise {exercise.number}'s answer) at line "
            f"{text.count(chr(10), 0, shown) + 1}, before it asks for the exercise (line "
            f"{text.count(chr(10), 0, asked.start()) + 1})")
    outside = re.sub(r"<details>.*?</details>", "", LESSON.read_text(), flags=re.S)
    for answer in ("4L + 2", "step_counters.png"):           # exercise 5's formula and the chart of its count
        assert answer not in outside, f"docs/learn.md shows {answer} outside a <details> block"


def test_the_dp_caption_counts_what_its_figure_shows():
    """Lesson 5's caption of step_timeline_dp.png names the gradient buckets' all-reduces and the loss's, as
    many and as large as the run that drew the figure counted (experiments/comm/results/step_timeline_dp.json)."""
    run = json.loads((ROOT / "experiments" / "comm" / "results" / "step_timeline_dp.json").read_text())
    phases = run["ranks"][0]["result"]["phases"]
    buckets = phases["backward"]["dp/iall_reduce"]["calls"]
    loss = phases["loss to every rank"]["dp/all_reduce"]
    caption = re.search(r"!\[([^\]]*)\]\(figures/step_timeline_dp\.png\)", COURSE.read_text()).group(1)
    number = {1: "one bucket", 2: "two buckets", 3: "three buckets"}.get(buckets, f"{buckets} buckets")
    assert number in caption and loss["calls"] == 1 and f"loss's {loss['bytes']}-byte all-reduce" in caption, (
        caption, buckets, loss)


def run(command: str):
    r = subprocess.run(student_shell(command), capture_output=True, text=True, timeout=TIMEOUT,
                       env=student_env(), cwd=ROOT)
    out = f"\n--- stdout (end) ---\n{r.stdout[-3000:]}\n--- stderr (end) ---\n{r.stderr[-2000:]}"
    if EXPECT_FAIL in command:
        assert r.returncode == 1 and "FAIL" in r.stdout, \
            f"`{command}` should fail with FAIL, exited {r.returncode}{out}"
    else:
        assert r.returncode == 0, f"`{command}` exited {r.returncode}{out}"


NO_STUDENT_SHELL = why_no_student_shell()


@pytest.fixture(scope="module", autouse=True)
def fresh_course_dirs(tmp_path_factory):
    """The pages write under /tmp/mpi_tp_course and /tmp/mpi_tp_exercises: the tests start with neither,
    and a student's own work found there is moved aside first and put back after (test_docs.students_folders)."""
    yield from students_folders([Path("/tmp/mpi_tp_course"), Path("/tmp/mpi_tp_exercises")],
                                tmp_path_factory.mktemp("students_work"))


@pytest.mark.skipif(NO_STUDENT_SHELL is not None, reason=str(NO_STUDENT_SHELL))
@pytest.mark.parametrize("command", [c for c in bash_commands(COURSE) if "pip install" not in c],
                         ids=lambda c: c[:80])
def test_course_command_runs(command):
    run(command)


@pytest.mark.skipif(NO_STUDENT_SHELL is not None, reason=str(NO_STUDENT_SHELL))
@pytest.mark.parametrize("command", bash_commands(EXERCISES), ids=lambda c: c[:80])
def test_exercise_command_runs(command):
    run(command)


def test_the_only_command_left_out_is_the_install():
    """The set-up installs as the README does (its first command, up to the training run), and that line
    is the only course line that does not run above; .ci/run installs the same way."""
    readme = bash_commands(ROOT / "README.md")[0]
    install = readme.split(" && .venv/bin/mpiexec")[0]
    assert install.startswith("python3 -m venv .venv && .venv/bin/pip install"), readme
    left = [c for c in bash_commands(COURSE) if "pip install" in c]
    assert left == [install] == course_setup()[0], (left, install)
    tests = bash_commands(ROOT / "README.md")[1]                 # the README's second command: the suite
    assert "tests/run.sh" in tests and Path(ROOT / ".ci" / "run").read_text().count(tests) == 1, tests


@pytest.mark.skipif(NO_STUDENT_SHELL is not None, reason=str(NO_STUDENT_SHELL))
def test_the_commands_find_the_venv_only_through_the_setup():
    """Without the set-up's PATH line the student's shell has no mpi-tp or mpiexec of .venv (so the tests
    cannot pass on a PATH the course never sets); after it, mpi-tp, mpiexec and python are .venv's."""
    assert course_setup()[1], "docs/course.md's set-up puts nothing on the shell's PATH"
    bare = subprocess.run(["bash", "-c", "command -v mpi-tp mpiexec python"], capture_output=True, text=True,
                          env=student_env(), cwd=ROOT)
    found = bare.stdout.split()
    assert not any(Path(f).parent.resolve() == (VENV / "bin").resolve() for f in found), found
    set_up = subprocess.run(student_shell("command -v mpi-tp mpiexec python"), capture_output=True, text=True,
                            env=student_env(), cwd=ROOT)
    found = set_up.stdout.split()
    assert len(found) == 3 and all(Path(f).parent.resolve() == (VENV / "bin").resolve() for f in found), (
        found, set_up.stderr)
