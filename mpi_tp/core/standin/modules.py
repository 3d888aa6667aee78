"""The fake `cupy` and `cupyx` modules: what mpi_tp asks of CuPy, on stand-in arrays.

cupy.X for any NumPy function or ufunc X runs NumPy's on the arrays' host values
(host arrays refused, results device arrays, each call a counted kernel); asarray
and array upload host data (counted), asnumpy reads back (a counted sync). cupy.cuda
has the runtime (getDeviceCount, which raises on the ranks of settings.fail_ranks),
Device, Stream and Event (their synchronize() a counted sync); cupyx has scatter_add
(float atomics counted) and the pinned allocations (counted, with the bytes still live).
"""
from __future__ import annotations

import time
import types
import weakref

import numpy

from mpi_tp.core.standin.counters import counters
from mpi_tp.core.standin.device import CUDARuntimeError, Device
from mpi_tp.core.standin.dispatch import apply_ufunc, as_index, assigned, call
from mpi_tp.core.standin.ndarray import ndarray
from mpi_tp.core.standin.state import StrictnessError, settings


def _world_rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


class Stream:
    def __init__(self, null=False, non_blocking=False, ptr=0):
        self.null, self.ptr = null, ptr

    def synchronize(self):
        counters.sync("stream.synchronize")

    def use(self):
        Stream.current = self
        return self

    def __enter__(self):
        self._before = Stream.current
        return self.use()

    def __exit__(self, *exc):
        Stream.current = self._before

    @property
    def done(self) -> bool:
        return True

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        pass


Stream.null = Stream.current = Stream(null=True)


class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        counters.sync("event.synchronize")

    @property
    def done(self) -> bool:
        return True


class _Pool:
    """cupy's memory pools, for code that asks them about their bytes (the stand-in keeps none)."""

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def n_free_blocks(self):
        return 0

    def free_all_blocks(self, stream=None):
        pass

    def set_limit(self, size=None, fraction=None):
        pass


class Ufunc:
    """cupy.add, cupy.exp, ...: the NumPy ufunc on device arrays."""

    def __init__(self, uf):
        self._uf, self.__name__, self.nin, self.nout = uf, uf.__name__, uf.nin, uf.nout

    def __call__(self, *args, **kwargs):
        return apply_ufunc(self._uf, "__call__", args, kwargs)

    def __getattr__(self, method):
        if method not in ("reduce", "accumulate", "outer", "at", "reduceat"):
            raise AttributeError(method)
        return lambda *args, **kwargs: apply_ufunc(self._uf, method, args, kwargs)

    def __repr__(self):
        return f"<ufunc 'cupy.{self.__name__}' (stand-in)>"


_MISSING = object()


class _Module(types.ModuleType):
    """A module whose missing names are NumPy's (`source`'s), wrapped for device arrays."""

    def __init__(self, name: str, source):
        super().__init__(name)
        self.__dict__["_source"] = source

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        obj = getattr(self._source, name, _MISSING)
        if obj is _MISSING:
            raise AttributeError(f"module {self.__name__!r} (the stand-in) has no attribute {name!r}")
        if isinstance(obj, numpy.ufunc):
            value = Ufunc(obj)
        elif isinstance(obj, types.ModuleType):
            raise AttributeError(f"{self.__name__}.{name} is not part of the CuPy stand-in")
        elif callable(obj) and not isinstance(obj, type):
            value = (lambda f, n: lambda *args, **kwargs: call(f, args, kwargs, n))(obj, name)
            value.__name__ = name
        else:
            value = obj                                   # dtypes, scalar types, constants
        setattr(self, name, value)
        return value


def _leaves(obj):
    if type(obj) in (list, tuple):
        for o in obj:
            yield from _leaves(o)
    else:
        yield obj


def asarray(a, dtype=None, order=None, *, blocking=False):
    """A device array: `a` itself when it is one (cast if dtype differs), built on the device from a
    sequence of device arrays (and scalars), else an upload of host data."""
    if type(a) is ndarray:
        return a if dtype is None or numpy.dtype(dtype) == a.dtype else a.astype(dtype)
    if type(a) in (list, tuple) and any(type(v) is ndarray for v in _leaves(a)):
        return call(numpy.array, (a,), {"dtype": dtype}, "array")     # host arrays among them: refused
    host = numpy.array(a, dtype=dtype, order=order or "K", copy=True)   # the device never aliases host memory
    counters.upload(host.nbytes)
    return ndarray._of(host)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if type(obj) is ndarray:
        out = obj.astype(dtype or obj.dtype, order=order, copy=True) if copy else asarray(obj, dtype)
        return out.reshape((1,) * (ndmin - out.ndim) + out.shape) if ndmin > out.ndim else out
    return asarray(numpy.array(obj, dtype=dtype, order=order, ndmin=ndmin), dtype)


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if type(a) is ndarray:
        return a.get(stream=stream, order=order, out=out)
    return numpy.asarray(a, order=order)


