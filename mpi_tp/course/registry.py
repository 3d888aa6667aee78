"""The exercises: number, title, the file a student copies, what it must define, its check, its lesson."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from mpi_tp.course import checks, hf_split, ring_bytes, step_bytes, vocab, zero_bytes


@dataclass(frozen=True)
class Exercise:
    number: int
    title: str
    module: str               # the file's name in exercises/ and solutions/ (without .py)
    names: tuple              # what the student's file must define
    check: object             # check(student_module, comm, path) -> bool, on every rank
    min_ranks: int            # at fewer ranks the bug cannot show
    ranks: int                # the world size the docs suggest
    lesson: str               # where to read about it
    answer: tuple = ()        # a prediction's: what shows its answer (the course shows these after the exercise)

    def source(self, solution: bool = False) -> str:
        folder = "solutions" if solution else "exercises"
        return str(resources.files(f"mpi_tp.course.{folder}").joinpath(f"{self.module}.py"))


EXERCISES = (
    Exercise(1, "the row layer's bias", "ex1_row_bias", ("RowLinear",), checks.row_bias, 2, 2,
             "mpiexec -n 2 mpi-tp explain --layer row; docs/learn.md, 'The row split'"),
    Exercise(2, "the order of the MLP's splits", "ex2_mlp_order", ("MLP",), checks.mlp_order, 2, 2,
             "mpiexec -n 2 mpi-tp explain --layer mlp; docs/learn.md, section 3"),
    Exercise(3, "f's backward in the column layer", "ex3_f_backward", ("ColumnLinear",), checks.f_backward, 2, 2,
             "mpiexec -n 2 mpi-tp explain --layer column; docs/learn.md, 'The two together'"),
    Exercise(4, "uneven vocabulary shards and their offset", "ex4_vocab_offset", ("vocab_range", "Embedding"),
             vocab.vocab_offset, 2, 3, "docs/learn.md, sections 4 and 5"),
    Exercise(5, "the bytes of one training step", "ex5_step_bytes", ("buffer_bytes", "wire_bytes"),
             step_bytes.step_bytes, 1, 2,
             "mpiexec -n 2 mpi-tp explain --layer block, --layer embedding, --layer loss (each part's collectives); "
             "once you have tried: mpi-tp explain --layer step, docs/learn.md section 7",
             answer=("explain --layer step", "tensor_parallelism.md", "step_counters.png")),
    Exercise(6, "one layer of ring attention", "ex6_ring_bytes", ("messages", "sent_bytes", "scores"),
             ring_bytes.ring_bytes, 1, 2,
             "the docstrings of mpi_tp/parallel/context_parallel.py and ring_attention.py; once you have tried: "
             "mpiexec -n 2 mpi-tp explain --layer cp (docs/course.md, lesson 12)",
             answer=("explain --layer cp",)),
    Exercise(7, "the slices of a Hugging Face folder at T ranks", "ex7_hf_split", ("shard",), hf_split.hf_split, 2, 3,
             "docs/course.md, lesson 13; once you have tried: mpi-tp inspect of lesson 13's checkpoints, "
             "mpiexec -n 3 mpi-tp explain --layer attention --kv-heads 2, mpi_tp/model/heads.py",
             answer=("mpi-tp inspect /tmp/mpi_tp_course/llama", "explain --layer attention --kv-heads",
                     "model/heads.py")),
    Exercise(8, "ZeRO-1's bytes: what it sends, what it keeps", "ex8_zero_bytes", ("dp_wire_bytes", "state_bytes"),
             zero_bytes.zero_bytes, 2, 2, "docs/course.md lesson 14 (its opening); once you have tried: "
             "docs/parallelism.md, 'ZeRO-1: the distributed optimizer'",
             answer=("zero-1-the-distributed-optimizer", "--zero 1")),
)


def get(number) -> Exercise | None:
    return next((e for e in EXERCISES if e.number == number), None)
