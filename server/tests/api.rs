//! The HTTP API against a live server on a loopback port, serving the
//! bundled demo model (random weights, real tokenizer and template).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use colibri_sched::{Engine, EngineOptions};
use colibri_server::{ServedModel, Server, ServerConfig};
use serde_json::{Value, json};

struct Live {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
    _dir: tempfile::TempDir,
}

impl Live {
    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Stops the server as SIGTERM would and returns what `run` returned.
    fn stop(mut self) -> Result<(), String> {
        let _ = self.stop.take().map(|s| s.send(()));
        self.thread
            .take()
            .map(|t| t.join().expect("server thread"))
            .unwrap_or(Ok(()))
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn start(config: ServerConfig, ctx: usize) -> Live {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("demo");
    colibri_model::demo::write_demo_model(&model_dir).unwrap();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let server = Server::bind(ServerConfig { port: 0, ..config })
                .await
                .map_err(|e| e.to_string())?;
            addr_tx.send(server.local_addr()).unwrap();
            let load = move || {
                let engine = Engine::load(
                    &model_dir,
                    &EngineOptions {
                        threads: 2,
                        ctx,
                        tier: colibri_sched::tier::TierOptions {
                            usage: colibri_sched::tier::UsageMode::Off,
                            ..Default::default()
                        },
                        ..EngineOptions::default()
                    },
                )
                .map_err(|e| e.to_string())?;
                let tokenizer = colibri_model::Tokenizer::from_dir(&model_dir)
                    .map_err(|e| e.to_string())?
                    .map(Arc::new);
                Ok(ServedModel {
                    engine: Arc::new(engine),
                    tokenizer,
                    name: "demo".into(),
                    path: model_dir,
                    is_demo: true,
                })
            };
            server
                .run(load, async {
                    let _ = stop_rx.await;
                })
                .await
                .map_err(|e| e.to_string())
        })
    });
    let addr = addr_rx.recv().unwrap();
    let live = Live {
        addr,
        stop: Some(stop_tx),
        thread: Some(thread),
        _dir: dir,
    };
    for _ in 0..500 {
        if let Ok((200, _)) = get(&live, "/health") {
            return live;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("server did not become healthy");
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into()
}

fn get(live: &Live, path: &str) -> Result<(u16, String), ureq::Error> {
    let mut r = agent().get(&live.url(path)).call()?;
    Ok((r.status().as_u16(), r.body_mut().read_to_string()?))
}

fn post_raw(
    live: &Live,
    path: &str,
    body: &[u8],
    key: Option<&str>,
) -> (u16, String, Option<String>) {
    let mut req = agent()
        .post(&live.url(path))
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", &format!("Bearer {k}"));
    }
    let mut r = req.send(body).unwrap();
    let retry = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    (
        r.status().as_u16(),
        r.body_mut().read_to_string().unwrap(),
        retry,
    )
}

fn post(live: &Live, path: &str, body: Value) -> (u16, Value) {
    let (s, b, _) = post_raw(live, path, body.to_string().as_bytes(), None);
    (
        s,
        serde_json::from_str(&b).unwrap_or_else(|_| panic!("not JSON: {b}")),
    )
}

fn chat_body(content: &str, max_tokens: u32) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0})
}

/// A streaming request over a raw socket; returns the `data:` payloads.
fn stream_raw(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    stop_after: Option<usize>,
) -> Vec<String> {
    stream_with(addr, path, body, stop_after, || {})
}

/// [`stream_raw`], calling `on_first` when the first event has arrived
/// (the request is running) before reading on.
fn stream_with(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    stop_after: Option<usize>,
    on_first: impl FnOnce(),
) -> Vec<String> {
    let mut on_first = Some(on_first);
    let mut s = TcpStream::connect(addr).unwrap();
    let b = body.to_string();
    write!(s, "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}", b.len()).unwrap();
    let mut r = BufReader::new(s);
    let mut out = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        if let Some(p) = line.trim_end().strip_prefix("data: ") {
            out.push(p.to_string());
            if let Some(f) = on_first.take() {
                f();
            }
            if stop_after.is_some_and(|n| out.len() >= n) {
                return out; // dropping the socket: the client goes away
            }
        }
    }
    out
}

