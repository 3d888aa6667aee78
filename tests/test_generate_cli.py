"""`mpi-tp generate` from a checkpoint: the same greedy text at 1 and 2 ranks and from the serial model,
a batch of prompts equal to each alone, long prompts cropped (and said), a bad prompt refused clearly."""
import pytest
from jobs import MPIEXEC, TINY, mpirun  # noqa: F401  (shared launcher helpers)

from mpi_tp import checkpoint as ckpt_io
from mpi_tp.inference.generate import Request, generate
from mpi_tp.inference.sampling import printable
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "run"
    r = mpirun(2, "train", *TINY, "--steps", "40", "--lr", "1e-2", "--dropout", "0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out / "checkpoints"


def serial_greedy(checkpoint, prompt: bytes, n: int) -> bytes:
    with ckpt_io.Checkpoint(str(checkpoint)) as ck:
        model = GPT(GPTConfig(**ck.meta["config"]), Topology.serial(), dtype="float32")
        ckpt_io.load_into(ck, model)
    return generate(model.eval(), [Request(prompt, n, temperature=0)])[0]


def test_greedy_text_at_every_size(checkpoint):
    args = ["generate", "--checkpoint", str(checkpoint), "--greedy", "--max-new-tokens", "24"]
    one = mpirun(1, *args, "--prompt", "The ", "--prompt", "def f(x):")
    two = mpirun(2, *args, "--prompt", "The ", "--prompt", "def f(x):")
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert one.stdout == two.stdout and len(one.stdout.splitlines()) >= 2
    alone = mpirun(2, *args, "--prompt", "def f(x):")
    assert alone.returncode == 0 and two.stdout.endswith(alone.stdout)          # batched: as alone
    want = "".join(printable(p + serial_greedy(checkpoint, p, 24)) + "\n" for p in (b"The ", b"def f(x):"))
    assert one.stdout == want                                                   # the serial model's text


def test_long_prompt_is_cropped_and_bad_prompt_refused(checkpoint):
    long = "x" * 40                                                    # block_size 16
    r = mpirun(2, "generate", "--checkpoint", str(checkpoint), "--prompt", long, "--max-new-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert "keep their last 16" in r.stderr and r.stdout.startswith("x" * 16) and not r.stdout.startswith("x" * 17)
    bad = mpirun(2, "generate", "--checkpoint", str(checkpoint), "--prompt", "")
    assert bad.returncode == 2 and "the prompt must hold 1 to 16 tokens" in bad.stderr
    assert "Traceback" not in bad.stderr
