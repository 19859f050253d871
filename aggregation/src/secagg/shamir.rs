//! Shamir secret sharing of 32-byte secrets over the prime field GF(2^61 - 1).
//!
//! A secret (a self-mask seed or an X25519 private key) is cut into five limbs of at most
//! 56 bits, and each limb is shared with its own random polynomial of degree `t - 1`. Any
//! `t` shares rebuild every limb; fewer reveal nothing about it (each limb is shared
//! perfectly: for any `t - 1` shares, every limb value is equally likely).
//!
//! Why a prime field and not GF(256) byte-wise sharing: a full neighbour graph gives a
//! client hundreds of shareholders, and GF(256) cannot name more than 255 of them. The
//! Mersenne prime 2^61 - 1 keeps every product in a `u128` with a cheap reduction, and it
//! has room for 2^61 - 2 shareholders.

use std::collections::BTreeSet;

/// The field modulus, the Mersenne prime 2^61 - 1.
pub const MODULUS: u64 = (1 << 61) - 1;

/// Bytes of a shared secret.
pub const SECRET_BYTES: usize = 32;

/// Limbs per secret: 4 limbs of 7 bytes and one of 4 bytes.
pub const LIMBS: usize = 5;

/// Bytes of one share on the wire: the holder (`u32`) and the limbs (`u64` each), all
/// little-endian.
pub const SHARE_BYTES: usize = 4 + 8 * LIMBS;

/// Why shares could not be made or combined.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShamirError {
    /// The threshold is zero or larger than the number of holders.
    #[error("threshold {threshold} needs between 1 and {holders} holders")]
    BadThreshold {
        /// The threshold asked for.
        threshold: usize,
        /// The holders available.
        holders: usize,
    },
    /// A holder is 0 (the point where the secret sits) or appears twice.
    #[error("share holders must be distinct and non-zero, got {0}")]
    BadHolder(u32),
    /// Fewer shares than the threshold.
    #[error("{found} shares, {needed} needed")]
    TooFewShares {
        /// Shares given.
        found: usize,
        /// The threshold.
        needed: usize,
    },
    /// A share's bytes are not a share: wrong length or a limb outside the field.
    #[error("malformed share: {0}")]
    Malformed(&'static str),
    /// The shares combine to a value that is not a secret's encoding, so some share
    /// is wrong.
    #[error("the shares do not combine to a valid secret")]
    Inconsistent,
}

/// One holder's share of one secret. Wiped when dropped: `t` of them are the secret.
#[derive(Clone, PartialEq, Eq, zeroize::Zeroize, zeroize::ZeroizeOnDrop)]
pub struct Share {
    /// The holder's non-zero point, its index in the round.
    pub holder: u32,
    limbs: [u64; LIMBS],
}

impl std::fmt::Debug for Share {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // t shares are the secret; keep them out of logs.
        f.debug_struct("Share")
            .field("holder", &self.holder)
            .finish_non_exhaustive()
    }
}

impl Share {
    /// The share as [`SHARE_BYTES`] little-endian bytes.
    pub fn to_bytes(&self) -> [u8; SHARE_BYTES] {
        let mut out = [0u8; SHARE_BYTES];
        out[..4].copy_from_slice(&self.holder.to_le_bytes());
        for (i, limb) in self.limbs.iter().enumerate() {
            out[4 + 8 * i..12 + 8 * i].copy_from_slice(&limb.to_le_bytes());
        }
        out
    }

    /// Parses [`to_bytes`](Self::to_bytes)'s form, refusing a wrong length, holder 0 or a
    /// limb outside the field.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ShamirError> {
        if bytes.len() != SHARE_BYTES {
            return Err(ShamirError::Malformed("wrong length"));
        }
        let holder = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
        if holder == 0 {
            return Err(ShamirError::BadHolder(0));
        }
        let mut limbs = [0u64; LIMBS];
        for (i, limb) in limbs.iter_mut().enumerate() {
            let v = u64::from_le_bytes(bytes[4 + 8 * i..12 + 8 * i].try_into().expect("8 bytes"));
            if v >= MODULUS {
                return Err(ShamirError::Malformed("limb outside the field"));
            }
            *limb = v;
        }
        Ok(Self { holder, limbs })
    }
}

fn add(a: u64, b: u64) -> u64 {
    let s = a + b; // both < 2^61, no overflow
    if s >= MODULUS { s - MODULUS } else { s }
}

