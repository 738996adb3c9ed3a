//! Symmetry: the cycles of a fabric automorphism on ranks and links, and the check that
//! the schedules are invariant under it.
//!
//! A generator `g` of [`Fabric::symmetry`](crate::Fabric::symmetry) splits the ranks into
//! cycles `r, g(r), g²(r), …` (orbits of the group it generates) and the links likewise.
//! The run simulates one representative per rank orbit, its lowest rank, when the schedule
//! of `g(r)` is the schedule of `r` with every peer mapped by `g`: the same steps in the same
//! order, kinds, channels, lengths and dependencies (offsets may differ). This is checked
//! for every representative `r` (for 64 of them, evenly spread, when there are more), which
//! makes the schedules invariant under `g` along every orbit when each schedule is a
//! function of the rank's position relative to its peers (as the library's are); it is not a
//! proof for arbitrary schedules.

use oxccl_core::schedule::{Op, Region, Schedule};

/// Cycles of a permutation of `0..n`, each starting at its lowest element, ordered by it.
#[derive(Clone, Debug)]
pub(crate) struct Cycles {
    /// The cycles: `cycles[c][i] = gⁱ(cycles[c][0])`.
    pub(crate) cycles: Vec<Vec<usize>>,
    /// Each element's cycle.
    pub(crate) cycle_of: Vec<u32>,
    /// Each element's position in its cycle.
    pub(crate) pos: Vec<u32>,
}

impl Cycles {
    /// The cycles of `map` (a permutation of `0..map.len()`), or `None` if it is not one.
    pub(crate) fn of(map: &[usize]) -> Option<Cycles> {
        let n = map.len();
        let mut cycle_of = vec![u32::MAX; n];
        let mut pos = vec![0u32; n];
        let mut cycles = Vec::new();
        for start in 0..n {
            if cycle_of[start] != u32::MAX {
                continue;
            }
            let c = cycles.len() as u32;
            let mut cyc = Vec::new();
            let mut x = start;
            loop {
                if x >= n || cycle_of[x] != u32::MAX {
                    // Not a permutation: a second way into a visited element, or out of range.
                    if x == start {
                        break;
                    }
                    return None;
                }
                cycle_of[x] = c;
                pos[x] = cyc.len() as u32;
                cyc.push(x);
                x = map[x];
            }
            cycles.push(cyc);
        }
        Some(Cycles {
            cycles,
            cycle_of,
            pos,
        })
    }

    /// The identity on `0..n`.
    pub(crate) fn identity(n: usize) -> Cycles {
        Cycles {
            cycles: (0..n).map(|i| vec![i]).collect(),
            cycle_of: (0..n as u32).collect(),
            pos: vec![0; n],
        }
    }

    /// The representative (lowest element) of `x`'s cycle.
    pub(crate) fn rep(&self, x: usize) -> usize {
        self.cycles[self.cycle_of[x] as usize][0]
    }

    /// The length of `x`'s cycle.
    pub(crate) fn len_of(&self, x: usize) -> usize {
        self.cycles[self.cycle_of[x] as usize].len()
    }

    /// `j` such that `gʲ(x)` is `x`'s representative.
    pub(crate) fn to_rep(&self, x: usize) -> usize {
        let len = self.len_of(x);
        (len - self.pos[x] as usize) % len
    }

    /// `gʲ(x)`.
    pub(crate) fn apply(&self, x: usize, j: usize) -> usize {
        let cyc = &self.cycles[self.cycle_of[x] as usize];
        cyc[(self.pos[x] as usize + j) % cyc.len()]
    }
}

/// Whether `b` is `a` with every peer mapped by `g` (kinds, channels, lengths, and with
/// `deps` dependencies equal; offsets free). `same_memory(region, region)` tells whether a copy is skipped.
pub(crate) fn invariant(
    a: &Schedule,
    b: &Schedule,
    g: impl Fn(usize) -> usize,
    copy_skipped_a: impl Fn(Region, Region) -> bool,
    copy_skipped_b: impl Fn(Region, Region) -> bool,
    deps: bool,
) -> bool {
    if a.steps.len() != b.steps.len() {
        return false;
    }
    // Dependency lists compared element by element: they are short, and comparing them as
    // slices calls memcmp for each (even two empty ones), a tenth of the time a 16k-rank
    // run spends building its schedules.
    let same = |x: &[u32], y: &[u32]| x.len() == y.len() && x.iter().zip(y).all(|(a, b)| a == b);
    a.steps.iter().zip(&b.steps).all(|(x, y)| {
        (!deps || same(&x.deps, &y.deps))
            && match (&x.op, &y.op) {
                (
                    Op::Send {
                        peer: p1,
                        channel: c1,
                        src: s1,
                    },
                    Op::Send {
                        peer: p2,
                        channel: c2,
                        src: s2,
                    },
                ) => g(*p1) == *p2 && c1 == c2 && s1.len == s2.len,
                (
                    Op::Recv {
                        peer: p1,
                        channel: c1,
                        dst: d1,
                        reduce_with: w1,
                    },
                    Op::Recv {
                        peer: p2,
                        channel: c2,
                        dst: d2,
                        reduce_with: w2,
                    },
                ) => g(*p1) == *p2 && c1 == c2 && d1.len == d2.len && w1.is_some() == w2.is_some(),
                (Op::Copy { src: s1, dst: d1 }, Op::Copy { src: s2, dst: d2 }) => {
                    s1.len == s2.len && copy_skipped_a(*s1, *d1) == copy_skipped_b(*s2, *d2)
                }
                (
                    Op::Reduce {
                        dst: d1,
                        a: a1,
                        b: b1,
                    },
                    Op::Reduce {
                        dst: d2,
                        a: a2,
                        b: b2,
                    },
                ) => d1.len == d2.len && a1.len == a2.len && b1.len == b2.len,
                _ => false,
            }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycles_of_a_shift() {
        // Shift by 2 on 6 elements: cycles (0 2 4) and (1 3 5).
        let c = Cycles::of(&[2, 3, 4, 5, 0, 1]).unwrap();
        assert_eq!(c.cycles, vec![vec![0, 2, 4], vec![1, 3, 5]]);
        assert_eq!(c.rep(4), 0);
        assert_eq!(c.to_rep(4), 1);
        assert_eq!(c.apply(4, c.to_rep(4)), 0);
        assert_eq!(c.apply(3, 2), 1);
        assert!(Cycles::of(&[1, 1]).is_none());
        assert!(Cycles::of(&[0, 5]).is_none());
    }
}
