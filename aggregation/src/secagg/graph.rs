//! The SecAgg+ neighbour graph (Bell et al. 2020): each client shares secrets with, and
//! masks against, only its `k` neighbours instead of every other client.
//!
//! The graph is a Harary graph on a random ring: the clients that advertised keys are
//! shuffled with a keystream derived from the round's public session id, placed on a
//! ring in that order, and each is joined to the `k / 2` nearest on either side. Every
//! client and the coordinator compute the same graph from public data, so no party has
//! to trust another's neighbour list. `k` is rounded up to an even number; when it
//! reaches `n - 1` the graph is complete (the original SecAgg).

use super::crypto::{self, KEY_BYTES};
use super::prg;

/// Why a graph cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    /// Members must be given in strictly ascending order, each once.
    #[error("graph members must be distinct and in ascending order")]
    Unsorted,
    /// A graph needs at least two members.
    #[error("a neighbour graph needs at least two members, got {0}")]
    TooSmall(usize),
    /// A neighbourhood of zero clients.
    #[error("each client needs at least one neighbour")]
    NoNeighbours,
}

/// Who neighbours whom in one round.
///
/// Every client of a round builds the whole graph to find its own neighbours, so in a
/// round of ten thousand clients simulated in one process it is built ten thousand
/// times: it is kept to three flat vectors made in linear time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeighbourGraph {
    /// Members, ascending: a member's rank is its place here.
    members: Vec<u32>,
    /// Members in ring order.
    ring: Vec<u32>,
    /// Each member's position on the ring, by rank.
    position: Vec<u32>,
    degree: usize,
}

/// The degree the graph really has for `n` members when `k` neighbours are asked for: `k`
/// rounded up to even, or `n - 1` (the complete graph) when that is not smaller.
pub fn effective_degree(n: usize, k: usize) -> usize {
    let full = n.saturating_sub(1);
    let even = k.saturating_add(k & 1);
    even.min(full)
}

/// A uniform index below `bound` from a word stream (Lemire's method with rejection, so
/// the shuffle is exactly uniform and the same on every platform).
fn below(bound: u32, next: &mut impl FnMut() -> u32) -> u32 {
    let threshold = bound.wrapping_neg() % bound;
    loop {
        let m = u64::from(next()) * u64::from(bound);
        if (m as u32) >= threshold {
            return (m >> 32) as u32;
        }
    }
}

impl NeighbourGraph {
    /// The graph over `members` (ascending client indices) for the round with public id
    /// `session`, with `k` neighbours per member (see [`effective_degree`]).
    pub fn new(members: &[u32], session: &[u8; KEY_BYTES], k: usize) -> Result<Self, GraphError> {
        if members.windows(2).any(|w| w[0] >= w[1]) {
            return Err(GraphError::Unsorted);
        }
        if members.len() < 2 {
            return Err(GraphError::TooSmall(members.len()));
        }
        if k == 0 {
            return Err(GraphError::NoNeighbours);
        }
        let degree = effective_degree(members.len(), k);
        // The shuffle moves ranks rather than members: the same swaps, so the same ring,
        // and each rank's position falls out without a search.
        let mut order: Vec<u32> = (0..members.len() as u32).collect();
        if degree < members.len() - 1 {
            let seed = crypto::public_derivation(session, b"neighbour graph");
            let mut buf = [0u32; 64];
            let mut used = buf.len();
            let mut word = 0u64;
            let mut next = || {
                if used == buf.len() {
                    prg::keystream(&seed, word, &mut buf)
                        .expect("a shuffle uses a tiny part of the keystream");
                    word += buf.len() as u64;
                    used = 0;
                }
                used += 1;
                buf[used - 1]
            };
            // Fisher-Yates.
            for i in (1..order.len()).rev() {
                let j = below(i as u32 + 1, &mut next) as usize;
                order.swap(i, j);
            }
        }
        let mut position = vec![0u32; order.len()];
        for (at, &rank) in order.iter().enumerate() {
            position[rank as usize] = at as u32;
        }
        let ring = order.iter().map(|&rank| members[rank as usize]).collect();
        Ok(Self {
            members: members.to_vec(),
            ring,
            position,
            degree,
        })
    }