fn sub(a: u64, b: u64) -> u64 {
    if a >= b { a - b } else { a + MODULUS - b }
}

fn mul(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    // 2^61 = 1 (mod p): fold the high bits onto the low ones, twice.
    let folded = (p as u64 & MODULUS) + (p >> 61) as u64;
    let folded = (folded & MODULUS) + (folded >> 61);
    if folded >= MODULUS {
        folded - MODULUS
    } else {
        folded
    }
}

fn pow(mut base: u64, mut exp: u64) -> u64 {
    let mut acc = 1;
    while exp > 0 {
        if exp & 1 == 1 {
            acc = mul(acc, base);
        }
        base = mul(base, base);
        exp >>= 1;
    }
    acc
}

fn inv(a: u64) -> u64 {
    debug_assert!(a != 0);
    pow(a, MODULUS - 2)
}

/// A uniform field element from a cryptographic RNG (rejection of the one value of 61
/// bits outside the field, 2^61 - 1 itself).
fn random_element<R: rand_core::CryptoRng + ?Sized>(rng: &mut R) -> u64 {
    loop {
        let v = rng.next_u64() & MODULUS;
        if v != MODULUS {
            return v;
        }
    }
}

fn to_limbs(secret: &[u8; SECRET_BYTES]) -> [u64; LIMBS] {
    let mut limbs = [0u64; LIMBS];
    for (i, chunk) in secret.chunks(7).enumerate() {
        let mut buf = [0u8; 8];
        buf[..chunk.len()].copy_from_slice(chunk);
        limbs[i] = u64::from_le_bytes(buf);
    }
    limbs
}

fn from_limbs(limbs: &[u64; LIMBS]) -> Result<[u8; SECRET_BYTES], ShamirError> {
    let mut secret = [0u8; SECRET_BYTES];
    for (i, chunk) in secret.chunks_mut(7).enumerate() {
        let bytes = limbs[i].to_le_bytes();
        if bytes[chunk.len()..].iter().any(|&b| b != 0) {
            return Err(ShamirError::Inconsistent);
        }
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
    Ok(secret)
}

/// Splits `secret` among `holders` (distinct, non-zero) so that any `threshold` of them
/// rebuild it. Shares come back in the order of `holders`.
pub fn split<R: rand_core::CryptoRng + ?Sized>(
    secret: &[u8; SECRET_BYTES],
    threshold: usize,
    holders: &[u32],
    rng: &mut R,
) -> Result<Vec<Share>, ShamirError> {
    if threshold == 0 || threshold > holders.len() {
        return Err(ShamirError::BadThreshold {
            threshold,
            holders: holders.len(),
        });
    }
    let mut seen = BTreeSet::new();
    for &h in holders {
        if h == 0 || !seen.insert(h) {
            return Err(ShamirError::BadHolder(h));
        }
    }
    // coefficients[limb][power], power 0 being the secret's limb. Any of them with a
    // few shares gives the secret away, so they are wiped on every way out.
    let constant = zeroize::Zeroizing::new(to_limbs(secret));
    let coefficients: zeroize::Zeroizing<Vec<Vec<u64>>> = zeroize::Zeroizing::new(
        constant
            .iter()
            .map(|&c| {
                std::iter::once(c)
                    .chain((1..threshold).map(|_| random_element(rng)))
                    .collect()
            })
            .collect(),
    );
    Ok(holders
        .iter()
        .map(|&holder| {
            let x = u64::from(holder);
            let mut limbs = [0u64; LIMBS];
            for (limb, coeffs) in limbs.iter_mut().zip(coefficients.iter()) {
                // Horner, from the highest power down.
                *limb = coeffs.iter().rev().fold(0, |acc, &c| add(mul(acc, x), c));
            }
            Share { holder, limbs }
        })
        .collect())
}

/// The Lagrange coefficients at 0 for a set of holders: reusable for every secret shared
/// among the same holders, which is what makes the full graph's hundreds of
/// reconstructions cheap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interpolator {
    holders: Vec<u32>,
    coefficients: Vec<u64>,
}

