"""python -m mpi_tp ... is the same as the mpi-tp command."""
import sys

from mpi_tp.commands.cli import main

sys.exit(main())
