//! Fixed-point quantisation of a weighted update into `Z_2^32`, sized so that the sum of
//! every client's vector cannot wrap.
//!
//! A client with update `x` (length `d`), sample count `w` and training loss `l` sends
//! `d + 2` words:
//!
//! - words `0..d`: `s = (w' / W) * clip(x, -c, c)` in `[-c, c]`, stochastically rounded
//!   to one of `L = 2^b - 1` levels: `q = round((s + c) / delta)`, `delta = 2c / L`;
//! - word `d`: the weight `w' = min(w, W)` as an integer;
//! - word `d + 1`: the loss term `(w' / W) * clamp(l, 0, l_max)` on `L` levels over
//!   `[0, l_max]`.
//!
//! `W` (the weight cap), `c` (the clip) and `l_max` are public settings; `b` is the
//! largest bit width with `n * L <= 2^32 - 1` for the round's `n` selected clients, so no
//! word of the sum can wrap. Scaling by `w' / W` before rounding is what makes the mean
//! weighted without giving the weight a value's bits; the weight travels masked too.
//!
//! The server learns `Q = sum q`, `S = sum w'` and the survivors' count `m`, and returns
//! `mean = (Q * delta - m * c) * W / S`.
//!
//! **Error bound.** Stochastic rounding moves each `s` by less than `delta`, so each
//! coordinate of the mean is within `m * delta * W / S` of the exact sample-weighted mean
//! of the clipped updates (and the rounding is unbiased, so the expected error is 0);
//! returning the mean as `f32` adds at most `c * 2^-24`. [`Quantizer::error_bound`]
//! computes the sum for a round.

use rayon::prelude::*;

use super::prg;
use crate::privacy::distributed::{DistributedNoise, DistributedNoiseError, SkellamScale};

/// Coordinates quantised per parallel task (and rounding noise generated per stack
/// buffer).
const QUANTIZE_CHUNK: usize = 4096;

/// Words appended to the `d` model words: the weight and the loss term.
pub const EXTRA_WORDS: usize = 2;

/// Public quantisation settings of a secure round.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QuantizationParams {
    /// Each update coordinate is clipped to `[-clip, clip]`.
    pub clip: f32,
    /// Sample counts above this count as this (the weight cap `W`).
    pub max_weight: u32,
    /// Training losses are clamped to `[0, loss_clip]` for the mean training loss.
    pub loss_clip: f32,
    /// Distributed differential privacy: when set, the update is clipped to an L2 norm
    /// instead of per coordinate, clients weigh equally, each adds its share of Skellam
    /// noise before masking, and the training loss is not sent (see
    /// [`crate::privacy::distributed`]). `clip`, `max_weight` and `loss_clip` are then
    /// unused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distributed_noise: Option<DistributedNoise>,
    /// Compression: a fixed number of bits per value (1, 2, 4 or 8) instead of the
    /// widest that fits, so that the model words can be narrower than 32 bits. `None`:
    /// the widest `b` with `n (2^b - 1) < 2^32`, in 32-bit words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bits: Option<u32>,
    /// Compression: the width of the model words on the wire and of the ring the masks
    /// live in (8, 16 or 32). `None`: the narrowest that holds the sum of every client's
    /// values with `bits`. A width too narrow for `n` clients is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub word_bits: Option<u32>,
    /// Compression: rotate every update with this seed before clipping (the same for
    /// every client of the round, so that the server rotates the sum back). Shrinks the
    /// range a few bits must cover; see [`crate::compress::rotation`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotation_seed: Option<u64>,
}

/// The model word widths a compressed secure round may use.
pub const WORD_BITS: [u32; 3] = [8, 16, 32];

impl Default for QuantizationParams {
    fn default() -> Self {
        Self {
            clip: 4.0,
            max_weight: 1000,
            loss_clip: 64.0,
            distributed_noise: None,
            bits: None,
            word_bits: None,
            rotation_seed: None,
        }
    }
}

