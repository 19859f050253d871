//! Aggregation rules that hold up when some clients send arbitrary updates: the
//! coordinate-wise median, the coordinate-wise trimmed mean (Yin et al. 2018), Krum and
//! Multi-Krum (Blanchard et al. 2017).
//!
//! Each rule looks at every individual update, so none can run under secure
//! aggregation, where the coordinator sees only the sum. Sample counts are ignored on
//! purpose: a malicious client could claim any count it likes. Updates are held in
//! memory (O(n d)): a robust rule needs them all at once.

use rayon::prelude::*;

/// A robust aggregation rule. Written as `median`, `trimmed-mean:BETA`, `krum:F` or
/// `multi-krum:F:M` in settings and on the command line.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum RobustRule {
    /// Per coordinate, the median of the clients' values (the mean of the middle two for
    /// an even count).
    Median,
    /// Per coordinate, the mean after dropping the `trim` fraction of largest and of
    /// smallest values (`0 <= trim < 0.5`; `floor(trim * n)` from each side).
    TrimmedMean {
        /// The fraction dropped from each side.
        trim: f64,
    },
    /// The one update whose summed squared distance to its `n - byzantine - 2` nearest
    /// neighbours is smallest; needs `n > 2 * byzantine + 2`.
    Krum {
        /// How many clients may be malicious.
        byzantine: usize,
    },
    /// The mean of the `select` updates with the best Krum scores.
    MultiKrum {
        /// How many clients may be malicious.
        byzantine: usize,
        /// How many updates are averaged (`1..=n - byzantine`).
        select: usize,
    },
}

/// Why a robust aggregation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RobustError {
    /// No updates.
    #[error("no updates to aggregate")]
    Empty,
    /// Updates of different lengths.
    #[error("update {index} has {got} values, the first has {expected}")]
    Length {
        /// Which update.
        index: usize,
        /// Its length.
        got: usize,
        /// The first update's length.
        expected: usize,
    },
    /// A NaN or infinite value.
    #[error("update {index} holds a non-finite value")]
    NonFinite {
        /// Which update.
        index: usize,
    },
    /// The rule's parameters do not fit the number of updates.
    #[error("{0}")]
    Parameters(String),
}

impl RobustRule {
    /// The rule's name as written in settings: `median`, `trimmed-mean:0.2`, `krum:2`,
    /// `multi-krum:2:10`.
    pub fn name(&self) -> String {
        match self {
            RobustRule::Median => "median".into(),
            RobustRule::TrimmedMean { trim } => format!("trimmed-mean:{trim}"),
            RobustRule::Krum { byzantine } => format!("krum:{byzantine}"),
            RobustRule::MultiKrum { byzantine, select } => {
                format!("multi-krum:{byzantine}:{select}")
            }
        }
    }

    /// Checks the parameters against `n` updates.
    pub fn check(&self, n: usize) -> Result<(), RobustError> {
        let bad = |m: String| Err(RobustError::Parameters(m));
        match *self {
            RobustRule::Median => Ok(()),
            RobustRule::TrimmedMean { trim } => {
                if !(trim.is_finite() && (0.0..0.5).contains(&trim)) {
                    return bad(format!(
                        "trimmed mean: trim must be in [0, 0.5), got {trim}"
                    ));
                }
                Ok(())
            }
            RobustRule::Krum { byzantine } => krum_fits(n, byzantine),
            RobustRule::MultiKrum { byzantine, select } => {
                krum_fits(n, byzantine)?;
                if select == 0 || select > n - byzantine {
                    return bad(format!(
                        "multi-krum: select must be between 1 and n - byzantine = {}, got {select}",
                        n - byzantine
                    ));
                }
                Ok(())
            }
        }
    }
}

impl std::fmt::Display for RobustRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl From<RobustRule> for String {
    fn from(rule: RobustRule) -> String {
        rule.name()
    }
}

