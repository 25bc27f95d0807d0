//! FUSE over io_uring (`-o uring=on`): requests come through the kernel's per-CPU ring
//! queues instead of /dev/fuse. `make test` also runs every FUSE suite with
//! `uring=on` added to each mount; these tests check that the rings really carry
//! the requests, and the parts only the ring path has (answers from other threads,
//! entries filled to their size, option errors).
//!
//! They need a kernel with FUSE over io_uring (6.14+) and fuse's `enable_uring`
//! parameter on, which they turn on as `-o uring=on` would (root). Where the kernel
//! has no such parameter, or it cannot be turned on, each test says so and passes
//! without running.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;

use birchfs::fuse::uring::{enabled_in_kernel, ENABLE_PARAM};
use common::*;

fn kernel_has_uring() -> bool {
    match fs::read_to_string(ENABLE_PARAM) {
        Err(_) => {
            eprintln!("skipped: this kernel has no FUSE over io_uring ({ENABLE_PARAM} is missing)");
            false
        }
        Ok(_) if enabled_in_kernel() => true,
        // What `-o uring=on` does; `make test` sets the parameter back afterwards.
        Ok(_) if fs::write(ENABLE_PARAM, "1").is_ok() => true,
        Ok(_) => {
            eprintln!("skipped: {ENABLE_PARAM} is off and this process cannot turn it on");
            false
        }
    }
}

fn uring_requests(m: &Mount) -> u64 {
    daemon_stats(m)["uring_requests"]
        .as_u64()
        .expect("uring_requests")
}

#[test]
fn requests_travel_through_the_rings_and_the_data_survives_a_remount() {
    if !kernel_has_uring() {
        return;
    }
    let mut m = Mount::with_options(&["uring=on"]);
    let before = uring_requests(&m);
    fs::create_dir(m.path("d")).unwrap();
    let data = mib_data(3, 7);
    fs::write(m.path("d/f"), &data).unwrap();
    fs::rename(m.path("d/f"), m.path("d/g")).unwrap();
    std::os::unix::fs::symlink("g", m.path("d/s")).unwrap();
    fs::hard_link(m.path("d/g"), m.path("d/h")).unwrap();
    setxattr(&m.path("d/g"), "user.k", b"v", 0).unwrap();
    assert_eq!(getxattr(&m.path("d/g"), "user.k").unwrap(), b"v");
    assert_eq!(
        fs::read_link(m.path("d/s")).unwrap().to_str(),
        Some("g"),
        "readlink"
    );
    let f = fs::OpenOptions::new()
        .write(true)
        .open(m.path("d/g"))
        .unwrap();
    f.write_all_at(b"xyz", 4096).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let after = uring_requests(&m);
    assert!(
        after >= before + 10,
        "the operations above went through the rings: {before} -> {after} ring requests"
    );
    m.remount();
    let mut want = data.clone();
    want[4096..4099].copy_from_slice(b"xyz");
    assert_bytes_eq(&fs::read(m.path("d/g")).unwrap(), &want, 0, "d/g");
    assert_eq!(fs::read(m.path("d/h")).unwrap().len(), want.len());
    let mut names = list_dir(&m.path("d"));
    names.sort();
    assert_eq!(names, ["g", "h", "s"]);
    assert!(
        uring_requests(&m) > 0,
        "the remount (uring=on again) serves through the rings too"
    );
}

#[test]
fn fsyncs_of_many_threads_are_answered_from_the_group_commit() {
    if !kernel_has_uring() {
        return;
    }
    // More fsyncs at once than a thread has ring entries: those answered by another
    // thread's group commit reach their ring through its mailbox.
    let m = Mount::with_options(&["uring=on", "uring_threads=1", "uring_depth=4"]);
    let before = daemon_stats(&m);
    create_concurrently(m.root(), 12, 40, 5000, "t", true);
    let after = daemon_stats(&m);
    let d = |k: &str| after[k].as_u64().unwrap() - before[k].as_u64().unwrap();
    assert!(
        d("fsyncs") >= 480,
        "every fsync reached the daemon: {}",
        d("fsyncs")
    );
    assert!(
        d("log_commits") < d("fsyncs"),
        "concurrent fsyncs shared log commits ({} commits for {} fsyncs)",
        d("log_commits"),
        d("fsyncs")
    );
    assert!(d("uring_requests") >= 480 * 3);
    check_created(&m, 12, 40, 5000, "t");
}

