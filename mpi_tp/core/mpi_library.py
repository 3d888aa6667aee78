"""Which MPI library mpi4py runs on, and what its launchers need.

    python -m mpi_tp.core.mpi_library                 # "MPICH 5.0.2" or "Open MPI 5.0.11"
    python -m mpi_tp.core.mpi_library --srun-mpi      # srun's --mpi for it: pmi2 (MPICH) or pmix (Open MPI)
    python -m mpi_tp.core.mpi_library --launcher-env  # VAR=value lines its mpiexec needs here (tests/run.sh)

(from the command line without starting MPI; in a program, after mpi4py has started it as usual)

mpi_tp itself relies only on what the MPI standard promises (tests/test_mpi_standard.py); the launchers
differ, and this module is where the differences are written down (docs/clusters.md#open-mpi):
- Slurm's srun speaks PMI-2 to MPICH's wheel (which has no PMIx client) and PMIx to Open MPI (which has no
  PMI-2 client: with --mpi=pmi2 it starts N separate one-rank programs).
- Open MPI's mpiexec refuses to run as root (containers, CI machines) unless told
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, and refuses more ranks than cores unless told
  --oversubscribe (PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe in the environment). MPICH's
  needs neither.
"""
from __future__ import annotations

import os
import sys


def vendor() -> tuple[str, str]:
    """("MPICH", "5.0.2") or ("Open MPI", "5.0.11"): the library mpi4py loads (importing mpi4py.MPI, which
    starts MPI unless mpi4py.rc.initialize says not to, as main() does)."""
    from mpi4py import MPI
    name, version = MPI.get_vendor()
    return name, ".".join(map(str, version))


def library_version() -> str:
    """'MPICH 5.0.2', 'Open MPI 5.0.11': the library as the stamps of figures and run records name it. (Not
    MPI_Get_library_version's first line: Open MPI's is a paragraph and ends in a NUL byte.)"""
    return " ".join(vendor())


def is_open_mpi() -> bool:
    return vendor()[0] == "Open MPI"


def srun_mpi() -> str:
    """srun's --mpi plugin for this library: pmix for Open MPI, pmi2 for MPICH (and others)."""
    return "pmix" if is_open_mpi() else "pmi2"


def launcher_env() -> dict:
    """The settings this library's mpiexec needs on this machine to run the test suite: none for MPICH;
    for Open MPI, leave to run as root (when root) and to start more ranks than cores."""
    if not is_open_mpi():
        return {}
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
    return {**root, "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


LAUNCHER_VARS = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "PRTE_", "MPI_TP_EXPECT")
LAUNCHER_SETTINGS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "PRTE_MCA_")


def child_job_env(env=None) -> dict:
    """The environment (os.environ's by default) for a new MPI job started from this process, which may
    itself be a rank of one: the variables its launcher gave it are dropped (MPICH's PMI_ and HYDRA_, Open
    MPI's OMPI_, PMIX_ and PRTE_, the expected world size), so the new job starts fresh; the user's
    settings for Open MPI's launcher stay (running as root, PRTE_MCA_ parameters: above)."""
    env = dict(os.environ if env is None else env)
    return {k: v for k, v in env.items() if k.startswith(LAUNCHER_SETTINGS) or not k.startswith(LAUNCHER_VARS)}


def main(argv: list[str]) -> int:
    import mpi4py
    mpi4py.rc.initialize = False            # asked from a shell script: no MPI job to start
    if argv == ["--srun-mpi"]:
        print(srun_mpi())
    elif argv == ["--launcher-env"]:
        print("\n".join(f"{k}={v}" for k, v in launcher_env().items()))
    elif not argv:
        print(library_version())
    else:
        print("usage: python -m mpi_tp.core.mpi_library [--srun-mpi | --launcher-env]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
