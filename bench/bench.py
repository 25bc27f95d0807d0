#!/usr/bin/python3
"""birchfs benchmark harness: `make bench` (full) and `make bench-quick`.

What it does
------------
Compares birchfs with the kernel filesystems on the same disk and the same layers:

  target        what                                                     device counter
  btrfs         kernel btrfs, mount -o ssd,nodiscard, on a loop device   loop sectors
  ext4          kernel ext4 (mkfs defaults), on a loop device            loop sectors
  ext4-fc       ext4 made with -O fast_commit, on a loop device          loop sectors
  xfs           kernel XFS (mkfs defaults), on a loop device             loop sectors
  birchfs-loop  birchfs through FUSE on a loop device (the fair row)     daemon stats
  birchfs-file  birchfs through FUSE on a plain image file               daemon stats
  birchfs-folio birchfs-file mounted -o block_dirty=off (whole-folio      daemon stats
                dirty tracking; W3 only, the seed-5 comparison)
  birchfs-sparse birchfs-file on a fresh sparse image file (what a plain   daemon stats
                `birchfs mkfs IMAGE` makes; W3 only, to show what holes cost)
  birchfs-uring birchfs-file mounted -o uring=on (FUSE requests through   daemon stats
                io_uring queues instead of /dev/fuse; W1, W3, W4, W5)
  raw           a directory of the host filesystem, no loop (the limit)  none
  fuse-floor    libfuse's passthrough_ll example (-o writeback, like     loop sectors
                birchfs) over ext4 on a loop device (the FUSE floor)      (of the ext4)
  fuse-null     examples/nullfs.rs: a FUSE filesystem that stores         none
                nothing (fsync returns at once), mounted as birchfs is:
                the most any filesystem served through /dev/fuse can reach
                here (the FUSE ceiling; W1, W3, W4 and W5 writes)
  fuse-null-flush the same, each fsync also writing a 4 KiB block of a    none
                file beside the image and flushing it (one host fdatasync
                per fsync, no group commit: what a kernel filesystem pays)

Every target but raw and birchfs-sparse uses one image file in the work directory
(same disk as the repository), written with zeros (whole once, and before each use
wherever the host holds it unwritten again), so that its blocks are
allocated on the host as a disk's are: on a sparse file, every write into a hole
makes the host allocate and commit its own journal before a flush returns, a cost
that falls on copy-on-write filesystems (which write new blocks all the time) and
not on a real disk. Kernel filesystems see it through `losetup --direct-io=on`, are
made and mounted without discard (mkfs.ext4 -E nodiscard, mkfs.xfs -K, mkfs.btrfs
-K, btrfs -o nodiscard) so that the loop device does not punch holes back into it;
birchfs-file uses it directly. A fresh filesystem is made for every run (every
workload variant, target and repetition).

Workloads (fio job templates in bench/jobs/, sizes from the profile below):
  W1  seed 1: randwrite bs=4k fsync=4 ioengine=sync direct=0 fallocate=none,
      numjobs 1, 2, 4, 8, BENCH_SIZE per job
  W2  seed 2: randwrite, bssplit 4k..1m, fsync=8, psync, thread, 4 jobs, time-based
  W3  seed 5: randwrite bs=4k overwrite=1 pre_read=1 fdatasync=1 psync, 4 jobs,
      time-based; write amplification = device bytes written / bytes fio wrote
  W5  sequential: one file of W5_SIZE written in 1 MiB writes + fsync; and read
      back after a remount (every target is unmounted and mounted again, so no
      cache of the filesystem's own survives) and drop_caches
  W4  seeds 3, 4: fs_mark-style creates of empty files (target/release/fsmark,
      src/bin/fsmark.rs): D directories x F files with an fsync per file, and a
      no-fsync run of 2 threads x N files each
For W2 and W3 the files are laid out first (fio create_only=1), outside the
measurement. Before every measured run: sync, echo 3 > /proc/sys/vm/drop_caches, read
the device counters; after it: sync -f on the mount, read them again.

Order: for each workload variant, the targets run interleaved (A B C D ... A B C D ...),
`reps` times; variants marked `interleave` (W2-snap) run in the same rounds as the
variant before them, so the two are compared in the same stretch of time. The report
gives median and min-max over the repetitions.

Output (bench/results/ for full, bench/results/quick/ for quick):
  REPORT.md           tables (workload x filesystem, birchfs / best kernel fs), machine
  results.json        every run: metrics, fio's JSON, fsmark's JSON, birchfs stats deltas
  throughput.png      MiB/s per fio workload
  fsync_latency.png   fsync latency p50/p90/p99 per workload
  files_per_s.png     W4 files/s as directories x files grow, and within the largest run

Usage (as root; the Makefile builds target/release first):
  make bench | make bench-quick
  /usr/bin/python3 bench/bench.py --profile quick [--reps N] [--work DIR]
  /usr/bin/python3 bench/bench.py --profile quick --report-only   # redo REPORT/PNGs
  --targets/--workloads restrict a run for debugging (the report then says so).

Installs what is missing with apt-get (fio, btrfs-progs, xfsprogs, e2fsprogs, fuse3,
libfuse3-dev, gcc, pkg-config, python3-matplotlib) and compiles passthrough_ll from
/usr/share/doc/libfuse3-dev/examples with gcc and pkg-config fuse3.

Cleanup: every mount and loop device it makes is undone when a run ends, fails, or the
harness gets SIGINT/SIGTERM/SIGHUP. At start it unmounts anything still mounted under
its own work directory, stops leftover daemons whose command line names that directory,
and detaches loop devices backed by files in it; nothing else is touched.
"""

import argparse
import datetime
import fcntl
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import threading
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "bench" / "jobs"
BIRCHFS = REPO / "target" / "release" / "birchfs"
FSMARK = REPO / "target" / "release" / "fsmark"
NULLFS = REPO / "target" / "release" / "examples" / "nullfs"
FUSE_EXAMPLES = Path("/usr/share/doc/libfuse3-dev/examples")

MiB = 1 << 20
# ext4 otherwise zeroes inode tables and journal in the background after mount
# (ext4lazyinit), which would add device writes and load to the measured runs.
EXT4_NOLAZY = ["-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard"]

PROFILES = {
    "full": {
        "out": "bench/results",
        "reps": 3,
        "image_size": "8G",
        "w1_size": "64M",
        "w1_jobs": [1, 2, 4, 8],
        "w1_cap_s": 240,
        "w2_size": "512M",
        "w2_runtime": 30,
        "snap_every_s": 10,
        "w3_size": "256M",
        "w3_runtime": 30,
        "w4_fsync_threads": 4,
        "w4_fsync": [[4, 1000], [64, 256], [64, 1024]],
        "w4_nofsync": {"threads": 2, "files_per_thread": 100000, "dirs": 2},
        "w4_cap_s": 240,
        "w5_size": "4G",
    },
    "quick": {
        "out": "bench/results/quick",
        "reps": 2,
        "image_size": "8G",
        "w1_size": "8M",
        "w1_jobs": [1, 2, 4, 8],
        "w1_cap_s": 30,
        "w2_size": "16M",
        "w2_runtime": 3,
        "snap_every_s": 1,
        "w3_size": "16M",
        "w3_runtime": 3,
        "w4_fsync_threads": 4,
        "w4_fsync": [[2, 100], [8, 64], [8, 128]],
        "w4_nofsync": {"threads": 2, "files_per_thread": 5000, "dirs": 2},
        "w4_cap_s": 60,
        "w5_size": "256M",
    },
}

TARGETS = ["btrfs", "ext4", "ext4-fc", "xfs", "birchfs-loop", "birchfs-file", "birchfs-folio",
           "birchfs-sparse", "birchfs-uring", "raw", "fuse-floor", "fuse-null",
           "fuse-null-flush"]
KERNEL = ["btrfs", "ext4", "ext4-fc", "xfs"]
BIRCH = ["birchfs-loop", "birchfs-file", "birchfs-folio", "birchfs-sparse", "birchfs-uring"]
# Targets that can take snapshots (the W2-snap variant runs on these only).
SNAPSHOT_TARGETS = ["btrfs", "birchfs-loop", "birchfs-file"]
# Targets that run only for some workloads (or variants, by id).
ONLY_FOR = {"birchfs-folio": {"W3"}, "birchfs-sparse": {"W3"},
            "birchfs-uring": {"W1", "W3", "W4", "W5"},
            # It keeps no data, so nothing survives W5's remount for W5-read; W5-write
            # shows what the kernel's cached FUSE writes allow.
            "fuse-null": {"W1", "W3", "W4", "W5-write"}, "fuse-null-flush": {"W1", "W3", "W4"}}


def runs_on(t, v):
    """Whether target `t` runs variant `v`: see ONLY_FOR, and a variant with targets
    of its own (W2 with snapshots) runs on those only."""
    only = ONLY_FOR.get(t)
    return ((only is None or v["workload"] in only or v["id"] in only)
            and t in v.get("targets", [t]))


