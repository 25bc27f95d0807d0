//! Counters the engine keeps about itself, read by `birchfs stats` and the benchmarks.

use std::sync::atomic::{AtomicU64, Ordering};

/// Monotonic counters; all relaxed atomics.
#[derive(Debug, Default)]
pub struct Stats {
    /// fsync and fdatasync calls.
    pub fsyncs: AtomicU64,
    /// fsyncs that returned without I/O (nothing new to make durable).
    pub fsyncs_noop: AtomicU64,
    /// fsyncs of an inode already logged in the running generation (only its new
    /// changes went to the log).
    pub fsyncs_relogged: AtomicU64,
    /// Full commits.
    pub commits: AtomicU64,
    /// Bytes of file data written by users.
    pub user_bytes: AtomicU64,
    /// Bytes of data blocks written to the device.
    pub dev_data_bytes: AtomicU64,
    /// Of those, bytes written in place into preallocated blocks (no new space).
    pub prealloc_filled_bytes: AtomicU64,
    /// Bytes of file data read by users.
    pub user_read_bytes: AtomicU64,
    /// Bytes of data blocks read from the device (cache misses and readahead).
    pub dev_read_bytes: AtomicU64,
    /// Runs of contiguous dirty blocks written back (each allocated in one piece).
    pub writeback_runs: AtomicU64,
    /// Files written back so that a replacement survives a crash whole: before a
    /// rename puts them over another file, or at their close after a truncate to 0.
    pub replace_writebacks: AtomicU64,
    /// Readahead windows read by the readahead thread, ahead of the reader.
    pub readahead_async: AtomicU64,
    /// Reads that waited for the device (blocks they return were not cached).
    pub read_waits: AtomicU64,
    /// Bytes read by users through opens that bypass the kernel's page cache.
    pub direct_read_bytes: AtomicU64,
    /// Bytes of file data shared by clone or copy_file_range instead of copied.
    pub cloned_bytes: AtomicU64,
    /// Bytes of tree nodes written to the device.
    pub dev_meta_bytes: AtomicU64,
    /// Bytes of superblocks written to the device.
    pub dev_super_bytes: AtomicU64,
    /// Bytes of log records written to the device.
    pub dev_log_bytes: AtomicU64,
    /// Bytes of free space discarded (fstrim, and online discard after commits).
    pub dev_discarded_bytes: AtomicU64,
    /// Device flushes.
    pub flushes: AtomicU64,
    /// Log batches written: one per group commit that had records of its own to write.
    pub log_commits: AtomicU64,
    /// Group commits that began while another was still at work (FUSE over
    /// io_uring lets several run at once); one whose records another's batch already
    /// wrote only flushes (or shares that batch's flush), so this can exceed
    /// `log_commits`, which counts batches.
    pub log_commits_overlapped: AtomicU64,
    /// Group commits that waited for a log flush already under way, which covered
    /// their records, instead of flushing again (several at once, over io_uring).
    pub log_flushes_shared: AtomicU64,
    /// fsyncs the log could not serve, done as full commits.
    pub fallbacks: AtomicU64,
    /// Commits the device refused for want of space, kept to be written with the next.
    pub commits_deferred: AtomicU64,
    /// Times memory pressure lowered the size the page cache keeps to.
    pub memory_squeezes: AtomicU64,
    /// Copies of tree nodes shared with a snapshot (each adds a reference per child).
    pub shared_cows: AtomicU64,
    /// FUSE requests that came through io_uring queues instead of `/dev/fuse`.
    pub uring_requests: AtomicU64,
    /// FUSE requests served by standby request threads (see `fuse::standby`).
    pub standby_served: AtomicU64,
    /// Times a standby request thread parked, no fsync having come for a while.
    pub standby_parks: AtomicU64,
    /// FUSE requests served, per kind.
    pub requests: RequestCounts,
    /// Measurements by the group commit that found gathering fsyncs pays.
    pub gather_chosen: AtomicU64,
    /// Measurements by the group commit that found it does not.
    pub gather_declined: AtomicU64,
    /// Measurements by the group commit that found two committers at once pay.
    pub gather_overlap: AtomicU64,
    /// fsync latency.
    pub fsync_latency: Histogram,
    /// Full commit latency.
    pub commit_latency: Histogram,
    /// Latency of the device flushes that make log batches durable: the device's
    /// share of an fsync.
    pub log_flush_latency: Histogram,
    /// Time to write a log batch to the device, before the flush that makes it durable.
    pub log_write_latency: Histogram,
    /// Time an fsync took to write back its file's cached data and find what the log
    /// must make durable, before it could wait for the log.
    pub fsync_prepare_latency: Histogram,
    /// Time a ready fsync waited for a group commit to take it (the flush of the
    /// group before it, mostly): the group commit's share of an fsync.
    pub fsync_queue_latency: Histogram,
    /// Time a group commit waited, before it took its group, for fsyncs still being
    /// prepared and for threads expected back (see `fuse::group`).
    pub fsync_gather_latency: Histogram,
}

