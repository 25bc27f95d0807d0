//! How much memory the daemon may use (physical memory, its cgroup's limit, or what
//! its address-space and data limits leave), and whether the system is short of it
//! (pressure stall information), for sizing the caches and shrinking them under
//! pressure.

use std::sync::OnceLock;
use std::time::Instant;

/// The memory this process may use: physical memory, or its cgroup's limit when
/// lower (as in a container), or half of what `ulimit -v` or `-d` leaves (see
/// [`memory_limit_room`]). Read once per process.
pub fn usable_memory() -> u64 {
    static USABLE: OnceLock<u64> = OnceLock::new();
    *USABLE.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let (pages, psize) = unsafe {
            (
                libc::sysconf(libc::_SC_PHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let ram = if pages > 0 && psize > 0 {
            pages as u64 * psize as u64
        } else {
            1 << 30
        };
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let limited = cgroup_memory_limit(&read).map_or(ram, |l| l.min(ram));
        memory_limit_room().map_or(limited, |r| (r / 2).min(limited))
    })
}

/// What the address-space and data limits (`ulimit -v`, `ulimit -d`) leave above what
/// this process maps now, `None` without such a limit. Past it the process cannot
/// allocate at all: a cache sized beyond it would abort at its first large allocation.
/// [`usable_memory`] takes half, the other half kept for thread stacks, allocator
/// arenas and the rest of the process.
pub fn memory_limit_room() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    limit_room(
        &status,
        crate::dev::soft_limit(libc::RLIMIT_AS),
        crate::dev::soft_limit(libc::RLIMIT_DATA),
    )
}

