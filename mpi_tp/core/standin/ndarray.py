"""The stand-in's device array: a NumPy array kept out of reach of anything that expects host memory.

Like cupy.ndarray it refuses implicit conversion (numpy.asarray, numpy.array, the
buffer protocol: "Implicit conversion to a NumPy array is not allowed"), refuses host
NumPy arrays as operands of its arithmetic and functions, and answers every
operation (arithmetic, ufuncs, NumPy functions through __array_ufunc__ and
__array_function__, methods, indexing, reductions, which return 0-d arrays, not
scalars) with another device array. Reading a value on the host (float(), int(),
bool(), .item(), .tolist(), printing) is a counted sync; so are the syncs CuPy makes
on its own, for outputs whose size depends on the data (a boolean mask, nonzero,
bincount). Host data that CuPy uploads silently (index arrays, values assigned) is a
counted upload. Stricter than CuPy: no pickling, no __index__, bool() of an empty array.
"""
from __future__ import annotations

import numpy

from mpi_tp.core.standin.counters import counters
from mpi_tp.core.standin.state import StrictnessError, device_buffer

_SCALARS = (bool, int, float, complex, numpy.generic)
# outputs whose size depends on the data: CuPy reads a count back from the device (syncs)
SYNCING = {"nonzero": 1, "flatnonzero": 1, "argwhere": 1, "unique": 1, "compress": 1, "extract": 1, "bincount": 2}
VIEWS = {"reshape", "transpose", "swapaxes", "moveaxis", "squeeze", "expand_dims", "broadcast_to", "broadcast_arrays",
         "ravel", "view", "atleast_1d", "atleast_2d", "shape", "ndim", "size", "result_type", "can_cast", "isscalar"}
METADATA = {"shape", "ndim", "size", "result_type", "can_cast", "min_scalar_type", "iscomplexobj", "isrealobj",
            "isscalar", "may_share_memory", "shares_memory", "broadcast_shapes"}


def _host_error(what: str) -> StrictnessError:
    return StrictnessError(f"{what}: a host numpy.ndarray among device arrays (CuPy: Unsupported type "
                           "numpy.ndarray); upload it with cupy.asarray first")


def _operand(x, keep: dict, what: str):
    """A ufunc operand: a device array (its NumPy array) or a scalar."""
    if type(x) is ndarray:
        keep[id(x._a)] = x
        return x._a
    if isinstance(x, numpy.ndarray):
        raise _host_error(what)
    if isinstance(x, _SCALARS) or x is None:
        return x
    raise StrictnessError(f"{what}: unsupported operand type {type(x).__name__}")


def _unwrap(x, keep: dict, what: str):
    """Function arguments: device arrays inside lists and tuples too; host arrays refused."""
    if type(x) is ndarray:
        keep[id(x._a)] = x
        return x._a
    if isinstance(x, numpy.ndarray):
        raise _host_error(what)
    if type(x) in (list, tuple):
        return type(x)(_unwrap(v, keep, what) for v in x)
    return x


def _wrap(res, keep: dict, scalars: bool = True):
    """Results back on the device: arrays (the same object for an input handed back), NumPy scalars as 0-d."""
    if isinstance(res, numpy.ndarray):
        known = keep.get(id(res))
        return known if known is not None else ndarray._of(res)
    if isinstance(res, numpy.generic):
        return ndarray._of(numpy.asarray(res))
    if type(res) in (list, tuple):
        return type(res)(_wrap(r, keep, False) for r in res)
    if scalars and isinstance(res, (bool, int, float, complex)):
        return ndarray._of(numpy.asarray(res))
    return res


def call(func, args, kwargs, name: str | None = None):
    """func (a NumPy function) on device arguments, as CuPy's function of that name."""
    name = name or func.__name__
    keep = {}
    raw = _unwrap(tuple(args), keep, name)
    kw = {k: _unwrap(v, keep, name) for k, v in kwargs.items()}
    for _ in range(SYNCING.get(name, 0) + (name == "where" and len(args) == 1)):
        counters.sync(name)
    if name not in VIEWS:
        counters.kernel(name)
    return _wrap(func(*raw, **kw), keep, scalars=name not in METADATA)


