//! `fsmark`: an fs_mark-style small-file create benchmark (used by `make bench`, W4).
//!
//! Semantics follow fs_mark: T threads each create N files; a thread spreads its files
//! over the D directories of the test directory (file i of thread t goes to directory
//! (t + i) mod D). Each file is `open(O_CREAT|O_EXCL|O_WRONLY)`, optionally written with
//! `--size` bytes, `fsync`ed when `--fsync` is given, and closed. The directories are
//! made (and synced) before the clock starts; all threads start together.
//!
//! Prints one JSON object on stdout: files/s, elapsed time, the rate in each tenth of
//! the run (to see whether the rate collapses as directories grow), and per-operation
//! latency percentiles (µs) for create (open), write, fsync and close.
//!
//! `--max-seconds S` stops every thread after S seconds (the run then reports the files
//! actually created and `"capped": true`).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;

#[derive(Parser)]
#[command(
    name = "fsmark",
    about = "fs_mark-style create benchmark: JSON on stdout"
)]
struct Args {
    /// Test directory (created if missing; must not already hold the run's directories)
    #[arg(short = 'd', long)]
    dir: PathBuf,
    /// Number of threads
    #[arg(short = 't', long, default_value_t = 1)]
    threads: usize,
    /// Files created by each thread
    #[arg(short = 'n', long)]
    files_per_thread: u64,
    /// Number of directories the files are spread over
    #[arg(short = 'D', long, default_value_t = 1)]
    dirs: usize,
    /// Bytes written to each file
    #[arg(short = 's', long, default_value_t = 0)]
    size: usize,
    /// fsync each file before closing it
    #[arg(long)]
    fsync: bool,
    /// Stop after this many seconds (0: no limit)
    #[arg(long, default_value_t = 0.0)]
    max_seconds: f64,
}

#[derive(Default)]
struct ThreadResult {
    created: u64,
    /// Completion time of each file since the common start, in ns.
    done_ns: Vec<u64>,
    open_ns: Vec<u64>,
    write_ns: Vec<u64>,
    fsync_ns: Vec<u64>,
    close_ns: Vec<u64>,
}

fn cpath(p: &Path) -> Result<CString> {
    Ok(CString::new(p.as_os_str().as_bytes())?)
}

fn fsync_dir(p: &Path) -> Result<()> {
    let f = std::fs::File::open(p).with_context(|| format!("open {}", p.display()))?;
    f.sync_all()
        .with_context(|| format!("fsync {}", p.display()))?;
    Ok(())
}

fn since_ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

#[allow(clippy::too_many_arguments)]
fn worker(
    t: usize,
    dirs: Arc<Vec<PathBuf>>,
    n: u64,
    size: usize,
    do_fsync: bool,
    deadline: Option<Duration>,
    barrier: Arc<Barrier>,
    epoch: Arc<std::sync::OnceLock<Instant>>,
) -> Result<ThreadResult> {
    let buf = vec![0xa5u8; size];
    let nd = dirs.len();
    // Paths are built before the clock starts so that name formatting is not timed.
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut paths = Vec::with_capacity(n as usize);
    for i in 0..n {
        let d = &dirs[(t + i as usize) % nd];
        let name = format!("{stamp:08x}{t:04x}{i:016x}");
        paths.push(cpath(&d.join(name))?);
    }
    let mut r = ThreadResult {
        done_ns: Vec::with_capacity(n as usize),
        open_ns: Vec::with_capacity(n as usize),
        fsync_ns: Vec::with_capacity(if do_fsync { n as usize } else { 0 }),
        close_ns: Vec::with_capacity(n as usize),
        ..Default::default()
    };
    barrier.wait();
    let start = *epoch.get_or_init(Instant::now);
    for p in &paths {
        if let Some(dl) = deadline {
            if start.elapsed() >= dl {
                break;
            }
        }
        let t0 = since_ns(start);
        // SAFETY: p is a valid NUL-terminated path.
        let fd = unsafe {
            libc::open(
                p.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC,
                0o644 as libc::c_uint,
            )
        };
        if fd < 0 {
            bail!("open {:?}: {}", p, std::io::Error::last_os_error());
        }
        let t1 = since_ns(start);
        r.open_ns.push(t1 - t0);
        let mut t_prev = t1;
        if size > 0 {
            let mut off = 0;
            while off < size {
                // SAFETY: fd is open; the buffer range is valid.
                let w = unsafe { libc::write(fd, buf[off..].as_ptr().cast(), size - off) };
                if w < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    // SAFETY: fd is open.
                    unsafe { libc::close(fd) };
                    bail!("write {:?}: {e}", p);
                }
                off += w as usize;
            }
            let t2 = since_ns(start);
            r.write_ns.push(t2 - t_prev);
            t_prev = t2;
        }
        if do_fsync {
            // SAFETY: fd is open.
            if unsafe { libc::fsync(fd) } != 0 {
                let e = std::io::Error::last_os_error();
                // SAFETY: fd is open.
                unsafe { libc::close(fd) };
                bail!("fsync {:?}: {e}", p);
            }
            let t3 = since_ns(start);
            r.fsync_ns.push(t3 - t_prev);
            t_prev = t3;
        }
        // SAFETY: fd is open and closed once.
        if unsafe { libc::close(fd) } != 0 {
            bail!("close {:?}: {}", p, std::io::Error::last_os_error());
        }
        let t4 = since_ns(start);
        r.close_ns.push(t4 - t_prev);
        r.done_ns.push(t4);
        r.created += 1;
    }
    Ok(r)
}

