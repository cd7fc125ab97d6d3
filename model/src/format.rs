//! Storage formats of weight matrices and exact conversions of their
//! elements to f32.
//!
//! A weight runs as stored: f32 stays f32, f16/bf16 are widened exactly
//! (every f16/bf16 value is an f32 value), FP8-e4m3 elements are widened
//! exactly and multiplied by their block's f32 scale, and ggml's block
//! formats Q8_0/Q4_0 (see [`crate::quant`]) are dequantized exactly.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// How the rows of a weight matrix are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightFormat {
    F32,
    F16,
    Bf16,
    /// FP8 e4m3fn elements with one f32 scale per `block × block` tile
    /// (DeepSeek-V3's `weight_scale_inv`).
    F8E4M3,
    /// ggml Q8_0: blocks of 32 × i8 with one f16 scale (34 bytes).
    Q8_0,
    /// ggml Q4_0: blocks of 32 × 4-bit with one f16 scale (18 bytes).
    Q4_0,
    /// ggml Q6_K: super-blocks of 256 × 6-bit in 16 sub-blocks with an i8
    /// scale each and one f16 scale (210 bytes); see
    /// [`crate::quant::dequantize_q6_k`].
    #[serde(rename = "q6_k")]
    Q6K,
    /// ggml Q4_K: super-blocks of 256 × 4-bit in 8 sub-blocks of 32, each
    /// with a 6-bit scale and a 6-bit min, and f16 `d` and `dmin` (144
    /// bytes); see [`crate::quant::dequantize_q4_k`].
    #[serde(rename = "q4_k")]
    Q4K,
    /// ggml Q5_K: Q4_K with a fifth bit per element (176 bytes); see
    /// [`crate::quant::dequantize_q5_k`].
    #[serde(rename = "q5_k")]
    Q5K,
    /// ggml Q4_1: blocks of 32 × 4-bit with an f16 scale and an f16 min
    /// (20 bytes); see [`crate::quant::dequantize_q4_1`]. Like Q5_0 and
    /// Q5_1, what llama.cpp writes for a k-quant's tensor whose rows are
    /// not whole 256-element super-blocks. Read only (no quantizer).
    Q4_1,
    /// ggml Q5_0: blocks of 32 × 5-bit with an f16 scale (22 bytes).
    Q5_0,
    /// ggml Q5_1: blocks of 32 × 5-bit with an f16 scale and min (24 bytes).
    Q5_1,
    /// ggml Q2_K: super-blocks of 256 × 2-bit in 16 sub-blocks of 16, each
    /// with a 4-bit scale and a 4-bit min, and f16 `d` and `dmin` (84
    /// bytes); see [`crate::quant::dequantize_q2_k`]. The bulk of
    /// llama.cpp's Q2_K files (and Q3_K_S's attention). Like Q3_K, IQ4_NL
    /// and IQ4_XS: read only (no quantizer).
    #[serde(rename = "q2_k")]
    Q2K,
    /// ggml Q3_K: super-blocks of 256 × 3-bit in 16 sub-blocks with a
    /// 6-bit scale each and one f16 `d` (110 bytes); see
    /// [`crate::quant::dequantize_q3_k`]. The bulk of the Q3_K_S/M/L files.
    #[serde(rename = "q3_k")]
    Q3K,
    /// ggml IQ4_NL: blocks of 32 × 4-bit indices into a fixed table of 16
    /// non-uniform values with one f16 scale (18 bytes); see
    /// [`crate::quant::dequantize_iq4_nl`].
    #[serde(rename = "iq4_nl")]
    Iq4Nl,
    /// ggml IQ4_XS: IQ4_NL's table in super-blocks of 256 with a 6-bit
    /// scale per 32 and one f16 `d` (136 bytes); see
    /// [`crate::quant::dequantize_iq4_xs`].
    #[serde(rename = "iq4_xs")]
    Iq4Xs,
}

