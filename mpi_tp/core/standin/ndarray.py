"""The stand-in's device array: a NumPy array kept out of reach of anything that expects host memory.

Like cupy.ndarray it refuses implicit conversion (numpy.asarray, numpy.array, the
buffer protocol: "Implicit conversion to a NumPy array is not allowed") and answers
every operation (arithmetic, ufuncs, NumPy functions through __array_ufunc__ and
__array_function__, methods, indexing, reductions, which return 0-d arrays, not
scalars) with another device array; the calls are translated by .dispatch, which
also refuses host arrays as operands. Reading a value on the host (float(), int(),
bool(), .item(), .tolist(), printing, .get()) is a counted sync, .set() a counted
upload. Stricter than CuPy: no pickling, no __index__, no bool() of an empty array.
Inside a cupy.fuse function only elementwise ufuncs, arithmetic and sum/prod/max/min
are taken (dispatch.fusable). The buffer MPI may take: .state.device_buffer.
"""
from __future__ import annotations

import numpy

from mpi_tp.core.standin import dispatch
from mpi_tp.core.standin.counters import counters
from mpi_tp.core.standin.device import Device
from mpi_tp.core.standin.dispatch import (
    FUSABLE,
    SYNCING,
    VIEWS,
    apply_ufunc,
    as_index,
    assigned,
    call,
    fusable,
    unwrap,
    wrap,
)
from mpi_tp.core.standin.state import StrictnessError, device_buffer


