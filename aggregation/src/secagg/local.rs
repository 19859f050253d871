//! An in-process transport: one secure round with every client in this process, for
//! simulation, benchmarks and tests. Messages go through the very same state machines
//! (and the same JSON encoding for the byte counts) as over HTTP.

use std::collections::BTreeMap;
use std::time::Instant;

use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;
use rayon::prelude::*;

use super::identity::Identity;
use super::messages::{RoundConfig, UnmaskRequest};
use super::{ClientSession, SecAggError, ServerSession, Stage, Unmasked};

/// What one client contributes when it reaches stage 3.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientInput {
    /// A float update, its weight (sample count) and training loss, quantised by the
    /// client.
    Update {
        /// The update, `d` values.
        values: Vec<f32>,
        /// Sample count.
        weight: u64,
        /// Mean training loss.
        loss: f64,
    },
    /// A vector already quantised with the round's quantiser (`d + 2` words).
    Quantized(Vec<u32>),
}

/// Seconds spent by each party in each stage.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    /// Per client: key generation and signing (stage 1).
    pub client_advertise: Vec<f64>,
    /// Per client: checking the roster and revealing the graph nonce.
    pub client_reveal: Vec<f64>,
    /// Per client: secret sharing and encryption (stage 2).
    pub client_share: Vec<f64>,
    /// Per client: decryption, quantisation and masking (stage 3), without obtaining
    /// the input.
    pub client_mask: Vec<f64>,
    /// Per client: checking and signing the survivor list (consistency check).
    pub client_confirm: Vec<f64>,
    /// Per client: checking the neighbours' signatures and revealing shares.
    pub client_unmask: Vec<f64>,
    /// Server: accepting and checking signed keys.
    pub server_advertise: f64,
    /// Server: accepting graph nonces and drawing the graph.
    pub server_reveal: f64,
    /// Server: accepting and routing shares.
    pub server_share: f64,
    /// Server: folding the masked inputs.
    pub server_collect: f64,
    /// Server: accepting and checking signatures over the survivor list.
    pub server_confirm: f64,
    /// Server: accepting revealed shares, rebuilding secrets, removing masks, decoding.
    pub server_unmask: f64,
    /// The whole round, wall clock.
    pub round: f64,
}

/// What a local round produced.
#[derive(Debug)]
pub struct LocalRound {
    /// The unmasked result, or why the round failed.
    pub result: Result<Unmasked, SecAggError>,
    /// Where the time went.
    pub timings: Timings,
    /// Bytes each client sent, by index: its messages' JSON and its masked input's
    /// bytes, as they travel over HTTP.
    pub bytes_sent: BTreeMap<u32, usize>,
    /// Clients that refused to go on, and why (for example too few neighbours left).
    pub aborted: BTreeMap<u32, SecAggError>,
}

fn json_len<T: serde::Serialize>(value: &T) -> usize {
    serde_json::to_vec(value).map_or(0, |v| v.len())
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed().as_secs_f64())
}

type Clients = BTreeMap<u32, (ClientSession, ChaCha20Rng)>;

/// Each client's message of one stage, with the seconds it took, computed on every core
/// with `parallel`.
fn answers<M: Send>(
    clients: &mut Clients,
    parallel: bool,
    make: impl Fn(u32, &mut ClientSession, &mut ChaCha20Rng) -> Result<M, SecAggError> + Sync,
) -> Vec<(u32, Result<M, SecAggError>, f64)> {
    let answer = |(&u, (session, rng)): (&u32, &mut (ClientSession, ChaCha20Rng))| {
        let (r, secs) = timed(|| make(u, session, rng));
        (u, r, secs)
    };
    if parallel {
        clients.par_iter_mut().map(answer).collect()
    } else {
        clients.iter_mut().map(answer).collect()
    }
}

/// Hands the clients' messages to the server: a client that refused to answer leaves
/// the round; a message the server refuses ends it (`Err`). Returns the server's seconds.
fn deliver<M: serde::Serialize>(
    answered: Vec<(u32, Result<M, SecAggError>, f64)>,
    mut receive: impl FnMut(u32, &M) -> Result<(), SecAggError>,
    clients: &mut Clients,
    client_times: &mut Vec<f64>,
    bytes: &mut BTreeMap<u32, usize>,
    aborted: &mut BTreeMap<u32, SecAggError>,
) -> Result<f64, SecAggError> {
    let mut server_time = 0.0;
    for (u, r, secs) in answered {
        client_times.push(secs);
        match r {
            Ok(message) => {
                *bytes.entry(u).or_default() += json_len(&message);
                let (r, secs) = timed(|| receive(u, &message));
                server_time += secs;
                r?;
            }
            Err(e) => {
                aborted.insert(u, e);
                clients.remove(&u);
            }
        }
    }
    Ok(server_time)
}

