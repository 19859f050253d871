//! The bodies of the fuzz targets: each takes untrusted bytes, runs one family of
//! `cohort-aggregation` decoders on them and checks what the decoders promise (no panic,
//! and whatever decodes re-encodes to the same thing).
//!
//! The libFuzzer binaries in `fuzz_targets/` are one line each around these functions,
//! and `aggregation/tests/fuzz_corpus.rs` includes this file to replay every committed
//! corpus input on stable Rust, so the two can never drift apart. Only crates that
//! `cohort-aggregation` itself depends on are used here, for that reason.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::sync::Arc;

use cohort_aggregation::model_file::{self, ModelFileError};
use cohort_aggregation::secagg::messages::{self, DirectoryEntry};
use cohort_aggregation::secagg::shamir::{SHARE_BYTES, Share};
use cohort_aggregation::secagg::{
    AdvertiseKeys, ClientSession, ForwardedShares, KeyDirectory, QuantizationParams, Quantizer,
    RoundConfig, SecAggError, ServerSession, ServerStage, ShareKeys, Stage, UnmaskRequest,
    UnmaskShares, Unmasked,
};
use cohort_aggregation::wire::{self, StreamCheck, WireError};
use cohort_aggregation::{Layout, TensorSpec};
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;
use serde::Serialize;
use serde::de::DeserializeOwned;

// ---------------------------------------------------------------------------------------
// wire_decode

/// Model-vector bodies (`wire::decode`, and `wire::StreamCheck` fed the same body in
/// pieces) against a few layouts.
///
/// Input: a layout description, then the body. The first byte's low two bits are the
/// number of tensors (0 to 3); each tensor is one byte whose low two bits are its rank (0
/// to 3), then one byte per dimension (0 to 15). One more byte seeds where the streaming
/// check cuts the body. The body is checked against that layout and against a flat
/// layout of exactly its length (so the value checks run whatever the layout bytes say).
pub fn wire_decode(data: &[u8]) {
    let mut at = 0;
    let mut next = || {
        let b = data.get(at).copied();
        at += 1;
        b.unwrap_or(0)
    };
    let count = usize::from(next() & 3);
    let mut specs = Vec::with_capacity(count);
    for i in 0..count {
        let rank = usize::from(next() & 3);
        let shape: Vec<usize> = (0..rank).map(|_| usize::from(next() & 15)).collect();
        specs.push(TensorSpec::new(format!("t{i}"), shape));
    }
    let cut_seed = next();
    let body = data.get(at..).unwrap_or(&[]);
    let described = Arc::new(Layout::new(specs).expect("distinct non-empty names"));
    check_wire(&described, body, cut_seed);
    check_wire(&Arc::new(Layout::flat(body.len() / 4)), body, cut_seed);
}

fn check_wire(layout: &Arc<Layout>, body: &[u8], cut_seed: u8) {
    let decoded = wire::decode(layout, body);
    let streamed = stream_check(layout.len(), body, cut_seed);
    // The streaming check accepts exactly the bodies decode accepts; when both find a
    // non-finite value, it is the same one.
    assert_eq!(
        decoded.is_ok(),
        streamed.is_ok(),
        "decode {decoded:?}, stream {streamed:?}"
    );
    if let (Err(WireError::NonFinite { index: a }), Err(WireError::NonFinite { index: b })) =
        (&decoded, &streamed)
    {
        assert_eq!(a, b);
    }
    match decoded {
        Ok(vector) => {
            assert_eq!(vector.layout(), layout);
            assert_eq!(vector.len(), layout.len());
            assert!(vector.is_finite());
            // Bit-exact: every accepted body is its vector's encoding.
            let again = wire::encode(&vector);
            assert_eq!(again, body);
            let back = wire::decode(layout, &again).expect("an encoded vector decodes");
            assert_eq!(back, vector);
        }
        Err(WireError::Ragged(n)) => assert!(n % 4 != 0 && n == body.len()),
        Err(WireError::WrongDimension { expected, found }) => {
            assert_eq!(expected, layout.len());
            assert_ne!(found, expected);
        }
        Err(WireError::NonFinite { index }) => {
            let b = &body[4 * index..4 * index + 4];
            assert!(!f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite());
        }
    }
}