class ndarray:
    """A device array of the stand-in (see the module's docstring); `_a` holds its values."""

    __slots__ = ("_a", "__weakref__")
    __module__ = "cupy"
    __hash__ = None

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        self._a = numpy.empty(shape, dtype, order=order)

    @classmethod
    def _of(cls, a: numpy.ndarray) -> "ndarray":
        obj = object.__new__(cls)
        obj._a = a
        return obj

    # -- what CuPy refuses -----------------------------------------------------------------

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct "
                        "a NumPy array explicitly.")

    def __reduce_ex__(self, protocol):
        raise StrictnessError("a device array is not pickled: copy it to the host (asnumpy) first")

    @property
    def __cuda_array_interface__(self):
        return device_buffer(self)

    # -- layout ----------------------------------------------------------------------------

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray._of(self._a.T))

    @property
    def device(self):
        return Device(0)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self._a)))

    # -- host <-> device -------------------------------------------------------------------

    def get(self, stream=None, order="C", out=None, blocking=True):
        """A host copy (into `out`, a NumPy array of the same shape and dtype): a device-to-host sync."""
        if out is None:
            counters.sync("get", self.nbytes, blocking)
            return numpy.array(self._a, order=order)
        if not isinstance(out, numpy.ndarray):
            raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
        if out.dtype != self.dtype:
            raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
        if out.shape != self.shape:
            raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}")
        counters.sync("get", self.nbytes, blocking)
        out[...] = self._a
        return out

    def set(self, arr, stream=None):
        """Copy host array `arr` (same shape and dtype) into this array: a host-to-device upload."""
        if not isinstance(arr, numpy.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        counters.upload(arr.nbytes)
        self._a[...] = arr

    def _read(self, reason: str):
        fusable(f"reading a value ({reason})")
        counters.sync(reason, self.nbytes)
        return self._a

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self._read("item").item()

    def tolist(self):
        return self._read("tolist").tolist()

    def tobytes(self, order="C"):
        return self._read("tobytes").tobytes(order)

    def _scalar(self, reason: str):
        if self.size != 1:
            raise TypeError(f"only size-1 arrays can be converted to Python scalars (shape {self.shape})")
        return self._read(reason).item()

    def __float__(self):
        return float(self._scalar("float"))

    def __int__(self):
        return int(self._scalar("int"))

    def __complex__(self):
        return complex(self._scalar("complex"))

    def __bool__(self):
        if self.size != 1:
            raise ValueError(f"The truth value of an array with {self.size} elements is ambiguous (the stand-in "
                             "refuses empty arrays too). Use a.any() or a.all()")
        return bool(self._read("bool").item())

    def __repr__(self):
        return repr(self._read("repr"))

    def __str__(self):
        return str(self._read("str"))

    def __format__(self, spec):
        return format(self._read("format").item() if self.ndim == 0 else self._read("format"), spec)

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    # -- NumPy's protocols -----------------------------------------------------------------

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return apply_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return call(func, args, kwargs)

    def __getitem__(self, key):
        fusable("indexing")
        k, advanced = as_index(key, "getitem")
        res = self._a[k]
        if isinstance(res, numpy.generic):               # CuPy gives a 0-d view, not a scalar
            res = self._a[(k if type(k) is tuple else (k,)) + (Ellipsis,)]
        if advanced:
            counters.kernel("take")
        return ndarray._of(res)

    def __setitem__(self, key, value):
        fusable("assignment into an array")
        k, _ = as_index(key, "setitem")
        counters.kernel("setitem")
        self._a[k] = assigned(value, "setitem")


dispatch.ndarray = ndarray


def _method(name: str):
    def method(self, *args, **kwargs):
        if name not in FUSABLE:
            fusable(f"ndarray.{name}")
        keep = {id(self._a): self}
        raw = unwrap(args, keep, name)
        kw = {k: unwrap(v, keep, name) for k, v in kwargs.items()}
        for _ in range(SYNCING.get(name, 0)):
            counters.sync(name)
        if name not in VIEWS:
            counters.kernel(name)
        return wrap(getattr(self._a, name)(*raw, **kw), keep)
    method.__name__ = method.__qualname__ = name
    return method


for _name in ("reshape", "transpose", "swapaxes", "squeeze", "ravel", "flatten", "view", "astype", "copy", "fill",
              "sum", "mean", "max", "min", "prod", "cumsum", "cumprod", "argmax", "argmin", "argsort", "sort", "all",
              "any", "var", "std", "clip", "dot", "round", "conj", "take", "repeat", "nonzero", "diagonal", "trace",
              "put", "partition", "argpartition", "searchsorted"):
    setattr(ndarray, _name, _method(_name))


def _operators(ufunc):
    def op(self, other):
        if not isinstance(other, (ndarray, numpy.ndarray) + dispatch.SCALARS):
            return NotImplemented                        # e.g. x == None: Python falls back to identity
        return apply_ufunc(ufunc, "__call__", (self, other), {})

    def rop(self, other):
        return apply_ufunc(ufunc, "__call__", (other, self), {})

    def iop(self, other):
        apply_ufunc(ufunc, "__call__", (self, other), {"out": (self,)})
        return self
    return op, rop, iop


for _name, _uf in (("add", numpy.add), ("sub", numpy.subtract), ("mul", numpy.multiply), ("matmul", numpy.matmul),
                   ("truediv", numpy.true_divide), ("floordiv", numpy.floor_divide), ("mod", numpy.remainder),
                   ("pow", numpy.power), ("and", numpy.bitwise_and), ("or", numpy.bitwise_or),
                   ("xor", numpy.bitwise_xor), ("lshift", numpy.left_shift), ("rshift", numpy.right_shift)):
    _op, _rop, _iop = _operators(_uf)
    setattr(ndarray, f"__{_name}__", _op)
    setattr(ndarray, f"__r{_name}__", _rop)
    setattr(ndarray, f"__i{_name}__", _iop)
for _name, _uf in (("eq", numpy.equal), ("ne", numpy.not_equal), ("lt", numpy.less), ("le", numpy.less_equal),
                   ("gt", numpy.greater), ("ge", numpy.greater_equal)):
    setattr(ndarray, f"__{_name}__", _operators(_uf)[0])
for _name, _uf in (("neg", numpy.negative), ("pos", numpy.positive), ("abs", numpy.absolute),
                   ("invert", numpy.invert)):
    setattr(ndarray, f"__{_name}__", (lambda uf: lambda self: apply_ufunc(uf, "__call__", (self,), {}))(_uf))
