//! KV cache tiers under the block pool: a full block evicted from the pool is copied down (host memory,
//! then a directory of block files on disk) instead of dropped, and copied back up when a prefix
//! lookup misses the pool but a tier holds the block.
//!
//! Blocks are named by their prefix hash (the prefix cache's name), so a tier is a content-addressed
//! store: `hash → bytes of every layer of the block`, layer-major, in the canonical [`KvLayout`]. The
//! tiers never see a backend: the engine thread moves bytes through the backend's KV export/import
//! (the same calls P/D transfer uses), so a GPU backend reuses this code unchanged.
//!
//! Each tier is LRU under a byte budget. The host tier evicts into the disk tier, so what the disk holds
//! survives the host's eviction, and the disk tier survives a restart: on open it re-indexes its
//! directory, dropping files written for another model (a warning: the model changed), truncated
//! files and leftovers of interrupted writes. Every file carries a CRC32 over header and payload,
//! checked on every read: a corrupt block is dropped and its prefix recomputed, never served. A write
//! error (a full disk) turns the disk tier off with a warning; it never fails a request.
//!
//! Disk reads need not wait for the step that admits a request: [`KvTiers::read_ahead`] hands the
//! blocks of requests still waiting to a reader thread ([`ReadAhead`]), which reads and checks their
//! files while steps run; [`KvTiers::collect_read_ahead`] keeps what came back, under a byte budget,
//! and [`KvTiers::fetch`] serves those bytes (as disk hits) before it would read the file itself.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};

use tandem_model::{KvDtype, KvLayout};

use crate::config::KvOffloadConfig;
use crate::prefix_cache::FxBuildHasher;
use crate::stats::{KvTierStats, RestoreHistogram};

/// First bytes of every block file.
const MAGIC: [u8; 8] = *b"TANDEMKV";
/// Block file format version; a file of another version is dropped at re-index.
const VERSION: u32 = 1;
/// Suffix of a finished block file; anything else in the directory is not a block.
const BLOCK_EXT: &str = "kvblock";
/// Suffix of a block file being written; renamed to [`BLOCK_EXT`] once complete.
const TEMP_EXT: &str = "part";
/// Header bytes before the identity: magic, version, header length, hash, five layout words, payload
/// length, identity length.
const FIXED_HEADER: usize = 8 + 4 + 4 + 8 + 5 * 4 + 8 + 4;

/// Why a block file was refused.
#[derive(Debug, thiserror::Error)]
pub enum BlockFileError {
    /// Reading or writing the file failed.
    #[error("block file I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The file was written for another model.
    #[error("block file of model {found}, not {expected}")]
    Identity {
        /// The identity this tier serves.
        expected: String,
        /// The identity in the file.
        found: String,
    },
    /// The file is not a block of this layout (bad magic, version, layout, hash, length or checksum).
    #[error("block file is invalid: {0}")]
    Invalid(String),
}

/// What a block file must agree with: the model and the cache layout its bytes belong to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockFormat {
    /// The model's identity (`tandem_model::ModelIdentity`): KV of another model is garbage here.
    pub identity: String,
    /// The cache shape (`num_blocks` is not part of the format).
    pub layout: KvLayout,
}

impl BlockFormat {
    /// Bytes of one block across every layer: the payload of a block file.
    pub fn payload_bytes(&self) -> usize {
        self.layout.n_layers * self.layout.block_bytes()
    }

    fn dtype_code(&self) -> u32 {
        match self.layout.dtype {
            KvDtype::F32 => 0,
            KvDtype::Bf16 => 1,
            KvDtype::Fp8E4m3 => 2,
        }
    }

    fn header_len(&self) -> usize {
        FIXED_HEADER + self.identity.len()
    }

