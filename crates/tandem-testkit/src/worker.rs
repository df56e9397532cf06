//! A `tandem worker` started by hand (as on another host), killed on drop: the process tests that start,
//! signal and replace workers themselves rather than through `tandem serve`'s launcher.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use crate::model::default_model;
use crate::server::free_port;

/// A `tandem worker` child process with the default model, a 64 MiB KV cache of 16-token blocks, one
/// thread and at most 8 sequences; killed on drop unless it already exited.
pub struct Worker {
    /// The worker process.
    pub child: Child,
    /// Its RPC base URL, from its ready line.
    pub url: String,
    /// Where its stderr goes (removed on drop).
    pub log: PathBuf,
    _stdout: BufReader<ChildStdout>,
}

impl Worker {
    /// Starts `BIN worker --role ROLE` bound to `host:port` with `extra` flags (e.g. `--register URL`)
    /// and waits for its ready line; panics with its log when it exits first. `bin` is the `tandem`
    /// binary (`env!("CARGO_BIN_EXE_tandem")` in the binary's tests).
    pub fn start(bin: &str, role: &str, host: &str, port: u16, extra: &[&str]) -> Worker {
        let log = std::env::temp_dir().join(format!(
            "tandem-worker-{}-{}.log",
            std::process::id(),
            free_port()
        ));
        let mut child = Command::new(bin)
            .args(["worker", "--role", role, "--host", host])
            .args(["--port", &port.to_string()])
            .arg("--model")
            .arg(default_model())
            .args(["--block-size", "16", "--kv-cache-memory", "64MiB"])
            .args(["--threads", "1", "--max-num-seqs", "8"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("tandem worker starts");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        let url = loop {
            line.clear();
            let n = stdout.read_line(&mut line).unwrap();
            assert!(
                n > 0,
                "the worker exited before serving:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            if let Some(url) = line.trim().strip_prefix("TANDEM_WORKER_READY ") {
                break url.to_owned();
            }
        };
        Worker {
            child,
            url,
            log,
            _stdout: stdout,
        }
    }

    /// What the worker wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits up to `within` for the process to exit; its status.
    pub fn exited(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A child process a test started by hand (a stage, a worker), killed and reaped on drop; it keeps the
/// read end of the child's stdout open, so a child printing after its ready line is not cut off.
pub struct Killed {
    /// The process.
    pub child: Child,
    stdout: BufReader<ChildStdout>,
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns `cmd` (stdin closed, stdout piped) and reads its stdout up to the line starting with `prefix`,
/// a ready line such as `TANDEM_STAGE_READY `; returns the child, killed on drop, and the rest of that
/// line. Panics when the child closes its stdout first.
pub fn spawn_ready(cmd: &mut Command, prefix: &str) -> (Killed, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the child starts");
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut killed = Killed { child, stdout };
    let mut line = String::new();
    loop {
        line.clear();
        let n = killed.stdout.read_line(&mut line).unwrap();
        assert!(
            n > 0,
            "{cmd:?} closed its stdout without a line starting {prefix:?}"
        );
        if let Some(rest) = line.trim().strip_prefix(prefix) {
            return (killed, rest.to_owned());
        }
    }
}
