//! What compression promises its users: the unbiased schemes are unbiased, every scheme
//! decodes what it encoded within its stated error, error feedback loses nothing for
//! good, and a receiver refuses a body that is not what the experiment asked for.

use proptest::prelude::*;

use super::format::HEADER_LEN;
use super::rotation::blocks;
use super::*;

fn expected(d: usize, seed: u64) -> Expected {
    Expected {
        dimension: d,
        rotation_seed: Some(seed),
    }
}

fn norm(v: impl Iterator<Item = f64>) -> f64 {
    v.map(|a| a * a).sum::<f64>().sqrt()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Unbiasedness: the mean of many decodings is the input, both with one rotation
    /// and fresh rounding each time (what the coordinator undoes on a sum of updates
    /// rotated alike) and with a fresh rotation too. Tolerance: six standard errors of
    /// the mean, from the draws' own spread (so a bias of a few hundredths of a step
    /// fails), plus 1e-6 for float rounding.
    #[test]
    fn each_quantiser_is_unbiased(
        x in prop::collection::vec(-4.0f32..4.0, 1..40),
        bits in prop::sample::select(QUANTIZE_BITS.to_vec()),
        salt in any::<u64>(),
        fresh_rotation in any::<bool>(),
    ) {
        const DRAWS: usize = 10_000;
        let scheme = Compression::Quantize { bits };
        let d = x.len();
        let (mut sum, mut squares) = (vec![0.0f64; d], vec![0.0f64; d]);
        for draw in 0..DRAWS as u64 {
            let r = if fresh_rotation { salt ^ draw.wrapping_mul(0x9e37_79b9_7f4a_7c15) } else { salt };
            let bytes = scheme.encode(&x, r, draw ^ !salt).unwrap();
            let got = scheme.decode(&bytes, &expected(d, r)).unwrap();
            for i in 0..d {
                let g = f64::from(got[i]);
                sum[i] += g;
                squares[i] += g * g;
            }
        }
        let n = DRAWS as f64;
        for i in 0..d {
            let mean = sum[i] / n;
            let variance = (squares[i] / n - mean * mean).max(0.0) * n / (n - 1.0);
            let tolerance = 6.0 * (variance / n).sqrt() + 1e-6;
            prop_assert!((mean - f64::from(x[i])).abs() <= tolerance,
                "bits {bits}, coordinate {i}: mean {mean}, input {}, tolerance {tolerance}", x[i]);
        }
    }

    /// One decoding is off by less than a step per rotated coordinate, so by less than
    /// `sqrt(sum over blocks of n_b step_b^2)` in norm.
    #[test]
    fn a_quantised_vector_is_within_its_steps(
        x in prop::collection::vec(-100.0f32..100.0, 0..3000),
        bits in prop::sample::select(QUANTIZE_BITS.to_vec()),
        r in any::<u64>(),
        s in any::<u64>(),
    ) {
        let scheme = Compression::Quantize { bits };
        let bytes = scheme.encode(&x, r, s).unwrap();
        prop_assert_eq!(bytes.len(), scheme.encoded_len(x.len()));
        let got = scheme.decode(&bytes, &expected(x.len(), r)).unwrap();
        let y = rotation::rotate(r, &x);
        let levels = f64::from((1u16 << bits) - 1);
        let bound: f64 = blocks(x.len()).into_iter().map(|b| {
            let part = &y[b];
            let lo = part.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = part.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            part.len() as f64 * ((hi - lo) / levels).powi(2)
        }).sum::<f64>().sqrt();
        let err = norm(x.iter().zip(&got).map(|(a, b)| f64::from(*a) - f64::from(*b)));
        prop_assert!(err <= bound * (1.0 + 1e-6) + 1e-4, "error {err}, bound {bound}");
    }

    /// Error feedback loses nothing for good: what was sent over any number of rounds
    /// plus the residual is what was fed in, up to float rounding.
    #[test]
    fn error_feedback_delays_but_never_drops(
        rounds in prop::collection::vec(prop::collection::vec(-1.0f32..1.0, 64), 1..8),
        topk in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let scheme = if topk { Compression::TopK { fraction: 0.1 } } else { Compression::Sign };
        let mut feedback = ErrorFeedback::new();
        let mut fed = vec![0.0f64; 64];
        let mut sent = vec![0.0f64; 64];
        for (t, update) in rounds.iter().enumerate() {
            let r = seed.wrapping_add(t as u64);
            let bytes = feedback.compress(scheme, update, r, 0).unwrap();
            let got = scheme.decode(&bytes, &expected(64, r)).unwrap();
            for i in 0..64 {
                fed[i] += f64::from(update[i]);
                sent[i] += f64::from(got[i]);
            }
        }
        for i in 0..64 {
            let kept = f64::from(feedback.residual()[i]);
            prop_assert!((fed[i] - sent[i] - kept).abs() < 1e-4, "{i}: {} {} {}", fed[i], sent[i], kept);
        }
    }
}

#[test]
fn topk_sends_exactly_the_largest_coordinates() {
    let x: Vec<f32> = (0..1000)
        .map(|i| ((i * 37 % 1000) as f32 - 500.0) / 100.0)
        .collect();
    let scheme = Compression::TopK { fraction: 0.01 };
    let bytes = scheme.encode(&x, 0, 0).unwrap();
    let got = scheme.decode(&bytes, &expected(1000, 99)).unwrap();
    let mut by_size: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    by_size.sort_by(|a, b| b.total_cmp(a));
    let threshold = by_size[9];
    let kept: Vec<usize> = (0..1000).filter(|&i| got[i] != 0.0).collect();
    assert_eq!(kept.len(), 10);
    for i in kept {
        assert_eq!(got[i], x[i]);
        assert!(x[i].abs() >= threshold);
    }
    // 10 coordinates: header, count, 10 gaps of one or two bytes, 10 floats.
    assert!(
        bytes.len() <= HEADER_LEN + 8 + 10 * 2 + 10 * 4,
        "{}",
        bytes.len()
    );
}

