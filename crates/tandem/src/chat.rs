//! `tandem chat`: an interactive terminal chat against a running tandem (or any OpenAI-compatible) server,
//! or, with `--local`, against a model served inside this process.

use std::io::Write;

use anyhow::{bail, Context, Result};
use clap::Args;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::config::{EngineSettings, Settings};
use crate::serve::LocalServer;

/// Flags of `tandem chat`.
#[derive(Clone, Debug, Args)]
pub struct ChatArgs {
    /// Base URL of the server (ignored with --local).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Load the model in this process instead of talking to a running server.
    #[arg(long)]
    pub local: bool,
    /// With --local: GGUF file or HF folder (default: the default model, fetched if missing).
    #[arg(long, requires = "local")]
    pub model_path: Option<std::path::PathBuf>,
    /// With --local: engine knobs, as for `tandem serve`.
    #[command(flatten)]
    pub engine: EngineSettings,
    /// With --local and --device cuda: CUDA backend flags, as for `tandem serve`.
    #[command(flatten)]
    pub cuda: crate::cuda_settings::CudaSettings,
    /// Model name (default: the server's first model).
    #[arg(long)]
    pub model: Option<String>,
    /// Bearer token, if the server requires one.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// PEM CA certificate(s) to trust for an https --url (a server whose certificate a private CA signed).
    #[arg(long, value_name = "FILE")]
    pub ca_cert: Option<std::path::PathBuf>,
    /// System prompt that starts the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Completion length cap per answer.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: u32,
    /// Sampling temperature.
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    /// Do not show a reasoning model's thinking (`reasoning_content`); it is never sent back either way.
    #[arg(long)]
    pub hide_reasoning: bool,
}

/// Splits complete SSE events off the front of `buf`, returning the `data:` payloads.
fn drain_events(buf: &mut String) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(end) = buf.find("\n\n") {
        let event: String = buf.drain(..end + 2).collect();
        for line in event.lines() {
            if let Some(data) = line.strip_prefix("data:") {
                out.push(data.trim_start().to_owned());
            }
        }
    }
    out
}

/// What one chat chunk adds: thinking (`reasoning_content`, from a server's reasoning parser) and answer.
#[derive(Debug, Default, PartialEq)]
struct Delta {
    reasoning: String,
    content: String,
}

/// The deltas of one chat chunk, or the error message an error event carries.
fn chunk_delta(data: &str) -> Result<Delta> {
    let v: Value = serde_json::from_str(data).with_context(|| format!("bad event: {data}"))?;
    if let Some(err) = v.get("error") {
        bail!(
            "server error: {}",
            err["message"].as_str().unwrap_or("unknown")
        );
    }
    let delta = &v["choices"][0]["delta"];
    let text = |key: &str| delta[key].as_str().unwrap_or_default().to_owned();
    Ok(Delta {
        reasoning: text("reasoning_content"),
        content: text("content"),
    })
}

/// Where the thinking goes: stderr, dimmed on a terminal, so stdout carries the answers alone.
struct Thinking {
    show: bool,
    dim: bool,
    open: bool,
}

impl Thinking {
    fn new(show: bool) -> Self {
        Thinking {
            show,
            dim: std::io::IsTerminal::is_terminal(&std::io::stderr()),
            open: false,
        }
    }

    /// Writes a piece of thinking, opening the block on the first one.
    fn write(&mut self, text: &str) {
        if !self.show || text.is_empty() {
            return;
        }
        if !self.open {
            eprint!("{}[thinking] ", if self.dim { "\x1b[2m" } else { "" });
            self.open = true;
        }
        eprint!("{text}");
    }

    /// Closes an open block before the answer (or the end) is written.
    fn close(&mut self) {
        if std::mem::take(&mut self.open) {
            eprintln!("{}", if self.dim { "\x1b[0m" } else { "" });
        }
    }
}

struct Client {
    http: reqwest::Client,
    args: ChatArgs,
}

