//! How many neighbours (`k`) and what threshold (`t`) a round needs, for a stated
//! fraction of clients that drop out and a stated fraction that collude with the
//! coordinator (Bell et al. 2020, Section 3.2's conditions, with the union bound over
//! clients).
//!
//! Three things can go wrong in a round with the random `k`-regular graph of
//! [`super::graph`], each bounded here:
//!
//! - **Privacy** ([`privacy_failure_bound`]). A coordinator that cheats gets a client's
//!   seed shares from the neighbours it tells "survived" and its mask key shares from
//!   those it tells "dropped"; an honest neighbour answers once, with one kind, while a
//!   colluding one hands over both. With `c` colluding neighbours out of `k`, both kinds
//!   reach `t` only if `k + c >= 2t`. So `t` must exceed `(k + c) / 2` for every client,
//!   which fails with probability at most `n * P[Binomial(k, gamma) >= 2t - k]`.
//!
//!   The same bound covers a client cut off from every honest survivor (all its
//!   neighbours collude or dropped after sharing): its pairwise masks are then all known
//!   to the coordinator, but its self mask still needs `t` seed shares, which only its
//!   colluding neighbours would give, and `c >= t` is within `c >= 2t - k`.
//! - **Liveness** ([`super::failure_bound`]). A secret finds fewer than `t` neighbours
//!   that reveal its shares; colluding clients may refuse, so they count as dropouts.
//!
//! [`size`] picks the smallest even `k` from `2 ceil(log2 n)` up, with the smallest `t`
//! that keeps privacy failures under `2^-`[`SECURITY_BITS`] per round and liveness
//! under [`super::DESIGN_FAILURE`]. With no colluding clients it gives exactly
//! [`super::default_neighbours`] and [`super::default_threshold`].

use super::graph::effective_degree;

/// Per round, the privacy failure stays below `2^-40`.
pub const SECURITY_BITS: i32 = 40;

/// A round's neighbourhood and threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Neighbourhood {
    /// Neighbours per client (`k`); `n - 1` is the complete graph.
    pub neighbours: usize,
    /// Shares needed to rebuild a secret (`t`).
    pub threshold: usize,
}

/// Why no neighbourhood meets the conditions.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SizingError {
    /// A fraction outside `[0, 1)`, or too few clients.
    #[error("invalid sizing input: {0}")]
    Invalid(String),
    /// Even the complete graph cannot keep a client's update private against this many
    /// colluding clients.
    #[error(
        "no neighbourhood of {n} clients keeps updates private against a colluding fraction \
         of {colluding} (at {dropout} dropout)"
    )]
    Impossible {
        /// Clients.
        n: usize,
        /// Colluding fraction.
        colluding: f64,
        /// Dropout fraction.
        dropout: f64,
    },
}

/// `ln P[X = x]` for `X ~ Binomial(k, p)`, `0 < p < 1`.
fn ln_pmf(k: usize, p: f64, x: usize) -> f64 {
    let (k, x) = (k as f64, x as f64);
    libm::lgamma(k + 1.0) - libm::lgamma(x + 1.0) - libm::lgamma(k - x + 1.0)
        + x * p.ln()
        + (k - x) * (1.0 - p).ln()
}

/// `P[X >= c]` for `X ~ Binomial(k, p)`, summed in log space so that the tiny tails
/// this module compares with `2^-40` do not underflow.
pub fn binomial_at_least(k: usize, p: f64, c: usize) -> f64 {
    if c == 0 {
        return 1.0;
    }
    if c > k || p <= 0.0 {
        return 0.0;
    }
    if p >= 1.0 {
        return 1.0;
    }
    let logs: Vec<f64> = (c..=k).map(|x| ln_pmf(k, p, x)).collect();
    let max = logs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (max.exp() * logs.iter().map(|l| (l - max).exp()).sum::<f64>()).min(1.0)
}

fn security() -> f64 {
    2f64.powi(-SECURITY_BITS)
}

/// The fewest colluding neighbours `c` such that a client has `c` or more of them with
/// probability at most `2^-40 / n`: with `t > (k + c - 1) / 2` no client's two kinds of
/// share reach the coordinator, except with probability `2^-40` over the round.
pub fn colluding_bound(n: usize, k: usize, colluding: f64) -> usize {
    let k = effective_degree(n, k);
    (0..=k + 1)
        .find(|&c| n as f64 * binomial_at_least(k, colluding, c) <= security())
        .unwrap_or(k + 1)
}

/// The smallest threshold that keeps updates private against `colluding` (a fraction of
/// the clients) with `k` neighbours: `ceil((k' + c) / 2)`, `c` from [`colluding_bound`],
/// and never below the protocol's `floor(k' / 2) + 1`. May exceed `k'`: then no
/// threshold works and the neighbourhood must grow.
pub fn min_threshold(n: usize, k: usize, colluding: f64) -> usize {
    let keff = effective_degree(n, k);
    let c = colluding_bound(n, k, colluding);
    (keff + c).div_ceil(2).max(keff / 2 + 1)
}

/// An upper bound on the probability that some client's update is exposed to a
/// coordinator colluding with a `colluding` fraction of clients: some client has `2t - k`
/// or more colluding neighbours.
pub fn privacy_failure_bound(n: usize, k: usize, t: usize, colluding: f64) -> f64 {
    let keff = effective_degree(n, k);
    let need = (2 * t).saturating_sub(keff);
    (n as f64 * binomial_at_least(keff, colluding, need)).min(1.0)
}

