"""The documentation keeps its promises: the lesson's commands run (its links: tests/test_doc_links.py).

    python -m pytest tests/test_docs.py

- The README says what the two tok/s of a training run measure, and a short
  run measures them so: a progress line's is its window's, the closing line's
  the whole run's.
- Every line of a ```bash block in docs/learn.md runs as written, from the
  repository root, and exits 0, in a student's shell: one whose PATH does not
  hold this interpreter's environment, after the `source` line of the course's
  set-up (docs/course.md) and nothing else (`student_shell`). The lines run in
  document order, so a command may read what an earlier one wrote (the lesson
  inspects the checkpoint of the run before it). The folders they write under
  /tmp (their --out) start empty and are removed after, with the
  `.replaced-<date-time>` copies that --overwrite made meanwhile; a student's
  own work found there is moved aside and put back (`students_folders`).

These tests start their own MPI jobs, so they run in the one-rank pass only
(no mpi marker).
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import MPIEXEC, mpirun

from mpi_tp.core.mpi_library import child_job_env

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "docs" / "learn.md"
BIN = os.path.dirname(sys.executable)          # the environment's mpiexec and mpi-tp live beside python
VENV = ROOT / ".venv"                          # where the README's install (and the course's set-up) puts them
COURSE = ROOT / "docs" / "course.md"
TIMEOUT = 120

FENCE = re.compile(r"^(```|~~~)(.*?)$(.*?)^\1[ \t]*$", re.M | re.S)


def clean_env():
    """The parent may itself be an MPI process: drop its launcher's variables so each child job is fresh."""
    env = child_job_env()
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def course_setup() -> tuple[list[str], list[str]]:
    """The course's set-up (the ```bash lines before its lesson 1): (the install lines, the lines that put
    the install on the shell's PATH: what a student's shell has run before every later command)."""
    lines = bash_commands(COURSE, COURSE.read_text().split("\n## 1. ")[0])
    return ([c for c in lines if "pip install" in c],
            [c for c in lines if c.startswith(("source ", ". ", "export "))])


def student_env() -> dict:
    """The environment of a student's fresh shell: clean_env() without this interpreter's bin folder, nor
    .venv's, on PATH, and no virtual environment active (what `.venv/bin/pip install` leaves behind)."""
    env = clean_env()
    drop = {os.path.realpath(BIN), os.path.realpath(VENV / "bin")}
    env["PATH"] = os.pathsep.join(d for d in env["PATH"].split(os.pathsep) if d and os.path.realpath(d) not in drop)
    env.pop("VIRTUAL_ENV", None)
    return env


def student_shell(command: str) -> list[str]:
    """bash running `command` as the course says to: after the set-up's PATH lines, in student_env()."""
    return ["bash", "-c", "\n".join(course_setup()[1] + [command])]


def why_no_student_shell() -> str | None:
    """Why the docs' commands cannot run as a student would here (None: they can). The set-up puts
    .venv first on PATH; the commands must find there the installation these tests run from."""
    if not (VENV / "bin" / "activate").is_file():
        return f"no {VENV}: the course's set-up installs into .venv (the README's install)"
    if os.path.realpath(sys.prefix) != os.path.realpath(VENV):
        return f"these tests run from {sys.prefix}, the course's commands from {VENV}: run them from .venv"
    if not (VENV / "bin" / "mpiexec").exists():
        return "no mpiexec in .venv (pip install -e \".[mpich]\")"
    return None


def students_folders(folders: list[Path], saved: Path):
    """Generator for a fixture around tests that run a page's commands, which write into `folders`: they
    start without them (a student's own work there is moved into `saved` first), and afterwards lose them
    and every `<folder>.replaced-<date-time>` that --overwrite made meanwhile; the student's work comes back."""
    def copies():
        return {p for d in folders for p in d.parent.glob(glob.escape(d.name) + ".replaced-*")}
    before = copies()
    for d in folders:
        if d.exists():
            shutil.move(str(d), str(saved / d.name))
    yield
    for d in list(folders) + sorted(copies() - before):
        shutil.rmtree(d, ignore_errors=True)
    for d in folders:
        if (saved / d.name).exists():
            shutil.move(str(saved / d.name), str(d))