/// Over the rings each fsync's own thread commits its group when it can, beside the
/// others (no wakeup of another thread to answer it): group commits overlap. Every
/// fsynced file is whole after a kill -9 of the daemon. Through `/dev/fuse` with
/// `fsync_gather=off` (no tuning, which may try two) one group commit runs at a time.
#[test]
fn group_commits_run_side_by_side_over_the_rings_and_one_at_a_time_through_dev_fuse() {
    if !kernel_has_uring() {
        return;
    }
    let plain = extra_mount_options().is_empty();
    for (opts, rings) in [
        (&["uring=on"][..], true),
        (&["fsync_gather=off"][..], false),
    ] {
        if !rings && !plain {
            continue;
        }
        let mut m = Mount::with_options(opts);
        let before = daemon_stats(&m);
        create_concurrently(m.root(), 8, 30, 9000, "t", true);
        let after = daemon_stats(&m);
        let d = |k: &str| after[k].as_u64().unwrap() - before[k].as_u64().unwrap();
        assert!(d("fsyncs") >= 240, "fsyncs: {}", d("fsyncs"));
        if rings {
            assert!(
                d("log_commits_overlapped") > 0,
                "no group commit ran beside another ({} log commits)",
                d("log_commits")
            );
        } else {
            assert_eq!(d("log_commits_overlapped"), 0, "through /dev/fuse");
        }
        m.kill_daemon();
        m.mount();
        check_created(&m, 8, 30, 9000, "t");
        m.unmount();
    }
}

#[test]
fn large_directories_and_large_reads_fill_the_ring_entries() {
    if !kernel_has_uring() {
        return;
    }
    let mut m = Mount::with_options(&["uring=on"]);
    let dir = m.path("many");
    fs::create_dir(&dir).unwrap();
    let mut want = Vec::new();
    for i in 0..1500 {
        // Long names so that one READDIR(PLUS) reply holds few entries.
        let name = format!("{i:05}-{}", "n".repeat(180));
        fs::File::create(dir.join(&name)).unwrap();
        want.push(name);
    }
    let big = mib_data(8, 3);
    fs::write(m.path("big"), &big).unwrap();
    m.remount();
    let mut names = list_dir(&dir);
    names.sort();
    assert_eq!(
        names, want,
        "readdir through the rings lists every entry once"
    );
    let raw = readdir_raw(&dir).unwrap();
    assert_eq!(raw.len(), 1502, "raw getdents: the entries plus . and ..");
    let mut f = fs::File::open(m.path("big")).unwrap();
    let mut got = Vec::new();
    std::io::Read::read_to_end(&mut f, &mut got).unwrap();
    assert_bytes_eq(&got, &big, 0, "8 MiB read in 1 MiB requests");
    assert!(uring_requests(&m) > 0);
}

#[test]
fn errors_come_back_through_the_rings_as_errno() {
    if !kernel_has_uring() {
        return;
    }
    let m = Mount::with_options(&["uring=on"]);
    expect_errno(
        fs::read(m.path("missing")),
        libc::ENOENT,
        "lookup of a missing name",
    );
    fs::create_dir(m.path("d")).unwrap();
    fs::write(m.path("d/f"), b"x").unwrap();
    expect_errno(fs::remove_dir(m.path("d")), libc::ENOTEMPTY, "rmdir");
    expect_errno(
        getxattr(&m.path("d/f"), "user.none"),
        libc::ENODATA,
        "getxattr",
    );
    let long = "x".repeat(300);
    expect_errno(
        fs::write(m.path(&long), b""),
        libc::ENAMETOOLONG,
        "a name too long",
    );
    expect_errno(
        renameat2(&m.path("d/f"), &m.path("d"), RENAME_NOREPLACE),
        libc::EEXIST,
        "rename2 NOREPLACE",
    );
}

#[test]
fn bad_ring_options_are_refused_with_a_message() {
    let mut m = Mount::unmounted("256M");
    for (opt, word) in [
        ("uring=maybe", "unknown mount option"),
        ("uring_depth=0", "1 to 256"),
        ("uring_threads=100", "1 to 64"),
    ] {
        m.expect_refused(opt, word);
    }
}

#[test]
fn a_queue_that_cannot_be_registered_sends_the_kernel_back_to_dev_fuse() {
    if !kernel_has_uring() {
        return;
    }
    // Once INIT agreed to io_uring, the kernel holds every request until each CPU's
    // queue has an entry: a queue that never gets one must be answered with a refused
    // registration, or the mount hangs.
    let mut m = Mount::unmounted("256M");
    m.set_daemon_env("BIRCHFS_TEST_URING_FAIL_QUEUE", "0");
    let out = m.try_mount(&["uring=on"]);
    assert!(
        !out.status.success(),
        "uring=on must fail when a queue cannot start"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("failed on purpose"), "{err}");
    assert!(!m.is_mounted());

    m.mount_with(&["uring=auto"]);
    let root = m.root().to_path_buf();
    let worker = std::thread::spawn(move || {
        fs::write(root.join("f"), b"through /dev/fuse").unwrap();
        fs::read(root.join("f")).unwrap()
    });
    assert!(
        wait_until(std::time::Duration::from_secs(30), || worker.is_finished()),
        "requests hang: the kernel still waits for the io_uring queues"
    );
    assert_eq!(worker.join().unwrap(), b"through /dev/fuse");
    assert_eq!(uring_requests(&m), 0, "the queues never served a request");
}
