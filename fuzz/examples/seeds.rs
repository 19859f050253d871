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
use cohort_aggregation::secagg::messages::encode_words;
use cohort_aggregation::secagg::{
    AdvertiseKeys, ClientSession, KeyDirectory, QuantizationParams, RoundConfig, ServerSession,
    ShareKeys, UnmaskShares,
};
use cohort_aggregation::{Layout, ModelVector, TensorSpec, wire};
use cohort_fuzz::{ROUND_PARTIES, round_config};
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;
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

/// The messages of one real round of the fuzzed configuration, every client honest.
struct Round {
    keys: Vec<AdvertiseKeys>,
    directory: KeyDirectory,
    shares: Vec<ShareKeys>,
    forwarded: Vec<cohort_aggregation::secagg::ForwardedShares>,
    masked: Vec<Vec<u32>>,
    request: cohort_aggregation::secagg::UnmaskRequest,
    replies: Vec<UnmaskShares>,
    sum: Vec<u32>,
}

fn real_round() -> Round {
    let mut server = ServerSession::new(round_config()).expect("valid");
    let mut clients = Vec::new();
    let mut keys = Vec::new();
    for u in 1..=ROUND_PARTIES {
        let mut rng = ChaCha20Rng::seed_from_u64(u64::from(u));
        let (session, k) = ClientSession::new(round_config(), u, &mut rng).expect("client");
        server.receive_keys(u, &k).expect("keys");
        clients.push((session, rng));
        keys.push(k);
    }
    let directory = server.close_advertise().expect("directory");
    let mut shares = Vec::new();
    for (u, (session, rng)) in (1..).zip(&mut clients) {
        let s = session.share_keys(&directory, rng).expect("shares");
        server.receive_shares(u, &s).expect("accepted");
        shares.push(s);
    }
    server.close_sharing().expect("closed");
    let mut forwarded = Vec::new();
    let mut masked = Vec::new();
    let mut sum = vec![0u32; server.input_words()];
    for (u, (session, rng)) in (1..).zip(&mut clients) {
        let f = server.forwarded_for(u).expect("forwarded");
        let update = [u as f32 / 8.0, -(u as f32) / 4.0, 0.5];
        let words = session.mask(&f, &update, 10, 0.5, rng).expect("masked");
        server.receive_masked(u, &words).expect("accepted");
        for (s, w) in sum.iter_mut().zip(&words) {
            *s = s.wrapping_add(*w);
        }
        forwarded.push(f);
        masked.push(words);
    }
    let request = server.close_collection().expect("request");
    let mut replies = Vec::new();
    for (u, (session, _)) in (1..).zip(&mut clients) {
        let r = session.unmask(&request).expect("reply");
        server.receive_unmask(u, &r).expect("accepted");
        replies.push(r);
    }
    server.finish().expect("the honest round finishes");
    Round {
        keys,
        directory,
        shares,
        forwarded,
        masked,
        request,
        replies,
        sum,
    }
}

fn secagg_message_seeds(root: &Path, round: &Round) -> usize {
    let mut c = Corpus::new(root, "secagg_messages");
    c.json("round-config", &round_config());
    let dp = RoundConfig {
        quantization: QuantizationParams {
            distributed_noise: Some(DistributedNoise {
                l2_clip: 1.5,
                noise_multiplier: 0.8,
            }),
            ..QuantizationParams::default()
        },
        ..round_config()
    };
    c.json("round-config-distributed-noise", &dp);
    c.json("quantization", &QuantizationParams::default());
    c.json("advertise-keys", &round.keys[0]);
    c.json("directory-entry", &round.directory.entries[0]);
    c.json("key-directory", &round.directory);
    c.json("share-keys", &round.shares[0]);
    c.json("forwarded-shares", &round.forwarded[0]);
    c.json("unmask-request", &round.request);
    c.json("unmask-shares", &round.replies[0]);
    let dropped = UnmaskShares {
        seed_shares: round.replies[0].seed_shares[1..].to_vec(),
        key_shares: round.replies[0].seed_shares[..1].to_vec(),
    };
    c.json("unmask-shares-with-key-share", &dropped);
    c.put("masked-words", encode_words(&round.masked[0]));
    let share = &round.replies[0].seed_shares[0].share;
    c.put("share", share);
    let mut two = share.clone();
    two.extend_from_slice(&round.replies[1].seed_shares[0].share);
    c.put("two-shares", two);
    c.written
}

fn secagg_round_seeds(root: &Path, round: &Round) -> usize {
    let mut c = Corpus::new(root, "secagg_round");
    let all = |op: &str| -> String {
        (1..=ROUND_PARTIES)
            .map(|u| format!("{op}{u}\n"))
            .collect::<String>()
    };
    let honest = format!(
        "{}a\n{}s\n{}m\n{}f\n",
        all("H"),
        all("H"),
        all("H"),
        all("H")
    );
    c.put("honest", &honest);
    let honest_to_m = format!("{}a\n{}s\n{}m\n", all("H"), all("H"), all("H"));
    let h = all("H");
    // Client 6 drops after sharing (its mask key is rebuilt), or after masking (its
    // input still counts).
    let without_6 = h.replace("H6\n", "");
    c.put(
        "dropout-after-sharing",
        format!("{h}a\n{h}s\n{without_6}m\n{without_6}f\n"),
    );
    c.put(
        "dropout-after-masking",
        format!("{h}a\n{h}s\n{h}m\n{without_6}f\n"),
    );
    // Replays and forgeries with real messages, between honest steps.
    let hostile = format!(
        "K7 {k}\nK0 {k}\n{h}K3 {k}\na\nS1 {s}\nS2 {s}\n{h}s\nM1 {w}\nM2 {w}\nX3\n{h}m\nU1 {r}\nU2 {r}\n{h}f\n",
        k = json(&round.keys[1]),
        s = json(&round.shares[0]),
        w = json(&round.masked[0]),
        r = json(&round.replies[0]),
    );
    c.put("hostile-replays", hostile);
    // A hostile server: the client is sent someone else's directory entries, shares and
    // survivor lists.
    let server = format!(
        "{h}a\nD1 {d}\nD2 {d}\n{h}s\nR1 {f}\nR3 {f}\n{h}m\nQ1 {q}\nQ2 {q}\n{h}f\n",
        d = json(&round.directory),
        f = json(&round.forwarded[1]),
        q = json(&round.request),
    );
    c.put("hostile-server", server);
    // The caller folds the inputs: the real sum through `F`, and inputs recorded with
    // `X` (no words), which `f` must then refuse.
    c.put(
        "external-sum",
        format!("{honest_to_m}{h}F {sum}\n", sum = json(&round.sum)),
    );
    c.put(
        "restored-inputs",
        format!(
            "{h}a\n{h}s\nX1\nX2\nX3\nX4\nX5\nm\n{h}f\nF {sum}\n",
            sum = json(&round.sum)
        ),
    );
    c.written
}

/// A message as one line of JSON.
fn json(value: &impl Serialize) -> String {
    serde_json::to_string(value).expect("serialises")
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let round = real_round();
    println!("wire_decode: {} seeds", wire_seeds(&root));
    println!("model_file_decode: {} seeds", model_file_seeds(&root));
    println!(
        "secagg_messages: {} seeds",
        secagg_message_seeds(&root, &round)
    );
    println!("secagg_round: {} seeds", secagg_round_seeds(&root, &round));
}