/// Request kinds counted: every FUSE opcode below this.
const REQUEST_KINDS: usize = 64;

/// The name of FUSE opcode `op` (`op<N>` for one without a name here).
fn request_name(op: usize) -> String {
    crate::fuse::abi::opcode_name(op as u32).map_or_else(|| format!("op{op}"), str::to_string)
}

/// FUSE requests served, per opcode.
#[derive(Debug)]
pub struct RequestCounts([AtomicU64; REQUEST_KINDS]);

impl Default for RequestCounts {
    fn default() -> Self {
        RequestCounts(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl RequestCounts {
    /// Counts one request with FUSE opcode `op` (opcodes past the table go uncounted).
    pub(crate) fn count(&self, op: u32) {
        if let Some(c) = self.0.get(op as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn snapshot(&self) -> RequestTally {
        RequestTally(std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed)))
    }
}

/// A copy of [`RequestCounts`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestTally([u64; REQUEST_KINDS]);

impl Default for RequestTally {
    fn default() -> Self {
        RequestTally([0; REQUEST_KINDS])
    }
}

impl RequestTally {
    /// The kinds served at least once, by name, in opcode order, with their counts.
    pub fn served(&self) -> Vec<(String, u64)> {
        (0..REQUEST_KINDS)
            .filter(|&op| self.0[op] > 0)
            .map(|op| (request_name(op), self.0[op]))
            .collect()
    }

    /// Requests with FUSE opcode `op` (0 for one past the table).
    pub fn of(&self, op: u32) -> u64 {
        self.0.get(op as usize).copied().unwrap_or(0)
    }

    /// The JSON object of [`RequestTally::served`].
    fn json(&self) -> String {
        let fields: Vec<String> = self
            .served()
            .into_iter()
            .map(|(name, n)| format!("\"{name}\":{n}"))
            .collect();
        format!("{{{}}}", fields.join(","))
    }
}

impl Stats {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// A plain copy of every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StatsSnapshot {
            fsyncs: g(&self.fsyncs),
            fsyncs_noop: g(&self.fsyncs_noop),
            fsyncs_relogged: g(&self.fsyncs_relogged),
            commits: g(&self.commits),
            user_bytes: g(&self.user_bytes),
            dev_data_bytes: g(&self.dev_data_bytes),
            prealloc_filled_bytes: g(&self.prealloc_filled_bytes),
            user_read_bytes: g(&self.user_read_bytes),
            dev_read_bytes: g(&self.dev_read_bytes),
            writeback_runs: g(&self.writeback_runs),
            replace_writebacks: g(&self.replace_writebacks),
            readahead_async: g(&self.readahead_async),
            read_waits: g(&self.read_waits),
            direct_read_bytes: g(&self.direct_read_bytes),
            direct_handles: 0,
            cloned_bytes: g(&self.cloned_bytes),
            cache_bytes: 0,
            cache_dirty_bytes: 0,
            cache_limit: 0,
            readonly: false,
            dev_meta_bytes: g(&self.dev_meta_bytes),
            dev_super_bytes: g(&self.dev_super_bytes),
            dev_log_bytes: g(&self.dev_log_bytes),
            dev_discarded_bytes: g(&self.dev_discarded_bytes),
            flushes: g(&self.flushes),
            log_commits: g(&self.log_commits),
            log_commits_overlapped: g(&self.log_commits_overlapped),
            log_flushes_shared: g(&self.log_flushes_shared),
            fallbacks: g(&self.fallbacks),
            commits_deferred: g(&self.commits_deferred),
            memory_squeezes: g(&self.memory_squeezes),
            shared_cows: g(&self.shared_cows),
            uring_requests: g(&self.uring_requests),
            standby_served: g(&self.standby_served),
            standby_parks: g(&self.standby_parks),
            requests: self.requests.snapshot(),
            gather_chosen: g(&self.gather_chosen),
            gather_declined: g(&self.gather_declined),
            gather_overlap: g(&self.gather_overlap),
            fsync_latency: self.fsync_latency.summary(),
            commit_latency: self.commit_latency.summary(),
            log_flush_latency: self.log_flush_latency.summary(),
            log_write_latency: self.log_write_latency.summary(),
            fsync_prepare_latency: self.fsync_prepare_latency.summary(),
            fsync_queue_latency: self.fsync_queue_latency.summary(),
            fsync_gather_latency: self.fsync_gather_latency.summary(),
        }
    }
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StatsSnapshot {
    /// See [`Stats::fsyncs`].
    pub fsyncs: u64,
    /// See [`Stats::fsyncs_noop`].
    pub fsyncs_noop: u64,
    /// See [`Stats::fsyncs_relogged`].
    pub fsyncs_relogged: u64,
    /// See [`Stats::commits`].
    pub commits: u64,
    /// See [`Stats::user_bytes`].
    pub user_bytes: u64,
    /// See [`Stats::dev_data_bytes`].
    pub dev_data_bytes: u64,
    /// See [`Stats::prealloc_filled_bytes`].
    pub prealloc_filled_bytes: u64,
    /// See [`Stats::user_read_bytes`].
    pub user_read_bytes: u64,
    /// See [`Stats::dev_read_bytes`].
    pub dev_read_bytes: u64,
    /// See [`Stats::writeback_runs`].
    pub writeback_runs: u64,
    /// See [`Stats::replace_writebacks`].
    pub replace_writebacks: u64,
    /// See [`Stats::readahead_async`].
    pub readahead_async: u64,
    /// See [`Stats::read_waits`].
    pub read_waits: u64,
    /// See [`Stats::direct_read_bytes`].
    pub direct_read_bytes: u64,
    /// Open handles that bypass the kernel's page cache now (a gauge, filled in by
    /// the FUSE server).
    pub direct_handles: u64,
    /// See [`Stats::cloned_bytes`].
    pub cloned_bytes: u64,
    /// Bytes held by the page cache now (a gauge, filled in by `Fs::stats`).
    pub cache_bytes: u64,
    /// Bytes of dirty blocks in the page cache now (a gauge).
    pub cache_dirty_bytes: u64,
    /// The size the page cache keeps to now (`cache_size=`, or less while memory is
    /// short).
    pub cache_limit: u64,
    /// Whether the filesystem was opened read-only (`-o ro`).
    pub readonly: bool,
    /// See [`Stats::dev_meta_bytes`].
    pub dev_meta_bytes: u64,
    /// See [`Stats::dev_super_bytes`].
    pub dev_super_bytes: u64,
    /// See [`Stats::dev_log_bytes`].
    pub dev_log_bytes: u64,
    /// See [`Stats::dev_discarded_bytes`].
    pub dev_discarded_bytes: u64,
    /// See [`Stats::flushes`].
    pub flushes: u64,
    /// See [`Stats::log_commits`].
    pub log_commits: u64,
    /// See [`Stats::log_commits_overlapped`].
    pub log_commits_overlapped: u64,
    /// See [`Stats::log_flushes_shared`].
    pub log_flushes_shared: u64,
    /// See [`Stats::fallbacks`].
    pub fallbacks: u64,
    /// See [`Stats::commits_deferred`].
    pub commits_deferred: u64,
    /// See [`Stats::memory_squeezes`].
    pub memory_squeezes: u64,
    /// See [`Stats::shared_cows`].
    pub shared_cows: u64,
    /// See [`Stats::uring_requests`].
    pub uring_requests: u64,
    /// See [`Stats::standby_served`].
    pub standby_served: u64,
    /// See [`Stats::standby_parks`].
    pub standby_parks: u64,
    /// See [`Stats::requests`].
    pub requests: RequestTally,
    /// See [`Stats::gather_chosen`].
    pub gather_chosen: u64,
    /// See [`Stats::gather_declined`].
    pub gather_declined: u64,
    /// See [`Stats::gather_overlap`].
    pub gather_overlap: u64,
    /// See [`Stats::fsync_latency`].
    pub fsync_latency: LatencySummary,
    /// See [`Stats::commit_latency`].
    pub commit_latency: LatencySummary,
    /// See [`Stats::log_flush_latency`].
    pub log_flush_latency: LatencySummary,
    /// See [`Stats::log_write_latency`].
    pub log_write_latency: LatencySummary,
    /// See [`Stats::fsync_prepare_latency`].
    pub fsync_prepare_latency: LatencySummary,
    /// See [`Stats::fsync_queue_latency`].
    pub fsync_queue_latency: LatencySummary,
    /// See [`Stats::fsync_gather_latency`].
    pub fsync_gather_latency: LatencySummary,
}

/// Bits of a latency below its leading one that pick its bucket: each power of two of
/// microseconds is split into 2^SUB_BITS buckets of equal width, so a percentile is
/// off by at most 1/16 of its value (below 16 µs, by at most 1 µs).
const SUB_BITS: u32 = 4;
/// Buckets per power of two.
const SUB: usize = 1 << SUB_BITS;
/// Powers of two with buckets of their own: latencies of 2^40 µs (12 days) and more
/// share the last bucket.
const POWERS: usize = 40 - SUB_BITS as usize;
/// Buckets of a latency histogram (see [`bucket_of`]).
const BUCKETS: usize = SUB + POWERS * SUB;

/// The bucket of a latency of `us` microseconds: below 2^SUB_BITS, one per
/// microsecond; above, 2^SUB_BITS per power of two.
fn bucket_of(us: u64) -> usize {
    if us < SUB as u64 {
        return us as usize;
    }
    let e = 63 - us.leading_zeros(); // us is in [2^e, 2^(e+1)), e >= SUB_BITS
    let sub = (us >> (e - SUB_BITS)) as usize - SUB;
    (SUB + (e - SUB_BITS) as usize * SUB + sub).min(BUCKETS - 1)
}

/// Where bucket `i` ends: the smallest latency (µs) above it.
fn bucket_end(i: usize) -> u64 {
    if i < SUB {
        return i as u64 + 1;
    }
    let e = (i - SUB) / SUB; // power above 2^SUB_BITS
    let sub = (i - SUB) % SUB;
    ((SUB + sub + 1) as u64) << e
}

/// A log-linear latency histogram in microseconds (like seed 4's htree_insert table,
/// with finer buckets).
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS],
    count: AtomicU64,
    sum_ns: AtomicU64,
    max_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
            max_ns: AtomicU64::new(0),
        }
    }
}

