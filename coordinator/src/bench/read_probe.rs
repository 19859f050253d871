//! How fast this machine reads memory: the best of several read patterns over one
//! buffer, so that a kernel's `ratio` is taken against what the machine gives, not
//! against one pattern that happens to leave bandwidth unused.
//!
//! - `all_threads`: every core of the pool sums its own contiguous part;
//! - `one_thread`: one core sums the whole buffer (on a machine whose cores share one
//!   memory channel this can be the best);
//! - `all_threads_4_streams`: every core sums four distant parts at once, one cache
//!   line of each in turn, so that more prefetch streams run;
//! - `all_threads_nt`: as `all_threads`, with non-temporal (streaming) 256-bit loads,
//!   where the CPU has AVX2;
//! - `all_threads_8_streams_wide`: every core reads eight distant parts at once with the
//!   widest vector loads the CPU has (AVX-512 or AVX2), adding them into a block that
//!   stays in the first-level cache: the access pattern of the reducers' sums, which
//!   read eight inputs at a time, without their arithmetic. On the 2-core machine this
//!   project is built on it read a quarter faster than the patterns above from 4 KiB
//!   pages, which a reducer's ratio would otherwise have exceeded 1 against.
//! - `all_threads_8_streams_prefetch`: as `all_threads_8_streams_wide`, one cache line
//!   of each part in turn, each part's line 2 KiB ahead asked for first (`prefetcht0`),
//!   as the FedAvg fold asks for its inputs on Intel CPUs (1 KiB ahead there): the
//!   hardware prefetchers stop at each 4 KiB page, the software ones do not. On huge
//!   pages, on the 2-core Intel Xeon, this and `all_threads` were the best (30-34 GB/s).
//!
//! The buffer is one large allocation: in the `cohort` command it is on transparent
//! huge pages, as the updates are (`crate::huge_pages`).
//!
//! Each pattern reads the whole buffer per repeat; its figure is the median of the
//! repeats, and the probe is the best pattern's.
// Non-temporal loads are only reachable through `std::arch` intrinsics, which take raw
// pointers: the one `unsafe` here reads a slice's own, aligned elements.
#![allow(unsafe_code)]

use std::time::Instant;

use rayon::prelude::*;

use super::secagg::median;

/// One pattern's figure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PatternRate {
    /// The pattern's name.
    pub pattern: &'static str,
    /// Median GB/s.
    pub gbps: f64,
}

/// Every pattern's figure and the best one.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadProbe {
    /// Each pattern measured, in the order above.
    pub patterns: Vec<PatternRate>,
}

impl ReadProbe {
    /// The fastest pattern.
    pub fn best(&self) -> PatternRate {
        self.patterns
            .iter()
            .copied()
            .max_by(|a, b| a.gbps.total_cmp(&b.gbps))
            .unwrap_or(PatternRate {
                pattern: "none",
                gbps: f64::NAN,
            })
    }
}

fn fold(words: &[u64]) -> u64 {
    words.iter().fold(0u64, |a, &w| a.wrapping_add(w))
}

/// Words in one parallel piece: large enough that scheduling is noise.
const PIECE: usize = 1 << 16;

fn all_threads(words: &[u64]) -> u64 {
    words
        .par_chunks(PIECE)
        .map(fold)
        .reduce(|| 0, u64::wrapping_add)
}

fn four_streams(words: &[u64]) -> u64 {
    // Each task takes four pieces a quarter of the buffer apart and walks them together,
    // 8 words (one cache line) of each in turn.
    let quarter = words.len() / 4;
    let (a, rest) = words.split_at(quarter);
    let (b, rest) = rest.split_at(quarter);
    let (c, d) = rest.split_at(quarter);
    let tail = fold(&d[quarter..]);
    let pieces = quarter.div_ceil(PIECE);
    (0..pieces)
        .into_par_iter()
        .map(|p| {
            let range = p * PIECE..((p + 1) * PIECE).min(quarter);
            let parts = [
                &a[range.clone()],
                &b[range.clone()],
                &c[range.clone()],
                &d[range],
            ];
            let mut acc = [0u64; 4];
            for line in (0..parts[0].len()).step_by(8) {
                for (k, part) in parts.iter().enumerate() {
                    let end = (line + 8).min(part.len());
                    acc[k] = acc[k].wrapping_add(fold(&part[line..end]));
                }
            }
            acc.iter().fold(0u64, |x, &y| x.wrapping_add(y))
        })
        .reduce(|| 0, u64::wrapping_add)
        .wrapping_add(tail)
}