/// Feeds `body` to a [`StreamCheck`] in pieces of 0 to 8 bytes chosen by `seed`.
fn stream_check(expected: usize, body: &[u8], seed: u8) -> Result<(), WireError> {
    let mut check = StreamCheck::new(expected);
    let mut state = u32::from(seed) | 0x100;
    let mut rest = body;
    while !rest.is_empty() {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let take = (state % 9) as usize;
        let (piece, tail) = rest.split_at(take.min(rest.len()));
        check.feed(piece)?;
        rest = tail;
    }
    check.finish()
}

// ---------------------------------------------------------------------------------------
// model_file_decode

/// The layout of the model-file unit tests: a small two-layer MLP.
fn mlp_layout() -> Arc<Layout> {
    Arc::new(
        Layout::new(vec![
            TensorSpec::new("fc1.weight", [3, 2]),
            TensorSpec::new("fc1.bias", [3]),
            TensorSpec::new("fc2.weight", [2, 3]),
        ])
        .expect("a valid layout"),
    )
}

/// Safetensors model files (`model_file::decode` and `decode_as`): the whole input is
/// the file. Whatever decodes must decode the same as its own layout, stay within the
/// size limit, and survive `model_file::encode` and a second decode unchanged.
pub fn model_file_decode(data: &[u8]) {
    let free = model_file::decode(data, usize::MAX);
    if !data.is_empty() {
        assert!(matches!(
            model_file::decode(data, data.len() - 1),
            Err(ModelFileError::TooLarge { .. })
        ));
    }
    let mlp = mlp_layout();
    let as_mlp = model_file::decode_as(&mlp, data, usize::MAX);
    if let Ok(v) = &as_mlp {
        assert_eq!(v.layout(), &mlp);
        assert!(v.is_finite());
        // A file that is exactly this model is also some model.
        assert!(
            free.is_ok(),
            "decode_as accepted what decode refused: {free:?}"
        );
    }
    let Ok(vector) = free else {
        return;
    };
    assert!(vector.is_finite());
    assert_eq!(vector.len(), vector.layout().len());
    assert!(!vector.layout().tensors().is_empty());
    let own = vector.layout().clone();
    let again = model_file::decode_as(&own, data, usize::MAX)
        .expect("a file decodes as the layout it decodes to");
    assert_eq!(again, vector);
    if let Ok(v) = as_mlp {
        // Same tensors, maybe another order: the values by name agree.
        for spec in mlp.tensors() {
            assert_eq!(v.tensor(&spec.name), vector.tensor(&spec.name));
        }
    }
    let encoded = model_file::encode(&vector, HashMap::from([("k".into(), "v".into())]));
    let limit = model_file::max_file_bytes(&own);
    assert!(
        encoded.len() <= limit,
        "the file we write ({} bytes) is over our own limit ({limit})",
        encoded.len()
    );
    let back = model_file::decode_as(&own, &encoded, limit).expect("our own file decodes");
    assert_eq!(back, vector);
}

// ---------------------------------------------------------------------------------------
// secagg_messages

/// Decodes `data` as a `T` from JSON; when it decodes, its JSON form must decode to the
/// same message and be stable.
fn json_round_trip<T>(data: &[u8]) -> Option<T>
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let message: T = serde_json::from_slice(data).ok()?;
    let json = serde_json::to_vec(&message).expect("a message serialises");
    let back: T = serde_json::from_slice(&json).expect("a serialised message decodes");
    assert_eq!(back, message);
    assert_eq!(serde_json::to_vec(&back).expect("serialises"), json);
    Some(message)
}

/// Checks one share's bytes: what parses is exactly its own encoding.
fn check_share(bytes: &[u8]) {
    if let Ok(share) = Share::from_bytes(bytes) {
        assert_eq!(bytes.len(), SHARE_BYTES);
        assert_ne!(share.holder, 0);
        assert_eq!(&share.to_bytes()[..], bytes);
    }
}