/// Why an input could not be quantised or a sum decoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantizeError {
    /// A setting out of range.
    #[error("invalid quantisation setting: {0}")]
    InvalidParams(String),
    /// An update coordinate or the loss is NaN or infinite.
    #[error("input value {index} is not finite")]
    NonFinite {
        /// The offending coordinate (`d` for the loss).
        index: usize,
    },
    /// The weight is zero.
    #[error("a client's weight (sample count) must be at least 1")]
    ZeroWeight,
    /// A vector of the wrong length.
    #[error("expected {expected} words, got {found}")]
    WrongLength {
        /// `d + 2`.
        expected: usize,
        /// What was given.
        found: usize,
    },
    /// A word of the unmasked sum is larger than `m` clients can produce: some input was
    /// out of range or a mask was not removed, so the sum is not trustworthy.
    #[error("word {index} of the sum is out of range for {survivors} clients")]
    OutOfRange {
        /// The offending word.
        index: usize,
        /// Clients in the sum.
        survivors: usize,
    },
    /// The sum holds no weight: there is no mean.
    #[error("the sum holds no weight")]
    NoWeight,
    /// The distributed noise settings are out of range.
    #[error(transparent)]
    Noise(#[from] DistributedNoiseError),
}

/// The quantiser of one round: public settings plus the bit width for `n` clients.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantizer {
    params: QuantizationParams,
    bits: u32,
    levels: u32,
    /// Width of the model words (the weight and loss words stay 32 bits).
    word_bits: u32,
    parties: u32,
    noise: Option<SkellamScale>,
}

/// The quantised vector of one client, with the facts needed to check it.
pub type Quantized = Vec<u32>;

/// What the server learns from an unmasked sum.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The sample-weighted mean update (of the clipped updates, within the error bound).
    pub mean: Vec<f32>,
    /// Sum of the (capped) weights.
    pub total_weight: u64,
    /// Sample-weighted mean training loss (clamped to `[0, loss_clip]`); `None` under
    /// distributed differential privacy, which does not release it.
    pub mean_loss: Option<f64>,
    /// The bound on every coordinate's rounding error, see [`Quantizer::error_bound`]
    /// (the differential privacy noise comes on top).
    pub error_bound: f64,
    /// Standard deviation of the differential privacy noise in each coordinate of the
    /// mean; 0 without distributed noise.
    pub noise_std: f64,
}

impl Quantizer {
    /// The quantiser for a round of `parties` selected clients.
    pub fn new(params: QuantizationParams, parties: u32) -> Result<Self, QuantizeError> {
        let bad = |m: String| Err(QuantizeError::InvalidParams(m));
        if !(params.clip.is_finite() && params.clip > 0.0 && params.clip <= 1e6) {
            return bad(format!("clip must be in (0, 1e6], got {}", params.clip));
        }
        if !(params.loss_clip.is_finite() && params.loss_clip > 0.0 && params.loss_clip <= 1e6) {
            return bad(format!(
                "loss_clip must be in (0, 1e6], got {}",
                params.loss_clip
            ));
        }
        if params.max_weight == 0 {
            return bad("max_weight must be at least 1".into());
        }
        if parties == 0 {
            return bad("a round needs at least one client".into());
        }
        let noise = params
            .distributed_noise
            .map(|n| SkellamScale::new(n, parties))
            .transpose()?;
        if u64::from(parties) * u64::from(params.max_weight) > u64::from(u32::MAX) {
            return bad(format!(
                "{parties} clients with weights up to {} could overflow the 32-bit weight sum",
                params.max_weight
            ));
        }
        let (bits, levels, word_bits) = match params.bits {
            None => {
                if params.word_bits.is_some_and(|w| w != 32) || params.rotation_seed.is_some() {
                    return bad("word_bits and rotation_seed come with a fixed bits".into());
                }
                let (bits, levels) = Self::widest(parties);
                if bits < 8 {
                    return bad(format!(
                        "{parties} clients leave only {bits} bits per value in 32-bit words"
                    ));
                }
                (bits, levels, 32)
            }
            Some(bits) => {
                if params.distributed_noise.is_some() {
                    return bad(
                        "compressed words do not carry distributed noise, which needs the \
                         32-bit ring"
                            .into(),
                    );
                }
                let (levels, word_bits) = Self::narrow(bits, params.word_bits, parties)
                    .map_err(QuantizeError::InvalidParams)?;
                (bits, levels, word_bits)
            }
        };
        Ok(Self {
            params,
            bits,
            levels,
            word_bits,
            parties,
            noise,
        })
    }

