//! The open-file limit. Every client connection holds one file descriptor for as long as
//! it is open, and an edge client holds its connection through a check-in long poll, so
//! the number of clients a coordinator can hold at once is about its `RLIMIT_NOFILE`.
//! Linux starts processes with a soft limit of 1,024 whatever the hard limit allows;
//! `cohort serve` raises the soft limit to the hard one at start-up, as a process may
//! without privileges. Raising the hard limit is the operator's (`LimitNOFILE=` in a
//! systemd unit, `--ulimit nofile=` for Docker, `ulimit -Hn` in a shell).

/// Client connections the coordinator is sized for; below this many descriptors it
/// warns at start-up.
pub const WANTED_DESCRIPTORS: u64 = 10_240;

/// The open-file limit before and after [`raise`]; `None` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdLimit {
    /// The soft limit the process started with.
    pub before: Option<u64>,
    /// The soft limit now: what `open` and `accept` are held to.
    pub soft: Option<u64>,
    /// The hard limit, the most the soft limit can be raised to without privileges.
    pub hard: Option<u64>,
}

impl FdLimit {
    /// Whether the soft limit allows at least `n` descriptors.
    pub fn allows(&self, n: u64) -> bool {
        self.soft.is_none_or(|soft| soft >= n)
    }
}

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit. On failure (a
/// platform whose hard limit the kernel does not accept as a soft one) the limit is
/// left as it was, and the error says why.
#[cfg(unix)]
pub fn raise() -> std::io::Result<FdLimit> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let start = getrlimit(Resource::Nofile);
    if start.current != start.maximum {
        setrlimit(
            Resource::Nofile,
            rustix::process::Rlimit {
                current: start.maximum,
                maximum: start.maximum,
            },
        )?;
    }
    let now = getrlimit(Resource::Nofile);
    Ok(FdLimit {
        before: start.current,
        soft: now.current,
        hard: now.maximum,
    })
}

/// Not Unix: there is no such limit to raise.
#[cfg(not(unix))]
pub fn raise() -> std::io::Result<FdLimit> {
    Ok(FdLimit {
        before: None,
        soft: None,
        hard: None,
    })
}

/// [`raise`], then logs the limit at info, and warns when it leaves fewer than
/// [`WANTED_DESCRIPTORS`]: past the limit, new connections wait in the listen queue
/// until a descriptor is free.
pub fn raise_and_log() {
    let show = |v: Option<u64>| v.map_or_else(|| "unlimited".to_string(), |v| v.to_string());
    match raise() {
        Ok(limit) => {
            tracing::info!(
                soft = %show(limit.soft),
                hard = %show(limit.hard),
                started_at = %show(limit.before),
                "open file limit (each client connection holds one)"
            );
            if !limit.allows(WANTED_DESCRIPTORS) {
                tracing::warn!(
                    limit = %show(limit.soft),
                    wanted = WANTED_DESCRIPTORS,
                    "the open file limit caps client connections held at once; raise the hard \
                     limit (LimitNOFILE= in a systemd unit, --ulimit nofile= for Docker)"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not raise the open file limit"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn soft_limit_reaches_the_hard_limit_and_stays_there() {
        let first = raise().unwrap();
        assert_eq!(first.soft, first.hard);
        let again = raise().unwrap();
        assert_eq!(again.before, first.soft, "a second raise changes nothing");
        assert_eq!(again.soft, first.soft);
    }

    #[test]
    fn unlimited_allows_anything() {
        let unlimited = FdLimit {
            before: Some(1024),
            soft: None,
            hard: None,
        };
        assert!(unlimited.allows(u64::MAX));
        let small = FdLimit {
            soft: Some(1024),
            hard: Some(1024),
            ..unlimited
        };
        assert!(small.allows(1024) && !small.allows(1025));
    }
}