@pytest.fixture(scope="module")
def lesson_folders(tmp_path_factory):
    """The lesson's runs' folders (the --out of its commands) left as a student had them."""
    outs = {m for c in bash_commands(LESSON) for m in re.findall(r"--out (\S+)", c)}
    yield from students_folders([Path(o) for o in sorted(outs)], tmp_path_factory.mktemp("students_work"))


def bash_commands(path: Path, text: str | None = None) -> list[str]:
    """Each non-empty, non-comment line of the ```bash blocks of `path` (or of `text`), in order."""
    out = []
    for m in FENCE.finditer(path.read_text() if text is None else text):
        if m.group(2).strip() == "bash":
            out += [line.strip() for line in m.group(3).splitlines()
                    if line.strip() and not line.strip().startswith("#")]
    return out


def test_the_lesson_has_commands():
    assert len(bash_commands(LESSON)) >= 3, "docs/learn.md lost its ```bash blocks"


@pytest.mark.skipif(why_no_student_shell() is not None, reason=str(why_no_student_shell()))
@pytest.mark.parametrize("command", bash_commands(LESSON), ids=lambda c: c[:70])
def test_lesson_command_runs(command, lesson_folders):
    r = subprocess.run(student_shell(command), capture_output=True, text=True, timeout=TIMEOUT,
                       env=student_env(), cwd=ROOT)
    assert r.returncode == 0, (f"`{command}` exited {r.returncode}\n--- stdout (end) ---\n{r.stdout[-2000:]}"
                               f"\n--- stderr (end) ---\n{r.stderr[-2000:]}")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
def test_the_readme_says_what_each_tok_s_measures(tmp_path):
    """A progress line's tok/s: the tokens of its --log-every steps over its window's seconds (metrics.jsonl's
    tokens_per_s x step_s is one step's tokens); the closing line's: every step's tokens over the whole run,
    which lasts longer than the windows together (the last checkpoint is saved after the last line)."""
    readme = (ROOT / "README.md").read_text()
    assert "The two kinds of `tok/s` measure different spans" in readme and "`train_seconds`" in readme
    steps, every, B, S = 6, 2, 2, 16
    out = tmp_path / "run"
    r = mpirun(1, "train", "--steps", str(steps), "--log-every", str(every), "--eval-every", "3", "--eval-batches",
               "2", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", str(S), "--batch-size",
               str(B), "--sample-len", "0", "--out", str(out), timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"tokens_per_s"' in l]
    assert len(lines) == steps // every
    printed = [int(n.replace(",", "")) for n in re.findall(r"\| ([\d,]+) tok/s \|", r.stdout)]
    assert printed == [round(l["tokens_per_s"]) for l in lines], (printed, lines)
    for line in lines:
        assert line["tokens_per_s"] * line["step_s"] == pytest.approx(B * S), line
    run = json.loads((out / "run.json").read_text())
    assert run["tokens_per_s"] * run["train_seconds"] == pytest.approx(steps * B * S)
    assert run["train_seconds"] > sum(every * line["step_s"] for line in lines)
    done = re.search(r"^done in .*, ([\d,]+) tok/s$", r.stdout, re.M)
    assert done and int(done.group(1).replace(",", "")) == round(run["tokens_per_s"]), r.stdout


def test_every_figure_names_the_command_that_draws_it():
    """docs/experiments.md's table lists every figure of docs/figures with a script that exists."""
    text = (ROOT / "docs" / "experiments.md").read_text().split("## Every figure and the command that draws it")[1]
    rows = [r for r in text.split("\n## ")[0].splitlines() if r.startswith("| ") and "`" in r]
    listed = {}
    for row in rows:
        names, command = row.split("|")[1:3]
        script = re.search(r"experiments/[\w/]+\.py", command)
        assert script and (ROOT / script.group(0)).exists(), f"no existing script in: {row}"
        listed.update({n.strip(): script.group(0) for n in names.split(",")})
    figures = {p.stem for p in (ROOT / "docs" / "figures").glob("*.png")}
    assert figures - set(listed) == set(), f"figures without a command in docs/experiments.md: {figures - set(listed)}"
    assert set(listed) - figures == set(), f"listed but not in docs/figures: {set(listed) - figures}"
