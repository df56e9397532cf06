//! Collectives between tensor-parallel ranks: the seam where NCCL (GPUs) or a network collective
//! would plug in; [`ThreadCollective`] runs the ranks as threads of one process.

use std::ops::Range;
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

/// A barrier that a failing rank can break, so its peers stop with a panic instead of waiting forever.
struct Barrier {
    state: Mutex<BarrierState>,
    cv: Condvar,
    n: usize,
}

struct BarrierState {
    arrived: usize,
    generation: u64,
    broken: bool,
}

impl Barrier {
    fn lock(&self) -> MutexGuard<'_, BarrierState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait(&self) {
        let mut s = self.lock();
        assert!(
            !s.broken,
            "a tensor-parallel rank failed; the group is unusable"
        );
        s.arrived += 1;
        if s.arrived == self.n {
            s.arrived = 0;
            s.generation += 1;
            self.cv.notify_all();
            return;
        }
        let generation = s.generation;
        while s.generation == generation && !s.broken {
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        assert!(
            !s.broken,
            "a tensor-parallel rank failed; the group is unusable"
        );
    }

    fn break_all(&self) {
        self.lock().broken = true;
        self.cv.notify_all();
    }
}

struct Shared {
    barrier: Barrier,
    /// One exchange buffer per rank, written by its owner between two barriers.
    slots: Vec<Mutex<Vec<f32>>>,
    /// The columns each rank posted for a gather.
    cols: Vec<Mutex<Range<usize>>>,
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
}

impl ThreadCollective {
    /// A group of `size` ranks; hand element `r` to the thread of rank `r`.
    pub fn group(size: usize) -> Vec<ThreadCollective> {
        assert!(size > 0, "a collective needs at least one rank");
        let shared = Arc::new(Shared {
            barrier: Barrier {
                state: Mutex::new(BarrierState {
                    arrived: 0,
                    generation: 0,
                    broken: false,
                }),
                cv: Condvar::new(),
                n: size,
            },
            slots: (0..size).map(|_| Mutex::new(Vec::new())).collect(),
            cols: (0..size).map(|_| Mutex::new(0..0)).collect(),
        });
        (0..size)
            .map(|rank| ThreadCollective {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    /// Breaks the group after a rank failed: its peers' pending and future calls panic instead of hanging.
    pub fn break_group(&self) {
        self.shared.barrier.break_all();
    }

    /// A handle that can only break the group: kept by whoever runs the rank, since the rank's own
    /// collective is owned by its model.
    pub fn breaker(&self) -> GroupBreaker {
        GroupBreaker(Arc::clone(&self.shared))
    }

    fn slot(&self, r: usize) -> MutexGuard<'_, Vec<f32>> {
        self.shared.slots[r]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn post(&self, data: &[f32], cols: Range<usize>) {
        let mut s = self.slot(self.rank);
        s.clear();
        s.extend_from_slice(data);
        *self.shared.cols[self.rank]
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = cols;
    }

    /// Posts this rank's columns, then assembles every rank's into `out` (on all ranks, or rank 0 only).
    fn exchange(
        &self,
        local: &[f32],
        cols: Range<usize>,
        width: usize,
        out: Option<&mut [f32]>,
        everyone: bool,
    ) {
        let receives = everyone || self.rank == 0;
        if self.size() == 1 {
            if let Some(out) = out {
                put_columns(out, width, local, cols);
            }
            return;
        }
        self.post(local, cols);
        self.shared.barrier.wait();
        if receives {
            let out = out.expect("a receiving rank passes an output buffer");
            for r in 0..self.size() {
                let c = self.shared.cols[r]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                put_columns(out, width, &self.slot(r), c);
            }
        }
        // Nobody may overwrite a slot before every receiver has read it.
        self.shared.barrier.wait();
    }
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.slots.len()
    }

    fn all_gather_columns(
        &mut self,
        local: &[f32],
        cols: Range<usize>,
        width: usize,
        out: &mut [f32],
    ) {
        self.exchange(local, cols, width, Some(out), true);
    }

    fn gather_columns(
        &mut self,
        local: &[f32],
        cols: Range<usize>,
        width: usize,
        out: Option<&mut [f32]>,
    ) {
        self.exchange(local, cols, width, out, false);
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
        first.break_group();
        assert!(
            waiter.join().is_err(),
            "the waiting rank must panic, not hang"
        );
    }
}
