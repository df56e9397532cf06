//! Collectives between tensor-parallel ranks: the seam where NCCL (GPUs) or a network collective
//! would plug in; [`ThreadCollective`] runs the ranks as threads of one process.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// The two operations tensor parallelism needs, called by every rank in the same order.
pub trait Collective: Send {
    /// This rank's index.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Replaces `buf` on every rank by the element-wise sum over ranks, added in rank order, so all ranks
    /// hold bit-identical results (each keeps its own copy of the residual stream).
    fn all_reduce_sum(&mut self, buf: &mut [f32]);
    /// Assembles on rank 0 the `rows` × `width` matrix `out` whose columns `cols` each rank holds as
    /// `local` (`rows` × `cols.len()`); `out` is only written (and only needed) on rank 0.
    fn gather_columns(
        &mut self,
        local: &[f32],
        cols: Range<usize>,
        width: usize,
        out: Option<&mut [f32]>,
    );
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

    fn post(&self, data: &[f32]) {
        let mut s = self.slot(self.rank);
        s.clear();
        s.extend_from_slice(data);
    }
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.slots.len()
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) {
        if self.size() == 1 {
            return;
        }
        self.post(buf);
        self.shared.barrier.wait();
        buf.copy_from_slice(&self.slot(0));
        for r in 1..self.size() {
            for (b, v) in buf.iter_mut().zip(self.slot(r).iter()) {
                *b += v;
            }
        }
        // Nobody may overwrite a slot before every rank has read it.
        self.shared.barrier.wait();
    }

    fn gather_columns(
        &mut self,
        local: &[f32],
        cols: Range<usize>,
        width: usize,
        out: Option<&mut [f32]>,
    ) {
        if self.rank != 0 {
            self.post(local);
            *self.shared.cols[self.rank]
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = cols.clone();
        }
        self.shared.barrier.wait();
        if self.rank == 0 {
            let out = out.expect("rank 0 gathers into an output buffer");
            let rows = out.len() / width.max(1);
            let mut put = |data: &[f32], c: Range<usize>| {
                if c.is_empty() {
                    return;
                }
                for (row, src) in data.chunks_exact(c.len()).take(rows).enumerate() {
                    out[row * width + c.start..row * width + c.end].copy_from_slice(src);
                }
            };
            put(local, cols);
            for r in 1..self.size() {
                let c = self.shared.cols[r]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                put(&self.slot(r), c);
            }
        }
        self.shared.barrier.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_and_gather_across_threads() {
        let group = ThreadCollective::group(3);
        let widths = [2usize, 3, 1];
        let results: Vec<(Vec<f32>, Option<Vec<f32>>)> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let r = c.rank();
                        let mut buf: Vec<f32> = (0..4).map(|i| (i * 10 + r) as f32).collect();
                        c.all_reduce_sum(&mut buf);
                        let start: usize = widths[..r].iter().sum();
                        let cols = start..start + widths[r];
                        // Two rows of this rank's columns, valued row*100 + column.
                        let local: Vec<f32> = (0..2)
                            .flat_map(|row| cols.clone().map(move |col| (row * 100 + col) as f32))
                            .collect();
                        let mut out = vec![-1.0; 2 * 6];
                        c.gather_columns(&local, cols, 6, (r == 0).then_some(&mut out[..]));
                        (buf, (r == 0).then_some(out))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (buf, _) in &results {
            assert_eq!(buf, &[3.0, 33.0, 63.0, 93.0]);
        }
        let want: Vec<f32> = (0..2)
            .flat_map(|row| (0..6).map(move |col| (row * 100 + col) as f32))
            .collect();
        assert_eq!(results[0].1.as_ref().unwrap(), &want);
    }

    #[test]
    fn a_broken_group_fails_instead_of_hanging() {
        let mut group = ThreadCollective::group(2);
        let mut second = group.pop().unwrap();
        let first = group.pop().unwrap();
        let waiter = std::thread::spawn(move || {
            let mut buf = vec![1.0];
            second.all_reduce_sum(&mut buf);
        });
        first.break_group();
        assert!(
            waiter.join().is_err(),
            "the waiting rank must panic, not hang"
        );
    }
}
