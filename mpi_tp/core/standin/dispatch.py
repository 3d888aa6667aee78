"""How NumPy calls become stand-in device operations: arguments checked and unwrapped, results wrapped.

Host NumPy arrays are refused among device arguments (CuPy: "Unsupported type
numpy.ndarray"), except where CuPy uploads them itself (an index array, values
assigned into a device array): those are counted uploads. Results come back as
device arrays (the same object when NumPy hands an argument back), NumPy scalars
as 0-d arrays; outputs whose size depends on the data count CuPy's implicit syncs.
Used by mpi_tp.core.standin.ndarray (the array type) and .modules (cupy.X).
"""
from __future__ import annotations

import numpy

from mpi_tp.core.standin.counters import counters
from mpi_tp.core.standin.state import StrictnessError

ndarray = None        # the array type: set by mpi_tp.core.standin.ndarray once it is defined

SCALARS = (bool, int, float, complex, numpy.generic)
# outputs whose size depends on the data: CuPy reads a count back from the device (syncs)
SYNCING = {"nonzero": 1, "flatnonzero": 1, "argwhere": 1, "unique": 1, "compress": 1, "extract": 1, "bincount": 2}
VIEWS = {"reshape", "transpose", "swapaxes", "moveaxis", "squeeze", "expand_dims", "broadcast_to", "broadcast_arrays",
         "ravel", "view", "atleast_1d", "atleast_2d", "shape", "ndim", "size", "result_type", "can_cast", "isscalar"}
METADATA = {"shape", "ndim", "size", "result_type", "can_cast", "min_scalar_type", "iscomplexobj", "isrealobj",
            "isscalar", "may_share_memory", "shares_memory", "broadcast_shapes"}


FUSABLE = {"sum", "prod", "amax", "amin", "max", "min"}    # the reductions cupy.fuse traces besides ufuncs


def fusable(what: str) -> None:
    """Refuse `what` inside a cupy.fuse function (counters.paused > 0). CuPy traces a fused function with
    proxies that take elementwise ufuncs, arithmetic and a few reductions: indexing, views, matmul, other
    functions and reading a value back fail there. In-place operators and out= are refused too, stricter
    than CuPy (which updates its inputs in place): the project's fused functions return new arrays."""
    if counters.paused:
        raise StrictnessError(f"cupy.fuse: {what} inside a fused function (only elementwise ufuncs, arithmetic and "
                              "the reductions sum, prod, max, min are fused)")


def host_error(what: str) -> StrictnessError:
    return StrictnessError(f"{what}: a host numpy.ndarray among device arrays (CuPy: Unsupported type "
                           "numpy.ndarray); upload it with cupy.asarray first")


def operand(x, keep: dict, what: str):
    """A ufunc operand: a device array (its NumPy array) or a scalar."""
    if type(x) is ndarray:
        keep[id(x._a)] = x
        return x._a
    if isinstance(x, numpy.ndarray):
        raise host_error(what)
    if isinstance(x, SCALARS) or x is None:
        return x
    raise StrictnessError(f"{what}: unsupported operand type {type(x).__name__}")


def unwrap(x, keep: dict, what: str):
    """Function arguments: device arrays inside lists and tuples too; host arrays refused."""
    if type(x) is ndarray:
        keep[id(x._a)] = x
        return x._a
    if isinstance(x, numpy.ndarray):
        raise host_error(what)
    if type(x) in (list, tuple):
        return type(x)(unwrap(v, keep, what) for v in x)
    return x


def wrap(res, keep: dict, scalars: bool = True):
    """Results back on the device: arrays (the same object for an input handed back), NumPy scalars as 0-d."""
    if isinstance(res, numpy.ndarray):
        known = keep.get(id(res))
        return known if known is not None else ndarray._of(res)
    if isinstance(res, numpy.generic):
        return ndarray._of(numpy.asarray(res))
    if type(res) in (list, tuple):
        return type(res)(wrap(r, keep, False) for r in res)
    if scalars and isinstance(res, (bool, int, float, complex)):
        return ndarray._of(numpy.asarray(res))
    return res


def call(func, args, kwargs, name: str | None = None):
    """func (a NumPy function) on device arguments, as CuPy's function of that name."""
    name = name or func.__name__
    if name not in FUSABLE:
        fusable(f"cupy.{name}")
    keep = {}
    raw = unwrap(tuple(args), keep, name)
    kw = {k: unwrap(v, keep, name) for k, v in kwargs.items()}
    for _ in range(SYNCING.get(name, 0) + (name == "where" and len(args) == 1)):
        counters.sync(name)
    if name not in VIEWS:
        counters.kernel(name)
    return wrap(func(*raw, **kw), keep, scalars=name not in METADATA)


def as_index(key, what: str):
    """The NumPy index for `key`: device index arrays unwrapped, host ones counted as uploads, masks as syncs."""
    parts = key if type(key) is tuple else (key,)
    out, advanced = [], False
    for k in parts:
        if type(k) is ndarray:
            k = k._a
        elif isinstance(k, (numpy.ndarray, list)):
            k = numpy.array(k)
            counters.upload(k.nbytes)                     # CuPy copies a host index to the device
        if isinstance(k, numpy.ndarray) and k.ndim > 0:
            advanced = True
            if k.dtype == bool:
                counters.sync("boolean mask")             # the number of True elements is read back
        out.append(k)
    return (tuple(out) if type(key) is tuple else out[0]), advanced


def assigned(v, what: str):
    if type(v) is ndarray:
        return v._a
    if isinstance(v, (numpy.ndarray, list)):
        v = numpy.array(v)
        counters.upload(v.nbytes)                         # CuPy uploads assigned host values
    return v


def apply_ufunc(ufunc, method: str, inputs, kwargs):
    keep, name = {}, ufunc.__name__
    if method != "__call__":
        fusable(f"{name}.{method}")
    elif "out" in kwargs:
        fusable(f"{name} with out= (or in place)")
    elif name == "matmul":
        fusable(name)
    if method == "at":                                     # ufunc.at(a, indices, b): unbuffered, atomic on a GPU
        target = operand(inputs[0], keep, name)
        raw = (target, as_index(inputs[1], name)[0]) + tuple(assigned(v, name) for v in inputs[2:])
        if target.dtype.kind in "fc":
            counters.atomic(f"{name}.at")
    else:
        raw = tuple(operand(x, keep, name) for x in inputs)
    kw = dict(kwargs)
    if "out" in kw:
        out = kw["out"] if type(kw["out"]) is tuple else (kw["out"],)
        kw["out"] = tuple(operand(o, keep, name) for o in out)
    for k in ("where", "initial"):
        if k in kw:
            kw[k] = operand(kw[k], keep, name)
    counters.kernel(name if method == "__call__" else f"{name}.{method}")
    return wrap(getattr(ufunc, method)(*raw, **kw), keep)
