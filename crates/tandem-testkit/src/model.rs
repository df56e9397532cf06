//! The default model and the one rule for tests that need it: present, it is used (loaded once per test
//! binary); absent, the test says so on stderr and skips (`scripts/fetch-model.sh` fetches it, and CI runs
//! that first).

use std::path::PathBuf;
use std::sync::OnceLock;

use tandem_model::{LoadOptions, LoadedModel};

/// The default model's path relative to the repository root.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The name `tandem serve` gives the default model (its file stem), which requests put in `model`.
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct.Q4_1";

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Where `scripts/fetch-model.sh` puts the default model, whether or not it is there.
pub fn default_model() -> PathBuf {
    root().join(DEFAULT_MODEL)
}

/// The default model's path, or `None` after a skip message on stderr when it is absent.
pub fn model_path() -> Option<PathBuf> {
    let path = default_model();
    if !path.is_file() {
        eprintln!(
            "skipping: {} is absent (run scripts/fetch-model.sh)",
            path.display()
        );
        return None;
    }
    Some(path)
}

/// Runs the binary `bin` with `args` from the repository root to completion and returns its stdout;
/// panics with its stdout and stderr when it fails (the CLI tests' one way to run a command).
pub fn run_ok(bin: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(bin)
        .args(args)
        .current_dir(root())
        .output()
        .expect("the binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{bin} {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The default model, loaded once per test binary; `None` (the test skips) when it is absent.
pub fn model() -> Option<&'static LoadedModel> {
    static MODEL: OnceLock<Option<LoadedModel>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let path = model_path()?;
            Some(
                tandem_model::load(&path, &LoadOptions { progress: false })
                    .expect("loading the default model"),
            )
        })
        .as_ref()
}
