"""`mpi-tp explain --layer precision`: the block's activation bytes at bf16 are half of fp32's (term by term,
the fp32 1/std apart), and a parameter costs 16 bytes either way (2 + 2 + 12 at bf16), at T = 1 and 2."""
import pytest
from jobs import mpirun


@pytest.mark.parametrize("ranks", [1, 2])
def test_precision_lesson(ranks):
    r = mpirun(ranks, "explain", "--layer", "precision", "--features", "32", "--seq", "16", timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "model state per parameter, bf16: weights 2 + grads 2 + master 4 + moments 8 = 16 bytes" in out
    assert "model state per parameter, fp32: weights 4 + grads 4 + moments 8 = 16 bytes" in out
    assert "Korthikanti et al.'s count at 2-byte values" in out and out.rstrip().endswith("per parameter: yes")
    rows = [line.split() for line in out.splitlines() if line.startswith(("  GELU input", "  softmax output"))]
    assert rows and all(float(row[-1]) == 0.5 for row in rows), rows