/// The secure-aggregation messages: the whole input is tried as the JSON of every message
/// kind (each must round-trip when it decodes, and a decoded round configuration is
/// validated), as a masked input (`messages::decode_words`), and as Shamir shares
/// (`Share::from_bytes`, on the whole input and on each 44-byte piece).
pub fn secagg_messages(data: &[u8]) {
    json_round_trip::<AdvertiseKeys>(data);
    json_round_trip::<DirectoryEntry>(data);
    json_round_trip::<KeyDirectory>(data);
    json_round_trip::<ShareKeys>(data);
    json_round_trip::<ForwardedShares>(data);
    json_round_trip::<UnmaskRequest>(data);
    if let Some(reply) = json_round_trip::<UnmaskShares>(data) {
        for r in reply.seed_shares.iter().chain(&reply.key_shares) {
            check_share(&r.share);
        }
    }
    check_settings(data);

    let words = data.len() / 4;
    match messages::decode_words(data, words) {
        Ok(w) => {
            assert_eq!(data.len() % 4, 0);
            assert_eq!(messages::encode_words(&w), data);
        }
        Err(e) => {
            assert_ne!(data.len() % 4, 0);
            assert!(matches!(e, SecAggError::WrongLength { .. }));
        }
    }
    assert!(messages::decode_words(data, words + 1).is_err());

    check_share(data);
    for piece in data.chunks(SHARE_BYTES) {
        check_share(piece);
    }
}

/// Round settings from JSON: validating them never panics, and valid ones round-trip
/// and start a server session. Invalid ones may not round-trip: an out-of-range float
/// such as `1e39` reads as an infinite `f32`, which JSON cannot write back.
fn check_settings(data: &[u8]) {
    if let Ok(params) = serde_json::from_slice::<QuantizationParams>(data)
        && Quantizer::new(params, 2).is_ok()
    {
        assert_eq!(json_round_trip(data), Some(params));
    }
    let Ok(config) = serde_json::from_slice::<RoundConfig>(data) else {
        return;
    };
    if config.validate().is_err() {
        return;
    }
    assert_eq!(json_round_trip::<RoundConfig>(data).as_ref(), Some(&config));
    ServerSession::new(config).expect("a valid configuration starts a round");
}

// ---------------------------------------------------------------------------------------
// secagg_round

/// Clients in the fuzzed round.
pub const ROUND_PARTIES: u32 = 6;

/// The fuzzed round: 6 clients, 4 neighbours each (a sparse graph, so some pairs are not
/// neighbours), threshold 3, 3 parameters.
pub fn round_config() -> RoundConfig {
    RoundConfig {
        session: [7; 32],
        parties: ROUND_PARTIES,
        threshold: 3,
        neighbours: 4,
        dimension: 3,
        quantization: QuantizationParams::default(),
    }
}

/// One honest client of the fuzzed round, with a deterministic key and randomness.
struct Honest {
    session: ClientSession,
    keys: AdvertiseKeys,
    keys_sent: bool,
    rng: ChaCha20Rng,
}

impl Honest {
    fn new(u: u32) -> Self {
        let mut rng = ChaCha20Rng::seed_from_u64(u64::from(u));
        let (session, keys) =
            ClientSession::new(round_config(), u, &mut rng).expect("a valid client");
        Self {
            session,
            keys,
            keys_sent: false,
            rng,
        }
    }

    fn update(&self) -> Vec<f32> {
        let u = self.session.index() as f32;
        vec![u / 8.0, -u / 4.0, 0.5]
    }
}

/// What a refused message must leave unchanged: the stage and every set of clients.
#[derive(Debug, PartialEq)]
struct Snapshot {
    stage: ServerStage,
    sets: [Vec<u32>; 4],
}

fn snapshot(server: &ServerSession) -> Snapshot {
    Snapshot {
        stage: server.stage().clone(),
        sets: [
            server.advertised().collect(),
            server.shared().collect(),
            server.masked().collect(),
            server.unmasked().collect(),
        ],
    }
}