    /// The whole file for block `hash`: header, payload, CRC32 of both.
    pub fn encode(&self, hash: u64, payload: &[u8]) -> Vec<u8> {
        let l = &self.layout;
        let mut out = Vec::with_capacity(self.header_len() + payload.len() + 4);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(self.header_len() as u32).to_le_bytes());
        out.extend_from_slice(&hash.to_le_bytes());
        for w in [
            l.block_size as u32,
            l.n_layers as u32,
            l.n_kv_heads as u32,
            l.head_dim as u32,
            self.dtype_code(),
        ] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.identity.len() as u32).to_le_bytes());
        out.extend_from_slice(self.identity.as_bytes());
        out.extend_from_slice(payload);
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Checks a header (the file's first bytes) for block `hash` and returns the whole file's length
    /// it announces. Identity is checked first, so a file of another model reads as such.
    pub fn check_header(&self, hash: u64, head: &[u8]) -> Result<usize, BlockFileError> {
        let bad = |why: &str| BlockFileError::Invalid(why.to_string());
        if head.len() < FIXED_HEADER {
            return Err(bad("truncated header"));
        }
        let u32_at = |o: usize| u32::from_le_bytes(head[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(head[o..o + 8].try_into().expect("8 bytes"));
        if head[..8] != MAGIC {
            return Err(bad("not a tandem KV block file"));
        }
        if u32_at(8) != VERSION {
            return Err(bad("unknown format version"));
        }
        let id_len = u32_at(FIXED_HEADER - 4) as usize;
        let header_len = u32_at(12) as usize;
        if header_len != FIXED_HEADER + id_len || head.len() < header_len {
            return Err(bad("truncated header"));
        }
        let found = String::from_utf8_lossy(&head[FIXED_HEADER..header_len]);
        if found != self.identity {
            return Err(BlockFileError::Identity {
                expected: self.identity.clone(),
                found: found.into_owned(),
            });
        }
        if u64_at(16) != hash {
            return Err(bad("prefix hash differs from the file name"));
        }
        let l = &self.layout;
        let words: Vec<u32> = (0..5).map(|i| u32_at(24 + 4 * i)).collect();
        let want = [
            l.block_size as u32,
            l.n_layers as u32,
            l.n_kv_heads as u32,
            l.head_dim as u32,
            self.dtype_code(),
        ];
        if words != want {
            return Err(bad("block size, layer count, head shape or dtype differ"));
        }
        let payload = u64_at(44) as usize;
        if payload != self.payload_bytes() {
            return Err(bad("payload length differs from the layout's"));
        }
        Ok(header_len + payload + 4)
    }

    /// The payload of a whole block file for `hash`, after checking header, length and CRC32.
    pub fn decode<'a>(&self, hash: u64, file: &'a [u8]) -> Result<&'a [u8], BlockFileError> {
        let total = self.check_header(hash, file)?;
        if file.len() != total {
            return Err(BlockFileError::Invalid(format!(
                "{} bytes where the header announces {total}",
                file.len()
            )));
        }
        let (body, crc) = file.split_at(total - 4);
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(BlockFileError::Invalid("checksum mismatch".into()));
        }
        Ok(&body[self.header_len()..])
    }
}

/// Least-recently-used order over block hashes, with each entry's size.
#[derive(Debug, Default)]
struct Lru {
    by_hash: HashMap<u64, (u64, usize), FxBuildHasher>,
    order: BTreeMap<u64, u64>,
    tick: u64,
    bytes: usize,
}

impl Lru {
    fn contains(&self, hash: u64) -> bool {
        self.by_hash.contains_key(&hash)
    }

    fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Adds `hash` (or refreshes it) as the most recently used.
    fn touch(&mut self, hash: u64, size: usize) {
        if let Some((tick, old)) = self.by_hash.remove(&hash) {
            self.order.remove(&tick);
            self.bytes -= old;
        }
        self.tick += 1;
        self.order.insert(self.tick, hash);
        self.by_hash.insert(hash, (self.tick, size));
        self.bytes += size;
    }

    fn remove(&mut self, hash: u64) -> bool {
        match self.by_hash.remove(&hash) {
            Some((tick, size)) => {
                self.order.remove(&tick);
                self.bytes -= size;
                true
            }
            None => false,
        }
    }

    /// The least recently used hash, removed.
    fn pop_oldest(&mut self) -> Option<u64> {
        let (_, hash) = self.order.pop_first()?;
        let (_, size) = self.by_hash.remove(&hash).expect("order and map agree");
        self.bytes -= size;
        Some(hash)
    }
}

/// Blocks in host memory under a byte budget.
#[derive(Debug)]
pub struct HostTier {
    budget: usize,
    lru: Lru,
    /// Shared so a restore reads a block's bytes on its copy threads without copying them out first.
    data: HashMap<u64, Arc<Vec<u8>>, FxBuildHasher>,
}

