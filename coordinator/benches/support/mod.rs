//! What the coordinator's load benches share: order statistics, a process's memory as
//! Linux reports it, and the durable-write baseline that uploads are compared with.
// Each bench includes this module and uses only part of it.
#![allow(dead_code)]

use std::path::Path;
use std::time::Instant;

/// The value after `name` on the bench's command line (`-- --mb 400`), if given.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// The `q` quantile of sorted values (nearest rank); NaN for none.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// The median (the mean of the middle two for an even count); NaN for none.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A `/proc/<pid>/status` field in MiB (`VmRSS:`, `VmHWM:`); NaN when unreadable.
pub fn status_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// Durable writes of `bytes` per second in `dir`: the steps of a blob put (write, fsync,
/// rename, directory fsync), the floor under an acknowledged upload.
pub fn durable_write_rate(dir: &Path, bytes: usize, count: usize) -> f64 {
    use std::io::Write;
    std::fs::create_dir_all(dir).unwrap();
    let data = vec![7u8; bytes];
    let start = Instant::now();
    for i in 0..count {
        let tmp = dir.join(format!("{i}.tmp"));
        let mut f = std::fs::File::create(&tmp).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
        std::fs::rename(&tmp, dir.join(format!("{i}.bin"))).unwrap();
        std::fs::File::open(dir).unwrap().sync_all().unwrap();
    }
    let rate = count as f64 / start.elapsed().as_secs_f64();
    std::fs::remove_dir_all(dir).unwrap();
    rate
}
