//! The HTTP client of the coordinator's REST API: enrol, check in, fetch the model,
//! upload an update, and each stage of a secure round.

use std::time::Duration;

use cohort_aggregation::secagg::{
    AdvertiseKeys, Confirmation, ForwardedShares, GraphReveal, KeyDirectory, Roster, ShareKeys,
    UnmaskRequest, UnmaskShares,
};
use cohort_aggregation::{ModelVector, wire};
use serde::Serialize;
use uuid::Uuid;

use super::messages::{
    CheckIn, DirectoryReply, EnrolRequest, ErrorBody, EvaluationReport, FailureReport,
    IdentityRegistered, IdentityRequest, RosterReply, SharesReply, SurvivorsReply, WithheldReason,
};
use super::routes;
use super::{CheckInReply, Credential, Task};

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The coordinator answered with an error.
    #[error("coordinator answered {status} {code}: {message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// The error body's code.
        code: String,
        /// The error body's message.
        message: String,
    },
    /// The request did not get an answer (connection refused, TLS, timeout).
    #[error("cannot reach the coordinator: {0}")]
    Transport(#[from] reqwest::Error),
    /// The answer was not what the protocol says.
    #[error("unexpected answer from the coordinator: {0}")]
    Protocol(String),
    /// The coordinator URL is not one this client sends its credential to.
    #[error(transparent)]
    Url(#[from] UrlError),
}

/// Why a coordinator URL is not used. Checked before anything is sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// Not an `https://` URL (nor an `http://` one).
    #[error(
        "the coordinator URL `{0}` is not an https:// URL (such as https://coordinator.example:8443)"
    )]
    NotHttps(String),
    /// Plain HTTP without the explicit permission.
    #[error(
        "refusing the plain HTTP coordinator `{0}`: the enrolment token, the client's \
         credential and its updates would cross the network unencrypted. Use an https:// \
         URL, or, for a test or a network you trust end to end, allow plain HTTP \
         explicitly (cohort-edge --insecure-http; `insecure_http` in the C and Python APIs)"
    )]
    PlainHttp(String),
}

/// Checks a coordinator URL before anything is sent to it: `https://`, or `http://`
/// only when `insecure_http` says so. Loopback addresses get no exemption: a local
/// proxy may forward anywhere, and a test that speaks plain HTTP says so.
pub fn check_coordinator_url(url: &str, insecure_http: bool) -> Result<(), UrlError> {
    // The URL as shown in errors: at most its scheme, host and port, so that anything
    // else written into it (a user name and password) is never printed.
    let shown = |u: &reqwest::Url| {
        let host = u.host_str().unwrap_or("");
        match u.port() {
            Some(port) => format!("{}://{host}:{port}", u.scheme()),
            None => format!("{}://{host}", u.scheme()),
        }
    };
    let parsed = reqwest::Url::parse(url.trim()).ok();
    match parsed {
        Some(u) if u.scheme() == "https" && u.has_host() => Ok(()),
        Some(u) if u.scheme() == "http" && u.has_host() => {
            if insecure_http {
                Ok(())
            } else {
                Err(UrlError::PlainHttp(shown(&u)))
            }
        }
        Some(u) if u.has_host() => Err(UrlError::NotHttps(shown(&u))),
        _ => Err(UrlError::NotHttps(
            url.chars().take(80).filter(|c| !c.is_control()).collect(),
        )),
    }
}

impl ProtocolError {
    /// True when trying again later may succeed: the coordinator is unreachable,
    /// overloaded or failing, rather than refusing this request for good.
    pub fn is_retryable(&self) -> bool {
        match self {
            ProtocolError::Transport(_) => true,
            ProtocolError::Refused { status, .. } => *status >= 500 || *status == 429,
            ProtocolError::Protocol(_) | ProtocolError::Url(_) => false,
        }
    }

    /// True when the coordinator already holds this exact message (a retry whose first
    /// try got through but whose answer was lost).
    pub fn is_already_sent(&self) -> bool {
        matches!(self, ProtocolError::Refused { status: 409, code, .. } if code == "already_sent")
    }

    /// True when the credential itself is refused (unknown, wrong or revoked).
    pub fn is_credential_refused(&self) -> bool {
        matches!(
            self,
            ProtocolError::Refused {
                status: 401 | 403,
                ..
            }
        )
    }
}

