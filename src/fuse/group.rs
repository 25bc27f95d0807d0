//! Group commit of fsyncs for the FUSE servers (leader and followers).
//!
//! An fsync whose data and records are ready joins the queue. If no group is being
//! committed (over io_uring: fewer groups than allowed, see "Several committers"),
//! its own request thread becomes the committer: it takes everything queued, makes
//! the log durable up to the highest target with one batch and one flush, answers
//! every fsync of the group, and goes on while more are queued.
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
//!
//! Whether gathering pays is measured, not assumed ([`Tuner`]). Two cohorts also
//! overlap: one's flush runs while the other's threads do the work between their
//! fsyncs, and merged, that work and the flush run one after the other. Where that
//! work is large beside a flush, gathering loses: fs_mark's three requests per
//! create between two fsyncs ran 10-20% slower with it on a 2-CPU VM, while fio's
//! 4 KiB overwrites with fdatasync on a loop device, whose flushes are slow, ran
//! 15% faster. So the queue counts the fsyncs answered per second in short windows
//! in each [`Mode`], keeps the mode that answered most for a while, and measures
//! again. A tie goes to gathering: larger groups write fewer log blocks and fill
//! the log more slowly (fewer full commits), which the windows do not see. The third
//! mode lets two committers work at once through `/dev/fuse` too (see "Several
//! committers"), where the server asks for it ([`FsyncQueue::set_overlap`]: the
//! daemon does with gathering on); it must answer 5% more to be chosen, as it writes
//! more log blocks.
//! On a 2-CPU VM whose device serves two flushes side by side, fs_mark's creates
//! with fsync (4 threads) ran 8-10% faster with two committers always on (medians
//! of 5 and 6 interleaved rounds), while fio's overwrites with fdatasync ran no
//! faster and wrote 0.3 more device bytes per byte; with the tuner choosing,
//! fs_mark gained 4% (a 0.4 s run is mostly measuring) and fio's write
//! amplification rose 0.05-0.1. The first measurement after the mount runs in 10 ms
//! windows ([`FIRST_WINDOW`]) instead of 50, so that a short burst of fsyncs runs
//! mostly in the mode chosen: fs_mark's 4,000 creates with fsync, 8 interleaved
//! rounds, 10,507 (9,641-11,255) files/s before, 11,125 (10,511-11,412) after.
//!
//! A gather holds no thread. The committer notes what it waits for and returns to
//! serving requests: the fsync that completes the gather commits the group on its
//! own request thread, and a timer thread commits it when its time is up. (A
//! committer that waited on its request thread kept that thread from serving the
//! requests that bring the awaited fsyncs: with two request threads, fs_mark's
//! creates took twice as long, and W4 on a loop device ran 25% slower than without
//! gathering.)
//!
//! Several committers. Through `/dev/fuse` a committer answers every fsync of its
//! group itself: each answer is one write to the device that wakes its caller. Over
//! io_uring an answer goes back through the ring of the thread that took the
//! request, and only that thread submits to its ring, so answering another thread's
//! fsync posts it to that thread's mailbox and wakes it: one more wakeup per fsync.
//! So over io_uring several committers may work at once ([`FsyncQueue::set_committers`]):
//! an fsync whose thread finds fewer at work commits the queue (mostly its own
//! fsync) itself, and the flushes run side by side (the device serves them in
//! parallel; `Fs::log_sync` writes the batches one at a time in log order and has
//! each flush answer only for what was written before it began; a group whose
//! records another's batch already wrote waits for that batch's flush when it is
//! under way, instead of flushing again). By hand on a 2-CPU
//! VM, fio's 4 KiB overwrites with fdatasync went from 42-48 to 60-63 MiB/s (fsync
//! p50 289-338 to 222-234 µs) and fs_mark's creates with fsync from 10,100-11,600 to
//! 11,700-14,800 files/s. Several committers never gather. Through `/dev/fuse` one
//! committer is set: several were no faster there with fio and, before the standby
//! request threads (`fuse::standby`) served requests while committers flush, slower
//! with fs_mark (more flushes for the same fsyncs); the [`Tuner`] lets a second one
//! work where that measures faster.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
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

/// Length of one measuring window of the [`Tuner`].
const WINDOW: Duration = Duration::from_millis(50);