def _index(key, what: str):
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


def _value(v, what: str):
    if type(v) is ndarray:
        return v._a
    if isinstance(v, (numpy.ndarray, list)):
        v = numpy.array(v)
        counters.upload(v.nbytes)                         # CuPy uploads assigned host values
    return v


def _ufunc(ufunc, method: str, inputs, kwargs):
    keep, name = {}, ufunc.__name__
    if method == "at":                                     # ufunc.at(a, indices, b): unbuffered, atomic on a GPU
        target = _operand(inputs[0], keep, name)
        raw = (target, _index(inputs[1], name)[0]) + tuple(_value(v, name) for v in inputs[2:])
        if target.dtype.kind in "fc":
            counters.atomic(f"{name}.at")
    else:
        raw = tuple(_operand(x, keep, name) for x in inputs)
    kw = dict(kwargs)
    if "out" in kw:
        out = kw["out"] if type(kw["out"]) is tuple else (kw["out"],)
        kw["out"] = tuple(_operand(o, keep, name) for o in out)
    for k in ("where", "initial"):
        if k in kw:
            kw[k] = _operand(kw[k], keep, name)
    counters.kernel(name if method == "__call__" else f"{name}.{method}")
    return _wrap(getattr(ufunc, method)(*raw, **kw), keep)


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
        from mpi_tp.core.standin.modules import Device
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
            counters.sync("get", self.nbytes)
            return numpy.array(self._a, order=order)
        if not isinstance(out, numpy.ndarray):
            raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
        if out.dtype != self.dtype:
            raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
        if out.shape != self.shape:
            raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}")
        counters.sync("get", self.nbytes)
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
        return _ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return call(func, args, kwargs)

    def __getitem__(self, key):
        k, advanced = _index(key, "getitem")
        res = self._a[k]
        if isinstance(res, numpy.generic):               # CuPy gives a 0-d view, not a scalar
            res = self._a[(k if type(k) is tuple else (k,)) + (Ellipsis,)]
        if advanced:
            counters.kernel("take")
        return ndarray._of(res)

    def __setitem__(self, key, value):
        k, _ = _index(key, "setitem")
        counters.kernel("setitem")
        self._a[k] = _value(value, "setitem")


def _method(name: str):
    def method(self, *args, **kwargs):
        keep = {id(self._a): self}
        raw = _unwrap(args, keep, name)
        kw = {k: _unwrap(v, keep, name) for k, v in kwargs.items()}
        for _ in range(SYNCING.get(name, 0)):
            counters.sync(name)
        if name not in VIEWS:
            counters.kernel(name)
        return _wrap(getattr(self._a, name)(*raw, **kw), keep)
    method.__name__ = method.__qualname__ = name
    return method


for _name in ("reshape", "transpose", "swapaxes", "squeeze", "ravel", "flatten", "view", "astype", "copy", "fill",
              "sum", "mean", "max", "min", "prod", "cumsum", "cumprod", "argmax", "argmin", "argsort", "sort", "all",
              "any", "var", "std", "clip", "dot", "round", "conj", "take", "repeat", "nonzero", "diagonal", "trace",
              "put", "partition", "argpartition", "searchsorted"):
    setattr(ndarray, _name, _method(_name))


def _operators(ufunc):
    def op(self, other):
        if not isinstance(other, (ndarray, numpy.ndarray) + _SCALARS):
            return NotImplemented                        # e.g. x == None: Python falls back to identity
        return _ufunc(ufunc, "__call__", (self, other), {})

    def rop(self, other):
        return _ufunc(ufunc, "__call__", (other, self), {})

    def iop(self, other):
        _ufunc(ufunc, "__call__", (self, other), {"out": (self,)})
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
    setattr(ndarray, f"__{_name}__", (lambda uf: lambda self: _ufunc(uf, "__call__", (self,), {}))(_uf))
