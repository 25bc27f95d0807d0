//! Group commit of fsyncs for the FUSE servers (leader and followers).
//!
//! An fsync whose data and records are ready joins the queue. If no group is being
//! committed, its own request thread becomes the committer: it takes everything
//! queued, makes the log durable up to the highest target with one batch and one
//! flush, answers every fsync of the group, and goes on while more are queued.
//! Otherwise the request thread returns at once and the committer answers the fsync
//! later. No request thread ever waits for another's fsync, and no thread hop delays
//! the first one.
//!
//! Gathering. Threads that fsync in a loop (a database, fio's W3 jobs, fs_mark) come
//! back a short, steady time after their answer. Taken greedily, four such threads
//! split into two cohorts that alternate between flushes, about two fsyncs per
//! flush. So before it takes a group, the committer may wait for fsyncs that request
//! threads are still preparing (btrfs's log sync waits for its writers the same way)
//! and for threads expected back soon: each thread's usual time from its answer to
//! its next fsync is tracked. In a loop, merging the two cohorts turns a cycle of two
//! flushes into one flush plus the wait, so a wait pays when it is shorter than a
//! flush; the committer waits at most half the smoothed time of a flush (and at
//! most [`GATHER_MAX`]), and only for fsyncs due within that. A thread that fsyncs
//! rarely, or is more than its usual time late, is not expected; nothing is waited
//! for when nothing is ready (the one who arrives commits it).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::answer::Done;
use super::ops::errno;
use crate::fs::Fs;

/// Longest a committer waits to gather fsyncs before it takes its group.
pub(crate) const GATHER_MAX: Duration = Duration::from_millis(1);

/// Threads tracked before the ones not seen for [`FORGET_AFTER`] are dropped.
const TRACKED: usize = 256;

/// A thread not seen for this long is dropped from the tracking.
const FORGET_AFTER: Duration = Duration::from_secs(10);

/// An fsync waiting for the log.
pub(crate) struct PendingFsync {
    /// The log sequence number it needs durable.
    pub target: u64,
    pub answer: Done,
    /// When the request arrived.
    pub arrived: Instant,
    /// When it joined the group-commit queue (its data and records ready).
    pub queued: Instant,
    /// The thread that asked.
    pub pid: u32,
}

/// What the queue knows of a thread that fsyncs.
#[derive(Clone, Copy, Debug)]
struct Fsyncer {
    /// When its last fsync was answered, until it sends the next one.
    answered: Option<Instant>,
    /// Smoothed time from an answer to this thread's next fsync.
    gap: Option<Duration>,
    /// When it last sent an fsync or got an answer.
    seen: Instant,
}

impl Fsyncer {
    /// When it is expected back at `now`: `None` if it is not waiting for its next
    /// fsync, its gap is unknown, or it is more than its gap late.
    fn due(&self, now: Instant) -> Option<Instant> {
        let (a, g) = (self.answered?, self.gap?);
        (a + g * 2 >= now).then_some(a + g)
    }
}

/// What a committer waits for before it takes its group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Gather {
    /// Until enough fsyncs are ready...
    pub ready: usize,
    /// ... or this moment has come.
    pub until: Instant,
}

/// What the fsync queue's lock guards, and the gathering policy.
#[derive(Default)]
pub(crate) struct QueueState {
    /// Fsyncs ready for the log.
    ready: Vec<PendingFsync>,
    /// Whether a committer is at work.
    committing: bool,
    /// Fsyncs on request threads that are writing their data back and will join
    /// `ready` in a moment (or be answered at once).
    preparing: usize,
    /// Threads that fsync, by thread id.
    threads: HashMap<u32, Fsyncer>,
    /// Smoothed time of a group's log sync (batch write and flush).
    flush: Duration,
}

impl QueueState {
    /// Notes that thread `pid` sent an fsync at `now`.
    pub(crate) fn arrived(&mut self, pid: u32, now: Instant) {
        let t = self.threads.entry(pid).or_insert(Fsyncer {
            answered: None,
            gap: None,
            seen: now,
        });
        t.seen = now;
        if let Some(a) = t.answered.take() {
            let g = now.saturating_duration_since(a);
            t.gap = Some(match t.gap {
                Some(old) => (old * 3 + g) / 4,
                None => g,
            });
        }
    }

    /// Notes that the fsyncs of `pids` were answered at `now`, after a log sync that
    /// took `took`.
    pub(crate) fn answered(
        &mut self,
        pids: impl IntoIterator<Item = u32>,
        now: Instant,
        took: Duration,
    ) {
        self.flush = if self.flush.is_zero() {
            took
        } else {
            (self.flush * 7 + took) / 8
        };
        for pid in pids {
            if let Some(t) = self.threads.get_mut(&pid) {
                t.answered = Some(now);
                t.seen = now;
            }
        }
        if self.threads.len() > TRACKED {
            self.threads
                .retain(|_, t| now.saturating_duration_since(t.seen) < FORGET_AFTER);
        }
    }

