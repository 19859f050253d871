//! Rate limits on what a stranger or a misbehaving device can hammer: enrolment per
//! address; uploads per client and per address; a client's other messages (secure
//! aggregation, evaluation and failure reports) per client; failed authentications
//! (bearer tokens, client credentials, dashboard sign-ins) per address, and failed
//! sign-ins per account. Token buckets, one per key, in this replica's memory: each
//! replica enforces its own share, which bounds what one caller can cost it.
//!
//! Addresses are limited on failures only: many honest devices may share one address
//! (a NAT, the test suites' 127.0.0.1), and what they send with valid credentials is
//! limited per client instead.
//!
//! The number of buckets is bounded: when the table is full, buckets that have filled up
//! again (their caller has been quiet) are dropped; if none has, a new key is refused
//! until one does, so that a flood of fresh addresses cannot grow memory without bound.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::Instant;

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use uuid::Uuid;

use super::error::ApiError;

/// Most keys one limiter tracks.
pub const MAX_KEYS: usize = 100_000;

/// Requests per minute allowed to one key; all of them may come at once. Zero turns the
/// limit off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerMinute(pub u32);

/// One caller's bucket.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Token buckets keyed by `K`.
#[derive(Debug)]
pub struct KeyedLimiter<K> {
    rate: PerMinute,
    max_keys: usize,
    buckets: Mutex<HashMap<K, Bucket>>,
}

