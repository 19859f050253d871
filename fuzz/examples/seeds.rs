//! Writes the seed inputs of every fuzz target into `corpus/<target>/seed-*`: valid
//! (and a few nearly valid) inputs made with the library's own encoders and a real
//! secure round, so that fuzzing starts from deep inside each format.
//!
//! ```bash
//! cd fuzz && cargo run --example seeds
//! ```

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cohort_aggregation::model_file;
use cohort_aggregation::privacy::distributed::DistributedNoise;
use cohort_aggregation::secagg::crypto::graph_seed;
use cohort_aggregation::secagg::messages::encode_words;
use cohort_aggregation::secagg::{
    AdvertiseKeys, Confirmation, ForwardedShares, GraphReveal, KeyDirectory, NeighbourGraph,
    QuantizationParams, Roster, RoundConfig, ServerSession, ShareKeys, SurvivorSignature,
    UnmaskRequest, UnmaskShares,
};
use cohort_aggregation::{Layout, ModelVector, TensorSpec, wire};
use cohort_fuzz::{Honest, ROUND_PARTIES, honest_script, round_config, round_identity};
use safetensors::tensor::{Dtype, TensorView};
use serde::Serialize;

struct Corpus {
    dir: PathBuf,
    written: usize,
}

impl Corpus {
    fn new(root: &Path, target: &str) -> Self {
        let dir = root.join(target);
        fs::create_dir_all(&dir).expect("corpus directory");
        Self { dir, written: 0 }
    }

    fn put(&mut self, name: &str, bytes: impl AsRef<[u8]>) {
        fs::write(self.dir.join(format!("seed-{name}")), bytes).expect("seed written");
        self.written += 1;
    }

    fn json(&mut self, name: &str, value: &impl Serialize) {
        self.put(name, serde_json::to_vec(value).expect("serialises"));
    }
}

/// `n` values that visit the awkward corners of `f32`.
fn values(n: usize) -> Vec<f32> {
    let special = [
        0.0,
        -0.0,
        1.0,
        -1.5,
        f32::MIN_POSITIVE,
        1e-45,
        f32::MAX,
        f32::MIN,
        3.25e7,
    ];
    (0..n).map(|i| special[i % special.len()]).collect()
}

fn wire_seeds(root: &Path) -> usize {
    let mut c = Corpus::new(root, "wire_decode");
    // Layout bytes (see cohort_fuzz::wire_decode), then the cut seed, then the body.
    let cases: [(&str, &[u8], usize); 6] = [
        ("empty", &[0], 0),
        ("scalar", &[1, 0], 1),
        ("vector4", &[1, 1, 4], 4),
        ("matrix-and-bias", &[2, 2, 3, 2, 1, 3], 9),
        ("mlp", &[3, 2, 3, 2, 1, 3, 2, 2, 3], 15),
        ("cube", &[1, 3, 4, 4, 4], 64),
    ];
    for (name, header, n) in cases {
        let body = wire::encode(&ModelVector::from_flat(values(n)));
        let mut input = header.to_vec();
        input.push(0x5a);
        input.extend_from_slice(&body);
        c.put(name, &input);
        if n > 0 {
            let mut nan = input.clone();
            let at = input.len() - 4;
            nan[at..].copy_from_slice(&f32::NAN.to_le_bytes());
            c.put(&format!("{name}-nan"), nan);
            let mut ragged = input.clone();
            ragged.pop();
            c.put(&format!("{name}-ragged"), ragged);
            let mut long = input;
            long.extend_from_slice(&f32::INFINITY.to_le_bytes());
            c.put(&format!("{name}-long-inf"), long);
        }
    }
    c.written
}

fn mlp() -> Arc<Layout> {
    Arc::new(
        Layout::new(vec![
            TensorSpec::new("fc1.weight", [3, 2]),
            TensorSpec::new("fc1.bias", [3]),
            TensorSpec::new("fc2.weight", [2, 3]),
        ])
        .expect("a valid layout"),
    )
}

fn safetensors_file(tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.to_string(),
                TensorView::new(*d, s.clone(), b).expect("a valid view"),
            )
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(metadata)).expect("serialises")
}