/// A mutual-TLS identity as [`CoordinatorClient::with_identity`] takes it: the
/// certificate chain file, then the private key file, both PEM. On failure, the file
/// that could not be read and why.
pub fn read_identity(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<Vec<u8>, (std::path::PathBuf, std::io::Error)> {
    let read = |path: &std::path::Path| std::fs::read(path).map_err(|e| (path.to_path_buf(), e));
    let mut pem = read(cert)?;
    pem.push(b'\n');
    pem.extend_from_slice(&read(key)?);
    Ok(pem)
}

/// The longest one request may take, long polls and large uploads included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// An HTTP client for one coordinator.
#[derive(Debug, Clone)]
pub struct CoordinatorClient {
    base: String,
    http: reqwest::Client,
    /// Bytes of updates the coordinator acknowledged (plain, compressed or masked), for
    /// the site's own log of what it sent.
    sent: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

async fn checked(response: reqwest::Response) -> Result<reqwest::Response, ProtocolError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let text = response.text().await.unwrap_or_default();
    let (code, message) = match serde_json::from_str::<ErrorBody>(&text) {
        Ok(e) => (e.error.code, e.error.message),
        Err(_) => ("unknown".into(), text.chars().take(200).collect()),
    };
    Err(ProtocolError::Refused {
        status: status.as_u16(),
        code,
        message,
    })
}

impl CoordinatorClient {
    /// A client for the coordinator at `base` (`https://host:port`), trusting only
    /// `ca_pem` when given, else the system's roots. A plain `http://` base is refused
    /// ([`check_coordinator_url`]).
    pub fn new(base: &str, ca_pem: Option<&[u8]>) -> Result<Self, ProtocolError> {
        Self::with_identity(base, ca_pem, None, false)
    }

    /// Like [`new`](Self::new); with `identity_pem` (a certificate chain and its private
    /// key, PEM), the client presents that certificate to a coordinator that requires
    /// mutual TLS. `insecure_http` allows a plain `http://` base, over which the
    /// credential travels unencrypted.
    pub fn with_identity(
        base: &str,
        ca_pem: Option<&[u8]>,
        identity_pem: Option<&[u8]>,
        insecure_http: bool,
    ) -> Result<Self, ProtocolError> {
        check_coordinator_url(base, insecure_http)?;
        // reqwest is built without a crypto provider of its own; ring is the one.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(REQUEST_TIMEOUT);
        // reqwest sets TCP_USER_TIMEOUT to 30 s. With keepalive on, Linux then aborts a
        // connection that has received nothing for 30 s as soon as one keepalive probe
        // goes unanswered. A check-in long poll is silent for up to 30 s by design (a
        // little longer when the coordinator is busy), so a single lost probe cut it: of
        // 10,000 polls held on one coordinator, 12 to 15% failed with `timed out` (see
        // the secure_load bench). The transport now gives up no sooner than the request.
        #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
        {
            builder = builder.tcp_user_timeout(REQUEST_TIMEOUT);
        }
        if let Some(pem) = ca_pem {
            let ca = reqwest::Certificate::from_pem(pem)?;
            builder = builder.tls_certs_only([ca]);
        }
        if let Some(pem) = identity_pem {
            builder = builder.identity(reqwest::Identity::from_pem(pem)?);
        }
        Ok(Self {
            base: base.trim_end_matches('/').to_string(),
            http: builder.build()?,
            sent: Default::default(),
        })
    }

    /// Bytes of updates the coordinator has acknowledged over this client's life (a
    /// retried upload counts once per acknowledgement).
    pub fn update_bytes_sent(&self) -> u64 {
        self.sent.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn count_sent(&self, bytes: usize) {
        self.sent
            .fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Asks whether the coordinator is up (`GET /api/v1/health`): a quick first contact,
    /// so that a wrong address or certificate is reported at once instead of retried.
    pub async fn health(&self) -> Result<(), ProtocolError> {
        let r = self.http.get(self.url("/api/v1/health")).send().await?;
        checked(r).await?;
        Ok(())
    }

    /// Spends an enrolment token and returns the new credential.
    pub async fn enrol(
        &self,
        token: &str,
        identity: &[u8; 32],
    ) -> Result<Credential, ProtocolError> {
        let r = self
            .http
            .post(self.url(routes::ENROL))
            .json(&EnrolRequest {
                token: token.to_string(),
                identity: Some(b64(identity)),
            })
            .send()
            .await?;
        Ok(checked(r).await?.json().await?)
    }

    /// Registers this client's identity (a no-op when the coordinator already has it);
    /// returns the fingerprint the coordinator shows its admin.
    pub async fn register_identity(
        &self,
        cred: &Credential,
        identity: &[u8; 32],
    ) -> Result<String, ProtocolError> {
        let r = self
            .http
            .put(self.url(routes::IDENTITY))
            .bearer_auth(cred.bearer())
            .json(&IdentityRequest {
                identity: b64(identity),
            })
            .send()
            .await?;
        let reply: IdentityRegistered = checked(r).await?.json().await?;
        Ok(reply.fingerprint)
    }

    /// Checks in and waits up to `wait_seconds` for a task.
    pub async fn checkin(
        &self,
        cred: &Credential,
        wait_seconds: u64,
    ) -> Result<Option<Task>, ProtocolError> {
        let r = self
            .http
            .post(self.url(routes::CHECKIN))
            .bearer_auth(cred.bearer())
            .json(&CheckIn { wait_seconds })
            .send()
            .await?;
        let reply: CheckInReply = checked(r).await?.json().await?;
        Ok(reply.task)
    }

    /// The experiment's current global model in `layout`.
    pub async fn model(
        &self,
        cred: &Credential,
        experiment: Uuid,
        layout: &std::sync::Arc<cohort_aggregation::Layout>,
    ) -> Result<ModelVector, ProtocolError> {
        Ok(self.versioned_model(cred, experiment, layout).await?.0)
    }

    /// The experiment's current global model in `layout`, and its version (the round
    /// that published it).
    pub async fn versioned_model(
        &self,
        cred: &Credential,
        experiment: Uuid,
        layout: &std::sync::Arc<cohort_aggregation::Layout>,
    ) -> Result<(ModelVector, i64), ProtocolError> {
        let r = self
            .http
            .get(self.url(&routes::for_experiment(routes::MODEL, experiment)))
            .bearer_auth(cred.bearer())
            .send()
            .await?;
        let r = checked(r).await?;
        let version = r
            .headers()
            .get("x-cohort-round")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<i64>().ok())
            .ok_or_else(|| ProtocolError::Protocol("global model without x-cohort-round".into()))?;
        let compression = match r.headers().get("x-cohort-compression") {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .ok()
                    .and_then(|v| v.parse::<cohort_aggregation::compress::Compression>().ok())
                    .ok_or_else(|| {
                        ProtocolError::Protocol(format!("global model compressed as {v:?}"))
                    })?,
            ),
        };
        let bytes = r.bytes().await?;
        let model = match compression {
            None => wire::decode(layout, &bytes)
                .map_err(|e| ProtocolError::Protocol(format!("global model: {e}")))?,
            // Compressed with a rotation the coordinator picked (the header says which):
            // a coordinator could only spoil its own model with another.
            Some(scheme) => {
                let expected = cohort_aggregation::compress::Expected {
                    dimension: layout.len(),
                    rotation_seed: None,
                };
                let values = scheme
                    .decode(&bytes, &expected)
                    .map_err(|e| ProtocolError::Protocol(format!("global model: {e}")))?;
                ModelVector::new(layout.clone(), values)
                    .map_err(|e| ProtocolError::Protocol(format!("global model: {e}")))?
            }
        };
        Ok((model, version))
    }

    /// Reports this client's evaluation of model `version` of `experiment`.
    pub async fn report_evaluation(
        &self,
        cred: &Credential,
        experiment: Uuid,
        version: i64,
        evaluation: &crate::trainer::ReportedEvaluation,
    ) -> Result<(), ProtocolError> {
        let body = EvaluationReport {
            model_version: version,
            num_examples: Some(i64::try_from(evaluation.num_examples).unwrap_or(i64::MAX)),
            metrics: evaluation.metrics.clone(),
            withheld: None,
        };
        self.post_json(
            cred,
            &routes::for_experiment(routes::EVALUATIONS, experiment),
            &body,
        )
        .await
    }

    /// Tells the coordinator this client keeps its evaluation of model `version` of
    /// `experiment` to itself, because it runs under local differential privacy: the
    /// report carries no number of its data, and the client is not asked again.
    pub async fn withhold_evaluation(
        &self,
        cred: &Credential,
        experiment: Uuid,
        version: i64,
    ) -> Result<(), ProtocolError> {
        let body = EvaluationReport {
            model_version: version,
            num_examples: None,
            metrics: Default::default(),
            withheld: Some(WithheldReason::LocalDifferentialPrivacy),
        };
        self.post_json(
            cred,
            &routes::for_experiment(routes::EVALUATIONS, experiment),
            &body,
        )
        .await
    }

    /// Reports that this client could not complete `task`, and why.
    pub async fn report_failure(
        &self,
        cred: &Credential,
        task: &Task,
        reason: &str,
    ) -> Result<(), ProtocolError> {
        let url = routes::for_attempt(
            routes::FAILURE,
            task.experiment_id,
            task.round,
            task.attempt,
        );
        self.post_json(cred, &url, &FailureReport::new(reason))
            .await
    }

    fn secagg_url(task: &Task, what: &str) -> String {
        routes::for_attempt(
            &routes::secagg_template(what),
            task.experiment_id,
            task.round,
            task.attempt,
        )
    }

    async fn post_json<T: Serialize>(
        &self,
        cred: &Credential,
        path: &str,
        body: &T,
    ) -> Result<(), ProtocolError> {
        let r = self
            .http
            .post(self.url(path))
            .bearer_auth(cred.bearer())
            .json(body)
            .send()
            .await?;
        match checked(r).await {
            Ok(_) => Ok(()),
            Err(e) if e.is_already_sent() => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        cred: &Credential,
        path: &str,
        wait_seconds: u64,
    ) -> Result<T, ProtocolError> {
        let r = self
            .http
            .get(self.url(&format!("{path}?wait_seconds={wait_seconds}")))
            .bearer_auth(cred.bearer())
            .send()
            .await?;
        Ok(checked(r).await?.json().await?)
    }

    /// Secure round, stage 1: sends this client's public keys.
    pub async fn advertise_keys(
        &self,
        cred: &Credential,
        task: &Task,
        keys: &AdvertiseKeys,
    ) -> Result<(), ProtocolError> {
        self.post_json(cred, &Self::secagg_url(task, "keys"), keys)
            .await
    }

    /// The roster (members and their graph commitments) once advertising has closed
    /// (`None` while it has not, after waiting up to `wait_seconds`).
    pub async fn roster(
        &self,
        cred: &Credential,
        task: &Task,
        wait_seconds: u64,
    ) -> Result<Option<Roster>, ProtocolError> {
        let r: RosterReply = self
            .get_json(cred, &Self::secagg_url(task, "roster"), wait_seconds)
            .await?;
        Ok(r.roster)
    }

    /// Secure round: reveals this client's graph nonce.
    pub async fn send_reveal(
        &self,
        cred: &Credential,
        task: &Task,
        reveal: &GraphReveal,
    ) -> Result<(), ProtocolError> {
        self.post_json(cred, &Self::secagg_url(task, "reveal"), reveal)
            .await
    }

    /// The key directory once revealing has closed (`None` while it has not, after
    /// waiting up to `wait_seconds`).
    pub async fn key_directory(
        &self,
        cred: &Credential,
        task: &Task,
        wait_seconds: u64,
    ) -> Result<Option<KeyDirectory>, ProtocolError> {
        let r: DirectoryReply = self
            .get_json(cred, &Self::secagg_url(task, "keys"), wait_seconds)
            .await?;
        Ok(r.directory)
    }

    /// Secure round, stage 2: sends the encrypted shares.
    pub async fn send_shares(
        &self,
        cred: &Credential,
        task: &Task,
        shares: &ShareKeys,
    ) -> Result<(), ProtocolError> {
        self.post_json(cred, &Self::secagg_url(task, "shares"), shares)
            .await
    }

    /// The neighbours' shares for this client once sharing has closed.
    pub async fn forwarded_shares(
        &self,
        cred: &Credential,
        task: &Task,
        wait_seconds: u64,
    ) -> Result<Option<ForwardedShares>, ProtocolError> {
        let r: SharesReply = self
            .get_json(cred, &Self::secagg_url(task, "shares"), wait_seconds)
            .await?;
        Ok(r.shares)
    }

    /// Secure round, stage 3: uploads the masked input, the only form in which the
    /// update leaves the machine. `upload_id` is the same for every retry of it.
    pub async fn upload_masked(
        &self,
        cred: &Credential,
        task: &Task,
        masked: &[u32],
        upload_id: Uuid,
    ) -> Result<(), ProtocolError> {
        let url = format!(
            "{}?upload_id={upload_id}",
            routes::for_attempt(routes::UPDATE, task.experiment_id, task.round, task.attempt)
        );
        // The model words travel in the round's width (narrower than 32 bits when the
        // experiment compresses uploads), the weight and loss words in 32.
        let (dimension, word_bits) = match &task.secure_aggregation {
            Some(secure) => (
                secure.config.dimension,
                secure.config.validate().map_or(32, |q| q.word_bits()),
            ),
            None => (
                masked
                    .len()
                    .saturating_sub(cohort_aggregation::secagg::EXTRA_WORDS),
                32,
            ),
        };
        let body =
            cohort_aggregation::secagg::messages::encode_masked(masked, dimension, word_bits);
        let bytes = body.len();
        let r = self
            .http
            .post(self.url(&url))
            .bearer_auth(cred.bearer())
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(body)
            .send()
            .await?;
        checked(r).await?;
        self.count_sent(bytes);
        Ok(())
    }

    /// The survivors once masked input collection has closed.
    pub async fn survivors(
        &self,
        cred: &Credential,
        task: &Task,
        wait_seconds: u64,
    ) -> Result<Option<UnmaskRequest>, ProtocolError> {
        let r: SurvivorsReply = self
            .get_json(cred, &Self::secagg_url(task, "survivors"), wait_seconds)
            .await?;
        Ok(r.request)
    }

    /// Consistency check: sends this client's signature over the survivor list.
    pub async fn send_confirmation(
        &self,
        cred: &Credential,
        task: &Task,
        confirmation: &Confirmation,
    ) -> Result<(), ProtocolError> {
        self.post_json(cred, &Self::secagg_url(task, "confirm"), confirmation)
            .await
    }

    /// Consistency check: the survivor list with this client's neighbours' signatures
    /// over it, once confirming has closed.
    pub async fn unmask_request(
        &self,
        cred: &Credential,
        task: &Task,
        wait_seconds: u64,
    ) -> Result<Option<UnmaskRequest>, ProtocolError> {
        let r: SurvivorsReply = self
            .get_json(cred, &Self::secagg_url(task, "unmask"), wait_seconds)
            .await?;
        Ok(r.request)
    }

    /// Secure round, last stage: reveals the shares the server is owed.
    pub async fn send_unmask(
        &self,
        cred: &Credential,
        task: &Task,
        shares: &UnmaskShares,
    ) -> Result<(), ProtocolError> {
        self.post_json(cred, &Self::secagg_url(task, "unmask"), shares)
            .await
    }

    /// Uploads a trained update for `task`. `upload_id` is the same for every retry of
    /// it, so that a retry whose first try was stored is recognised (200) rather than
    /// counted twice or refused.
    pub async fn upload(
        &self,
        cred: &Credential,
        task: &Task,
        params: &ModelVector,
        num_samples: usize,
        train_loss: f64,
        upload_id: Uuid,
    ) -> Result<(), ProtocolError> {
        self.upload_body(
            cred,
            task,
            wire::encode(params),
            num_samples,
            train_loss,
            upload_id,
        )
        .await
    }

    /// Uploads a body the caller encoded as the task's `upload` says (a compressed
    /// difference, for `compressed_difference`), with the same query as
    /// [`upload`](Self::upload).
    pub async fn upload_body(
        &self,
        cred: &Credential,
        task: &Task,
        body: Vec<u8>,
        num_samples: usize,
        train_loss: f64,
        upload_id: Uuid,
    ) -> Result<(), ProtocolError> {
        let bytes = body.len();
        let mut url = format!(
            "{}?num_samples={num_samples}&upload_id={upload_id}",
            routes::for_attempt(routes::UPDATE, task.experiment_id, task.round, task.attempt)
        );
        if train_loss.is_finite() {
            url.push_str(&format!("&train_loss={train_loss}"));
        }
        let r = self
            .http
            .post(self.url(&url))
            .bearer_auth(cred.bearer())
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(body)
            .send()
            .await?;
        checked(r).await?;
        self.count_sent(bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A plain-HTTP coordinator on `127.0.0.1` that answers the first request on its first
    /// connection with `body` and then holds the connection open; its address.
    async fn answer_once(body: &'static str) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = vec![0u8; 64 * 1024];
            let _ = socket.read(&mut request).await.unwrap();
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            socket.write_all(head.as_bytes()).await.unwrap();
            socket.write_all(body.as_bytes()).await.unwrap();
            let _ = socket.read(&mut request).await;
        });
        addr
    }

    /// `TCP_USER_TIMEOUT` of this process's TCP connection to `peer`, found among its
    /// open descriptors.
    #[cfg(target_os = "linux")]
    fn user_timeout_to(peer: std::net::SocketAddr) -> Duration {
        use rustix::process::{PidfdFlags, PidfdGetfdFlags, getpid, pidfd_getfd, pidfd_open};
        let me = pidfd_open(getpid(), PidfdFlags::empty()).unwrap();
        for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
            let Some(number) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            // A duplicate of our own descriptor, without unsafe code.
            let Ok(fd) = pidfd_getfd(&me, number, PidfdGetfdFlags::empty()) else {
                continue;
            };
            let to_peer = rustix::net::getpeername(&fd)
                .ok()
                .flatten()
                .and_then(|a| std::net::SocketAddr::try_from(a).ok());
            if to_peer == Some(peer) {
                let ms = rustix::net::sockopt::tcp_user_timeout(&fd).unwrap();
                return Duration::from_millis(ms.into());
            }
        }
        panic!("no connection to {peer}");
    }

    /// Only https:// is used unless plain HTTP is asked for, loopback included; what an
    /// error shows of the URL is its scheme, host and port, never a password in it.
    #[test]
    fn coordinator_urls_are_https_unless_plain_http_is_asked_for() {
        for ok in [
            "https://127.0.0.1:8443",
            "https://fl.example",
            "HTTPS://fl.example:1/",
        ] {
            assert_eq!(check_coordinator_url(ok, false), Ok(()), "{ok}");
        }
        for plain in [
            "http://127.0.0.1:8443",
            "http://localhost",
            "http://[::1]:80",
            "HTTP://fl.example",
        ] {
            assert!(
                matches!(
                    check_coordinator_url(plain, false),
                    Err(UrlError::PlainHttp(_))
                ),
                "{plain}"
            );
            assert_eq!(check_coordinator_url(plain, true), Ok(()), "{plain}");
        }
        for bad in [
            "ftp://fl.example",
            "fl.example:8443",
            "",
            "https://",
            "unix:/tmp/s",
        ] {
            assert!(
                matches!(check_coordinator_url(bad, true), Err(UrlError::NotHttps(_))),
                "{bad:?}"
            );
        }
        let e = check_coordinator_url("http://user:hunter2@fl.example:80/x", false).unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
        assert!(e.to_string().contains("--insecure-http"), "{e}");
        assert!(matches!(
            CoordinatorClient::new("http://127.0.0.1:1", None),
            Err(ProtocolError::Url(UrlError::PlainHttp(_)))
        ));
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn connections_outlast_the_longest_long_poll() {
        // With reqwest's default of 30 s, a check-in held for its full 30 s was cut
        // (`timed out`) as soon as one keepalive probe went unanswered.
        let peer = answer_once(r#"{"task":null}"#).await;
        let client =
            CoordinatorClient::with_identity(&format!("http://{peer}"), None, None, true).unwrap();
        let cred = Credential {
            client_id: Uuid::nil(),
            secret: "secret".into(),
        };
        assert_eq!(client.checkin(&cred, 0).await.unwrap(), None);
        let timeout = user_timeout_to(peer);
        assert!(
            timeout >= REQUEST_TIMEOUT,
            "TCP_USER_TIMEOUT {timeout:?} would cut a long poll before the request's own \
             {REQUEST_TIMEOUT:?} timeout"
        );
    }
}
