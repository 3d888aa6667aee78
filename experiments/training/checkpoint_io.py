"""Checkpoint save and load speed, next to the raw speed of the same disk in the same run.

    mpiexec -n 2 python -m mpi4py experiments/training/checkpoint_io.py                  # table on rank 0
    mpiexec -n 1 python -m mpi4py experiments/training/checkpoint_io.py --json --dir /scratch/me

Builds a GPT with AdamW state (weights + m + v, float32; the defaults give about
340 MB of checkpoint), then times, as the median of --repeats runs:

    save          mpi_tp.checkpoint.save into a fresh root (shards, SHA-256, index, renames)
    load          Checkpoint(root) + load_into(model, optimizer), from the page cache (warm)
                  and after evicting the files from it (cold, posix_fadvise DONTNEED)
    raw write     the same bytes per rank, written concurrently with plain file writes + fsync
    raw read      those files read back, warm and cold
    sha256        each rank hashing its own shard (a part of save)

MB/s is all bytes of all ranks over the wall time of the slowest rank. "Cold"
only evicts this machine's page cache: a VM's host or a network filesystem may
still cache. Everything written under --dir is removed at the end.
"""
import argparse
import hashlib
import json
import os
import shutil
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpi_tp import checkpoint as ckpt
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW

COMM = MPI.COMM_WORLD
BLOCK = 64 << 20                     # raw I/O buffer: 64 MiB


def timed(fn):
    """Wall seconds of fn on the slowest rank (barriers on both sides)."""
    COMM.Barrier()
    t = time.perf_counter()
    fn()
    COMM.Barrier()
    return COMM.allreduce(time.perf_counter() - t, op=MPI.MAX)


def evict(paths):
    """Drop the files' (clean, fsynced) pages from this machine's page cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def raw_write(path, nbytes, buf):
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(buf)[:min(left, buf.nbytes)])
        os.fsync(f.fileno())


def raw_read(path, buf):
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def filesystem(path):
    """(mount point, type, device, free GB) of the filesystem holding path, from /proc/mounts and statvfs."""
    path, best = os.path.realpath(path), ("?", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, kind = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, kind, dev)
    except OSError:
        pass
    st = os.statvfs(path)
    return {"mount": best[0], "type": best[1], "device": best[2], "free_gb": st.f_bavail * st.f_frsize / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp", help="where to write (a scratch folder is made inside)")
    ap.add_argument("--json", action="store_true", help="one JSON line per measurement instead of a table")
    args = ap.parse_args()
    rank, size = COMM.Get_rank(), COMM.Get_size()

    topo = Topology.create(COMM)
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg, topo, dtype="float32")
    opt = AdamW(model.parameters())
    rng = np.random.default_rng(rank)
    for m, v in zip(opt.m, opt.v):             # non-trivial optimizer state (zeros would be unrealistic)
        m[...] = rng.standard_normal(m.shape, dtype=np.float32) * 1e-3
        v[...] = np.abs(m) * 1e-3
    opt.t = 1
    meta = {"config": cfg.to_dict(), "optimizer_t": opt.t}

    scratch = COMM.bcast(os.path.join(args.dir, f"ckio-{os.getpid()}") if rank == 0 else None)
    if rank == 0:
        os.makedirs(scratch)
    COMM.Barrier()
    times = {k: [] for k in ("save", "load_warm", "load_cold", "sha256",
                             "raw_write", "raw_read_warm", "raw_read_cold")}
    buf = np.random.default_rng(100 + rank).integers(0, 256, BLOCK, dtype=np.uint8)
    try:
        step_dir, shard_bytes = None, 0
        for i in range(args.repeats):
            if step_dir is not None and rank == 0:
                shutil.rmtree(os.path.dirname(step_dir))          # a fresh root for every save
            root = os.path.join(scratch, f"root-{i}")
            times["save"].append(timed(lambda: ckpt.save(root, 1, model, opt, meta)))
            step_dir = os.path.join(root, ckpt.step_dir_name(1))
            files = [os.path.join(step_dir, n) for n in sorted(os.listdir(step_dir))]
            mine = os.path.join(step_dir, ckpt.shard_name(topo.tp.rank, topo.tp.size))
            shard_bytes = os.path.getsize(mine)

            def load():
                with ckpt.Checkpoint(root) as c:
                    ckpt.load_into(c, model, opt)
            times["load_warm"].append(timed(load))
            evict(files)
            times["load_cold"].append(timed(load))
            times["sha256"].append(timed(lambda: sha256(mine)))

            raw = os.path.join(scratch, f"raw-{rank}.bin")       # same bytes as this rank's shard
            times["raw_write"].append(timed(lambda: raw_write(raw, shard_bytes, buf)))
            times["raw_read_warm"].append(timed(lambda: raw_read(raw, buf)))
            evict([raw])
            times["raw_read_cold"].append(timed(lambda: raw_read(raw, buf)))
            COMM.Barrier()
            os.remove(raw)
        ckpt_bytes = COMM.bcast(sum(os.path.getsize(p) for p in files) if rank == 0 else None)
        raw_bytes = COMM.allreduce(shard_bytes)
    finally:
        COMM.Barrier()
        if rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)

    if rank != 0:
        return
    fs = filesystem(args.dir)
    common = {"ranks": size, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "params": model.num_params(),
              "dir": args.dir, "fs": fs, "repeats": args.repeats}
    rows = []
    for k, ts in times.items():
        nbytes = raw_bytes if k.startswith("raw") or k == "sha256" else ckpt_bytes
        t = statistics.median(ts)
        rows.append({"what": k, "bytes": nbytes, "seconds": t, "mb_per_s": nbytes / t / 1e6,
                     "all_seconds": ts, **common})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{size} rank(s), GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd}: {model.num_params():,} parameters; "
          f"checkpoint {ckpt_bytes / 1e6:.1f} MB (shards {raw_bytes / 1e6:.1f} MB, weights + AdamW m, v)")
    print(f"dir {args.dir} on {fs['mount']} ({fs['type']}, {fs['device']}, {fs['free_gb']:.0f} GB free); "
          f"median of {args.repeats}")
    print(f"{'':<15} {'MB':>8} {'s':>8} {'MB/s':>8}")
    for r in rows:
        print(f"{r['what']:<15} {r['bytes'] / 1e6:>8.1f} {r['seconds']:>8.3f} {r['mb_per_s']:>8.0f}")


if __name__ == "__main__":
    main()