    /// The widest `b` with `n (2^b - 1) <= 2^32 - 1`, and its `2^b - 1`.
    fn widest(parties: u32) -> (u32, u32) {
        let per_client = u32::MAX / parties; // the largest L with n * L <= 2^32 - 1
        if per_client == u32::MAX {
            return (32, u32::MAX);
        }
        let bits = 32 - (per_client.saturating_add(1)).leading_zeros() - 1;
        (bits, (1u32 << bits) - 1)
    }

    /// `2^bits - 1` and the model word width for `parties` clients at `bits` bits: the
    /// one asked for, if the sum fits it, else the narrowest that fits.
    fn narrow(bits: u32, word_bits: Option<u32>, parties: u32) -> Result<(u32, u32), String> {
        if !crate::compress::QUANTIZE_BITS.contains(&(bits as u8)) || bits > 8 {
            return Err(format!("bits must be 1, 2, 4 or 8, got {bits}"));
        }
        let levels = (1u32 << bits) - 1;
        let sum = u64::from(parties) * u64::from(levels);
        let fits = |w: u32| sum < 1u64 << w;
        match word_bits {
            Some(w) if !WORD_BITS.contains(&w) => {
                Err(format!("word_bits must be 8, 16 or 32, got {w}"))
            }
            Some(w) if !fits(w) => Err(format!(
                "a {w}-bit word is too narrow for {parties} clients at {bits} bits: their sum \
                 reaches {parties} x {levels} = {sum}, above 2^{w} - 1; use {} bits or fewer \
                 clients",
                WORD_BITS.iter().find(|&&w| fits(w)).copied().unwrap_or(32)
            )),
            Some(w) => Ok((levels, w)),
            None => Ok((
                levels,
                WORD_BITS.iter().copied().find(|&w| fits(w)).unwrap_or(32),
            )),
        }
    }

    /// Width of the model words, which is also the ring the masks of the model words
    /// live in: 32, or 8 or 16 for a compressed round (the weight and loss words are
    /// always 32 bits).
    pub fn word_bits(&self) -> u32 {
        self.word_bits
    }

    /// Reduces the model words of a sum of masked inputs, from which the masks have been
    /// removed modulo 2^32, to their ring: the masks cancel modulo 2^32, so modulo 2^w
    /// too, and the sum of the values is below 2^w, so the low bits are the sum.
    pub fn narrow_words(&self, sum: &mut [u32]) {
        let mask = self.word_mask();
        if mask != u32::MAX {
            let d = sum.len().saturating_sub(EXTRA_WORDS);
            for w in &mut sum[..d] {
                *w &= mask;
            }
        }
    }

    /// The mask that keeps a model word in its ring (`2^word_bits - 1`).
    pub fn word_mask(&self) -> u32 {
        if self.word_bits == 32 {
            u32::MAX
        } else {
            (1u32 << self.word_bits) - 1
        }
    }

    /// The distributed noise scale, when the round carries distributed differential
    /// privacy.
    pub fn distributed_noise(&self) -> Option<&SkellamScale> {
        self.noise.as_ref()
    }

    /// The public settings.
    pub fn params(&self) -> &QuantizationParams {
        &self.params
    }

    /// Bits per value: the fixed `bits` of a compressed round, else the largest `b` with
    /// `n * (2^b - 1) < 2^32`.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// The quantisation step `delta = 2c / (2^b - 1)`.
    pub fn step(&self) -> f64 {
        2.0 * f64::from(self.params.clip) / f64::from(self.levels)
    }

    /// The bound on every coordinate of the decoded mean: `m * delta * W / S` for `m`
    /// survivors with capped weights summing to `S`, plus `c * 2^-24` for rounding the
    /// mean (at most `c` in size) to `f32`. With a rotation it bounds the rotated
    /// coordinates; rotating back keeps the error's norm, `sqrt(d)` times this at most.
    pub fn error_bound(&self, survivors: usize, total_weight: u64) -> f64 {
        if total_weight == 0 {
            return f64::INFINITY;
        }
        let rounding = survivors as f64 * self.step() * f64::from(self.params.max_weight)
            / total_weight as f64;
        rounding + f64::from(self.params.clip) * f64::from(f32::EPSILON) / 2.0
    }