/// Runs one `receive_*` (or `restore_masked`) call and checks its contract: refused, the
/// server is unchanged; accepted, `from` is in the stage's set.
fn receive(
    server: &mut ServerSession,
    from: u32,
    set: usize,
    call: impl FnOnce(&mut ServerSession) -> Result<(), SecAggError>,
) {
    let before = snapshot(server);
    match call(server) {
        Ok(()) => {
            let after = snapshot(server);
            assert_eq!(after.stage, before.stage);
            assert!(
                after.sets[set].contains(&from) && !before.sets[set].contains(&from),
                "accepted client {from} is not newly in set {set}"
            );
        }
        Err(_) => assert_eq!(
            snapshot(server),
            before,
            "a refused message changed the server"
        ),
    }
}

/// One secure round's server, and its honest clients, driven by a script of honest
/// steps, hostile client messages and hostile server messages: no panic, a refused
/// message changes nothing, an accepted one counts its sender, and a finished round
/// reports exactly the clients it summed.
///
/// Input: lines of text, each an operation letter, a client index in decimal (where the
/// operation needs one), and, for messages, a space and the message's JSON:
///
/// - `H<u>`: client `u` takes its next honest step (advertise, share, mask or unmask),
///   from what the server has published so far.
/// - `K<u> {AdvertiseKeys}`, `S<u> {ShareKeys}`, `M<u> [words]`, `U<u> {UnmaskShares}`:
///   a hostile message from `u` to the server; `X<u>` records `u`'s masked input without
///   its words (`restore_masked`).
/// - `D<u> {KeyDirectory}`, `R<u> {ForwardedShares}`, `Q<u> {UnmaskRequest}`: a hostile
///   server message to honest client `u`; what the client answers goes to the server.
/// - `a`, `s`, `m`: close advertising, sharing, collection; `f`: finish; `F [words]`:
///   finish with a sum folded by the caller.
pub fn secagg_round(data: &[u8]) {
    secagg_round_stage(data);
}

/// [`secagg_round`], returning where the round ended (so that a test can check that an
/// honest script really finishes it).
pub fn secagg_round_stage(data: &[u8]) -> ServerStage {
    let mut server = ServerSession::new(round_config()).expect("a valid configuration");
    let mut clients: BTreeMap<u32, Honest> =
        (1..=ROUND_PARTIES).map(|u| (u, Honest::new(u))).collect();
    for line in data.split(|&b| b == b'\n').take(256) {
        let Some((&op, rest)) = line.split_first() else {
            continue;
        };
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        let from: u32 = std::str::from_utf8(&rest[..digits])
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let payload = rest[digits..].strip_prefix(b" ").unwrap_or(&rest[digits..]);
        match op {
            b'H' => {
                if let Some(client) = clients.get_mut(&from) {
                    honest_step(&mut server, from, client);
                }
            }
            b'K' => {
                if let Ok(keys) = serde_json::from_slice::<AdvertiseKeys>(payload) {
                    receive(&mut server, from, 0, |s| s.receive_keys(from, &keys));
                }
            }
            b'S' => {
                if let Ok(shares) = serde_json::from_slice::<ShareKeys>(payload) {
                    receive(&mut server, from, 1, |s| s.receive_shares(from, &shares));
                }
            }
            b'M' => {
                if let Ok(words) = serde_json::from_slice::<Vec<u32>>(payload) {
                    receive(&mut server, from, 2, |s| s.receive_masked(from, &words));
                }
            }
            b'X' => receive(&mut server, from, 2, |s| s.restore_masked(from)),
            b'U' => {
                if let Ok(reply) = serde_json::from_slice::<UnmaskShares>(payload) {
                    receive(&mut server, from, 3, |s| s.receive_unmask(from, &reply));
                }
            }
            b'D' => {
                let (Some(client), Ok(directory)) = (
                    clients.get_mut(&from),
                    serde_json::from_slice::<KeyDirectory>(payload),
                ) else {
                    continue;
                };
                if let Ok(shares) = client.session.share_keys(&directory, &mut client.rng) {
                    receive(&mut server, from, 1, |s| s.receive_shares(from, &shares));
                }
            }
            b'R' => {
                let (Some(client), Ok(forwarded)) = (
                    clients.get_mut(&from),
                    serde_json::from_slice::<ForwardedShares>(payload),
                ) else {
                    continue;
                };
                let update = client.update();
                if let Ok(words) =
                    client
                        .session
                        .mask(&forwarded, &update, 10, 0.5, &mut client.rng)
                {
                    assert_eq!(words.len(), server.input_words());
                    receive(&mut server, from, 2, |s| s.receive_masked(from, &words));
                }
            }
            b'Q' => {
                let (Some(client), Ok(request)) = (
                    clients.get_mut(&from),
                    serde_json::from_slice::<UnmaskRequest>(payload),
                ) else {
                    continue;
                };
                if let Ok(reply) = client.session.unmask(&request) {
                    receive(&mut server, from, 3, |s| s.receive_unmask(from, &reply));
                }
            }
            b'a' => {
                if let Ok(directory) = server.close_advertise() {
                    assert_eq!(Some(&directory), server.directory().as_ref());
                    assert!(
                        directory
                            .entries
                            .iter()
                            .map(|e| e.index)
                            .eq(server.advertised())
                    );
                }
            }
            b's' => {
                let _ = server.close_sharing();
            }
            b'm' => {
                if let Ok(request) = server.close_collection() {
                    assert!(request.survivors.iter().copied().eq(server.masked()));
                }
            }
            b'f' => check_finish(&mut server, |s| s.finish()),
            b'F' => {
                if let Ok(sum) = serde_json::from_slice::<Vec<u32>>(payload) {
                    check_finish(&mut server, |s| s.finish_with(sum));
                }
            }
            _ => {}
        }
        // The read-only views the coordinator polls must answer at every point.
        let _ = server.dropouts();
        let _ = server.missing_secrets();
        for u in 0..=ROUND_PARTIES + 1 {
            let _ = server.forwarded_for(u);
            let _ = server.neighbours(u);
        }
    }
    server.stage().clone()
}

