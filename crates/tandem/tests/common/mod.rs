//! What the process tests of the `tandem` binary share: the binary, the default model's path, free
//! loopback ports and a `tandem serve` child that is killed on drop.

#![allow(dead_code)] // each test binary uses its own subset

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `tandem` binary cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Where `scripts/fetch-model.sh` puts the default model.
pub fn default_model() -> PathBuf {
    root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// A loopback port free at the time of the call.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether `GET /health` at `url` answers 200: a raw HTTP/1.1 request over loopback, so polling needs no
/// runtime.
pub fn healthy(url: &str) -> bool {
    use std::io::{Read, Write};
    let addr = url.trim_start_matches("http://");
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let req = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200")
}

/// A running `tandem serve`, killed on drop (its workers and stages exit when their pipes close).
pub struct Server {
    /// The server process.
    pub child: Child,
    /// Its base URL on loopback.
    pub url: String,
    /// Where its stderr goes.
    pub log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `tandem serve <args> --host 127.0.0.1 --port <free>` with stderr in `log` and waits
    /// (up to 300 s) until it answers `/health`; panics with its log when it exits first.
    pub fn start<S: AsRef<OsStr>>(args: &[S], log: &Path) -> Server {
        let port = free_port();
        let child = Command::new(BIN)
            .arg("serve")
            .args(args)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("tandem serve starts");
        let mut server = Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log: log.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if let Some(status) = server.child.try_wait().unwrap() {
                panic!("tandem serve exited with {status}:\n{}", server.log());
            }
            if healthy(&server.url) {
                return server;
            }
            assert!(
                Instant::now() < deadline,
                "tandem serve never became healthy:\n{}",
                server.log()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// What the server wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}