/// The smallest neighbourhood (even `k` from `2 ceil(log2 n)`, or the complete graph)
/// and its smallest threshold that keep the privacy failure under `2^-40` and
/// the round failure under [`super::DESIGN_FAILURE`], for clients that drop out with
/// probability `dropout` and a `colluding` fraction of clients that work with the
/// coordinator.
pub fn size(n: usize, dropout: f64, colluding: f64) -> Result<Neighbourhood, SizingError> {
    for (name, f) in [("dropout", dropout), ("colluding fraction", colluding)] {
        if !(f.is_finite() && (0.0..1.0).contains(&f)) {
            return Err(SizingError::Invalid(format!(
                "{name} must be in [0, 1), got {f}"
            )));
        }
    }
    if n < 2 {
        return Err(SizingError::Invalid(format!(
            "a round needs at least 2 clients, got {n}"
        )));
    }
    // Colluding clients may refuse to reveal: for liveness they are dropouts too.
    let gone = 1.0 - (1.0 - dropout) * (1.0 - colluding);
    // Privacy is a must; liveness is the goal that sizes a sparse graph. The complete
    // graph is as live as a round of n clients can be, so it is taken when no sparser
    // one meets the goal, however often it would fail.
    let fits = |k: usize, live: bool| -> Option<Neighbourhood> {
        let keff = effective_degree(n, k);
        let t = min_threshold(n, k, colluding);
        let ok =
            t <= keff && (!live || super::failure_bound(n, k, t, gone) <= super::DESIGN_FAILURE);
        ok.then_some(Neighbourhood {
            neighbours: k.min(n - 1),
            threshold: t,
        })
    };
    let log = (usize::BITS - (n - 1).leading_zeros()) as usize;
    let mut k = (2 * log).max(2);
    while k < n - 1 {
        if let Some(found) = fits(k, true) {
            return Ok(found);
        }
        k += 2;
    }
    fits(n - 1, false).ok_or(SizingError::Impossible {
        n,
        colluding,
        dropout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secagg::{DESIGN_DROPOUT, default_neighbours, default_threshold};

    #[test]
    fn without_colluding_clients_the_sizing_is_the_default() {
        for n in [3, 10, 50, 100, 500, 1000, 5000] {
            let s = size(n, DESIGN_DROPOUT, 0.0).unwrap();
            let k = default_neighbours(n);
            assert_eq!(s.neighbours, k, "n = {n}");
            assert_eq!(s.threshold, default_threshold(n, k), "n = {n}");
        }
    }

    #[test]
    fn colluding_clients_need_larger_neighbourhoods_and_thresholds() {
        let honest = size(1000, 0.1, 0.0).unwrap();
        let some = size(1000, 0.1, 0.05).unwrap();
        assert!(some.neighbours > honest.neighbours, "{honest:?} {some:?}");
        // The conditions hold at the sizing, and fail with one neighbour fewer.
        let k = some.neighbours;
        assert!(privacy_failure_bound(1000, k, some.threshold, 0.05) <= security());
        assert!(
            privacy_failure_bound(1000, k, some.threshold - 1, 0.05) > security(),
            "the threshold is the smallest that works"
        );
        assert!(size(1000, 0.1, 0.05).unwrap().threshold * 2 > k);
        assert!(size(1000, 0.1, 0.1).unwrap().neighbours > k);
    }

    #[test]
    fn too_many_colluders_for_a_small_round_is_impossible_not_a_weak_setting() {
        // 10 clients, 30% colluding: some client has all 9 neighbours colluding with
        // probability 2e-4, far above 2^-40, so no threshold protects it.
        assert!(matches!(
            size(10, 0.1, 0.3),
            Err(SizingError::Impossible { .. })
        ));
        // 100 clients: the complete graph with a high threshold keeps updates private,
        // and is chosen though rounds with it fail often.
        let full = size(100, 0.1, 0.3).unwrap();
        assert_eq!(full.neighbours, 99);
        assert!(privacy_failure_bound(100, 99, full.threshold, 0.3) <= security());
        for bad in [-0.1, 1.0, f64::NAN] {
            assert!(matches!(size(100, bad, 0.0), Err(SizingError::Invalid(_))));
            assert!(matches!(size(100, 0.1, bad), Err(SizingError::Invalid(_))));
        }
    }

    /// The table in the README's threat model.
    #[test]
    fn the_readme_table_of_neighbourhoods_holds() {
        let table = [
            (100, 0.0, 20, 11),
            (1000, 0.0, 24, 13),
            (10_000, 0.0, 30, 16),
            (100, 0.01, 42, 27),
            (100, 0.05, 78, 52),
            (100, 0.1, 99, 70),
            (1000, 0.01, 50, 32),
            (1000, 0.05, 92, 61),
            (1000, 0.1, 180, 119),
            (10_000, 0.01, 58, 37),
            (10_000, 0.05, 104, 68),
        ];
        for (n, colluding, k, t) in table {
            assert_eq!(
                size(n, 0.1, colluding).unwrap(),
                Neighbourhood {
                    neighbours: k,
                    threshold: t
                },
                "n = {n}, colluding {colluding}"
            );
        }
    }

    #[test]
    fn the_log_space_tail_matches_the_direct_sum() {
        let direct = |k: usize, p: f64, c: usize| -> f64 {
            (c..=k)
                .map(|x| {
                    let mut comb = 1.0;
                    for i in 0..x {
                        comb *= (k - i) as f64 / (i + 1) as f64;
                    }
                    comb * p.powi(x as i32) * (1.0 - p).powi((k - x) as i32)
                })
                .sum()
        };
        for (k, p, c) in [(20, 0.1, 3), (50, 0.3, 20), (10, 0.5, 0), (10, 0.5, 11)] {
            let (a, b) = (binomial_at_least(k, p, c), direct(k, p, c));
            assert!((a - b).abs() <= 1e-12 + 1e-9 * b, "{k} {p} {c}: {a} vs {b}");
        }
    }
}