/// Latency summary in µs (nearest-rank percentiles) as a JSON object.
fn lat_json(mut v: Vec<u64>) -> String {
    if v.is_empty() {
        return "{\"count\":0}".into();
    }
    v.sort_unstable();
    let n = v.len();
    let pct = |p: f64| -> f64 {
        let rank = ((p / 100.0) * n as f64).ceil() as usize;
        v[rank.clamp(1, n) - 1] as f64 / 1000.0
    };
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64 / 1000.0;
    format!(
        "{{\"count\":{n},\"mean\":{mean:.3},\"min\":{:.3},\"p50\":{:.3},\"p90\":{:.3},\"p99\":{:.3},\"p99.9\":{:.3},\"max\":{:.3}}}",
        v[0] as f64 / 1000.0,
        pct(50.0),
        pct(90.0),
        pct(99.0),
        pct(99.9),
        v[n - 1] as f64 / 1000.0
    )
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.threads == 0 || a.dirs == 0 {
        bail!("--threads and --dirs must be at least 1");
    }
    std::fs::create_dir_all(&a.dir).with_context(|| format!("mkdir {}", a.dir.display()))?;
    let mut dirs = Vec::with_capacity(a.dirs);
    for d in 0..a.dirs {
        let p = a.dir.join(format!("d{d:05}"));
        std::fs::create_dir(&p).with_context(|| format!("mkdir {}", p.display()))?;
        dirs.push(p);
    }
    if a.fsync {
        for p in &dirs {
            fsync_dir(p)?;
        }
        fsync_dir(&a.dir)?;
    }
    let dirs = Arc::new(dirs);
    let barrier = Arc::new(Barrier::new(a.threads));
    let epoch = Arc::new(std::sync::OnceLock::new());
    let deadline = (a.max_seconds > 0.0).then(|| Duration::from_secs_f64(a.max_seconds));
    let mut handles = Vec::new();
    for t in 0..a.threads {
        let (dirs, barrier, epoch) = (dirs.clone(), barrier.clone(), epoch.clone());
        let (n, size, fs) = (a.files_per_thread, a.size, a.fsync);
        handles.push(std::thread::spawn(move || {
            worker(t, dirs, n, size, fs, deadline, barrier, epoch)
        }));
    }
    let mut results = Vec::new();
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(r)) => results.push(r),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert(anyhow::anyhow!("a worker thread panicked"));
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    let start = *epoch.get().expect("threads started");
    let elapsed = start.elapsed().as_secs_f64();
    let mut done: Vec<u64> = results
        .iter()
        .flat_map(|r| r.done_ns.iter().copied())
        .collect();
    done.sort_unstable();
    let created: u64 = results.iter().map(|r| r.created).sum();
    // The run ends when the last file is closed (not when the threads are joined).
    let run_s = done.last().map(|&x| x as f64 / 1e9).unwrap_or(elapsed);
    let rate = if run_s > 0.0 {
        created as f64 / run_s
    } else {
        0.0
    };
    // files/s in each tenth of the files created, in completion order.
    let mut tenths = Vec::new();
    if done.len() >= 10 {
        let n = done.len();
        let mut prev_t = 0u64;
        for k in 1..=10 {
            let hi = n * k / 10;
            let lo = n * (k - 1) / 10;
            let t_end = done[hi - 1];
            let dt = (t_end.saturating_sub(prev_t)) as f64 / 1e9;
            tenths.push(if dt > 0.0 {
                format!("{:.1}", (hi - lo) as f64 / dt)
            } else {
                "null".into()
            });
            prev_t = t_end;
        }
    }
    let cat = |f: fn(&ThreadResult) -> &Vec<u64>| -> Vec<u64> {
        results.iter().flat_map(|r| f(r).iter().copied()).collect()
    };
    let requested = a.files_per_thread * a.threads as u64;
    println!(
        "{{\"threads\":{},\"dirs\":{},\"files_per_thread\":{},\"files_requested\":{},\"files_created\":{},\"size\":{},\"fsync\":{},\"capped\":{},\"elapsed_s\":{:.6},\"files_per_s\":{:.3},\"files_per_s_by_tenth\":[{}],\"latency_us\":{{\"create\":{},\"write\":{},\"fsync\":{},\"close\":{}}}}}",
        a.threads,
        a.dirs,
        a.files_per_thread,
        requested,
        created,
        a.size,
        a.fsync,
        created < requested,
        run_s,
        rate,
        tenths.join(","),
        lat_json(cat(|r| &r.open_ns)),
        lat_json(cat(|r| &r.write_ns)),
        lat_json(cat(|r| &r.fsync_ns)),
        lat_json(cat(|r| &r.close_ns)),
    );
    Ok(())
}