impl HostTier {
    /// An empty tier holding at most `budget` bytes of blocks.
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            lru: Lru::default(),
            data: HashMap::default(),
        }
    }

    /// Whether block `hash` is here.
    pub fn contains(&self, hash: u64) -> bool {
        self.lru.contains(hash)
    }

    /// Block `hash`'s bytes, now the most recently used.
    pub fn get(&mut self, hash: u64) -> Option<&Arc<Vec<u8>>> {
        let size = self.data.get(&hash)?.len();
        self.lru.touch(hash, size);
        self.data.get(&hash)
    }

    /// Stores block `hash`; returns the blocks evicted to make room (oldest first). A block larger
    /// than the whole budget is not kept.
    pub fn put(&mut self, hash: u64, bytes: Vec<u8>) -> Vec<(u64, Arc<Vec<u8>>)> {
        let mut evicted = Vec::new();
        if bytes.len() > self.budget {
            return evicted;
        }
        self.lru.remove(hash);
        self.data.remove(&hash);
        while self.lru.bytes + bytes.len() > self.budget {
            let old = self
                .lru
                .pop_oldest()
                .expect("bytes over budget means entries");
            let b = self.data.remove(&old).expect("lru and data agree");
            evicted.push((old, b));
        }
        self.lru.touch(hash, bytes.len());
        self.data.insert(hash, Arc::new(bytes));
        evicted
    }

    /// Blocks held.
    pub fn blocks(&self) -> usize {
        self.lru.len()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.lru.bytes
    }
}

/// Blocks as files in one directory under a byte budget; see the module docs for the file format.
#[derive(Debug)]
pub struct DiskTier {
    dir: PathBuf,
    budget: usize,
    format: BlockFormat,
    lru: Lru,
    enabled: bool,
    /// Files dropped because they failed their checks at restore.
    pub corrupt: u64,
}

impl DiskTier {
    /// Opens (creating) `dir` as a tier of `budget` bytes for blocks of `format`, re-indexing what a
    /// previous run left: finished files of this model and layout are kept, in modification-time
    /// order as their LRU; files of another model (a warning: the model changed), invalid or truncated
    /// files and interrupted writes are deleted. The CRC is checked on every read, not here, so that
    /// opening costs one header read per file rather than reading the whole tier.
    pub fn open(dir: &Path, budget: usize, format: BlockFormat) -> std::io::Result<Self> {
        fs::create_dir_all(dir)?;
        let mut tier = Self {
            dir: dir.to_path_buf(),
            budget,
            format,
            lru: Lru::default(),
            enabled: true,
            corrupt: 0,
        };
        let mut found = Vec::new();
        let mut other_model = 0usize;
        let mut invalid = 0usize;
        for entry in fs::read_dir(dir)? {
            let path = entry?.path();
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            if ext == TEMP_EXT {
                // A write that never finished: never a block.
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(hash) = Self::hash_of(&path) else {
                continue;
            };
            match tier.check_file(hash, &path) {
                Ok((size, mtime)) => found.push((mtime, hash, size)),
                Err(e) => {
                    match e {
                        BlockFileError::Identity { .. } => other_model += 1,
                        _ => invalid += 1,
                    }
                    let _ = fs::remove_file(&path);
                }
            }
        }
        if other_model > 0 {
            tracing::warn!(
                dir = %dir.display(),
                files = other_model,
                "KV disk tier held blocks of another model (the model changed): dropped them"
            );
        }
        if invalid > 0 {
            tracing::warn!(dir = %dir.display(), files = invalid, "KV disk tier: dropped invalid or truncated block files");
        }
        found.sort();
        for (_, hash, size) in found {
            tier.lru.touch(hash, size);
        }
        tier.shrink_to(tier.budget);
        tracing::info!(
            dir = %dir.display(),
            blocks = tier.lru.len(),
            bytes = tier.lru.bytes,
            "KV disk tier opened"
        );
        Ok(tier)
    }

    fn hash_of(path: &Path) -> Option<u64> {
        if path.extension()?.to_str()? != BLOCK_EXT {
            return None;
        }
        u64::from_str_radix(path.file_stem()?.to_str()?, 16).ok()
    }

    fn path(&self, hash: u64) -> PathBuf {
        self.dir.join(format!("{hash:016x}.{BLOCK_EXT}"))
    }

    fn check_file(
        &self,
        hash: u64,
        path: &Path,
    ) -> Result<(usize, std::time::SystemTime), BlockFileError> {
        let mut f = fs::File::open(path)?;
        let meta = f.metadata()?;
        let mut head = vec![0u8; self.format.header_len()];
        let n = read_up_to(&mut f, &mut head)?;
        let total = self.format.check_header(hash, &head[..n])?;
        if meta.len() != total as u64 {
            return Err(BlockFileError::Invalid("truncated".into()));
        }
        Ok((total, meta.modified()?))
    }

    /// Marks block `hash` most recently used; false when it is not here.
    pub fn touch(&mut self, hash: u64) -> bool {
        let Some(&(_, size)) = self.lru.by_hash.get(&hash) else {
            return false;
        };
        self.lru.touch(hash, size);
        true
    }

    /// Whether the tier takes writes (false after a write error).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether block `hash` is here.
    pub fn contains(&self, hash: u64) -> bool {
        self.lru.contains(hash)
    }

    /// Blocks held.
    pub fn blocks(&self) -> usize {
        self.lru.len()
    }

    /// Bytes held (whole files).
    pub fn bytes(&self) -> usize {
        self.lru.bytes
    }

    fn shrink_to(&mut self, budget: usize) {
        while self.lru.bytes > budget {
            let Some(old) = self.lru.pop_oldest() else {
                break;
            };
            let _ = fs::remove_file(self.path(old));
        }
    }

    /// Writes block `hash` (to a temporary file, renamed when complete, so a kill mid-write leaves no
    /// block); returns the bytes written, 0 when it was already here or the tier is off. A write
    /// error turns the tier off with a warning.
    pub fn put(&mut self, hash: u64, payload: &[u8]) -> usize {
        if !self.enabled {
            return 0;
        }
        if self.lru.contains(hash) {
            self.lru
                .touch(hash, self.format.header_len() + payload.len() + 4);
            return 0;
        }
        let file = self.format.encode(hash, payload);
        if file.len() > self.budget {
            return 0;
        }
        self.shrink_to(self.budget - file.len());
        let tmp = self
            .dir
            .join(format!("{hash:016x}.{}.{TEMP_EXT}", std::process::id()));
        let written = fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(&file))
            .and_then(|()| fs::rename(&tmp, self.path(hash)));
        match written {
            Ok(()) => {
                self.lru.touch(hash, file.len());
                file.len()
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                self.enabled = false;
                tracing::warn!(
                    dir = %self.dir.display(),
                    error = %e,
                    "KV disk tier write failed (disk full?): the disk tier is off; blocks it holds are still served"
                );
                0
            }
        }
    }

