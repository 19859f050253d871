//! Non-IID partitioners: how a pooled data set is dealt out to simulated clients.
//!
//! Every scheme is deterministic from a seed, gives every sample to exactly one client,
//! gives every client at least one sample, and returns each client's indices sorted.
//! Requests that cannot meet these guarantees are errors, never a silently different
//! partition.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Gamma, StandardNormal};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

/// The accepted textual forms, quoted in parse errors.
const ACCEPTED: &str = "iid, dirichlet:ALPHA (ALPHA > 0), shards:K (integer K >= 1), \
                        quantity:SIGMA (SIGMA >= 0), natural";

/// How samples are distributed over clients.
///
/// Parses from and displays as `iid`, `dirichlet:ALPHA`, `shards:K`, `quantity:SIGMA` or
/// `natural` (case-insensitive, surrounding whitespace ignored); serde uses the same
/// string form.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PartitionScheme {
    /// Shuffle and deal into near-equal parts: every client sees the global distribution.
    Iid,
    /// Label skew: each class is split over clients in proportions drawn from
    /// Dirichlet(alpha). Small alpha (0.1) gives clients a few dominant labels; large
    /// alpha (100) approaches IID.
    Dirichlet {
        /// Concentration, finite and > 0.
        alpha: f64,
    },
    /// Pathological non-IID (McMahan et al. 2017): samples sorted by label are cut into
    /// `clients * per_client` shards and each client gets `per_client` random shards, so
    /// at most `per_client` distinct labels.
    Shards {
        /// Shards (and so at most labels) per client, >= 1.
        per_client: usize,
    },
    /// Quantity skew: client sizes proportional to LogNormal(0, sigma) draws, samples
    /// dealt IID. Sigma 0 gives near-equal sizes.
    Quantity {
        /// Spread of the log-sizes, finite and >= 0.
        sigma: f64,
    },
    /// The data set's own groups (devices): client i gets the i-th distinct group.
    Natural,
}

/// Why a partition could not be parsed or made.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PartitionError {
    /// A scheme string (or a directly built scheme) is not valid.
    #[error("invalid partition `{input}`: {reason}; accepted forms: {ACCEPTED}")]
    InvalidScheme {
        /// The text given (control characters escaped).
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Zero clients were requested.
    #[error("cannot partition among 0 clients; at least 1 is needed")]
    NoClients,
    /// More clients than samples, so some client would be empty.
    #[error("cannot give each of {clients} clients a sample: there are only {samples} samples")]
    TooManyClients {
        /// Clients requested.
        clients: usize,
        /// Samples available.
        samples: usize,
    },
    /// A sample's label is not below the number of classes.
    #[error("sample {index} has label {label}, outside the {num_classes} classes")]
    LabelOutOfRange {
        /// Index of the offending sample.
        index: usize,
        /// Its label.
        label: u32,
        /// The number of classes given.
        num_classes: usize,
    },
    /// The group ids do not match the labels one to one.
    #[error("{groups} group ids were given for {labels} samples")]
    GroupLengthMismatch {
        /// Number of group ids.
        groups: usize,
        /// Number of labels (samples).
        labels: usize,
    },
    /// `shards:K` with more labels per client than there are classes.
    #[error(
        "shards:{per_client} asks for {per_client} labels per client, but there are only {num_classes} classes"
    )]
    ShardsExceedClasses {
        /// K.
        per_client: usize,
        /// Number of classes.
        num_classes: usize,
    },
    /// `shards:K` with more shards than samples, so some shard would be empty.
    #[error(
        "shards:{per_client} with {clients} clients needs {clients} x {per_client} shards of at \
         least one sample, but there are only {samples} samples"
    )]
    ShardsExceedSamples {
        /// Clients requested.
        clients: usize,
        /// K.
        per_client: usize,
        /// Samples available.
        samples: usize,
    },
    /// `shards:K` with fewer shards than labels present: some shard would mix labels, and
    /// a client could then hold more than K labels.
    #[error(
        "shards:{per_client} with {clients} clients makes {} shards, too few for the {labels} \
         labels present without mixing labels in a shard; use more clients or a larger K",
        .clients.saturating_mul(*.per_client)
    )]
    ShardsTooFew {
        /// Clients requested.
        clients: usize,
        /// K.
        per_client: usize,
        /// Distinct labels present.
        labels: usize,
    },
    /// `natural` on a data set without groups.
    #[error(
        "the natural partition needs a data set with its own groups (devices); this one has none"
    )]
    NoGroups,
    /// `natural` with a client count different from the number of groups.
    #[error(
        "the natural partition has {groups} groups (devices), but {clients} clients were requested; request {groups} clients"
    )]
    GroupCountMismatch {
        /// Distinct groups in the data.
        groups: usize,
        /// Clients requested.
        clients: usize,
    },
}