#[test]
fn sizes_are_what_the_issue_promises_for_the_mnist_mlp() {
    // mlp:128 on 784 features, 10 classes.
    let d = 784 * 128 + 128 + 128 * 10 + 10;
    let plain = Compression::None.encoded_len(d) as f64;
    let four = Compression::Quantize { bits: 4 }.encoded_len(d) as f64;
    let sign = Compression::Sign.encoded_len(d) as f64;
    assert!(plain / four > 7.9, "{}", plain / four);
    assert!(plain / sign > 31.0, "{}", plain / sign);
}

/// Every way a body can be wrong is refused with its own error, and the message names
/// what was expected.
#[test]
fn a_receiver_refuses_what_was_not_asked_for() {
    let x: Vec<f32> = (0..100).map(|i| i as f32 / 10.0).collect();
    let q4 = Compression::Quantize { bits: 4 };
    let good = q4.encode(&x, 7, 8).unwrap();
    let e = expected(100, 7);
    assert!(q4.decode(&good, &e).is_ok());
    let corrupt = |at: usize, byte: u8| {
        let mut b = good.clone();
        b[at] = byte;
        q4.decode(&b, &e).unwrap_err()
    };
    assert_eq!(corrupt(0, b'X'), CompressError::Magic);
    assert_eq!(corrupt(2, 9), CompressError::Version(9));
    let wrong = corrupt(4, 8).to_string();
    assert!(
        wrong.contains("says quantize:8, the experiment asks for quantize:4"),
        "{wrong}"
    );
    assert_eq!(corrupt(6, 1), CompressError::Reserved);
    assert!(matches!(
        corrupt(8, 99),
        CompressError::Dimension {
            expected: 100,
            found: 99
        }
    ));
    assert!(matches!(
        corrupt(16, 6),
        CompressError::Seed {
            expected: 7,
            found: 6
        }
    ));
    // A reversed range, a NaN range.
    let mut reversed = good.clone();
    reversed[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&1e9f32.to_le_bytes());
    assert!(matches!(
        q4.decode(&reversed, &e),
        Err(CompressError::Range { block: 0 })
    ));
    let mut nan = good.clone();
    nan[HEADER_LEN + 4..HEADER_LEN + 8].copy_from_slice(&f32::NAN.to_le_bytes());
    assert!(matches!(
        q4.decode(&nan, &e),
        Err(CompressError::NonFinite { .. })
    ));
    // One byte short, one byte long, and plain floats where a compressed body belongs.
    assert!(matches!(
        q4.decode(&good[..good.len() - 1], &e),
        Err(CompressError::Length { .. })
    ));
    let mut long = good.clone();
    long.push(0);
    assert!(matches!(
        q4.decode(&long, &e),
        Err(CompressError::Length { .. })
    ));
    let plain = Compression::None.encode(&x, 0, 0).unwrap();
    assert_eq!(q4.decode(&plain, &e).unwrap_err(), CompressError::Magic);
    assert!(matches!(
        q4.decode(&good[..10], &e),
        Err(CompressError::TooShort { .. })
    ));
    // Non-finite input is refused before anything is sent.
    assert_eq!(
        q4.encode(&[1.0, f32::INFINITY], 0, 0).unwrap_err(),
        CompressError::NonFinite { index: 1 }
    );
}

#[test]
fn a_topk_receiver_checks_count_and_positions() {
    let x: Vec<f32> = (0..50).map(|i| i as f32).collect();
    let top = Compression::TopK { fraction: 0.1 };
    let good = top.encode(&x, 0, 0).unwrap();
    let e = expected(50, 0);
    assert_eq!(top.decode(&good, &e).unwrap()[49], 49.0);
    // Another fraction's count.
    let other = Compression::TopK { fraction: 0.2 }
        .decode(&good, &e)
        .unwrap_err();
    assert!(
        matches!(
            other,
            CompressError::Count {
                expected: 10,
                found: 5
            }
        ),
        "{other}"
    );
    // A gap that runs past the model.
    let mut past = good.clone();
    past[HEADER_LEN + 8] = 60;
    assert!(matches!(
        top.decode(&past, &e),
        Err(CompressError::Position { index: 0 })
    ));
    // A position that never ends.
    let mut endless = good[..HEADER_LEN + 8].to_vec();
    endless.extend_from_slice(&[0xff; 20]);
    assert!(matches!(
        top.decode(&endless, &e),
        Err(CompressError::Position { index: 0 })
    ));
}

#[test]
fn sign_sends_scaled_signs_of_the_rotated_vector() {
    // With one block of two coordinates, rotating (a, b) gives ((a+b), (a-b)) / sqrt 2
    // up to the random signs; their mean magnitude is the scale.
    let x = vec![3.0f32, 1.0];
    let bytes = Compression::Sign.encode(&x, 5, 0).unwrap();
    assert_eq!(bytes.len(), Compression::Sign.encoded_len(2));
    let got = Compression::Sign.decode(&bytes, &expected(2, 5)).unwrap();
    let y = rotation::rotate(5, &x);
    let scale = (y[0].abs() + y[1].abs()) / 2.0;
    let mut back = vec![scale * y[0].signum(), scale * y[1].signum()];
    rotation::unrotate(5, &mut back);
    assert!(
        (f64::from(got[0]) - back[0]).abs() < 1e-6 && (f64::from(got[1]) - back[1]).abs() < 1e-6
    );
}
