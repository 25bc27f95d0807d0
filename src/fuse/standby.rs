//! Standby request threads: `/dev/fuse` threads that serve only while fsyncs arrive.
//!
//! Through `/dev/fuse` the fsync that leads a group commit keeps its request thread
//! while the log batch is written and flushed (see `group`): with two request
//! threads on a 2-CPU machine, a stream of creates with fsync (fs_mark, W4) then has
//! one thread left for every GETATTR, LOOKUP and CREATE, and they queue for it (a
//! create took 110-150 µs instead of 60-80). Four threads serve that stream 11-15 %
//! faster, but cost creates without fsync a quarter, since then all four contend for
//! the filesystem's lock and the CPUs. So the threads beyond the first `core` are on
//! standby: after each request one of them serves (but a FORGET, which fuser hands
//! over once per inode of a BATCH_FORGET), it parks unless an fsync arrived in the
//! last [`ACTIVE`], until one does. A parked thread does not read `/dev/fuse`;
//! it also wakes every [`NAP`] to read once, so that it sees the session end (the
//! kernel sends no request when an unmount aborts the connection).
//!
//! Which threads are core is settled by the order in which threads serve their first
//! request: the first `core` to do so.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long after an fsync arrived the standby threads keep serving.
pub(crate) const ACTIVE: Duration = Duration::from_millis(100);

/// Longest a standby thread stays parked before it reads `/dev/fuse` once.
pub(crate) const NAP: Duration = Duration::from_millis(100);

/// Hands out the ids that tell [`Standby`]s apart in the threads' memory.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The [`Standby`] this thread last served for (its id) and its place in the
    /// order in which that one's threads first served.
    static PLACE: std::cell::Cell<(u64, usize)> = const { std::cell::Cell::new((0, 0)) };
}

/// The standby policy of one mount's request threads.
pub(crate) struct Standby {
    /// Tells this one apart from earlier ones in [`PLACE`].
    id: u64,
    /// Threads that always serve; the others are on standby. `usize::MAX`: none is.
    core: usize,
    /// Places handed out so far.
    next: AtomicUsize,
    /// When it was made: times below are nanoseconds since then.
    epoch: Instant,
    /// Until when the standby threads serve (the last fsync's arrival plus [`ACTIVE`]).
    active_until: AtomicU64,
    /// Standby threads parked now.
    parked: AtomicUsize,
    /// Set when the session ends: nobody parks any more.
    closing: AtomicBool,
    lock: parking_lot::Mutex<()>,
    wake: parking_lot::Condvar,
}

impl Default for Standby {
    /// Every thread is core: nobody ever parks.
    fn default() -> Standby {
        Standby::new(usize::MAX)
    }
}

impl Standby {
    /// A policy under which the first `core` threads to serve always serve.
    pub(crate) fn new(core: usize) -> Standby {
        Standby {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            core,
            next: AtomicUsize::new(0),
            epoch: Instant::now(),
            active_until: AtomicU64::new(0),
            parked: AtomicUsize::new(0),
            closing: AtomicBool::new(false),
            lock: parking_lot::Mutex::new(()),
            wake: parking_lot::Condvar::new(),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos().min(u64::MAX as u128) as u64
    }

    /// Whether an fsync arrived within [`ACTIVE`].
    fn active(&self) -> bool {
        self.now() <= self.active_until.load(Ordering::SeqCst)
    }

    /// Notes an fsync's arrival: the standby threads serve for [`ACTIVE`] from now
    /// (the parked ones are woken).
    pub(crate) fn fsync_arrived(&self) {
        if self.core == usize::MAX {
            return;
        }
        let until = self.now().saturating_add(ACTIVE.as_nanos() as u64);
        self.active_until.store(until, Ordering::SeqCst);
        // SeqCst on both sides: a thread about to park counts itself before it looks
        // at `active_until`, and this looks at the count after the store, so one of
        // the two sees the other.
        if self.parked.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock();
            self.wake.notify_all();
        }
    }

    /// Called by a request thread after it served a request: a standby thread parks
    /// here while no fsync arrives (for at most [`NAP`] at a time).
    pub(crate) fn after_request(&self) -> Served {
        self.after_request_napping(NAP)
    }

