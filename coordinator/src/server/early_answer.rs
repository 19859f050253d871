//! Answering a request before its body has arrived (a 413 for an oversized upload, a 401
//! or 429 before the body is looked at) so that the client sees the answer.
//!
//! A handler that refuses a request drops its body unread. Over HTTP/2 hyper then resets
//! the stream, and clients that are still sending (curl, httpx) report the reset instead
//! of the answer that came before it: curl fails with "Stream error in the HTTP/2 framing
//! layer" and prints no status, httpx waits for flow-control credit until its timeout.
//! Over HTTP/1.1 hyper answers and closes the connection, and a client that reuses it
//! for its next request at that moment meets a TLS EOF instead of an answer.
//! [`keep_reading`] wraps every request body so that, dropped before its end, it is read
//! on (and thrown away) in the background for a bounded while: the answer goes out, the
//! client finishes sending and reads it, and the stream ends cleanly (the connection
//! stays usable). Past the bounds the stream is reset, or the connection closed, as
//! before, so a client that never stops sending costs at most [`DRAIN_BYTES`] and
//! [`DRAIN_TIME`].

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;

/// The most bytes of an abandoned body read on after the answer.
pub const DRAIN_BYTES: u64 = 256 * 1024 * 1024;
/// The longest an abandoned body is read on after the answer.
pub const DRAIN_TIME: Duration = Duration::from_secs(30);

/// Middleware: wraps the body of each request in [`DrainOnDrop`].
pub async fn keep_reading(request: Request, next: Next) -> Response {
    let request = request.map(|body| Body::new(DrainOnDrop { inner: Some(body) }));
    next.run(request).await
}

/// A request body that, dropped before its end, is read to its end (within bounds) by a
/// background task instead of being abandoned.
struct DrainOnDrop {
    /// `None` once the body has ended (or been handed to the drain).
    inner: Option<Body>,
}

impl HttpBody for DrainOnDrop {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.inner = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| http_body::SizeHint::with_exact(0), HttpBody::size_hint)
    }
}

impl Drop for DrainOnDrop {
    fn drop(&mut self) {
        let Some(body) = self.inner.take() else {
            return;
        };
        if body.is_end_stream() {
            return;
        }
        // Outside a runtime (a test building requests by hand) there is nothing to
        // drain with; the body is dropped as before.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(drain(body));
        }
    }
}

/// Reads `body` to its end, or until [`DRAIN_BYTES`] or [`DRAIN_TIME`], discarding it.
async fn drain(body: Body) {
    use http_body_util::BodyExt;
    let read = async move {
        let mut body = body;
        let mut total = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                total += data.len() as u64;
                if total > DRAIN_BYTES {
                    break;
                }
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, read).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    type Item = Result<http_body::Frame<Bytes>, axum::Error>;

    /// A body fed by a channel of one slot: its sender blocks unless someone reads.
    fn channel_body() -> (tokio::sync::mpsc::Sender<Item>, Body) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Item>(1);
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        (tx, Body::new(http_body_util::StreamBody::new(stream)))
    }

    /// Dropped before its end, the body is read on by a task: its sender (the client)
    /// can send the rest instead of stalling.
    #[tokio::test]
    async fn an_abandoned_body_is_read_to_its_end() {
        let (tx, body) = channel_body();
        let mut wrapped = DrainOnDrop { inner: Some(body) };
        tx.send(Ok(http_body::Frame::data(Bytes::from_static(b"first"))))
            .await
            .unwrap();
        wrapped.frame().await.unwrap().unwrap();
        drop(wrapped);
        let rest = async {
            for _ in 0..100 {
                tx.send(Ok(http_body::Frame::data(Bytes::from_static(b"more"))))
                    .await
                    .unwrap();
            }
        };
        tokio::time::timeout(Duration::from_secs(10), rest)
            .await
            .expect("the rest of the body is read");
    }

    /// A body read to its end leaves nothing to drain.
    #[tokio::test]
    async fn a_finished_body_is_not_drained() {
        let mut body = DrainOnDrop {
            inner: Some(Body::from("done")),
        };
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "done");
        assert!(body.frame().await.is_none());
        assert!(body.inner.is_none());
    }
}
