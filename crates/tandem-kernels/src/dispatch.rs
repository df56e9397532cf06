//! Runtime choice between the portable kernels and the AVX2 ones.

use std::sync::OnceLock;

/// Whether the AVX2+FMA+F16C kernels are used: CPU support and not overridden by `TANDEM_KERNELS=portable`.
///
/// Decided once per process so every call of a kernel takes the same path.
pub fn simd_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        let forced_portable = std::env::var("TANDEM_KERNELS")
            .map(|v| v.eq_ignore_ascii_case("portable"))
            .unwrap_or(false);
        !forced_portable && cpu_has_avx2()
    })
}

/// Whether the CPU itself supports the SIMD kernels, regardless of the override (tests compare both paths).
pub(crate) fn cpu_has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