impl TryFrom<String> for RobustRule {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl std::str::FromStr for RobustRule {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        const ACCEPTED: &str = "median, trimmed-mean:BETA, krum:F or multi-krum:F:M";
        let lower = text.trim().to_ascii_lowercase();
        let parts: Vec<&str> = lower.split(':').collect();
        let count = |s: &str, what: &str| {
            s.parse::<usize>()
                .map_err(|_| format!("`{text}`: {what} must be a whole number, got `{s}`"))
        };
        match parts.as_slice() {
            ["median"] => Ok(RobustRule::Median),
            ["trimmed-mean", beta] => {
                let trim: f64 = beta.parse().map_err(|_| {
                    format!("`{text}`: the trimmed fraction must be a number, got `{beta}`")
                })?;
                let rule = RobustRule::TrimmedMean { trim };
                rule.check(usize::MAX).map_err(|e| e.to_string())?;
                Ok(rule)
            }
            ["krum", f] => Ok(RobustRule::Krum {
                byzantine: count(f, "the number of byzantine clients")?,
            }),
            ["multi-krum", f, m] => Ok(RobustRule::MultiKrum {
                byzantine: count(f, "the number of byzantine clients")?,
                select: count(m, "the number of updates averaged")?,
            }),
            _ => Err(format!("unknown aggregator `{text}`: expected {ACCEPTED}")),
        }
    }
}

fn krum_fits(n: usize, byzantine: usize) -> Result<(), RobustError> {
    if n < 2 * byzantine + 3 {
        return Err(RobustError::Parameters(format!(
            "krum with {byzantine} byzantine clients needs at least {} updates, got {n}",
            2 * byzantine + 3
        )));
    }
    Ok(())
}

fn validate(updates: &[&[f32]]) -> Result<usize, RobustError> {
    let first = updates.first().ok_or(RobustError::Empty)?;
    for (index, u) in updates.iter().enumerate() {
        if u.len() != first.len() {
            return Err(RobustError::Length {
                index,
                got: u.len(),
                expected: first.len(),
            });
        }
        if u.iter().any(|v| !v.is_finite()) {
            return Err(RobustError::NonFinite { index });
        }
    }
    Ok(first.len())
}

/// Coordinates handled per parallel task.
const CHUNK: usize = 4096;

/// Applies `per_column` to each coordinate's values across the updates, in parallel.
fn per_coordinate(
    updates: &[&[f32]],
    d: usize,
    per_column: impl Fn(&mut [f32]) -> f32 + Sync,
) -> Vec<f32> {
    let mut out = vec![0.0f32; d];
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut column = vec![0.0f32; updates.len()];
            for (k, slot) in chunk.iter_mut().enumerate() {
                let j = c * CHUNK + k;
                for (v, u) in column.iter_mut().zip(updates) {
                    *v = u[j];
                }
                *slot = per_column(&mut column);
            }
        });
    out
}

fn median(column: &mut [f32]) -> f32 {
    let n = column.len();
    let mid = n / 2;
    let (_, upper, _) = column.select_nth_unstable_by(mid, f32::total_cmp);
    let upper = *upper;
    if n % 2 == 1 {
        upper
    } else {
        // The largest of the lower half.
        let lower = column[..mid]
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        ((f64::from(lower) + f64::from(upper)) / 2.0) as f32
    }
}

fn trimmed_mean(column: &mut [f32], cut: usize) -> f32 {
    column.sort_unstable_by(f32::total_cmp);
    let kept = &column[cut..column.len() - cut];
    (kept.iter().map(|&v| f64::from(v)).sum::<f64>() / kept.len() as f64) as f32
}