/// Length of the windows of the [`Tuner`]'s first measurement, so that a short burst
/// of fsyncs after the mount runs mostly in the mode chosen.
const FIRST_WINDOW: Duration = Duration::from_millis(10);

/// Windows in which the mode the [`Tuner`] chose runs before it measures again.
const CHOSEN_WINDOWS: u32 = 20;

/// How many more fsyncs per second not gathering must answer to be chosen (a tie
/// goes to gathering, which writes fewer log blocks).
const NO_GATHER_MARGIN: f64 = 1.03;

/// How many more fsyncs per second two committers must answer than the better of
/// the one-committer modes to be chosen: each writes its own log blocks, so they
/// fill the log faster and write more (see the module's "Several committers").
const OVERLAP_MARGIN: f64 = 1.05;

/// A window longer than this many [`WINDOW`]s spanned a pause and measures nothing.
const PAUSE_WINDOWS: u32 = 4;

/// How a single-committer queue commits groups (see the module's "Gathering" and
/// "Several committers").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Mode {
    /// One committer, which waits briefly for the fsyncs of threads expected back.
    #[default]
    Gather,
    /// One committer, which takes what is queued at once.
    Single,
    /// Two committers at once, neither waiting.
    Overlap,
}

/// The modes of the measuring windows, in order, where two committers are tried
/// ([`FsyncQueue::set_overlap`]): each is measured twice, the order symmetric so
/// that a trend over the cycle favours none.
const MEASURED: [Mode; 6] = [
    Mode::Gather,
    Mode::Single,
    Mode::Overlap,
    Mode::Overlap,
    Mode::Single,
    Mode::Gather,
];

/// The measuring windows where only one committer is tried.
const MEASURED_ONE: [Mode; 4] = [Mode::Gather, Mode::Single, Mode::Single, Mode::Gather];

/// Decides by measuring how a single-committer queue does best for the fsyncs at
/// hand: windows in each [`Mode`] (in the order of [`MEASURED`]), then the mode that
/// answered the most fsyncs per second, with the margins above, for
/// [`CHOSEN_WINDOWS`] windows, and again.
#[derive(Debug, Default)]
pub(crate) struct Tuner {
    /// When the current window began (`None` before the first answer).
    start: Option<Instant>,
    /// Fsyncs answered in the current window.
    count: u64,
    /// Which window of the cycle this is: the first [`MEASURED`] ones measure, the
    /// rest use `choice`.
    step: u32,
    /// Fsyncs per second in each mode (by [`Mode`] as index), summed over this
    /// cycle's windows.
    rates: [f64; 3],
    /// What the last measurement chose.
    choice: Mode,
    /// Whether two committers at once are tried.
    overlap: bool,
    /// Whether the first measurement is over (its windows are [`FIRST_WINDOW`]s).
    measured_once: bool,
}

impl Tuner {
    /// The modes of the measuring windows.
    fn measured(&self) -> &'static [Mode] {
        if self.overlap {
            &MEASURED
        } else {
            &MEASURED_ONE
        }
    }

    /// The length of the current window.
    fn window(&self) -> Duration {
        if self.measured_once {
            WINDOW
        } else {
            FIRST_WINDOW
        }
    }

    /// The mode of the current window.
    pub(crate) fn mode(&self) -> Mode {
        self.measured()
            .get(self.step as usize)
            .copied()
            .unwrap_or(self.choice)
    }

    /// Whether the current window gathers.
    pub(crate) fn gathers(&self) -> bool {
        self.mode() == Mode::Gather
    }

    /// Notes `n` fsyncs answered at `now`, and moves to the next window when this
    /// one is over; returns the choice when a measurement ends.
    pub(crate) fn answered(&mut self, n: u64, now: Instant) -> Option<Mode> {
        let start = *self.start.get_or_insert(now);
        self.count += n;
        let took = now.saturating_duration_since(start);
        let window = self.window();
        if took < window {
            return None;
        }
        self.start = Some(now);
        let count = std::mem::take(&mut self.count);
        if took > window * PAUSE_WINDOWS {
            return None;
        }
        let rate = count as f64 / took.as_secs_f64();
        let measured = self.measured();
        if let Some(&m) = measured.get(self.step as usize) {
            self.rates[m as usize] += rate;
        }
        self.step += 1;
        let chose = (self.step as usize == measured.len()).then(|| {
            let [g, s, o] = std::mem::take(&mut self.rates);
            let (one, best) = if s > g * NO_GATHER_MARGIN {
                (Mode::Single, s)
            } else {
                (Mode::Gather, g)
            };
            self.choice = if o > best * OVERLAP_MARGIN {
                Mode::Overlap
            } else {
                one
            };
            self.measured_once = true;
            self.choice
        });
        if self.step >= measured.len() as u32 + CHOSEN_WINDOWS {
            self.step = 0;
        }
        chose
    }
}

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
    /// Committers at work.
    committing: usize,
    /// Fsyncs on request threads that are writing their data back and will join
    /// `ready` in a moment (or be answered at once).
    preparing: usize,
    /// Threads that fsync, by thread id.
    threads: HashMap<u32, Fsyncer>,
    /// Smoothed time of a group's log sync (batch write and flush).
    flush: Duration,
    /// The gather under way, and when it began: no committer is at work, and the
    /// fsync that completes it, or the timer thread once its time is up, commits it.
    gathering: Option<(Gather, Instant)>,
    /// Set when the timer thread is to stop.
    stop: bool,
    /// Whether gathering pays, measured.
    tuner: Tuner,
}