/// Summary of a histogram: count, mean and percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencySummary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median (upper edge of its bucket, capped at max: at most 1/16 above).
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl Histogram {
    /// Records one latency.
    pub fn record(&self, d: std::time::Duration) {
        let ns = d.as_nanos().min(u64::MAX as u128) as u64;
        let us = ns / 1000;
        self.buckets[bucket_of(us)].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// Count, mean and percentiles.
    pub fn summary(&self) -> LatencySummary {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let n: u64 = counts.iter().sum();
        if n == 0 {
            return LatencySummary::default();
        }
        let max = self.max_ns.load(Ordering::Relaxed) as f64 / 1000.0;
        let pct = |p: f64| {
            let want = ((n as f64) * p).ceil().max(1.0) as u64;
            let mut seen = 0;
            for (i, c) in counts.iter().enumerate() {
                seen += c;
                if seen >= want {
                    return (bucket_end(i) as f64).min(max);
                }
            }
            max
        };
        LatencySummary {
            count: n,
            mean: self.sum_ns.load(Ordering::Relaxed) as f64 / n as f64 / 1000.0,
            p50: pct(0.5),
            p90: pct(0.9),
            p99: pct(0.99),
            max,
        }
    }
}

impl LatencySummary {
    fn json(&self) -> String {
        format!(
            "{{\"count\":{},\"mean\":{:.1},\"p50\":{:.1},\"p90\":{:.1},\"p99\":{:.1},\"max\":{:.1}}}",
            self.count, self.mean, self.p50, self.p90, self.p99, self.max
        )
    }
}

impl StatsSnapshot {
    /// Bytes written to the device, all kinds.
    pub fn device_total(&self) -> u64 {
        self.dev_data_bytes + self.dev_meta_bytes + self.dev_super_bytes + self.dev_log_bytes
    }

    /// The JSON object `birchfs stats --json` prints.
    pub fn to_json(&self) -> String {
        format!(
            concat!(
                "{{\"readonly\":{},\"fsyncs\":{},\"fsyncs_noop\":{},\"fsyncs_relogged\":{},\"log_commits\":{},\"log_commits_overlapped\":{},\"log_flushes_shared\":{},\"full_commits\":{},",
                "\"fallbacks\":{},\"commits_deferred\":{},\"shared_cows\":{},\"bytes\":{{\"user\":{},\"data\":{},\"metadata\":{},\"log\":{},",
                "\"superblock\":{},\"device_total\":{},\"prealloc_filled\":{},\"user_read\":{},\"device_read\":{},\"cloned\":{},\"direct_read\":{},\"discarded\":{}}},",
                "\"writeback_runs\":{},\"replace_writebacks\":{},\"readahead_async\":{},\"read_waits\":{},\"direct_handles\":{},\"cache\":{{\"bytes\":{},\"dirty\":{},\"limit\":{},\"squeezes\":{}}},\"flushes\":{},\"uring_requests\":{},\"standby\":{{\"served\":{},\"parks\":{}}},",
                "\"requests\":{},\"gather\":{{\"chosen\":{},\"declined\":{},\"overlap\":{}}},",
                "\"latency_us\":{{\"fsync\":{},\"commit\":{},\"log_flush\":{},\"log_write\":{},\"fsync_prepare\":{},\"fsync_queue\":{},\"fsync_gather\":{}}}}}"
            ),
            self.readonly,
            self.fsyncs,
            self.fsyncs_noop,
            self.fsyncs_relogged,
            self.log_commits,
            self.log_commits_overlapped,
            self.log_flushes_shared,
            self.commits,
            self.fallbacks,
            self.commits_deferred,
            self.shared_cows,
            self.user_bytes,
            self.dev_data_bytes,
            self.dev_meta_bytes,
            self.dev_log_bytes,
            self.dev_super_bytes,
            self.device_total(),
            self.prealloc_filled_bytes,
            self.user_read_bytes,
            self.dev_read_bytes,
            self.cloned_bytes,
            self.direct_read_bytes,
            self.dev_discarded_bytes,
            self.writeback_runs,
            self.replace_writebacks,
            self.readahead_async,
            self.read_waits,
            self.direct_handles,
            self.cache_bytes,
            self.cache_dirty_bytes,
            self.cache_limit,
            self.memory_squeezes,
            self.flushes,
            self.uring_requests,
            self.standby_served,
            self.standby_parks,
            self.requests.json(),
            self.gather_chosen,
            self.gather_declined,
            self.gather_overlap,
            self.fsync_latency.json(),
            self.commit_latency.json(),
            self.log_flush_latency.json(),
            self.log_write_latency.json(),
            self.fsync_prepare_latency.json(),
            self.fsync_queue_latency.json(),
            self.fsync_gather_latency.json()
        )
    }

    /// A human-readable table.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let row = |s: &mut String, k: &str, v: String| s.push_str(&format!("{k:<22} {v}\n"));
        row(&mut s, "fsyncs", self.fsyncs.to_string());
        row(&mut s, "  answered at once", self.fsyncs_noop.to_string());
        row(
            &mut s,
            "  of inodes logged before",
            self.fsyncs_relogged.to_string(),
        );
        row(&mut s, "log commits", self.log_commits.to_string());
        row(
            &mut s,
            "overlapped commits",
            self.log_commits_overlapped.to_string(),
        );
        row(
            &mut s,
            "  sharing a flush",
            self.log_flushes_shared.to_string(),
        );
        row(&mut s, "full commits", self.commits.to_string());
        row(&mut s, "log fallbacks", self.fallbacks.to_string());
        row(
            &mut s,
            "commits deferred (no room)",
            self.commits_deferred.to_string(),
        );
        row(
            &mut s,
            "gathering measured",
            format!(
                "{} times paid, {} not, {} two committers paid more",
                self.gather_chosen, self.gather_declined, self.gather_overlap
            ),
        );
        row(&mut s, "shared node copies", self.shared_cows.to_string());
        row(
            &mut s,
            "bytes written by users",
            self.user_bytes.to_string(),
        );
        row(
            &mut s,
            "device bytes: data",
            self.dev_data_bytes.to_string(),
        );
        row(
            &mut s,
            "  of it into preallocated blocks",
            self.prealloc_filled_bytes.to_string(),
        );
        row(
            &mut s,
            "device bytes: metadata",
            self.dev_meta_bytes.to_string(),
        );
        row(&mut s, "device bytes: log", self.dev_log_bytes.to_string());
        row(
            &mut s,
            "device bytes: super",
            self.dev_super_bytes.to_string(),
        );
        row(
            &mut s,
            "device bytes discarded",
            self.dev_discarded_bytes.to_string(),
        );
        row(&mut s, "device flushes", self.flushes.to_string());
        row(
            &mut s,
            "bytes read by users",
            self.user_read_bytes.to_string(),
        );
        row(&mut s, "device bytes read", self.dev_read_bytes.to_string());
        row(&mut s, "writeback runs", self.writeback_runs.to_string());
        row(
            &mut s,
            "files written back to replace another",
            self.replace_writebacks.to_string(),
        );
        row(
            &mut s,
            "readahead windows ahead",
            self.readahead_async.to_string(),
        );
        row(
            &mut s,
            "reads that waited for the device",
            self.read_waits.to_string(),
        );
        row(&mut s, "bytes cloned", self.cloned_bytes.to_string());
        row(
            &mut s,
            "bytes read past the kernel cache",
            self.direct_read_bytes.to_string(),
        );
        row(
            &mut s,
            "open handles past the kernel cache",
            self.direct_handles.to_string(),
        );
        row(
            &mut s,
            "requests via io_uring",
            self.uring_requests.to_string(),
        );
        row(
            &mut s,
            "requests by standby threads",
            self.standby_served.to_string(),
        );
        row(
            &mut s,
            "standby thread parks",
            self.standby_parks.to_string(),
        );
        for (name, n) in self.requests.served() {
            row(&mut s, &format!("requests: {name}"), n.to_string());
        }
        row(&mut s, "page cache bytes", self.cache_bytes.to_string());
        row(
            &mut s,
            "page cache dirty",
            self.cache_dirty_bytes.to_string(),
        );
        row(&mut s, "page cache limit", self.cache_limit.to_string());
        row(
            &mut s,
            "page cache squeezes",
            self.memory_squeezes.to_string(),
        );
        for (name, l) in [
            ("fsync", &self.fsync_latency),
            ("commit", &self.commit_latency),
            ("log flush", &self.log_flush_latency),
            ("log write", &self.log_write_latency),
            ("fsync prepare", &self.fsync_prepare_latency),
            ("fsync queue", &self.fsync_queue_latency),
            ("fsync gather", &self.fsync_gather_latency),
        ] {
            row(
                &mut s,
                &format!("{name} latency (µs)"),
                format!(
                    "n={} mean={:.0} p50={:.0} p90={:.0} p99={:.0} max={:.0}",
                    l.count, l.mean, l.p50, l.p90, l.p99, l.max
                ),
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Requests are counted per opcode and shown by name, only the kinds served; an
    /// opcode past the table is not counted, and one without a name shows its number.
    #[test]
    fn requests_are_counted_and_named_by_kind() {
        let st = Stats::default();
        for op in [35, 35, 20, 53, 500] {
            st.requests.count(op);
        }
        let snap = st.snapshot();
        assert_eq!(snap.requests.of(35), 2);
        assert_eq!(snap.requests.of(500), 0);
        assert_eq!(
            snap.requests.served(),
            [
                ("fsync".to_string(), 1),
                ("create".to_string(), 2),
                ("op53".to_string(), 1)
            ]
        );
        assert!(
            snap.to_json()
                .contains("\"requests\":{\"fsync\":1,\"create\":2,\"op53\":1},"),
            "{}",
            snap.to_json()
        );
        assert!(snap.to_text().contains("requests: create"));
    }

    #[test]
    fn histogram_buckets_tile_the_range_and_stay_within_a_sixteenth() {
        let mut prev_end = 0;
        for i in 0..BUCKETS - 1 {
            let end = bucket_end(i);
            assert!(end > prev_end, "bucket {i}");
            // The bucket's first and last value map to it, the next one past it.
            assert_eq!(bucket_of(prev_end), i, "first of {i}");
            assert_eq!(bucket_of(end - 1), i, "last of {i}");
            assert_eq!(bucket_of(end), i + 1, "after {i}");
            // Width at most 1/16 of where it starts (1 µs below 16 µs).
            assert!((end - prev_end) * 16 <= prev_end.max(16), "bucket {i}");
            prev_end = end;
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(15), 15);
        assert_eq!(bucket_of(16), 16);
        assert_eq!(bucket_end(16), 17);
        // 300 µs lies in [288, 304): 16 µs wide, as every bucket in [256, 512).
        assert_eq!(bucket_of(300), bucket_of(288));
        assert_eq!(bucket_of(300), bucket_of(303));
        assert_eq!(bucket_end(bucket_of(300)), 304);
        assert_ne!(bucket_of(300), bucket_of(287));
    }

    #[test]
    fn histogram_percentiles_fall_in_the_right_buckets() {
        let h = Histogram::default();
        for _ in 0..90 {
            h.record(Duration::from_micros(100));
        }
        for _ in 0..10 {
            h.record(Duration::from_millis(10));
        }
        let s = h.summary();
        assert_eq!(s.count, 100);
        // Within 1/16 above the true value (power-of-two buckets said 128 and 16384).
        assert!((100.0..=106.25).contains(&s.p50), "{s:?}");
        assert!((100.0..=106.25).contains(&s.p90), "{s:?}");
        assert_eq!(s.p99, 10_000.0, "capped at the max: {s:?}");
        assert_eq!(s.max, 10_000.0);
        assert!((s.mean - 1090.0).abs() < 1.0);
        let j = StatsSnapshot {
            fsyncs: 3,
            fsync_latency: s,
            ..Default::default()
        }
        .to_json();
        assert!(j.starts_with("{\"readonly\":false,\"fsyncs\":3,"), "{j}");
        assert!(j.contains("\"p99\":"), "{j}");
    }
}