impl<K: Eq + Hash + Copy> KeyedLimiter<K> {
    /// A limiter at `rate`, tracking at most `max_keys` keys.
    pub fn new(rate: PerMinute, max_keys: usize) -> Self {
        Self {
            rate,
            max_keys: max_keys.max(1),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one request of `key` at `now`: `Ok`, or `Err(seconds)` until it would be
    /// taken.
    pub fn check(&self, key: K, now: Instant) -> Result<(), u64> {
        let PerMinute(per_minute) = self.rate;
        if per_minute == 0 {
            return Ok(());
        }
        let capacity = f64::from(per_minute);
        let per_second = capacity / 60.0;
        let refill = |b: &Bucket| {
            let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
            (b.tokens + elapsed * per_second).min(capacity)
        };
        // A poisoned lock only means another request panicked mid-update; the counts are
        // still usable.
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if !buckets.contains_key(&key) && buckets.len() >= self.max_keys {
            buckets.retain(|_, b| refill(b) < capacity);
            if buckets.len() >= self.max_keys {
                return Err(60);
            }
        }
        let bucket = buckets.entry(key).or_insert(Bucket {
            tokens: capacity,
            at: now,
        });
        let tokens = refill(bucket);
        if tokens >= 1.0 {
            *bucket = Bucket {
                tokens: tokens - 1.0,
                at: now,
            };
            Ok(())
        } else {
            *bucket = Bucket { tokens, at: now };
            Err(((1.0 - tokens) / per_second).ceil().max(1.0) as u64)
        }
    }

    /// Whether `key` has a request left at `now`, without taking it: `Ok`, or
    /// `Err(seconds)` until it has. A key not tracked has its whole burst left.
    pub fn peek(&self, key: K, now: Instant) -> Result<(), u64> {
        let PerMinute(per_minute) = self.rate;
        if per_minute == 0 {
            return Ok(());
        }
        let capacity = f64::from(per_minute);
        let per_second = capacity / 60.0;
        let buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let Some(bucket) = buckets.get(&key) else {
            return Ok(());
        };
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        let tokens = (bucket.tokens + elapsed * per_second).min(capacity);
        if tokens >= 1.0 {
            Ok(())
        } else {
            Err(((1.0 - tokens) / per_second).ceil().max(1.0) as u64)
        }
    }

    /// Keys tracked now.
    pub fn len(&self) -> usize {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True when no key is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The limits `cohort serve` applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateSettings {
    /// Enrolments per minute from one address.
    pub enrol_per_address: PerMinute,
    /// Model update uploads per minute from one client.
    pub uploads_per_client: PerMinute,
    /// Uploads per minute from one address, all its clients together.
    pub uploads_per_address: PerMinute,
    /// A client's other messages per minute: secure-aggregation keys, shares and unmask
    /// answers, evaluation reports and failure reports.
    pub messages_per_client: PerMinute,
    /// Failed authentications per minute from one address: wrong bearer tokens (admin or
    /// client credentials) and failed dashboard sign-ins together. Past it, the address's
    /// requests are refused before their credentials are even looked at.
    pub auth_failures_per_address: PerMinute,
    /// Failed dashboard sign-ins per minute for one account (there is one, the admin),
    /// from every address together: what a guesser with many addresses gets.
    pub sign_in_failures_per_account: PerMinute,
}

impl Default for RateSettings {
    /// Generous for real fleets: a site re-enrolling devices, a client retrying an
    /// upload, a hospital's many devices behind one NAT. A secure round is four messages
    /// per client; an honest caller fails to authenticate only when misconfigured.
    fn default() -> Self {
        Self {
            enrol_per_address: PerMinute(600),
            uploads_per_client: PerMinute(120),
            uploads_per_address: PerMinute(60_000),
            messages_per_client: PerMinute(600),
            auth_failures_per_address: PerMinute(120),
            sign_in_failures_per_account: PerMinute(600),
        }
    }
}

/// The dashboard's one account: it signs in with the admin token and has no name to
/// type, so its failures are counted under this one.
pub const ADMIN_ACCOUNT: &str = "admin";

/// The account every person's dashboard sign-in failures count against together (a
/// person's token is as unguessable as the admin token; this bounds the guessing all
/// the same).
pub const PEOPLE_ACCOUNT: &str = "people";

/// This replica's limiters.
#[derive(Debug)]
pub struct RateLimits {
    enrol_per_address: KeyedLimiter<IpAddr>,
    uploads_per_client: KeyedLimiter<Uuid>,
    uploads_per_address: KeyedLimiter<IpAddr>,
    messages_per_client: KeyedLimiter<Uuid>,
    auth_failures_per_address: KeyedLimiter<IpAddr>,
    sign_in_failures_per_account: KeyedLimiter<&'static str>,
}

impl RateLimits {
    /// Limiters for `settings`.
    pub fn new(settings: RateSettings) -> Self {
        Self {
            enrol_per_address: KeyedLimiter::new(settings.enrol_per_address, MAX_KEYS),
            uploads_per_client: KeyedLimiter::new(settings.uploads_per_client, MAX_KEYS),
            uploads_per_address: KeyedLimiter::new(settings.uploads_per_address, MAX_KEYS),
            messages_per_client: KeyedLimiter::new(settings.messages_per_client, MAX_KEYS),
            auth_failures_per_address: KeyedLimiter::new(
                settings.auth_failures_per_address,
                MAX_KEYS,
            ),
            sign_in_failures_per_account: KeyedLimiter::new(
                settings.sign_in_failures_per_account,
                MAX_KEYS,
            ),
        }
    }

    /// A secure-aggregation message, evaluation report or failure report by `client`.
    pub fn message(&self, client: Uuid) -> Result<(), ApiError> {
        self.messages_per_client
            .check(client, Instant::now())
            .map_err(|seconds| limited("messages from this client", seconds))
    }

    /// Refuses `peer` while its failed authentications are past the limit; called
    /// before a credential is checked, so that a guesser learns nothing more.
    pub fn authentication_allowed(&self, peer: Option<IpAddr>) -> Result<(), ApiError> {
        match peer {
            Some(ip) => self
                .auth_failures_per_address
                .peek(ip, Instant::now())
                .map_err(|seconds| limited("failed authentications from this address", seconds)),
            None => Ok(()),
        }
    }

    /// Counts a credential from `peer` that was presented and refused.
    pub fn authentication_failed(&self, peer: Option<IpAddr>) {
        if let Some(ip) = peer {
            // Past the limit already: the next request is refused by
            // `authentication_allowed` anyway.
            let _ = self.auth_failures_per_address.check(ip, Instant::now());
        }
    }

    /// Refuses a dashboard sign-in to `account` from `peer` while either has failed too
    /// often; called before the token is checked.
    pub fn sign_in_allowed(
        &self,
        peer: Option<IpAddr>,
        account: &'static str,
    ) -> Result<(), ApiError> {
        self.authentication_allowed(peer)?;
        self.sign_in_failures_per_account
            .peek(account, Instant::now())
            .map_err(|seconds| limited("failed sign-ins to this account", seconds))
    }

    /// Counts a failed dashboard sign-in to `account` from `peer`.
    pub fn sign_in_failed(&self, peer: Option<IpAddr>, account: &'static str) {
        self.authentication_failed(peer);
        let _ = self
            .sign_in_failures_per_account
            .check(account, Instant::now());
    }

    /// An enrolment from `peer` (unknown in tests that call the router directly: not
    /// limited by address).
    pub fn enrolment(&self, peer: Option<IpAddr>) -> Result<(), ApiError> {
        if let Some(ip) = peer {
            self.enrol_per_address
                .check(ip, Instant::now())
                .map_err(|seconds| limited("enrolments from this address", seconds))?;
        }
        Ok(())
    }

    /// An upload by `client` from `peer`.
    pub fn upload(&self, client: Uuid, peer: Option<IpAddr>) -> Result<(), ApiError> {
        let now = Instant::now();
        self.uploads_per_client
            .check(client, now)
            .map_err(|seconds| limited("uploads from this client", seconds))?;
        if let Some(ip) = peer {
            self.uploads_per_address
                .check(ip, now)
                .map_err(|seconds| limited("uploads from this address", seconds))?;
        }
        Ok(())
    }
}

fn limited(what: &str, seconds: u64) -> ApiError {
    ApiError::TooManyRequests {
        message: format!("too many {what}: retry in {seconds} s"),
        retry_after_seconds: seconds,
    }
}

/// The address the request came from, when the server records it (it does when
/// serving; a router called directly in a test has none). Behind a trusted proxy
/// (`--trusted-proxies`), the address that proxy names in `X-Forwarded-For`.
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub Option<IpAddr>);

impl FromRequestParts<super::AppState> for PeerAddr {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &super::AppState,
    ) -> Result<Self, Self::Rejection> {
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip());
        Ok(PeerAddr(peer.map(|ip| {
            client_address(ip, &parts.headers, &state.settings.trusted_proxies)
        })))
    }
}

/// The client's address: `peer` itself, unless `peer` is a trusted proxy; then the
/// right-most address of `X-Forwarded-For` that is not a trusted proxy (the entries to
/// its left were written by the client and prove nothing). A header that does not parse
/// leaves the proxy's own address.
pub fn client_address(peer: IpAddr, headers: &axum::http::HeaderMap, trusted: &[IpAddr]) -> IpAddr {
    if !trusted.contains(&peer) {
        return peer;
    }
    let mut hops: Vec<IpAddr> = Vec::new();
    for value in headers.get_all("x-forwarded-for") {
        let Ok(text) = value.to_str() else {
            return peer;
        };
        for hop in text.split(',') {
            match hop.trim().parse() {
                Ok(ip) => hops.push(ip),
                Err(_) => return peer,
            }
        }
    }
    hops.into_iter()
        .rev()
        .find(|ip| !trusted.contains(ip))
        .unwrap_or(peer)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::*;

    /// A full minute's worth may come at once; then one more per 60/N seconds.
    #[test]
    fn a_burst_then_the_steady_rate() {
        let limiter = KeyedLimiter::new(PerMinute(6), 10);
        let t0 = Instant::now();
        for _ in 0..6 {
            assert_eq!(limiter.check(1, t0), Ok(()));
        }
        assert_eq!(limiter.check(1, t0), Err(10));
        // Another key has its own bucket.
        assert_eq!(limiter.check(2, t0), Ok(()));
        assert_eq!(limiter.check(1, t0 + Duration::from_secs(9)), Err(1));
        assert_eq!(limiter.check(1, t0 + Duration::from_secs(10)), Ok(()));
        assert!(limiter.check(1, t0 + Duration::from_secs(10)).is_err());
    }

    /// Only a trusted proxy may name another address, and only its own hop counts:
    /// what a client writes into the header itself is ignored.
    #[test]
    fn forwarded_addresses_are_believed_only_from_trusted_proxies() {
        let proxy: IpAddr = "10.0.0.2".parse().unwrap();
        let client: IpAddr = "203.0.113.7".parse().unwrap();
        let mut headers = axum::http::HeaderMap::new();
        headers.insert("x-forwarded-for", "1.2.3.4, 203.0.113.7".parse().unwrap());
        assert_eq!(client_address(proxy, &headers, &[proxy]), client);
        assert_eq!(client_address(client, &headers, &[proxy]), client);
        let stranger: IpAddr = "198.51.100.1".parse().unwrap();
        assert_eq!(client_address(stranger, &headers, &[proxy]), stranger);
        headers.insert("x-forwarded-for", "not an address".parse().unwrap());
        assert_eq!(client_address(proxy, &headers, &[proxy]), proxy);
        let empty = axum::http::HeaderMap::new();
        assert_eq!(client_address(proxy, &empty, &[proxy]), proxy);
    }

    /// Peeking takes nothing: a key is refused only once `check` has used its burst,
    /// and is told how long until a request is taken again.
    #[test]
    fn peeking_takes_nothing() {
        let limiter = KeyedLimiter::new(PerMinute(2), 10);
        let t0 = Instant::now();
        for _ in 0..5 {
            assert_eq!(limiter.peek(1, t0), Ok(()));
        }
        assert!(limiter.is_empty(), "peeking tracks nothing new");
        assert_eq!(limiter.check(1, t0), Ok(()));
        assert_eq!(limiter.check(1, t0), Ok(()));
        assert_eq!(limiter.peek(1, t0), Err(30));
        assert_eq!(limiter.peek(1, t0 + Duration::from_secs(30)), Ok(()));
        assert_eq!(limiter.peek(2, t0), Ok(()), "another key is not affected");
    }

    /// Failed sign-ins count against the address and the account; the address's share
    /// is the one its failed bearer tokens use too.
    #[test]
    fn sign_in_failures_count_per_address_and_per_account() {
        let limits = RateLimits::new(RateSettings {
            auth_failures_per_address: PerMinute(2),
            sign_in_failures_per_account: PerMinute(3),
            ..RateSettings::default()
        });
        let a: IpAddr = "203.0.113.7".parse().unwrap();
        let b: IpAddr = "198.51.100.1".parse().unwrap();
        limits.authentication_failed(Some(a));
        limits.sign_in_failed(Some(a), ADMIN_ACCOUNT);
        assert!(limits.sign_in_allowed(Some(a), ADMIN_ACCOUNT).is_err());
        assert!(limits.authentication_allowed(Some(a)).is_err());
        assert!(limits.sign_in_allowed(Some(b), ADMIN_ACCOUNT).is_ok());
        limits.sign_in_failed(Some(b), ADMIN_ACCOUNT);
        limits.sign_in_failed(None, ADMIN_ACCOUNT);
        assert!(limits.authentication_allowed(Some(b)).is_ok());
        let refused = limits.sign_in_allowed(Some(b), ADMIN_ACCOUNT).unwrap_err();
        assert!(matches!(
            refused,
            ApiError::TooManyRequests {
                retry_after_seconds: 1..,
                ..
            }
        ));
    }

    #[test]
    fn zero_turns_the_limit_off() {
        let limiter = KeyedLimiter::new(PerMinute(0), 1);
        let t0 = Instant::now();
        for key in 0..1000 {
            assert_eq!(limiter.check(key, t0), Ok(()));
        }
        assert!(limiter.is_empty(), "nothing is tracked when off");
    }

    /// The table never holds more than its bound: quiet callers make room, and while
    /// every tracked caller is active a new one waits.
    #[test]
    fn the_table_is_bounded() {
        let limiter = KeyedLimiter::new(PerMinute(60), 3);
        let t0 = Instant::now();
        for key in 0..3 {
            assert_eq!(limiter.check(key, t0), Ok(()));
        }
        assert_eq!(limiter.check(99, t0), Err(60), "all three are active");
        assert_eq!(limiter.len(), 3);
        // A second later each bucket has refilled: they are dropped for the newcomer.
        assert_eq!(limiter.check(99, t0 + Duration::from_secs(1)), Ok(()));
        assert!(limiter.len() <= 3);
    }

    proptest! {
        /// Over any window, a key gets at most the burst plus what refilled in it.
        #[test]
        fn never_more_than_burst_plus_refill(
            per_minute in 1u32..600,
            gaps_ms in proptest::collection::vec(0u64..2000, 1..300),
        ) {
            let limiter = KeyedLimiter::new(PerMinute(per_minute), 4);
            let t0 = Instant::now();
            let mut now = t0;
            let mut taken = 0u64;
            for gap in gaps_ms {
                now += Duration::from_millis(gap);
                if limiter.check(7u8, now).is_ok() {
                    taken += 1;
                }
            }
            let elapsed = now.duration_since(t0).as_secs_f64();
            let bound = f64::from(per_minute) * (1.0 + elapsed / 60.0);
            prop_assert!(taken as f64 <= bound + 1e-9, "{taken} > {bound}");
        }
    }
}