    /// What a committer about to take a group at `now` should wait for, if anything
    /// (see the module's "Gathering").
    pub(crate) fn gather(&self, now: Instant) -> Option<Gather> {
        let budget = self.flush.min(GATHER_MAX) / 2;
        if self.ready.is_empty() || budget.is_zero() {
            return None;
        }
        let end = now + budget;
        let expected = self
            .threads
            .iter()
            .filter(|(pid, _)| !self.ready.iter().any(|p| p.pid == **pid))
            .filter_map(|(_, t)| t.due(now))
            .filter(|&d| d < end)
            .count();
        let k = self.preparing + expected;
        (k > 0).then_some(Gather {
            ready: self.ready.len() + k,
            until: end,
        })
    }
}

/// The group-commit queue of a mount.
#[derive(Default)]
pub(crate) struct FsyncQueue {
    state: parking_lot::Mutex<QueueState>,
    /// Signalled when a preparing fsync joins the queue or is answered.
    prepared: parking_lot::Condvar,
    /// Whether committers wait to gather (off when a waiting committer would hold the
    /// only request thread that could bring the fsyncs it waits for).
    gather: std::sync::atomic::AtomicBool,
}

/// An fsync counted as preparing; dropping it uncounts it (also when the fsync
/// fails or unwinds on the way).
pub(crate) struct Preparing<'a>(&'a FsyncQueue);

impl Drop for Preparing<'_> {
    fn drop(&mut self) {
        drop(self.0.ready(None));
    }
}

impl FsyncQueue {
    /// Turns gathering on or off.
    pub(crate) fn set_gather(&self, on: bool) {
        self.gather.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Notes an fsync from thread `pid`, counted as preparing until it is queued or
    /// answered.
    pub(crate) fn preparing(&self, pid: u32, now: Instant) -> Preparing<'_> {
        let mut st = self.state.lock();
        st.arrived(pid, now);
        st.preparing += 1;
        Preparing(self)
    }

    /// Notes an fsync from thread `pid` that is not counted as preparing (its long
    /// writeback runs on a worker).
    pub(crate) fn arrived(&self, pid: u32, now: Instant) {
        self.state.lock().arrived(pid, now);
    }