/// The room the address-space and data limits leave above the sizes `status` (the
/// text of /proc/self/status) gives (`VmSize`, `VmData`).
fn limit_room(status: &str, address_space: Option<u64>, data: Option<u64>) -> Option<u64> {
    let kib = |field: &str| {
        status.lines().find_map(|l| {
            let v = l.strip_prefix(field)?.trim().strip_suffix("kB")?;
            v.trim().parse::<u64>().ok().map(|k| k << 10)
        })
    };
    let room =
        |limit: Option<u64>, field: &str| limit.map(|l| l.saturating_sub(kib(field).unwrap_or(0)));
    match (room(address_space, "VmSize:"), room(data, "VmData:")) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The memory limit of this process's cgroup (and its ancestors), `None` when there
/// is none; `read` gives a file's text (/proc/self/cgroup, files under
/// /sys/fs/cgroup). A container sees its own cgroup as the root of both.
fn cgroup_memory_limit(read: &dyn Fn(&str) -> Option<String>) -> Option<u64> {
    // Limits this large mean none (cgroup v1 writes "no limit" as about 2^63).
    let real = |v: u64| (v < 1 << 60).then_some(v);
    let own = read("/proc/self/cgroup")?;
    let mut limit: Option<u64> = None;
    for line in own.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let found = if let Some(v2) = v2_path(line) {
            // cgroup v2: every ancestor's memory.max applies.
            ancestry(v2)
                .iter()
                .filter_map(|p| read(&format!("/sys/fs/cgroup{p}/memory.max")))
                .filter_map(|t| real(t.trim().parse().ok()?))
                .min()
        } else if ctrls.split(',').any(|c| c == "memory") {
            // cgroup v1: memory.stat has the limit its ancestors give (the first
            // directory of the chain that exists: a container may see only its own).
            ancestry(path)
                .iter()
                .find_map(|p| read(&format!("/sys/fs/cgroup/memory{p}/memory.stat")))
                .and_then(|t| {
                    t.lines().find_map(|l| {
                        real(
                            l.strip_prefix("hierarchical_memory_limit ")?
                                .trim()
                                .parse()
                                .ok()?,
                        )
                    })
                })
        } else {
            None
        };
        limit = match (limit, found) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    limit
}

/// The cgroup v2 path in a line of /proc/self/cgroup (`0::PATH`), `None` for a v1 line.
fn v2_path(line: &str) -> Option<&str> {
    line.strip_prefix("0::")
}

/// A cgroup's path, then each ancestor's, up to the root ("").
fn ancestry(path: &str) -> Vec<String> {
    let mut p = path.trim_end_matches('/').to_string();
    let mut v = vec![p.clone()];
    while let Some(i) = p.rfind('/') {
        p.truncate(i);
        v.push(p.clone());
    }
    v
}

/// Watches the pressure stall information of the system and, under cgroup v2, of this
/// process's cgroup: memory is short while tasks waited for it at least a tenth of
/// the time since the last look (the stall counters' growth, not their 10-second
/// average, which lags for seconds after the pressure ends).
pub struct MemoryPressure {
    /// Each watched file, with its `some total=` (µs) and when it was read.
    files: Vec<(String, Option<(u64, Instant)>)>,
}

impl MemoryPressure {
    /// Watches /proc/pressure/memory and this process's cgroup's memory.pressure.
    pub fn new() -> MemoryPressure {
        let mut files = vec!["/proc/pressure/memory".to_string()];
        let own = std::fs::read_to_string("/proc/self/cgroup").ok();
        if let Some(p) = own.as_deref().and_then(|t| t.lines().find_map(v2_path)) {
            files.push(format!(
                "/sys/fs/cgroup{}/memory.pressure",
                p.trim_end_matches('/')
            ));
        }
        MemoryPressure {
            files: files.into_iter().map(|f| (f, None)).collect(),
        }
    }

    /// Whether memory has been short since the last call (never on the first).
    pub fn short(&mut self) -> bool {
        let now = Instant::now();
        let mut short = false;
        for (path, last) in &mut self.files {
            let total = std::fs::read_to_string(&*path)
                .ok()
                .and_then(|t| psi_some_total(&t));
            short |= stalled_a_tenth(*last, total, now);
            *last = total.map(|t| (t, now));
        }
        short
    }
}

impl Default for MemoryPressure {
    fn default() -> Self {
        MemoryPressure::new()
    }
}

/// Whether the stall counter grew by at least a tenth of the time since `last`.
fn stalled_a_tenth(last: Option<(u64, Instant)>, total: Option<u64>, now: Instant) -> bool {
    match (last, total) {
        (Some((was, then)), Some(t)) => {
            let elapsed = now.duration_since(then).as_micros() as u64;
            elapsed > 0 && t.saturating_sub(was) * 10 >= elapsed
        }
        _ => false,
    }
}

/// The `some total=` counter (µs of stall) of a pressure stall information file.
fn psi_some_total(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("some "))?
        .split_whitespace()
        .find_map(|f| f.strip_prefix("total="))?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_space_and_data_limits_leave_room_above_what_is_mapped() {
        let status =
            "Name:\tbirchfs\nVmPeak:\t  20000 kB\nVmSize:\t  10240 kB\nVmData:\t   2048 kB\n";
        assert_eq!(limit_room(status, None, None), None);
        assert_eq!(limit_room(status, Some(300 << 20), None), Some(290 << 20));
        assert_eq!(limit_room(status, None, Some(100 << 20)), Some(98 << 20));
        assert_eq!(
            limit_room(status, Some(300 << 20), Some(100 << 20)),
            Some(98 << 20)
        );
        // Already over the limit: nothing left.
        assert_eq!(limit_room(status, Some(1 << 20), None), Some(0));
        // No status to read: the whole limit is room.
        assert_eq!(limit_room("", Some(64 << 20), None), Some(64 << 20));
    }

    /// The cgroup memory limit is found for v2 (the lowest on the way up, "max" none),
    /// for v1 (memory.stat's hierarchical limit, at the first directory that exists),
    /// and is none without one.
    #[test]
    fn the_cgroup_memory_limit_is_read_for_v1_and_v2() {
        use std::collections::HashMap;
        let fake = |files: &[(&str, &str)]| {
            let m: HashMap<String, String> = files
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            move |p: &str| m.get(p).cloned()
        };
        let v2 = fake(&[
            ("/proc/self/cgroup", "0::/a/b\n"),
            ("/sys/fs/cgroup/a/b/memory.max", "max\n"),
            ("/sys/fs/cgroup/a/memory.max", "536870912\n"),
            ("/sys/fs/cgroup/memory.max", "1073741824\n"),
        ]);
        assert_eq!(cgroup_memory_limit(&v2), Some(512 << 20));
        let v2_none = fake(&[
            ("/proc/self/cgroup", "0::/\n"),
            ("/sys/fs/cgroup/memory.max", "max\n"),
        ]);
        assert_eq!(cgroup_memory_limit(&v2_none), None);
        let v1 = fake(&[
            (
                "/proc/self/cgroup",
                "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n",
            ),
            (
                "/sys/fs/cgroup/memory/memory.stat",
                "cache 0\nhierarchical_memory_limit 268435456\n",
            ),
        ]);
        assert_eq!(
            cgroup_memory_limit(&v1),
            Some(256 << 20),
            "a container's view"
        );
        let v1_none = fake(&[
            ("/proc/self/cgroup", "4:memory:/p\n"),
            (
                "/sys/fs/cgroup/memory/p/memory.stat",
                "hierarchical_memory_limit 9223372036854771712\n",
            ),
        ]);
        assert_eq!(cgroup_memory_limit(&v1_none), None);
        assert_eq!(cgroup_memory_limit(&fake(&[])), None, "no /proc");
        assert_eq!(ancestry("/a/b/"), ["/a/b", "/a", ""]);
        assert_eq!(ancestry("/"), [""]);
    }

    /// Pressure is the stall counter's growth: a tenth of the elapsed time or more is
    /// short, less is not, and a first reading or a missing file never is.
    #[test]
    fn memory_is_short_when_stalls_grow_by_a_tenth_of_the_time() {
        let t = "some avg10=0.00 avg60=0.00 avg300=0.00 total=4368969\n\
                 full avg10=0.00 avg60=0.00 avg300=0.00 total=2456867\n";
        assert_eq!(psi_some_total(t), Some(4_368_969));
        assert_eq!(psi_some_total("full total=1\n"), None);
        let t0 = Instant::now();
        let t1 = t0 + std::time::Duration::from_secs(1);
        assert!(stalled_a_tenth(Some((1_000, t0)), Some(101_000), t1));
        assert!(!stalled_a_tenth(Some((1_000, t0)), Some(99_000), t1));
        assert!(!stalled_a_tenth(None, Some(5_000_000), t1), "first reading");
        assert!(!stalled_a_tenth(Some((1_000, t0)), None, t1), "no file");
        // The real files can be read (where the kernel has them) and a first look
        // finds no pressure.
        assert!(!MemoryPressure::new().short());
    }
}
