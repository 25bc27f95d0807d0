//! Mount options: `-o` parsed into the filesystem's options and the daemon's.

use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

use birchfs::Options;

use crate::parse_size;

/// What `-o` asked for.
pub(crate) struct MountOpts {
    /// The filesystem's own options.
    pub(crate) fs: Options,
    /// FUSE request threads that always serve.
    pub(crate) threads: usize,
    /// FUSE request threads more, which serve only while fsyncs arrive (see
    /// `fuse::standby`).
    pub(crate) standby: usize,
    /// Whether to serve requests through io_uring queues.
    pub(crate) uring: UringMode,
    /// How the io_uring queues are served.
    pub(crate) ring: birchfs::fuse::uring::RingConfig,
    /// Whether group commits wait briefly to gather the fsyncs of threads expected back.
    pub(crate) gather: bool,
    /// Smallest file whose read-only opens bypass the kernel's page cache (`None`:
    /// never); unset means the cache size.
    pub(crate) direct_read: Option<Option<u64>>,
    /// The generic mount flags asked for (nosuid, nodev, noexec, noatime, sync).
    pub(crate) vfs: VfsFlags,
    /// How long the kernel may cache names and attributes.
    pub(crate) timeouts: birchfs::fuse::Timeouts,
}

/// Generic mount flags, which the kernel enforces on the mount.
#[derive(Default)]
pub(crate) struct VfsFlags {
    nosuid: bool,
    nodev: bool,
    noexec: bool,
    noatime: bool,
    sync: bool,
}

impl VfsFlags {
    /// The flags as fuser mount options; set-id and device files work only for root.
    pub(crate) fn mount_options(&self, root: bool) -> Vec<fuser::MountOption> {
        use fuser::MountOption as M;
        let mut v = vec![if self.noexec { M::NoExec } else { M::Exec }];
        if root {
            v.push(if self.nosuid { M::NoSuid } else { M::Suid });
            v.push(if self.nodev { M::NoDev } else { M::Dev });
        }
        if self.noatime {
            v.push(M::NoAtime);
        }
        if self.sync {
            v.push(M::Sync);
        }
        v
    }
}

impl MountOpts {
    /// The `direct_read=` threshold in effect.
    pub(crate) fn direct_read(&self) -> Option<u64> {
        self.direct_read.unwrap_or(Some(self.fs.cache.cache_size))
    }
}

/// The `uring=` mount option (off by default: the kernel offers the queues only while
/// fuse's `enable_uring` parameter, global to the machine, is on; see README).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum UringMode {
    /// Never: every request through read(2)/write(2) on /dev/fuse.
    Off,
    /// When the kernel offers it (fuse's enable_uring parameter is on).
    Auto,
    /// Always: turns the parameter on if it can, and fails the mount otherwise.
    On,
}

/// Standby request threads by default (see `fuse::standby`): on a 2-CPU VM, fs_mark's
/// creates with fsync from 4 threads went from 9,407 (9,055-11,555) to 10,578
/// (9,722-11,296) files/s with two (medians of 4), and creates without fsync stayed at
/// 21,300-22,100.
const DEFAULT_STANDBY: usize = 2;

/// Request threads by default: one per CPU, at least two. Eight threads on two CPUs
/// only switched between each other. Four on two CPUs helped fsync-heavy work a little
/// (W4 creates with fsync +10 %, W3 +1..11 %) but cost creates without fsync a third
/// (W4 no-fsync 16.5k -> 9.5..11.5k files/s: more threads contend for the fs lock).
fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 16)
}

/// Shortest run of freed space that `discard` (without a size) discards: smaller
/// holes punched into an image file would fragment it on the host, and the next
/// writes there would wait for the host to allocate again.
const DISCARD_MIN_DEFAULT: u64 = 1 << 20;

/// The error for a mount option birchfs does not know.
fn unknown_option(opt: &str) -> String {
    format!(
        "unknown mount option '{opt}' (known: commit=SECONDS, cache_size=SIZE, \
         folio_size=SIZE, dirty_expire=SECONDS, block_dirty=on|off, threads=N, standby_threads=N, \
         fsync_gather=on|off, direct_read=SIZE|off, uring=auto|on|off, uring_threads=N, \
         uring_depth=N, discard[=SIZE], nodiscard, timeout=SECONDS, negative_timeout=SECONDS, \
         ro, rw, norecovery, nosuid, nodev, noexec, noatime, sync, defaults)"
    )
}