    /// Quantises one client's update (clipping it), weight and loss into `d + 2` words,
    /// with stochastic rounding. The rounding noise is a ChaCha20 keystream under a key
    /// drawn from `rng`, so the update is quantised in parallel chunks and the result
    /// does not depend on the number of threads.
    pub fn encode<R: rand_core::Rng + ?Sized>(
        &self,
        update: &[f32],
        weight: u64,
        loss: f64,
        rng: &mut R,
    ) -> Result<Quantized, QuantizeError> {
        if weight == 0 {
            return Err(QuantizeError::ZeroWeight);
        }
        if let Some(index) = first_where(update, |_, v| !v.is_finite()) {
            return Err(QuantizeError::NonFinite { index });
        }
        if !loss.is_finite() {
            return Err(QuantizeError::NonFinite {
                index: update.len(),
            });
        }
        if let Some(noise) = &self.noise {
            // Clients weigh equally: a sample count would raise one client's influence
            // past the clip that the noise is calibrated to.
            let d = update.len();
            let mut out = vec![0u32; d + EXTRA_WORDS];
            noise.encode(update, &mut out[..d], rng);
            out[d] = 1;
            return Ok(out);
        }
        let rotated: Vec<f32>;
        let update = match self.params.rotation_seed {
            Some(seed) => {
                rotated = crate::compress::rotation::rotate(seed, update)
                    .into_iter()
                    .map(|v| v as f32)
                    .collect();
                &rotated[..]
            }
            None => update,
        };
        let mut noise_key = [0u8; 32];
        rng.fill_bytes(&mut noise_key);
        let w = weight.min(u64::from(self.params.max_weight)) as u32;
        let scale = f64::from(w) / f64::from(self.params.max_weight);
        let clip = f64::from(self.params.clip);
        let levels = f64::from(self.levels);
        let inv_step = levels / (2.0 * clip);
        let mut out = vec![0u32; update.len() + EXTRA_WORDS];
        out[..update.len()]
            .par_chunks_mut(QUANTIZE_CHUNK)
            .zip(update.par_chunks(QUANTIZE_CHUNK))
            .enumerate()
            .for_each(|(i, (q, x))| {
                let mut noise = [0u32; QUANTIZE_CHUNK];
                let noise = &mut noise[..x.len()];
                prg::keystream(&noise_key, (i * QUANTIZE_CHUNK) as u64, noise)
                    .expect("a model of at most 2^28 parameters fits one keystream");
                for ((q, &v), &u) in q.iter_mut().zip(x).zip(noise.iter()) {
                    let s = scale * f64::from(v).clamp(-clip, clip);
                    *q = self.round(((s + clip) * inv_step).clamp(0.0, levels), u);
                }
            });
        let d = update.len();
        out[d] = w;
        let mut tail = [0u32; 1];
        prg::keystream(&noise_key, d as u64, &mut tail)
            .expect("a model of at most 2^28 parameters fits one keystream");
        let loss_clip = f64::from(self.params.loss_clip);
        let l = scale * loss.clamp(0.0, loss_clip);
        out[d + 1] = self.round((l * levels / loss_clip).clamp(0.0, levels), tail[0]);
        Ok(out)
    }

    /// Stochastic rounding of `z` in `[0, L]` with uniform noise `u`: up with probability
    /// `frac(z)` (to within 2^-32).
    #[inline]
    fn round(&self, z: f64, u: u32) -> u32 {
        // `z` is never negative, so truncation is the floor; `f64::floor` is a libm call
        // on baseline x86-64 (no SSE4.1) that kept this loop scalar, and was most of a
        // small model's masking time.
        let floor = z as u32;
        let frac = z - f64::from(floor);
        let up = (f64::from(u) + 0.5) * (1.0 / 4_294_967_296.0) < frac;
        (floor + u32::from(up)).min(self.levels)
    }