    /// [`Standby::after_request`] with a nap of `nap`.
    fn after_request_napping(&self, nap: Duration) -> Served {
        if self.core == usize::MAX {
            return Served::ByCore;
        }
        let place = PLACE.with(|p| {
            let (id, place) = p.get();
            if id == self.id {
                return place;
            }
            let place = self.next.fetch_add(1, Ordering::Relaxed);
            p.set((self.id, place));
            place
        });
        if place < self.core {
            return Served::ByCore;
        }
        if self.active() || self.closing.load(Ordering::SeqCst) {
            return Served::ByStandby;
        }
        let mut g = self.lock.lock();
        self.parked.fetch_add(1, Ordering::SeqCst);
        let park = !self.active() && !self.closing.load(Ordering::SeqCst);
        if park {
            self.wake.wait_for(&mut g, nap);
        }
        self.parked.fetch_sub(1, Ordering::SeqCst);
        if park {
            Served::ThenParked
        } else {
            Served::ByStandby
        }
    }

    /// Ends parking for good (the session is over) and wakes the parked threads.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let _g = self.lock.lock();
        self.wake.notify_all();
    }
}

/// Who served a request, as [`Standby::after_request`] tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Served {
    /// A core thread (or every thread is core).
    ByCore,
    /// A standby thread, which serves on.
    ByStandby,
    /// A standby thread, which then parked.
    ThenParked,
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const LONG: Duration = Duration::from_secs(3600);
    /// Far longer than any wake-up takes, far shorter than [`LONG`].
    const PROMPT: Duration = Duration::from_secs(60);

    /// Runs `after_request` on a new thread with a nap of `nap`; the thread gives what
    /// it was told and when it came back.
    fn serve_once(s: &Arc<Standby>, nap: Duration) -> std::thread::JoinHandle<(Served, Instant)> {
        let s = s.clone();
        std::thread::spawn(move || (s.after_request_napping(nap), Instant::now()))
    }

    /// Waits until a thread is parked in `s`.
    fn until_parked(s: &Standby) {
        while s.parked.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn core_threads_never_park_and_standby_ones_park_while_no_fsync_comes() {
        let s = Arc::new(Standby::new(1));
        // This thread serves first: it is core, and comes back at once whatever the nap.
        let t0 = Instant::now();
        assert_eq!(s.after_request_napping(LONG), Served::ByCore);
        assert_eq!(s.after_request_napping(LONG), Served::ByCore);
        assert!(t0.elapsed() < PROMPT);
        // A second thread is on standby: with no fsync it parks for its nap.
        let nap = Duration::from_millis(200);
        let t1 = Instant::now();
        let (served, back) = serve_once(&s, nap).join().unwrap();
        assert_eq!(served, Served::ThenParked);
        assert!(back - t1 >= nap, "parked for {:?}", back - t1);
    }

    #[test]
    fn a_standby_thread_serves_on_while_fsyncs_arrive() {
        let s = Arc::new(Standby::new(0));
        s.fsync_arrived();
        let t0 = Instant::now();
        let (served, _) = serve_once(&s, LONG).join().unwrap();
        assert_eq!(served, Served::ByStandby);
        assert!(t0.elapsed() < PROMPT);
    }

    #[test]
    fn an_fsync_wakes_a_parked_thread() {
        let s = Arc::new(Standby::new(0));
        let t = serve_once(&s, LONG);
        until_parked(&s);
        let woke = Instant::now();
        s.fsync_arrived();
        let (served, back) = t.join().unwrap();
        assert_eq!(served, Served::ThenParked);
        assert!(back - woke < PROMPT);
    }

    #[test]
    fn closing_wakes_parked_threads_and_ends_parking() {
        let s = Arc::new(Standby::new(0));
        let t = serve_once(&s, LONG);
        until_parked(&s);
        let t0 = Instant::now();
        s.close();
        assert_eq!(t.join().unwrap().0, Served::ThenParked);
        let (served, _) = serve_once(&s, LONG).join().unwrap();
        assert_eq!(served, Served::ByStandby);
        assert!(t0.elapsed() < PROMPT);
    }

    #[test]
    fn without_standby_threads_nobody_parks() {
        let s = Arc::new(Standby::default());
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(serve_once(&s, LONG).join().unwrap().0, Served::ByCore);
        }
        assert!(t0.elapsed() < PROMPT);
    }
}