/// Parses the `-o` list; unknown options and bad values are errors.
pub(crate) fn parse_mount_options(list: &[String]) -> Result<MountOpts> {
    let mut o = MountOpts {
        fs: Options::default(),
        threads: default_threads(),
        standby: DEFAULT_STANDBY,
        uring: UringMode::Off,
        ring: Default::default(),
        gather: true,
        direct_read: None,
        vfs: VfsFlags::default(),
        timeouts: Default::default(),
    };
    // Seconds, with a fraction if wanted, up to a day.
    let seconds = |opt: &str, v: &str| {
        v.parse::<f64>()
            .ok()
            .filter(|s| (0.0..=86_400.0).contains(s))
            .map(Duration::from_secs_f64)
            .ok_or_else(|| anyhow!("bad value in mount option '{opt}' (0 to 86400 seconds)"))
    };
    let count = |opt: &str, v: &str, range: std::ops::RangeInclusive<usize>| {
        v.parse().ok().filter(|n| range.contains(n)).ok_or_else(|| {
            let (min, max) = range.into_inner();
            anyhow!("bad value in mount option '{opt}' ({min} to {max})")
        })
    };
    let mut cache_given = false;
    for opt in list.iter().filter(|s| !s.is_empty()) {
        match opt.split_once('=') {
            Some(("commit", v)) => {
                let secs: u64 = v
                    .parse()
                    .map_err(|_| anyhow!("bad value in mount option '{opt}'"))?;
                o.fs.commit_interval = Duration::from_secs(secs);
            }
            Some(("cache_size", v)) => {
                o.fs.cache.cache_size =
                    parse_size(v).with_context(|| format!("in mount option '{opt}'"))?;
                cache_given = true;
            }
            Some(("folio_size", v)) => {
                o.fs.cache.folio_size =
                    parse_size(v).with_context(|| format!("in mount option '{opt}'"))?
            }
            Some(("dirty_expire", v)) => {
                let secs: u64 = v
                    .parse()
                    .map_err(|_| anyhow!("bad value in mount option '{opt}'"))?;
                o.fs.cache.dirty_expire = Duration::from_secs(secs);
            }
            Some(("threads", v)) => o.threads = count(opt, v, 1..=256)?,
            Some(("standby_threads", v)) => o.standby = count(opt, v, 0..=64)?,
            Some(("timeout", v)) => o.timeouts.entry = seconds(opt, v)?,
            Some(("negative_timeout", v)) => o.timeouts.negative = seconds(opt, v)?,
            Some(("uring", "on")) => o.uring = UringMode::On,
            Some(("uring", "off")) => o.uring = UringMode::Off,
            Some(("uring", "auto")) => o.uring = UringMode::Auto,
            Some(("uring_threads", v)) => o.ring.threads = count(opt, v, 1..=64)?,
            Some(("uring_depth", v)) => o.ring.depth = count(opt, v, 1..=256)?,
            Some(("block_dirty", "on")) => o.fs.cache.block_dirty = true,
            Some(("block_dirty", "off")) => o.fs.cache.block_dirty = false,
            Some(("fsync_gather", "on")) => o.gather = true,
            Some(("fsync_gather", "off")) => o.gather = false,
            Some(("discard", v)) => {
                let min = parse_size(v).with_context(|| format!("in mount option '{opt}'"))?;
                if min < 4096 {
                    bail!("mount option '{opt}': at least 4K (one block)");
                }
                o.fs.discard = Some(min);
            }
            Some(("direct_read", "off")) => o.direct_read = Some(None),
            Some(("direct_read", v)) => {
                o.direct_read = Some(Some(
                    parse_size(v).with_context(|| format!("in mount option '{opt}'"))?,
                ))
            }
            None => match opt.as_str() {
                "ro" => o.fs.readonly = true,
                "rw" => o.fs.readonly = false,
                "nosuid" => o.vfs.nosuid = true,
                "suid" => o.vfs.nosuid = false,
                "nodev" => o.vfs.nodev = true,
                "dev" => o.vfs.nodev = false,
                "noexec" => o.vfs.noexec = true,
                "exec" => o.vfs.noexec = false,
                // birchfs never updates access times on its own: noatime is what it
                // does anyway, and the kernel then leaves them alone too.
                "noatime" | "nodiratime" => o.vfs.noatime = true,
                "sync" => o.vfs.sync = true,
                "async" => o.vfs.sync = false,
                "discard" => o.fs.discard = Some(DISCARD_MIN_DEFAULT),
                "nodiscard" => o.fs.discard = None,
                "defaults" => {}
                // ext4's and XFS's name, and btrfs's older one.
                "norecovery" | "nologreplay" => o.fs.no_log_replay = true,
                "atime" | "relatime" | "strictatime" | "diratime" | "lazytime" => bail!(
                    "mount option '{opt}': birchfs does not update access times on reads \
                     (it behaves as noatime)"
                ),
                "dirsync" => {
                    bail!("mount option 'dirsync' is not supported: fsync the directory instead")
                }
                _ => bail!(unknown_option(opt)),
            },
            _ => bail!(unknown_option(opt)),
        }
    }
    if o.fs.no_log_replay && !o.fs.readonly {
        bail!(
            "mount option 'norecovery' needs 'ro': a writable mount would empty the log, and \
             the fsyncs in it would be lost"
        );
    }
    o.fs.cache.validate().map_err(|e| anyhow!("{e}"))?;
    // A cache larger than memory is a slip (100T for 100M): writers would fill it
    // with dirty data until memory ran out.
    let usable = birchfs::usable_memory();
    if o.fs.cache.cache_size > usable {
        bail!(
            "cache_size={} is more than the memory this daemon may use ({} MiB: the \
             machine's, its cgroup's limit, or half of what ulimit -v or -d leaves)",
            o.fs.cache.cache_size,
            usable >> 20
        );
    }
    if let Some(room) = birchfs::memory_limit_room() {
        // Each CPU's io_uring queue has its threads: a 2 MiB stack and a 1 MiB payload
        // for each ring entry.
        let ring = if o.uring == UringMode::Off {
            0
        } else {
            let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
            cpus * o.ring.threads as u64 * ((2 << 20) + o.ring.depth as u64 * (1 << 20))
        };
        let need = daemon_overhead(o.threads + o.standby) + ring;
        o.fs.cache.cache_size = fit_memory_limit(room, need, o.fs.cache.cache_size, cache_given)?;
    }
    Ok(o)
}