impl Interpolator {
    /// Coefficients for exactly these holders (distinct, non-zero).
    pub fn new(holders: &[u32]) -> Result<Self, ShamirError> {
        let mut seen = BTreeSet::new();
        for &h in holders {
            if h == 0 || !seen.insert(h) {
                return Err(ShamirError::BadHolder(h));
            }
        }
        let xs: Vec<u64> = holders.iter().map(|&h| u64::from(h)).collect();
        // lambda_i = prod_{j != i} x_j / (x_j - x_i); the denominators are inverted
        // together (Montgomery's trick) so the whole set costs one inversion.
        let mut nums = Vec::with_capacity(xs.len());
        let mut dens = Vec::with_capacity(xs.len());
        for (i, &xi) in xs.iter().enumerate() {
            let mut num = 1;
            let mut den = 1;
            for (j, &xj) in xs.iter().enumerate() {
                if i != j {
                    num = mul(num, xj);
                    den = mul(den, sub(xj, xi));
                }
            }
            nums.push(num);
            dens.push(den);
        }
        let mut prefix = Vec::with_capacity(dens.len());
        let mut acc = 1;
        for &d in &dens {
            prefix.push(acc);
            acc = mul(acc, d);
        }
        let mut inv_acc = inv(acc);
        let mut coefficients = vec![0; xs.len()];
        for i in (0..dens.len()).rev() {
            coefficients[i] = mul(nums[i], mul(inv_acc, prefix[i]));
            inv_acc = mul(inv_acc, dens[i]);
        }
        Ok(Self {
            holders: holders.to_vec(),
            coefficients,
        })
    }

    /// The holders these coefficients are for.
    pub fn holders(&self) -> &[u32] {
        &self.holders
    }

    /// Rebuilds a secret from one share per holder, given in [`holders`](Self::holders)
    /// order.
    pub fn combine(&self, shares: &[&Share]) -> Result<[u8; SECRET_BYTES], ShamirError> {
        if shares.len() != self.holders.len()
            || shares
                .iter()
                .zip(&self.holders)
                .any(|(s, &h)| s.holder != h)
        {
            return Err(ShamirError::Malformed("shares do not match the holders"));
        }
        let mut limbs = zeroize::Zeroizing::new([0u64; LIMBS]);
        for (share, &lambda) in shares.iter().zip(&self.coefficients) {
            for (limb, &y) in limbs.iter_mut().zip(&share.limbs) {
                *limb = add(*limb, mul(lambda, y));
            }
        }
        from_limbs(&limbs)
    }
}

