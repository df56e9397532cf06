//! Collectives between tensor-parallel ranks: the seam where NCCL (GPUs) or a network collective
//! would plug in; [`ThreadCollective`] runs the ranks as threads of one process.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// The operations tensor parallelism needs, called by every rank in the same order.
///
/// Activations are row-major `rows` × `width` matrices whose columns are split over the ranks; each call
/// names this rank's columns. (On GPUs an NCCL implementation would gather contiguous per-rank chunks and
/// interleave them in a kernel.)
pub trait Collective: Send {
    /// This rank's index.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Assembles on every rank the matrix `out` (`rows` × `width`) whose columns `cols` each rank holds
    /// as `local` (`rows` × `cols.len()`).
    fn all_gather_columns(
        &mut self,
        local: &[f32],
        cols: Range<usize>,
        width: usize,
        out: &mut [f32],
    );
    /// Like [`Collective::all_gather_columns`], but only rank 0 receives (and needs) `out`: logits.
    fn gather_columns(
        &mut self,
        local: &[f32],
        cols: Range<usize>,
        width: usize,
        out: Option<&mut [f32]>,
    );
}

/// Copies a `rows` × `cols.len()` block into columns `cols` of the `width`-wide rows of `out`.
fn put_columns(out: &mut [f32], width: usize, data: &[f32], cols: Range<usize>) {
    if cols.is_empty() {
        return;
    }
    for (dst, src) in out
        .chunks_exact_mut(width)
        .zip(data.chunks_exact(cols.len()))
    {
        dst[cols.clone()].copy_from_slice(src);
    }
}

/// Spins before a waiting rank sleeps: ranks usually arrive within microseconds of each other, and a
/// futex wake-up per exchange (4 per layer) would cost more than the exchange itself.
const SPINS: u32 = 4000;

/// A barrier that a failing rank can break, so its peers stop with a panic instead of waiting forever.
/// Waiters spin briefly, then sleep on a condition variable.
struct Barrier {
    arrived: AtomicUsize,
    generation: AtomicU64,
    broken: AtomicBool,
    sleep: Mutex<()>,
    cv: Condvar,
    n: usize,
}

impl Barrier {
    fn new(n: usize) -> Barrier {
        Barrier {
            arrived: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            broken: AtomicBool::new(false),
            sleep: Mutex::new(()),
            cv: Condvar::new(),
            n,
        }
    }

    fn check(&self) {
        assert!(
            !self.broken.load(Ordering::Acquire),
            "a tensor-parallel rank failed; the group is unusable"
        );
    }

    fn lock(&self) -> MutexGuard<'_, ()> {
        self.sleep.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait(&self) {
        self.check();
        let generation = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            // Reset before releasing: released ranks may arrive at the next barrier at once.
            self.arrived.store(0, Ordering::Relaxed);
            let _g = self.lock();
            self.generation.fetch_add(1, Ordering::Release);
            self.cv.notify_all();
            return;
        }
        let passed = || {
            self.generation.load(Ordering::Acquire) != generation
                || self.broken.load(Ordering::Acquire)
        };
        for _ in 0..SPINS {
            if passed() {
                return self.check();
            }
            std::hint::spin_loop();
        }
        let mut g = self.lock();
        while !passed() {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        drop(g);
        self.check();
    }

    fn break_all(&self) {
        self.broken.store(true, Ordering::Release);
        let _g = self.lock();
        self.cv.notify_all();
    }
}

/// What one rank posts for an exchange: its block of columns and which columns they are.
type Post = Mutex<(Vec<f32>, Range<usize>)>;

struct Shared {
    barrier: Barrier,
    /// Two exchange buffers per rank, used alternately: a rank can only be one exchange ahead of the
    /// slowest (it must pass that exchange's barrier first), so writing exchange k+2's buffer never
    /// disturbs a peer still reading exchange k's, and one barrier per exchange suffices.
    posts: Vec<[Post; 2]>,
}

/// Breaks a [`ThreadCollective`] group from outside it (see [`ThreadCollective::breaker`]).
pub struct GroupBreaker(Arc<Shared>);

impl GroupBreaker {
    /// Makes every pending and future collective call of the group panic instead of waiting.
    pub fn break_group(&self) {
        self.0.barrier.break_all();
    }
}