    /// Decodes the unmasked sum of `survivors` clients' vectors, its model words in
    /// their ring ([`narrow_words`](Self::narrow_words), as the server's session leaves
    /// them; a word past the ring is out of range).
    pub fn decode(&self, sum: &[u32], survivors: usize) -> Result<Decoded, QuantizeError> {
        if sum.len() < EXTRA_WORDS {
            return Err(QuantizeError::WrongLength {
                expected: EXTRA_WORDS,
                found: sum.len(),
            });
        }
        if survivors == 0 || survivors > self.parties as usize {
            return Err(QuantizeError::InvalidParams(format!(
                "{survivors} survivors in a round of {}",
                self.parties
            )));
        }
        let d = sum.len() - EXTRA_WORDS;
        if let Some(noise) = &self.noise {
            return Self::decode_noisy(noise, sum, survivors);
        }
        let max_word = survivors as u64 * u64::from(self.levels);
        let weight_limit = survivors as u64 * u64::from(self.params.max_weight);
        if let Some(index) = first_where(sum, |i, &q| {
            u64::from(q) > if i == d { weight_limit } else { max_word }
        }) {
            return Err(QuantizeError::OutOfRange { index, survivors });
        }
        let total_weight = u64::from(sum[d]);
        if total_weight == 0 {
            return Err(QuantizeError::NoWeight);
        }
        let step = self.step();
        let clip = f64::from(self.params.clip);
        let factor = f64::from(self.params.max_weight) / total_weight as f64;
        let offset = survivors as f64 * clip;
        let mean = match self.params.rotation_seed {
            None => sum[..d]
                .par_iter()
                .map(|&q| ((f64::from(q) * step - offset) * factor) as f32)
                .collect(),
            Some(seed) => {
                let mut rotated: Vec<f64> = sum[..d]
                    .par_iter()
                    .map(|&q| (f64::from(q) * step - offset) * factor)
                    .collect();
                crate::compress::rotation::unrotate(seed, &mut rotated);
                rotated.into_iter().map(|v| v as f32).collect()
            }
        };
        let loss_step = f64::from(self.params.loss_clip) / f64::from(self.levels);
        Ok(Decoded {
            mean,
            total_weight,
            mean_loss: Some(f64::from(sum[d + 1]) * loss_step * factor),
            error_bound: self.error_bound(survivors, total_weight),
            noise_std: 0.0,
        })
    }

    /// [`decode`](Self::decode) under distributed noise: the count word must equal the
    /// survivors and the loss word must be 0 (anything else means a mask was not
    /// removed); the values are read as signed integers.
    fn decode_noisy(
        noise: &SkellamScale,
        sum: &[u32],
        survivors: usize,
    ) -> Result<Decoded, QuantizeError> {
        let d = sum.len() - EXTRA_WORDS;
        if sum[d] as usize != survivors {
            return Err(QuantizeError::OutOfRange {
                index: d,
                survivors,
            });
        }
        if sum[d + 1] != 0 {
            return Err(QuantizeError::OutOfRange {
                index: d + 1,
                survivors,
            });
        }
        let m = survivors as f64;
        let mean = noise
            .decode(&sum[..d])
            .into_iter()
            .map(|v| (v / m) as f32)
            .collect();
        let noise_std = noise.sum_noise_std(survivors, d) / m;
        let clip = f64::from(noise.settings().l2_clip);
        Ok(Decoded {
            mean,
            total_weight: survivors as u64,
            mean_loss: None,
            // Rounding moves each client's coordinate by less than 1 / gamma; the f32
            // result adds half an ulp of a value within the clip plus 8 noise deviations.
            error_bound: 1.0 / noise.gamma()
                + (clip + 8.0 * noise_std) * f64::from(f32::EPSILON) / 2.0,
            noise_std,
        })
    }
}

/// Values a search task tests before it looks for the first hit.
const SEARCH_CHUNK: usize = 16_384;

