//! Runtime choice of the instruction set the kernels use: portable, AVX2, or AVX-512 (VNNI).

use std::sync::OnceLock;

/// Instruction-set levels a kernel may be written for, in increasing order of capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Plain scalar Rust: the reference every other level is tested against.
    Portable,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL + VNNI on top of AVX2 (int8 dot products in one instruction, 512-bit lanes).
    Avx512,
}

/// The cap on the level set by [`set_isa_cap`] (the `tandem` binary's `--kernels` flag), or, once the
/// first kernel has asked for the level, the cap it ran under.
static CAP: OnceLock<Isa> = OnceLock::new();

/// Caps the level the kernels run at (`portable` and `avx2` are for comparisons and benchmarks). Call it
/// once at start, before any kernel runs: it returns false, changing nothing, when the level is already
/// fixed (a cap set before, or a kernel already ran), so every call of a kernel takes the same path.
pub fn set_isa_cap(cap: Isa) -> bool {
    CAP.set(cap).is_ok()
}

static BATCH_ORDERS: OnceLock<bool> = OnceLock::new();

/// Turns on (once per process, before the first kernel call; returns false when already decided)
/// llama.cpp's batch-dependent summation orders, which its CPU backend picks by the number of tokens of
/// a step: a step of a single token sums attention's values as `ggml_vec_dot_f32`, and each K-quant
/// row takes the kernel llama.cpp's AVX2 build would run for it in a product of that many rows
/// (`matmul::KPath`). With them tandem gives llama.cpp's logits bit for bit in decode too, but a token's
/// bits then depend on its step: a prompt recomputed in one prefill (preemption, decode failover) no
/// longer reproduces what one-token decode steps computed. Off (the default), every step uses one order
/// per kernel (llamafile's for attention; the one-row kernels for K-quants), so tokens are
/// batch-invariant.
pub fn set_llamacpp_batch_orders(on: bool) -> bool {
    BATCH_ORDERS.set(on).is_ok()
}

/// Whether llama.cpp's batch-dependent orders are on (see [`set_llamacpp_batch_orders`]).
pub fn llamacpp_batch_orders() -> bool {
    #[cfg(test)]
    if let Some(on) = TEST_BATCH_ORDERS.get() {
        return on;
    }
    *BATCH_ORDERS.get_or_init(|| false)
}

#[cfg(test)]
thread_local! {
    static TEST_BATCH_ORDERS: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` on this thread with llama.cpp's batch-dependent orders on or off (tests).
#[cfg(test)]
pub(crate) fn with_batch_orders<R>(on: bool, f: impl FnOnce() -> R) -> R {
    let before = TEST_BATCH_ORDERS.replace(Some(on));
    let r = f();
    TEST_BATCH_ORDERS.set(before);
    r
}

/// The level the kernels run at: the best the CPU supports, capped by [`set_isa_cap`]. Decided once per
/// process so every call of a kernel takes the same path.
pub fn isa() -> Isa {
    #[cfg(test)]
    if let Some(level) = TEST_ISA.get() {
        return level;
    }
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| cpu_isa().min(*CAP.get_or_init(|| Isa::Avx512)))
}

#[cfg(test)]
thread_local! {
    /// The level [`with_isa`] runs this thread's kernel calls at.
    static TEST_ISA: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the kernels it calls on this thread at `level` (whatever the process runs at), so tests
/// compare every level through the public entry points. A kernel reads the level once, on the calling
/// thread, and hands it to its pool's tasks.
#[cfg(test)]
pub(crate) fn with_isa<R>(level: Isa, f: impl FnOnce() -> R) -> R {
    let before = TEST_ISA.replace(Some(level));
    let r = f();
    TEST_ISA.set(before);
    r
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// The level's name: the spelling of the `--kernels` flag and of `TANDEM_KERNELS`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

impl std::str::FromStr for Isa {
    type Err = String;

    /// A level by its [`Isa::name`], in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name() == lower)
            .ok_or_else(|| format!("unknown kernel level `{lower}`: portable, avx2 or avx512"))
    }
}

/// Whether the AVX2+FMA+F16C kernels (or better) are used.
pub fn simd_enabled() -> bool {
    isa() >= Isa::Avx2
}

/// The best level the CPU itself supports, regardless of the override (tests compare every level).
pub(crate) fn cpu_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        let avx512 = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        match (avx2, avx512) {
            (true, true) => Isa::Avx512,
            (true, false) => Isa::Avx2,
            _ => Isa::Portable,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Isa::Portable
    }
}

/// Whether the CPU itself supports the AVX2 kernels, regardless of the override.
#[cfg(test)]
pub(crate) fn cpu_has_avx2() -> bool {
    cpu_isa() >= Isa::Avx2
}

#[cfg(test)]
mod tests {
    use super::Isa;

    #[test]
    fn every_level_reads_back_from_its_name_in_any_case() {
        for isa in Isa::ALL {
            assert_eq!(isa.name().parse::<Isa>(), Ok(isa));
            assert_eq!(isa.name().to_ascii_uppercase().parse::<Isa>(), Ok(isa));
        }
        assert!("avx1024".parse::<Isa>().unwrap_err().contains("avx1024"));
    }
}
