//! Server-sent events: each payload is flushed as its own `data:` frame the
//! moment the scheduler produces it, and every stream ends with
//! `data: [DONE]`. Dropping the body (client gone) drops the receiver, which
//! cancels the sequence.

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use colibri_sched::scheduler::Event;
use tokio::sync::mpsc::UnboundedReceiver;

/// Turns one scheduler event into the payloads to send. `last` is true for
/// the final event (Done or Error).
pub trait Framer: Send + 'static {
    fn frame(&mut self, ev: Event) -> Vec<String>;
}

struct State<F> {
    rx: UnboundedReceiver<Event>,
    framer: F,
    queue: std::collections::VecDeque<String>,
    ended: bool,
}

pub fn sse_response<F: Framer>(rx: UnboundedReceiver<Event>, framer: F) -> Response {
    let state = State {
        rx,
        framer,
        queue: Default::default(),
        ended: false,
    };
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(p) = st.queue.pop_front() {
                let frame = format!("data: {p}\n\n");
                return Some((
                    Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(frame)),
                    st,
                ));
            }
            if st.ended {
                return None;
            }
            match st.rx.recv().await {
                Some(ev) => {
                    let end = matches!(ev, Event::Done(_) | Event::Error(_));
                    st.queue.extend(st.framer.frame(ev));
                    if end {
                        st.queue.push_back("[DONE]".into());
                        st.ended = true;
                    }
                }
                None => {
                    // The scheduler dropped the sequence without a final
                    // event (shutdown): still end the stream properly.
                    st.queue.push_back("[DONE]".into());
                    st.ended = true;
                }
            }
        }
    });
    let mut r = Response::new(Body::from_stream(stream));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}
