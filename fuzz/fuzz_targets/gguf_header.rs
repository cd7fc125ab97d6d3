//! Fuzzes the GGUF header parser: any input must give an error or a header
//! whose tensors all lie inside the input, never a panic, a hang or a huge
//! allocation. Seed the corpus with tests/fixtures/gguf/*.gguf.
#![no_main]

use colibri_model::source::gguf::header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = header::parse(data) {
        assert!(h.alignment.is_power_of_two());
        assert!(h.data_offset.is_multiple_of(h.alignment));
        for t in &h.tensors {
            let end = h.data_offset + t.offset + t.size;
            assert!(end <= data.len() as u64, "tensor {} outside the input", t.name);
        }
    }
});