impl QueueState {
    /// Uncounts an fsync that was preparing.
    fn prepared(&mut self) {
        self.preparing = self.preparing.saturating_sub(1);
    }

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
    /// took `took`; returns the tuner's choice, when it chose.
    pub(crate) fn answered(
        &mut self,
        pids: impl IntoIterator<Item = u32>,
        now: Instant,
        took: Duration,
    ) -> Option<Mode> {
        self.flush = if self.flush.is_zero() {
            took
        } else {
            (self.flush * 7 + took) / 8
        };
        let mut n = 0;
        for pid in pids {
            n += 1;
            if let Some(t) = self.threads.get_mut(&pid) {
                t.answered = Some(now);
                t.seen = now;
            }
        }
        if self.threads.len() > TRACKED {
            self.threads
                .retain(|_, t| now.saturating_duration_since(t.seen) < FORGET_AFTER);
        }
        self.tuner.answered(n, now)
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

/// A one-shot timer that the timer thread sleeps on (a timerfd). Arming and
/// disarming it wakes no thread, so a gather that its fsyncs complete in time costs
/// no thread switch. (A condition variable woke the timer thread twice per gather, to
/// arm it and when the time was up: a tenth of the daemon's CPU under fs_mark.)
struct Alarm(OwnedFd);

impl Alarm {
    /// A disarmed alarm.
    fn new() -> std::io::Result<Alarm> {
        // SAFETY: timerfd_create takes no pointers; a non-negative result is a new fd
        // that nothing else owns.
        let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: see above.
        Ok(Alarm(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Arms the alarm to go off `after` from now (at once for zero), or disarms it
    /// (`None`); either way forgets a time that was up but not yet waited for.
    fn set(&self, after: Option<Duration>) {
        let value = match after {
            Some(d) => libc::timespec {
                tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
                tv_nsec: d.subsec_nanos().max(u32::from(d.is_zero())) as libc::c_long,
            },
            None => libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
        };
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: value,
        };
        // SAFETY: `spec` is a valid itimerspec; the old value is not asked for.
        let r =
            unsafe { libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if r < 0 {
            tracing::error!(
                "cannot set the group commit's timer: {}",
                std::io::Error::last_os_error()
            );
        }
    }

    /// Whether the alarm is armed.
    #[cfg(test)]
    fn armed(&self) -> bool {
        // SAFETY: an all-zero itimerspec is valid; timerfd_gettime writes one.
        let mut cur: libc::itimerspec = unsafe { std::mem::zeroed() };
        // SAFETY: `cur` is a valid itimerspec to write.
        let r = unsafe { libc::timerfd_gettime(self.0.as_raw_fd(), &mut cur) };
        assert_eq!(r, 0, "timerfd_gettime failed");
        cur.it_value.tv_sec != 0 || cur.it_value.tv_nsec != 0
    }

    /// Blocks until the alarm goes off (at once if it went off since it was set).
    fn wait(&self) {
        let mut ticks = [0u8; 8];
        loop {
            // SAFETY: reads at most 8 bytes into `ticks`.
            let r = unsafe { libc::read(self.0.as_raw_fd(), ticks.as_mut_ptr().cast(), 8) };
            if r >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return;
            }
        }
    }
}

/// The group-commit queue of a mount.
#[derive(Default)]
pub(crate) struct FsyncQueue {
    state: parking_lot::Mutex<QueueState>,
    /// Wakes the timer thread when a gather's time is up or the queue is shutting
    /// down; set by [`FsyncQueue::install_alarm`].
    alarm: std::sync::OnceLock<Alarm>,
    /// Whether committers wait to gather.
    gather: std::sync::atomic::AtomicBool,
    /// How many committers may be at work at once (0 counts as 1); see the module's
    /// "Several committers".
    committers: std::sync::atomic::AtomicUsize,
}

/// An fsync counted as preparing; dropping it uncounts it (also when the fsync
/// fails or unwinds on the way).
pub(crate) struct Preparing<'a>(&'a FsyncQueue);

impl Drop for Preparing<'_> {
    fn drop(&mut self) {
        self.0.state.lock().prepared();
    }
}

impl FsyncQueue {
    /// Makes the alarm that [`FsyncQueue::run_timer`] sleeps on; gathering needs it.
    pub(crate) fn install_alarm(&self) -> std::io::Result<()> {
        if self.alarm.get().is_none() {
            let _ = self.alarm.set(Alarm::new()?);
        }
        Ok(())
    }

    /// Arms the alarm for the gather under way (disarms it if none), with `st` locked.
    fn arm(&self, st: &QueueState, now: Instant) {
        if let Some(a) = self.alarm.get() {
            a.set(
                st.gathering
                    .map(|(g, _)| g.until.saturating_duration_since(now)),
            );
        }
    }

    /// Turns gathering on or off. On, a thread must run [`FsyncQueue::run_timer`].
    pub(crate) fn set_gather(&self, on: bool) {
        self.gather.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Lets the tuner try two committers at once as a third mode where one is set
    /// (see the module's "Gathering"); off, one committer works at a time. The
    /// tuner starts its measuring over.
    pub(crate) fn set_overlap(&self, on: bool) {
        self.state.lock().tuner = Tuner {
            overlap: on,
            ..Tuner::default()
        };
    }

    /// Lets up to `n` committers work at once (see the module's "Several
    /// committers"); with more than one, committers never gather.
    pub(crate) fn set_committers(&self, n: usize) {
        self.committers
            .store(n.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// How many committers may be at work at once, as set.
    fn committers(&self) -> usize {
        self.committers
            .load(std::sync::atomic::Ordering::Relaxed)
            .max(1)
    }

    /// How many committers may be at work at once now (`st` locked): as set, or
    /// with one set, two while the tuner has them overlap.
    fn committers_now(&self, st: &QueueState) -> usize {
        match self.committers() {
            1 if st.tuner.mode() == Mode::Overlap => 2,
            n => n,
        }
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

    /// Queues `p` (uncounting `prep`). If no committer is at work and no gather is
    /// waiting for more, commits groups on this thread until the queue is empty (or
    /// a gather begins); an fsync that completes a gather commits it.
    pub(crate) fn submit(&self, fs: &Fs, p: PendingFsync, prep: Option<Preparing<'_>>) {
        let gathered = {
            let mut st = self.state.lock();
            if let Some(prep) = prep {
                std::mem::forget(prep);
                st.prepared();
            }
            st.ready.push(p);
            if st.committing >= self.committers_now(&st) {
                return;
            }
            if let Some((g, _)) = st.gathering {
                if st.ready.len() < g.ready && Instant::now() < g.until {
                    return;
                }
            }
            self.become_committer(&mut st)
        };
        self.commit_groups(fs, gathered);
    }

    /// Makes the caller the committer (`st` locked); it takes over the gather under
    /// way, if any: disarms its alarm and gives when it began.
    fn become_committer(&self, st: &mut QueueState) -> Option<Instant> {
        st.committing += 1;
        let since = st.gathering.take().map(|(_, since)| since);
        if since.is_some() {
            self.arm(st, Instant::now());
        }
        since
    }

    /// Commits groups until the queue is empty, as the one committer. `gathered`:
    /// the first group ends the gather that began then (and is not gathered again).
    /// Every other group is first gathered (see the module's "Gathering"): then this
    /// thread leaves, and the fsync that completes the gather (or the timer thread)
    /// commits it.
    fn commit_groups(&self, fs: &Fs, gathered: Option<Instant>) {
        let gather =
            self.gather.load(std::sync::atomic::Ordering::Relaxed) && self.committers() == 1;
        let mut may_gather = gathered.is_none();
        if let Some(since) = gathered {
            fs.record_fsync_gather_latency(since.elapsed());
        }
        loop {
            let group = {
                let mut st = self.state.lock();
                if may_gather && gather && st.tuner.gathers() {
                    let now = Instant::now();
                    if let Some(g) = st.gather(now) {
                        st.gathering = Some((g, now));
                        st.committing -= 1;
                        self.arm(&st, now);
                        return;
                    }
                }
                may_gather = true;
                if st.ready.is_empty() {
                    st.committing -= 1;
                    break;
                }
                if st.committing > 1 {
                    fs.count_overlapped_log_commit();
                }
                // A gather begun by another committer (while the tuner had two at
                // once) is over: this group takes what it waited for.
                if st.gathering.take().is_some() {
                    self.arm(&st, Instant::now());
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
            let chose = self.state.lock().answered(
                group.iter().map(|p| p.pid),
                Instant::now(),
                t0.elapsed(),
            );
            // Counted only where the tuner's choice is used: with gathering off
            // (or several committers set) its windows change nothing.
            if let Some(mode) = chose.filter(|_| gather) {
                fs.count_gather_choice(match mode {
                    Mode::Gather => Some(true),
                    Mode::Single => Some(false),
                    Mode::Overlap => None,
                });
            }
            for p in group {
                fs.record_fsync_latency(p.arrived.elapsed());
                (p.answer)(r.as_ref().map(|_| ()).map_err(errno));
            }
        }
        if let Err(e) = fs.commit_if_log_full() {
            tracing::error!("commit of a full log failed: {e}");
        }
    }

    /// The timer thread: commits each gathered group whose fsyncs did not all come
    /// before its time was up, until [`FsyncQueue::stop_timer`]; then commits what a
    /// gather still holds. Returns at once without [`FsyncQueue::install_alarm`].
    pub(crate) fn run_timer(&self, fs: &Fs) {
        let Some(alarm) = self.alarm.get() else {
            return;
        };
        loop {
            {
                let mut st = self.state.lock();
                let now = Instant::now();
                match st.gathering {
                    Some((g, _)) if st.stop || now >= g.until => {
                        let since = self.become_committer(&mut st);
                        drop(st);
                        self.commit_groups(fs, since);
                        continue;
                    }
                    _ if st.stop => return,
                    // Armed already, unless the gather began before the alarm was
                    // installed: arming again costs a system call, not a wake.
                    Some(_) => self.arm(&st, now),
                    None => {}
                }
            }
            alarm.wait();
        }
    }

    /// Makes [`FsyncQueue::run_timer`] return, after it commits what a gather holds.
    pub(crate) fn stop_timer(&self) {
        let mut st = self.state.lock();
        st.stop = true;
        if let Some(a) = self.alarm.get() {
            a.set(Some(Duration::ZERO));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::dev::MemDev;
    use crate::fs::{MkfsOptions, Options};

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
        // Two threads answered 230 µs ago come back after 250 µs: due in 20 µs.
        cycle(&mut st, 7, 250 * US, t0 - 230 * US);
        cycle(&mut st, 8, 250 * US, t0 - 230 * US);
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
        // Answered just now, back in 250 µs: later than half a flush.
        cycle(&mut st, 1, 250 * US, t0);
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

    /// An fsync of thread `pid` that needs nothing new durable, and the flag its
    /// answer sets.
    fn pending(pid: u32) -> (PendingFsync, Arc<AtomicBool>) {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let p = PendingFsync {
            target: 0,
            answer: Box::new(move |r| {
                assert!(r.is_ok());
                d.store(true, Ordering::SeqCst);
            }),
            arrived: Instant::now(),
            queued: Instant::now(),
            pid,
        };
        (p, done)
    }

    /// A mounted filesystem on a memory device, and a gathering queue that expects
    /// thread 7 back at once (it fsyncs every 50 ms, a flush takes 100 ms).
    fn gathering_queue() -> (Arc<Fs>, Arc<FsyncQueue>) {
        let dev = Arc::new(MemDev::new(64 << 20));
        Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let fs = Arc::new(Fs::open(dev, Options::default()).unwrap());
        let q = Arc::new(FsyncQueue::default());
        q.install_alarm().unwrap();
        q.set_gather(true);
        {
            let mut st = q.state.lock();
            st.flush = 100 * MS;
            // Answered 49.8 ms ago: due in 0.2 ms, within the 0.5 ms a gather may
            // wait (and still expected if this test is slow, up to 50 ms late).
            cycle(&mut st, 7, 50 * MS, Instant::now() - 49_800 * US);
            // The tuner starts over, in a window that gathers.
            st.tuner = Tuner::default();
        }
        (fs, q)
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_gather_holds_no_thread_and_the_fsync_that_completes_it_commits_the_group() {
        let (fs, q) = gathering_queue();
        let (p1, done1) = pending(1);
        q.submit(&fs, p1, None);
        // Thread 7 is expected: the group waits for it, but not on this thread.
        assert!(!done1.load(Ordering::SeqCst));
        {
            let st = q.state.lock();
            assert!(st.gathering.is_some() && st.committing == 0);
            assert_eq!(st.ready.len(), 1);
        }
        assert!(q.alarm.get().unwrap().armed(), "the gather set no alarm");
        // Thread 7's fsync completes the gather (or comes after its time): its own
        // thread commits the group and answers both.
        let (p7, done7) = pending(7);
        q.submit(&fs, p7, None);
        assert!(done1.load(Ordering::SeqCst) && done7.load(Ordering::SeqCst));
        let st = q.state.lock();
        assert!(st.gathering.is_none() && st.committing == 0 && st.ready.is_empty());
        // Its time is not up: the timer thread must not wake for it.
        assert!(!q.alarm.get().unwrap().armed(), "the alarm is still armed");
    }

    /// While another thread commits, an fsync waits for it; once `allow` has let a
    /// second committer work, the next fsync's thread commits the queue at once,
    /// beside the other, and counts the overlap.
    fn second_committer_works_once_allowed(
        fs: &Fs,
        q: &FsyncQueue,
        allow: impl FnOnce(&FsyncQueue),
    ) {
        q.state.lock().committing = 1;
        let (p1, done1) = pending(1);
        q.submit(fs, p1, None);
        assert!(
            !done1.load(Ordering::SeqCst),
            "answered beside the committer"
        );
        assert_eq!(q.state.lock().ready.len(), 1);
        allow(q);
        let (p2, done2) = pending(2);
        q.submit(fs, p2, None);
        assert!(done1.load(Ordering::SeqCst) && done2.load(Ordering::SeqCst));
        let st = q.state.lock();
        assert!(st.ready.is_empty());
        assert_eq!(st.committing, 1, "the other committer is still counted");
        assert_eq!(fs.stats().log_commits_overlapped, 1);
    }

    /// With one committer allowed, an fsync that comes while a committer is at work
    /// waits for it; with two, its thread commits the queue at once.
    #[test]
    fn a_second_committer_works_beside_the_first_only_when_allowed() {
        let dev = Arc::new(MemDev::new(64 << 20));
        Fs::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let fs = Arc::new(Fs::open(dev, Options::default()).unwrap());
        second_committer_works_once_allowed(&fs, &FsyncQueue::default(), |q| q.set_committers(2));
    }

    /// With one committer set, a second one works beside the first only in the
    /// tuner's overlapping windows (the queue starts in a gathering one).
    #[test]
    fn the_tuners_overlap_windows_allow_a_second_committer() {
        let (fs, q) = gathering_queue();
        second_committer_works_once_allowed(&fs, &q, |q| {
            q.set_overlap(true);
            let mut st = q.state.lock();
            st.tuner.step = MEASURED.iter().position(|&m| m == Mode::Overlap).unwrap() as u32;
            assert_eq!(q.committers_now(&st), 2);
        });
    }

    /// A committer that takes a group ends a gather that another committer began
    /// (both at work while the tuner overlapped): the gather's fsyncs are in it.
    #[test]
    fn a_group_taken_beside_a_gather_ends_it() {
        let (fs, q) = gathering_queue();
        let (p1, done1) = pending(1);
        {
            let mut st = q.state.lock();
            st.committing = 2;
            st.ready.push(p1);
            let until = Instant::now() + Duration::from_secs(3600);
            st.gathering = Some((Gather { ready: 5, until }, Instant::now()));
            q.arm(&st, Instant::now());
        }
        // As a committer that has just ended a gather of its own goes on.
        q.commit_groups(&fs, Some(Instant::now()));
        assert!(done1.load(Ordering::SeqCst));
        let st = q.state.lock();
        assert!(st.ready.is_empty() && st.gathering.is_none());
        assert_eq!(st.committing, 1, "the other committer is still counted");
        assert!(
            !q.alarm.get().unwrap().armed(),
            "the ended gather's alarm is armed"
        );
    }

    /// Several committers never gather: each commits at once what is queued.
    #[test]
    fn with_several_committers_nothing_is_gathered() {
        let (fs, q) = gathering_queue();
        q.set_committers(2);
        let (p1, done1) = pending(1);
        q.submit(&fs, p1, None);
        assert!(
            done1.load(Ordering::SeqCst),
            "the fsync waited for a gather"
        );
        let st = q.state.lock();
        assert!(st.gathering.is_none() && st.committing == 0);
        assert_eq!(fs.stats().log_commits_overlapped, 0);
    }

    /// Commits one fsync on `q` in the last measuring window of its tuner, which
    /// has measured gathering to answer most; returns the choices counted.
    fn choices_counted_after_a_measurement(fs: &Fs, q: &FsyncQueue) -> [u64; 3] {
        {
            let mut st = q.state.lock();
            st.tuner.step = MEASURED_ONE.len() as u32 - 1;
            st.tuner.rates = [1e6, 0.0, 0.0];
            st.tuner.start = Some(Instant::now() - st.tuner.window() * 2);
        }
        let (p, done) = pending(3);
        q.submit(fs, p, None);
        assert!(done.load(Ordering::SeqCst));
        assert_eq!(
            q.state.lock().tuner.step,
            MEASURED_ONE.len() as u32,
            "the measurement did not end"
        );
        let s = fs.stats();
        [s.gather_chosen, s.gather_declined, s.gather_overlap]
    }

    /// The tuner's choice is counted where it is used, and not with gathering off.
    #[test]
    fn the_tuners_choice_is_counted_only_with_gathering_on() {
        let (fs, q) = gathering_queue();
        // No thread is expected back: the fsync is committed at once, not gathered.
        q.state.lock().threads.clear();
        assert_eq!(choices_counted_after_a_measurement(&fs, &q), [1, 0, 0]);
        q.set_gather(false);
        q.set_overlap(false);
        assert_eq!(choices_counted_after_a_measurement(&fs, &q), [1, 0, 0]);
    }

    #[test]
    fn a_disarmed_alarm_does_not_go_off_and_an_armed_one_does() {
        let a = Arc::new(Alarm::new().unwrap());
        a.set(Some(20 * MS));
        a.set(None);
        let fired = Arc::new(AtomicBool::new(false));
        let t = {
            let (a, fired) = (a.clone(), fired.clone());
            std::thread::spawn(move || {
                a.wait();
                fired.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(100 * MS);
        assert!(!fired.load(Ordering::SeqCst), "a disarmed alarm went off");
        a.set(Some(Duration::ZERO));
        t.join().unwrap();
        assert!(fired.load(Ordering::SeqCst));
    }

    #[test]
    fn the_timer_commits_a_gather_whose_fsyncs_do_not_come() {
        let (fs, q) = gathering_queue();
        let t = {
            let (fs, q) = (fs.clone(), q.clone());
            std::thread::spawn(move || q.run_timer(&fs))
        };
        let (p1, done1) = pending(1);
        q.submit(&fs, p1, None);
        let t0 = Instant::now();
        while !done1.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(MS);
        }
        assert!(
            done1.load(Ordering::SeqCst),
            "the timer did not commit the gather"
        );
        assert!(q.state.lock().gathering.is_none());
        q.stop_timer();
        t.join().unwrap();
    }

    #[test]
    fn a_stopping_timer_commits_what_a_gather_holds() {
        let (fs, q) = gathering_queue();
        let (p1, done1) = pending(1);
        {
            let mut st = q.state.lock();
            st.ready.push(p1);
            let until = Instant::now() + Duration::from_secs(3600);
            st.gathering = Some((Gather { ready: 5, until }, Instant::now()));
        }
        let t = {
            let (fs, q) = (fs.clone(), q.clone());
            std::thread::spawn(move || q.run_timer(&fs))
        };
        q.stop_timer();
        t.join().unwrap();
        assert!(done1.load(Ordering::SeqCst));
    }

    /// Runs one window of `tuner` from `at`: `n` fsyncs answered over it. Returns
    /// the window's end and what the tuner chose at it, if it chose.
    fn window(tuner: &mut Tuner, at: Instant, n: u64) -> (Instant, Option<Mode>) {
        let w = tuner.window();
        tuner.answered(n / 2, at + w / 2);
        let end = at + w;
        (end, tuner.answered(n - n / 2, end))
    }

    /// Runs a measuring cycle of `t` from `at` with `rate(mode)` fsyncs per window,
    /// checking the mode of each window; returns its end and the choice.
    fn measure(t: &mut Tuner, mut at: Instant, rate: impl Fn(Mode) -> u64) -> (Instant, Mode) {
        let measured = t.measured();
        for (i, &m) in measured.iter().enumerate() {
            assert_eq!(t.mode(), m, "window {i}");
            assert_eq!(t.gathers(), m == Mode::Gather);
            let (end, chose) = window(t, at, rate(m));
            at = end;
            if i + 1 < measured.len() {
                assert_eq!(chose, None, "window {i}");
            } else {
                return (at, chose.expect("a choice at the end of the measuring"));
            }
        }
        unreachable!()
    }

    /// Runs a measurement of `t` from `at` with `rates` fsyncs per window (by
    /// [`Mode`]), checks that it chooses `want`, and runs the chosen windows.
    fn measure_and_keep(t: &mut Tuner, at: Instant, rates: [u64; 3], want: Mode) -> Instant {
        let (end, chose) = measure(t, at, |m| rates[m as usize]);
        assert_eq!(chose, want, "rates {rates:?}");
        keep(t, end, want)
    }

    /// Runs the chosen windows of `t` from `at`, checking that they keep `mode`.
    fn keep(t: &mut Tuner, mut at: Instant, mode: Mode) -> Instant {
        for _ in 0..CHOSEN_WINDOWS {
            assert_eq!(t.mode(), mode);
            let (end, chose) = window(t, at, 1);
            assert_eq!(chose, None);
            at = end;
        }
        at
    }

    #[test]
    fn the_tuner_measures_every_mode_and_keeps_the_one_that_answers_most() {
        use Mode::*;
        let mut t = Tuner {
            overlap: true,
            ..Tuner::default()
        };
        let mut at = Instant::now();
        // The first answer starts the first window.
        t.answered(0, at);
        // Fsyncs per window with gathering, a single committer and two; the choice.
        let cycles = [
            // Gathering answers 20% more than either other mode.
            ([120, 100, 100], Gather),
            // A tie between the one-committer modes goes to gathering, and two
            // committers 4% ahead are not enough.
            ([100, 101, 104], Gather),
            // Not gathering answers 10% more.
            ([100, 110, 100], Single),
            // Two committers answer 10% more than the better one-committer mode.
            ([100, 105, 116], Overlap),
            // All even: gathering.
            ([100, 100, 100], Gather),
        ];
        for (i, (rates, want)) in cycles.into_iter().enumerate() {
            // Every measurement starts with a gathering window; the first one's
            // windows are short.
            assert_eq!(t.mode(), Gather);
            assert_eq!(t.window(), if i == 0 { FIRST_WINDOW } else { WINDOW });
            at = measure_and_keep(&mut t, at, rates, want);
        }
    }

    #[test]
    fn without_overlap_the_tuner_never_tries_two_committers() {
        use Mode::*;
        let mut t = Tuner::default();
        let mut at = Instant::now();
        t.answered(0, at);
        assert_eq!(t.measured(), &[Gather, Single, Single, Gather]);
        // However many fsyncs an overlapping window would answer, none is run.
        for (rates, want) in [([100, 100, 500], Gather), ([100, 110, 500], Single)] {
            at = measure_and_keep(&mut t, at, rates, want);
        }
    }

    #[test]
    fn a_window_that_spans_a_pause_measures_nothing() {
        let mut t = Tuner::default();
        let at = Instant::now();
        t.answered(0, at);
        // One fsync now, the next after a pause of a second: no window counted.
        assert_eq!(t.answered(1, at + Duration::from_secs(1)), None);
        assert_eq!(t.step, 0);
        assert!(t.gathers());
        // The window that follows counts.
        let (_, chose) = window(&mut t, at + Duration::from_secs(1), 100);
        assert_eq!((chose, t.step), (None, 1));
        assert_eq!(t.mode(), Mode::Single);
    }
}