impl PartitionScheme {
    /// Checks the parameter's range; `Err` holds the reason.
    fn check(&self) -> Result<(), String> {
        match *self {
            PartitionScheme::Dirichlet { alpha } if !alpha.is_finite() => {
                Err("alpha must be finite".to_owned())
            }
            PartitionScheme::Dirichlet { alpha } if alpha <= 0.0 => {
                Err("alpha must be > 0".to_owned())
            }
            PartitionScheme::Shards { per_client: 0 } => Err("K must be >= 1".to_owned()),
            PartitionScheme::Quantity { sigma } if !sigma.is_finite() => {
                Err("sigma must be finite".to_owned())
            }
            PartitionScheme::Quantity { sigma } if sigma < 0.0 => {
                Err("sigma must be >= 0".to_owned())
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for PartitionScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // f64's Display is the shortest text that parses back to the same value.
        match self {
            PartitionScheme::Iid => f.write_str("iid"),
            PartitionScheme::Dirichlet { alpha } => write!(f, "dirichlet:{alpha}"),
            PartitionScheme::Shards { per_client } => write!(f, "shards:{per_client}"),
            PartitionScheme::Quantity { sigma } => write!(f, "quantity:{sigma}"),
            PartitionScheme::Natural => f.write_str("natural"),
        }
    }
}

impl FromStr for PartitionScheme {
    type Err = PartitionError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let trimmed = s.trim();
        let err = |reason: String| PartitionError::InvalidScheme {
            input: trimmed.escape_debug().to_string(),
            reason,
        };
        let lower = trimmed.to_ascii_lowercase();
        let (name, param) = match lower.split_once(':') {
            Some((name, param)) => (name.trim(), Some(param.trim())),
            None => (lower.as_str(), None),
        };
        let number = |p: &str, what: &str| {
            p.parse::<f64>().map_err(|_| {
                err(format!(
                    "{what} must be a number, not `{}`",
                    p.escape_debug()
                ))
            })
        };
        let scheme = match (name, param) {
            ("iid", None) => PartitionScheme::Iid,
            ("natural", None) => PartitionScheme::Natural,
            ("iid" | "natural", Some(_)) => {
                return Err(err(format!("`{name}` takes no parameter")));
            }
            ("dirichlet", Some(p)) => PartitionScheme::Dirichlet {
                alpha: number(p, "alpha")?,
            },
            ("quantity", Some(p)) => PartitionScheme::Quantity {
                sigma: number(p, "sigma")?,
            },
            ("shards", Some(p)) => PartitionScheme::Shards {
                per_client: p.parse().map_err(|_| {
                    err(format!(
                        "K must be an integer >= 1, not `{}`",
                        p.escape_debug()
                    ))
                })?,
            },
            ("dirichlet" | "quantity" | "shards", None) => {
                return Err(err(format!("`{name}` needs a parameter after `:`")));
            }
            _ => return Err(err("unknown scheme".to_owned())),
        };
        scheme.check().map_err(err)?;
        Ok(scheme)
    }
}

impl Serialize for PartitionScheme {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PartitionScheme {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Deals sample indices out to `clients` clients according to `scheme`.
///
/// `labels[i]` is sample i's class, below `num_classes`; `groups` (one id per sample)
/// is needed only by [`PartitionScheme::Natural`]. Returns one sorted index list per
/// client; together they hold every index in `0..labels.len()` exactly once, none is
/// empty, and the result depends only on the inputs and `seed`.
///
/// Dirichlet: a class whose draws all underflow to zero (tiny alpha) goes wholly to one
/// random client, the alpha -> 0 limit; clients left empty are then given one random
/// sample each from the currently largest client (lowest index on ties), so the skew
/// that alpha asks for is kept. Shards: shards never straddle two labels (each label's
/// samples are cut into a number of shards proportional to its count), which is what
/// guarantees at most K labels per client.
///
/// # Errors
/// [`PartitionError`] for an invalid scheme parameter, 0 clients, more clients than
/// samples, a label `>= num_classes`, `groups` of the wrong length; for shards, K above
/// `num_classes`, more shards than samples, or fewer shards than labels present; for
/// natural, no groups or a group count different from `clients`.
pub fn partition(
    labels: &[u32],
    num_classes: usize,
    groups: Option<&[u32]>,
    clients: usize,
    scheme: &PartitionScheme,
    seed: u64,
) -> Result<Vec<Vec<usize>>, PartitionError> {
    scheme
        .check()
        .map_err(|reason| PartitionError::InvalidScheme {
            input: scheme.to_string(),
            reason,
        })?;
    if clients == 0 {
        return Err(PartitionError::NoClients);
    }
    if let Some((index, &label)) = labels
        .iter()
        .enumerate()
        .find(|&(_, &l)| l as usize >= num_classes)
    {
        return Err(PartitionError::LabelOutOfRange {
            index,
            label,
            num_classes,
        });
    }
    if let Some(g) = groups
        && g.len() != labels.len()
    {
        return Err(PartitionError::GroupLengthMismatch {
            groups: g.len(),
            labels: labels.len(),
        });
    }
    let n = labels.len();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut parts = match *scheme {
        // Before the sample-count check so that the error names the group count.
        PartitionScheme::Natural => return natural(groups, clients),
        _ if clients > n => {
            return Err(PartitionError::TooManyClients {
                clients,
                samples: n,
            });
        }
        PartitionScheme::Iid => {
            let idx = shuffled(n, &mut rng);
            cut(&idx, &equal_sizes(n, clients))
        }
        PartitionScheme::Dirichlet { alpha } => dirichlet(labels, clients, alpha, &mut rng),
        PartitionScheme::Shards { per_client } => {
            shards(labels, num_classes, clients, per_client, &mut rng)?
        }
        PartitionScheme::Quantity { sigma } => {
            let sizes = quantity_sizes(n, clients, sigma, &mut rng);
            cut(&shuffled(n, &mut rng), &sizes)
        }
    };
    for part in &mut parts {
        part.sort_unstable();
    }
    Ok(parts)
}

fn natural(groups: Option<&[u32]>, clients: usize) -> Result<Vec<Vec<usize>>, PartitionError> {
    let groups = groups.ok_or(PartitionError::NoGroups)?;
    let mut by_group: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, &g) in groups.iter().enumerate() {
        by_group.entry(g).or_default().push(i);
    }
    if by_group.len() != clients {
        return Err(PartitionError::GroupCountMismatch {
            groups: by_group.len(),
            clients,
        });
    }
    Ok(by_group.into_values().collect())
}

fn shuffled(n: usize, rng: &mut ChaCha8Rng) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..n).collect();
    idx.shuffle(rng);
    idx
}

