//! The SentencePiece (Llama 2 style) tokenizer built from GGUF metadata against SentencePiece itself:
//! tests/fixtures/spm holds a tokenizer trained with Llama 2's options and exported as llama.cpp's
//! converter does, plus SentencePiece's ids for tricky strings (scripts/fixtures/gen-spm-tokenizer-fixture.py).

use std::path::Path;

use tandem_model::gguf::GgufFile;
use tandem_model::{IncrementalDecoder, Tokenizer};

#[test]
fn spm_gguf_tokenizer_matches_sentencepiece() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/spm");
    let gguf = GgufFile::open(&dir.join("tokenizer.gguf")).expect("open tokenizer.gguf");
    let tok = Tokenizer::from_gguf(&gguf).expect("build the SPM tokenizer");
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("cases.json")).unwrap()).unwrap();
    assert_eq!(
        tok.vocab_size() as u64,
        cases["vocab_size"].as_u64().unwrap()
    );
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let (text, got) = tandem_testkit::assert_tokenizer_case(&tok, case, "decoded", "");
        let decoded = case["decoded"].as_str().unwrap();
        // Streaming must produce the same text, never a broken UTF-8 sequence on the way.
        let mut dec = IncrementalDecoder::new(tok.clone(), false);
        let mut streamed = String::new();
        for &id in &got {
            streamed += &dec.push(id).unwrap();
        }
        streamed += &dec.finish().unwrap();
        assert_eq!(streamed, decoded, "streamed decode of {text:?}");
    }
    // add_bos_token is set: encoding with special tokens prepends <s> (id 1).
    assert_eq!(tok.encode("Hello", true).unwrap()[0], 1);
}