/// [`deliver`] for a stage whose messages the server takes all at once (`receive_all`,
/// in the clients' order): a client that refused to answer leaves the round; a message
/// the server refuses ends it. Returns the server's seconds.
fn deliver_all<M: serde::Serialize>(
    answered: Vec<(u32, Result<M, SecAggError>, f64)>,
    receive_all: impl FnOnce(&[(u32, &M)]) -> Result<(), SecAggError>,
    clients: &mut Clients,
    client_times: &mut Vec<f64>,
    bytes: &mut BTreeMap<u32, usize>,
    aborted: &mut BTreeMap<u32, SecAggError>,
) -> Result<f64, SecAggError> {
    let mut messages = Vec::with_capacity(answered.len());
    for (u, r, secs) in answered {
        client_times.push(secs);
        match r {
            Ok(message) => {
                *bytes.entry(u).or_default() += json_len(&message);
                messages.push((u, message));
            }
            Err(e) => {
                aborted.insert(u, e);
                clients.remove(&u);
            }
        }
    }
    let refs: Vec<(u32, &M)> = messages.iter().map(|(u, m)| (*u, m)).collect();
    let (r, secs) = timed(|| receive_all(&refs));
    r.map(|()| secs)
}

/// Runs one round among clients `1..=config.parties`. A client in `drop_at` stops
/// answering at that stage (it sends nothing from that stage on). Randomness for client
/// `i`, its identity included, comes from a ChaCha20 stream of `seed` and `i`, so a
/// round is reproducible whatever the thread timing. `input(i)` is called once per client that reaches stage
/// 3; with `parallel`, clients work concurrently in each stage.
pub fn run_round<F>(
    config: &RoundConfig,
    seed: [u8; 32],
    drop_at: &BTreeMap<u32, Stage>,
    parallel: bool,
    input: F,
) -> LocalRound
where
    F: Fn(u32) -> ClientInput + Sync,
{
    run_round_on(crate::reduce::cpu(), config, seed, drop_at, parallel, input)
}