/// Sizes of `parts` near-equal parts of `n`: the first `n % parts` get one more.
fn equal_sizes(n: usize, parts: usize) -> Vec<usize> {
    let (base, extra) = (n / parts, n % parts);
    (0..parts).map(|i| base + usize::from(i < extra)).collect()
}

/// Consecutive pieces of `idx` with the given sizes (which sum to `idx.len()`).
fn cut(idx: &[usize], sizes: &[usize]) -> Vec<Vec<usize>> {
    let mut rest = idx;
    sizes
        .iter()
        .map(|&s| {
            let (head, tail) = rest.split_at(s.min(rest.len()));
            rest = tail;
            head.to_vec()
        })
        .collect()
}

/// Sample indices of each class, for the classes present, in class order.
fn by_class(labels: &[u32]) -> Vec<Vec<usize>> {
    let mut map: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, &l) in labels.iter().enumerate() {
        map.entry(l).or_default().push(i);
    }
    map.into_values().collect()
}

fn dirichlet(labels: &[u32], clients: usize, alpha: f64, rng: &mut ChaCha8Rng) -> Vec<Vec<usize>> {
    let mut parts = vec![Vec::new(); clients];
    // check() guarantees alpha is finite and > 0, all Gamma::new needs; the fallback
    // only keeps this function total.
    let gamma = Gamma::new(alpha, 1.0).ok();
    for mut members in by_class(labels) {
        members.shuffle(rng);
        let mut p: Vec<f64> = match gamma {
            Some(g) => (0..clients).map(|_| rng.sample(g)).collect(),
            None => vec![1.0; clients],
        };
        let max = p.iter().copied().fold(0.0f64, f64::max);
        if max.is_infinite() {
            // Only for astronomically large alpha, whose limit is the uniform split.
            p.fill(1.0);
        } else if max > 0.0 {
            // Scaling by the max keeps the sum finite whatever the draws' magnitude.
            p.iter_mut().for_each(|v| *v /= max);
        } else {
            // Every draw underflowed (tiny alpha): the limit is one client taking all.
            p.fill(0.0);
            p[rng.random_range(0..clients)] = 1.0;
        }
        let total: f64 = p.iter().sum();
        let m = members.len();
        let (mut cum, mut start) = (0.0, 0);
        for (i, &pi) in p.iter().enumerate() {
            cum += pi;
            let end = if i + 1 == clients {
                m
            } else {
                ((cum / total * m as f64).round() as usize).clamp(start, m)
            };
            parts[i].extend_from_slice(&members[start..end]);
            start = end;
        }
    }
    repair_empty(&mut parts, rng);
    parts
}

