# birchfs: build, mount, test. See README.md.
CARGO ?= cargo
BIN := target/release/birchfs
IMAGE ?= birchfs.img
MNT ?= mnt
SIZE ?= 4G

.PHONY: all build deps install mount test test-long lint fmt clean fuzz fuzz-quick

all: build

build:
	$(CARGO) build --release

# Installs what is missing on a Debian/Ubuntu machine (fuse3 for fusermount3).
deps:
	@command -v fusermount3 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq fuse3; }

# Installs the binary where mount(8)'s helper mount.fuse3 finds it, so that
# `mount -t fuse.birchfs IMAGE DIR` and /etc/fstab lines work.
PREFIX ?= /usr/local
install: build
	install -D -m 755 $(BIN) $(DESTDIR)$(PREFIX)/bin/birchfs

# Builds, creates ./birchfs.img if absent, and mounts it on ./mnt until Ctrl-C.
mount: deps build
	@mkdir -p $(MNT)
	@test -e $(IMAGE) || $(BIN) mkfs --size $(SIZE) $(IMAGE)
	$(BIN) mount --foreground $(IMAGE) $(MNT)

# Every test: unit, model, FUSE integration, data. Release build: the data tests move GiBs.
# The FUSE suites run a second time with every mount served through io_uring queues
# (uring=on), where the kernel has FUSE over io_uring and fuse's enable_uring parameter
# can be turned on (root); the parameter is set back to what it was afterwards. They
# run a third time with every read-only open reading past the kernel's page cache
# (direct_read=0), the cache suite aside (its tests set direct_read= themselves).
FUSE_SUITES := --test posix --test data --test cache --test faults --test reflink --test snapshots
DIRECT_SUITES := --test posix --test data --test faults --test reflink --test snapshots
URING_PARAM := /sys/module/fuse/parameters/enable_uring
# The suites that run birchfs in the test process (no daemon). Their crash states and
# models copy whole 32 MiB images, and glibc maps and unmaps each such buffer afresh
# (it is at its largest mmap threshold), so most of their time went to page faults;
# these allocator settings keep freed memory for reuse, in huge pages (crash.rs 173 s
# -> 54 s, model.rs 44 -> 8 s on a 2-CPU VM). Never set for daemons: the FUSE suites
# run without them, as users' mounts do.
INPROC_SUITES := --lib --bins --test crash --test model --test hostile
INPROC_MALLOC := glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296:glibc.malloc.hugetlb=1
MOUNT_SUITES := $(FUSE_SUITES) --test uring --examples
# No separate `cargo build` first: `cargo test` builds the binaries the tests run, with
# the dev-dependencies' features, so a plain build would compile most crates twice.
test: deps
	@for f in tests/*.rs; do n=$$(basename $$f .rs); \
	 case " $(INPROC_SUITES) $(MOUNT_SUITES) " in *" --test $$n "*) ;; \
	 *) echo "make test: $$f is in none of the Makefile's suite lists"; exit 1;; esac; done
	@was=$$(cat $(URING_PARAM) 2>/dev/null); status=0; \
	 GLIBC_TUNABLES=$(INPROC_MALLOC) $(CARGO) test --release $(INPROC_SUITES) -- --test-threads=2 || status=$$?; \
	 if [ $$status = 0 ]; then \
	   $(CARGO) test --release $(MOUNT_SUITES) -- --test-threads=2 || status=$$?; \
	 fi; \
	 if [ $$status = 0 ]; then $(CARGO) test --release --doc || status=$$?; fi; \
	 if [ $$status = 0 ]; then \
	   if [ -e $(URING_PARAM) ] && { [ "$$(cat $(URING_PARAM))" = Y ] || echo 1 > $(URING_PARAM) 2>/dev/null; }; then \
	     echo "FUSE suites again over io_uring (uring=on)"; \
	     BIRCHFS_TEST_MOUNT_OPTIONS=uring=on $(CARGO) test --release $(FUSE_SUITES) -- --test-threads=2 || status=$$?; \
	   else echo "FUSE over io_uring: skipped (no enable_uring parameter here, or it cannot be turned on)"; fi; \
	 fi; \
	 if [ $$status = 0 ]; then \
	   echo "FUSE suites again with direct reads (direct_read=0)"; \
	   BIRCHFS_TEST_MOUNT_OPTIONS=direct_read=0 $(CARGO) test --release $(DIRECT_SUITES) -- --test-threads=2 || status=$$?; \
	 fi; \
	 if [ "$$was" = N ]; then echo 0 > $(URING_PARAM) 2>/dev/null || true; fi; \
	 exit $$status
	@if $(CARGO) +nightly fuzz --version >/dev/null 2>&1; then $(MAKE) --no-print-directory fuzz-quick; \
	 else echo "fuzz: skipped (needs nightly Rust and cargo-fuzz); tests/hostile.rs covered damaged images"; fi

# The long variants (1 GiB data tests, more model cases).
test-long: deps
	BIRCHFS_LONG=1 PROPTEST_CASES=2000 $(CARGO) test --release -- --test-threads=2
	$(MAKE) --no-print-directory fuzz FUZZ_RUNS=20000

# cargo-fuzz targets (fuzz/): a damaged or hostile image, and operation sequences
# against a model. Fixed seed and run count; the corpus lives in fuzz/corpus.
FUZZ_RUNS ?= 300
fuzz-quick: fuzz
fuzz:
	cd fuzz && $(CARGO) +nightly fuzz run ops corpus/ops -- -runs=$(FUZZ_RUNS) -seed=1
	cd fuzz && $(CARGO) +nightly fuzz run mount_image corpus/mount_image -- -runs=$(FUZZ_RUNS) -seed=1

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --release --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean

# Benchmarks against kernel btrfs, ext4, XFS, a FUSE floor and a FUSE ceiling (see bench/bench.py).
# Root; installs fio etc. with apt-get if missing. Results in bench/results[/quick].
BENCH_PY ?= /usr/bin/python3
.PHONY: bench bench-quick

bench:
	$(CARGO) build --release --bins --examples
	$(BENCH_PY) bench/bench.py --profile full

bench-quick:
	$(CARGO) build --release --bins --examples
	$(BENCH_PY) bench/bench.py --profile quick