LABELS = {
    "btrfs": "btrfs -o ssd",
    "ext4": "ext4",
    "ext4-fc": "ext4 fast_commit",
    "xfs": "XFS",
    "birchfs-loop": "birchfs (loop)",
    "birchfs-file": "birchfs (file)",
    "birchfs-folio": "birchfs (file) block_dirty=off",
    "birchfs-sparse": "birchfs (file) sparse image",
    "birchfs-uring": "birchfs (file) uring=on",
    "raw": "raw host dir",
    "fuse-floor": "FUSE floor",
    "fuse-null": "FUSE ceiling (nullfs)",
    "fuse-null-flush": "FUSE ceiling + a flush per fsync",
}
COLORS = {
    "btrfs": "#1f77b4",
    "ext4": "#2ca02c",
    "ext4-fc": "#98df8a",
    "xfs": "#9467bd",
    "birchfs-loop": "#d62728",
    "birchfs-file": "#ff9896",
    "birchfs-folio": "#8c564b",
    "birchfs-sparse": "#e377c2",
    "birchfs-uring": "#ff7f0e",
    "raw": "#7f7f7f",
    "fuse-floor": "#bcbd22",
    "fuse-null": "#17becf",
    "fuse-null-flush": "#9edae5",
}


class Interrupted(Exception):
    pass


class RunError(Exception):
    pass


class Skipped(Exception):
    """A run that cannot be done on this machine (the reason goes into the report)."""


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- processes

CHILDREN = set()  # Popen objects of running children, for cleanup on a signal