/// Gives every empty client one random sample of the currently largest client.
///
/// Always succeeds when there are at least as many samples as clients: while a client
/// is empty, the samples sit in fewer clients than there are samples, so the largest
/// holds at least two and stays non-empty after giving one.
fn repair_empty(parts: &mut [Vec<usize>], rng: &mut ChaCha8Rng) {
    for i in 0..parts.len() {
        if !parts[i].is_empty() {
            continue;
        }
        let mut donor = 0;
        for (j, p) in parts.iter().enumerate() {
            if p.len() > parts[donor].len() {
                donor = j;
            }
        }
        if parts[donor].len() < 2 {
            return;
        }
        let pick = rng.random_range(0..parts[donor].len());
        let moved = parts[donor].swap_remove(pick);
        parts[i].push(moved);
    }
}

fn shards(
    labels: &[u32],
    num_classes: usize,
    clients: usize,
    per_client: usize,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<Vec<usize>>, PartitionError> {
    let n = labels.len();
    if per_client > num_classes {
        return Err(PartitionError::ShardsExceedClasses {
            per_client,
            num_classes,
        });
    }
    let total = match clients.checked_mul(per_client) {
        Some(t) if t <= n => t,
        _ => {
            return Err(PartitionError::ShardsExceedSamples {
                clients,
                per_client,
                samples: n,
            });
        }
    };
    let classes = by_class(labels);
    if total < classes.len() {
        return Err(PartitionError::ShardsTooFew {
            clients,
            per_client,
            labels: classes.len(),
        });
    }

    let counts: Vec<usize> = classes.iter().map(Vec::len).collect();
    let per_class = shard_counts(&counts, total);
    let mut all_shards: Vec<Vec<usize>> = Vec::with_capacity(total);
    for (mut members, s) in classes.into_iter().zip(per_class) {
        // Shuffled so which samples of a label share a shard is random too.
        members.shuffle(rng);
        all_shards.extend(cut(&members, &equal_sizes(members.len(), s)));
    }
    let order = shuffled(all_shards.len(), rng);
    Ok(order
        .chunks(per_client)
        .map(|chunk| {
            chunk
                .iter()
                .flat_map(|&s| all_shards[s].iter().copied())
                .collect()
        })
        .collect())
}

/// Shards per class: proportional to class size, each in `1..=count`, summing to `total`.
///
/// Needs `counts.len() <= total <= counts.iter().sum()`, which the caller has checked.
fn shard_counts(counts: &[usize], total: usize) -> Vec<usize> {
    let n: usize = counts.iter().sum();
    let target: Vec<f64> = counts
        .iter()
        .map(|&c| total as f64 * c as f64 / n as f64)
        .collect();
    let mut s: Vec<usize> = counts
        .iter()
        .zip(&target)
        .map(|(&c, &t)| (t.floor() as usize).clamp(1, c))
        .collect();
    let mut sum: usize = s.iter().sum();
    // Each step moves the sum by one toward `total` at the class furthest from its
    // target; the loop ends because a class below its cap (or above 1) always exists
    // while the sum is off.
    while sum != total {
        let grow = sum < total;
        let pick = (0..s.len())
            .filter(|&c| if grow { s[c] < counts[c] } else { s[c] > 1 })
            .max_by(|&a, &b| {
                let gap = |c: usize| {
                    if grow {
                        target[c] - s[c] as f64
                    } else {
                        s[c] as f64 - target[c]
                    }
                };
                // Reverse index order on ties so max_by picks the lowest index.
                gap(a).total_cmp(&gap(b)).then(b.cmp(&a))
            });
        let Some(c) = pick else { break };
        if grow {
            s[c] += 1;
            sum += 1;
        } else {
            s[c] -= 1;
            sum -= 1;
        }
    }
    s
}

/// Client sizes for quantity skew: at least 1 each, summing to `n`, the rest shared in
/// proportion to LogNormal(0, sigma) weights by largest remainder.
fn quantity_sizes(n: usize, clients: usize, sigma: f64, rng: &mut ChaCha8Rng) -> Vec<usize> {
    let z: Vec<f64> = (0..clients).map(|_| rng.sample(StandardNormal)).collect();
    let z_max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // exp(sigma * z) / exp(sigma * z_max): the same proportions as LogNormal(0, sigma)
    // draws, without overflow for large sigma.
    let w: Vec<f64> = z.iter().map(|&zi| (sigma * (zi - z_max)).exp()).collect();
    let w_sum: f64 = w.iter().sum();
    let extra = n - clients;
    let target: Vec<f64> = w.iter().map(|&wi| extra as f64 * wi / w_sum).collect();
    let mut sizes: Vec<usize> = target.iter().map(|&t| t.floor() as usize).collect();
    let mut given: usize = sizes.iter().sum();
    // Rounding may overshoot by a unit or so; take it back from the largest shares.
    while given > extra {
        if let Some(c) = (0..clients)
            .filter(|&c| sizes[c] > 0)
            .max_by_key(|&c| (sizes[c], clients - c))
        {
            sizes[c] -= 1;
            given -= 1;
        } else {
            break;
        }
    }
    let mut order: Vec<usize> = (0..clients).collect();
    // Largest fractional remainder first, lowest index on ties.
    order.sort_by(|&a, &b| {
        let frac = |c: usize| target[c] - sizes[c] as f64;
        frac(b).total_cmp(&frac(a)).then(a.cmp(&b))
    });
    for &c in order.iter().cycle().take(extra - given) {
        sizes[c] += 1;
    }
    sizes.iter().map(|&s| s + 1).collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde::de::IntoDeserializer;
    use serde::de::value::{Error as DeError, StrDeserializer};

    use super::*;

    fn check_valid(parts: &[Vec<usize>], n: usize, clients: usize) {
        assert_eq!(parts.len(), clients);
        let mut seen = vec![false; n];
        for part in parts {
            assert!(!part.is_empty(), "every client gets a sample");
            assert!(
                part.windows(2).all(|w| w[0] < w[1]),
                "sorted, no duplicates"
            );
            for &i in part {
                assert!(i < n);
                assert!(!seen[i], "index {i} given twice");
                seen[i] = true;
            }
        }
        assert!(seen.iter().all(|&s| s), "every sample assigned");
    }

    fn digit_labels() -> Vec<u32> {
        crate::data::digits().labels
    }

    /// Mean total-variation distance between each client's label distribution and the
    /// global one: 0 for perfectly IID, near 1 for one label per client.
    fn mean_tv(labels: &[u32], classes: usize, parts: &[Vec<usize>]) -> f64 {
        let dist = |idx: &mut dyn Iterator<Item = u32>| {
            let mut h = vec![0.0; classes];
            let mut n = 0.0;
            for l in idx {
                h[l as usize] += 1.0;
                n += 1.0;
            }
            h.iter().map(|c| c / n).collect::<Vec<f64>>()
        };
        let global = dist(&mut labels.iter().copied());
        parts
            .iter()
            .map(|p| {
                let local = dist(&mut p.iter().map(|&i| labels[i]));
                0.5 * local
                    .iter()
                    .zip(&global)
                    .map(|(a, b)| (a - b).abs())
                    .sum::<f64>()
            })
            .sum::<f64>()
            / parts.len() as f64
    }

    #[test]
    fn parses_every_accepted_form_case_insensitively_and_trimmed() {
        let cases = [
            ("iid", PartitionScheme::Iid),
            ("  IID ", PartitionScheme::Iid),
            ("Natural", PartitionScheme::Natural),
            ("dirichlet:0.5", PartitionScheme::Dirichlet { alpha: 0.5 }),
            (
                "DIRICHLET: 1e-3 ",
                PartitionScheme::Dirichlet { alpha: 1e-3 },
            ),
            ("shards:2", PartitionScheme::Shards { per_client: 2 }),
            ("quantity:0", PartitionScheme::Quantity { sigma: 0.0 }),
            ("Quantity:1.5", PartitionScheme::Quantity { sigma: 1.5 }),
        ];
        for (text, want) in cases {
            assert_eq!(text.parse::<PartitionScheme>().unwrap(), want, "{text:?}");
        }
    }

    #[test]
    fn invalid_scheme_messages_name_the_value_and_list_accepted_forms() {
        let err = "dirichlet:0".parse::<PartitionScheme>().unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("invalid partition `dirichlet:0`: alpha must be > 0"),
            "{msg}"
        );
        assert!(msg.contains("shards:K") && msg.contains("natural"), "{msg}");
        for bad in [
            "",
            "iid:2",
            "dirichlet",
            "dirichlet:-1",
            "dirichlet:nan",
            "dirichlet:inf",
            "dirichlet:abc",
            "shards:0",
            "shards:1.5",
            "shards:-1",
            "quantity:-0.1",
            "quantity:inf",
            "random",
            "natural:x",
            "dirichlet:0.5\n1",
        ] {
            let err = bad.parse::<PartitionScheme>().unwrap_err();
            assert!(
                matches!(err, PartitionError::InvalidScheme { .. }),
                "{bad:?}"
            );
            assert!(!err.to_string().contains('\n'), "{err}");
        }
    }

    #[test]
    fn display_round_trips_through_from_str_and_serde() {
        for scheme in [
            PartitionScheme::Iid,
            PartitionScheme::Natural,
            PartitionScheme::Dirichlet { alpha: 0.1 },
            PartitionScheme::Dirichlet { alpha: 1e-300 },
            PartitionScheme::Dirichlet { alpha: 123456.789 },
            PartitionScheme::Shards { per_client: 3 },
            PartitionScheme::Quantity { sigma: 0.0 },
            PartitionScheme::Quantity { sigma: 2.25 },
        ] {
            let text = scheme.to_string();
            assert_eq!(text.parse::<PartitionScheme>().unwrap(), scheme, "{text}");
            let de: StrDeserializer<'_, DeError> = text.as_str().into_deserializer();
            assert_eq!(PartitionScheme::deserialize(de).unwrap(), scheme);
        }
        let de: StrDeserializer<'_, DeError> = "shards:0".into_deserializer();
        assert!(PartitionScheme::deserialize(de).is_err());
    }

    #[test]
    fn iid_gives_near_equal_sizes_and_global_label_mix() {
        let labels = digit_labels();
        let parts = partition(&labels, 10, None, 7, &PartitionScheme::Iid, 1).unwrap();
        check_valid(&parts, labels.len(), 7);
        let sizes: Vec<usize> = parts.iter().map(Vec::len).collect();
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        assert!(mean_tv(&labels, 10, &parts) < 0.1);
    }

    #[test]
    fn small_dirichlet_alpha_skews_labels_and_large_alpha_is_near_iid() {
        let labels = digit_labels();
        let tv = |alpha: f64| {
            let parts = partition(
                &labels,
                10,
                None,
                10,
                &PartitionScheme::Dirichlet { alpha },
                3,
            )
            .unwrap();
            check_valid(&parts, labels.len(), 10);
            mean_tv(&labels, 10, &parts)
        };
        let (skewed, mixed) = (tv(0.1), tv(100.0));
        assert!(skewed > 0.4, "alpha 0.1: mean TV {skewed}");
        assert!(mixed < 0.1, "alpha 100: mean TV {mixed}");
    }

    #[test]
    fn tiny_dirichlet_alpha_still_fills_every_client() {
        let labels: Vec<u32> = (0..50).map(|i| i % 2).collect();
        for alpha in [1e-300, 1e-9, 1e-3] {
            let parts = partition(
                &labels,
                2,
                None,
                20,
                &PartitionScheme::Dirichlet { alpha },
                4,
            )
            .unwrap();
            check_valid(&parts, 50, 20);
        }
        let huge = PartitionScheme::Dirichlet { alpha: 1e308 };
        check_valid(&partition(&labels, 2, None, 5, &huge, 4).unwrap(), 50, 5);
    }

    #[test]
    fn shards_give_each_client_at_most_k_labels() {
        let labels = digit_labels();
        for (clients, k) in [(10, 1), (20, 2), (100, 2), (7, 3), (5, 10)] {
            let scheme = PartitionScheme::Shards { per_client: k };
            let parts = partition(&labels, 10, None, clients, &scheme, 9).unwrap();
            check_valid(&parts, labels.len(), clients);
            for part in &parts {
                let mut ls: Vec<u32> = part.iter().map(|&i| labels[i]).collect();
                ls.sort_unstable();
                ls.dedup();
                assert!(ls.len() <= k, "{clients} clients, k={k}: {ls:?}");
            }
        }
    }

    #[test]
    fn shards_with_one_label_per_client_are_pure() {
        let labels = digit_labels();
        let parts = partition(
            &labels,
            10,
            None,
            10,
            &PartitionScheme::Shards { per_client: 1 },
            0,
        )
        .unwrap();
        for part in &parts {
            assert!(part.iter().all(|&i| labels[i] == labels[part[0]]));
        }
    }

    #[test]
    fn shard_counts_are_proportional_capped_and_exact() {
        assert_eq!(shard_counts(&[100, 100], 4), vec![2, 2]);
        assert_eq!(shard_counts(&[1, 99], 10), vec![1, 9]);
        assert_eq!(shard_counts(&[1, 1, 8], 10), vec![1, 1, 8]);
        assert_eq!(shard_counts(&[5, 5, 5], 3), vec![1, 1, 1]);
    }

    #[test]
    fn quantity_sigma_zero_gives_near_equal_sizes_and_large_sigma_skews() {
        let labels: Vec<u32> = (0..1003).map(|i| i % 4).collect();
        let parts = partition(
            &labels,
            4,
            None,
            10,
            &PartitionScheme::Quantity { sigma: 0.0 },
            2,
        )
        .unwrap();
        check_valid(&parts, 1003, 10);
        let sizes: Vec<usize> = parts.iter().map(Vec::len).collect();
        assert!(
            sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
            "{sizes:?}"
        );

        let parts = partition(
            &labels,
            4,
            None,
            10,
            &PartitionScheme::Quantity { sigma: 2.0 },
            2,
        )
        .unwrap();
        check_valid(&parts, 1003, 10);
        let sizes: Vec<usize> = parts.iter().map(Vec::len).collect();
        assert!(
            sizes.iter().max().unwrap() > &(3 * sizes.iter().min().unwrap()),
            "{sizes:?}"
        );

        let extreme = PartitionScheme::Quantity { sigma: 1e6 };
        check_valid(
            &partition(&labels, 4, None, 10, &extreme, 2).unwrap(),
            1003,
            10,
        );
    }

    #[test]
    fn natural_uses_sorted_distinct_groups() {
        let labels = vec![0, 1, 0, 1, 0, 1];
        let groups = vec![7, 3, 7, 9, 3, 3];
        let parts = partition(&labels, 2, Some(&groups), 3, &PartitionScheme::Natural, 0).unwrap();
        assert_eq!(parts, vec![vec![1, 4, 5], vec![0, 2], vec![3]]);
    }

    #[test]
    fn natural_errors_say_how_many_groups_there_are() {
        let labels = vec![0, 1, 0];
        let err = partition(&labels, 2, None, 2, &PartitionScheme::Natural, 0).unwrap_err();
        assert_eq!(err, PartitionError::NoGroups);
        let groups = vec![0, 1, 1];
        let err =
            partition(&labels, 2, Some(&groups), 3, &PartitionScheme::Natural, 0).unwrap_err();
        assert_eq!(
            err,
            PartitionError::GroupCountMismatch {
                groups: 2,
                clients: 3
            }
        );
        assert!(err.to_string().contains("2 groups"), "{err}");
        let err = partition(
            &labels,
            2,
            Some(&[0u32, 1][..]),
            2,
            &PartitionScheme::Natural,
            0,
        )
        .unwrap_err();
        assert!(matches!(err, PartitionError::GroupLengthMismatch { .. }));
    }

    #[test]
    fn impossible_requests_are_errors() {
        let labels: Vec<u32> = (0..10).map(|i| i % 5).collect();
        let p = |clients, scheme: PartitionScheme| partition(&labels, 5, None, clients, &scheme, 0);
        assert_eq!(
            p(0, PartitionScheme::Iid).unwrap_err(),
            PartitionError::NoClients
        );
        assert!(matches!(
            p(11, PartitionScheme::Iid).unwrap_err(),
            PartitionError::TooManyClients {
                clients: 11,
                samples: 10
            }
        ));
        assert!(matches!(
            p(2, PartitionScheme::Shards { per_client: 6 }).unwrap_err(),
            PartitionError::ShardsExceedClasses { .. }
        ));
        assert!(matches!(
            p(4, PartitionScheme::Shards { per_client: 3 }).unwrap_err(),
            PartitionError::ShardsExceedSamples { .. }
        ));
        assert!(matches!(
            p(2, PartitionScheme::Shards { per_client: 2 }).unwrap_err(),
            PartitionError::ShardsTooFew { labels: 5, .. }
        ));
        assert!(matches!(
            p(usize::MAX, PartitionScheme::Shards { per_client: 2 }).unwrap_err(),
            PartitionError::TooManyClients { .. }
        ));
        assert!(matches!(
            p(2, PartitionScheme::Dirichlet { alpha: -1.0 }).unwrap_err(),
            PartitionError::InvalidScheme { .. }
        ));
        assert!(matches!(
            p(2, PartitionScheme::Quantity { sigma: f64::NAN }).unwrap_err(),
            PartitionError::InvalidScheme { .. }
        ));
        assert!(matches!(
            partition(&labels, 4, None, 2, &PartitionScheme::Iid, 0).unwrap_err(),
            PartitionError::LabelOutOfRange {
                index: 4,
                label: 4,
                num_classes: 4
            }
        ));
        assert!(matches!(
            partition(&[], 0, None, 1, &PartitionScheme::Iid, 0).unwrap_err(),
            PartitionError::TooManyClients { .. }
        ));
    }

    #[test]
    fn different_seeds_give_different_partitions() {
        let labels = digit_labels();
        for scheme in [
            PartitionScheme::Iid,
            PartitionScheme::Dirichlet { alpha: 0.5 },
            PartitionScheme::Shards { per_client: 2 },
            PartitionScheme::Quantity { sigma: 1.0 },
        ] {
            let a = partition(&labels, 10, None, 10, &scheme, 1).unwrap();
            let b = partition(&labels, 10, None, 10, &scheme, 1).unwrap();
            let c = partition(&labels, 10, None, 10, &scheme, 2).unwrap();
            assert_eq!(a, b, "{scheme}");
            assert_ne!(a, c, "{scheme}");
        }
    }

    fn scheme_strategy() -> impl Strategy<Value = PartitionScheme> {
        prop_oneof![
            Just(PartitionScheme::Iid),
            (0.001f64..1000.0).prop_map(|alpha| PartitionScheme::Dirichlet { alpha }),
            (1usize..5).prop_map(|per_client| PartitionScheme::Shards { per_client }),
            (0.0f64..4.0).prop_map(|sigma| PartitionScheme::Quantity { sigma }),
        ]
    }

    fn problem_strategy() -> impl Strategy<Value = (usize, Vec<u32>, usize)> {
        (1usize..8).prop_flat_map(|classes| {
            prop::collection::vec(0..classes as u32, 1..120).prop_flat_map(move |labels| {
                let n = labels.len();
                (Just(classes), Just(labels), 1..=n)
            })
        })
    }

    proptest! {
        #[test]
        fn prop_every_sample_goes_to_exactly_one_nonempty_client(
            (classes, labels, clients) in problem_strategy(),
            scheme in scheme_strategy(),
            seed in any::<u64>(),
        ) {
            match partition(&labels, classes, None, clients, &scheme, seed) {
                Ok(parts) => {
                    check_valid(&parts, labels.len(), clients);
                    if let PartitionScheme::Shards { per_client } = scheme {
                        for part in &parts {
                            let mut ls: Vec<u32> = part.iter().map(|&i| labels[i]).collect();
                            ls.sort_unstable();
                            ls.dedup();
                            prop_assert!(ls.len() <= per_client);
                        }
                    }
                }
                Err(e) => {
                    // Only shards has requests that a valid client count can still fail.
                    prop_assert!(matches!(scheme, PartitionScheme::Shards { .. }), "{}", e);
                    prop_assert!(matches!(
                        e,
                        PartitionError::ShardsExceedClasses { .. }
                            | PartitionError::ShardsExceedSamples { .. }
                            | PartitionError::ShardsTooFew { .. }
                    ), "{}", e);
                }
            }
        }

        #[test]
        fn prop_same_seed_same_partition(
            (classes, labels, clients) in problem_strategy(),
            scheme in scheme_strategy(),
            seed in any::<u64>(),
        ) {
            let a = partition(&labels, classes, None, clients, &scheme, seed);
            let b = partition(&labels, classes, None, clients, &scheme, seed);
            prop_assert_eq!(a, b);
        }

        #[test]
        fn prop_natural_partition_matches_groups(
            groups in prop::collection::vec(0u32..6, 1..80),
        ) {
            let labels = vec![0u32; groups.len()];
            let mut distinct = groups.clone();
            distinct.sort_unstable();
            distinct.dedup();
            let parts = partition(&labels, 1, Some(&groups), distinct.len(), &PartitionScheme::Natural, 0).unwrap();
            check_valid(&parts, labels.len(), distinct.len());
            for (part, g) in parts.iter().zip(&distinct) {
                prop_assert!(part.iter().all(|&i| groups[i] == *g));
            }
        }

        #[test]
        fn prop_display_parse_round_trip(scheme in scheme_strategy()) {
            prop_assert_eq!(scheme.to_string().parse::<PartitionScheme>().unwrap(), scheme);
        }
    }
}
