//! A persistent thread pool with microsecond dispatch for the ~250 kernel launches of every decoded token.
//!
//! Protocol: one atomic `state` word packs `generation:32 | n_tasks:16 | next_task:16`. The caller publishes a
//! job by storing the closure in `job` and then a new generation in `state`; workers spin on `state` for a short
//! while (then park on a condvar) and claim tasks with a compare-exchange that also checks the generation, so a
//! late worker can never claim a task of a newer job with an older closure. A claimed task keeps the caller
//! waiting (it waits for `done == n_tasks`), which is what keeps the borrowed closure alive while it runs.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking: covers the gap between kernels of one forward pass.
const SPIN: Duration = Duration::from_micros(100);
/// Most tasks one job can carry in the packed state; larger requests are folded into ranges.
const MAX_TASKS: usize = u16::MAX as usize;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    state: AtomicU64,
    /// The current job's closure; written only while no task can be claimed (see module docs).
    job: UnsafeCell<Option<Job>>,
    done: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written by the dispatching thread while no worker can read it (no claimable task),
// and only read by a worker holding a claimed task of the generation that wrote it.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

#[inline(always)]
fn pack(generation: u32, n: usize, next: usize) -> u64 {
    ((generation as u64) << 32) | ((n as u64) << 16) | next as u64
}

#[inline(always)]
fn unpack(s: u64) -> (u32, usize, usize) {
    (
        (s >> 32) as u32,
        ((s >> 16) & 0xFFFF) as usize,
        (s & 0xFFFF) as usize,
    )
}

impl Shared {
    /// Claims and runs tasks of `generation` until none are left; returns how many this thread ran.
    fn work(&self, generation: u32) {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let (g, n, next) = unpack(s);
            if g != generation || next >= n {
                return;
            }
            match self
                .state
                .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    // SAFETY: holding an unfinished task of `generation` means the caller is still inside `run`
                    // for this generation, so `job` is set and the closure it points to is alive.
                    let f = unsafe { &*(*self.job.get()).expect("job set before publishing") };
                    if catch_unwind(AssertUnwindSafe(|| f(next))).is_err() {
                        self.panicked.store(true, Ordering::Relaxed);
                    }
                    self.done.fetch_add(1, Ordering::AcqRel);
                    s = self.state.load(Ordering::Acquire);
                }
                Err(cur) => s = cur,
            }
        }
    }
}

/// Persistent worker threads with cheap dispatch (spin, then park), the calling thread participates.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
    /// Serializes `run` calls from different threads (the protocol has one dispatcher at a time).
    dispatch: Mutex<u32>,
}

/// Resolves a thread-count setting where 0 means "all cores" (every `--threads` flag uses that rule).
pub fn resolve_threads(requested: usize) -> usize {
    if requested == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        requested
    }
}

impl ThreadPool {
    /// Starts `n_threads - 1` workers (`n_threads` includes the caller; 1 runs every job inline).
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..n_threads)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("tandem-kernel-{i}"))
                    .spawn(move || worker_loop(&shared))
                    .expect("spawn kernel worker thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            n_threads,
            dispatch: Mutex::new(0),
        }
    }

    /// Threads that run tasks, the caller included: kernels size their work split with it.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Calls `f(i)` for every `i in 0..n_tasks` across the pool and returns when all calls have finished.
    ///
    /// Must not be called from inside `f` (the pool runs one job at a time). A panic in `f` is re-raised here.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        if self.n_threads == 1 || n_tasks == 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        if n_tasks > MAX_TASKS {
            let per = n_tasks.div_ceil(MAX_TASKS);
            let folded = |t: usize| (t * per..((t + 1) * per).min(n_tasks)).for_each(f);
            return self.run(n_tasks.div_ceil(per), &folded);
        }
        let mut generation = self.dispatch.lock().unwrap_or_else(|e| e.into_inner());
        *generation = generation.wrapping_add(1);
        let g = *generation;
        let sh = &*self.shared;
        // SAFETY: every task of the previous generation has finished (we waited for them), so no worker can be
        // reading `job`. The lifetime is erased; we do not return before all tasks that can see it are done.
        unsafe {
            let erased: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f);
            *sh.job.get() = Some(erased);
        }
        sh.done.store(0, Ordering::Relaxed);
        sh.panicked.store(false, Ordering::Relaxed);
        sh.state.store(pack(g, n_tasks, 0), Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        sh.work(g);
        let mut spins = 0u32;
        while sh.done.load(Ordering::Acquire) < n_tasks {
            spins += 1;
            if spins < 1 << 14 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: all tasks finished; clear the dangling pointer before `f`'s borrow ends.
        unsafe { *sh.job.get() = None };
        if sh.panicked.load(Ordering::Relaxed) {
            drop(generation);
            panic!("a ThreadPool task panicked");
        }
    }
}

fn worker_loop(sh: &Shared) {
    let mut seen = 0u32;
    loop {
        let spin_start = Instant::now();
        let mut i = 0u32;
        let g = loop {
            let (g, _, _) = unpack(sh.state.load(Ordering::Acquire));
            if g != seen || sh.shutdown.load(Ordering::Relaxed) {
                break g;
            }
            i = i.wrapping_add(1);
            if i.is_multiple_of(64) && spin_start.elapsed() > SPIN {
                let mut guard = sh.lock.lock().unwrap_or_else(|e| e.into_inner());
                sh.sleepers.fetch_add(1, Ordering::SeqCst);
                while unpack(sh.state.load(Ordering::SeqCst)).0 == seen
                    && !sh.shutdown.load(Ordering::SeqCst)
                {
                    guard = sh.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                sh.sleepers.fetch_sub(1, Ordering::SeqCst);
            } else {
                std::hint::spin_loop();
            }
        };
        if sh.shutdown.load(Ordering::Relaxed) {
            return;
        }
        seen = g;
        sh.work(g);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _guard = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_exactly_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n in [0usize, 1, 2, 7, 100, 70_000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "threads {threads} n {n}"
                );
            }
        }
    }

    #[test]
    fn many_quick_dispatches_and_parking() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        for round in 0..2000 {
            pool.run(4, &|i| {
                total.fetch_add(i, Ordering::Relaxed);
            });
            if round % 500 == 0 {
                std::thread::sleep(Duration::from_millis(2)); // let the worker park
            }
        }
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 6);
    }

    #[test]
    fn task_panic_reaches_caller_and_pool_survives() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|i| {
                if i == 5 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let c = AtomicUsize::new(0);
        pool.run(8, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 8);
    }
}