impl WeightFormat {
    /// Bytes one row of `cols` elements takes. Block formats need `cols`
    /// to be a whole number of blocks (ggml quantizes along rows).
    pub fn row_bytes(self, cols: usize) -> Result<usize> {
        let block = |bytes: usize| {
            if cols.is_multiple_of(crate::quant::QK) {
                Ok(cols / crate::quant::QK * bytes)
            } else {
                Err(ModelError::Invalid(format!(
                    "{}: a row of {cols} elements is not a multiple of the {}-element block",
                    self.name(),
                    crate::quant::QK
                )))
            }
        };
        match self {
            WeightFormat::F32 => Ok(cols * 4),
            WeightFormat::F16 | WeightFormat::Bf16 => Ok(cols * 2),
            WeightFormat::F8E4M3 => Ok(cols),
            WeightFormat::Q8_0 => block(crate::quant::Q8_0_BLOCK_BYTES),
            WeightFormat::Q4_0 => block(crate::quant::Q4_0_BLOCK_BYTES),
            WeightFormat::Q4_1 => block(crate::quant::Q4_1_BLOCK_BYTES),
            WeightFormat::Q5_0 => block(crate::quant::Q5_0_BLOCK_BYTES),
            WeightFormat::Q5_1 => block(crate::quant::Q5_1_BLOCK_BYTES),
            WeightFormat::Iq4Nl => block(crate::quant::IQ4_NL_BLOCK_BYTES),
            WeightFormat::Q6K
            | WeightFormat::Q4K
            | WeightFormat::Q5K
            | WeightFormat::Q2K
            | WeightFormat::Q3K
            | WeightFormat::Iq4Xs => {
                if cols.is_multiple_of(crate::quant::QK_K) {
                    Ok(cols / crate::quant::QK_K * self.super_block_bytes())
                } else {
                    Err(ModelError::Invalid(format!(
                        "{}: a row of {cols} elements is not a multiple of the {}-element super-block",
                        self.name(),
                        crate::quant::QK_K
                    )))
                }
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::F8E4M3 => "fp8-e4m3",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q4_0 => "q4_0",
            WeightFormat::Q6K => "q6_k",
            WeightFormat::Q4K => "q4_k",
            WeightFormat::Q5K => "q5_k",
            WeightFormat::Q4_1 => "q4_1",
            WeightFormat::Q5_0 => "q5_0",
            WeightFormat::Q5_1 => "q5_1",
            WeightFormat::Q2K => "q2_k",
            WeightFormat::Q3K => "q3_k",
            WeightFormat::Iq4Nl => "iq4_nl",
            WeightFormat::Iq4Xs => "iq4_xs",
        }
    }

    /// Whether this is one of ggml's k-quants (rows of 256-element
    /// super-blocks).
    pub fn is_k_quant(self) -> bool {
        matches!(
            self,
            WeightFormat::Q6K
                | WeightFormat::Q4K
                | WeightFormat::Q5K
                | WeightFormat::Q2K
                | WeightFormat::Q3K
        )
    }

    /// Bytes of one 256-element super-block of a k-quant or of IQ4_XS (0
    /// for the other formats).
    pub fn super_block_bytes(self) -> usize {
        match self {
            WeightFormat::Q6K => crate::quant::Q6_K_BLOCK_BYTES,
            WeightFormat::Q4K => crate::quant::Q4_K_BLOCK_BYTES,
            WeightFormat::Q5K => crate::quant::Q5_K_BLOCK_BYTES,
            WeightFormat::Q2K => crate::quant::Q2_K_BLOCK_BYTES,
            WeightFormat::Q3K => crate::quant::Q3_K_BLOCK_BYTES,
            WeightFormat::Iq4Xs => crate::quant::IQ4_XS_BLOCK_BYTES,
            _ => 0,
        }
    }
}

/// bf16 bits to f32: exact (bf16 is the top half of an f32).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f16 bits to f32: exact.
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// FP8 e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no
/// infinities, S.1111.111 is NaN) to f32, exactly.
pub const fn fp8_e4m3_to_f32_scalar(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        // Subnormal: man/8 * 2^-6.
        sign * man * (1.0 / 512.0)
    } else {
        // (1 + man/8) * 2^(exp-7), built without powi so it stays const.
        let mut scale = 1.0f32;
        let mut e = exp - 7;
        while e > 0 {
            scale *= 2.0;
            e -= 1;
        }
        while e < 0 {
            scale *= 0.5;
            e += 1;
        }
        sign * (1.0 + man / 8.0) * scale
    }
}

const fn build_fp8_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = fp8_e4m3_to_f32_scalar(i as u8);
        i += 1;
    }
    t
}

/// Lookup table of every FP8 e4m3fn value.
pub static FP8_E4M3_TABLE: [f32; 256] = build_fp8_table();

#[inline(always)]
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    FP8_E4M3_TABLE[b as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_matches_known_values() {
        // Values from the OCP FP8 spec (E4M3).
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(fp8_e4m3_to_f32(0x40), 2.0);
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6));
        assert!(fp8_e4m3_to_f32(0x7f).is_nan());
        assert!(fp8_e4m3_to_f32(0xff).is_nan());
    }

    #[test]
    fn fp8_matches_half_crate_bit_building() {
        // Independent construction: every finite e4m3 value is exactly
        // representable in f16 (5-bit exponent), so build f16 bits directly.
        for b in 0u16..256 {
            let v = fp8_e4m3_to_f32(b as u8);
            if v.is_nan() {
                continue;
            }
            let s = (b >> 7) & 1;
            let e = (b >> 3) & 0xf;
            let m = b & 7;
            let h = if e == 0 {
                // subnormal e4m3 -> normal or subnormal f16 via value
                half::f16::from_f32(v).to_bits()
            } else {
                (s << 15) | ((e + 8) << 10) | (m << 7)
            };
            assert_eq!(half::f16::from_bits(h).to_f32(), v, "byte {b:#x}");
        }
    }

    #[test]
    fn bf16_and_f16_widen_exactly() {
        for v in [1.5f32, -3.25, 65504.0, 1e-3, 0.0] {
            let b = half::bf16::from_f32(v);
            assert_eq!(bf16_to_f32(b.to_bits()), b.to_f32());
            let h = half::f16::from_f32(v);
            assert_eq!(f16_to_f32(h.to_bits()), h.to_f32());
        }
    }
}
