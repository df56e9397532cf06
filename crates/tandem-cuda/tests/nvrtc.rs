//! NVRTC compiles the real kernel source for Hopper (sm_90) when its library is installed; it needs no
//! GPU. An integration test, so that the library reads no environment: `scripts/test.sh` provides
//! libnvrtc and sets `TANDEM_REQUIRE_NVRTC`, which turns the skip into a failure, and `TANDEM_PTX_DIR`
//! keeps the PTX for reading.

use tandem_cuda::kernels::{
    compile, nvrtc_available, GemvTuning, KernelShape, GEMV_FORMAT_FAMILIES, GEMV_MAX_ROWS,
    KERNEL_NAMES,
};

/// Every weight format's GEMVs (see `KernelShape::formats`).
const ALL_FORMATS: u8 = (1 << GEMV_FORMAT_FAMILIES.len()) - 1;

/// Compiles the real source for sm_90 when NVRTC is installed (it needs no GPU); skipped otherwise.
#[test]
fn compiles_for_hopper_when_nvrtc_is_present() {
    if !nvrtc_available() {
        // scripts/test.sh provides libnvrtc and sets this, so that there the skip is an error.
        assert!(
            std::env::var_os("TANDEM_REQUIRE_NVRTC").is_none(),
            "TANDEM_REQUIRE_NVRTC is set but libnvrtc cannot be loaded"
        );
        eprintln!("skipped: libnvrtc not found");
        return;
    }
    for shape in [
        KernelShape {
            head_dim: 128,
            gqa: 4,
            block_size: 16,
            formats: ALL_FORMATS,
            kv_fp8: false,
        },
        KernelShape {
            head_dim: 64,
            gqa: 3,
            block_size: 16,
            formats: ALL_FORMATS,
            kv_fp8: false,
        },
        // Gemma 3 270M and 1B (4 query heads on 1 KV head of 256 dims).
        KernelShape {
            head_dim: 256,
            gqa: 4,
            block_size: 16,
            formats: ALL_FORMATS,
            kv_fp8: false,
        },
        // FP8 KV cache (`kv_cache_dtype: fp8`): every attention kernel reads E4M3 codes.
        KernelShape {
            head_dim: 128,
            gqa: 4,
            block_size: 16,
            formats: 1,
            kv_fp8: true,
        },
        KernelShape {
            head_dim: 256,
            gqa: 4,
            block_size: 16,
            formats: 1,
            kv_fp8: true,
        },
    ] {
        let ptx = compile(&shape, &GemvTuning::default(), 9, 0)
            .unwrap_or_else(|e| panic!("{shape:?}: {e}"));
        let text = ptx.to_src();
        for name in KERNEL_NAMES {
            assert!(text.contains(name), "{name} missing from the PTX");
        }
        for m in 1..=GEMV_MAX_ROWS {
            let compiled = GEMV_FORMAT_FAMILIES
                .iter()
                .enumerate()
                .filter(|(f, _)| (shape.formats | 1) & (1 << f) != 0);
            for family in compiled.flat_map(|(_, families)| families) {
                assert!(
                    text.contains(&format!(".entry {family}{m}(")),
                    "{family}{m} missing from the PTX"
                );
            }
        }
        assert!(text.contains("mma.sync.aligned.m16n8k16"));
        if let Ok(dir) = std::env::var("TANDEM_PTX_DIR") {
            let path = format!(
                "{dir}/llama_d{}_g{}{}.ptx",
                shape.head_dim,
                shape.gqa,
                if shape.kv_fp8 { "_kvfp8" } else { "" }
            );
            std::fs::write(&path, &text).expect("writing the PTX");
        }
    }
    // The packed formats' FP32-lane GEMVs (`--cuda-gemv-packed-simt`), kept for A/B timings.
    let shape = KernelShape {
        head_dim: 128,
        gqa: 4,
        block_size: 16,
        formats: ALL_FORMATS,
        kv_fp8: false,
    };
    let simt = GemvTuning {
        packed_mma: false,
        ..GemvTuning::default()
    };
    let text = compile(&shape, &simt, 9, 0)
        .unwrap_or_else(|e| panic!("{shape:?} {simt:?}: {e}"))
        .to_src();
    for m in 1..=GEMV_MAX_ROWS {
        for family in GEMV_FORMAT_FAMILIES.iter().flatten() {
            assert!(
                text.contains(&format!(".entry {family}{m}(")),
                "{family}{m} missing from the PTX ({simt:?})"
            );
        }
    }
}