/// One rank of a group of threads that exchange through shared buffers.
pub struct ThreadCollective {
    rank: usize,
    shared: Arc<Shared>,
    /// Exchanges done so far; its parity picks the buffer.
    round: usize,
}

impl ThreadCollective {
    /// A group of `size` ranks; hand element `r` to the thread of rank `r`.
    pub fn group(size: usize) -> Vec<ThreadCollective> {
        assert!(size > 0, "a collective needs at least one rank");
        let post = || Mutex::new((Vec::new(), 0..0));
        let shared = Arc::new(Shared {
            barrier: Barrier::new(size),
            posts: (0..size).map(|_| [post(), post()]).collect(),
        });
        (0..size)
            .map(|rank| ThreadCollective {
                rank,
                shared: Arc::clone(&shared),
                round: 0,
            })
            .collect()
    }

    /// A handle that can only break the group: kept by whoever runs the rank, since the rank's own
    /// collective is owned by its model.
    pub fn breaker(&self) -> GroupBreaker {
        GroupBreaker(Arc::clone(&self.shared))
    }

    fn post(&self, r: usize) -> MutexGuard<'_, (Vec<f32>, Range<usize>)> {
        self.shared.posts[r][self.round % 2]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Posts this rank's columns, then assembles every rank's into `out` if this rank receives (`Some`).
    fn exchange(
        &mut self,
        local: &[f32],
        cols: Range<usize>,
        width: usize,
        out: Option<&mut [f32]>,
    ) {
        if self.size() == 1 {
            if let Some(out) = out {
                put_columns(out, width, local, cols);
            }
            return;
        }
        {
            let mut mine = self.post(self.rank);
            mine.0.clear();
            mine.0.extend_from_slice(local);
            mine.1 = cols;
        }
        self.shared.barrier.wait();
        if let Some(out) = out {
            for r in 0..self.size() {
                let post = self.post(r);
                put_columns(out, width, &post.0, post.1.clone());
            }
        }
        self.round += 1;
    }
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.posts.len()
    }

    fn all_gather_columns(
        &mut self,
        local: &[f32],
        cols: Range<usize>,
        width: usize,
        out: &mut [f32],
    ) {
        self.exchange(local, cols, width, Some(out));
    }

    fn gather_columns(
        &mut self,
        local: &[f32],
        cols: Range<usize>,
        width: usize,
        out: Option<&mut [f32]>,
    ) {
        assert!(
            self.rank != 0 || out.is_some(),
            "rank 0 gathers into an output buffer"
        );
        self.exchange(local, cols, width, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_columns_across_threads() {
        let group = ThreadCollective::group(3);
        let widths = [2usize, 3, 1];
        let want: Vec<f32> = (0..2)
            .flat_map(|row| (0..6).map(move |col| (row * 100 + col) as f32))
            .collect();
        let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let r = c.rank();
                        let start: usize = widths[..r].iter().sum();
                        let cols = start..start + widths[r];
                        // Two rows of this rank's columns, valued row*100 + column.
                        let local: Vec<f32> = (0..2)
                            .flat_map(|row| cols.clone().map(move |col| (row * 100 + col) as f32))
                            .collect();
                        let mut all = vec![-1.0; 2 * 6];
                        c.all_gather_columns(&local, cols.clone(), 6, &mut all);
                        let mut first = vec![-1.0; 2 * 6];
                        c.gather_columns(&local, cols, 6, (r == 0).then_some(&mut first[..]));
                        (all, first)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (all, first)) in results.iter().enumerate() {
            assert_eq!(all, &want, "rank {r} all-gather");
            if r == 0 {
                assert_eq!(first, &want);
            } else {
                assert!(
                    first.iter().all(|&v| v == -1.0),
                    "rank {r} must not receive"
                );
            }
        }
    }

    #[test]
    fn a_broken_group_fails_instead_of_hanging() {
        let mut group = ThreadCollective::group(2);
        let mut second = group.pop().unwrap();
        let first = group.pop().unwrap();
        let waiter = std::thread::spawn(move || {
            let mut out = vec![0.0; 2];
            second.all_gather_columns(&[1.0], 1..2, 2, &mut out);
        });
        first.breaker().break_group();
        assert!(
            waiter.join().is_err(),
            "the waiting rank must panic, not hang"
        );
    }
}