/// Rebuilds a secret from the first `threshold` of `shares` (by holder), refusing fewer
/// shares or repeated holders.
pub fn combine(shares: &[Share], threshold: usize) -> Result<[u8; SECRET_BYTES], ShamirError> {
    if threshold == 0 {
        return Err(ShamirError::BadThreshold {
            threshold,
            holders: shares.len(),
        });
    }
    if shares.len() < threshold {
        return Err(ShamirError::TooFewShares {
            found: shares.len(),
            needed: threshold,
        });
    }
    let mut sorted: Vec<&Share> = shares.iter().collect();
    sorted.sort_by_key(|s| s.holder);
    if let Some(w) = sorted.windows(2).find(|w| w[0].holder == w[1].holder) {
        return Err(ShamirError::BadHolder(w[0].holder));
    }
    sorted.truncate(threshold);
    let holders: Vec<u32> = sorted.iter().map(|s| s.holder).collect();
    Interpolator::new(&holders)?.combine(&sorted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    fn rng(seed: u64) -> ChaCha20Rng {
        ChaCha20Rng::seed_from_u64(seed)
    }

    #[test]
    fn field_arithmetic_matches_u128_reference() {
        let p = u128::from(MODULUS);
        for (a, b) in [
            (0, 0),
            (1, MODULUS - 1),
            (MODULUS - 1, MODULUS - 1),
            (123_456_789_012, 987_654_321_098),
            ((1 << 60) + 5, (1 << 60) + 7),
        ] {
            assert_eq!(u128::from(mul(a, b)), u128::from(a) * u128::from(b) % p);
            assert_eq!(u128::from(add(a, b)), (u128::from(a) + u128::from(b)) % p);
            assert_eq!(
                u128::from(sub(a, b)),
                (u128::from(a) + p - u128::from(b)) % p
            );
        }
        assert_eq!(mul(inv(12345), 12345), 1);
    }

    proptest! {
        #[test]
        fn any_threshold_subset_rebuilds_the_secret(
            secret in any::<[u8; 32]>(),
            holders in 1usize..40,
            t_frac in 0.0f64..1.0,
            seed in any::<u64>(),
            pick in any::<u64>(),
        ) {
            let t = 1 + ((holders - 1) as f64 * t_frac) as usize;
            // Holder indices need not be 1..=n: a neighbourhood is any set of indices.
            let ids: Vec<u32> = (0..holders as u32).map(|i| 3 * i + 1 + (pick % 5) as u32).collect();
            let shares = split(&secret, t, &ids, &mut rng(seed)).unwrap();
            let mut subset = shares.clone();
            // A pseudo-random subset of t shares.
            let mut state = pick;
            for i in (1..subset.len()).rev() {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                subset.swap(i, (state >> 33) as usize % (i + 1));
            }
            subset.truncate(t);
            prop_assert_eq!(combine(&subset, t).unwrap(), secret);
            for s in &shares {
                prop_assert_eq!(&Share::from_bytes(&s.to_bytes()).unwrap(), s);
            }
        }

        #[test]
        fn fewer_than_threshold_shares_are_refused(t in 2usize..20, seed in any::<u64>()) {
            let ids: Vec<u32> = (1..=t as u32 + 3).collect();
            let shares = split(&[7; 32], t, &ids, &mut rng(seed)).unwrap();
            prop_assert_eq!(
                combine(&shares[..t - 1], t),
                Err(ShamirError::TooFewShares { found: t - 1, needed: t })
            );
        }
    }

    #[test]
    fn t_minus_one_shares_are_consistent_with_any_secret() {
        // Perfect secrecy, concretely: for t - 1 shares of secret A there is a polynomial
        // through them whose constant term is any other secret B. Adding the share at a
        // fresh point that B's polynomial takes shows that the t - 1 shares plus it
        // rebuild B.
        let t = 4;
        let ids = [1, 2, 3, 4, 5];
        let a = [0x11; 32];
        let shares = split(&a, t, &ids, &mut rng(1)).unwrap();
        let known = &shares[..t - 1];
        let b = [0x22; 32];
        // The unique degree-(t-1) polynomial through (0, B) and the known points, at 5.
        let mut limbs = [0u64; LIMBS];
        let xs: Vec<u64> = std::iter::once(0)
            .chain(known.iter().map(|s| u64::from(s.holder)))
            .collect();
        let b_limbs = to_limbs(&b);
        for (l, limb) in limbs.iter_mut().enumerate() {
            let ys: Vec<u64> = std::iter::once(b_limbs[l])
                .chain(known.iter().map(|s| s.limbs[l]))
                .collect();
            let x = 5u64;
            let mut acc = 0;
            for i in 0..xs.len() {
                let mut term = ys[i];
                for j in 0..xs.len() {
                    if i != j {
                        term = mul(term, mul(sub(x, xs[j]), inv(sub(xs[i], xs[j]))));
                    }
                }
                acc = add(acc, term);
            }
            *limb = acc;
        }
        let forged = Share { holder: 5, limbs };
        let mut set: Vec<Share> = known.to_vec();
        set.push(forged);
        assert_eq!(combine(&set, t).unwrap(), b);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut r = rng(0);
        assert!(matches!(
            split(&[0; 32], 0, &[1, 2], &mut r),
            Err(ShamirError::BadThreshold { .. })
        ));
        assert!(matches!(
            split(&[0; 32], 3, &[1, 2], &mut r),
            Err(ShamirError::BadThreshold { .. })
        ));
        assert_eq!(
            split(&[0; 32], 1, &[1, 0], &mut r),
            Err(ShamirError::BadHolder(0))
        );
        assert_eq!(
            split(&[0; 32], 1, &[2, 2], &mut r),
            Err(ShamirError::BadHolder(2))
        );
        let shares = split(&[9; 32], 2, &[1, 2, 3], &mut r).unwrap();
        let dup = vec![shares[0].clone(), shares[0].clone()];
        assert_eq!(combine(&dup, 2), Err(ShamirError::BadHolder(1)));
        assert!(Share::from_bytes(&[0; 10]).is_err());
        let mut bytes = shares[0].to_bytes();
        bytes[4..12].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Share::from_bytes(&bytes).is_err());
        let mut zero = shares[0].to_bytes();
        zero[..4].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(Share::from_bytes(&zero), Err(ShamirError::BadHolder(0)));
        // A tampered share almost surely combines to a value that is no secret's
        // encoding (a limb with bits above its width).
        let mut tampered = shares.clone();
        tampered[0].limbs[0] = add(tampered[0].limbs[0], 1 << 40);
        assert_ne!(combine(&tampered, 2).ok(), Some([9; 32]));
    }
}
