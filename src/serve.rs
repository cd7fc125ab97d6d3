//! `colibri serve`: the OpenAI-compatible server.

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use colibri_server::{ServedModel, Server, ServerConfig};

use crate::common::{ModelArgs, load};

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to bind (127.0.0.1 keeps the server private to this machine).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    /// Also read from COLIBRI_API_KEY.
    #[arg(long, env = "COLIBRI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Requests that may wait for a place in the batch; more get 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Sequences decoding together.
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Name clients use for the model (default: the directory name).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
}

pub fn main(args: ServeArgs) -> Result<()> {
    if args.max_batch == 0 {
        anyhow::bail!("--max-batch must be at least 1");
    }
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_queue: args.max_queue,
        max_batch: args.max_batch,
        max_body_bytes: args.max_body_bytes,
        ..Default::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get().min(4)))
        .thread_name("colibri-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let server = Server::bind(config).await?;
        let addr = server.local_addr();
        tracing::info!("listening on http://{addr} (OpenAI API at http://{addr}/v1)");
        let model_args = args.model.clone();
        let name = args.model_name.clone();
        let loader = move || -> Result<ServedModel, String> {
            let loaded = load(&model_args).map_err(|e| format!("{e:#}"))?;
            let name = name.unwrap_or_else(|| {
                if loaded.is_demo {
                    colibri_model::demo::DEMO_MODEL_NAME.to_string()
                } else {
                    loaded
                        .path
                        .file_name()
                        .and_then(|n| n.to_str())
                        .unwrap_or("model")
                        .to_string()
                }
            });
            Ok(ServedModel {
                engine: Arc::new(loaded.engine),
                tokenizer: loaded.tokenizer,
                name,
                path: loaded.path,
                is_demo: loaded.is_demo,
            })
        };
        server.run(loader, shutdown_signal()).await?;
        tracing::info!("stopped");
        Ok(())
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
