//! An on-disk cache of compiled kernels, so a restart or a second worker skips NVRTC.
//!
//! NVRTC takes seconds for `llama.cu` (16 s on a fresh machine); its output depends only on the
//! source with the model's `#define`s, the compile options and the device's compute capability,
//! which together form the cache key. An entry is `<hash>.ptx` beside `<hash>.key`, the full key:
//! a hit must match the key byte for byte, so a hash collision recompiles instead of loading the
//! wrong kernels. Entries are written to a temporary name and renamed, so concurrent workers never
//! read a half-written file. (The driver caches its own PTX-to-machine-code step the same way, in
//! its compute cache.)

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

/// Where a compiled module is cached and under which key.
#[derive(Clone, Debug)]
pub struct CacheEntry {
    key: String,
    ptx: PathBuf,
    key_file: PathBuf,
}

impl CacheEntry {
    /// The entry for `key` (everything the compiled output depends on) under `dir`.
    pub fn new(dir: &Path, key: String) -> Self {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut h);
        let name = format!("llama-{:016x}", h.finish());
        Self {
            key,
            ptx: dir.join(format!("{name}.ptx")),
            key_file: dir.join(format!("{name}.key")),
        }
    }

    /// The cached output, when present and made from exactly this key.
    pub fn load(&self) -> Option<String> {
        let key = std::fs::read_to_string(&self.key_file).ok()?;
        if key != self.key {
            return None;
        }
        std::fs::read_to_string(&self.ptx).ok()
    }

    /// Stores `ptx` for this key; failures are logged, not fatal (the cache only saves time).
    pub fn store(&self, ptx: &str) {
        if let Err(e) = self.try_store(ptx) {
            tracing::warn!(path = %self.ptx.display(), error = %e, "could not cache the compiled kernels");
        }
    }

    fn try_store(&self, ptx: &str) -> std::io::Result<()> {
        if let Some(dir) = self.ptx.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = |p: &Path| p.with_extension(format!("tmp{}", std::process::id()));
        // The PTX lands first: a reader that finds the new key also finds its PTX.
        std::fs::write(tmp(&self.ptx), ptx)?;
        std::fs::rename(tmp(&self.ptx), &self.ptx)?;
        std::fs::write(tmp(&self.key_file), &self.key)?;
        std::fs::rename(tmp(&self.key_file), &self.key_file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hit_needs_the_same_key() {
        let dir = std::env::temp_dir().join(format!("tandem-kcache-{}", std::process::id()));
        let a = CacheEntry::new(&dir, "source A / sm_90".into());
        assert_eq!(a.load(), None);
        a.store("ptx A");
        assert_eq!(a.load().as_deref(), Some("ptx A"));
        assert_eq!(
            CacheEntry::new(&dir, "source A / sm_90".into())
                .load()
                .as_deref(),
            Some("ptx A")
        );
        assert_eq!(
            CacheEntry::new(&dir, "source A / sm_80".into()).load(),
            None
        );
        // A key file that does not match (a collision, or a torn pair) is a miss, not a wrong hit.
        std::fs::write(&a.key_file, "another key").unwrap();
        assert_eq!(a.load(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
