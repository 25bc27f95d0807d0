//! Counters the engine keeps about itself, read by `birchfs stats` and the benchmarks.

use std::sync::atomic::{AtomicU64, Ordering};

/// Monotonic counters; all relaxed atomics.
#[derive(Debug, Default)]
pub struct Stats {
    /// fsync and fdatasync calls.
    pub fsyncs: AtomicU64,
    /// fsyncs that returned without I/O (nothing new to make durable).
    pub fsyncs_noop: AtomicU64,
    /// Full commits.
    pub commits: AtomicU64,
    /// Bytes of file data written by users.
    pub user_bytes: AtomicU64,
    /// Bytes of data blocks written to the device.
    pub dev_data_bytes: AtomicU64,
    /// Bytes of tree nodes written to the device.
    pub dev_meta_bytes: AtomicU64,
    /// Bytes of superblocks written to the device.
    pub dev_super_bytes: AtomicU64,
    /// Bytes of log records written to the device.
    pub dev_log_bytes: AtomicU64,
    /// Device flushes.
    pub flushes: AtomicU64,
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
            commits: g(&self.commits),
            user_bytes: g(&self.user_bytes),
            dev_data_bytes: g(&self.dev_data_bytes),
            dev_meta_bytes: g(&self.dev_meta_bytes),
            dev_super_bytes: g(&self.dev_super_bytes),
            dev_log_bytes: g(&self.dev_log_bytes),
            flushes: g(&self.flushes),
        }
    }
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// See [`Stats::fsyncs`].
    pub fsyncs: u64,
    /// See [`Stats::fsyncs_noop`].
    pub fsyncs_noop: u64,
    /// See [`Stats::commits`].
    pub commits: u64,
    /// See [`Stats::user_bytes`].
    pub user_bytes: u64,
    /// See [`Stats::dev_data_bytes`].
    pub dev_data_bytes: u64,
    /// See [`Stats::dev_meta_bytes`].
    pub dev_meta_bytes: u64,
    /// See [`Stats::dev_super_bytes`].
    pub dev_super_bytes: u64,
    /// See [`Stats::dev_log_bytes`].
    pub dev_log_bytes: u64,
    /// See [`Stats::flushes`].
    pub flushes: u64,
}