    /// The ring position of member `u`.
    fn position_of(&self, u: u32) -> Option<usize> {
        let rank = self.members.binary_search(&u).ok()?;
        Some(self.position[rank] as usize)
    }

    /// Neighbours per member.
    pub fn degree(&self) -> usize {
        self.degree
    }

    /// Members, in ascending order.
    pub fn members(&self) -> impl Iterator<Item = u32> + '_ {
        self.members.iter().copied()
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.ring.len()
    }

    /// True for a graph without members (never: a graph has at least two).
    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    /// Whether `u` is a member.
    pub fn contains(&self, u: u32) -> bool {
        self.members.binary_search(&u).is_ok()
    }

    /// The neighbours of `u` in ascending order, or `None` when `u` is not a member.
    pub fn neighbours(&self, u: u32) -> Option<Vec<u32>> {
        let p = self.position_of(u)?;
        let n = self.ring.len();
        let mut out: Vec<u32> = if self.degree == n - 1 {
            self.ring.iter().copied().filter(|&v| v != u).collect()
        } else {
            let half = self.degree / 2;
            (1..=half)
                .flat_map(|d| [self.ring[(p + d) % n], self.ring[(p + n - d) % n]])
                .collect()
        };
        out.sort_unstable();
        Some(out)
    }

    /// Whether `u` and `v` are neighbours.
    pub fn are_neighbours(&self, u: u32, v: u32) -> bool {
        let (Some(pu), Some(pv)) = (self.position_of(u), self.position_of(v)) else {
            return false;
        };
        if u == v {
            return false;
        }
        let n = self.ring.len();
        if self.degree == n - 1 {
            return true;
        }
        let d = (pu + n - pv) % n;
        d.min(n - d) <= self.degree / 2
    }

    /// Where `v` stands among `u`'s neighbours in ascending order (the place of `v` in
    /// [`neighbours`](Self::neighbours)`(u)`), or `None` when they are not neighbours.
    /// A client's shares are dealt in that order, so this finds the share `u` dealt to
    /// `v` without searching the shares: the server does it for each of the 360,000
    /// shares revealed in a round of 10,000, where a binary search through 40 dealt
    /// shares (scattered cache lines, each step waiting for the last) was most of the
    /// checks' time. Here the 40 neighbours are two short runs of the ring, read at once.
    pub fn neighbour_rank(&self, u: u32, v: u32) -> Option<usize> {
        if !self.are_neighbours(u, v) {
            return None;
        }
        let n = self.ring.len();
        if self.degree == n - 1 {
            // Every other member, ascending: v's rank, less one when u comes before it.
            let rank = self.members.binary_search(&v).ok()?;
            return Some(rank - usize::from(u < v));
        }
        let p = self.position_of(u)?;
        let half = self.degree / 2;
        Some(
            (1..=half)
                .map(|d| {
                    usize::from(self.ring[(p + d) % n] < v)
                        + usize::from(self.ring[(p + n - d) % n] < v)
                })
                .sum(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn graph_is_regular_symmetric_and_public(
            n in 2usize..120,
            k in 1usize..40,
            session in any::<[u8; 32]>(),
            gap in 1u32..4,
        ) {
            let members: Vec<u32> = (0..n as u32).map(|i| 1 + i * gap).collect();
            let g = NeighbourGraph::new(&members, &session, k).unwrap();
            let degree = effective_degree(n, k);
            prop_assert_eq!(g.degree(), degree);
            prop_assert!(degree >= k.min(n - 1));
            for &u in &members {
                let nb = g.neighbours(u).unwrap();
                prop_assert_eq!(nb.len(), degree, "regular");
                prop_assert!(!nb.contains(&u));
                for &v in &nb {
                    prop_assert!(g.are_neighbours(u, v));
                    prop_assert!(g.neighbours(v).unwrap().contains(&u), "symmetric");
                }
                // Each neighbour's rank is its place in the ascending list; everyone
                // else (u itself, non-neighbours, non-members) has none.
                for v in 0..=(1 + n as u32 * gap) {
                    prop_assert_eq!(
                        g.neighbour_rank(u, v),
                        nb.iter().position(|&x| x == v),
                        "rank of {} among {}'s neighbours", v, u
                    );
                }
            }
            let again = NeighbourGraph::new(&members, &session, k).unwrap();
            prop_assert_eq!(&g, &again, "every party computes the same graph");
        }
    }

    proptest! {
        /// Parties of different versions must draw the same graph: the ring is the
        /// Fisher-Yates shuffle of the members themselves with the session's keystream,
        /// however the graph keeps it.
        #[test]
        fn ring_is_the_members_own_shuffle(
            n in 2usize..300,
            k in 1usize..12,
            session in any::<[u8; 32]>(),
        ) {
            let members: Vec<u32> = (0..n as u32).map(|i| 3 + i * 2).collect();
            let g = NeighbourGraph::new(&members, &session, k).unwrap();
            let mut expected = members.clone();
            if g.degree() < n - 1 {
                let seed = crypto::public_derivation(&session, b"neighbour graph");
                let mut stream = vec![0u32; 64 * (4 * n / 64 + 2)];
                prg::keystream(&seed, 0, &mut stream).unwrap();
                let mut words = stream.into_iter();
                let mut next = || words.next().expect("enough words for the shuffle");
                for i in (1..n).rev() {
                    let j = below(i as u32 + 1, &mut next) as usize;
                    expected.swap(i, j);
                }
            }
            prop_assert_eq!(&g.ring, &expected);
            for (at, &u) in expected.iter().enumerate() {
                prop_assert_eq!(g.position_of(u), Some(at));
            }
            prop_assert_eq!(g.position_of(2), None);
            prop_assert_eq!(g.members().collect::<Vec<_>>(), members);
        }
    }

    #[test]
    fn different_sessions_give_different_graphs() {
        let members: Vec<u32> = (1..=100).collect();
        let a = NeighbourGraph::new(&members, &[1; 32], 10).unwrap();
        let b = NeighbourGraph::new(&members, &[2; 32], 10).unwrap();
        assert_ne!(a.neighbours(1), b.neighbours(1));
        // The shuffle really mixes: client 1's neighbours are not just 2..=6 and 96..=100.
        assert_ne!(
            a.neighbours(1).unwrap(),
            vec![2, 3, 4, 5, 6, 96, 97, 98, 99, 100]
        );
    }

    #[test]
    fn odd_k_rounds_up_and_large_k_is_complete() {
        assert_eq!(effective_degree(100, 13), 14);
        assert_eq!(effective_degree(100, 14), 14);
        assert_eq!(effective_degree(10, 9), 9);
        assert_eq!(effective_degree(10, 500), 9);
        assert_eq!(effective_degree(9, 7), 8);
        let g = NeighbourGraph::new(&[1, 2, 3, 4], &[0; 32], 100).unwrap();
        assert_eq!(g.neighbours(2).unwrap(), vec![1, 3, 4]);
        assert_eq!(g.neighbours(5), None);
        assert!(!g.are_neighbours(1, 1));
    }

    #[test]
    fn bad_members_are_errors() {
        assert_eq!(
            NeighbourGraph::new(&[2, 1], &[0; 32], 2),
            Err(GraphError::Unsorted)
        );
        assert_eq!(
            NeighbourGraph::new(&[1, 1], &[0; 32], 2),
            Err(GraphError::Unsorted)
        );
        assert_eq!(
            NeighbourGraph::new(&[1], &[0; 32], 2),
            Err(GraphError::TooSmall(1))
        );
        assert_eq!(
            NeighbourGraph::new(&[1, 2], &[0; 32], 0),
            Err(GraphError::NoNeighbours)
        );
    }

    #[test]
    fn shuffle_index_is_uniform_and_in_range() {
        let mut state = 1u32;
        let mut next = || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            state
        };
        let mut counts = [0usize; 7];
        for _ in 0..70_000 {
            counts[below(7, &mut next) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_000..11_000).contains(&c)),
            "{counts:?}"
        );
    }
}