/// Address space a daemon with `threads` request threads takes besides its cache:
/// measured 99 MiB (allocator arenas, the other threads' stacks, the program) and
/// 18.5 MiB more for each request thread (its stack and its 16 MiB request buffer).
fn daemon_overhead(threads: usize) -> u64 {
    (100 << 20) + threads as u64 * (19 << 20)
}

/// Smallest cache a daemon under `ulimit -v` or `-d` is given.
const MIN_LIMITED_CACHE: u64 = 16 << 20;

/// The cache size for a daemon that `ulimit -v` or `-d` leaves `room` bytes and that
/// needs `need` of them besides its cache: at most half of the rest for a default
/// cache; an error when that is too little, or when a `given` cache_size does not fit
/// (the daemon would abort at the first allocation past the limit).
fn fit_memory_limit(room: u64, need: u64, cache: u64, given: bool) -> Result<u64> {
    let spare = room.saturating_sub(need);
    let what = || {
        format!(
            "ulimit -v or -d leaves this daemon {} MiB, and it takes {} MiB besides its \
             cache (its threads, their buffers, its allocator)",
            room >> 20,
            need >> 20
        )
    };
    if given {
        if cache > spare {
            bail!(
                "cache_size={cache} does not fit: {}; raise the limit or lower cache_size",
                what()
            );
        }
        return Ok(cache);
    }
    if spare / 2 < MIN_LIMITED_CACHE {
        bail!(
            "too little memory to mount: {}, and at least {} MiB for the cache; raise the \
             limit (or lower threads= or uring_threads=)",
            what(),
            (2 * MIN_LIMITED_CACHE) >> 20
        );
    }
    Ok(cache.min(spare / 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memory_limit_leaves_the_daemon_its_needs_and_the_cache_half_the_rest() {
        const MIB: u64 = 1 << 20;
        let need = daemon_overhead(2);
        // A default cache is cut to half of what is left after the daemon's needs.
        assert_eq!(
            fit_memory_limit(need + 200 * MIB, need, 3 << 30, false).unwrap(),
            100 * MIB
        );
        // A smaller default stays.
        assert_eq!(
            fit_memory_limit(need + 200 * MIB, need, 64 * MIB, false).unwrap(),
            64 * MIB
        );
        // Too little left: refused, with the figures.
        let e = fit_memory_limit(need + 20 * MIB, need, 3 << 30, false).unwrap_err();
        assert!(e.to_string().contains("too little memory"), "{e}");
        // More threads need more.
        assert!(daemon_overhead(8) > need + 40 * MIB);
        assert!(fit_memory_limit(need + 40 * MIB, daemon_overhead(8), 3 << 30, false).is_err());
        // A given cache_size must fit whole.
        assert_eq!(
            fit_memory_limit(need + 200 * MIB, need, 150 * MIB, true).unwrap(),
            150 * MIB
        );
        let e = fit_memory_limit(need + 200 * MIB, need, 300 * MIB, true).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
    }

    fn parse(s: &str) -> Result<MountOpts> {
        parse_mount_options(&s.split(',').map(String::from).collect::<Vec<_>>())
    }

    /// norecovery (or nologreplay) leaves the log alone, and only on a read-only mount.
    #[test]
    fn norecovery_needs_ro() {
        for ok in ["ro,norecovery", "nologreplay,ro"] {
            assert!(parse(ok).unwrap().fs.no_log_replay, "{ok}");
        }
        assert!(!parse("ro").unwrap().fs.no_log_replay);
        for bad in ["norecovery", "ro,norecovery,rw"] {
            let e = parse(bad).err().expect(bad).to_string();
            assert!(e.contains("needs 'ro'"), "{bad}: {e}");
        }
    }

    /// Each option lands in its own field; later options override earlier ones.
    #[test]
    fn options_land_in_their_fields() {
        let o = parse(
            "commit=5,cache_size=64M,folio_size=16K,dirty_expire=7,threads=3,\
             fsync_gather=off,direct_read=off,block_dirty=off,ro,nosuid,noexec,uring=auto",
        )
        .unwrap();
        assert_eq!(o.fs.commit_interval, Duration::from_secs(5));
        assert_eq!(o.fs.cache.cache_size, 64 << 20);
        assert_eq!(o.fs.cache.folio_size, 16 << 10);
        assert_eq!(o.fs.cache.dirty_expire, Duration::from_secs(7));
        assert!(!o.fs.cache.block_dirty);
        assert!(o.fs.readonly);
        assert_eq!(o.threads, 3);
        assert_eq!(o.standby, DEFAULT_STANDBY);
        assert_eq!(parse("standby_threads=0").unwrap().standby, 0);
        assert_eq!(parse("standby_threads=5").unwrap().standby, 5);
        assert!(!o.gather);
        assert_eq!(o.direct_read(), None);
        assert_eq!(o.uring, UringMode::Auto);
        assert!(o.vfs.nosuid && o.vfs.noexec && !o.vfs.nodev);
        let o = parse("ro,rw,direct_read=1M,cache_size=32M").unwrap();
        assert!(!o.fs.readonly);
        assert_eq!(o.direct_read(), Some(1 << 20));
        assert_eq!(o.fs.discard, None, "discard is off unless asked for");
        assert_eq!(parse("discard").unwrap().fs.discard, Some(1 << 20));
        assert_eq!(parse("discard=64K").unwrap().fs.discard, Some(64 << 10));
        assert_eq!(parse("discard,nodiscard").unwrap().fs.discard, None);
        let t = parse("timeout=30,negative_timeout=0.5").unwrap().timeouts;
        assert_eq!(t.entry, Duration::from_secs(30));
        assert_eq!(t.negative, Duration::from_millis(500));
        let t = parse("defaults").unwrap().timeouts;
        assert_eq!(
            (t.entry, t.negative),
            (Duration::from_secs(1), Duration::ZERO)
        );
        // Unset, direct_read follows the cache size.
        assert_eq!(
            parse("cache_size=32M").unwrap().direct_read(),
            Some(32 << 20)
        );
    }

    /// Out-of-range counts, bad sizes and a folio size the cache refuses are errors
    /// that name the option.
    #[test]
    fn bad_values_are_refused_with_the_option_named() {
        for (opt, says) in [
            ("threads=0", "threads=0"),
            ("threads=257", "threads=257"),
            ("standby_threads=65", "standby_threads=65"),
            ("standby_threads=-1", "standby_threads=-1"),
            ("uring_depth=x", "uring_depth=x"),
            ("cache_size=lots", "cache_size=lots"),
            ("commit=-1", "commit=-1"),
            ("folio_size=3K", "folio"),
            ("discard=1K", "discard=1K"),
            ("discard=x", "discard=x"),
            ("cache_size=1000000T", "more than the memory"),
            ("timeout=-1", "timeout=-1"),
            ("negative_timeout=90000", "negative_timeout=90000"),
            ("timeout=soon", "timeout=soon"),
        ] {
            let e = format!("{:#}", parse(opt).err().expect(opt));
            assert!(e.contains(says), "{opt}: {e}");
        }
    }
}