#[cfg(target_arch = "x86_64")]
fn streaming_loads_available() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

#[cfg(not(target_arch = "x86_64"))]
fn streaming_loads_available() -> bool {
    false
}

/// The sum of `words` read with non-temporal 256-bit loads.
#[cfg(target_arch = "x86_64")]
fn fold_streaming(words: &[u64]) -> u64 {
    #[target_feature(enable = "avx2")]
    fn inner(words: &[u64]) -> u64 {
        use std::arch::x86_64::{
            __m256i, _mm256_add_epi64, _mm256_setzero_si256, _mm256_storeu_si256,
            _mm256_stream_load_si256,
        };
        // SAFETY: `__m256i` is plain data of 4 `u64`s; `align_to` hands back only
        // elements aligned for it, inside the slice.
        let (head, body, tail) = unsafe { words.align_to::<__m256i>() };
        let mut acc = [_mm256_setzero_si256(); 4];
        let lines = body.chunks_exact(4);
        let rest = lines.remainder();
        for line in lines {
            for (k, v) in line.iter().enumerate() {
                // SAFETY: `v` is a 32-byte-aligned element of the slice, valid to read.
                let loaded = unsafe { _mm256_stream_load_si256(v as *const __m256i) };
                acc[k] = _mm256_add_epi64(acc[k], loaded);
            }
        }
        let mut total = fold(head).wrapping_add(fold(tail));
        for v in rest.iter().chain(acc.iter()) {
            let mut lanes = [0u64; 4];
            // SAFETY: `lanes` is 32 bytes, written unaligned.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), *v) };
            total = total.wrapping_add(fold(&lanes));
        }
        total
    }
    // SAFETY: called only where `streaming_loads_available` found AVX2.
    unsafe { inner(words) }
}

#[cfg(not(target_arch = "x86_64"))]
fn fold_streaming(words: &[u64]) -> u64 {
    fold(words)
}

fn all_threads_streaming(words: &[u64]) -> u64 {
    words
        .par_chunks(PIECE)
        .map(fold_streaming)
        .reduce(|| 0, u64::wrapping_add)
}

/// Parts read at once by `all_threads_8_streams_wide`.
const STREAMS: usize = 8;

/// Words of each part added into the cache-resident block per step (16 KiB of block).
const BLOCK: usize = 2048;

/// The sum of the words of eight equal parts, read together a block at a time: the
/// loop the compiler vectorises for the instruction set of its caller.
#[inline(always)]
fn fold_streams(parts: [&[u64]; STREAMS]) -> u64 {
    let len = parts[0].len();
    let parts: [&[u64]; STREAMS] = std::array::from_fn(|k| &parts[k][..len]);
    let mut block = [0u64; BLOCK];
    for start in (0..len).step_by(BLOCK) {
        let n = BLOCK.min(len - start);
        for (i, b) in block[..n].iter_mut().enumerate() {
            let mut a = *b;
            for part in &parts {
                a = a.wrapping_add(part[start + i]);
            }
            *b = a;
        }
    }
    fold(&block)
}