fn metric(live: &Live, name: &str) -> f64 {
    let (_, text) = get(live, "/metrics").unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("colibri_{name} ")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

fn error_of(v: &Value) -> &Value {
    &v["error"]
}

#[test]
fn chat_completion_stream_and_usage() {
    let live = start(ServerConfig::default(), 0);
    let (s, v) = post(&live, "/v1/chat/completions", chat_body("Hello there", 16));
    assert_eq!(s, 200, "{v}");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 5);

    // Streaming gives the same text, token by token, then a usage chunk and [DONE].
    let mut body = chat_body("Hello there", 16);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let events = stream_raw(live.addr, "/v1/chat/completions", &body, None);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"]
                .get(0)
                .and_then(|ch| ch["delta"]["content"].as_str())
                .map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, text);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 16);
    assert!(chunks.len() >= 10, "tokens must arrive as separate events");

    // Without include_usage: no usage chunk.
    body["stream_options"] = json!({"include_usage": false});
    let events = stream_raw(live.addr, "/v1/chat/completions", &body, None);
    assert!(events.iter().all(|e| !e.contains("\"usage\"")));
    assert_eq!(live.stop(), Ok(()));
}

#[test]
fn stop_sequences_seeds_logprobs_and_completions() {
    let live = start(ServerConfig::default(), 0);
    let (_, v) = post(&live, "/v1/chat/completions", chat_body("Tell me", 30));
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    // A stop string from the middle of the greedy text (may span tokens).
    let start_at = text.char_indices().nth(5).unwrap().0;
    let end_at = text.char_indices().nth(8).map_or(text.len(), |c| c.0);
    let stop = &text[start_at..end_at];
    let mut body = chat_body("Tell me", 30);
    body["stop"] = json!([stop, "zzzz-never"]);
    let (_, v) = post(&live, "/v1/chat/completions", body.clone());
    let cut = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(cut, &text[..text.find(stop).unwrap()]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    body["stream"] = json!(true);
    let streamed: String = stream_raw(live.addr, "/v1/chat/completions", &body, None)
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, cut);

    // Seeds: same seed same text; sampling differs from greedy.
    let sampled = |seed: i64| {
        let mut b = chat_body("Tell me", 24);
        b["temperature"] = json!(1.0);
        b["seed"] = json!(seed);
        post(&live, "/v1/chat/completions", b).1["choices"][0]["message"]["content"].clone()
    };
    assert_eq!(sampled(7), sampled(7));
    assert_ne!(sampled(7), sampled(8));

    // Logprobs.
    let mut b = chat_body("Tell me", 5);
    b["logprobs"] = json!(true);
    b["top_logprobs"] = json!(3);
    let (_, v) = post(&live, "/v1/chat/completions", b);
    let lps = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(lps.len(), 5);
    for lp in lps {
        let alts = lp["top_logprobs"].as_array().unwrap();
        assert_eq!(alts.len(), 3);
        // Greedy: the chosen token is the most probable one.
        assert_eq!(lp["logprob"], alts[0]["logprob"]);
        assert!(lp["logprob"].as_f64().unwrap() <= 0.0);
    }

    // Completions: text prompt with echo and legacy logprobs; token prompt.
    let (s, v) = post(
        &live,
        "/v1/completions",
        json!({"prompt": "abc", "max_tokens": 4, "echo": true, "logprobs": 2, "temperature": 0}),
    );
    assert_eq!(s, 200, "{v}");
    assert!(v["choices"][0]["text"].as_str().unwrap().starts_with("abc"));
    assert_eq!(
        v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
    let (s, v) = post(
        &live,
        "/v1/completions",
        json!({"prompt": [97, 98, 99], "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
}

#[test]
fn hostile_and_malformed_requests_get_clean_errors_and_the_server_survives() {
    let live = start(
        ServerConfig {
            max_body_bytes: 64 << 10,
            ..Default::default()
        },
        64,
    );
    let cases: Vec<(&[u8], u16, &str)> = vec![
        (b"{not json", 400, ""),
        (b"\xff\xfe\xfd", 400, "UTF-8"),
        (br#"{"messages": "x"}"#, 400, "messages"),
        (
            br#"{"messages": [{"role":"user","content":"hi"}], "max_tokens": -5}"#,
            400,
            "max_tokens",
        ),
        (
            br#"{"messages": [{"role":"user","content":"hi"}], "temperature": NaN}"#,
            400,
            "",
        ),
        (
            br#"{"messages": [{"role":"user","content":"hi"}], "temperature": 1e308}"#,
            400,
            "temperature",
        ),
        (
            br#"{"messages": [{"role":"user","content":"hi"}], "n": 3}"#,
            400,
            "n",
        ),
        (
            br#"{"messages": [{"role":"wizard","content":"hi"}]}"#,
            400,
            "role",
        ),
        (br#"{"messages": []}"#, 400, "messages"),
        (
            br#"{"messages": [{"role":"user","content":"hi"}], "model": "gpt-9"}"#,
            404,
            "gpt-9",
        ),
        (br#"[1,2,3]"#, 400, ""),
        (b"", 400, ""),
    ];
    for (body, status, needle) in cases {
        let (s, b, _) = post_raw(&live, "/v1/chat/completions", body, None);
        assert_eq!(s, status, "{} -> {b}", String::from_utf8_lossy(body));
        let v: Value = serde_json::from_str(&b).unwrap();
        let msg = error_of(&v)["message"].as_str().unwrap();
        assert!(
            msg.contains(needle)
                || error_of(&v)["param"]
                    .as_str()
                    .is_some_and(|p| p.contains(needle)),
            "{b}"
        );
    }
    // A million stop strings: refused by the body limit or the stop cap.
    let many: Vec<String> = (0..1_000_000).map(|i| i.to_string()).collect();
    let body = json!({"messages": [{"role":"user","content":"hi"}], "stop": many}).to_string();
    // The server may answer 413 from the Content-Length alone and close
    // while the body is still being sent: write what it takes, then read.
    let mut sock = TcpStream::connect(live.addr).unwrap();
    let _ = write!(
        sock,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let _ = sock.write_all(body.as_bytes());
    let mut resp = String::new();
    let _ = sock.read_to_string(&mut resp);
    assert!(
        resp.starts_with("HTTP/1.1 413"),
        "{}",
        &resp[..resp.len().min(200)]
    );
    assert!(
        resp.contains("\"error\"") && resp.contains("larger than"),
        "{resp}"
    );
    let body = json!({"messages": [{"role":"user","content":"hi"}], "stop": (0..100).map(|i| i.to_string()).collect::<Vec<_>>()});
    assert_eq!(post(&live, "/v1/chat/completions", body).0, 400);
    // Prompt longer than the 64-token context: 400 with both numbers.
    let long = "word ".repeat(40);
    let (s, v) = post(&live, "/v1/chat/completions", chat_body(&long, 4));
    assert_eq!(s, 400);
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("64") && msg.contains("prompt has"), "{msg}");
    // max_tokens past the context is capped, not an error.
    let (s, v) = post(
        &live,
        "/v1/completions",
        json!({"prompt": [97, 98], "max_tokens": 1000, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(s, 200);
    assert_eq!(v["usage"]["completion_tokens"], 62);
    // Unknown endpoint, wrong method.
    assert_eq!(get(&live, "/v1/nothing").unwrap().0, 404);
    assert_eq!(get(&live, "/v1/chat/completions").unwrap().0, 405);
    // Still alive.
    assert_eq!(
        post(&live, "/v1/chat/completions", chat_body("hi", 2)).0,
        200
    );
}

#[test]
fn api_key_guards_everything_but_health() {
    let live = start(
        ServerConfig {
            api_key: Some("sekret".into()),
            ..Default::default()
        },
        0,
    );
    assert_eq!(get(&live, "/health").unwrap().0, 200);
    assert_eq!(get(&live, "/v1/models").unwrap().0, 401);
    assert_eq!(get(&live, "/metrics").unwrap().0, 401);
    let body = chat_body("hi", 2).to_string();
    let (s, b, _) = post_raw(&live, "/v1/chat/completions", body.as_bytes(), None);
    assert_eq!(s, 401);
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap()["error"]["code"],
        "invalid_api_key"
    );
    assert_eq!(
        post_raw(
            &live,
            "/v1/chat/completions",
            body.as_bytes(),
            Some("wrong")
        )
        .0,
        401
    );
    assert_eq!(
        post_raw(
            &live,
            "/v1/chat/completions",
            body.as_bytes(),
            Some("sekret")
        )
        .0,
        200
    );
}

#[test]
fn full_queue_answers_429_with_retry_after() {
    let live = start(
        ServerConfig {
            max_batch: 1,
            max_queue: 0,
            ..Default::default()
        },
        0,
    );
    // The long request's client reads its first event, then holds the
    // connection without reading until the full-queue request has been
    // answered: the long request cannot end early (its client hanging up
    // would cancel it) while the second one is in flight.
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let addr = live.addr;
    let long = std::thread::spawn(move || {
        let body = json!({"prompt": [97], "max_tokens": 4000, "ignore_eos": true, "temperature": 0, "stream": true});
        stream_with(addr, "/v1/completions", &body, Some(40), move || {
            started_tx.send(()).unwrap();
            release_rx.recv().unwrap();
        })
        .len()
    });
    started_rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the long request never streamed");
    assert_eq!(metric(&live, "running"), 1.0);
    let (s, b, retry) = post_raw(
        &live,
        "/v1/completions",
        br#"{"prompt":[97],"max_tokens":2}"#,
        None,
    );
    // Had the long request ended before the second arrived, the second
    // would have been served: say so rather than blame the queue.
    let still_running = metric(&live, "running") == 1.0;
    release_tx.send(()).unwrap();
    assert!(still_running, "the long request ended before the check");
    assert_eq!(s, 429, "{b}");
    assert_eq!(retry.as_deref(), Some("1"));
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap()["error"]["type"],
        "rate_limit_exceeded"
    );
    assert_eq!(long.join().unwrap(), 40);
}

#[test]
fn a_client_that_disconnects_is_cancelled_and_the_next_request_works() {
    let live = start(ServerConfig::default(), 0);
    // Streaming: read a few events, then hang up.
    let body = json!({"prompt": [97], "max_tokens": 3000, "ignore_eos": true, "temperature": 0, "stream": true});
    let got = stream_raw(live.addr, "/v1/completions", &body, Some(5));
    assert_eq!(got.len(), 5);
    let mut cancelled = 0.0;
    for _ in 0..2000 {
        cancelled = metric(&live, "requests_cancelled_total");
        if cancelled >= 1.0 && metric(&live, "running") == 0.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(cancelled, 1.0);
    assert!(metric(&live, "generated_tokens_total") < 3000.0);

    // Non-streaming: send the request and close the socket at once.
    {
        let mut s = TcpStream::connect(live.addr).unwrap();
        let b = json!({"prompt": [98], "max_tokens": 3000, "ignore_eos": true, "temperature": 0})
            .to_string();
        write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..2000 {
        if metric(&live, "requests_cancelled_total") >= 2.0 && metric(&live, "running") == 0.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        metric(&live, "requests_cancelled_total"),
        2.0,
        "non-streaming disconnect must cancel too"
    );
    assert_eq!(metric(&live, "running"), 0.0);
    let (s, v) = post(&live, "/v1/chat/completions", chat_body("after", 3));
    assert_eq!(s, 200, "{v}");
}

#[test]
fn eight_concurrent_streams_equal_single_streams_and_share_expert_reads() {
    let live = start(
        ServerConfig {
            max_batch: 8,
            ..Default::default()
        },
        0,
    );
    let prompts: Vec<String> = (0..8)
        .map(|i| format!("Prompt number {i}: {}", "ab".repeat(i)))
        .collect();
    let single: Vec<String> = prompts
        .iter()
        .map(|p| post(&live, "/v1/chat/completions", chat_body(p, 24)).1["choices"][0]["message"]["content"].as_str().unwrap().to_string())
        .collect();
    let fetched0 = metric(&live, "experts_fetched_total");
    let rows0 = metric(&live, "batch_rows_total");
    let addr = live.addr;
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let mut body = chat_body(p, 24);
            body["stream"] = json!(true);
            std::thread::spawn(move || {
                stream_raw(addr, "/v1/chat/completions", &body, None)
                    .iter()
                    .filter(|e| *e != "[DONE]")
                    .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                    .filter_map(|c| {
                        c["choices"][0]["delta"]["content"]
                            .as_str()
                            .map(str::to_string)
                    })
                    .collect::<String>()
            })
        })
        .collect();
    let together: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(together, single);
    // Routed uses = rows x top_k x MoE layers (demo: top-2, 4 MoE layers);
    // shared fetches read fewer experts than that.
    let rows = metric(&live, "batch_rows_total") - rows0;
    let fetched = metric(&live, "experts_fetched_total") - fetched0;
    assert!(
        fetched < rows * 2.0 * 4.0,
        "{fetched} experts fetched for {rows} rows: reads not shared"
    );
    assert!(metric(&live, "steps_total") > 0.0);
}

#[test]
fn llama_server_endpoints_and_models() {
    let live = start(ServerConfig::default(), 0);
    let (_, v) = post(
        &live,
        "/tokenize",
        json!({"content": "héllo", "with_pieces": true}),
    );
    let ids: Vec<u32> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids.len(), 6, "byte-level: é is two tokens");
    let (_, v) = post(&live, "/detokenize", json!({"tokens": ids}));
    assert_eq!(v["content"], "héllo");
    let (_, v) = post(
        &live,
        "/apply-template",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(
        v["prompt"],
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let (s, body) = get(&live, "/v1/models").unwrap();
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "demo");
    assert!(
        v["data"][0]["owned_by"]
            .as_str()
            .unwrap()
            .contains("RANDOM")
    );
    let (_, text) = get(&live, "/metrics").unwrap();
    for name in [
        "requests_total",
        "generated_tokens_total",
        "queue_depth",
        "cache_hit_rate{tier=\"ram\"}",
        "disk_bytes_read_total",
        "prefetch_recall",
    ] {
        assert!(
            text.contains(&format!("colibri_{name}")),
            "metrics lack {name}"
        );
    }
}

#[test]
fn shutdown_finishes_or_cancels_in_flight_requests_and_returns_ok() {
    let live = start(
        ServerConfig {
            shutdown_grace: Duration::from_millis(300),
            ..Default::default()
        },
        0,
    );
    let addr = live.addr;
    // A short request finishes within the grace period; a long one is cut.
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let short_started = started_tx.clone();
    let short = std::thread::spawn(move || {
        let body = json!({"prompt": [97], "max_tokens": 20, "ignore_eos": true, "temperature": 0, "stream": true});
        stream_with(addr, "/v1/completions", &body, None, move || {
            short_started.send(()).unwrap()
        })
    });
    let long = std::thread::spawn(move || {
        let body = json!({"prompt": [98], "max_tokens": 4000, "ignore_eos": true, "temperature": 0, "stream": true});
        stream_with(addr, "/v1/completions", &body, None, move || {
            started_tx.send(()).unwrap()
        })
    });
    // Both requests have streamed (the long one runs for seconds), however
    // slowly the machine starts them.
    for _ in 0..2 {
        started_rx
            .recv_timeout(Duration::from_secs(120))
            .expect("a request never streamed");
    }
    assert_eq!(live.stop(), Ok(()));
    let short = short.join().unwrap();
    let long = long.join().unwrap();
    assert_eq!(short.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(
        long.last().map(String::as_str),
        Some("[DONE]"),
        "a cut stream still ends properly"
    );
    let tokens = |ev: &[String]| {
        ev.iter()
            .filter(|e| e.contains("\"text\":\"") && !e.contains("finish_reason\":\""))
            .count()
    };
    assert!(tokens(&long) < 4000);
    assert!(tokens(&short) >= 19);
}
