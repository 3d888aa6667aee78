"""Attention's span and its dropout by tile: the sliding window's edge, the tiles' global positions, the strip cache."""
from mutation.mutant import Mutant

BAND = "tests/test_sliding_window.py::test_every_form_equals_the_band_reference"
WINDOWED = "tests/test_sliding_window.py::test_a_windowed_model_trains_to_the_serial_numbers_at_every_layout"
ONLINE = "tests/test_online_attention.py::test_the_online_softmax_draws_its_dropout_masks_by_tile"

MUTANTS = [
    Mutant("attention/window-one-too-wide",
           "a query sees its S_w + 1 latest keys: the window's edge off by one",
           "mpi_tp/core/attention_span.py",
           "(gap < 0) | (gap >= window)", "(gap < 0) | (gap > window)",
           (BAND,), (1,)),
    Mutant("attention/online-window-tiles-from-the-strip-start",
           "the online softmax's strips start their keys at the window of their first row only at whole tiles "
           "past it: the keys of the tile before are never computed",
           "mpi_tp/core/kernels_online.py",
           "    return lo - lo % block, b", "    return lo - lo % block + block if lo % block else lo, b",
           (BAND,), (1,)),
    Mutant("attention/ring-tile-masks-at-local-positions",
           "ring attention's dropout tiles drawn at local positions, not the rows' and keys' global ones",
           "mpi_tp/model/dropout.py",
           "        t, s = t0 + rows.start, s0 + cols.start", "        t, s = rows.start, cols.start",
           (WINDOWED,), (2,)),
    Mutant("attention/online-strip-never-redrawn",
           "the online softmax's dropout keeps the first strip's mask for every strip of query rows",
           "mpi_tp/model/dropout.py",
           "        if self.strip[0] != (t, n):", "        if self.strip[0] is None:",
           (ONLINE,), (1,)),
]