/// [`run_round`] with the server's mask removal on `reducer`.
pub fn run_round_on<F>(
    reducer: std::sync::Arc<dyn crate::reduce::Reducer>,
    config: &RoundConfig,
    seed: [u8; 32],
    drop_at: &BTreeMap<u32, Stage>,
    parallel: bool,
    input: F,
) -> LocalRound
where
    F: Fn(u32) -> ClientInput + Sync,
{
    let started = Instant::now();
    let mut timings = Timings::default();
    let mut bytes: BTreeMap<u32, usize> = BTreeMap::new();
    let mut aborted = BTreeMap::new();
    let present = |u: u32, stage: Stage| drop_at.get(&u).is_none_or(|&d| d > stage);
    let rng_for = |u: u32| {
        let mut s = seed;
        for (b, x) in s.iter_mut().zip(u.to_le_bytes()) {
            *b ^= x;
        }
        s[31] ^= 0xa5;
        ChaCha20Rng::from_seed(s)
    };
    let finish = |result, timings: Timings, bytes, aborted| LocalRound {
        result,
        timings,
        bytes_sent: bytes,
        aborted,
    };
    let mut server = match ServerSession::new(config.clone()) {
        Ok(s) => s,
        Err(e) => return finish(Err(e), timings, bytes, aborted),
    };
    server.set_reducer(reducer);

    // Stage 1.
    let indices: Vec<u32> = (1..=config.parties).collect();
    let advertise = |&u: &u32| {
        let mut rng = rng_for(u);
        let identity = Identity::from_rng(&mut rng);
        // The coordinator is this program: the floors that guard a client against one
        // that cheats (the consistency check among them) are the caller's choice, made
        // in the round's settings.
        let floors = super::ClientFloors {
            require_consistency_check: false,
            ..super::ClientFloors::default()
        };
        let (made, secs) =
            timed(|| ClientSession::with_floors(config.clone(), u, floors, &identity, &mut rng));
        (u, made, rng, identity, secs)
    };
    let joined: Vec<_> = if parallel {
        indices.par_iter().map(advertise).collect()
    } else {
        indices.iter().map(advertise).collect()
    };
    let mut clients: Clients = BTreeMap::new();
    let mut identities: BTreeMap<u32, Identity> = BTreeMap::new();
    let mut server_time = 0.0;
    for (u, made, rng, identity, secs) in joined {
        timings.client_advertise.push(secs);
        let (session, keys) = match made {
            Ok(m) => m,
            Err(e) => return finish(Err(e), timings, bytes, aborted),
        };
        if !present(u, Stage::Advertise) {
            continue;
        }
        *bytes.entry(u).or_default() += json_len(&keys);
        let (r, secs) = timed(|| server.receive_keys(u, &keys, &identity.public()));
        server_time += secs;
        if let Err(e) = r {
            return finish(Err(e), timings, bytes, aborted);
        }
        clients.insert(u, (session, rng));
        identities.insert(u, identity);
    }
    let (roster, secs) = timed(|| server.close_advertise());
    timings.server_advertise = server_time + secs;
    let roster = match roster {
        Ok(r) => r,
        Err(e) => return finish(Err(e), timings, bytes, aborted),
    };

    // Graph nonces: revealed only once every commitment is fixed.
    clients.retain(|&u, _| present(u, Stage::Reveal));
    let revealed = answers(&mut clients, parallel, |_, session, _| {
        session.reveal(&roster)
    });
    let server_time = match deliver(
        revealed,
        |u, m| server.receive_reveal(u, m),
        &mut clients,
        &mut timings.client_reveal,
        &mut bytes,
        &mut aborted,
    ) {
        Ok(secs) => secs,
        Err(e) => return finish(Err(e), timings, bytes, aborted),
    };
    let (closed, secs) = timed(|| server.close_reveal());
    timings.server_reveal = server_time + secs;
    if let Err(e) = closed {
        return finish(Err(e), timings, bytes, aborted);
    }
    let server_ref = &server;

    // Stage 2.
    clients.retain(|&u, _| present(u, Stage::Share));
    let shared = answers(&mut clients, parallel, |u, session, rng| {
        // Each client gets its own neighbourhood's keys, as over HTTP.
        let directory = server_ref
            .directory_for(u)
            .expect("every member of U1 has a directory");
        session.share_keys(&directory, rng)
    });
    let server_time = match deliver(
        shared,
        |u, m| server.receive_shares(u, m),
        &mut clients,
        &mut timings.client_share,
        &mut bytes,
        &mut aborted,
    ) {
        Ok(secs) => secs,
        Err(e) => return finish(Err(e), timings, bytes, aborted),
    };
    let (closed, secs) = timed(|| server.close_sharing());
    timings.server_share = server_time + secs;
    if let Err(e) = closed {
        return finish(Err(e), timings, bytes, aborted);
    }

    // Stage 3: inputs are folded as they come, so only one masked vector per worker is
    // alive at a time.
    clients.retain(|&u, _| present(u, Stage::Masked));
    let server_cell = std::sync::Mutex::new((&mut server, 0.0f64));
    let mask = |(&u, (session, rng)): (&u32, &mut (ClientSession, ChaCha20Rng))| {
        let forwarded = server_cell
            .lock()
            .expect("no panics while held")
            .0
            .forwarded_for(u);
        let forwarded = match forwarded {
            Ok(f) => f,
            Err(e) => return (u, Err(e), 0.0, 0),
        };
        let value = input(u);
        let (masked, secs) = timed(|| match value {
            ClientInput::Update {
                values,
                weight,
                loss,
            } => session.mask(&forwarded, &values, weight, loss, rng),
            ClientInput::Quantized(words) => session.mask_quantized(&forwarded, words),
        });
        match masked {
            Ok(words) => {
                let sent = words.len() * 4;
                let mut guard = server_cell.lock().expect("no panics while held");
                let (r, s) = timed(|| guard.0.receive_masked(u, &words));
                guard.1 += s;
                (u, r, secs, sent)
            }
            Err(e) => (u, Err(e), secs, 0),
        }
    };
    let masked: Vec<_> = if parallel {
        clients.par_iter_mut().map(mask).collect()
    } else {
        clients.iter_mut().map(mask).collect()
    };
    let (_, collect_time) = server_cell.into_inner().expect("no panics while held");
    for (u, r, secs, sent) in masked {
        timings.client_mask.push(secs);
        *bytes.entry(u).or_default() += sent;
        if let Err(e) = r {
            aborted.insert(u, e);
            clients.remove(&u);
        }
    }
    let (request, secs) = timed(|| server.close_collection());
    timings.server_collect = collect_time + secs;
    let request: UnmaskRequest = match request {
        Ok(r) => r,
        Err(e) => return finish(Err(e), timings, bytes, aborted),
    };

    // The consistency check: each survivor signs the list it was sent.
    if config.consistency_check {
        clients.retain(|&u, _| present(u, Stage::Confirm));
        let identities = &identities;
        let confirmed = answers(&mut clients, parallel, |u, session, _| {
            session.confirm(&request, &identities[&u])
        });
        let server_time = match deliver(
            confirmed,
            |u, m| server.receive_confirmation(u, m),
            &mut clients,
            &mut timings.client_confirm,
            &mut bytes,
            &mut aborted,
        ) {
            Ok(secs) => secs,
            Err(e) => return finish(Err(e), timings, bytes, aborted),
        };
        let (closed, secs) = timed(|| server.close_confirm());
        timings.server_confirm = server_time + secs;
        if let Err(e) = closed {
            return finish(Err(e), timings, bytes, aborted);
        }
    }

    // Unmasking: each survivor gets the list with its neighbours' signatures.
    clients.retain(|&u, _| present(u, Stage::Unmask));
    let server_ref = &server;
    let revealed = answers(&mut clients, parallel, |u, session, _| {
        let request = server_ref
            .unmask_request_for(u)
            .unwrap_or_else(|| request.clone());
        session.unmask(&request)
    });
    let server_time = match deliver_all(
        revealed,
        |replies| server.receive_unmasks(replies),
        &mut clients,
        &mut timings.client_unmask,
        &mut bytes,
        &mut aborted,
    ) {
        Ok(secs) => secs,
        Err(e) => return finish(Err(e), timings, bytes, aborted),
    };
    let (result, secs) = timed(|| server.finish());
    timings.server_unmask = server_time + secs;
    timings.round = started.elapsed().as_secs_f64();
    finish(result, timings, bytes, aborted)
}
