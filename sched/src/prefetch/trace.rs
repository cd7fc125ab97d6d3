//! Routing traces: the routing decisions of a real run, and what the routers
//! of the next MoE layers guessed at each layer, in a file, so predictors and
//! cache settings can be evaluated offline ([`super::replay`]) by anyone who
//! has a real model, without re-running it or touching a disk.
//!
//! The format is JSON lines: a [`TraceHeader`] first, then one
//! [`TraceRecord`] per MoE layer per step, in execution order. Cross-token
//! guesses need no field: they are the previous step's `experts`.

use std::io::{BufRead, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Written as the first line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// Format version (1).
    pub colibri_routing_trace: u32,
    /// What was run (a path or a model name).
    pub model: String,
    pub num_layers: usize,
    pub moe_layers: Vec<usize>,
    pub experts_per_layer: usize,
    pub top_k: usize,
}

/// One MoE layer of one step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Forward pass, from 1.
    pub step: u64,
    pub layer: usize,
    /// Rows (tokens) of the step: 1 in single-sequence decode.
    pub rows: usize,
    /// The experts the layer used (union over rows, ascending).
    pub experts: Vec<usize>,
    /// The next MoE layer's router applied to this layer's input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_next: Option<Vec<usize>>,
    /// The MoE layer after next's router applied to this layer's input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_second: Option<Vec<usize>>,
}

/// Errors reading or writing a trace, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("routing trace {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("routing trace {path}, line {line}: {reason}")]
    Format {
        path: PathBuf,
        line: usize,
        reason: String,
    },
}

/// Appends records to a trace file.
pub struct TraceWriter {
    path: PathBuf,
    out: BufWriter<std::fs::File>,
}

impl TraceWriter {
    /// Creates (truncates) `path` and writes the header.
    pub fn create(path: &Path, header: &TraceHeader) -> Result<TraceWriter, TraceError> {
        let io = |source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::create(path).map_err(io)?;
        let mut writer = TraceWriter {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
        };
        writer.line(header)?;
        Ok(writer)
    }

    fn line(&mut self, value: &impl Serialize) -> Result<(), TraceError> {
        let io = |source| TraceError::Io {
            path: self.path.clone(),
            source,
        };
        serde_json::to_writer(&mut self.out, value).map_err(|e| io(e.into()))?;
        self.out.write_all(b"\n").map_err(io)
    }

    /// Appends one record.
    pub fn record(&mut self, record: &TraceRecord) -> Result<(), TraceError> {
        self.line(record)
    }

    /// Writes what is buffered.
    pub fn flush(&mut self) -> Result<(), TraceError> {
        self.out.flush().map_err(|source| TraceError::Io {
            path: self.path.clone(),
            source,
        })
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// A whole trace in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    pub header: TraceHeader,
    pub records: Vec<TraceRecord>,
}

impl Trace {
    /// Reads and checks a trace file: header first, layers of the header's
    /// MoE layers, expert ids below the header's expert count.
    pub fn read(path: &Path) -> Result<Trace, TraceError> {
        let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let bad = |line: usize, reason: String| TraceError::Format {
            path: path.to_path_buf(),
            line,
            reason,
        };
        let mut header: Option<TraceHeader> = None;
        let mut records = Vec::new();
        for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
            let n = i + 1;
            let line = line.map_err(|source| TraceError::Io {
                path: path.to_path_buf(),
                source,
            })?;
            if line.trim().is_empty() {
                continue;
            }
            let Some(h) = &header else {
                let parsed: TraceHeader =
                    serde_json::from_str(&line).map_err(|e| bad(n, format!("header: {e}")))?;
                if parsed.colibri_routing_trace != 1 {
                    return Err(bad(
                        n,
                        format!("version {} (expected 1)", parsed.colibri_routing_trace),
                    ));
                }
                if parsed.moe_layers.iter().any(|&l| l >= parsed.num_layers) {
                    return Err(bad(n, "a MoE layer beyond num_layers".into()));
                }
                header = Some(parsed);
                continue;
            };
            let r: TraceRecord = serde_json::from_str(&line).map_err(|e| bad(n, e.to_string()))?;
            if !h.moe_layers.contains(&r.layer) {
                return Err(bad(n, format!("layer {} is not a MoE layer", r.layer)));
            }
            let ids = r
                .experts
                .iter()
                .chain(r.router_next.iter().flatten())
                .chain(r.router_second.iter().flatten());
            if let Some(&e) = ids.into_iter().find(|&&e| e >= h.experts_per_layer) {
                return Err(bad(
                    n,
                    format!("expert {e} of {} per layer", h.experts_per_layer),
                ));
            }
            records.push(r);
        }
        let header = header.ok_or_else(|| bad(0, "empty file (no header)".into()))?;
        Ok(Trace { header, records })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_round_trips_and_bad_lines_are_named() {
        let dir = std::env::temp_dir().join(format!("colibri-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        let header = TraceHeader {
            colibri_routing_trace: 1,
            model: "m".into(),
            num_layers: 3,
            moe_layers: vec![0, 2],
            experts_per_layer: 8,
            top_k: 2,
        };
        let records = vec![
            TraceRecord {
                step: 1,
                layer: 0,
                rows: 1,
                experts: vec![1, 7],
                router_next: Some(vec![2, 3]),
                router_second: None,
            },
            TraceRecord {
                step: 1,
                layer: 2,
                rows: 1,
                experts: vec![2, 5],
                router_next: None,
                router_second: None,
            },
        ];
        let mut w = TraceWriter::create(&path, &header).unwrap();
        for r in &records {
            w.record(r).unwrap();
        }
        w.flush().unwrap();
        drop(w);
        let t = Trace::read(&path).unwrap();
        assert_eq!(t.header, header);
        assert_eq!(t.records, records);

        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("{\"step\":2,\"layer\":0,\"rows\":1,\"experts\":[8]}\n");
        std::fs::write(&path, text).unwrap();
        let err = Trace::read(&path).unwrap_err().to_string();
        assert!(err.contains("line 4") && err.contains("expert 8"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