/// Client `u`'s next honest step, from what the server has published so far.
fn honest_step(server: &mut ServerSession, u: u32, client: &mut Honest) {
    match client.session.stage() {
        Some(Stage::Share) if !client.keys_sent => {
            client.keys_sent = true;
            let keys = client.keys.clone();
            receive(server, u, 0, |s| s.receive_keys(u, &keys));
        }
        Some(Stage::Share) => {
            let Some(directory) = server.directory() else {
                return;
            };
            if let Ok(shares) = client.session.share_keys(&directory, &mut client.rng) {
                receive(server, u, 1, |s| s.receive_shares(u, &shares));
            }
        }
        Some(Stage::Masked) => {
            let Ok(forwarded) = server.forwarded_for(u) else {
                return;
            };
            let update = client.update();
            if let Ok(words) = client
                .session
                .mask(&forwarded, &update, 10, 0.5, &mut client.rng)
            {
                receive(server, u, 2, |s| s.receive_masked(u, &words));
            }
        }
        Some(Stage::Unmask) => {
            let Some(request) = server.unmask_request() else {
                return;
            };
            if let Ok(reply) = client.session.unmask(&request) {
                receive(server, u, 3, |s| s.receive_unmask(u, &reply));
            }
        }
        _ => {}
    }
}

fn check_finish(
    server: &mut ServerSession,
    finish: impl FnOnce(&mut ServerSession) -> Result<Unmasked, SecAggError>,
) {
    let masked: Vec<u32> = server.masked().collect();
    let before = server.stage().clone();
    match finish(server) {
        Ok(result) => {
            assert_eq!(before, ServerStage::Unmask);
            assert_eq!(*server.stage(), ServerStage::Finished);
            assert_eq!(result.survivors, masked);
            assert_eq!(result.sum.len(), server.input_words());
        }
        // Refused before anything was done, or the round failed.
        Err(_) => assert!(
            *server.stage() == before || matches!(server.stage(), ServerStage::Failed(_)),
            "finishing from {before:?} left the round at {:?}",
            server.stage()
        ),
    }
}
