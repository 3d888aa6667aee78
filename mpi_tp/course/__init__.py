"""Exercises with feedback (`mpi-tp exercise N`): broken layers to fix, a prediction to make.

    exercises/   the broken variants a student copies and edits (one small file each)
    solutions/   the reference solutions (what the tests check)
    common.py    loading a student's file, comparing with the serial layer, the report
    checks.py    the checks of exercises 1-3 (row bias, MLP order, f's backward)
    vocab.py     exercise 4 (uneven vocabulary shards)
    step_bytes.py  exercise 5 (the bytes of one step, against the counters)
    registry.py  the list: number, title, file, what to fix, where the lesson is

Every check runs the student's layer at T = world size against the serial layer
built from the same seed (float64), like `mpi-tp explain`, and says PASS or what
is still wrong: which rank, which quantity, how far off, and a hint.
"""