    /// Block `hash`'s payload, checked (header, length, CRC32). A file that fails is deleted and
    /// counted in `corrupt`, and the caller recomputes the prefix.
    pub fn get(&mut self, hash: u64) -> Option<Vec<u8>> {
        if !self.lru.contains(hash) {
            return None;
        }
        match read_block(&self.dir, &self.format, hash) {
            Ok(payload) => {
                self.lru
                    .touch(hash, self.format.header_len() + payload.len() + 4);
                Some(payload)
            }
            Err(e) => {
                self.drop_bad(hash, &e);
                None
            }
        }
    }

    /// Deletes block `hash`'s file, which failed its checks, and counts it in `corrupt`.
    fn drop_bad(&mut self, hash: u64, e: &BlockFileError) {
        let path = self.path(hash);
        tracing::warn!(file = %path.display(), error = %e, "KV disk tier: dropped a bad block file; its prefix is recomputed");
        self.lru.remove(hash);
        let _ = fs::remove_file(&path);
        self.corrupt += 1;
    }

    /// A reader of this tier's files on a thread of its own.
    fn reader(&self) -> ReadAhead {
        ReadAhead::start(self.dir.clone(), self.format.clone())
    }
}

/// The payload of the block file of `hash` in `dir`, checked against `format`.
fn read_block(dir: &Path, format: &BlockFormat, hash: u64) -> Result<Vec<u8>, BlockFileError> {
    let file = fs::read(dir.join(format!("{hash:016x}.{BLOCK_EXT}")))?;
    format.decode(hash, &file).map(<[u8]>::to_vec)
}

/// Bytes of disk blocks read ahead that the tiers keep at once (with the reads in flight): enough for
/// a few long prefixes, a bound on the memory a queue of waiting requests can take.
pub const READ_AHEAD_BYTES: usize = 256 << 20;

/// A thread that reads disk-tier block files it is sent, so that the engine thread does not wait for
/// them; what it read waits in `staged` until [`KvTiers::fetch`] takes it.
#[derive(Debug)]
struct ReadAhead {
    /// Hashes to read; dropping it ends the thread.
    to_read: mpsc::Sender<u64>,
    /// What was read: the payload, or why not.
    done: mpsc::Receiver<(u64, Result<Vec<u8>, BlockFileError>)>,
    /// Sent and not yet collected.
    pending: HashSet<u64>,
    /// Read and checked, oldest first.
    staged: HashMap<u64, Arc<Vec<u8>>>,
    order: VecDeque<u64>,
    staged_bytes: usize,
}

impl ReadAhead {
    /// Block `hash`'s bytes if they were read ahead (once: they leave the staging).
    fn take(&mut self, hash: u64) -> Option<Arc<Vec<u8>>> {
        let b = self.staged.remove(&hash)?;
        self.staged_bytes -= b.len();
        self.order.retain(|&h| h != hash);
        Some(b)
    }