    /// Uncounts a preparing fsync, queueing `p` if it needs the log, and wakes a
    /// committer waiting for it.
    fn ready(&self, p: Option<PendingFsync>) -> parking_lot::MutexGuard<'_, QueueState> {
        let mut st = self.state.lock();
        st.preparing = st.preparing.saturating_sub(1);
        st.ready.extend(p);
        self.prepared.notify_all();
        st
    }

    /// Queues `p` (uncounting `prep`) and, if no committer is at work, commits groups
    /// on this thread until the queue is empty.
    pub(crate) fn submit(&self, fs: &Fs, p: PendingFsync, prep: Option<Preparing<'_>>) {
        {
            let mut st = match prep {
                Some(prep) => {
                    std::mem::forget(prep);
                    self.ready(Some(p))
                }
                None => {
                    let mut st = self.state.lock();
                    st.ready.push(p);
                    st
                }
            };
            if st.committing {
                return;
            }
            st.committing = true;
        }
        let gather = self.gather.load(std::sync::atomic::Ordering::Relaxed);
        loop {
            let group = {
                let mut st = self.state.lock();
                let t0 = Instant::now();
                if let Some(g) = gather.then(|| st.gather(t0)).flatten() {
                    while st.ready.len() < g.ready
                        && !self.prepared.wait_until(&mut st, g.until).timed_out()
                    {
                    }
                    fs.record_fsync_gather_latency(t0.elapsed());
                }
                if st.ready.is_empty() {
                    st.committing = false;
                    break;
                }
                std::mem::take(&mut st.ready)
            };
            let target = group.iter().map(|p| p.target).max().unwrap_or(0);
            for p in &group {
                fs.record_fsync_queue_latency(p.queued.elapsed());
            }
            let t0 = Instant::now();
            let r = fs.sync_to(target);
            // Noted before the answers go out, so that a thread's next fsync always
            // arrives after its answer was noted.
            self.state
                .lock()
                .answered(group.iter().map(|p| p.pid), Instant::now(), t0.elapsed());
            for p in group {
                fs.record_fsync_latency(p.arrived.elapsed());
                (p.answer)(r.as_ref().map(|_| ()).map_err(errno));
            }
        }
        if let Err(e) = fs.commit_if_log_full() {
            tracing::error!("commit of a full log failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    /// A state whose flushes took `flush`, with `ready` fsyncs queued.
    fn state(flush: Duration, ready: usize) -> QueueState {
        let mut st = QueueState {
            flush,
            ..Default::default()
        };
        for pid in 0..ready as u32 {
            st.ready.push(PendingFsync {
                target: 1,
                answer: Box::new(|_| {}),
                arrived: Instant::now(),
                queued: Instant::now(),
                pid: 1000 + pid,
            });
        }
        st
    }

    /// Makes thread `pid` come back `gap` after an answer, and answers it at `at`.
    fn cycle(st: &mut QueueState, pid: u32, gap: Duration, at: Instant) {
        let t = at - gap * 2;
        st.arrived(pid, t);
        st.answered([pid], t, st.flush);
        st.arrived(pid, t + gap);
        st.answered([pid], at, st.flush);
    }

    #[test]
    fn threads_due_within_half_a_flush_are_waited_for() {
        let t0 = Instant::now() + Duration::from_secs(1);
        let mut st = state(300 * US, 2);
        // Two threads answered 280 µs ago come back after 300 µs: due in 20 µs.
        cycle(&mut st, 7, 300 * US, t0 - 280 * US);
        cycle(&mut st, 8, 300 * US, t0 - 280 * US);
        // 2 ready, 2 expected: wait for both, at most half a flush (150 µs).
        let g = st.gather(t0).expect("waits");
        assert_eq!(
            g,
            Gather {
                ready: 4,
                until: t0 + 150 * US
            }
        );
        // Once they are back (preparing), they are waited for as preparing fsyncs.
        st.arrived(7, t0);
        st.arrived(8, t0);
        st.preparing = 2;
        assert_eq!(
            st.gather(t0),
            Some(Gather {
                ready: 4,
                until: t0 + 150 * US
            })
        );
    }

    #[test]
    fn threads_due_too_late_slow_or_long_overdue_are_not_waited_for() {
        let t0 = Instant::now() + Duration::from_secs(1);
        let mut st = state(300 * US, 2);
        // Answered just now, back in 300 µs: later than half a flush.
        cycle(&mut st, 1, 300 * US, t0);
        // Fsyncs every 5 ms.
        cycle(&mut st, 2, 5000 * US, t0 - 1000 * US);
        // Due 100 µs after its answer, 250 µs ago: more than its gap late.
        cycle(&mut st, 3, 100 * US, t0 - 250 * US);
        assert_eq!(st.gather(t0), None);
        // Due in 50 µs, but its fsync is already ready (its arrival raced with the
        // answer's note).
        cycle(&mut st, 1000, 100 * US, t0 - 50 * US);
        assert_eq!(st.gather(t0), None);
        // One due in 50 µs: waited for.
        cycle(&mut st, 4, 100 * US, t0 - 50 * US);
        assert_eq!(
            st.gather(t0),
            Some(Gather {
                ready: 3,
                until: t0 + 150 * US
            })
        );
    }

    #[test]
    fn nothing_ready_or_no_flush_timed_means_no_wait() {
        let t0 = Instant::now() + Duration::from_secs(1);
        let mut st = state(300 * US, 0);
        st.preparing = 3;
        assert_eq!(st.gather(t0), None);
        let mut st = state(Duration::ZERO, 1);
        st.preparing = 3;
        assert_eq!(st.gather(t0), None);
        // A slow device: the wait never exceeds GATHER_MAX.
        let mut st = state(Duration::from_secs(1), 1);
        st.preparing = 1;
        assert_eq!(
            st.gather(t0),
            Some(Gather {
                ready: 2,
                until: t0 + GATHER_MAX / 2
            })
        );
    }

    #[test]
    fn the_gap_and_the_flush_time_are_smoothed_and_stale_threads_forgotten() {
        let t0 = Instant::now();
        let mut st = state(300 * US, 0);
        st.arrived(3, t0);
        st.answered([3], t0, 300 * US);
        st.arrived(3, t0 + 100 * US);
        st.answered([3], t0 + 100 * US, 300 * US);
        st.arrived(3, t0 + 600 * US); // gap 500: smoothed to (3 * 100 + 500) / 4 = 200
        assert_eq!(st.threads[&3].gap, Some(200 * US));
        st.answered([], t0, 1100 * US); // (7 * 300 + 1100) / 8 = 400
        assert_eq!(st.flush, 400 * US);
        let later = t0 + FORGET_AFTER + Duration::from_secs(1);
        for pid in 100..(100 + TRACKED as u32) {
            st.arrived(pid, later);
        }
        st.answered([], later, 300 * US);
        assert!(!st.threads.contains_key(&3));
        assert_eq!(st.threads.len(), TRACKED);
    }
}