/// `sum(parts)` compiled for the widest vector unit the CPU has (AVX-512 or AVX2); `sum`
/// is inlined into each variant.
#[cfg(target_arch = "x86_64")]
fn on_widest<S: Fn([&[u64]; STREAMS]) -> u64>(parts: [&[u64]; STREAMS], sum: S) -> u64 {
    #[target_feature(enable = "avx512f")]
    fn avx512<S: Fn([&[u64]; STREAMS]) -> u64>(parts: [&[u64]; STREAMS], sum: S) -> u64 {
        sum(parts)
    }
    #[target_feature(enable = "avx2")]
    fn avx2<S: Fn([&[u64]; STREAMS]) -> u64>(parts: [&[u64]; STREAMS], sum: S) -> u64 {
        sum(parts)
    }
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU reports AVX-512F; the body is safe Rust over slices.
        unsafe { avx512(parts, sum) }
    } else if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: as above, for AVX2.
        unsafe { avx2(parts, sum) }
    } else {
        sum(parts)
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn on_widest<S: Fn([&[u64]; STREAMS]) -> u64>(parts: [&[u64]; STREAMS], sum: S) -> u64 {
    sum(parts)
}

/// How far ahead of the sum `all_threads_8_streams_prefetch` asks for each part's cache
/// line, in words: 2 KiB, the distance that served the FedAvg fold best on 4 KiB pages
/// (on huge pages the fold asks 1 KiB ahead).
const AHEAD: usize = 256;

/// As [`fold_streams`], one cache line of each part in turn, each part's line [`AHEAD`]
/// asked for first.
#[inline(always)]
fn fold_streams_prefetched(parts: [&[u64]; STREAMS]) -> u64 {
    const LINE: usize = 8;
    let len = parts[0].len();
    let parts: [&[u64]; STREAMS] = std::array::from_fn(|k| &parts[k][..len]);
    let mut acc = [0u64; LINE];
    let whole = len - len % LINE;
    for line in (0..whole).step_by(LINE) {
        for part in &parts {
            prefetch(part, line + AHEAD);
        }
        for part in &parts {
            let words: &[u64; LINE] = part[line..line + LINE].try_into().expect("a line");
            for (a, w) in acc.iter_mut().zip(words) {
                *a = a.wrapping_add(*w);
            }
        }
    }
    let tail: u64 = parts
        .iter()
        .map(|p| fold(&p[whole..]))
        .fold(0, u64::wrapping_add);
    fold(&acc).wrapping_add(tail)
}

/// Asks for the cache line holding `x[at]`; past the slice's end it asks for nothing
/// the program can see.
#[inline(always)]
fn prefetch(x: &[u64], at: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let p = x.as_ptr().wrapping_add(at);
        // SAFETY: a prefetch is a hint: it reads nothing the program can see and cannot
        // fault, whatever the address.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast()) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, at);
}

fn eight_streams(words: &[u64]) -> u64 {
    streams_by(words, |parts| on_widest(parts, fold_streams))
}

fn eight_streams_prefetched(words: &[u64]) -> u64 {
    streams_by(words, |parts| on_widest(parts, fold_streams_prefetched))
}

/// The buffer as eight equal parts, a stretch of each summed together by `sum` in each
/// parallel task.
fn streams_by(words: &[u64], sum: fn([&[u64]; STREAMS]) -> u64) -> u64 {
    let part = words.len() / STREAMS;
    let tail = fold(&words[part * STREAMS..]);
    // Each task reads the same stretch of every part: one piece in all, as the other
    // patterns' tasks read.
    let stretch = PIECE / STREAMS;
    (0..part.div_ceil(stretch))
        .into_par_iter()
        .map(|p| {
            let range = p * stretch..((p + 1) * stretch).min(part);
            sum(std::array::from_fn(|k| {
                &words[k * part + range.start..k * part + range.end]
            }))
        })
        .reduce(|| 0, u64::wrapping_add)
        .wrapping_add(tail)
}

/// A way of reading the whole buffer, returning the sum of its words.
type Pattern = fn(&[u64]) -> u64;

/// Reads `bytes` of memory with each pattern, `repeats` times each.
pub fn measure(bytes: usize, repeats: usize) -> ReadProbe {
    measure_and_keep(bytes, repeats).0
}

/// The probe's buffer and its best pattern, kept to read again between a kernel's
/// repeats: on a shared machine memory's speed moves within seconds, so a kernel's
/// repeat is best compared with a probe read just before it.
pub struct Reread {
    words: Vec<u64>,
    expected: u64,
    read: Pattern,
    /// The pattern read again (the best of the run's).
    pub pattern: &'static str,
}

impl Reread {
    /// Reads the buffer once with the kept pattern; its GB/s.
    pub fn gbps(&self) -> f64 {
        let (seconds, sum) = read_once(self.read, &self.words);
        assert_eq!(
            sum, self.expected,
            "the {} probe read the whole buffer",
            self.pattern
        );
        (self.words.len() * 8) as f64 / seconds / 1e9
    }
}

/// One read of `words` with `read`: its seconds and the sum it found.
fn read_once(read: Pattern, words: &[u64]) -> (f64, u64) {
    let start = Instant::now();
    let sum = std::hint::black_box(read(std::hint::black_box(words)));
    (start.elapsed().as_secs_f64(), sum)
}

/// [`measure`], keeping the buffer and the best pattern to read again.
pub fn measure_and_keep(bytes: usize, repeats: usize) -> (ReadProbe, Reread) {
    let words: Vec<u64> = (0..bytes / 8).into_par_iter().map(|i| i as u64).collect();
    let expected = fold(&words);
    let mut patterns: Vec<(&'static str, Pattern)> = vec![
        ("all_threads", all_threads),
        ("one_thread", fold),
        ("all_threads_4_streams", four_streams),
    ];
    if streaming_loads_available() {
        patterns.push(("all_threads_nt", all_threads_streaming));
    }
    patterns.push(("all_threads_8_streams_wide", eight_streams));
    patterns.push(("all_threads_8_streams_prefetch", eight_streams_prefetched));
    let rates: Vec<PatternRate> = patterns
        .iter()
        .map(|&(pattern, read)| {
            let mut times = Vec::with_capacity(repeats);
            for _ in 0..repeats.max(1) {
                let (seconds, sum) = read_once(read, &words);
                times.push(seconds);
                // Every pattern reads every word: a pattern that skipped some would
                // report a rate it did not reach.
                assert_eq!(sum, expected, "the {pattern} probe read the whole buffer");
            }
            PatternRate {
                pattern,
                gbps: bytes as f64 / median(times) / 1e9,
            }
        })
        .collect();
    let probe = ReadProbe { patterns: rates };
    let best = probe.best().pattern;
    let read = patterns
        .iter()
        .find(|(name, _)| *name == best)
        .map_or(patterns[0].1, |&(_, read)| read);
    let reread = Reread {
        words,
        expected,
        read,
        pattern: best,
    };
    (probe, reread)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each pattern reads exactly the buffer (the probe asserts it), whatever its length,
    /// and the best is the largest figure.
    #[test]
    fn every_pattern_reads_the_whole_buffer() {
        for words in [0usize, 1, 7, 8, 33, 4 * PIECE + 13, 9 * PIECE + 3] {
            let data: Vec<u64> = (0..words as u64).map(|i| i * 2_654_435_761).collect();
            let expected = fold(&data);
            assert_eq!(all_threads(&data), expected, "{words}");
            assert_eq!(four_streams(&data), expected, "{words}");
            assert_eq!(eight_streams_prefetched(&data), expected, "{words}");
            assert_eq!(all_threads_streaming(&data), expected, "{words}");
            assert_eq!(eight_streams(&data), expected, "{words}");
            // Unaligned starts too.
            if words > 3 {
                assert_eq!(fold_streaming(&data[1..]), fold(&data[1..]));
            }
        }
        let probe = measure(1 << 20, 1);
        assert!(probe.patterns.len() >= 4);
        let best = probe.best();
        assert!(probe.patterns.iter().all(|p| p.gbps <= best.gbps));
    }
}