impl Client {
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let url = format!("{}{}", self.args.url.trim_end_matches('/'), path);
        let req = self.http.request(method, url);
        match &self.args.api_key {
            Some(key) => req.bearer_auth(key),
            None => req,
        }
    }

    async fn first_model(&self) -> Result<String> {
        let v: Value = self
            .request(reqwest::Method::GET, "/v1/models")
            .send()
            .await
            .context("is the server running? (tandem serve)")?
            .error_for_status()?
            .json()
            .await?;
        v["data"][0]["id"]
            .as_str()
            .map(str::to_owned)
            .context("the server lists no models")
    }

    /// Streams one answer to stdout and returns its full text.
    async fn answer(&self, model: &str, messages: &[Value]) -> Result<String> {
        let body = json!({
            "model": model,
            "messages": messages,
            "stream": true,
            "max_tokens": self.args.max_tokens,
            "temperature": self.args.temperature,
        });
        let response = self
            .request(reqwest::Method::POST, "/v1/chat/completions")
            .json(&body)
            .send()
            .await?;
        if !response.status().is_success() {
            let status = response.status();
            let text = response.text().await.unwrap_or_default();
            bail!("{status}: {text}");
        }
        let mut stream = response.bytes_stream();
        let mut buf = String::new();
        let mut answer = String::new();
        let mut stdout = std::io::stdout();
        let mut thinking = Thinking::new(!self.args.hide_reasoning);
        while let Some(bytes) = stream.next().await {
            buf.push_str(&String::from_utf8_lossy(&bytes?));
            for data in drain_events(&mut buf) {
                if data == "[DONE]" {
                    thinking.close();
                    return Ok(answer);
                }
                let delta = chunk_delta(&data).inspect_err(|_| thinking.close())?;
                thinking.write(&delta.reasoning);
                if !delta.content.is_empty() {
                    thinking.close();
                }
                print!("{}", delta.content);
                stdout.flush()?;
                answer.push_str(&delta.content);
            }
        }
        thinking.close();
        Ok(answer)
    }
}

/// Runs the read-answer loop until EOF or `/exit`; `/reset` forgets the conversation.
///
/// Input is read with blocking std I/O between requests: nothing else runs while the user types.
pub fn run(mut args: ChatArgs) -> Result<()> {
    // Declared before the client so it outlives every request; dropping it stops the engine.
    let local = if args.local {
        let server = LocalServer::start(local_settings(&args)?)?;
        args.url = server.url.clone();
        Some(server)
    } else {
        None
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = Client {
        http: crate::tls::trusting(reqwest::Client::builder(), args.ca_cert.as_deref())?
            .build()
            .context("building the HTTP client")?,
        args,
    };
    let model = match &client.args.model {
        Some(m) => m.clone(),
        None => runtime.block_on(client.first_model())?,
    };
    let system: Vec<Value> = client
        .args
        .system
        .iter()
        .map(|s| json!({"role": "system", "content": s}))
        .collect();
    let mut messages = system.clone();
    let place = match &local {
        Some(_) => "in this process".to_owned(),
        None => format!("at {}", client.args.url),
    };
    eprintln!("chatting with {model} {place} (/reset, /exit)");
    // Piped input is not echoed by a terminal: echo it after the prompt so the transcript reads as typed.
    let piped = !std::io::IsTerminal::is_terminal(&std::io::stdin());
    let mut lines = std::io::stdin().lines();
    loop {
        eprint!("> ");
        let Some(line) = lines.next().transpose()? else {
            if piped {
                eprintln!();
            }
            break;
        };
        if piped {
            eprintln!("{line}");
        }
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = system.clone();
                eprintln!("(conversation forgotten; the system prompt stays)");
                continue;
            }
            text => messages.push(json!({"role": "user", "content": text})),
        }
        match runtime.block_on(client.answer(&model, &messages)) {
            Ok(answer) => {
                println!();
                messages.push(json!({"role": "assistant", "content": answer}));
            }
            Err(e) => {
                eprintln!("\nerror: {e:#}");
                messages.pop();
            }
        }
    }
    match local {
        Some(server) => server.stop(),
        None => Ok(()),
    }
}

/// The settings of the in-process server: `tandem serve`'s defaults plus the chat's engine flags.
fn local_settings(args: &ChatArgs) -> Result<Settings> {
    let flags = Settings {
        model: args.model_path.clone(),
        engine: args.engine.clone(),
        cuda: args.cuda.clone(),
        ..Settings::default()
    };
    Settings::colocated(&flags, Settings::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_split_across_reads() {
        let mut buf = String::from("data: {\"a\":1}\n\ndata: [DO");
        assert_eq!(drain_events(&mut buf), vec!["{\"a\":1}".to_owned()]);
        buf.push_str("NE]\n\n");
        assert_eq!(drain_events(&mut buf), vec!["[DONE]".to_owned()]);
        assert!(buf.is_empty());
    }

    #[test]
    fn chunk_delta_reads_answer_thinking_and_errors() {
        let delta = |data| chunk_delta(data).unwrap();
        assert_eq!(
            delta(r#"{"choices":[{"delta":{"content":"hi"}}]}"#).content,
            "hi"
        );
        assert_eq!(
            delta(r#"{"choices":[{"delta":{"role":"assistant"}}]}"#),
            Delta::default()
        );
        assert_eq!(
            delta(r#"{"choices":[{"delta":{"reasoning_content":"hmm"}}]}"#),
            Delta {
                reasoning: "hmm".into(),
                content: String::new()
            }
        );
        assert!(chunk_delta(r#"{"error":{"message":"boom"}}"#).is_err());
    }
}