/// Krum scores: for each update, the summed squared distance to its `n - f - 2` nearest
/// other updates.
fn krum_scores(updates: &[&[f32]], byzantine: usize) -> Vec<f64> {
    let n = updates.len();
    let pairs: Vec<(usize, usize)> = (0..n)
        .flat_map(|i| (i + 1..n).map(move |j| (i, j)))
        .collect();
    let distances: Vec<f64> = pairs
        .par_iter()
        .map(|&(i, j)| {
            updates[i]
                .iter()
                .zip(updates[j])
                .map(|(&a, &b)| {
                    let d = f64::from(a) - f64::from(b);
                    d * d
                })
                .sum()
        })
        .collect();
    let mut matrix = vec![vec![0.0f64; n]; n];
    for (&(i, j), &d) in pairs.iter().zip(&distances) {
        matrix[i][j] = d;
        matrix[j][i] = d;
    }
    let neighbours = n - byzantine - 2;
    matrix
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let mut others: Vec<f64> = row
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, &d)| d)
                .collect();
            others.sort_unstable_by(f64::total_cmp);
            others[..neighbours].iter().sum()
        })
        .collect()
}

/// The indices of the `select` best Krum scores, best first (ties by index).
pub fn krum_selection(
    updates: &[&[f32]],
    byzantine: usize,
    select: usize,
) -> Result<Vec<usize>, RobustError> {
    validate(updates)?;
    RobustRule::MultiKrum { byzantine, select }.check(updates.len())?;
    let scores = krum_scores(updates, byzantine);
    let mut order: Vec<usize> = (0..updates.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
    order.truncate(select);
    Ok(order)
}

/// The rule applied to `updates` (all of one length, all finite).
pub fn aggregate(rule: RobustRule, updates: &[&[f32]]) -> Result<Vec<f32>, RobustError> {
    let d = validate(updates)?;
    rule.check(updates.len())?;
    Ok(match rule {
        RobustRule::Median => per_coordinate(updates, d, median),
        RobustRule::TrimmedMean { trim } => {
            let cut = (trim * updates.len() as f64).floor() as usize;
            per_coordinate(updates, d, |c| trimmed_mean(c, cut))
        }
        RobustRule::Krum { byzantine } => {
            let best = krum_selection(updates, byzantine, 1)?[0];
            updates[best].to_vec()
        }
        RobustRule::MultiKrum { byzantine, select } => {
            let chosen = krum_selection(updates, byzantine, select)?;
            let mut sum = vec![0.0f64; d];
            for &i in &chosen {
                for (s, &v) in sum.iter_mut().zip(updates[i]) {
                    *s += f64::from(v);
                }
            }
            sum.into_iter()
                .map(|s| (s / chosen.len() as f64) as f32)
                .collect()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn refs(v: &[Vec<f32>]) -> Vec<&[f32]> {
        v.iter().map(Vec::as_slice).collect()
    }

    /// `honest` clients near `centre`, `bad` ones far away (scaled and sign-flipped).
    fn population(honest: usize, bad: usize, d: usize, seed: u64) -> (Vec<Vec<f32>>, Vec<f32>) {
        use rand_core::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut uniform =
            |lo: f32, hi: f32| lo + (hi - lo) * (rng.next_u32() as f32 / 4_294_967_296.0);
        let centre: Vec<f32> = (0..d).map(|_| uniform(-1.0, 1.0)).collect();
        let mut all: Vec<Vec<f32>> = (0..honest)
            .map(|_| centre.iter().map(|c| c + uniform(-0.1, 0.1)).collect())
            .collect();
        // Sign-flipped and scaled, then pushed away, so that every malicious value is
        // at least 9 from every honest one.
        for k in 0..bad {
            let (scale, shift) = if k % 2 == 0 {
                (-10.0, 20.0)
            } else {
                (50.0, -60.0)
            };
            all.push(centre.iter().map(|c| c * scale + shift).collect());
        }
        (all, centre)
    }

    fn max_distance(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn every_rule_stays_with_the_honest_majority(
            honest in 7usize..20, bad_share in 0.0f64..0.3, d in 1usize..50, seed in any::<u64>()
        ) {
            let bad = ((honest as f64) * bad_share).floor() as usize;
            let (all, centre) = population(honest, bad, d, seed);
            let n = all.len();
            let rules = [
                RobustRule::Median,
                RobustRule::TrimmedMean { trim: (bad as f64 / n as f64 + 0.01).min(0.49) },
                RobustRule::Krum { byzantine: bad },
                RobustRule::MultiKrum { byzantine: bad, select: n - bad },
            ];
            for rule in rules {
                let out = aggregate(rule, &refs(&all)).unwrap();
                // Honest values are within 0.1 of the centre; a rule that let an
                // attacker in would be off by at least several units.
                prop_assert!(max_distance(&out, &centre) <= 0.1 + 1e-5, "{rule:?}");
            }
        }

        #[test]
        fn the_order_of_the_updates_does_not_matter(
            n in 5usize..12, d in 1usize..20, seed in any::<u64>(), shift in 1usize..11
        ) {
            let (all, _) = population(n, 0, d, seed);
            let mut rotated = all.clone();
            rotated.rotate_left(shift % n);
            for rule in [RobustRule::Median, RobustRule::TrimmedMean { trim: 0.2 },
                         RobustRule::Krum { byzantine: 1 }, RobustRule::MultiKrum { byzantine: 1, select: 3 }] {
                prop_assert_eq!(aggregate(rule, &refs(&all)).unwrap(),
                                aggregate(rule, &refs(&rotated)).unwrap());
            }
        }
    }

    #[test]
    fn median_and_trimmed_mean_of_small_columns() {
        let all = vec![
            vec![1.0, 10.0],
            vec![2.0, 20.0],
            vec![100.0, 30.0],
            vec![3.0, -5.0],
        ];
        assert_eq!(
            aggregate(RobustRule::Median, &refs(&all)).unwrap(),
            vec![2.5, 15.0]
        );
        assert_eq!(
            aggregate(RobustRule::TrimmedMean { trim: 0.25 }, &refs(&all)).unwrap(),
            vec![2.5, 15.0]
        );
        // Nothing trimmed: the plain mean.
        assert_eq!(
            aggregate(RobustRule::TrimmedMean { trim: 0.0 }, &refs(&all)).unwrap(),
            vec![26.5, 13.75]
        );
        let odd = vec![vec![3.0], vec![1.0], vec![2.0]];
        assert_eq!(
            aggregate(RobustRule::Median, &refs(&odd)).unwrap(),
            vec![2.0]
        );
    }

    #[test]
    fn rules_are_written_and_read_back() {
        for rule in [
            RobustRule::Median,
            RobustRule::TrimmedMean { trim: 0.2 },
            RobustRule::Krum { byzantine: 3 },
            RobustRule::MultiKrum {
                byzantine: 2,
                select: 7,
            },
        ] {
            assert_eq!(rule.to_string().parse::<RobustRule>(), Ok(rule));
        }
        for bad in [
            "mean",
            "trimmed-mean:0.5",
            "trimmed-mean:x",
            "krum",
            "krum:-1",
            "multi-krum:1",
        ] {
            assert!(bad.parse::<RobustRule>().is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        assert_eq!(aggregate(RobustRule::Median, &[]), Err(RobustError::Empty));
        let ragged = vec![vec![1.0, 2.0], vec![1.0]];
        assert!(matches!(
            aggregate(RobustRule::Median, &refs(&ragged)),
            Err(RobustError::Length { index: 1, .. })
        ));
        let nan = vec![vec![1.0], vec![f32::NAN]];
        assert_eq!(
            aggregate(RobustRule::Median, &refs(&nan)),
            Err(RobustError::NonFinite { index: 1 })
        );
        let few = vec![vec![1.0]; 4];
        assert!(matches!(
            aggregate(RobustRule::Krum { byzantine: 1 }, &refs(&few)),
            Err(RobustError::Parameters(_))
        ));
        assert!(matches!(
            aggregate(RobustRule::TrimmedMean { trim: 0.5 }, &refs(&few)),
            Err(RobustError::Parameters(_))
        ));
        let five = vec![vec![1.0]; 5];
        assert!(matches!(
            aggregate(
                RobustRule::MultiKrum {
                    byzantine: 1,
                    select: 5
                },
                &refs(&five)
            ),
            Err(RobustError::Parameters(_))
        ));
    }
}