fn model_file_seeds(root: &Path) -> usize {
    let mut c = Corpus::new(root, "model_file_decode");
    let layout = mlp();
    let v = ModelVector::new(layout.clone(), values(15)).expect("15 values");
    c.put("mlp", model_file::encode(&v, HashMap::new()));
    c.put(
        "mlp-metadata",
        model_file::encode(&v, HashMap::from([("round".into(), "7".into())])),
    );
    let mut truncated = model_file::encode(&v, HashMap::new());
    truncated.truncate(truncated.len() - 3);
    c.put("mlp-truncated", truncated);
    let f32s = |xs: &[f32]| -> Vec<u8> { xs.iter().flat_map(|x| x.to_le_bytes()).collect() };
    c.put(
        "mlp-nan",
        safetensors_file(&[
            ("fc1.weight", Dtype::F32, vec![3, 2], f32s(&[0.0; 6])),
            ("fc1.bias", Dtype::F32, vec![3], f32s(&[0.0, f32::NAN, 1.0])),
            ("fc2.weight", Dtype::F32, vec![2, 3], f32s(&[2.0; 6])),
        ]),
    );
    c.put(
        "scalar-and-empty",
        safetensors_file(&[
            ("scale", Dtype::F32, vec![], f32s(&[0.5])),
            ("nothing", Dtype::F32, vec![0, 4], Vec::new()),
            ("bias", Dtype::F32, vec![2], f32s(&[1.0, -1.0])),
        ]),
    );
    c.put(
        "no-tensors",
        safetensors::serialize(Vec::<(String, TensorView<'_>)>::new(), None).expect("empty"),
    );
    // Every other dtype, one small tensor each, and all together with an F32 one.
    let others = [
        (Dtype::F16, 2),
        (Dtype::BF16, 2),
        (Dtype::F64, 8),
        (Dtype::I8, 1),
        (Dtype::U8, 1),
        (Dtype::I16, 2),
        (Dtype::U16, 2),
        (Dtype::I32, 4),
        (Dtype::U32, 4),
        (Dtype::I64, 8),
        (Dtype::U64, 8),
        (Dtype::BOOL, 1),
        (Dtype::F8_E4M3, 1),
        (Dtype::F8_E5M2, 1),
        (Dtype::C64, 8),
    ];
    let mut all = vec![("w", Dtype::F32, vec![2, 2], f32s(&[1.0, 2.0, 3.0, 4.0]))];
    for (i, (dtype, size)) in others.iter().enumerate() {
        let bytes: Vec<u8> = (0..4 * size).map(|b| (b * 37 + i) as u8 & 0x3f).collect();
        c.put(
            &format!("dtype-{dtype:?}").to_lowercase(),
            safetensors_file(&[("t", *dtype, vec![4], bytes.clone())]),
        );
        if i < 4 {
            all.push((["a", "b", "c", "d"][i], *dtype, vec![4], bytes));
        }
    }
    c.put("mixed-dtypes", safetensors_file(&all));
    // Many small tensors with dotted names, as a PyTorch state dict has.
    let many: Vec<TensorSpec> = (0..40)
        .map(|i| TensorSpec::new(format!("layers.{i}.weight"), [2, 1]))
        .collect();
    let many = Arc::new(Layout::new(many).expect("distinct names"));
    let v = ModelVector::new(many.clone(), values(many.len())).expect("values");
    c.put("many-tensors", model_file::encode(&v, HashMap::new()));
    c.written
}

/// The messages of one real round of the fuzzed configuration, every client honest: the
/// harness's own clients (`cohort_fuzz::Honest`), so that its scripts can replay them.
struct Round {
    consistency_check: bool,
    keys: Vec<AdvertiseKeys>,
    roster: Roster,
    reveals: Vec<GraphReveal>,
    /// Client 1's directory, and the whole one.
    directory: KeyDirectory,
    full_directory: KeyDirectory,
    shares: Vec<ShareKeys>,
    forwarded: Vec<ForwardedShares>,
    masked: Vec<Vec<u32>>,
    /// The bare survivor list.
    list: UnmaskRequest,
    /// The survivors' signatures over it (with the consistency check).
    confirmations: Vec<Confirmation>,
    /// What each survivor is asked to answer.
    requests: Vec<UnmaskRequest>,
    replies: Vec<UnmaskShares>,
    sum: Vec<u32>,
}

fn real_round(consistency_check: bool) -> Round {
    let mut server = ServerSession::new(round_config(consistency_check)).expect("valid");
    let mut clients: Vec<Honest> = (1..=ROUND_PARTIES)
        .map(|u| Honest::new(u, consistency_check))
        .collect();
    let mut keys = Vec::new();
    for (u, c) in (1..).zip(&clients) {
        server
            .receive_keys(u, &c.keys, &c.identity.public())
            .expect("keys");
        keys.push(c.keys.clone());
    }
    let roster = server.close_advertise().expect("roster");
    let mut reveals = Vec::new();
    for (u, c) in (1..).zip(&mut clients) {
        let r = c.session.reveal(&roster).expect("reveal");
        server.receive_reveal(u, &r).expect("accepted");
        reveals.push(r);
    }
    server.close_reveal().expect("graph");
    let mut shares = Vec::new();
    for (u, c) in (1..).zip(&mut clients) {
        let directory = server.directory_for(u).expect("a member");
        let s = c
            .session
            .share_keys(&directory, &mut c.rng)
            .expect("shares");
        server.receive_shares(u, &s).expect("accepted");
        shares.push(s);
    }
    server.close_sharing().expect("closed");
    let mut forwarded = Vec::new();
    let mut masked = Vec::new();
    let mut sum = vec![0u32; server.input_words()];
    for (u, c) in (1..).zip(&mut clients) {
        let f = server.forwarded_for(u).expect("forwarded");
        let update = c.update();
        let words = c
            .session
            .mask(&f, &update, 10, 0.5, &mut c.rng)
            .expect("masked");
        server.receive_masked(u, &words).expect("accepted");
        for (s, w) in sum.iter_mut().zip(&words) {
            *s = s.wrapping_add(*w);
        }
        forwarded.push(f);
        masked.push(words);
    }
    let list = server.close_collection().expect("survivors");
    let mut confirmations = Vec::new();
    if consistency_check {
        for (u, c) in (1..).zip(&mut clients) {
            let m = c.session.confirm(&list, &c.identity).expect("signed");
            server.receive_confirmation(u, &m).expect("accepted");
            confirmations.push(m);
        }
        server.close_confirm().expect("confirmed");
    }
    let mut requests = Vec::new();
    let mut replies = Vec::new();
    for (u, c) in (1..).zip(&mut clients) {
        let request = server.unmask_request_for(u).expect("a survivor");
        let r = c.session.unmask(&request).expect("reply");
        server.receive_unmask(u, &r).expect("accepted");
        requests.push(request);
        replies.push(r);
    }
    server.finish().expect("the honest round finishes");
    Round {
        consistency_check,
        keys,
        roster,
        reveals,
        directory: server.directory_for(1).expect("a member"),
        full_directory: server.directory().expect("drawn"),
        shares,
        forwarded,
        masked,
        list,
        confirmations,
        requests,
        replies,
        sum,
    }
}

fn secagg_message_seeds(root: &Path, plain: &Round, checked: &Round) -> usize {
    let mut c = Corpus::new(root, "secagg_messages");
    c.json("round-config", &round_config(false));
    c.json("round-config-consistency-check", &round_config(true));
    let dp = RoundConfig {
        quantization: QuantizationParams {
            distributed_noise: Some(DistributedNoise {
                l2_clip: 1.5,
                noise_multiplier: 0.8,
            }),
            ..QuantizationParams::default()
        },
        ..round_config(false)
    };
    c.json("round-config-distributed-noise", &dp);
    c.json("round-context", &round_config(true).context);
    c.json("quantization", &QuantizationParams::default());
    c.json("advertise-keys", &plain.keys[0]);
    c.json("roster", &plain.roster);
    c.json("graph-reveal", &plain.reveals[0]);
    c.json("directory-entry", &plain.directory.entries[0]);
    c.json("key-directory", &plain.directory);
    c.json("key-directory-full", &plain.full_directory);
    c.json("share-keys", &plain.shares[0]);
    c.json("forwarded-shares", &plain.forwarded[0]);
    c.json("unmask-request", &plain.list);
    c.json("confirmation", &checked.confirmations[0]);
    c.json("survivor-signature", &checked.requests[0].signatures[0]);
    c.json("unmask-request-signed", &checked.requests[0]);
    c.json("unmask-shares", &plain.replies[0]);
    let dropped = UnmaskShares {
        seed_shares: plain.replies[0].seed_shares[1..].to_vec(),
        key_shares: plain.replies[0].seed_shares[..1].to_vec(),
    };
    c.json("unmask-shares-with-key-share", &dropped);
    c.put("masked-words", encode_words(&plain.masked[0]));
    let share = &plain.replies[0].seed_shares[0].share;
    c.put("share", share);
    let mut two = share.clone();
    two.extend_from_slice(&plain.replies[1].seed_shares[0].share);
    c.put("two-shares", two);
    c.written
}

/// The scripts of one mode of the round: `name` seeds its plain scripts and
/// `name-consistency-check` the others.
fn secagg_round_scripts(c: &mut Corpus, round: &Round) {
    let checked = round.consistency_check;
    let name = |base: &str| {
        if checked {
            format!("{base}-consistency-check")
        } else {
            base.to_string()
        }
    };
    let mode = if checked { "+\n" } else { "" };
    let h: String = (1..=ROUND_PARTIES).map(|u| format!("H{u}\n")).collect();
    // After masking: the confirm stage (with the check), then unmasking.
    let to_end = |h_confirm: &str, h_unmask: &str| {
        if checked {
            format!("{h_confirm}c\n{h_unmask}f\n")
        } else {
            format!("{h_unmask}f\n")
        }
    };
    c.put(&name("honest"), honest_script(checked));
    let honest_to_m = format!("{mode}{h}a\n{h}r\n{h}s\n{h}m\n");
    // Client 6 drops after sharing (its mask key is rebuilt), after masking (its input
    // still counts), or before revealing its nonce (the attempt fails).
    let without_6 = h.replace("H6\n", "");
    c.put(
        &name("dropout-after-sharing"),
        format!(
            "{mode}{h}a\n{h}r\n{h}s\n{without_6}m\n{}",
            to_end(&without_6, &without_6)
        ),
    );
    c.put(
        &name("dropout-after-masking"),
        format!("{honest_to_m}{}", to_end(&without_6, &without_6)),
    );
    if checked {
        c.put(
            "dropout-after-confirming-consistency-check",
            format!("{honest_to_m}{}", to_end(&h, &without_6)),
        );
    }
    c.put(
        &name("dropout-before-revealing"),
        format!("{mode}{h}a\n{without_6}r\n{h}s\n"),
    );
    // Replays and forgeries with real messages, between honest steps: another client's
    // keys (whose signature is not the sender's), nonce, shares, input, signature and
    // answer.
    let confirmations = if checked {
        format!("C1 {c}\nC2 {c}\n", c = json(&round.confirmations[1]))
    } else {
        String::new()
    };
    let entry = &round.full_directory.entries[1];
    let hostile = format!(
        "{mode}K7 {k}\nK0 {k}\n{h}K3 {k}\nK4 {e}\na\nN1 {n}\nN9 {n}\n{h}r\nS1 {s}\nS2 {s}\n{h}s\nM1 {w}\nM2 {w}\nX3\n{h}m\n{confirmations}{h}{}U1 {r}\nU2 {r}\n{h}f\n",
        if checked { "c\n" } else { "" },
        k = json(&round.keys[1]),
        e = json(entry),
        n = json(&round.reveals[1]),
        s = json(&round.shares[0]),
        w = json(&round.masked[0]),
        r = json(&round.replies[0]),
    );
    c.put(&name("hostile-replays"), hostile);
    // A hostile server: the client is sent a roster without it, someone else's
    // directory, shares and survivor lists.
    let mut short_roster = round.roster.clone();
    short_roster.members.remove(1);
    short_roster.commitments.remove(1);
    let lists = if checked {
        format!("L1 {l}\nL2 {l}\n{h}c\n", l = json(&round.list))
    } else {
        String::new()
    };
    let server = format!(
        "{mode}{h}a\nO2 {o}\nO1 {roster}\n{h}r\nD1 {d}\nD2 {d}\n{h}s\nR1 {f}\nR3 {f}\n{h}m\n{lists}Q1 {q}\nQ2 {q}\n{h}f\n",
        o = json(&short_roster),
        roster = json(&round.roster),
        d = json(&round.directory),
        f = json(&round.forwarded[1]),
        q = json(&round.requests[0]),
    );
    c.put(&name("hostile-server"), server);
    if checked {
        // Two survivor lists: client 6 alive for clients 1 to 3 (and 6) and dropped for
        // 4 and 5; each is then asked to answer with the signatures its neighbours made
        // over its own list, all the server got.
        let s1 = round.list.clone();
        let s2 = UnmaskRequest {
            survivors: s1.survivors.iter().copied().filter(|&u| u != 6).collect(),
            signatures: vec![],
        };
        let config = round_config(true);
        let dir = &round.full_directory;
        let graph = NeighbourGraph::new(
            &dir.members,
            &graph_seed(&config.session, &dir.members, &dir.reveals),
            config.neighbours,
        )
        .expect("the round's graph");
        let told_s1 = |u: u32| [1, 2, 3, 6].contains(&u);
        let request = |u: u32| {
            let list = if told_s1(u) { &s1 } else { &s2 };
            UnmaskRequest {
                signatures: graph
                    .neighbours(u)
                    .expect("a member")
                    .into_iter()
                    .filter(|&v| told_s1(v) == told_s1(u))
                    .map(|v| SurvivorSignature {
                        index: v,
                        signature: round_identity(v)
                            .sign(&config.survivors_statement(&list.survivors)),
                    })
                    .collect(),
                ..list.clone()
            }
        };
        let asks: String = [1, 4, 2, 5, 3]
            .into_iter()
            .map(|u| format!("Q{u} {}\n", json(&request(u))))
            .collect();
        let split = format!(
            "+\n{h}a\n{h}r\n{h}s\n{h}m\nL1 {s1}\nL2 {s1}\nL3 {s1}\nL6 {s1}\nL4 {s2}\nL5 {s2}\nc\n{asks}{h}f\n",
            s1 = json(&s1),
            s2 = json(&s2),
        );
        c.put("split-survivor-lists-consistency-check", split);
    }
    // The caller folds the inputs: the real sum through `F`, and inputs recorded with
    // `X` (no words), which `f` must then refuse.
    let end = if checked {
        format!("{h}c\n")
    } else {
        String::new()
    };
    c.put(
        &name("external-sum"),
        format!("{honest_to_m}{end}{h}F {sum}\n", sum = json(&round.sum)),
    );
    c.put(
        &name("restored-inputs"),
        format!(
            "{mode}{h}a\n{h}r\n{h}s\nX1\nX2\nX3\nX4\nX5\nm\n{end}{h}f\nF {sum}\n",
            sum = json(&round.sum)
        ),
    );
}

fn secagg_round_seeds(root: &Path, plain: &Round, checked: &Round) -> usize {
    let mut c = Corpus::new(root, "secagg_round");
    secagg_round_scripts(&mut c, plain);
    secagg_round_scripts(&mut c, checked);
    c.written
}

/// A message as one line of JSON.
fn json(value: &impl Serialize) -> String {
    serde_json::to_string(value).expect("serialises")
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let (plain, checked) = (real_round(false), real_round(true));
    println!("wire_decode: {} seeds", wire_seeds(&root));
    println!("model_file_decode: {} seeds", model_file_seeds(&root));
    println!(
        "secagg_messages: {} seeds",
        secagg_message_seeds(&root, &plain, &checked)
    );
    println!(
        "secagg_round: {} seeds",
        secagg_round_seeds(&root, &plain, &checked)
    );
}