    fn start(dir: PathBuf, format: BlockFormat) -> Self {
        let (to_read, rx) = mpsc::channel::<u64>();
        let (tx, done) = mpsc::channel();
        std::thread::Builder::new()
            .name("kv-disk-read".into())
            .spawn(move || {
                for hash in rx {
                    if tx.send((hash, read_block(&dir, &format, hash))).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning the KV disk reader thread");
        Self {
            to_read,
            done,
            pending: HashSet::new(),
            staged: HashMap::new(),
            order: VecDeque::new(),
            staged_bytes: 0,
        }
    }
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_up_to(f: &mut fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Which tier served a restored block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// Host memory.
    Host,
    /// The disk directory.
    Disk,
}

/// The tiers under one engine's pool, with their counters.
#[derive(Debug)]
pub struct KvTiers {
    host: Option<HostTier>,
    disk: Option<DiskTier>,
    /// The disk tier's reads ahead of admission (with a disk tier).
    ahead: Option<ReadAhead>,
    stats: [KvTierStats; 2],
    /// Restores of one request's prefix, timed.
    pub restore_seconds: RestoreHistogram,
}

impl KvTiers {
    /// The tiers `config` asks for over blocks of `layout`, or None when it asks for none. Fails when
    /// the disk directory cannot be opened.
    pub fn open(config: &KvOffloadConfig, layout: KvLayout) -> std::io::Result<Option<Self>> {
        if config.host.is_none() && config.disk.is_none() {
            return Ok(None);
        }
        let host = config.host.map(HostTier::new);
        let disk = match &config.disk {
            Some(d) => Some(DiskTier::open(
                &d.path,
                d.size,
                BlockFormat {
                    identity: config.model_identity.clone(),
                    layout,
                },
            )?),
            None => None,
        };
        let stat = |tier: &str| KvTierStats {
            tier: tier.into(),
            ..Default::default()
        };
        let ahead = disk.as_ref().map(DiskTier::reader);
        let mut tiers = Self {
            host,
            disk,
            ahead,
            stats: [stat("host"), stat("disk")],
            restore_seconds: RestoreHistogram::default(),
        };
        tiers.refresh();
        Ok(Some(tiers))
    }

    /// Whether some tier holds block `hash`.
    pub fn contains(&self, hash: u64) -> bool {
        self.host.as_ref().is_some_and(|h| h.contains(hash))
            || self.disk.as_ref().is_some_and(|d| d.contains(hash))
    }

    /// Whether the top tier (host, else disk) already holds block `hash`, refreshing it there if so:
    /// then an evicted block need not be copied down again.
    pub fn refresh_if_held(&mut self, hash: u64) -> bool {
        match (&mut self.host, &mut self.disk) {
            (Some(host), _) => host.get(hash).is_some(),
            (None, Some(disk)) => disk.touch(hash),
            (None, None) => false,
        }
    }

    /// Takes a block evicted from the pool: into the host tier (whose evictions go to disk), or
    /// straight to disk without one. A block already held is only refreshed.
    pub fn offload(&mut self, hash: u64, bytes: Vec<u8>) {
        let len = bytes.len() as u64;
        match &mut self.host {
            Some(host) => {
                if host.contains(hash) {
                    host.get(hash);
                    return;
                }
                self.stats[0].bytes_down += len;
                for (old, b) in host.put(hash, bytes) {
                    if let Some(disk) = &mut self.disk {
                        self.stats[1].bytes_down += disk.put(old, &b) as u64;
                    }
                }
            }
            None => {
                if let Some(disk) = &mut self.disk {
                    self.stats[1].bytes_down += disk.put(hash, &bytes) as u64;
                }
            }
        }
        self.refresh();
    }

    /// Block `hash`'s bytes from the highest tier holding it, counting a hit or miss per tier
    /// consulted. None when no tier has it or the disk copy failed its checks.
    pub fn fetch(&mut self, hash: u64) -> Option<(Arc<Vec<u8>>, Tier)> {
        let mut got = None;
        if let Some(host) = &mut self.host {
            match host.get(hash) {
                Some(b) => {
                    self.stats[0].hits += 1;
                    self.stats[0].bytes_up += b.len() as u64;
                    got = Some((Arc::clone(b), Tier::Host));
                }
                None => self.stats[0].misses += 1,
            }
        }
        if got.is_none() {
            if let Some(b) = self.ahead.as_mut().and_then(|a| a.take(hash)) {
                self.stats[1].hits += 1;
                self.stats[1].read_ahead += 1;
                self.stats[1].bytes_up += b.len() as u64;
                if let Some(disk) = &mut self.disk {
                    disk.touch(hash);
                }
                got = Some((b, Tier::Disk));
            }
        }
        if got.is_none() {
            if let Some(disk) = &mut self.disk {
                match disk.get(hash) {
                    Some(b) => {
                        self.stats[1].hits += 1;
                        self.stats[1].bytes_up += b.len() as u64;
                        got = Some((Arc::new(b), Tier::Disk));
                    }
                    None => self.stats[1].misses += 1,
                }
            }
        }
        self.refresh();
        got
    }

    /// Whether there is a disk tier to read ahead from (else naming blocks to read is wasted work).
    pub fn reads_ahead(&self) -> bool {
        self.ahead.is_some()
    }

    /// Starts reading, on the reader thread, those of `hashes` (the blocks the waiting requests will
    /// restore, in order) that only the disk tier holds, as far as [`READ_AHEAD_BYTES`] allows. Blocks
    /// read earlier that `hashes` no longer names (restored meanwhile, or their request gone) are let
    /// go first, so they never hold the budget against the ones wanted now.
    pub fn read_ahead(&mut self, hashes: &[u64]) {
        let (Some(ahead), Some(disk)) = (&mut self.ahead, &self.disk) else {
            return;
        };
        if !ahead.staged.is_empty() {
            let wanted: HashSet<u64> = hashes.iter().copied().collect();
            for old in ahead.order.iter().filter(|h| !wanted.contains(h)) {
                if let Some(b) = ahead.staged.remove(old) {
                    ahead.staged_bytes -= b.len();
                }
            }
            ahead.order.retain(|h| wanted.contains(h));
        }
        let block = disk.format.header_len() + disk.format.payload_bytes() + 4;
        for &hash in hashes {
            if self.host.as_ref().is_some_and(|h| h.contains(hash))
                || ahead.staged.contains_key(&hash)
                || ahead.pending.contains(&hash)
                || !disk.contains(hash)
            {
                continue;
            }
            if ahead.staged_bytes + (ahead.pending.len() + 1) * block > READ_AHEAD_BYTES
                || ahead.to_read.send(hash).is_err()
            {
                break;
            }
            ahead.pending.insert(hash);
        }
    }

    /// Keeps the blocks the reader thread has read since the last call (oldest dropped past
    /// [`READ_AHEAD_BYTES`]); a file that failed its checks is deleted and counted as corrupt.
    pub fn collect_read_ahead(&mut self) {
        let Some(ahead) = &mut self.ahead else {
            return;
        };
        while let Ok((hash, read)) = ahead.done.try_recv() {
            ahead.pending.remove(&hash);
            let held = self.disk.as_ref().is_some_and(|d| d.contains(hash));
            match read {
                Ok(payload) if held => {
                    ahead.staged_bytes += payload.len();
                    ahead.staged.insert(hash, Arc::new(payload));
                    ahead.order.push_back(hash);
                }
                // Evicted from the disk tier while it was read: not kept.
                Ok(_) => {}
                // Deleted by the tier's own eviction meanwhile: nothing to drop.
                Err(BlockFileError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    if let (Some(disk), true) = (&mut self.disk, held) {
                        disk.drop_bad(hash, &e);
                    }
                }
            }
        }
        while ahead.staged_bytes > READ_AHEAD_BYTES {
            let Some(old) = ahead.order.pop_front() else {
                break;
            };
            if let Some(b) = ahead.staged.remove(&old) {
                ahead.staged_bytes -= b.len();
            }
        }
        self.refresh();
    }

    fn refresh(&mut self) {
        let [h, d] = &mut self.stats;
        h.enabled = self.host.is_some();
        if let Some(host) = &self.host {
            (h.blocks, h.bytes) = (host.blocks() as u64, host.bytes() as u64);
        }
        d.enabled = self.disk.as_ref().is_some_and(DiskTier::enabled);
        if let Some(disk) = &self.disk {
            (d.blocks, d.bytes) = (disk.blocks() as u64, disk.bytes() as u64);
            d.corrupt = disk.corrupt;
        }
    }

    /// The counters of the tiers configured (host first).
    pub fn stats(&self) -> Vec<KvTierStats> {
        let mut out = Vec::new();
        if self.host.is_some() {
            out.push(self.stats[0].clone());
        }
        if self.disk.is_some() {
            out.push(self.stats[1].clone());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DiskOffloadConfig;

    fn layout() -> KvLayout {
        KvLayout {
            n_layers: 2,
            n_kv_heads: 1,
            head_dim: 4,
            block_size: 2,
            num_blocks: 8,
            dtype: KvDtype::F32,
        }
    }

    fn format(identity: &str) -> BlockFormat {
        BlockFormat {
            identity: identity.into(),
            layout: layout(),
        }
    }

    fn payload(seed: u8) -> Vec<u8> {
        (0..format("m").payload_bytes())
            .map(|i| seed.wrapping_add(i as u8))
            .collect()
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tandem-kv-tiers-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    /// Tiers of model "m": a disk tier of 1 MiB in `dir`, under a host tier of `host` bytes if any.
    fn disk_config(dir: &Path, host: Option<usize>) -> KvOffloadConfig {
        KvOffloadConfig {
            host,
            disk: Some(DiskOffloadConfig {
                path: dir.to_path_buf(),
                size: 1 << 20,
            }),
            model_identity: "m".into(),
        }
    }

    #[test]
    fn lru_evicts_least_recently_used() {
        let mut h = HostTier::new(30);
        assert!(h.put(1, vec![1; 10]).is_empty());
        assert!(h.put(2, vec![2; 10]).is_empty());
        assert!(h.put(3, vec![3; 10]).is_empty());
        assert!(h.get(1).is_some(), "1 is now the most recent");
        let out = h.put(4, vec![4; 10]);
        assert_eq!(out.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![2]);
        assert!(h.contains(1) && !h.contains(2) && h.contains(3) && h.contains(4));
        assert_eq!((h.blocks(), h.bytes()), (3, 30));
        let out = h.put(5, vec![5; 25]);
        assert_eq!(
            out.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            vec![3, 1, 4]
        );
        assert!(
            h.put(6, vec![6; 31]).is_empty(),
            "larger than the budget: not kept"
        );
        assert!(!h.contains(6));
    }

    #[test]
    fn file_format_round_trips_and_rejects_damage() {
        let f = format("model-a");
        let p = payload(7);
        let file = f.encode(42, &p);
        assert_eq!(f.decode(42, &file).unwrap(), &p[..]);
        assert!(
            matches!(f.decode(43, &file), Err(BlockFileError::Invalid(_))),
            "another block's name"
        );
        for cut in [0, 10, FIXED_HEADER, file.len() / 2, file.len() - 1] {
            assert!(f.decode(42, &file[..cut]).is_err(), "truncated at {cut}");
        }
        let mut flipped = file.clone();
        flipped[f.header_len() + 3] ^= 1;
        assert!(
            matches!(f.decode(42, &flipped), Err(BlockFileError::Invalid(m)) if m.contains("checksum"))
        );
        assert!(matches!(
            format("model-b").decode(42, &file),
            Err(BlockFileError::Identity { .. })
        ));
        let mut other = f.clone();
        other.layout.dtype = KvDtype::Bf16;
        assert!(other.decode(42, &file).is_err(), "another dtype");
    }

    #[test]
    fn disk_tier_survives_reopen_and_drops_bad_files() {
        let dir = tmpdir("reopen");
        let f = format("m");
        let size = f.encode(0, &payload(0)).len();
        {
            let mut d = DiskTier::open(&dir, 10 * size, f.clone()).unwrap();
            for h in 1..=4u64 {
                assert_eq!(d.put(h, &payload(h as u8)), size);
            }
            assert_eq!(d.put(1, &payload(1)), 0, "already held");
        }
        // A write killed half-way leaves a temporary file, which is never indexed.
        fs::write(dir.join(format!("{:016x}.123.{TEMP_EXT}", 9u64)), b"half").unwrap();
        // A truncated block and a corrupt one.
        let p3 = dir.join(format!("{:016x}.{BLOCK_EXT}", 3u64));
        let bytes = fs::read(&p3).unwrap();
        fs::write(&p3, &bytes[..bytes.len() - 5]).unwrap();
        let p4 = dir.join(format!("{:016x}.{BLOCK_EXT}", 4u64));
        let mut bytes = fs::read(&p4).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        fs::write(&p4, &bytes).unwrap();

        let mut d = DiskTier::open(&dir, 10 * size, f.clone()).unwrap();
        assert!(d.contains(1) && d.contains(2));
        assert!(!d.contains(3), "truncated file dropped at re-index");
        assert!(!d.contains(9), "temporary file never indexed");
        assert!(!dir.join(format!("{:016x}.123.{TEMP_EXT}", 9u64)).exists());
        assert_eq!(d.get(1).unwrap(), payload(1));
        assert!(
            d.contains(4),
            "corruption inside the payload is found on read"
        );
        assert_eq!(d.get(4), None);
        assert_eq!(d.corrupt, 1);
        assert!(!d.contains(4) && !p4.exists());

        // Another model: every file is dropped.
        let d = DiskTier::open(&dir, 10 * size, format("other")).unwrap();
        assert_eq!(d.blocks(), 0);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn disk_tier_keeps_its_budget_and_turns_off_on_write_errors() {
        let dir = tmpdir("budget");
        let f = format("m");
        let size = f.encode(0, &payload(0)).len();
        let mut d = DiskTier::open(&dir, 2 * size, f).unwrap();
        d.put(1, &payload(1));
        d.put(2, &payload(2));
        assert!(d.get(1).is_some());
        d.put(3, &payload(3));
        assert!(d.contains(1) && !d.contains(2) && d.contains(3));
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 2);
        // The directory vanishing stands in for a full disk: the write fails, the tier turns off.
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(d.put(5, &payload(5)), 0);
        assert!(!d.enabled());
        assert_eq!(d.put(6, &payload(6)), 0);
        assert!(!d.contains(5) && !d.contains(6));
    }

    /// Collects the reader thread's results until none is pending.
    fn collect_all(t: &mut KvTiers) {
        for _ in 0..500 {
            t.collect_read_ahead();
            if t.ahead.as_ref().unwrap().pending.is_empty() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        panic!("the reader thread did not answer in 5 s");
    }

    /// Blocks read ahead are served from memory, as disk hits, even once their files are gone; a file
    /// that fails its checks is dropped as corrupt when read ahead, and nothing is served for it.
    #[test]
    fn disk_blocks_read_ahead_are_served_without_the_file() {
        let dir = tmpdir("ahead");
        let mut t = KvTiers::open(&disk_config(&dir, None), layout())
            .unwrap()
            .unwrap();
        for h in 1..=3u64 {
            t.offload(h, payload(h as u8));
        }
        let file = |h: u64| dir.join(format!("{h:016x}.{BLOCK_EXT}"));
        // Block 3's file is damaged; 9 is held by no tier and not read.
        let mut bad = fs::read(file(3)).unwrap();
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        fs::write(file(3), bad).unwrap();
        t.read_ahead(&[1, 2, 3, 9]);
        assert_eq!(t.ahead.as_ref().unwrap().pending.len(), 3);
        collect_all(&mut t);
        for h in [1, 2] {
            fs::remove_file(file(h)).unwrap();
        }
        assert_eq!(t.fetch(1), Some((Arc::new(payload(1)), Tier::Disk)));
        assert_eq!(t.fetch(2), Some((Arc::new(payload(2)), Tier::Disk)));
        assert_eq!(t.fetch(3), None, "a damaged block is never served");
        let s = t.stats();
        assert_eq!((s[0].hits, s[0].misses, s[0].corrupt), (2, 1, 1));
        assert_eq!(s[0].read_ahead, 2);
        assert_eq!(s[0].bytes_up, 2 * payload(0).len() as u64);
        assert!(!t.contains(3));
        assert!(
            t.ahead.as_ref().unwrap().staged.is_empty(),
            "served blocks leave the staging"
        );
        // A block read ahead and then no longer wanted leaves the staging at the next call.
        t.offload(4, payload(4));
        t.read_ahead(&[4]);
        collect_all(&mut t);
        assert_eq!(t.ahead.as_ref().unwrap().staged.len(), 1);
        t.read_ahead(&[]);
        let a = t.ahead.as_ref().unwrap();
        assert!(a.staged.is_empty() && a.order.is_empty() && a.staged_bytes == 0);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn host_evicts_into_disk_and_fetch_counts_per_tier() {
        let dir = tmpdir("tiers");
        let p = payload(0).len();
        let mut t = KvTiers::open(&disk_config(&dir, Some(2 * p)), layout())
            .unwrap()
            .unwrap();
        for h in 1..=3u64 {
            t.offload(h, payload(h as u8));
        }
        assert!(t.contains(1) && t.contains(2) && t.contains(3) && !t.contains(4));
        assert_eq!(t.fetch(3), Some((Arc::new(payload(3)), Tier::Host)));
        assert_eq!(
            t.fetch(1),
            Some((Arc::new(payload(1)), Tier::Disk)),
            "host evicted it to disk"
        );
        assert_eq!(t.fetch(4), None);
        let s = t.stats();
        assert_eq!((s[0].hits, s[0].misses), (1, 2));
        assert_eq!((s[1].hits, s[1].misses), (1, 1));
        assert_eq!(s[0].blocks, 2);
        assert_eq!(s[1].blocks, 1);
        assert_eq!(s[0].bytes_down, 3 * p as u64);
        assert_eq!(s[0].bytes_up + s[1].bytes_up, 2 * p as u64);
        fs::remove_dir_all(&dir).unwrap();
    }
}
