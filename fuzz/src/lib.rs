//! The bodies of the fuzz targets: each takes untrusted bytes, runs one family of
//! `cohort-aggregation` decoders on them and checks what the decoders promise (no panic,
//! and whatever decodes re-encodes to the same thing).
//!
//! The libFuzzer binaries in `fuzz_targets/` are one line each around these functions,
//! and `aggregation/tests/fuzz_corpus.rs` includes this file to replay every committed
//! corpus input on stable Rust, so the two can never drift apart. Only crates that
//! `cohort-aggregation` itself depends on are used here, for that reason.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Debug;
use std::sync::Arc;

use cohort_aggregation::model_file::{self, ModelFileError};
use cohort_aggregation::secagg::messages::{self, DirectoryEntry};
use cohort_aggregation::secagg::shamir::{SHARE_BYTES, Share};
use cohort_aggregation::secagg::{
    AdvertiseKeys, ClientSession, Confirmation, ForwardedShares, GraphReveal, Identity,
    KeyDirectory, QuantizationParams, Quantizer, Roster, RoundConfig, RoundContext, SecAggError,
    ServerSession, ServerStage, ShareKeys, Stage, SurvivorSignature, UnmaskRequest, UnmaskShares,
    Unmasked,
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
        Err(WireError::TooLong { .. }) => unreachable!("decode sees the whole body at once"),
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
/// kind (each must round-trip when it decodes, a decoded round configuration is
/// validated, and a decoded key directory is handed to an honest client of the fuzzed
/// round, which must refuse it without panicking unless it is the real one), as a masked
/// input (`messages::decode_words`), and as Shamir shares (`Share::from_bytes`, on the
/// whole input and on each 44-byte piece).
pub fn secagg_messages(data: &[u8]) {
    json_round_trip::<AdvertiseKeys>(data);
    json_round_trip::<Roster>(data);
    json_round_trip::<GraphReveal>(data);
    json_round_trip::<DirectoryEntry>(data);
    if let Some(directory) = json_round_trip::<KeyDirectory>(data) {
        check_directory(&directory);
    }
    json_round_trip::<ShareKeys>(data);
    json_round_trip::<ForwardedShares>(data);
    json_round_trip::<UnmaskRequest>(data);
    json_round_trip::<SurvivorSignature>(data);
    json_round_trip::<Confirmation>(data);
    json_round_trip::<RoundContext>(data);
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

/// A key directory from outside: an honest client that has revealed its nonce in the
/// fuzzed round (without the consistency check) checks it without panicking, and a
/// directory it accepts names every member's committed nonce and its neighbours' signed
/// keys.
fn check_directory(directory: &KeyDirectory) {
    let Some(&first) = directory.entries.first().map(|e| &e.index) else {
        return;
    };
    if first == 0 || first > ROUND_PARTIES {
        return;
    }
    static ROSTER: std::sync::OnceLock<Roster> = std::sync::OnceLock::new();
    let roster = ROSTER.get_or_init(|| Roster {
        members: (1..=ROUND_PARTIES).collect(),
        commitments: (1..=ROUND_PARTIES)
            .map(|u| Honest::new(u, false).keys.graph_commitment)
            .collect(),
    });
    let mut client = Honest::new(first, false);
    client.session.reveal(roster).expect("the real roster");
    if client
        .session
        .share_keys(directory, &mut client.rng)
        .is_ok()
    {
        assert_eq!(directory.members, roster.members);
        assert_eq!(client.session.stage(), Some(Stage::Masked));
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
/// neighbours), threshold 3, 3 parameters, with or without the consistency check.
pub fn round_config(consistency_check: bool) -> RoundConfig {
    RoundConfig {
        session: [7; 32],
        context: RoundContext {
            experiment: "fuzz".into(),
            round: 1,
            attempt: 1,
        },
        parties: ROUND_PARTIES,
        threshold: 3,
        neighbours: 4,
        dimension: 3,
        quantization: QuantizationParams::default(),
        consistency_check,
    }
}

/// Client `u`'s registered identity in the fuzzed round (and in the seeds), from a
/// generator of `u`. Index 0 and indices past the round's get one a stranger holds.
pub fn round_identity(u: u32) -> Identity {
    let mut rng = ChaCha20Rng::seed_from_u64(0x1d00 + u64::from(u.min(ROUND_PARTIES + 1)));
    Identity::from_rng(&mut rng)
}

/// One honest client of the fuzzed round, with a deterministic identity, keys and
/// randomness.
pub struct Honest {
    /// The client's session.
    pub session: ClientSession,
    /// Its stage 1 message.
    pub keys: AdvertiseKeys,
    /// Its registered identity.
    pub identity: Identity,
    keys_sent: bool,
    /// Its randomness after stage 1.
    pub rng: ChaCha20Rng,
}

impl Honest {
    /// Client `u` of the fuzzed round.
    pub fn new(u: u32, consistency_check: bool) -> Self {
        let identity = round_identity(u);
        let mut rng = ChaCha20Rng::seed_from_u64(u64::from(u));
        let (session, keys) = ClientSession::with_floors(
            round_config(consistency_check),
            u,
            cohort_aggregation::secagg::ClientFloors {
                require_consistency_check: false,
                ..Default::default()
            },
            &identity,
            &mut rng,
        )
        .expect("a valid client");
        Self {
            session,
            keys,
            identity,
            keys_sent: false,
            rng,
        }
    }

    /// Its update: `[u / 8, -u / 4, 0.5]`.
    pub fn update(&self) -> Vec<f32> {
        let u = self.session.index() as f32;
        vec![u / 8.0, -u / 4.0, 0.5]
    }
}

/// The script of an honest round: every client takes each of its steps and the server
/// closes each stage after them, with the consistency check (a first line `+`) or
/// without.
pub fn honest_script(consistency_check: bool) -> String {
    let all: String = (1..=ROUND_PARTIES).map(|u| format!("H{u}\n")).collect();
    let closes: &[&str] = if consistency_check {
        &["a", "r", "s", "m", "c", "f"]
    } else {
        &["a", "r", "s", "m", "f"]
    };
    let mut script = String::from(if consistency_check { "+\n" } else { "" });
    for close in closes {
        script.push_str(&all);
        script.push_str(close);
        script.push('\n');
    }
    script
}

/// The sets of clients a snapshot holds, by position.
const ADVERTISED: usize = 0;
const REVEALED: usize = 1;
const SHARED: usize = 2;
const MASKED: usize = 3;
const CONFIRMED: usize = 4;
const UNMASKED: usize = 5;

/// What a refused message must leave unchanged: the stage and every set of clients.
#[derive(Debug, PartialEq)]
struct Snapshot {
    stage: ServerStage,
    sets: [Vec<u32>; 6],
}

/// The members whose graph nonce the server holds, while it collects them: a second
/// nonce from one of them is refused as a duplicate before its bytes are looked at.
fn revealed(server: &ServerSession) -> Vec<u32> {
    let probe = GraphReveal { nonce: [0; 32] };
    server
        .advertised()
        .filter(|&u| server.check_reveal(u, &probe) == Err(SecAggError::Duplicate(u)))
        .collect()
}

fn snapshot(server: &ServerSession) -> Snapshot {
    Snapshot {
        stage: server.stage().clone(),
        sets: [
            server.advertised().collect(),
            revealed(server),
            server.shared().collect(),
            server.masked().collect(),
            server.confirmed().collect(),
            server.unmasked().collect(),
        ],
    }
}

/// Runs one `receive_*` (or `restore_masked`) call and checks its contract: refused, the
/// server is unchanged; accepted, `from` is newly in the stage's set and nothing else
/// changed.
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
            for (i, (a, b)) in after.sets.iter().zip(&before.sets).enumerate() {
                assert!(
                    i == set || a == b,
                    "accepting client {from} changed set {i}"
                );
            }
        }
        Err(_) => assert_eq!(
            snapshot(server),
            before,
            "a refused message changed the server"
        ),
    }
}

/// Which honest clients revealed which kind of share of whose secret, whether or not
/// the server took the answer: what a server that deviates could hold.
#[derive(Default)]
struct Ledger {
    /// Owner -> holders that revealed a share of its self-mask seed.
    seeds: BTreeMap<u32, BTreeSet<u32>>,
    /// Owner -> holders that revealed a share of its mask key.
    keys: BTreeMap<u32, BTreeSet<u32>>,
}

impl Ledger {
    /// Records honest client `holder`'s answer and checks the protocol's promise: no
    /// client's seed and mask key both reach `t` revealed shares, whatever the server
    /// told whom.
    fn record(&mut self, holder: u32, reply: &UnmaskShares, threshold: usize) {
        for r in &reply.seed_shares {
            self.seeds.entry(r.owner).or_default().insert(holder);
        }
        for r in &reply.key_shares {
            self.keys.entry(r.owner).or_default().insert(holder);
        }
        for (owner, seeds) in &self.seeds {
            let keys = self.keys.get(owner).map_or(0, BTreeSet::len);
            assert!(
                seeds.len() < threshold || keys < threshold,
                "honest clients revealed {} seed shares and {keys} key shares of client \
                 {owner}'s secrets: its input is exposed",
                seeds.len()
            );
        }
    }
}

/// One secure round's server, and its honest clients, driven by a script of honest
/// steps, hostile client messages and hostile server messages: no panic, a refused
/// message changes nothing, an accepted one counts its sender, a finished round reports
/// exactly the clients it summed, and no client's seed and mask key are both revealed by
/// `t` honest clients, whatever the server sent them.
///
/// Input: lines of text, each an operation letter, a client index in decimal (where the
/// operation needs one), and, for messages, a space and the message's JSON. A first line
/// `+` runs the round with the consistency check.
///
/// - `H<u>`: client `u` takes its next honest step (advertise, reveal, share, mask,
///   confirm or unmask), from what the server has published so far for it.
/// - `K<u> {AdvertiseKeys}` (under `u`'s registered identity) or `K<u> {DirectoryEntry}`
///   (under the identity it names), `N<u> {GraphReveal}`, `S<u> {ShareKeys}`,
///   `M<u> [words]`, `C<u> {Confirmation}`, `U<u> {UnmaskShares}`: a hostile message
///   from `u` to the server; `X<u>` records `u`'s masked input without its words
///   (`restore_masked`).
/// - `O<u> {Roster}`, `D<u> {KeyDirectory}`, `R<u> {ForwardedShares}`,
///   `L<u> {UnmaskRequest}` (a survivor list to sign), `Q<u> {UnmaskRequest}`: a hostile
///   server message to honest client `u`; what the client answers goes to the server.
/// - `a`, `r`, `s`, `m`, `c`: close advertising, revealing, sharing, collection,
///   confirming; `f`: finish; `F [words]`: finish with a sum folded by the caller.
pub fn secagg_round(data: &[u8]) {
    secagg_round_stage(data);
}

/// [`secagg_round`], returning where the round ended (so that a test can check that an
/// honest script really finishes it).
pub fn secagg_round_stage(data: &[u8]) -> ServerStage {
    let consistency_check = data.first() == Some(&b'+');
    let config = round_config(consistency_check);
    let threshold = config.threshold;
    let mut server = ServerSession::new(config).expect("a valid configuration");
    let mut clients: BTreeMap<u32, Honest> = (1..=ROUND_PARTIES)
        .map(|u| (u, Honest::new(u, consistency_check)))
        .collect();
    let mut ledger = Ledger::default();
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
        // A hostile server message to honest client `from`, when it parses.
        macro_rules! to_client {
            ($t:ty) => {{
                let (Some(client), Ok(message)) = (
                    clients.get_mut(&from),
                    serde_json::from_slice::<$t>(payload),
                ) else {
                    continue;
                };
                (client, message)
            }};
        }
        match op {
            b'H' => {
                if let Some(client) = clients.get_mut(&from) {
                    honest_step(&mut server, from, client, &mut ledger, threshold);
                }
            }
            b'K' => {
                let (keys, identity) =
                    if let Ok(keys) = serde_json::from_slice::<AdvertiseKeys>(payload) {
                        (keys, round_identity(from).public())
                    } else if let Ok(entry) = serde_json::from_slice::<DirectoryEntry>(payload) {
                        (entry.keys, entry.identity)
                    } else {
                        continue;
                    };
                receive(&mut server, from, ADVERTISED, |s| {
                    s.receive_keys(from, &keys, &identity)
                });
            }
            b'N' => {
                if let Ok(reveal) = serde_json::from_slice::<GraphReveal>(payload) {
                    receive(&mut server, from, REVEALED, |s| {
                        s.receive_reveal(from, &reveal)
                    });
                }
            }
            b'S' => {
                if let Ok(shares) = serde_json::from_slice::<ShareKeys>(payload) {
                    receive(&mut server, from, SHARED, |s| {
                        s.receive_shares(from, &shares)
                    });
                }
            }
            b'M' => {
                if let Ok(words) = serde_json::from_slice::<Vec<u32>>(payload) {
                    receive(&mut server, from, MASKED, |s| {
                        s.receive_masked(from, &words)
                    });
                }
            }
            b'X' => receive(&mut server, from, MASKED, |s| s.restore_masked(from)),
            b'C' => {
                if let Ok(confirmation) = serde_json::from_slice::<Confirmation>(payload) {
                    receive(&mut server, from, CONFIRMED, |s| {
                        s.receive_confirmation(from, &confirmation)
                    });
                }
            }
            b'U' => {
                if let Ok(reply) = serde_json::from_slice::<UnmaskShares>(payload) {
                    receive(&mut server, from, UNMASKED, |s| {
                        s.receive_unmask(from, &reply)
                    });
                }
            }
            b'O' => {
                let (client, roster) = to_client!(Roster);
                if let Ok(reveal) = client.session.reveal(&roster) {
                    receive(&mut server, from, REVEALED, |s| {
                        s.receive_reveal(from, &reveal)
                    });
                }
            }
            b'D' => {
                let (client, directory) = to_client!(KeyDirectory);
                if let Ok(shares) = client.session.share_keys(&directory, &mut client.rng) {
                    receive(&mut server, from, SHARED, |s| {
                        s.receive_shares(from, &shares)
                    });
                }
            }
            b'R' => {
                let (client, forwarded) = to_client!(ForwardedShares);
                let update = client.update();
                if let Ok(words) =
                    client
                        .session
                        .mask(&forwarded, &update, 10, 0.5, &mut client.rng)
                {
                    assert_eq!(words.len(), server.input_words());
                    receive(&mut server, from, MASKED, |s| {
                        s.receive_masked(from, &words)
                    });
                }
            }
            b'L' => {
                let (client, list) = to_client!(UnmaskRequest);
                if let Ok(confirmation) = client.session.confirm(&list, &client.identity) {
                    receive(&mut server, from, CONFIRMED, |s| {
                        s.receive_confirmation(from, &confirmation)
                    });
                }
            }
            b'Q' => {
                let (client, request) = to_client!(UnmaskRequest);
                if let Ok(reply) = client.session.unmask(&request) {
                    ledger.record(from, &reply, threshold);
                    receive(&mut server, from, UNMASKED, |s| {
                        s.receive_unmask(from, &reply)
                    });
                }
            }
            b'a' => {
                if let Ok(roster) = server.close_advertise() {
                    assert_eq!(Some(&roster), server.roster().as_ref());
                    assert!(roster.members.iter().copied().eq(server.advertised()));
                    assert_eq!(roster.commitments.len(), roster.members.len());
                }
            }
            b'r' => {
                let drawn = server.close_reveal().is_ok();
                if drawn {
                    let directory = server.directory().expect("the graph is drawn");
                    assert!(directory.members.iter().copied().eq(server.advertised()));
                    assert_eq!(directory.reveals.len(), directory.members.len());
                    for &u in &directory.members {
                        let mut wanted = server.neighbours(u).expect("a member");
                        wanted.push(u);
                        wanted.sort_unstable();
                        let mine = server.directory_for(u).expect("a member");
                        assert!(mine.entries.iter().map(|e| e.index).eq(wanted));
                    }
                }
            }
            b's' => {
                let _ = server.close_sharing();
            }
            b'm' => {
                if let Ok(list) = server.close_collection() {
                    assert!(list.survivors.iter().copied().eq(server.masked()));
                    assert!(list.signatures.is_empty());
                    assert_eq!(Some(list), server.survivor_list());
                }
            }
            b'c' => {
                let confirmed = server.close_confirm().is_ok();
                if confirmed {
                    assert!(server.confirmed().count() >= threshold);
                    for u in server.masked() {
                        let request = server.unmask_request_for(u).expect("a survivor");
                        let neighbours = server.neighbours(u).expect("a member");
                        assert!(request.signatures.iter().all(|s| {
                            neighbours.contains(&s.index)
                                && server.confirmed().any(|c| c == s.index)
                        }));
                    }
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
        let _ = server.roster();
        let _ = server.directory();
        let _ = server.survivor_list();
        for u in 0..=ROUND_PARTIES + 1 {
            let _ = server.forwarded_for(u);
            let _ = server.neighbours(u);
            let _ = server.directory_for(u);
            let _ = server.unmask_request_for(u);
        }
    }
    server.stage().clone()
}

/// Client `u`'s next honest step, from what the server has published so far for it.
fn honest_step(
    server: &mut ServerSession,
    u: u32,
    client: &mut Honest,
    ledger: &mut Ledger,
    threshold: usize,
) {
    match client.session.stage() {
        Some(Stage::Reveal) if !client.keys_sent => {
            client.keys_sent = true;
            let (keys, identity) = (client.keys.clone(), client.identity.public());
            receive(server, u, ADVERTISED, |s| {
                s.receive_keys(u, &keys, &identity)
            });
        }
        Some(Stage::Reveal) => {
            let Some(roster) = server.roster() else {
                return;
            };
            if let Ok(reveal) = client.session.reveal(&roster) {
                receive(server, u, REVEALED, |s| s.receive_reveal(u, &reveal));
            }
        }
        Some(Stage::Share) => {
            let Some(directory) = server.directory_for(u) else {
                return;
            };
            if let Ok(shares) = client.session.share_keys(&directory, &mut client.rng) {
                receive(server, u, SHARED, |s| s.receive_shares(u, &shares));
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
                receive(server, u, MASKED, |s| s.receive_masked(u, &words));
            }
        }
        Some(Stage::Confirm) => {
            let Some(list) = server.survivor_list() else {
                return;
            };
            if let Ok(confirmation) = client.session.confirm(&list, &client.identity) {
                receive(server, u, CONFIRMED, |s| {
                    s.receive_confirmation(u, &confirmation)
                });
            }
        }
        Some(Stage::Unmask) => {
            let Some(request) = server.unmask_request_for(u) else {
                return;
            };
            if let Ok(reply) = client.session.unmask(&request) {
                ledger.record(u, &reply, threshold);
                receive(server, u, UNMASKED, |s| s.receive_unmask(u, &reply));
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
            // Whoever dropped after uploading is still summed.
            for u in result
                .dropouts
                .confirm
                .iter()
                .chain(&result.dropouts.unmask)
            {
                assert!(masked.contains(u), "{u} is listed as a late dropout");
            }
        }
        // Refused before anything was done, or the round failed.
        Err(_) => assert!(
            *server.stage() == before || matches!(server.stage(), ServerStage::Failed(_)),
            "finishing from {before:?} left the round at {:?}",
            server.stage()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The round harness is only worth its fuzzing if honest scripts really reach the
    /// end, in both modes.
    #[test]
    fn honest_scripts_finish_the_round_with_and_without_the_consistency_check() {
        for consistency_check in [false, true] {
            let script = honest_script(consistency_check);
            assert_eq!(
                secagg_round_stage(script.as_bytes()),
                ServerStage::Finished,
                "{script}"
            );
        }
        // Without its last close, the round waits.
        let script = honest_script(true).replace("\nc\n", "\n");
        assert_eq!(secagg_round_stage(script.as_bytes()), ServerStage::Confirm);
    }
}