def get_array_module(*args):
    return cupy if any(type(a) is ndarray for a in args) else numpy


def fuse(*args, **kwargs):
    """cupy.fuse: the function runs as is, counted as one kernel, refusing what CuPy's tracing cannot fuse
    (dispatch.fusable: indexing, views, matmul, in-place updates, reading values)."""
    def decorate(f):
        def fused(*a, **kw):
            counters.paused += 1
            try:
                return f(*a, **kw)
            finally:
                counters.paused -= 1
                counters.kernel(f"fuse:{f.__name__}")
        fused.__name__ = f.__name__
        return fused
    return decorate(args[0]) if len(args) == 1 and callable(args[0]) and not kwargs else decorate


def scatter_add(a, slices, value):
    """cupyx.scatter_add: a[slices] += value with repeated indices summed (atomics: floats race on a GPU)."""
    if type(a) is not ndarray:
        raise StrictnessError("cupyx.scatter_add: the target must be a device array")
    k, _ = as_index(slices, "scatter_add")
    if a.dtype.kind in "fc":
        counters.atomic("cupyx.scatter_add")
    counters.kernel("scatter_add")
    numpy.add.at(a._a, k, assigned(value, "scatter_add"))


def empty_pinned(shape, dtype=float, order="C"):
    """A host (NumPy) array in 'page-locked' memory: counted, and its bytes live until it is freed."""
    out = numpy.empty(shape, dtype, order=order)
    counters.pinned(out.nbytes)
    weakref.finalize(out, counters.pinned_freed, out.nbytes)
    return out


def zeros_pinned(shape, dtype=float, order="C"):
    out = empty_pinned(shape, dtype, order)
    out[...] = 0
    return out


def _build():
    cupy = _Module("cupy", numpy)
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.ModuleType("cupy.cuda.runtime")

    def get_device_count():
        if _world_rank() in settings.fail_ranks:
            raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected (the stand-in "
                                   "fails on this rank on purpose: settings.fail_ranks)")
        return settings.devices

    runtime.__dict__.update(getDeviceCount=get_device_count, getDevice=lambda: Device.current,
                            setDevice=lambda i: Device(i).use(), CUDARuntimeError=CUDARuntimeError, is_hip=False,
                            getDeviceProperties=lambda i: {"name": b"CuPy stand-in (host memory)",
                                                           "totalGlobalMem": 0},
                            runtimeGetVersion=lambda: 0, driverGetVersion=lambda: 0)
    cuda.__dict__.update(runtime=runtime, Device=Device, Stream=Stream, Event=Event,
                         get_current_stream=lambda device=None: Stream.current, is_available=lambda: True,
                         get_elapsed_time=lambda start, end: (end.t - start.t) * 1e3)
    pool, pinned_pool = _Pool(), _Pool()
    cupy.__dict__.update(ndarray=ndarray, asarray=asarray, array=array, asnumpy=asnumpy, cuda=cuda,
                         get_array_module=get_array_module, fuse=fuse, linalg=_Module("cupy.linalg", numpy.linalg),
                         get_default_memory_pool=lambda: pool,
                         get_default_pinned_memory_pool=lambda: pinned_pool, __version__="0+standin",
                         __standin__=True, __file__=__file__)
    cupyx = types.ModuleType("cupyx")
    cupyx.__dict__.update(scatter_add=scatter_add, empty_pinned=empty_pinned, zeros_pinned=zeros_pinned,
                          empty_like_pinned=lambda a, dtype=None: empty_pinned(a.shape, dtype or a.dtype),
                          zeros_like_pinned=lambda a, dtype=None: zeros_pinned(a.shape, dtype or a.dtype),
                          __standin__=True)
    return cupy, cuda, runtime, cupyx


cupy, cuda, runtime, cupyx = _build()
MODULES = {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.linalg": cupy.linalg,
           "cupyx": cupyx}