def run(cmd, check=True, capture=True, timeout=None, env=None):
    """Runs cmd; returns CompletedProcess. Tracks the child so a signal can end it."""
    p = subprocess.Popen(
        [str(c) for c in cmd],
        stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
        stderr=subprocess.PIPE if capture else subprocess.DEVNULL,
        text=True,
        env=env,
    )
    CHILDREN.add(p)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise RunError(f"timed out after {timeout}s: {' '.join(map(str, cmd))}")
    except BaseException:
        # Interrupted: end the child before the mounts under it are torn down.
        p.terminate()
        try:
            p.wait(timeout=10)
        except BaseException:
            p.kill()
        raise
    finally:
        CHILDREN.discard(p)
    if check and p.returncode != 0:
        e = (err or "").strip()
        if len(e) > 2000:
            e = e[:1000] + "\n...\n" + e[-1000:]
        raise RunError(f"exit {p.returncode}: {' '.join(map(str, cmd))}\n{e}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def kill_children():
    for p in list(CHILDREN):
        try:
            p.terminate()
            p.wait(timeout=5)
        except Exception:
            try:
                p.kill()
            except Exception:
                pass


def lock_free(path):
    """Whether no process holds an flock on path (a birchfs daemon locks its image)."""
    try:
        with open(path, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(f, fcntl.LOCK_UN)
            return True
    except OSError:
        return True


def pids_with_arg(fragment, names):
    """PIDs whose argv[0] basename is in names and whose command line contains fragment."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0]:
            continue
        if os.path.basename(argv[0].decode(errors="replace")) not in names:
            continue
        if any(fragment in a.decode(errors="replace") for a in argv[1:]):
            out.append(int(d.name))
    return out


def wait_for(pred, timeout, step=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


# ---------------------------------------------------------------- mounts, loops

def unescape_mount(s):
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mounts():
    res = []
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                res.append((unescape_mount(parts[0]), unescape_mount(parts[1]), parts[2]))
    return res


def is_mounted(mp):
    mp = str(mp)
    return any(m[1] == mp for m in mounts())


def unmount(mp, fuse=False):
    """Unmounts mp; retries while busy, then detaches lazily as a last resort."""
    mp = str(mp)
    if not is_mounted(mp):
        return
    for attempt in range(20):
        cmd = ["fusermount3", "-u", mp] if fuse and shutil.which("fusermount3") else ["umount", mp]
        r = run(cmd, check=False)
        if not is_mounted(mp):
            return
        if fuse and r.returncode != 0:
            run(["umount", mp], check=False)
            if not is_mounted(mp):
                return
        time.sleep(0.25)
    log(f"warning: {mp} still busy; lazy unmount")
    run(["umount", "-l", mp], check=False)


def loop_attach(image):
    dev = run(["losetup", "--direct-io=on", "-f", "--show", image]).stdout.strip()
    name = os.path.basename(dev)
    dio = Path(f"/sys/block/{name}/loop/dio")
    if dio.exists() and dio.read_text().strip() != "1":
        log(f"warning: {dev} did not switch to direct I/O")
    return dev


def loop_detach(dev):
    for _ in range(20):
        r = run(["losetup", "-d", dev], check=False)
        if r.returncode == 0:
            return
        time.sleep(0.25)
    log(f"warning: could not detach {dev}")


def loops_under(work):
    r = run(["losetup", "-l", "-n", "-O", "NAME,BACK-FILE"], check=False)
    out = []
    for line in (r.stdout or "").splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[1].strip().startswith(str(work)):
            out.append(parts[0])
    return out


def loop_write_bytes(dev):
    stat = Path(f"/sys/block/{os.path.basename(dev)}/stat").read_text().split()
    return int(stat[6]) * 512


def drop_caches():
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def birch_stats(mp):
    r = run([BIRCHFS, "stats", "--json", mp], check=False, timeout=30)
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError:
        return None


def stats_delta(a, b):
    """b - a over numeric leaves; latency summaries (not subtractable) are taken from b."""
    if a is None or b is None:
        return None
    out = {}
    for k, v in b.items():
        if k == "latency_us":
            out[k] = v
        elif isinstance(v, dict):
            out[k] = stats_delta(a.get(k, {}), v)
        elif isinstance(v, (int, float)):
            out[k] = v - a.get(k, 0)
    return out


# ---------------------------------------------------------------- targets

class Target:
    """A filesystem under test; setup() makes it fresh and returns the mountpoint."""

    def __init__(self, name, work, image_size):
        self.name = name
        self.work = work
        self.image_size = image_size
        self.sparse = name == "birchfs-sparse"
        self.img = work / "img" / (f"{name}.img" if self.sparse else DISK_IMAGE)
        self.mp = work / "mnt" / name
        self.dev = None
        self.lower_mp = work / "lower" / name
        self.proc = None
        self.log = work / "log" / f"{name}.log"

    def fresh_image(self):
        """A new sparse image for birchfs-sparse; for every other target, the shared
        zero-filled image (see `disk_image`)."""
        self.img.parent.mkdir(parents=True, exist_ok=True)
        if not self.sparse:
            # An earlier target that did not let go (lazy unmount, busy loop device,
            # daemon still running) would write into the next one's filesystem.
            held = run(["losetup", "-j", str(self.img)], check=False).stdout.strip()
            if held or not lock_free(self.img):
                raise RunError(f"{self.img} is still in use ({held or 'locked'}); "
                               "not reusing it")
            disk_image(self.img, parse_size(self.image_size))
            return
        if self.img.exists():
            self.img.unlink()
        with open(self.img, "wb") as f:
            f.truncate(parse_size(self.image_size))

    def setup(self):
        self.mp.mkdir(parents=True, exist_ok=True)
        n = self.name
        if n == "raw":
            d = self.work / "raw"
            if d.exists():
                shutil.rmtree(d)
            d.mkdir(parents=True)
            return d
        if n in ("fuse-null", "fuse-null-flush"):
            self.log.parent.mkdir(parents=True, exist_ok=True)
            logf = open(self.log, "w")
            cmd = [str(NULLFS), str(self.mp)]
            if n == "fuse-null-flush":
                self.img.parent.mkdir(parents=True, exist_ok=True)
                cmd += ["2", str(self.img.parent / "nullfs-flush.bin")]
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=logf)
            logf.close()
            if not wait_for(lambda: is_mounted(self.mp), 10):
                raise RunError(f"nullfs did not mount (see {self.log})")
            return self.mp
        self.fresh_image()
        if n in ("birchfs-file", "birchfs-folio", "birchfs-sparse", "birchfs-uring"):
            if self.sparse:
                run([BIRCHFS, "mkfs", "--size", self.image_size, self.img])
            else:
                run([BIRCHFS, "mkfs", "--force", self.img])
            self.birch_mount(self.img)
            return self.mp
        self.dev = loop_attach(self.img)
        if n == "birchfs-loop":
            run([BIRCHFS, "mkfs", "--force", self.dev])
            self.birch_mount(self.dev)
        elif n == "fuse-floor":
            self.lower_mp.mkdir(parents=True, exist_ok=True)
            run(["mkfs.ext4", "-q", "-F"] + EXT4_NOLAZY + [self.dev])
            run(["mount", self.dev, self.lower_mp])
            self.log.parent.mkdir(parents=True, exist_ok=True)
            logf = open(self.log, "w")
            # passthrough_ll holds an O_PATH fd for every inode it has looked up, so
            # 65,536 files need more than the usual 1,024..20,000 open files.
            self.proc = subprocess.Popen(
                [str(self.work / "bin" / "passthrough_ll"), "-f",
                 "-o", f"source={self.lower_mp},writeback", str(self.mp)],
                stdout=logf, stderr=logf, preexec_fn=raise_nofile)
            logf.close()
            if not wait_for(lambda: is_mounted(self.mp), 10):
                raise RunError(f"passthrough_ll did not mount (see {self.log})")
        else:
            mkfs = {
                "btrfs": ["mkfs.btrfs", "-q", "-f", "-K"],
                "ext4": ["mkfs.ext4", "-q", "-F"] + EXT4_NOLAZY,
                "ext4-fc": ["mkfs.ext4", "-q", "-F", "-O", "fast_commit"] + EXT4_NOLAZY,
                "xfs": ["mkfs.xfs", "-q", "-f", "-K"],
            }[n]
            # mke2fs zeroes inode tables and journal with fallocate(ZERO_RANGE), which
            # the loop device turns into unwritten extents of the image: write instead.
            run(mkfs + [self.dev], env=dict(os.environ, UNIX_IO_NOZEROOUT="1"))
            opts = ["-o", "ssd,nodiscard"] if n == "btrfs" else []
            run(["mount"] + opts + [self.dev, self.mp])
        return self.mp

    def birch_mount(self, image):
        self.log.parent.mkdir(parents=True, exist_ok=True)
        opts = {"birchfs-folio": ["-o", "block_dirty=off"],
                "birchfs-uring": ["-o", "uring=on"]}.get(self.name, [])
        run([BIRCHFS, "mount", "--log", self.log] + opts + [image, self.mp], timeout=60)
        if not is_mounted(self.mp):
            raise RunError(f"birchfs did not mount on {self.mp} (see {self.log})")

    def birch_unmount(self):
        unmount(self.mp)
        mp = str(self.mp)
        # The kernel unmounts before the daemon has finished its last commit and exited;
        # its image stays locked (flock) until then, and that is what a new mount needs.
        image = self.dev or self.img
        if image and not wait_for(lambda: lock_free(image), 120, 0.1):
            log(f"warning: {image} still locked 120 s after unmounting {mp}")
        if not wait_for(lambda: not pids_with_arg(mp, {"birchfs"}), 120, 0.1):
            log(f"warning: birchfs daemon for {mp} did not exit; terminating it")
            for pid in pids_with_arg(mp, {"birchfs"}):
                os.kill(pid, signal.SIGTERM)
            wait_for(lambda: not pids_with_arg(mp, {"birchfs"}), 10, 0.1)

    def remount(self):
        """Unmounts and mounts the same filesystem again, so no cache of its own
        survives (raw and the FUSE floor have none beyond the kernel's)."""
        n = self.name
        if n in BIRCH:
            self.birch_unmount()
            self.birch_mount(self.dev or self.img)
        elif n in KERNEL:
            unmount(self.mp)
            opts = ["-o", "ssd,nodiscard"] if n == "btrfs" else []
            run(["mount"] + opts + [self.dev, self.mp])

    def counters(self):
        """Device-level counters: loop sectors written and, for birchfs, its stats."""
        c = {}
        if self.dev and self.name != "birchfs-file":
            c["loop_write_bytes"] = loop_write_bytes(self.dev)
        if self.name in BIRCH:
            c["birchfs"] = birch_stats(self.mp)
        return c

    def teardown(self):
        n = self.name
        if n == "raw":
            d = self.work / "raw"
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)
            return
        if n in BIRCH:
            self.birch_unmount()
        elif n in ("fuse-floor", "fuse-null", "fuse-null-flush"):
            unmount(self.mp, fuse=True)
            if self.proc:
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.terminate()
                    self.proc.wait(timeout=10)
                self.proc = None
            if n == "fuse-floor":
                unmount(self.lower_mp)
            flush_file = self.img.parent / "nullfs-flush.bin"
            if n == "fuse-null-flush" and flush_file.exists():
                flush_file.unlink()
        else:
            unmount(self.mp)
        if self.dev:
            loop_detach(self.dev)
            self.dev = None
        if self.sparse and self.img.exists():
            self.img.unlink()


# The image file every target but raw and birchfs-sparse uses (see the module doc).
DISK_IMAGE = "disk.img"


def unwritten_ranges(path, size):
    """Byte ranges of `path` the host has not written: holes and unwritten
    (fallocated or zero-ranged) extents, from `filefrag -v`; None if unknown."""
    r = run(["filefrag", "-v", "-b4096", str(path)], check=False)
    if r.returncode != 0:
        return None
    ranges, pos = [], 0
    for line in r.stdout.splitlines():
        m = re.match(r"\s*\d+:\s+(\d+)\.\.\s*(\d+):", line)
        if not m:
            continue
        start, end = int(m.group(1)) * 4096, (int(m.group(2)) + 1) * 4096
        if start > pos:
            ranges.append((pos, start))
        if "unwritten" in line:
            ranges.append((start, end))
        pos = max(pos, end)
    if pos < size:
        ranges.append((pos, size))
    return ranges


def disk_image(path, size):
    """Makes `path` a file of `size` bytes, all written (allocated on the host): a new
    or wrongly sized file is written whole; an existing one only where the host has
    not written it (holes, or unwritten extents the loop device made for a mkfs's
    zeroing). Earlier runs' contents stay elsewhere, as on a reused disk."""
    gaps = None
    try:
        if path.stat().st_size == size:
            gaps = unwritten_ranges(path, size)
    except FileNotFoundError:
        pass
    if gaps == []:
        return
    if gaps is None:
        with open(path, "wb") as f:
            f.truncate(size)
        gaps = [(0, size)]
    log(f"writing zeros over {sum(b - a for a, b in gaps) >> 20} MiB of {path} "
        "the host had not written")
    zeros = bytes(16 << 20)
    with open(path, "r+b") as f:
        for a, b in gaps:
            f.seek(a)
            while a < b:
                n = min(b - a, len(zeros))
                f.write(memoryview(zeros)[:n])
                a += n
        f.flush()
        os.fsync(f.fileno())


def raise_nofile():
    import resource
    try:
        n = min(1 << 20, int(Path("/proc/sys/fs/nr_open").read_text()))
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    except (OSError, ValueError):
        pass


def parse_size(s):
    s = str(s).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(s[:-1]) * mult[s[-1]]
    return int(s)


def cleanup_work(work, quiet=False):
    """Undoes anything the harness may have left under work: mounts, daemons, loops."""
    w = str(work)
    ms = [m for m in mounts() if m[1] == w or m[1].startswith(w + "/")]
    # FUSE mounts first (they may sit on an ext4 lower mount), deepest first.
    ms.sort(key=lambda m: (not m[2].startswith("fuse"), -m[1].count("/")))
    for dev, mp, fstype in ms:
        if not quiet:
            log(f"cleanup: unmounting {mp} ({fstype})")
        unmount(mp, fuse=fstype.startswith("fuse"))
    names = {"birchfs", "passthrough_ll"}
    if pids_with_arg(w, names):
        wait_for(lambda: not pids_with_arg(w, names), 30, 0.1)
    for pid in pids_with_arg(w, names):
        log(f"cleanup: terminating leftover daemon pid {pid}")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if not wait_for(lambda: not pids_with_arg(w, names), 10, 0.1):
        for pid in pids_with_arg(w, names):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for dev in loops_under(w):
        if not quiet:
            log(f"cleanup: detaching {dev}")
        loop_detach(dev)


# ---------------------------------------------------------------- dependencies

def ensure_deps(need_build_tools=True):
    need = []
    for cmd, pkg in [("fio", "fio"), ("mkfs.btrfs", "btrfs-progs"), ("mkfs.xfs", "xfsprogs"),
                     ("mkfs.ext4", "e2fsprogs"), ("losetup", "mount"),
                     ("fusermount3", "fuse3"), ("gcc", "gcc"), ("pkg-config", "pkg-config")]:
        if not shutil.which(cmd):
            need.append(pkg)
    have_fuse_dev = (FUSE_EXAMPLES / "passthrough_ll.c").exists() and shutil.which("pkg-config") \
        and subprocess.run(["pkg-config", "--exists", "fuse3"]).returncode == 0
    if not have_fuse_dev:
        need.append("libfuse3-dev")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        need.append("python3-matplotlib")
    need = sorted(set(need))
    if need:
        log(f"installing {' '.join(need)}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends"] + need,
                       check=True, env=env, stdout=subprocess.DEVNULL)
    if shutil.which("modprobe"):  # built in on some kernels, modules on others
        for mod in ["loop", "btrfs", "xfs", "fuse"]:
            subprocess.run(["modprobe", mod], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not Path("/dev/fuse").exists():
        sys.exit("bench: /dev/fuse is missing")
    for b in (BIRCHFS, FSMARK, NULLFS):
        if not b.exists():
            sys.exit(f"bench: {b} is missing: run `cargo build --release --bins --examples` first")


def snapshot_binaries(work):
    """Copies birchfs and fsmark into the work dir and uses the copies for the whole run,
    so a rebuild of target/release during the run cannot mix two versions."""
    global BIRCHFS, FSMARK, NULLFS
    import hashlib
    info = {}
    d = work / "bin"
    d.mkdir(parents=True, exist_ok=True)
    for name, src in (("birchfs", BIRCHFS), ("fsmark", FSMARK), ("nullfs", NULLFS)):
        dst = d / name
        tmp = d / f".{name}.tmp"
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
        info[name] = {
            "built": datetime.datetime.fromtimestamp(src.stat().st_mtime).astimezone().isoformat(timespec="seconds"),
            "sha256": hashlib.sha256(dst.read_bytes()).hexdigest(),
        }
    BIRCHFS, FSMARK, NULLFS = d / "birchfs", d / "fsmark", d / "nullfs"
    return info


def build_passthrough(work):
    out = work / "bin" / "passthrough_ll"
    out.parent.mkdir(parents=True, exist_ok=True)
    src = FUSE_EXAMPLES / "passthrough_ll.c"
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    flags = run(["pkg-config", "fuse3", "--cflags", "--libs"]).stdout.split()
    run(["gcc", "-O2", "-Wall", "-I", FUSE_EXAMPLES, src, "-o", out] + flags)
    return out


# ---------------------------------------------------------------- workloads

def variants(prof, only=None):
    """The workload variants, in run order: dicts with id, workload, label, kind."""
    v = []
    for nj in prof["w1_jobs"]:
        v.append({"id": f"W1-j{nj}", "workload": "W1", "kind": "fio", "job": "w1.fio",
                  "label": f"W1 4k randwrite fsync=4, {nj} job{'s' if nj > 1 else ''} x {prof['w1_size']}",
                  "env": {"BENCH_SIZE": prof["w1_size"], "BENCH_NUMJOBS": str(nj),
                          "BENCH_RUNTIME": str(prof["w1_cap_s"])},
                  "layout": False, "timeout": prof["w1_cap_s"] + 120,
                  "expect_bytes": nj * parse_size(prof["w1_size"])})
    v.append({"id": "W2", "workload": "W2", "kind": "fio", "job": "w2.fio",
              "label": f"W2 bssplit 4k-1m randwrite fsync=8, 4 threads x {prof['w2_size']}, {prof['w2_runtime']} s",
              "env": {"BENCH_SIZE": prof["w2_size"], "BENCH_NUMJOBS": "4",
                      "BENCH_RUNTIME": str(prof["w2_runtime"])},
              "layout": True, "timeout": prof["w2_runtime"] + 600})
    # Issue 7: W2 again while a read-only snapshot is taken every 10 s and the one
    # before it deleted (filesystems with snapshots only: birchfs mkdir and rmdir in
    # .snapshots, btrfs subvolume snapshot -r and subvolume delete).
    v.append({"id": "W2-snap", "workload": "W2", "kind": "fio", "job": "w2.fio",
              "label": f"W2 with a snapshot every {prof['snap_every_s']} s, the one before deleted",
              "env": {"BENCH_SIZE": prof["w2_size"], "BENCH_NUMJOBS": "4",
                      "BENCH_RUNTIME": str(prof["w2_runtime"])},
              "layout": True, "timeout": prof["w2_runtime"] + 600,
              "snap_every": prof["snap_every_s"], "targets": SNAPSHOT_TARGETS,
              "interleave": True})
    v.append({"id": "W3", "workload": "W3", "kind": "fio", "job": "w3.fio",
              "label": f"W3 4k overwrite fdatasync=1, 4 jobs x {prof['w3_size']}, {prof['w3_runtime']} s",
              "env": {"BENCH_SIZE": prof["w3_size"], "BENCH_NUMJOBS": "4",
                      "BENCH_RUNTIME": str(prof["w3_runtime"])},
              "layout": True, "timeout": prof["w3_runtime"] + 600})
    for rw in ("write", "read"):
        v.append({"id": f"W5-{rw}", "workload": "W5", "kind": "fio", "job": "w5.fio",
                  "label": f"W5 sequential {rw}, 1 MiB x {prof['w5_size']}"
                           + (" + fsync" if rw == "write" else ", after remount"),
                  "env": {"BENCH_SIZE": prof["w5_size"], "BENCH_RW": rw},
                  "rw": rw, "layout": rw == "read", "remount": rw == "read",
                  "timeout": 1800})
    t = prof["w4_fsync_threads"]
    for d, f in prof["w4_fsync"]:
        v.append({"id": f"W4-{d}x{f}", "workload": "W4", "kind": "fsmark",
                  "label": f"W4 create+fsync {d} dirs x {f} files, {t} threads",
                  "args": ["-t", t, "-D", d, "-n", d * f // t, "--fsync"],
                  "files": d * f, "dirs": d, "fsync": True,
                  "timeout": prof["w4_cap_s"] + 120})
    nf = prof["w4_nofsync"]
    v.append({"id": "W4-nofsync", "workload": "W4", "kind": "fsmark",
              "label": f"W4 create, no fsync, {nf['threads']} threads x {nf['files_per_thread']} files, {nf['dirs']} dirs",
              "args": ["-t", nf["threads"], "-D", nf["dirs"], "-n", nf["files_per_thread"]],
              "files": nf["threads"] * nf["files_per_thread"], "dirs": nf["dirs"], "fsync": False,
              "timeout": prof["w4_cap_s"] + 120})
    for x in v:
        if x["kind"] == "fsmark":
            x["args"] = x["args"] + ["--max-seconds", prof["w4_cap_s"]]
    if only:
        v = [x for x in v if x["workload"] in only or x["id"] in only]
    return v


def pct(d, key):
    try:
        return d["percentile"][key] / 1000.0
    except (KeyError, TypeError):
        return None


class Snapshotter:
    """Takes a read-only snapshot of the target every `every` seconds until stopped
    (nothing when `every` is None), and deletes the one before each new one, as a
    backup rotation would. Kept, three snapshots of W2's 2 GiB set, each rewritten
    almost whole between them (480 MiB/s), plus the live set filled the 8 GiB image:
    birchfs on a loop device ran out of space in 2 of 3 runs (stop 28)."""

    def __init__(self, tgt, mp, every):
        self.took, self.error, self.deleted = [], None, 0
        self.done = threading.Event()
        self.thread = None
        if every:
            self.thread = threading.Thread(target=self.loop, args=(tgt, Path(mp), every),
                                           daemon=True)
            self.thread.start()

    def loop(self, tgt, mp, every):
        n = 0
        while not self.done.wait(every):
            n += 1
            t0 = time.monotonic()
            try:
                if tgt.name in BIRCH:
                    os.mkdir(mp / ".snapshots" / f"s{n}")
                else:
                    run(["btrfs", "subvolume", "snapshot", "-r", str(mp), str(mp / f".snap-{n}")],
                        timeout=120)
                self.took.append(time.monotonic() - t0)
                if n > 1:
                    if tgt.name in BIRCH:
                        os.rmdir(mp / ".snapshots" / f"s{n - 1}")
                    else:
                        run(["btrfs", "subvolume", "delete", str(mp / f".snap-{n - 1}")],
                            timeout=120)
                    self.deleted += 1
            except (OSError, RunError) as e:
                self.error = str(e)
                return

    def stop(self):
        self.done.set()
        if self.thread:
            self.thread.join()


def run_fio(v, tgt, mp, work):
    d = Path(mp) / "fio"
    d.mkdir(exist_ok=True)
    env = dict(os.environ, BENCH_DIR=str(d), BENCH_CREATE_ONLY="0", **v["env"])
    out = work / "fio.json"
    job = JOBS / v["job"]
    if v["layout"]:
        run(["fio", "--output-format=json", f"--output={out}", job],
            env=dict(env, BENCH_CREATE_ONLY="1"), timeout=v["timeout"])
    if v.get("remount"):
        run(["sync", "-f", str(d)], check=False, timeout=600)
        tgt.remount()
    drop_caches()
    before = tgt.counters()
    load0 = os.getloadavg()[0]
    if out.exists():
        out.unlink()
    snaps = Snapshotter(tgt, mp, v.get("snap_every"))
    try:
        run(["fio", "--output-format=json", f"--output={out}", job], env=env,
            timeout=v["timeout"])
    finally:
        snaps.stop()
    run(["sync", "-f", str(d)], check=False, timeout=120)
    after = tgt.counters()
    fj = json.loads(out.read_text())
    j = fj["jobs"][0]
    w = j[v.get("rw", "write")]
    sync_lat = j.get("sync", {}).get("lat_ns", {})
    m = {
        "mib_s": w["bw_bytes"] / MiB,
        "iops": w["iops"],
        "write_bytes": w["io_bytes"],
        "runtime_s": w["runtime"] / 1000.0,
        "fsyncs": sync_lat.get("N", 0),
        "fsync_p50_us": pct(sync_lat, "50.000000"),
        "fsync_p90_us": pct(sync_lat, "90.000000"),
        "fsync_p99_us": pct(sync_lat, "99.000000"),
        "fsync_p999_us": pct(sync_lat, "99.900000"),
        "fsync_mean_us": sync_lat.get("mean", 0) / 1000.0 if sync_lat.get("N") else None,
        "loadavg_1m_before": load0,
        "loadavg_1m_after": os.getloadavg()[0],
    }
    if "expect_bytes" in v:
        m["capped"] = w["io_bytes"] < v["expect_bytes"]
    if v.get("snap_every"):
        if snaps.error:
            raise RunError(f"snapshot failed: {snaps.error}")
        m["snapshots"] = len(snaps.took)
        m["snapshots_deleted"] = snaps.deleted
        m["snapshot_ms_max"] = max(snaps.took) * 1000 if snaps.took else None
    extra = device_metrics(tgt, before, after, w["io_bytes"], m)
    extra["fio"] = {"fio_version": fj.get("fio version"), "global options": fj.get("global options"),
                    "job": j}
    return m, extra


def device_metrics(tgt, before, after, user_bytes, m):
    extra = {"counters_before": before, "counters_after": after}
    if "loop_write_bytes" in before:
        m["loop_bytes"] = after["loop_write_bytes"] - before["loop_write_bytes"]
    if tgt.name in BIRCH:
        delta = stats_delta(before.get("birchfs"), after.get("birchfs"))
        extra["birchfs_stats_delta"] = delta
        if delta:
            m["device_bytes"] = delta["bytes"]["device_total"]
            m["birchfs_log_commits"] = delta.get("log_commits")
            m["birchfs_full_commits"] = delta.get("full_commits")
            m["birchfs_fallbacks"] = delta.get("fallbacks")
    elif "loop_bytes" in m:
        m["device_bytes"] = m["loop_bytes"]
    if m.get("device_bytes") is not None and user_bytes:
        m["wa"] = m["device_bytes"] / user_bytes
    return extra


def nofile_limit(pid):
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    return None


def run_fsmark(v, tgt, mp, work):
    d = Path(mp) / "fsmark"
    if tgt.name == "fuse-floor" and tgt.proc:
        lim = nofile_limit(tgt.proc.pid)
        if lim is not None and v["files"] + 1000 > lim:
            raise Skipped(f"passthrough_ll keeps an open O_PATH fd per inode and may open only {lim} files "
                          f"(RLIMIT_NOFILE; raising it needs CAP_SYS_RESOURCE, which this machine lacks); "
                          f"the run creates {v['files']:,}")
    drop_caches()
    before = tgt.counters()
    load0 = os.getloadavg()[0]
    r = run([FSMARK, "-d", d] + v["args"], timeout=v["timeout"],
            env=dict(os.environ, RUST_BACKTRACE="0"))
    run(["sync", "-f", str(mp)], check=False, timeout=120)
    after = tgt.counters()
    fm = json.loads(r.stdout)
    lat = fm["latency_us"]["fsync"]
    m = {
        "files_per_s": fm["files_per_s"],
        "files_created": fm["files_created"],
        "capped": fm["capped"],
        "runtime_s": fm["elapsed_s"],
        "fsync_p50_us": lat.get("p50"),
        "fsync_p90_us": lat.get("p90"),
        "fsync_p99_us": lat.get("p99"),
        "fsync_p999_us": lat.get("p99.9"),
        "fsync_mean_us": lat.get("mean"),
        "create_p50_us": fm["latency_us"]["create"].get("p50"),
        "create_p99_us": fm["latency_us"]["create"].get("p99"),
        "files_per_s_by_tenth": fm["files_per_s_by_tenth"],
        "loadavg_1m_before": load0,
        "loadavg_1m_after": os.getloadavg()[0],
    }
    extra = device_metrics(tgt, before, after, 0, m)
    extra["fsmark"] = fm
    return m, extra


# ---------------------------------------------------------------- machine facts

def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        return ""


def machine_facts(work):
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = ""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal"):
            mem = f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    src = sh(f"findmnt -n -o SOURCE --target {work}")
    disk = os.path.basename(src) if src.startswith("/dev/") else src
    base = disk.rstrip("0123456789") if disk.startswith(("sd", "vd", "xvd")) else disk
    if base.startswith("nvme") and "p" in base:
        base = base.rsplit("p", 1)[0]
    q = Path(f"/sys/block/{base}/queue")
    def rd(p):
        v = read_text(p)
        return "?" if v is None else v
    size = rd(f"/sys/block/{base}/size")
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory": mem,
        "kernel": platform.release(),
        "disk": {
            "device": src,
            "fstype": sh(f"findmnt -n -o FSTYPE --target {work}"),
            "mount_options": sh(f"findmnt -n -o OPTIONS --target {work}"),
            "size_gib": round(int(size) * 512 / (1 << 30), 1) if size.isdigit() else None,
            "rotational": rd(q / "rotational"),
            "scheduler": rd(q / "scheduler"),
            "write_cache": rd(q / "write_cache"),
            "model": rd(f"/sys/block/{base}/device/model"),
            "driver": os.path.basename(os.path.realpath(f"/sys/block/{base}/device/driver"))
            if Path(f"/sys/block/{base}/device/driver").exists() else "?",
        },
        "work_dir": str(work),
        "versions": {
            "fio": sh("fio --version"),
            "btrfs-progs": sh("mkfs.btrfs --version 2>&1 | head -1"),
            "e2fsprogs": sh("mkfs.ext4 -V 2>&1 | head -1"),
            "xfsprogs": sh("mkfs.xfs -V 2>&1 | head -1"),
            "libfuse": sh("pkg-config --modversion fuse3"),
            "birchfs": sh(f"{BIRCHFS} --version"),
            "git": sh(f"git -C {REPO} rev-parse --short HEAD") + ("-dirty" if sh(f"git -C {REPO} status --porcelain --untracked-files=no") else ""),
            "git_dirty_files": sh(f"git -C {REPO} status --porcelain --untracked-files=no -- src Cargo.toml Cargo.lock | wc -l"),
        },
    }


# ---------------------------------------------------------------- summary and report

METRICS = ["mib_s", "iops", "files_per_s", "fsync_p50_us", "fsync_p90_us", "fsync_p99_us",
           "fsync_p999_us", "wa", "create_p50_us"]


def summarize(runs):
    s = {}
    for r in runs:
        if not r.get("ok"):
            continue
        cell = s.setdefault(r["variant"], {}).setdefault(r["target"], {})
        for k in METRICS:
            x = r["metrics"].get(k)
            if x is not None:
                cell.setdefault(k, []).append(x)
    out = {}
    for r in runs:
        if r.get("skipped"):
            out.setdefault(r["variant"], {}).setdefault(r["target"], {})["skipped"] = r["skipped"]
    for vid, tg in s.items():
        for t, ms in tg.items():
            for k, xs in ms.items():
                out.setdefault(vid, {}).setdefault(t, {})[k] = {
                    "median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
    return out


def fmt(x):
    if x is None:
        return "–"
    if x == 0:
        return "0"
    if isinstance(x, int) or (float(x).is_integer() and abs(x) >= 100):
        return f"{int(x):,}"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def cell(summ, vid, t, k):
    c = summ.get(vid, {}).get(t, {}).get(k)
    if not c:
        return "skipped" if "skipped" in summ.get(vid, {}).get(t, {}) else "–"
    if c["n"] == 1:
        return fmt(c["median"])
    return f"{fmt(c['median'])} ({fmt(c['min'])}–{fmt(c['max'])})"


def ratio_cols(summ, vid, k, higher_better, targets):
    meds = {t: summ.get(vid, {}).get(t, {}).get(k, {}).get("median") for t in targets}
    kern = {t: meds[t] for t in KERNEL if meds.get(t) is not None}
    if not kern:
        return ["–"] * (1 + len(BIRCH))
    best = (max if higher_better else min)(kern, key=kern.get)
    cols = [LABELS[best]]
    for b in BIRCH:
        if meds.get(b) is None or not kern[best]:
            cols.append("–")
        else:
            cols.append(f"{meds[b] / kern[best]:.2f}")
    return cols


def table(summ, vs, targets, k, higher_better, title_unit):
    hdr = ["workload"] + [LABELS[t] for t in targets] + ["best kernel fs"] + [f"{LABELS[b]} / best" for b in BIRCH]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for v in vs:
        if not any(summ.get(v["id"], {}).get(t, {}).get(k) for t in targets):
            continue
        row = [v["label"]] + [cell(summ, v["id"], t, k) for t in targets] + \
            ratio_cols(summ, v["id"], k, higher_better, targets)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_report(res, outdir):
    prof = res["profile"]
    targets = res["targets"]
    vs = res["variants"]
    runs = res["runs"]
    summ = res["summary"]
    m = res["machine"]
    main_k = lambda v: "files_per_s" if v["kind"] == "fsmark" else "mib_s"
    L = []
    L.append(f"# birchfs benchmarks ({res['profile_name']})")
    L.append("")
    status = "complete" if res.get("complete") else "**INCOMPLETE (interrupted or partial)**"
    L.append(f"Run {m['date']}, {res.get('wall_s', 0) / 60:.1f} min wall in total, {status}. "
             f"Generated by `{res['command']}` (bench/bench.py); raw data in results.json.")
    if res.get("restricted"):
        L.append("")
        L.append(f"**Restricted run:** {res['restricted']}")
    for note in res.get("notes", []):
        L.append("")
        L.append(f"**Note:** {note}")
    for rr in res.get("reruns", []):
        L.append("")
        L.append(f"**Re-run:** {', '.join(rr['variants'])} were run again on {rr['date']} "
                 f"({rr['wall_s'] / 60:.1f} min, all targets interleaved, same repetitions) and replace the "
                 f"first run's results for those rows: {rr['reason']}")
    L.append("")
    L.append("## Machine")
    L.append("")
    d = m["disk"]
    L.append(f"- {m['cores']} cores ({m['cpu']}), {m['memory']} RAM, kernel {m['kernel']}")
    L.append(f"- disk: {d['device']} ({d['driver']}, {d['size_gib']} GiB, rotational={d['rotational']}, "
             f"write cache: {d['write_cache']}, scheduler {d['scheduler']}), host filesystem {d['fstype']} "
             f"({d['mount_options']}); all images in {m['work_dir']}")
    vv = m["versions"]
    L.append(f"- {vv['fio']}, {vv['btrfs-progs']}, {vv['e2fsprogs']}, {vv['xfsprogs']}, libfuse {vv['libfuse']}, "
             f"{vv['birchfs']} at git {vv['git']}"
             + (f" ({vv['git_dirty_files']} files under src/ modified in the work tree)" if vv.get('git_dirty_files', '0') not in ('', '0') else ""))
    b = m.get("binaries", {}).get("birchfs")
    if b:
        L.append(f"- birchfs binary built {b['built']}, sha256 {b['sha256'][:16]}…; copied into the work directory "
                 f"at the start and used for every run")
    for rr in res.get("reruns", []):
        rm = rr.get("machine", {})
        rb = rm.get("binaries", {}).get("birchfs")
        if rb:
            same = "the same binary" if b and rb["sha256"] == b["sha256"] else "a different binary"
            L.append(f"- re-run of {', '.join(rr['variants'])}: birchfs built {rb['built']}, sha256 "
                     f"{rb['sha256'][:16]}… ({same})")
        # A re-run on another machine (the sessions' machines differ) says which.
        other = [f"{k} {rm[k]}" for k in ("cpu", "kernel") if rm.get(k) and rm.get(k) != m.get(k)]
        if other:
            L.append(f"  - **on another machine** than the first run: {', '.join(other)}; compare its rows "
                     f"within the row, not with rows run elsewhere")
    loads = [r["metrics"].get("loadavg_1m_before") for r in runs if r.get("ok")]
    loads = [x for x in loads if x is not None]
    if loads:
        L.append(f"- 1-minute load average at the start of the measured runs: median {statistics.median(loads):.1f}, "
                 f"max {max(loads):.1f} (the harness itself keeps about 1 busy; more means other work shared the "
                 f"{m['cores']} cores)")
    L.append("")
    L.append("## Method")
    L.append("")
    L.append(f"- Targets: {', '.join(LABELS[t] + ' (`' + t + '`)' for t in targets)}. "
             f"Every target's filesystem lives on one {prof['image_size']} image file on the same disk, written with zeros "
             f"(whole once, and before each run wherever the host holds it unwritten again, e.g. after a mkfs's zeroing) so that its blocks are allocated on the host, as a disk's are (in a sparse file every "
             f"write into a hole makes the host allocate and commit its journal before a flush returns, which copy-on-write "
             f"filesystems pay on most fsyncs and a real disk never does). Kernel filesystems see it through a loop device "
             f"with `--direct-io=on` and are made and mounted without discard (`mkfs.ext4 -E nodiscard`, `mkfs.xfs -K`, "
             f"`mkfs.btrfs -K`, btrfs `-o nodiscard`), so the loop device punches no holes into it; `birchfs-file` uses the "
             f"file itself; `raw` is a directory of the host filesystem; `birchfs-sparse` is birchfs on a fresh sparse image "
             f"file (what a plain `birchfs mkfs` makes), to show what the holes cost. btrfs is mounted `-o ssd,nodiscard`; the FUSE floor is libfuse {vv['libfuse']}'s "
             f"`passthrough_ll -o writeback` (birchfs also uses the writeback cache) over ext4 on a loop device.")
    L.append(f"- A fresh filesystem for every run; targets interleaved (A B C … A B C …) within each workload variant (W2-snap in the same rounds as W2); "
             f"{prof['reps']} repetitions; `sync` + `drop_caches` before each measured run. Cells: median (min–max).")
    L.append("- W2/W3 files are laid out by a separate fio pass (`create_only=1`) before the measured pass. "
             "Device bytes are read before the measured pass and after it plus `sync -f` on the mount: "
             "loop-device write sectors (/sys/block/loopN/stat) for kernel filesystems and the FUSE floor, "
             "the daemon's `bytes.device_total` (`birchfs stats --json`) for birchfs. FUSE does not pass syncfs to "
             "the daemon, so work birchfs defers to its next periodic commit (30 s) may fall outside the window; "
             "likewise for kernel filesystems' deferred checkpoints.")
    L.append(f"- fsync latency: fio's `sync` latency percentiles (fsync for W1/W2, fdatasync for W3), "
             f"fsmark's per-file fsync time for W4. W1 jobs stop at their size (a {prof['w1_cap_s']} s cap is only "
             f"a safety net); W4 runs are capped at {prof['w4_cap_s']} s. W4 fsync runs use "
             f"{prof['w4_fsync_threads']} threads; each thread spreads its files over all D directories.")
    L.append("- Ratios: birchfs median / the median of the best kernel filesystem (btrfs, ext4, ext4 fast_commit, "
             "XFS) for that row. For throughput, IOPS and files/s above 1 means birchfs is faster; for latency "
             "below 1 means birchfs is faster.")
    L.append("- The machine is shared (2 cores): other work may run at the same time; each run records the "
             "1-minute load average in results.json.")
    L.append("")
    L.append("## Throughput (fio: MiB/s written; W4: files/s)")
    L.append("")
    hdr = ["workload", "unit"] + [LABELS[t] for t in targets] + ["best kernel fs"] + [f"{LABELS[b]} / best" for b in BIRCH]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for v in vs:
        k = main_k(v)
        row = [v["label"], "files/s" if k == "files_per_s" else "MiB/s"] + \
            [cell(summ, v["id"], t, k) for t in targets] + ratio_cols(summ, v["id"], k, True, targets)
        lines.append("| " + " | ".join(row) + " |")
    L.append("\n".join(lines))
    L.append("")
    fio_vs = [v for v in vs if v["kind"] == "fio"]
    L.append("## IOPS (fio write operations per second)")
    L.append("")
    L.append(table(summ, fio_vs, targets, "iops", True, "IOPS"))
    L.append("")
    L.append("## fsync latency p50 (µs)")
    L.append("")
    L.append(table(summ, vs, targets, "fsync_p50_us", False, "µs"))
    L.append("")
    L.append("## fsync latency p99 (µs)")
    L.append("")
    L.append(table(summ, vs, targets, "fsync_p99_us", False, "µs"))
    L.append("")
    L.append("## Write amplification (device bytes written / bytes fio wrote)")
    L.append("")
    L.append("W3 is the workload this is defined for; W1/W2/W5 are shown for reference. "
             "`raw` has no device of its own (n/a). For the FUSE floor it is the ext4 loop device below it.")
    L.append("")
    wa_targets = [t for t in targets if t != "raw"]
    L.append(table(summ, [v for v in fio_vs if v["id"] != "W5-read"], wa_targets, "wa", False, "x"))
    L.append("")
    # birchfs internals
    bl = []
    for v in vs:
        for t in BIRCH:
            rs = [r for r in runs if r["variant"] == v["id"] and r["target"] == t and r.get("ok")]
            if not rs:
                continue
            def med(key):
                xs = [r["metrics"].get(key) for r in rs if r["metrics"].get(key) is not None]
                return fmt(statistics.median(xs)) if xs else "–"
            def dmed(path, unit=1):
                xs = []
                for r in rs:
                    dd = r.get("birchfs_stats_delta")
                    for p in path:
                        dd = dd.get(p) if isinstance(dd, dict) else None
                    if dd is not None:
                        xs.append(dd / unit)
                if not xs:
                    return "–"
                x = statistics.median(xs)
                return fmt(x) if unit == 1 else f"{x:,.1f}"
            mib = lambda k: dmed(["bytes", k], MiB)
            bl.append(f"| {v['label']} | {LABELS[t]} | {dmed(['fsyncs'])} | {med('birchfs_log_commits')} | "
                      f"{med('birchfs_full_commits')} | {med('birchfs_fallbacks')} | "
                      f"{mib('user')} | {mib('data')} | {mib('metadata')} | {mib('log')} | {mib('superblock')} | "
                      f"{mib('device_total')} |")
    if bl:
        L.append("## birchfs daemon counters during the measured run (medians)")
        L.append("")
        L.append("Counter deltas over the measured pass (`birchfs stats --json` before and after); bytes in MiB.")
        L.append("")
        L.append("| workload | target | fsyncs | log commits | full commits | fallbacks | user MiB | data MiB | metadata MiB | log MiB | superblock MiB | device MiB |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        L.extend(bl)
        L.append("")
    # W4 collapse check
    w4 = [v for v in vs if v["kind"] == "fsmark"]
    if w4:
        L.append("## W4: does the create rate hold as the directories fill?")
        L.append("")
        L.append("files/s in the last tenth of each run divided by files/s in the first tenth (median over runs; "
                 "below 1 means the rate fell during the run).")
        L.append("")
        hdr = ["workload"] + [LABELS[t] for t in targets]
        L.append("| " + " | ".join(hdr) + " |")
        L.append("|" + "---|" * len(hdr))
        for v in w4:
            row = [v["label"]]
            for t in targets:
                xs = []
                for r in runs:
                    if r["variant"] == v["id"] and r["target"] == t and r.get("ok"):
                        tt = r["metrics"].get("files_per_s_by_tenth") or []
                        if len(tt) == 10 and tt[0] and tt[9]:
                            xs.append(tt[9] / tt[0])
                row.append(f"{statistics.median(xs):.2f}" if xs else "–")
            L.append("| " + " | ".join(row) + " |")
        L.append("")
    bad = [r for r in runs if not r.get("ok") and not r.get("skipped")]
    skipped = [r for r in runs if r.get("skipped")]
    capped = [r for r in runs if r.get("ok") and r["metrics"].get("capped")]
    L.append("## Failures and capped runs")
    L.append("")
    if not bad and not capped and not skipped:
        L.append("None.")
    reasons = {}
    for r in skipped:
        reasons.setdefault(r["skipped"], []).append(f"{r['variant']} on {r['target']} rep {r['rep']}")
    for why, which in reasons.items():
        L.append(f"- skipped {', '.join(which)}: {why}")
    for r in bad:
        err = (r.get("error") or "interrupted").strip().splitlines() or ["?"]
        msg = " / ".join(x.strip() for x in err[:2])
        L.append(f"- FAILED {r['variant']} on {r['target']} rep {r['rep']}: `{msg[:400]}`")
    for r in capped:
        L.append(f"- capped {r['variant']} on {r['target']} rep {r['rep']} (stopped at the time cap before finishing)")
    L.append("")
    L.append("## Charts")
    L.append("")
    L.append("![throughput](throughput.png)")
    L.append("")
    L.append("![fsync latency](fsync_latency.png)")
    L.append("")
    L.append("![files per second](files_per_s.png)")
    L.append("")
    (outdir / "REPORT.md").write_text("\n".join(L))


def charts(res, outdir):
    """Writes the PNGs; a chart that cannot be drawn (e.g. a partial run) is logged and skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"no charts: {sys.executable} has no matplotlib (make bench uses /usr/bin/python3)")
        return
    for name in ("throughput", "fsync_latency", "files_per_s"):
        (outdir / f"{name}.png").unlink(missing_ok=True)  # no stale chart from an earlier run
    for name, fn in (("throughput", chart_throughput), ("fsync_latency", chart_latency),
                     ("files_per_s", chart_files)):
        try:
            fn(res, outdir, plt)
        except Exception as e:  # a missing chart must not hide the results
            log(f"warning: {name}.png not drawn: {e!r}")
        finally:
            plt.close("all")


def has(summ, vid, targets, k):
    return any(summ.get(vid, {}).get(t, {}).get(k) for t in targets)


def _hbar(ax, summ, targets, vid, k, title, unit):
    ys, meds, lo, hi, cols = [], [], [], [], []
    for i, t in enumerate(targets):
        c = summ.get(vid, {}).get(t, {}).get(k)
        ys.append(i)
        if c:
            meds.append(c["median"])
            lo.append(c["median"] - c["min"])
            hi.append(c["max"] - c["median"])
        else:
            meds.append(0)
            lo.append(0)
            hi.append(0)
        cols.append(COLORS[t])
    ax.barh(ys, meds, xerr=[lo, hi], color=cols, capsize=3, error_kw={"elinewidth": 1})
    ax.set_yticks(ys)
    ax.set_yticklabels([LABELS[t] for t in targets], fontsize=8)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(unit, fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    tops = [m_ + h_ for m_, h_ in zip(meds, hi)]
    mx = max(tops + [0])
    for y, mval, top in zip(ys, meds, tops):
        if mval:
            ax.text(top + mx * 0.015, y, fmt(mval), va="center", fontsize=7)
    ax.set_xlim(0, mx * 1.22 if mx else 1)
    ax.grid(axis="x", alpha=0.3)


def chart_throughput(res, outdir, plt):
    summ, targets = res["summary"], res["targets"]
    fio_vs = [v for v in res["variants"] if v["kind"] == "fio" and has(summ, v["id"], targets, "mib_s")]
    n = len(fio_vs)
    if not n:
        return
    cols_ = 3 if n > 4 else n
    rows = (n + cols_ - 1) // cols_
    fig, axes = plt.subplots(rows, cols_, figsize=(5.2 * cols_, 3.4 * rows), squeeze=False)
    for i, v in enumerate(fio_vs):
        _hbar(axes[i // cols_][i % cols_], summ, targets, v["id"], "mib_s", wrap(v["label"], 48),
              "MiB/s (median, whiskers min–max)")
    for j in range(n, rows * cols_):
        axes[j // cols_][j % cols_].axis("off")
    fig.suptitle(f"Write throughput per workload ({res['profile_name']}, {res['profile']['reps']} runs each)", fontsize=11)
    fig.tight_layout()
    fig.savefig(outdir / "throughput.png", dpi=110)


def chart_latency(res, outdir, plt):
    summ, targets, vs = res["summary"], res["targets"], res["variants"]

    def get(vid, t, k):
        return summ.get(vid, {}).get(t, {}).get(k)

    lat_vs = [v for v in vs if any(get(v["id"], t, "fsync_p50_us") for t in targets)]
    if lat_vs:
        n = len(lat_vs)
        cols_ = 3 if n > 4 else n
        rows = (n + cols_ - 1) // cols_
        fig, axes = plt.subplots(rows, cols_, figsize=(5.2 * cols_, 3.6 * rows), squeeze=False)
        pcts = [("fsync_p50_us", "p50", 0.9), ("fsync_p90_us", "p90", 0.6), ("fsync_p99_us", "p99", 0.3)]
        for i, v in enumerate(lat_vs):
            ax = axes[i // cols_][i % cols_]
            h = 0.26
            for j, (k, name, alpha) in enumerate(pcts):
                ys, meds, lo, hi, colors = [], [], [], [], []
                for ti, t in enumerate(targets):
                    c = get(v["id"], t, k)
                    ys.append(ti + (j - 1) * h)
                    if c:
                        meds.append(c["median"])
                        lo.append(c["median"] - c["min"])
                        hi.append(c["max"] - c["median"])
                    else:
                        meds.append(0)
                        lo.append(0)
                        hi.append(0)
                    colors.append(COLORS[t])
                ax.barh(ys, meds, height=h, xerr=[lo, hi], color=colors, alpha=alpha,
                        edgecolor="black", linewidth=0.3, capsize=2, error_kw={"elinewidth": 0.8},
                        label=name)
            ax.set_xscale("log")
            log_ticks(ax.xaxis)
            ax.set_yticks(range(len(targets)))
            ax.set_yticklabels([LABELS[t] for t in targets], fontsize=8)
            ax.invert_yaxis()
            ax.set_title(wrap(v["label"], 48), fontsize=9)
            ax.set_xlabel("fsync latency, µs (log)", fontsize=8)
            ax.tick_params(axis="x", labelsize=8)
            ax.grid(axis="x", alpha=0.3, which="both")
        from matplotlib.patches import Patch
        fig.legend(handles=[Patch(facecolor="grey", alpha=a, edgecolor="black", label=nm) for _, nm, a in pcts],
                   loc="lower center", ncol=3, fontsize=9, title="bars per target, top to bottom", title_fontsize=9)
        for j in range(n, rows * cols_):
            axes[j // cols_][j % cols_].axis("off")
        fig.suptitle(f"fsync latency percentiles, median of {res['profile']['reps']} runs (whiskers min–max)", fontsize=11)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        fig.savefig(outdir / "fsync_latency.png", dpi=110)


def chart_files(res, outdir, plt):
    summ, targets, vs = res["summary"], res["targets"], res["variants"]

    def get(vid, t, k):
        return summ.get(vid, {}).get(t, {}).get(k)

    w4 = [v for v in vs if v["kind"] == "fsmark" and has(summ, v["id"], targets, "files_per_s")]
    w4f = [v for v in w4 if v["fsync"]]
    if w4:
        fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
        ax = axes[0]
        xs = list(range(len(w4f)))
        for t in targets:
            meds, lo, hi = [], [], []
            for v in w4f:
                c = get(v["id"], t, "files_per_s")
                meds.append(c["median"] if c else float("nan"))
                lo.append(c["min"] if c else float("nan"))
                hi.append(c["max"] if c else float("nan"))
            if all(x != x for x in meds):  # no data for this target
                continue
            ax.plot(xs, meds, marker="o", color=COLORS[t], label=LABELS[t])
            ax.fill_between(xs, lo, hi, color=COLORS[t], alpha=0.15)
        if ax.lines:
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{v['dirs']} dirs x {v['files'] // v['dirs']}\n({v['files']:,} files)"
                                for v in w4f], fontsize=8)
            ax.set_yscale("log")
            log_ticks(ax.yaxis)
            ax.set_ylabel("files/s (log; median, band min–max)", fontsize=8)
            ax.set_title(f"W4 create + fsync per file, {res['profile']['w4_fsync_threads']} threads", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7, ncol=2)
        else:
            ax.axis("off")
        # within the largest fsync run: rate by tenth (median over runs)
        for ax, v in ((axes[1], w4f[-1] if w4f else None), (axes[2], next((x for x in w4 if not x["fsync"]), None))):
            if v is None:
                ax.axis("off")
                continue
            for t in targets:
                series = [r["metrics"].get("files_per_s_by_tenth") for r in res["runs"]
                          if r["variant"] == v["id"] and r["target"] == t and r.get("ok")]
                series = [s for s in series if s and len(s) == 10 and all(x is not None for x in s)]
                if not series:
                    continue
                med = [statistics.median(col) for col in zip(*series)]
                ax.plot(range(1, 11), med, marker=".", color=COLORS[t], label=LABELS[t])
            if not ax.lines:
                ax.axis("off")
                continue
            ax.set_yscale("log")
            log_ticks(ax.yaxis)
            ax.set_xlabel("tenth of the run (by files created)", fontsize=8)
            ax.set_ylabel("files/s in that tenth (log, median)", fontsize=8)
            ax.set_title(wrap(v["label"], 55), fontsize=9)
            ax.set_xticks(range(1, 11))
            ax.grid(alpha=0.3, which="both")
        fig.suptitle("W4 fs_mark-style creates: files/s as directories x files grow", fontsize=11)
        fig.tight_layout()
        fig.savefig(outdir / "files_per_s.png", dpi=110)


def log_ticks(axis):
    """Plain-number ticks at 1, 2, 5 x 10^n on a log axis (readable over short spans)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}" if x >= 1 else f"{x:g}"))
    axis.set_minor_formatter(NullFormatter())
    axis.set_tick_params(labelsize=8)


def wrap(s, width):
    words, lines, cur = s.split(), [], ""
    for w in words:
        if len(cur) + len(w) + 1 > width and cur:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    lines.append(cur)
    return "\n".join(lines)


# ---------------------------------------------------------------- main

URING_PARAM = "/sys/module/fuse/parameters/enable_uring"


def read_text(path):
    """The stripped contents of a small file, or None when it cannot be read."""
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def on_signal(signum, frame):
    raise Interrupted(f"signal {signum}")


def merge_into(old, res, vs, reason):
    """The earlier results `old` with the rows of variants `vs` replaced by this run's."""
    ids = {v["id"] for v in vs}
    old["runs"] = [r for r in old["runs"] if r["variant"] not in ids] + res["runs"]
    # Variants, targets and profile settings new since the base run join it, in order.
    for k, val in res["profile"].items():
        old["profile"].setdefault(k, val)
    known = {v["id"] for v in old["variants"]} | ids
    old["variants"] = [v for v in variants(old["profile"], None) if v["id"] in known]
    old["targets"] = [t for t in TARGETS if t in old["targets"] or t in res["targets"]]
    old.setdefault("reruns", []).append({
        "variants": sorted(ids), "date": res["machine"]["date"], "reason": reason,
        "wall_s": res["wall_s"], "complete": res["complete"], "machine": res["machine"]})
    # Complete when every variant x repetition x target has a finished (or skipped) run.
    have = {(r["variant"], r["rep"], r["target"]) for r in old["runs"] if r.get("ok") or r.get("skipped")}
    want = {(v["id"], rep, t) for v in old["variants"] for rep in range(1, old["profile"]["reps"] + 1)
            for t in old["targets"] if runs_on(t, v)}
    failed_ok = {(r["variant"], r["rep"], r["target"]) for r in old["runs"] if "error" in r}
    old["complete"] = res["complete"] and want <= (have | failed_ok)
    # An interrupted base run has no wall time of its own: use the sum of its runs.
    base_wall = old.get("wall_s") or sum(r.get("wall_s", 0) for r in old["runs"] if r["variant"] not in ids)
    old["wall_s"] = base_wall + res["wall_s"]
    return old


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--reps", type=int, help="repetitions (>= 2; the full profile uses 3)")
    ap.add_argument("--work", default="/var/tmp/birchfs-bench", help="work directory for images and mounts")
    ap.add_argument("--out", help="output directory (default from the profile)")
    ap.add_argument("--targets", help="comma-separated subset, for debugging only")
    ap.add_argument("--workloads", help="comma-separated subset (W1,W2,W3,W4 or variant ids), for debugging only")
    ap.add_argument("--report-only", action="store_true", help="rebuild REPORT.md and PNGs from results.json")
    ap.add_argument("--note", action="append", default=[],
                    help="with --report-only: add a caveat about the run to results.json and the report")
    ap.add_argument("--merge", metavar="REASON",
                    help="with --workloads: re-run those workloads (all targets, interleaved, all reps) and "
                         "replace their runs in the existing results.json; REASON goes into the report")
    a = ap.parse_args()

    prof = dict(PROFILES[a.profile])
    if a.reps:
        if a.reps < 2:
            sys.exit("bench: at least 2 repetitions")
        prof["reps"] = a.reps
    outdir = (REPO / (a.out or prof["out"])).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    if a.merge and not a.workloads:
        sys.exit("bench: --merge needs --workloads")
    if a.report_only:
        res = json.loads((outdir / "results.json").read_text())
        if a.note:
            res.setdefault("notes", []).extend(a.note)
            res["summary"] = summarize(res["runs"])
            (outdir / "results.json").write_text(json.dumps(res, indent=1))
        res["summary"] = summarize(res["runs"])
        write_report(res, outdir)
        charts(res, outdir)
        log(f"wrote {outdir}/REPORT.md and charts")
        return 0
    if os.geteuid() != 0:
        sys.exit("bench: run as root (loop devices, mounts, drop_caches)")

    work = Path(a.work).resolve()
    if str(work) in ("/", "/var", "/var/tmp", "/tmp") or str(REPO).startswith(str(work) + "/"):
        sys.exit(f"bench: refusing work directory {work}")
    work.mkdir(parents=True, exist_ok=True)
    lockf = open(work / ".lock", "w")
    try:
        fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"bench: another harness is running on {work}")

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, on_signal)

    targets = TARGETS
    restricted = []
    if a.targets:
        targets = [t for t in TARGETS if t in a.targets.split(",")]
        restricted.append(f"targets {','.join(targets)}")
    only = a.workloads.split(",") if a.workloads else None
    if only and not a.merge:
        restricted.append(f"workloads {a.workloads}")
    vs = variants(prof, only)

    t_start = time.monotonic()
    res = {
        "profile_name": a.profile,
        "profile": prof,
        "command": "make bench" if a.profile == "full" else "make bench-quick",
        "targets": targets,
        "variants": vs,
        "restricted": "; ".join(restricted) or None,
        "runs": [],
        "complete": False,
    }
    if a.reps:
        res["command"] += f" (--reps {a.reps})"
    rc = 0
    # `-o uring=on` (birchfs-uring) turns fuse's enable_uring parameter on and leaves
    # it on; the harness sets it back to what it found.
    uring_was = read_text(URING_PARAM)
    try:
        cleanup_work(work)
        ensure_deps()
        bins = snapshot_binaries(work)
        build_passthrough(work)
        res["machine"] = machine_facts(work)
        res["machine"]["binaries"] = bins
        total = prof["reps"] * sum(1 for v in vs for t in targets if runs_on(t, v))
        log(f"profile {a.profile}: {len(vs)} variants x {prof['reps']} reps x {len(targets)} targets = {total} runs")
        i = 0
        groups = []
        for v in vs:
            if v.get("interleave") and groups:
                groups[-1].append(v)
            else:
                groups.append([v])
        rounds = [(v, rep) for g in groups for rep in range(1, prof["reps"] + 1) for v in g]
        for v, rep in rounds:
            for tname in targets:
                if not runs_on(tname, v):
                    continue
                i += 1
                tgt = Target(tname, work, prof["image_size"])
                rec = {"variant": v["id"], "workload": v["workload"], "target": tname, "rep": rep}
                t0 = time.monotonic()
                try:
                    mp = tgt.setup()
                    if v["kind"] == "fio":
                        m, extra = run_fio(v, tgt, mp, work)
                    else:
                        m, extra = run_fsmark(v, tgt, mp, work)
                    rec.update(ok=True, metrics=m, **extra)
                except RunError as e:
                    rec.update(ok=False, error=str(e), metrics={})
                    log(f"run failed: {e}")
                except Skipped as e:
                    rec.update(ok=False, skipped=str(e), metrics={})
                finally:
                    try:
                        tgt.teardown()
                    except RunError as e:
                        log(f"teardown of {tname} failed: {e}")
                    rec["wall_s"] = time.monotonic() - t0
                    res["runs"].append(rec)
                    (work / "results.partial.json").write_text(json.dumps(res))
                mm = rec["metrics"]
                main = mm.get("files_per_s") if v["kind"] == "fsmark" else mm.get("mib_s")
                unit = "files/s" if v["kind"] == "fsmark" else "MiB/s"
                lat = mm.get("fsync_p99_us")
                log(f"[{i}/{total}] {v['id']:<11} rep {rep} {tname:<13} "
                    + (f"{fmt(main)} {unit}, fsync p50 {fmt(mm.get('fsync_p50_us'))} p99 {fmt(lat)} µs"
                       + (f", WA {mm['wa']:.2f}" if mm.get("wa") else "")
                       if rec["ok"] else ("skipped" if rec.get("skipped") else "FAILED"))
                    + f" ({rec['wall_s']:.1f} s)")
        res["complete"] = True
    except Interrupted as e:
        log(f"interrupted ({e}); cleaning up")
        rc = 130
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        rc = 130
    finally:
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        kill_children()
        cleanup_work(work)
        if uring_was == "N" and read_text(URING_PARAM) == "Y":
            try:
                Path(URING_PARAM).write_text("0")
                log(f"set {URING_PARAM} back to N")
            except OSError as e:
                log(f"warning: could not set {URING_PARAM} back to N: {e}")
        left = [m for m in mounts() if m[1].startswith(str(work))] + [(d,) for d in loops_under(work)]
        if left:
            log(f"warning: still present after cleanup: {left}")
            rc = rc or 1
    res["wall_s"] = time.monotonic() - t_start
    if a.merge and res["runs"]:
        res = merge_into(json.loads((outdir / "results.json").read_text()), res, vs, a.merge)
    if res["runs"]:
        res["summary"] = summarize(res["runs"])
        res.setdefault("machine", machine_facts(work))
        (outdir / "results.json").write_text(json.dumps(res, indent=1))
        write_report(res, outdir)
        charts(res, outdir)
        log(f"wrote {outdir}/REPORT.md, results.json and charts in {res['wall_s'] / 60:.1f} min")
    failed = sum(1 for r in res["runs"] if not r.get("ok") and not r.get("skipped"))
    if failed:
        log(f"{failed} run(s) failed; see REPORT.md")
        rc = rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