/// The first index of `values` where `bad(index, value)` holds. Each task tests a whole
/// chunk without stopping early, which the compiler turns into vector code, and only a
/// chunk with a hit is searched again for its place: rayon's own `position_first` pays
/// an atomic and a call per value, and cost more than quantising the update did.
fn first_where<T: Sync>(values: &[T], bad: impl Fn(usize, &T) -> bool + Sync) -> Option<usize> {
    values
        .par_chunks(SEARCH_CHUNK)
        .enumerate()
        .find_map_first(|(c, chunk)| {
            let base = c * SEARCH_CHUNK;
            let any = chunk
                .iter()
                .enumerate()
                .fold(false, |hit, (j, v)| hit | bad(base + j, v));
            if !any {
                return None;
            }
            chunk
                .iter()
                .enumerate()
                .position(|(j, v)| bad(base + j, v))
                .map(|j| base + j)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    fn q(parties: u32) -> Quantizer {
        Quantizer::new(QuantizationParams::default(), parties).unwrap()
    }

    #[test]
    fn bit_width_leaves_room_for_every_client() {
        for n in [1u32, 2, 3, 100, 500, 1000, 4_000_000] {
            let quant = Quantizer::new(
                QuantizationParams {
                    max_weight: 1,
                    ..QuantizationParams::default()
                },
                n,
            )
            .unwrap();
            let l = u64::from(quant.levels);
            assert!(u64::from(n) * l <= u64::from(u32::MAX), "n={n}");
            // and it is the largest such width
            if quant.bits < 32 {
                assert!(
                    u64::from(n) * ((l + 1) * 2 - 1) > u64::from(u32::MAX),
                    "n={n}"
                );
            }
        }
        assert_eq!(q(1).bits(), 32);
        assert_eq!(q(2).bits(), 31);
        assert_eq!(q(100).bits(), 25);
        assert_eq!(q(500).bits(), 23);
    }

    #[test]
    fn bad_settings_and_inputs_are_errors() {
        let p = QuantizationParams::default();
        for bad in [
            QuantizationParams { clip: 0.0, ..p },
            QuantizationParams {
                clip: f32::NAN,
                ..p
            },
            QuantizationParams { max_weight: 0, ..p },
            QuantizationParams {
                loss_clip: -1.0,
                ..p
            },
        ] {
            assert!(Quantizer::new(bad, 10).is_err());
        }
        assert!(Quantizer::new(p, 0).is_err());
        assert!(
            Quantizer::new(p, 5_000_000).is_err(),
            "weight sum could wrap"
        );
        let quant = q(10);
        let mut rng = ChaCha20Rng::seed_from_u64(0);
        assert_eq!(
            quant.encode(&[1.0, f32::NAN], 1, 0.0, &mut rng),
            Err(QuantizeError::NonFinite { index: 1 })
        );
        assert_eq!(
            quant.encode(&[1.0], 0, 0.0, &mut rng),
            Err(QuantizeError::ZeroWeight)
        );
        assert!(quant.decode(&[0], 1).is_err());
        assert!(quant.decode(&[0, 0, 0], 1).is_err(), "no weight");
        assert!(matches!(
            quant.decode(&[u32::MAX, 1, 0], 1),
            Err(QuantizeError::OutOfRange { index: 0, .. })
        ));
    }

    #[test]
    fn the_first_bad_value_is_named_wherever_it_lies() {
        let quant = q(10);
        let mut rng = ChaCha20Rng::seed_from_u64(0);
        let d = 3 * SEARCH_CHUNK + 17;
        for first in [
            0,
            SEARCH_CHUNK - 1,
            SEARCH_CHUNK,
            2 * SEARCH_CHUNK + 5,
            d - 1,
        ] {
            let mut update = vec![0.25f32; d];
            update[first] = f32::INFINITY;
            // A later bad value, in a later chunk or the same one, must not be named.
            update[(first + 1).min(d - 1)] = f32::NAN;
            update[d - 1] = f32::NEG_INFINITY;
            assert_eq!(
                quant.encode(&update, 1, 0.0, &mut rng),
                Err(QuantizeError::NonFinite { index: first })
            );
        }
        let mut sum = vec![0u32; d + EXTRA_WORDS];
        sum[d] = 1;
        sum[SEARCH_CHUNK + 3] = u32::MAX;
        sum[2 * SEARCH_CHUNK] = u32::MAX;
        assert!(matches!(
            quant.decode(&sum, 1),
            Err(QuantizeError::OutOfRange { index, .. }) if index == SEARCH_CHUNK + 3
        ));
        sum[SEARCH_CHUNK + 3] = 0;
        sum[2 * SEARCH_CHUNK] = 0;
        sum[d] = u32::MAX;
        assert!(matches!(
            quant.decode(&sum, 1),
            Err(QuantizeError::OutOfRange { index, .. }) if index == d
        ));
    }

    proptest! {
        #[test]
        fn decoded_mean_is_within_the_bound_of_the_weighted_mean(
            clients in prop::collection::vec(
                (prop::collection::vec(-5.0f32..5.0, 6), 1u64..2000, 0.0f64..10.0), 1..40),
            seed in any::<u64>(),
        ) {
            let n = clients.len() as u32;
            let quant = q(n);
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            let mut sum = vec![0u32; 6 + EXTRA_WORDS];
            for (x, w, l) in &clients {
                let v = quant.encode(x, *w, *l, &mut rng).unwrap();
                for (s, q) in sum.iter_mut().zip(&v) {
                    *s = s.checked_add(*q).expect("the sum never wraps");
                }
            }
            let dec = quant.decode(&sum, clients.len()).unwrap();
            let c = f64::from(quant.params().clip);
            let cap = u64::from(quant.params().max_weight);
            let total: u64 = clients.iter().map(|(_, w, _)| (*w).min(cap)).sum();
            prop_assert_eq!(dec.total_weight, total);
            for j in 0..6 {
                let exact: f64 = clients
                    .iter()
                    .map(|(x, w, _)| (*w).min(cap) as f64 * f64::from(x[j]).clamp(-c, c))
                    .sum::<f64>()
                    / total as f64;
                // The bound covers the f32 output too; 1e-12 is f64 arithmetic.
                prop_assert!(
                    (f64::from(dec.mean[j]) - exact).abs() <= dec.error_bound + 1e-12,
                    "coordinate {}: {} vs {} (bound {})", j, dec.mean[j], exact, dec.error_bound
                );
            }
            let loss: f64 = clients.iter().map(|(_, w, l)| (*w).min(cap) as f64 * l).sum::<f64>() / total as f64;
            let loss_bound = clients.len() as f64 * f64::from(quant.params().loss_clip)
                / f64::from(quant.levels) * cap as f64 / total as f64;
            prop_assert!((dec.mean_loss.unwrap() - loss).abs() <= loss_bound + 1e-9);
        }
    }

    #[test]
    fn rounding_is_unbiased() {
        let quant = q(1000);
        let mut rng = ChaCha20Rng::seed_from_u64(3);
        let x = 0.123_456_7f32;
        let reps = 20_000;
        let mut sum = 0f64;
        for _ in 0..reps {
            let v = quant.encode(&[x], 1000, 0.0, &mut rng).unwrap();
            sum += f64::from(v[0]) * quant.step() - 4.0;
        }
        let mean = sum / f64::from(reps);
        // The standard error of the mean of rounding noise is below step / sqrt(reps).
        assert!(
            (mean - f64::from(x)).abs() < 5.0 * quant.step() / f64::from(reps).sqrt(),
            "{mean} vs {x}"
        );
    }

    /// Bad compression settings are refused with a message that names the setting.
    #[test]
    fn compressed_settings_are_checked() {
        let with = |bits, word_bits| QuantizationParams {
            bits,
            word_bits,
            ..QuantizationParams::default()
        };
        let refused = |p, n| Quantizer::new(p, n).unwrap_err().to_string();
        assert!(refused(with(Some(3), None), 10).contains("bits must be 1, 2, 4 or 8, got 3"));
        assert!(refused(with(Some(4), Some(12)), 10).contains("word_bits must be 8, 16 or 32"));
        let narrow = refused(with(Some(4), Some(8)), 100);
        assert!(
            narrow.contains("8-bit word is too narrow for 100 clients at 4 bits")
                && narrow.contains("use 16 bits"),
            "{narrow}"
        );
        assert!(refused(with(None, Some(16)), 10).contains("come with a fixed bits"));
        // The narrowest ring that fits is taken when none is named.
        assert_eq!(
            Quantizer::new(with(Some(4), None), 17).unwrap().word_bits(),
            8
        );
        assert_eq!(
            Quantizer::new(with(Some(4), None), 18).unwrap().word_bits(),
            16
        );
        assert_eq!(
            Quantizer::new(with(Some(4), None), 4369)
                .unwrap()
                .word_bits(),
            16
        );
        assert_eq!(
            Quantizer::new(with(Some(4), None), 4370)
                .unwrap()
                .word_bits(),
            32
        );
        assert_eq!(
            Quantizer::new(with(None, None), 10).unwrap().word_bits(),
            32
        );
    }
}
